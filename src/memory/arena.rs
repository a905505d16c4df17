//! The bookkeeping of a caching allocator, with no device in it: segments split into blocks,
//! best-fit reuse, coalescing, and stream-ordered reuse. Pure data, so it is property-tested
//! against a reference model.
//!
//! Segments are fixed (one device allocation each) or expandable: an address range of which a
//! prefix is mapped, grown at its end by [`Arena::grow`] when no free block fits, and shrunk by
//! [`Arena::shrink`] when its end is free (Note [Expandable segments] in `allocator.rs`).
//!
//! Lent segments ([`Arena::add_lent`]) are memory that another owner lends to the arena for a
//! while (a graph pool borrowing the parameters' gradients, Note [Lent gradients] in
//! `graph/lend.rs`): their blocks are handed out only by [`Arena::alloc_lent`], to the requests
//! the caller allows, they count in neither `allocated` nor `reserved` (their owner's arena
//! counts the bytes), and they are never released to the device, only given back whole
//! ([`Arena::remove_lent`]).
//!
//! Stream-ordered reuse: a block freed by stream S may be reused at once by S (its queue orders
//! the new use after the old one), but by another stream only after the allocator has seen an
//! ordering — [`Arena::mark_ordered`] after S was synchronized or joined — because that stream's
//! work could otherwise still be reading the block.

use std::collections::{BTreeMap, BTreeSet};

/// Every block starts on a multiple of this many bytes, as `cudaMalloc` guarantees.
pub const ALIGN: usize = 256;
/// A split leaves a remainder only if it is at least this large.
const MIN_SPLIT: usize = 512;
/// Requests up to this size share 2 MiB segments of their own, expandable arenas included: a
/// small request never splits a larger block, whose remainder a later request of the larger
/// size could not use (PyTorch's small pool; Note [Small segments]).
const SMALL: usize = 1 << 20;
const SMALL_SEGMENT: usize = 2 << 20;
/// Requests under this size share 20 MiB segments; larger ones get their own.
const MEDIUM: usize = 10 << 20;
const MEDIUM_SEGMENT: usize = 20 << 20;

/// Identity of a segment: one device allocation.
pub type SegmentId = u64;

/// A stream, as the arena knows it.
pub type StreamKey = u64;

/// Who may reuse a free block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FreeTag {
    /// Only the stream that freed it (until an ordering is seen).
    Stream(StreamKey),
    /// Any stream.
    Any,
}

/// The state of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out, last used on this stream.
    Used(StreamKey),
    /// Free.
    Free(FreeTag),
}

/// One block, as reported by [`Arena::blocks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    /// Its segment.
    pub segment: SegmentId,
    /// Byte offset in the segment.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
    /// Used or free.
    pub state: BlockState,
}

/// Byte counts of an arena (a graph pool, or the cache outside pools), or of a whole allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes in blocks handed out.
    pub allocated: usize,
    /// Bytes of device memory held: whole fixed segments, and the mapped part of expandable ones.
    pub reserved: usize,
    /// Highest `allocated` seen.
    pub peak_allocated: usize,
    /// Highest `reserved` seen.
    pub peak_reserved: usize,
    /// The largest free block in reserved memory: the largest request served without growing.
    pub largest_free: usize,
    /// Bytes in blocks handed out from lent memory ([`Arena::add_lent`]), which `allocated`
    /// leaves out: their owner counts them.
    pub lent: usize,
}

#[derive(Debug)]
struct Segment {
    /// Bytes usable now: blocks cover `[0, size)`.
    size: usize,
    /// Bytes the segment may grow to: its address range if expandable, else `size`.
    capacity: usize,
    expandable: bool,
    /// Holds requests of at most [`SMALL`] bytes only, and only they go there.
    small: bool,
    /// Memory lent by another owner ([`Arena::add_lent`]).
    lent: bool,
    blocks: BTreeMap<usize, (usize, BlockState)>,
}

/// How to grow an expandable segment so that a request fits (see [`Arena::plan_growth`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growth {
    /// The segment.
    pub segment: SegmentId,
    /// Its usable size after growing.
    pub size: usize,
    /// Who may reuse the new bytes: the tag of the free tail they extend, so that the two merge.
    tag: FreeTag,
}

/// A free block's key: (tag, size, segment, offset), ordered for best fit.
type FreeKey = (FreeTag, usize, SegmentId, usize);

