//! The bookkeeping of a caching allocator, with no device in it: segments split into blocks,
//! best-fit reuse, coalescing, and stream-ordered reuse. Pure data, so it is property-tested
//! against a reference model.
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
/// Requests up to this size share 2 MiB segments.
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

/// Byte counts of an arena.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes in blocks handed out.
    pub allocated: usize,
    /// Bytes in segments.
    pub reserved: usize,
    /// Highest `allocated` seen.
    pub peak_allocated: usize,
    /// Highest `reserved` seen.
    pub peak_reserved: usize,
}

#[derive(Debug)]
struct Segment {
    size: usize,
    blocks: BTreeMap<usize, (usize, BlockState)>,
}

/// Segments and blocks of one pool.
#[derive(Debug, Default)]
pub struct Arena {
    segments: BTreeMap<SegmentId, Segment>,
    /// Free blocks by (tag, size, segment, offset), for best fit.
    free: BTreeSet<(FreeTag, usize, SegmentId, usize)>,
    stats: Stats,
}

/// Rounds a request to the block size the arena hands out.
pub fn block_size(bytes: usize) -> usize {
    bytes.max(1).div_ceil(ALIGN) * ALIGN
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

    /// Byte counts.
    pub fn stats(&self) -> Stats {
        self.stats
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

    /// Adds a segment of `size` bytes (a multiple of [`ALIGN`]), all free to any stream.
    pub fn add_segment(&mut self, id: SegmentId, size: usize) {
        let mut blocks = BTreeMap::new();
        blocks.insert(0, (size, BlockState::Free(FreeTag::Any)));
        self.segments.insert(id, Segment { size, blocks });
        self.free.insert((FreeTag::Any, size, id, 0));
        self.stats.reserved += size;
        self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
    }

    fn best_fit(&self, tag: FreeTag, size: usize) -> Option<(FreeTag, usize, SegmentId, usize)> {
        self.free.range((tag, size, 0, 0)..=(tag, usize::MAX, SegmentId::MAX, usize::MAX)).next().copied()
    }

    /// Hands out a block of `block_size(bytes)` for `stream`, or `None` if no free block fits
    /// (then add a segment of `segment_size` and ask again). Returns (segment, offset, size).
    pub fn alloc(&mut self, bytes: usize, stream: StreamKey) -> Option<(SegmentId, usize, usize)> {
        let size = block_size(bytes);
        let own = self.best_fit(FreeTag::Stream(stream), size);
        let any = self.best_fit(FreeTag::Any, size);
        let chosen = match (own, any) {
            (Some(a), Some(b)) => Some(if a.1 <= b.1 { a } else { b }),
            (a, b) => a.or(b),
        }?;
        let (tag, found, seg, off) = chosen;
        self.free.remove(&chosen);
        let blocks = &mut self.segments.get_mut(&seg).expect("free blocks belong to segments").blocks;
        let taken = if found - size >= MIN_SPLIT {
            blocks.insert(off + size, (found - size, BlockState::Free(tag)));
            self.free.insert((tag, found - size, seg, off + size));
            size
        } else {
            found
        };
        blocks.insert(off, (taken, BlockState::Used(stream)));
        self.stats.allocated += taken;
        self.stats.peak_allocated = self.stats.peak_allocated.max(self.stats.allocated);
        Some((seg, off, taken))
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
        self.stats.allocated -= size;
        self.insert_free(segment, offset, size, tag.unwrap_or(FreeTag::Stream(stream)));
        true
    }

    /// Inserts a free block and merges it with free neighbours of the same tag.
    fn insert_free(&mut self, segment: SegmentId, mut offset: usize, mut size: usize, tag: FreeTag) {
        let blocks = &mut self.segments.get_mut(&segment).expect("caller checked").blocks;
        if let Some((&prev_off, &(prev_size, BlockState::Free(t)))) = blocks.range(..offset).next_back() {
            if t == tag && prev_off + prev_size == offset {
                blocks.remove(&prev_off);
                self.free.remove(&(tag, prev_size, segment, prev_off));
                offset = prev_off;
                size += prev_size;
            }
        }
        if let Some(&(next_size, BlockState::Free(t))) = blocks.get(&(offset + size)) {
            if t == tag {
                blocks.remove(&(offset + size));
                self.free.remove(&(tag, next_size, segment, offset + size));
                size += next_size;
            }
        }
        blocks.insert(offset, (size, BlockState::Free(tag)));
        self.free.insert((tag, size, segment, offset));
    }

    /// The allocator has seen that everything `stream` freed so far is ordered before any later
    /// work of any stream (the stream was synchronized, or every stream joined it): its free
    /// blocks become reusable by all.
    pub fn mark_ordered(&mut self, stream: StreamKey) {
        let tag = FreeTag::Stream(stream);
        let moved: Vec<_> =
            self.free.range((tag, 0, 0, 0)..=(tag, usize::MAX, SegmentId::MAX, usize::MAX)).copied().collect();
        for key @ (_, size, seg, off) in moved {
            self.free.remove(&key);
            self.segments.get_mut(&seg).expect("free blocks belong to segments").blocks.remove(&off);
            self.insert_free(seg, off, size, FreeTag::Any);
        }
    }

    /// Every free block becomes reusable by all streams (the device was synchronized).
    pub fn mark_all_ordered(&mut self) {
        let tags: BTreeSet<FreeTag> = self.free.iter().map(|k| k.0).filter(|t| *t != FreeTag::Any).collect();
        for tag in tags {
            if let FreeTag::Stream(s) = tag {
                self.mark_ordered(s);
            }
        }
    }

    /// Removes the segments that are entirely free to any stream and returns them, for the
    /// caller to release to the device.
    pub fn release_empty(&mut self) -> Vec<(SegmentId, usize)> {
        let empty: Vec<(SegmentId, usize)> = self
            .segments
            .iter()
            .filter(
                |(_, s)| matches!(s.blocks.get(&0), Some(&(size, BlockState::Free(FreeTag::Any))) if size == s.size),
            )
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
            4 => (1usize..40_000, 0u64..3).prop_map(|(bytes, stream)| Step::Alloc { bytes, stream }),
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
    }

    proptest! {
        #[test]
        fn arena_matches_the_model(steps in proptest::collection::vec(step(), 1..120)) {
            let mut a = Arena::new();
            let mut m = Model::default();
            let mut next_seg = 0;
            for s in steps {
                match s {
                    Step::Alloc { bytes, stream } => {
                        let got = match a.alloc(bytes, stream) {
                            Some(b) => b,
                            None => {
                                let size = segment_size(block_size(bytes));
                                a.add_segment(next_seg, size);
                                m.segments.insert(next_seg, size);
                                next_seg += 1;
                                a.alloc(bytes, stream).expect("a fresh segment fits the request")
                            }
                        };
                        let (seg, off, size) = got;
                        prop_assert!(size >= bytes && off % ALIGN == 0 && off + size <= m.segments[&seg]);
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
                    }
                }
                let st = a.stats();
                prop_assert_eq!(st.allocated, m.live.iter().map(|l| l.2).sum::<usize>());
                prop_assert_eq!(st.reserved, m.segments.values().sum::<usize>());
                prop_assert!(st.peak_allocated >= st.allocated && st.peak_reserved >= st.reserved);
            }
            for (seg, off, _, _) in std::mem::take(&mut m.live) {
                prop_assert!(a.free(seg, off));
            }
            for stream in 0..3 {
                a.mark_ordered(stream);
            }
            prop_assert_eq!(a.release_empty().len(), m.segments.len(), "everything coalesces back into whole segments");
            prop_assert_eq!(a.stats().reserved, 0);
        }
    }
}