/// Segments and blocks of one pool.
#[derive(Debug, Default)]
pub struct Arena {
    segments: BTreeMap<SegmentId, Segment>,
    /// Free blocks of the arena's own segments, for best fit.
    free: BTreeSet<FreeKey>,
    /// Free blocks of lent segments, apart so that only [`Arena::alloc_lent`] sees them.
    lent_free: BTreeSet<FreeKey>,
    stats: Stats,
}

/// Rounds a request to the block size the arena hands out.
pub fn block_size(bytes: usize) -> usize {
    bytes.max(1).div_ceil(ALIGN) * ALIGN
}

/// Whether a request of `bytes` is small: served only by small segments, which only it uses.
pub fn is_small(bytes: usize) -> bool {
    block_size(bytes) <= SMALL
}

/// The size of the segment to allocate when no free block fits `block` bytes.
pub fn segment_size(block: usize) -> usize {
    if block <= SMALL {
        SMALL_SEGMENT
    } else if block < MEDIUM {
        MEDIUM_SEGMENT
    } else {
        block.div_ceil(SMALL_SEGMENT) * SMALL_SEGMENT
    }
}

impl Arena {
    /// An empty arena.
    pub fn new() -> Arena {
        Arena::default()
    }

    /// Bytes in blocks handed out now (`stats().allocated`, without the free list's scan).
    pub(crate) fn allocated(&self) -> usize {
        self.stats.allocated
    }

    /// Bytes of its segments (`stats().reserved`, without the free list's scan).
    pub(crate) fn reserved(&self) -> usize {
        self.stats.reserved
    }

    /// The highest `allocated` seen.
    pub(crate) fn peak_allocated(&self) -> usize {
        self.stats.peak_allocated
    }

    /// The largest block [`alloc`](Arena::alloc) could hand `stream` now without a new segment
    /// or growth, for a request that is not small ([`is_small`]): the largest free block of its own
    /// or free to any stream, outside small segments.
    pub fn largest_free_for(&self, stream: StreamKey) -> usize {
        self.largest_free_in(stream, false)
    }

    /// As [`largest_free_for`](Arena::largest_free_for), in small segments (`small`) or the
    /// others.
    fn largest_free_in(&self, stream: StreamKey, small: bool) -> usize {
        let largest = |tag| {
            let tagged = (tag, 0, 0, 0)..=(tag, usize::MAX, SegmentId::MAX, usize::MAX);
            self.free.range(tagged).rev().find(|k| self.segments[&k.2].small == small).map_or(0, |k| k.1)
        };
        largest(FreeTag::Stream(stream)).max(largest(FreeTag::Any))
    }

    /// Byte counts.
    pub fn stats(&self) -> Stats {
        Stats { largest_free: self.free.iter().map(|k| k.1).max().unwrap_or(0), ..self.stats }
    }

    /// Every block, by segment and offset.
    pub fn blocks(&self) -> Vec<BlockInfo> {
        self.segments
            .iter()
            .flat_map(|(id, s)| {
                s.blocks.iter().map(move |(off, (size, state))| BlockInfo {
                    segment: *id,
                    offset: *off,
                    size: *size,
                    state: *state,
                })
            })
            .collect()
    }

    /// Adds a fixed segment of `size` bytes (a multiple of [`ALIGN`]), all free to any stream: a
    /// small segment, for small requests only, if `size` is at most the 2 MiB that
    /// [`segment_size`] gives them.
    pub fn add_segment(&mut self, id: SegmentId, size: usize) {
        let mut blocks = BTreeMap::new();
        blocks.insert(0, (size, BlockState::Free(FreeTag::Any)));
        let small = size <= SMALL_SEGMENT;
        self.segments.insert(id, Segment { size, capacity: size, expandable: false, small, lent: false, blocks });
        self.free.insert((FreeTag::Any, size, id, 0));
        self.note_reserved(size);
    }

    /// Adds an expandable segment that may grow to `capacity` bytes, with nothing usable yet.
    pub fn add_expandable(&mut self, id: SegmentId, capacity: usize) {
        let segment =
            Segment { size: 0, capacity, expandable: true, small: false, lent: false, blocks: BTreeMap::new() };
        self.segments.insert(id, segment);
    }

    /// Adds `size` bytes (a multiple of [`ALIGN`]) that another owner lends to the arena, free
    /// to any stream: handed out only by [`alloc_lent`](Arena::alloc_lent), counted in neither
    /// `allocated` nor `reserved`, never released by [`release_empty`](Arena::release_empty).
    pub fn add_lent(&mut self, id: SegmentId, size: usize) {
        let mut blocks = BTreeMap::new();
        blocks.insert(0, (size, BlockState::Free(FreeTag::Any)));
        self.segments.insert(id, Segment { size, capacity: size, expandable: false, small: false, lent: true, blocks });
        self.lent_free.insert((FreeTag::Any, size, id, 0));
    }

    /// Gives a lent segment back to its owner, if none of its blocks is handed out (returns
    /// whether it did). The caller knows that no graph that may run still uses its blocks.
    pub fn remove_lent(&mut self, id: SegmentId) -> bool {
        let Some(seg) = self.segments.get(&id).filter(|s| s.lent) else { return false };
        if seg.blocks.values().any(|(_, state)| matches!(state, BlockState::Used(_))) {
            return false;
        }
        let keys: Vec<FreeKey> = seg
            .blocks
            .iter()
            .filter_map(|(off, (size, state))| match state {
                BlockState::Free(tag) => Some((*tag, *size, id, *off)),
                BlockState::Used(_) => None,
            })
            .collect();
        for key in keys {
            self.lent_free.remove(&key);
        }
        self.segments.remove(&id);
        true
    }

    /// Whether `segment` is lent memory ([`add_lent`](Arena::add_lent)).
    pub fn is_lent(&self, segment: SegmentId) -> bool {
        self.segments.get(&segment).is_some_and(|s| s.lent)
    }

    fn note_reserved(&mut self, added: usize) {
        self.stats.reserved += added;
        self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
    }

    /// How to grow an expandable segment, in multiples of `step` bytes (a multiple of
    /// [`ALIGN`]), so that [`alloc`](Arena::alloc)`(bytes, stream)` then succeeds: the segment
    /// whose growth is the smallest, counting a free tail that `stream` may reuse as part of the
    /// request. `None` if no expandable segment has room, or for a small request (it takes a
    /// small segment: [`is_small`]).
    pub fn plan_growth(&self, bytes: usize, stream: StreamKey, step: usize) -> Option<Growth> {
        if is_small(bytes) {
            return None;
        }
        let size = block_size(bytes);
        self.segments
            .iter()
            .filter(|(_, s)| s.expandable)
            .filter_map(|(&segment, s)| {
                let tail = match s.blocks.iter().next_back() {
                    Some((&off, &(_, BlockState::Free(tag))))
                        if tag == FreeTag::Any || tag == FreeTag::Stream(stream) =>
                    {
                        Some((off, tag))
                    }
                    _ => None,
                };
                let (start, tag) = tail.unwrap_or((s.size, FreeTag::Any));
                let new_size = (start + size).div_ceil(step) * step;
                (new_size <= s.capacity).then_some(Growth { segment, size: new_size, tag })
            })
            .min_by_key(|g| g.size - self.segments[&g.segment].size)
    }

    /// Grows a segment as `growth` says, after the device mapped the new bytes. The new bytes
    /// join the segment's free tail if it has one of the same tag.
    pub fn grow(&mut self, growth: Growth) {
        let Some(seg) = self.segments.get_mut(&growth.segment) else { return };
        let old = seg.size;
        if growth.size <= old {
            return;
        }
        seg.size = growth.size;
        self.insert_free(growth.segment, old, growth.size - old, growth.tag);
        self.note_reserved(growth.size - old);
    }

    /// Sets the usable size of an expandable segment to `size`, what the device reports mapped
    /// after a mapping or unmapping call failed partway: new bytes are free to any stream, and
    /// only a free tail is given up.
    pub fn track_mapped(&mut self, segment: SegmentId, size: usize) {
        match self.segments.get(&segment) {
            Some(s) if s.expandable && size > s.size => self.grow(Growth { segment, size, tag: FreeTag::Any }),
            Some(s) if s.expandable && size < s.size => {
                self.shrink(segment, size);
            }
            _ => {}
        }
    }

    /// The expandable segments whose end is free to any stream, each with the size it may
    /// shrink to: its last used byte rounded up to `step`. Changes nothing: the caller unmaps
    /// the bytes beyond that size, then calls [`shrink`](Arena::shrink).
    pub fn free_tails(&self, step: usize) -> Vec<(SegmentId, usize)> {
        self.segments
            .iter()
            .filter(|(_, s)| s.expandable)
            .filter_map(|(&id, s)| match s.blocks.iter().next_back() {
                Some((&off, &(_, BlockState::Free(FreeTag::Any)))) => {
                    let keep = off.div_ceil(step) * step;
                    (keep < s.size).then_some((id, keep))
                }
                _ => None,
            })
            .collect()
    }

    /// Shrinks an expandable segment to `size` bytes, after the device unmapped the rest. Only
    /// a free tail (to any stream) is given up: a size that would cut into another block is
    /// refused (returns false).
    pub fn shrink(&mut self, segment: SegmentId, size: usize) -> bool {
        let Some(seg) = self.segments.get_mut(&segment) else { return false };
        let Some((&off, &(tail, state))) = seg.blocks.iter().next_back() else { return false };
        if !seg.expandable || state != BlockState::Free(FreeTag::Any) || size < off || size >= seg.size {
            return false;
        }
        let given = seg.size - size;
        seg.size = size;
        seg.blocks.remove(&off);
        self.free.remove(&(FreeTag::Any, tail, segment, off));
        if size > off {
            self.segments.get_mut(&segment).expect("found above").blocks.insert(off, (size - off, state));
            self.free.insert((FreeTag::Any, size - off, segment, off));
        }
        self.stats.reserved -= given;
        true
    }

    /// The best fit for `size` bytes on `stream` among `set`'s blocks of segments `allowed`:
    /// the smallest of the stream's own and those free to any stream.
    fn best_fit(
        set: &BTreeSet<FreeKey>,
        stream: StreamKey,
        size: usize,
        allowed: &dyn Fn(SegmentId) -> bool,
    ) -> Option<FreeKey> {
        let fit = |tag| {
            set.range((tag, size, 0, 0)..=(tag, usize::MAX, SegmentId::MAX, usize::MAX)).find(|k| allowed(k.2)).copied()
        };
        match (fit(FreeTag::Stream(stream)), fit(FreeTag::Any)) {
            (Some(a), Some(b)) => Some(if a.1 <= b.1 { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    /// Hands out a block of `block_size(bytes)` for `stream`, or `None` if no free block fits
    /// (then grow an expandable segment or add a segment of `segment_size`, always the latter
    /// for a small request, and ask again). Returns (segment, offset, size). A small request
    /// ([`is_small`]) takes a block of a small segment, any other never does; lent segments are
    /// left to [`alloc_lent`](Arena::alloc_lent).
    pub fn alloc(&mut self, bytes: usize, stream: StreamKey) -> Option<(SegmentId, usize, usize)> {
        let (size, small) = (block_size(bytes), is_small(bytes));
        let segments = &self.segments;
        let chosen = Arena::best_fit(&self.free, stream, size, &|s| segments[&s].small == small)?;
        Some(self.take(chosen, size, stream))
    }

    /// As [`alloc`](Arena::alloc), from lent segments for which `allowed` holds only, or `None`.
    pub fn alloc_lent(
        &mut self,
        bytes: usize,
        stream: StreamKey,
        allowed: &dyn Fn(SegmentId) -> bool,
    ) -> Option<(SegmentId, usize, usize)> {
        let size = block_size(bytes);
        let chosen = Arena::best_fit(&self.lent_free, stream, size, allowed)?;
        Some(self.take(chosen, size, stream))
    }

    /// Hands out `size` bytes of the free block `chosen` for `stream`, splitting off the rest.
    fn take(&mut self, chosen: FreeKey, size: usize, stream: StreamKey) -> (SegmentId, usize, usize) {
        let (tag, found, seg, off) = chosen;
        let segment = self.segments.get_mut(&seg).expect("free blocks belong to segments");
        let free = if segment.lent { &mut self.lent_free } else { &mut self.free };
        free.remove(&chosen);
        let taken = if found - size >= MIN_SPLIT {
            segment.blocks.insert(off + size, (found - size, BlockState::Free(tag)));
            free.insert((tag, found - size, seg, off + size));
            size
        } else {
            found
        };
        segment.blocks.insert(off, (taken, BlockState::Used(stream)));
        if segment.lent {
            self.stats.lent += taken;
        } else {
            self.stats.allocated += taken;
            self.stats.peak_allocated = self.stats.peak_allocated.max(self.stats.allocated);
        }
        (seg, off, taken)
    }

    /// Records that the used block at (`segment`, `offset`) is now used on `stream` as well;
    /// it will be reusable only by that stream (or after an ordering).
    pub fn record_use(&mut self, segment: SegmentId, offset: usize, stream: StreamKey) -> bool {
        match self.segments.get_mut(&segment).and_then(|s| s.blocks.get_mut(&offset)) {
            Some((_, state @ BlockState::Used(_))) => {
                *state = BlockState::Used(stream);
                true
            }
            _ => false,
        }
    }

    /// Frees the used block at (`segment`, `offset`), reusable by the stream it was allocated
    /// for. Returns false if there is no such block.
    pub fn free(&mut self, segment: SegmentId, offset: usize) -> bool {
        self.free_with(segment, offset, None)
    }

    /// Frees the used block at (`segment`, `offset`), reusable by `tag` (the stream that used it
    /// last, or any stream if none did); `None` means the stream it was allocated for.
    pub fn free_with(&mut self, segment: SegmentId, offset: usize, tag: Option<FreeTag>) -> bool {
        let Some(seg) = self.segments.get_mut(&segment) else { return false };
        let Some(&(size, BlockState::Used(stream))) = seg.blocks.get(&offset) else { return false };
        seg.blocks.remove(&offset);
        match seg.lent {
            true => self.stats.lent -= size,
            false => self.stats.allocated -= size,
        }
        self.insert_free(segment, offset, size, tag.unwrap_or(FreeTag::Stream(stream)));
        true
    }

    /// Inserts a free block and merges it with free neighbours of the same tag.
    fn insert_free(&mut self, segment: SegmentId, mut offset: usize, mut size: usize, tag: FreeTag) {
        let seg = self.segments.get_mut(&segment).expect("caller checked");
        let free = if seg.lent { &mut self.lent_free } else { &mut self.free };
        let blocks = &mut seg.blocks;
        if let Some((&prev_off, &(prev_size, BlockState::Free(t)))) = blocks.range(..offset).next_back() {
            if t == tag && prev_off + prev_size == offset {
                blocks.remove(&prev_off);
                free.remove(&(tag, prev_size, segment, prev_off));
                offset = prev_off;
                size += prev_size;
            }
        }
        if let Some(&(next_size, BlockState::Free(t))) = blocks.get(&(offset + size)) {
            if t == tag {
                blocks.remove(&(offset + size));
                free.remove(&(tag, next_size, segment, offset + size));
                size += next_size;
            }
        }
        blocks.insert(offset, (size, BlockState::Free(tag)));
        free.insert((tag, size, segment, offset));
    }

    /// The allocator has seen that everything `stream` freed so far is ordered before any later
    /// work of any stream (the stream was synchronized, or every stream joined it): its free
    /// blocks become reusable by all.
    pub fn mark_ordered(&mut self, stream: StreamKey) {
        let tag = FreeTag::Stream(stream);
        let range = (tag, 0, 0, 0)..=(tag, usize::MAX, SegmentId::MAX, usize::MAX);
        let moved: Vec<FreeKey> = self.free.range(range.clone()).chain(self.lent_free.range(range)).copied().collect();
        for key @ (_, size, seg, off) in moved {
            self.free.remove(&key);
            self.lent_free.remove(&key);
            self.segments.get_mut(&seg).expect("free blocks belong to segments").blocks.remove(&off);
            self.insert_free(seg, off, size, FreeTag::Any);
        }
    }

    /// Every free block becomes reusable by all streams (the device was synchronized).
    pub fn mark_all_ordered(&mut self) {
        let tags: BTreeSet<FreeTag> =
            self.free.iter().chain(&self.lent_free).map(|k| k.0).filter(|t| *t != FreeTag::Any).collect();
        for tag in tags {
            if let FreeTag::Stream(s) = tag {
                self.mark_ordered(s);
            }
        }
    }

    /// Removes the fixed segments that are entirely free to any stream and returns them, for
    /// the caller to release to the device. Expandable segments shrink instead
    /// ([`free_tails`](Arena::free_tails)).
    pub fn release_empty(&mut self) -> Vec<(SegmentId, usize)> {
        let empty: Vec<(SegmentId, usize)> = self
            .segments
            .iter()
            .filter(|(_, s)| {
                !s.expandable
                    && !s.lent
                    && matches!(s.blocks.get(&0), Some(&(size, BlockState::Free(FreeTag::Any))) if size == s.size)
            })
            .map(|(id, s)| (*id, s.size))
            .collect();
        for (id, size) in &empty {
            self.segments.remove(id);
            self.free.remove(&(FreeTag::Any, *size, *id, 0));
            self.stats.reserved -= size;
        }
        empty
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn split_reuse_and_coalesce() {
        let mut a = Arena::new();
        assert_eq!(a.alloc(100, 1), None);
        a.add_segment(7, 4096);
        let (s, x, n) = a.alloc(100, 1).unwrap();
        assert_eq!((s, x, n), (7, 0, 256), "rounded to the alignment, split from the front");
        let (_, y, _) = a.alloc(1000, 1).unwrap();
        assert_eq!(y, 256);
        assert!(a.free(7, x) && a.free(7, y));
        assert!(!a.free(7, y), "double free is refused");
        assert_eq!(a.stats().allocated, 0);
        assert_eq!(a.alloc(3000, 2), None, "blocks freed on stream 1 are not reused by stream 2 before an ordering");
        a.mark_ordered(1);
        assert_eq!(a.blocks().len(), 1, "all coalesced into one free block");
        assert_eq!(a.alloc(3000, 2).map(|b| b.1), Some(0));
        assert_eq!(a.stats().peak_allocated, 3072);
    }

    #[test]
    fn an_expandable_segment_grows_through_its_free_tail_and_gives_it_back() {
        const MIB: usize = 1 << 20;
        let mut a = Arena::new();
        a.add_expandable(1, 1 << 40);
        assert_eq!(a.alloc(100, 0), None, "nothing is usable before the first growth");
        // Thirty-two 32 MiB blocks, all freed: fixed segments would keep them as 32 MiB pieces.
        let grow = |a: &mut Arena, bytes: usize| {
            let g = a.plan_growth(bytes, 0, 2 * MIB).expect("the range has room");
            a.grow(g);
            a.alloc(bytes, 0).expect("the grown segment fits")
        };
        let small: Vec<_> = (0..32).map(|_| grow(&mut a, 32 * MIB)).collect();
        assert_eq!(a.stats().reserved, 1024 * MIB);
        for (seg, off, _) in &small {
            assert!(a.free(*seg, *off));
        }
        assert_eq!(a.stats().largest_free, 1024 * MIB, "neighbours coalesce into one range");
        let (_, off, _) = a.alloc(1024 * MIB, 0).expect("the freed range serves the larger request");
        assert_eq!((off, a.stats().reserved), (0, 1024 * MIB), "reserved did not grow");
        assert!(a.free(1, 0));
        // A request larger than the free tail maps only the difference after it.
        let (_, off, _) = grow(&mut a, 1280 * MIB);
        assert_eq!((off, a.stats().reserved), (0, 1280 * MIB));
        assert!(a.free(1, 0));
        let (_, low, _) = a.alloc(8 * MIB, 0).unwrap();
        assert_eq!(a.free_tails(2 * MIB), vec![], "the tail was freed by stream 0 and is not ordered yet");
        a.mark_ordered(0);
        assert_eq!(a.free_tails(2 * MIB), vec![(1, 8 * MIB)], "the free tail past the used block goes back");
        assert!(!a.shrink(1, 4 * MIB), "a used block is never cut");
        assert!(a.shrink(1, 8 * MIB));
        assert_eq!((a.stats().reserved, a.stats().peak_reserved), (8 * MIB, 1280 * MIB));
        assert!(a.free(1, low));
        a.mark_ordered(0);
        assert!(a.shrink(1, 0));
        assert_eq!((a.stats().reserved, a.blocks().len()), (0, 0));
    }

    #[test]
    fn growth_skips_a_tail_another_stream_freed() {
        const MIB: usize = 1 << 20;
        let mut a = Arena::new();
        a.add_expandable(1, 1 << 30);
        let g = a.plan_growth(2 * MIB, 7, MIB).unwrap();
        a.grow(g);
        let (_, off, _) = a.alloc(2 * MIB, 7).unwrap();
        assert!(a.free(1, off));
        let g = a.plan_growth(4 * MIB, 8, MIB).unwrap();
        assert_eq!(g.size, 6 * MIB, "stream 8 may not reuse stream 7's tail, so it maps after it");
        a.grow(g);
        assert_eq!(a.alloc(4 * MIB, 8).map(|b| b.1), Some(2 * MIB));
        assert_eq!(a.plan_growth(1 << 30, 8, MIB), None, "no room left in the range");
    }

    #[test]
    fn small_requests_take_small_segments_only_and_never_split_a_large_block() {
        const MIB: usize = 1 << 20;
        let mut a = Arena::new();
        a.add_expandable(1, 1 << 30);
        a.grow(a.plan_growth(32 * MIB, 0, 2 * MIB).unwrap());
        let (_, big, _) = a.alloc(32 * MIB, 0).unwrap();
        assert!(a.free(1, big));
        assert_eq!(a.plan_growth(MIB, 0, 2 * MIB), None, "a small request never grows the range");
        assert_eq!(a.alloc(MIB, 0), None, "nor takes a piece of the freed 32 MiB");
        a.add_segment(2, segment_size(block_size(MIB)));
        assert_eq!(a.alloc(MIB, 0).map(|b| b.0), Some(2));
        assert_eq!(a.alloc(MIB + 1, 0).map(|b| b.0), Some(1), "a larger one never takes a small segment");
        assert_eq!(a.alloc(32 * MIB, 0), None, "the large block was split by the larger request only");
        assert_eq!(
            a.largest_free_for(0),
            32 * MIB - block_size(MIB + 1),
            "small segments are not room for large requests"
        );
    }

    #[test]
    fn lent_memory_serves_only_the_requests_allowed_and_goes_back_whole() {
        let mut a = Arena::new();
        a.add_segment(1, 4096);
        a.add_lent(2, 8192);
        a.add_lent(3, 8192);
        assert_eq!(a.alloc(6000, 0), None, "plain requests never see lent memory");
        assert_eq!(a.alloc_lent(6000, 0, &|s| s == 3).map(|b| b.0), Some(3));
        assert_eq!(a.alloc_lent(6000, 0, &|s| s == 3), None, "segment 3 is taken and 2 is not allowed");
        let (seg, off, size) = a.alloc_lent(100, 0, &|_| true).expect("fits the rest of segment 3");
        assert_eq!((seg, off, size), (3, 6144, 256), "best fit: the smallest free block allowed");
        let st = a.stats();
        assert_eq!((st.allocated, st.reserved, st.lent), (0, 4096, 6400), "lent bytes count apart");
        assert_eq!(st.largest_free, 4096, "lent free blocks serve no plain request");
        assert!(!a.remove_lent(3), "a block of it is handed out");
        assert!(a.free(3, off) && a.free(3, 0));
        assert_eq!(a.release_empty(), vec![(1, 4096)], "lent segments are never released to the device");
        a.mark_ordered(0);
        assert!(a.remove_lent(3) && a.remove_lent(2));
        assert!(!a.remove_lent(2), "given back once");
        assert_eq!((a.stats(), a.blocks().len()), (Stats { peak_reserved: 4096, ..Stats::default() }, 0));
    }

    #[test]
    fn segment_sizes_follow_the_request() {
        assert_eq!(segment_size(block_size(1)), 2 << 20);
        assert_eq!(segment_size(block_size(3 << 20)), 20 << 20);
        assert_eq!(segment_size(block_size(11 << 20)), 12 << 20);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Alloc { bytes: usize, stream: u64 },
        Free { pick: usize },
        Ordered { stream: u64 },
        Release,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => (1usize..40_000, 0u64..3).prop_map(|(bytes, stream)| Step::Alloc { bytes, stream }),
            2 => (SMALL - 20_000..SMALL + 60_000, 0u64..3).prop_map(|(bytes, stream)| Step::Alloc { bytes, stream }),
            3 => any::<usize>().prop_map(|pick| Step::Free { pick }),
            1 => (0u64..3).prop_map(|stream| Step::Ordered { stream }),
            1 => Just(Step::Release),
        ]
    }

    /// The reference model: live blocks, and for each byte range freed on a stream and not yet
    /// ordered, which stream may reuse it.
    #[derive(Default)]
    struct Model {
        live: Vec<(SegmentId, usize, usize, u64)>,
        unordered: Vec<(SegmentId, usize, usize, u64)>,
        segments: BTreeMap<SegmentId, usize>,
        next_fixed: SegmentId,
    }

    /// The request's block, after growing the expandable segment or adding a fixed one if no
    /// free block fits.
    fn alloc_growing(
        a: &mut Arena,
        m: &mut Model,
        expandable: bool,
        bytes: usize,
        stream: u64,
    ) -> Result<(SegmentId, usize, usize), TestCaseError> {
        if let Some(b) = a.alloc(bytes, stream) {
            return Ok(b);
        }
        if expandable && !is_small(bytes) {
            let g = a.plan_growth(bytes, stream, STEP).expect("the range is large enough");
            prop_assert!(g.size.is_multiple_of(STEP) && g.size > m.segments[&g.segment]);
            a.grow(g);
            m.segments.insert(g.segment, g.size);
        } else {
            m.next_fixed += 1;
            let id = m.next_fixed;
            let size = segment_size(block_size(bytes));
            a.add_segment(id, size);
            m.segments.insert(id, size);
        }
        Ok(a.alloc(bytes, stream).expect("the grown arena fits the request"))
    }

    const STEP: usize = 8192;

    proptest! {
        #[test]
        fn arena_matches_the_model(expandable: bool, steps in proptest::collection::vec(step(), 1..120)) {
            let mut a = Arena::new();
            let mut m = Model::default();
            if expandable {
                a.add_expandable(0, 1 << 30);
                m.segments.insert(0, 0);
            }
            for s in steps {
                match s {
                    Step::Alloc { bytes, stream } => {
                        let (room, reserved) = (a.largest_free_in(stream, is_small(bytes)), a.stats().reserved);
                        let (seg, off, size) = alloc_growing(&mut a, &mut m, expandable, bytes, stream)?;
                        prop_assert_eq!(a.stats().reserved > reserved, block_size(bytes) > room, "largest_free_for({}) = {} and {} bytes", stream, room, bytes);
                        prop_assert!(size >= bytes && off % ALIGN == 0 && off + size <= m.segments[&seg]);
                        prop_assert_eq!(a.segments[&seg].small, is_small(bytes), "a request of the other class's segment");
                        for (s2, o2, n2, _) in &m.live {
                            prop_assert!(*s2 != seg || off + size <= *o2 || o2 + n2 <= off, "overlaps a live block");
                        }
                        for (s2, o2, n2, freer) in &m.unordered {
                            let overlaps = *s2 == seg && off < o2 + n2 && *o2 < off + size;
                            prop_assert!(!overlaps || *freer == stream, "reused by stream {stream} memory freed on {freer} without an ordering");
                        }
                        m.live.push((seg, off, size, stream));
                    }
                    Step::Free { pick } => {
                        if !m.live.is_empty() {
                            let (seg, off, size, stream) = m.live.swap_remove(pick % m.live.len());
                            prop_assert!(a.free(seg, off));
                            m.unordered.push((seg, off, size, stream));
                        }
                    }
                    Step::Ordered { stream } => {
                        a.mark_ordered(stream);
                        m.unordered.retain(|u| u.3 != stream);
                    }
                    Step::Release => {
                        for (seg, _) in a.release_empty() {
                            prop_assert!(m.live.iter().all(|l| l.0 != seg), "released a segment in use");
                            m.segments.remove(&seg);
                        }
                        for (seg, size) in a.free_tails(STEP) {
                            let used_end = m.live.iter().chain(&m.unordered).filter(|l| l.0 == seg).map(|l| l.1 + l.2).max();
                            prop_assert!(used_end.unwrap_or(0) <= size, "gave up bytes in use or not yet ordered");
                            prop_assert!(a.shrink(seg, size));
                            m.segments.insert(seg, size);
                        }
                    }
                }
                let st = a.stats();
                prop_assert_eq!(st.allocated, m.live.iter().map(|l| l.2).sum::<usize>());
                prop_assert_eq!(st.reserved, m.segments.values().sum::<usize>());
                prop_assert!(st.peak_allocated >= st.allocated && st.peak_reserved >= st.reserved);
                prop_assert!(st.largest_free <= st.reserved - st.allocated);
            }
            for (seg, off, _, _) in std::mem::take(&mut m.live) {
                prop_assert!(a.free(seg, off));
            }
            for stream in 0..3 {
                a.mark_ordered(stream);
            }
            let fixed = m.segments.len() - usize::from(expandable);
            prop_assert_eq!(a.release_empty().len(), fixed, "everything coalesces back into whole segments");
            if expandable {
                for (seg, size) in a.free_tails(STEP) {
                    prop_assert!(size == 0 && a.shrink(seg, size), "an idle segment shrinks to nothing");
                }
            }
            prop_assert_eq!(a.stats().reserved, 0);
        }
    }
}
