//! The caching allocator: device segments split into blocks by an [`Arena`], the same code on
//! both backends (only segment allocation differs), with graph pools for captures.
//!
//! Note [Expandable segments]: with fixed segments, a freed block serves only requests that fit
//! in its own segment, so a pool that freed 32 MiB blocks still needs a new segment for a later
//! 1 GiB request. Where the device has virtual memory management, each arena (the cache, each
//! graph pool) instead reserves one address range as large as the device's memory and maps
//! pages at its end as it needs them, so a free range at the end joins the new pages into one
//! block. Rules that keep it safe:
//! - growth maps new pages after the mapped ones and never moves memory, so the addresses that
//!   captured graphs hold stay valid while their pool grows;
//! - growth during a capture maps in relaxed capture mode, as a new fixed segment is allocated:
//!   mapping is a host action, not captured, and the pages stay mapped for every replay;
//! - pages go back only from a free end (to any stream: its last uses were ordered), only in
//!   [`CachingAllocator::empty_cache`], after a device synchronize and never while a capture of
//!   this allocator is active; a graph pool's end goes back only while no graph of the pool can
//!   run (every executable reset), since replays would touch it.
//!
//! Note [Small segments]: requests of at most 1 MiB take blocks of 2 MiB fixed segments of their
//! own, in expandable arenas too, and only they do (PyTorch's small pool). Otherwise a small
//! request best-fits into a freed large block, and the rest of it no longer serves a later
//! request of the larger size: at L, two 1 MiB blocks at the front of a freed 32 MiB activation
//! left 30 MiB that the next activation could not use, and the offloading pool grew by that much
//! (`bench/results/2026-12-07-h100-offload-trace-741a33b.txt`).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use foldhash::HashMap;

use super::arena::{
    block_size, is_small, segment_size, Arena, BlockInfo, BlockState, FreeTag, SegmentId, Stats, StreamKey,
};
use super::lifetimes::{Learning, Lifetimes, Place};
use super::pool::{GraphPool, Lent, LentRange, PoolGraph, PoolId, PoolState};
use crate::device::memory::{Block, BlockOwner, Fence, MemKind, RawBuffer};
use crate::device::{
    ids, BufferId, Capture, CaptureMode, Device, DeviceBuffer, Elem, EventId, GraphId, Stream, StreamId,
};
use crate::{Error, Result};

/// A stream key for blocks used on several streams: only a full synchronize orders them.
const MANY_STREAMS: StreamKey = u64::MAX;

/// Expandable segments grow and shrink by this many bytes (rounded up to the device's
/// granularity): PyTorch's small-segment size, which keeps the number of mappings of a large
/// pool in the thousands while returning memory at a fine grain.
const CHUNK: usize = 2 << 20;

/// The environment variable that turns expandable segments off (`0`) or on where supported
/// (`1`) for allocators whose [`AllocatorConfig`] does not say.
pub const EXPANDABLE_ENV: &str = "GRAPHED_EXPANDABLE";

/// Byte counts of the allocator: in total, outside pools, and per pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryStats {
    /// Everything. Its peaks are the peaks of the sums (not the sums of the arenas' peaks), a
    /// pool counted at its capture peak whenever one of its graphs is launched (a replay
    /// re-enacts the capture beside what the cache holds then), and its `largest_free` the
    /// largest of any arena.
    pub total: Stats,
    /// Blocks allocated outside captures.
    pub default: Stats,
    /// Each graph pool.
    pub pools: Vec<(PoolId, Stats)>,
    /// Whether segments are expandable (Note [Expandable segments]).
    pub expandable: bool,
}

/// How a [`CachingAllocator`] gets and hands out memory.
///
/// ```
/// use graphed::device::Device;
/// use graphed::memory::{AllocatorConfig, CachingAllocator};
///
/// let dev = Device::sim();
/// let alloc = CachingAllocator::with_config(&dev, AllocatorConfig::default().expandable(false))?;
/// assert!(!alloc.stats().expandable);
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorConfig {
    poison: bool,
    expandable: Option<bool>,
}

impl AllocatorConfig {
    /// Fill every block handed out with 0xFF bytes (see [`CachingAllocator::with_poison`]).
    pub fn poison(self, on: bool) -> AllocatorConfig {
        AllocatorConfig { poison: on, ..self }
    }

    /// Expandable segments (Note [Expandable segments]) on or off. Unless set, they are on where
    /// the device supports them and the environment variable `GRAPHED_EXPANDABLE` is not `0`;
    /// set on, a device without them is an error.
    pub fn expandable(self, on: bool) -> AllocatorConfig {
        AllocatorConfig { expandable: Some(on), ..self }
    }
}

/// How expandable segments are sized.
#[derive(Debug, Clone, Copy)]
struct Expandable {
    /// Bytes per mapping: growth and shrinking come in multiples of it.
    chunk: usize,
    /// Bytes of address range per segment: the device's memory, so one segment serves an arena.
    range: usize,
}

/// Whether to use expandable segments on `dev`, and their sizes.
fn expandable_on(dev: &Device, asked: Option<bool>) -> Result<Option<Expandable>> {
    const OP: &str = "CachingAllocator::with_config";
    let wanted = asked.or_else(|| match std::env::var(EXPANDABLE_ENV).as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    });
    if wanted == Some(false) {
        return Ok(None);
    }
    let sizes = dev.vm_layout().map(|layout| {
        let (granularity, total) = layout.filter(|(g, _)| *g > 0)?;
        let chunk = CHUNK.div_ceil(granularity) * granularity;
        Some(Expandable { chunk, range: total.div_ceil(chunk).max(1) * chunk })
    });
    match (sizes, asked) {
        (Ok(Some(x)), _) => Ok(Some(x)),
        (Err(e), Some(true)) => Err(e),
        (Ok(None), Some(true)) => Err(Error::Unsupported {
            op: OP,
            backend: "cuda",
            why: "this driver or GPU has no virtual memory management, which expandable segments need; use AllocatorConfig::expandable(false)",
        }),
        // Asked for by default or by the environment only: fixed segments serve as before.
        _ => Ok(None),
    }
}

/// One block of [`CachingAllocator::blocks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockEntry {
    /// Its pool; `None` outside pools.
    pub pool: Option<PoolId>,
    /// Segment, offset, size, state.
    pub info: BlockInfo,
    /// The buffer holding it, if handed out.
    pub buffer: Option<BufferId>,
    /// Whether it is memory lent to its pool (the parameters' gradients a graphed stack lends).
    pub lent: bool,
}

/// A caching allocator over one device's memory.
///
/// Blocks are 256-byte aligned. They come from expandable segments where the device supports
/// them (Note [Expandable segments]: one address range per pool, and one for the cache, mapped
/// in 2 MiB pages as it grows), else from fixed 2 MiB segments (requests up to 1 MiB), 20 MiB
/// segments (up to 10 MiB) or their own segment. A block freed on a stream is reused at once by
/// that stream and by others only after an ordering the allocator has seen
/// ([`CachingAllocator::synchronize`]). Allocations made while a stream captures through
/// [`CachingAllocator::capture`] come from the capture's [`GraphPool`].
///
/// ```
/// use graphed::device::{CaptureMode, Device};
/// use graphed::memory::CachingAllocator;
/// use graphed::ops::elementwise;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let pool = alloc.new_pool();
/// let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
/// let tmp = alloc.alloc::<f32>(&s, 1024)?;          // from the pool
/// elementwise::fill(tmp.view(), 1.0, &s)?;
/// drop(tmp);                                      // back to the pool, for later captures
/// let graph = cap.finish()?;
/// assert_eq!(alloc.stats().pools[0].1.allocated, 0);
/// graph.instantiate()?.launch(&s)?;
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone)]
pub struct CachingAllocator {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) dev: Device,
    /// Names the allocator in the memory trace (`GRAPHED_LOG=graphed::memory=trace`), whose pool
    /// and segment numbers are the allocator's own.
    id: u64,
    poison: bool,
    /// `None`: fixed segments.
    expandable: Option<Expandable>,
    state: Mutex<State>,
    /// Blocks given back, waiting to be put into their arena. Kept apart from `state` because
    /// blocks come back from wherever their last reference drops, including inside a backend
    /// that holds its own lock while the allocator may be waiting for it.
    returned: Mutex<Vec<Returned>>,
}

struct Returned {
    pool: Option<PoolId>,
    segment: SegmentId,
    offset: usize,
    stream: Option<StreamKey>,
    /// Free for the fence's stream once its event completed (else for `stream`).
    fence: Option<Fence>,
}

#[derive(Default)]
struct State {
    default: Arena,
    pools: HashMap<PoolId, PoolState>,
    segments: HashMap<SegmentId, Arc<RawBuffer>>,
    /// Where each lent segment begins in its allocation, in bytes (other segments begin at 0).
    bases: HashMap<SegmentId, usize>,
    next_segment: SegmentId,
    next_pool: u64,
    /// Which pool each allocator capture allocates from, by capture id.
    captures: HashMap<u64, PoolId>,
    /// Where each handed-out block is.
    live: HashMap<(Option<PoolId>, SegmentId, usize), BufferId>,
    /// Freed blocks waiting for their fence's event.
    fenced: Vec<Returned>,
    /// Highest sums over all arenas of allocated and of reserved bytes; a pool counts at its
    /// capture peak while its graphs replay ([`Inner::launched`]).
    peak_allocated: usize,
    peak_reserved: usize,
    /// The allocations of a pass being learned ([`CachingAllocator::learn`]).
    learning: Option<Learning>,
    /// Memory lent to the cache for the eager allocations of a stream, by stream
    /// ([`CachingAllocator::lend_eager`]).
    eager_lent: HashMap<StreamKey, EagerLent>,
    /// Lent segments of the cache that a block still held when their lending ended: kept, with
    /// their lenders' blocks, so that neither is handed out again.
    _stuck_lent: Vec<(SegmentId, Arc<Block>)>,
}

/// Memory lent to the cache for the allocations of one stream outside captures: a lending
/// stack's warmup (Note [Lent gradients in the warmup] in `graph/lend.rs`).
struct EagerLent {
    /// Each lent segment, its lender, and the lender's block, kept alive while lent.
    lent: Vec<(SegmentId, usize, Arc<Block>)>,
    /// The segments that the stream's allocations may take now.
    open: Vec<SegmentId>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the bookkeeping consistent before it can fail.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl State {
    /// The pool that `stream`, capturing as `capture` (its id; `None` outside captures),
    /// allocates from.
    fn pool_of(&self, op: &'static str, stream: &Stream, capture: Option<u64>) -> Result<Option<PoolId>> {
        match capture {
            None => Ok(None),
            Some(id) => Ok(Some(*self.captures.get(&id).ok_or(Error::NoCapturePool { op, stream: stream.id() })?)),
        }
    }

    fn arena(&mut self, pool: Option<PoolId>) -> Option<&mut Arena> {
        match pool {
            None => Some(&mut self.default),
            Some(p) => self.pools.get_mut(&p).map(|p| &mut p.arena),
        }
    }

    /// A new segment id for memory lent from `block`'s allocation, `start` bytes into it.
    fn lent_segment(&mut self, block: &Block, start: usize) -> SegmentId {
        self.next_segment += 1;
        let segment = self.next_segment;
        self.segments.insert(segment, block.raw.clone());
        self.bases.insert(segment, start);
        segment
    }

    /// Ends the cache's eager lending to `stream`: gives back each lent segment none of whose
    /// blocks is handed out; returns the bytes of the blocks still held, whose segments stay
    /// apart.
    fn end_eager_lent(&mut self, stream: StreamKey) -> usize {
        let Some(e) = self.eager_lent.remove(&stream) else { return 0 };
        let mut held = 0;
        for (segment, _, keep) in e.lent {
            if self.default.remove_lent(segment) {
                self.segments.remove(&segment);
                self.bases.remove(&segment);
            } else {
                held += (self.default.blocks().iter())
                    .filter(|b| b.segment == segment && matches!(b.state, BlockState::Used(_)))
                    .map(|b| b.size)
                    .sum::<usize>();
                self._stuck_lent.push((segment, keep));
            }
        }
        held
    }

    /// Gives the memory `lenders` lent to `pool` back to its owners (`None`: of every lender,
    /// but not what a capture in progress was lent), each segment none of whose blocks is handed
    /// out, and closes the pool's lent memory to captures; a segment of `lenders` that a block
    /// still holds goes back once the pool is idle and the block free. The caller knows that no
    /// graph that may run uses those segments' free blocks.
    pub(crate) fn give_back_lent(&mut self, pool: PoolId, lenders: Option<&[usize]>) {
        let Some(p) = self.pools.get_mut(&pool) else { return };
        let given: Vec<SegmentId> = (p.lent.iter())
            .filter(|l| lenders.map_or(!l.pinned, |ids| ids.contains(&l.lender)))
            .map(|l| l.segment)
            .filter(|s| p.arena.remove_lent(*s))
            .collect();
        p.lent.retain(|l| !given.contains(&l.segment));
        // What a block still holds goes back once the pool is idle and the block free.
        p.lent.iter_mut().filter(|l| lenders.is_some_and(|ids| ids.contains(&l.lender))).for_each(|l| l.pinned = false);
        p.close_lent();
        for segment in given {
            self.segments.remove(&segment);
            self.bases.remove(&segment);
        }
    }

    /// Raises the allocator's peaks to the sums of allocated and reserved bytes over all arenas
    /// now, without [`total`](State::total)'s scan of every free list (once per allocation).
    fn note_peaks(&mut self) {
        let arenas = std::iter::once(&self.default).chain(self.pools.values().map(|p| &p.arena));
        let (allocated, reserved) = arenas.fold((0, 0), |(a, r), arena| (a + arena.allocated(), r + arena.reserved()));
        self.peak_allocated = self.peak_allocated.max(allocated);
        self.peak_reserved = self.peak_reserved.max(reserved);
    }

    /// The sums over all arenas, with the allocator's own peaks.
    fn total(&mut self) -> Stats {
        let mut total = self.default.stats();
        for p in self.pools.values() {
            let s = p.arena.stats();
            total.allocated += s.allocated;
            total.reserved += s.reserved;
            total.lent += s.lent;
            total.largest_free = total.largest_free.max(s.largest_free);
        }
        self.peak_allocated = self.peak_allocated.max(total.allocated);
        self.peak_reserved = self.peak_reserved.max(total.reserved);
        Stats { peak_allocated: self.peak_allocated, peak_reserved: self.peak_reserved, ..total }
    }
}

/// Gives a block back to the allocator it came from.
struct Lease {
    alloc: Weak<Inner>,
    pool: Option<PoolId>,
    segment: SegmentId,
    offset: usize,
}

impl BlockOwner for Lease {
    fn release_on_handle_drop(&self) -> bool {
        // Note [Pool replay order]: pool blocks are reused by later captures of the pool as soon
        // as their handle is dropped; the graphs that still name them replay in order.
        self.pool.is_some()
    }

    fn release(&self, last_stream: Option<StreamId>, streams_used: u32, fence: Option<Fence>) {
        if let Some(alloc) = self.alloc.upgrade() {
            let stream = match (last_stream, streams_used) {
                (None, _) => None,
                (Some(s), 1) => Some(s.raw()),
                (Some(_), _) => Some(MANY_STREAMS),
            };
            // Pool blocks follow the pool's replay order instead (note [Pool replay order]). A
            // block never used, or used on its fence's stream alone, needs no fence.
            let needless = |f: &Fence| last_stream.is_none_or(|s| streams_used == 1 && s == f.stream);
            let fence = fence.filter(|f| self.pool.is_none() && !needless(f));
            let r = Returned { pool: self.pool, segment: self.segment, offset: self.offset, stream, fence };
            lock(&alloc.returned).push(r);
        }
    }
}

impl Inner {
    /// Puts returned blocks back into their arenas.
    fn take_returned(&self, st: &mut State) {
        let mut returned = std::mem::take(&mut *lock(&self.returned));
        returned.append(&mut st.fenced);
        // Blocks given back together share their fence: each event is asked once (a driver call
        // on CUDA).
        let mut asked: Vec<(EventId, Option<bool>)> = Vec::new();
        for mut r in returned {
            if let Some(f) = r.fence.take() {
                let id = f.event.id();
                let done = match asked.iter().find(|(e, _)| *e == id) {
                    Some(&(_, done)) => done,
                    None => {
                        let done = f.event.query().ok();
                        asked.push((id, done));
                        done
                    }
                };
                match done {
                    Some(true) => r.stream = Some(f.stream.raw()),
                    Some(false) => {
                        r.fence = Some(f);
                        st.fenced.push(r);
                        continue;
                    }
                    // Its record cannot be waited for: the block waits for a synchronize.
                    None => {}
                }
            }
            st.live.remove(&(r.pool, r.segment, r.offset));
            if let Some(p) = r.pool.and_then(|p| st.pools.get_mut(&p)) {
                if p.capturing.is_some() {
                    p.capture_frees.insert(r.stream.unwrap_or(MANY_STREAMS));
                }
            }
            if let Some(arena) = st.arena(r.pool) {
                // Never used by any stream: nothing can still be reading it.
                let tag = r.stream.map_or(FreeTag::Any, FreeTag::Stream);
                arena.free_with(r.segment, r.offset, Some(tag));
                tracing::trace!(allocator = self.id, pool = ?r.pool, segment = r.segment, offset = r.offset, "graphed: free");
            }
        }
    }

    /// Ends `pool`'s expectation (Note [Pass-local blocks]): the bytes of the blocks it placed
    /// where only pass-local blocks may go that are still held.
    pub(crate) fn end_expect(&self, pool: PoolId) -> usize {
        let mut st = lock(&self.state);
        self.take_returned(&mut st);
        let Some(e) = st.pools.get_mut(&pool).and_then(|p| p.expect.take()) else { return 0 };
        let held = |&&(segment, offset, id, _): &&(SegmentId, usize, BufferId, usize)| {
            st.live.get(&(Some(pool), segment, offset)) == Some(&id)
        };
        e.placed.iter().filter(held).map(|p| p.3).sum()
    }

    pub(crate) fn with_pool<T>(&self, pool: PoolId, f: impl FnOnce(&mut PoolState) -> T) -> Option<T> {
        lock(&self.state).pools.get_mut(&pool).map(f)
    }

    /// Notes a launch of `graph`, of `pool`, on `stream`. A replay re-enacts the pool's captures,
    /// so its blocks are live up to the pool's capture peak again, beside what the other arenas
    /// hold now: the allocator's total peak counts that, or memory allocated after the capture
    /// (in the cache, say) would never be counted together with the pool's peak.
    pub(crate) fn launched(&self, pool: PoolId, graph: GraphId, stream: &Stream) {
        let mut st = lock(&self.state);
        let Some(p) = st.pools.get_mut(&pool) else { return };
        p.launched(graph, stream);
        let replay = p.arena.peak_allocated();
        let others = st.default.allocated()
            + (st.pools.iter()).filter(|(id, _)| **id != pool).map(|(_, p)| p.arena.allocated()).sum::<usize>();
        st.peak_allocated = st.peak_allocated.max(others + replay);
    }

    pub(crate) fn pool_stats(&self, pool: PoolId) -> Option<Stats> {
        let mut st = lock(&self.state);
        self.take_returned(&mut st);
        st.pools.get(&pool).map(|p| p.arena.stats())
    }

    /// Makes room in `pool`'s arena for `bytes` on stream `key`: grows an expandable segment
    /// (reserving a new one if none has room) or adds a fixed segment (always, for a small
    /// request: Note [Small segments]). `relaxed` while the stream captures, so that the capture
    /// is not invalidated.
    fn grow(&self, st: &mut State, pool: Option<PoolId>, bytes: usize, key: StreamKey, relaxed: bool) -> Result<()> {
        const OP: &str = "CachingAllocator::alloc";
        let out_of_memory = |requested: usize, what: &'static str| {
            move |e| match e {
                Error::OutOfMemory { free, total, .. } => Error::OutOfMemory { op: OP, requested, what, free, total },
                other => other,
            }
        };
        let missing = || Error::NoCapturePool { op: OP, stream: StreamId(key) };
        let Some(x) = self.expandable.filter(|_| !is_small(bytes)) else {
            let seg_bytes = segment_size(block_size(bytes));
            let what = "a new segment of the caching allocator";
            let raw =
                self.dev.alloc_raw(seg_bytes, MemKind::Device, relaxed).map_err(out_of_memory(seg_bytes, what))?;
            st.next_segment += 1;
            let id = st.next_segment;
            st.segments.insert(id, Arc::new(raw));
            st.arena(pool).ok_or_else(missing)?.add_segment(id, seg_bytes);
            tracing::trace!(allocator = self.id, ?pool, segment = id, size = seg_bytes, "graphed: segment");
            return Ok(());
        };
        let plan = st.arena(pool).ok_or_else(missing)?.plan_growth(bytes, key, x.chunk);
        let growth = match plan {
            Some(g) => g,
            None => {
                // The first growth of this arena, or a request larger than its range has left.
                let range = x.range.max(block_size(bytes).div_ceil(x.chunk) * x.chunk);
                let raw = self.dev.reserve_raw(range, x.chunk, relaxed)?;
                st.next_segment += 1;
                let id = st.next_segment;
                st.segments.insert(id, Arc::new(raw));
                let arena = st.arena(pool).ok_or_else(missing)?;
                arena.add_expandable(id, range);
                arena.plan_growth(bytes, key, x.chunk).expect("a fresh range fits the request")
            }
        };
        let raw = st.segments[&growth.segment].clone();
        let mapped = self.dev.map_raw(&raw, growth.size, relaxed);
        let arena = st.arena(pool).ok_or_else(missing)?;
        match mapped {
            Ok(()) => {
                arena.grow(growth);
                tracing::trace!(
                    allocator = self.id,
                    ?pool,
                    segment = growth.segment,
                    size = growth.size,
                    "graphed: grow"
                );
            }
            Err(e) => {
                arena.track_mapped(growth.segment, raw.mapped());
                return Err(out_of_memory(growth.size, "more pages of an expandable segment")(e));
            }
        }
        Ok(())
    }

    /// Waits for the device, then lets every cached block be reused by any stream, and every
    /// pool be replayed on any stream next.
    fn synchronize(&self) -> Result<()> {
        self.dev.synchronize()?;
        let mut st = lock(&self.state);
        self.take_returned(&mut st);
        st.default.mark_all_ordered();
        for p in st.pools.values_mut() {
            p.arena.mark_all_ordered();
            p.forget_last_stream();
        }
        Ok(())
    }

    /// Gives the device back what `pool` holds free, if none of its graphs can run
    /// ([`PoolState::idle`]) and no capture of this allocator is active: its fixed segments
    /// with no block in use, and the free ends of its expandable segments. The caller has
    /// synchronized the device since the pool's blocks were last used.
    fn release_idle_pool(&self, st: &mut State, pool: PoolId) -> Result<()> {
        if !st.captures.is_empty() || !st.pools.get(&pool).is_some_and(PoolState::idle) {
            return Ok(());
        }
        let empty = st.pools.get_mut(&pool).map(|p| p.arena.release_empty()).unwrap_or_default();
        for (segment, _) in empty {
            // The graphs that named the segment are gone or cannot run: it is freed when the
            // last of them drops.
            st.segments.remove(&segment);
            tracing::trace!(allocator = self.id, pool = ?Some(pool), segment, "graphed: release");
        }
        st.give_back_lent(pool, None);
        self.release_free_ends(st, Some(pool))
    }

    /// Lends `bytes` bytes at `start` in `block`'s allocation (256-byte aligned, inside the block)
    /// to `pool`, for the captures that `lender` is open to (Note [Lent gradients]); the pool
    /// keeps the block alive until it gives the memory back, and keeps the memory while pinned
    /// (until [`GraphPool::unpin_lent`]), even when none of its graphs can run.
    pub(crate) fn lend(&self, pool: PoolId, LentRange { lender, block, start, bytes }: LentRange) {
        let mut st = lock(&self.state);
        if !st.pools.contains_key(&pool) {
            return;
        }
        let segment = st.lent_segment(&block, start);
        let p = st.pools.get_mut(&pool).expect("checked above");
        p.arena.add_lent(segment, bytes);
        p.lent.push(Lent { segment, lender, bytes, pinned: true, _keep: block });
    }

    /// Each lent segment of `pool` whose lender is in `lenders`: its allocation and its byte
    /// range there.
    pub(crate) fn lent_memory(&self, pool: PoolId, lenders: &[usize]) -> Vec<(BufferId, std::ops::Range<usize>)> {
        let st = lock(&self.state);
        let Some(p) = st.pools.get(&pool) else { return Vec::new() };
        p.lent
            .iter()
            .filter(|l| lenders.contains(&l.lender))
            .filter_map(|l| {
                let (raw, base) = (st.segments.get(&l.segment)?, st.bases.get(&l.segment)?);
                Some((raw.id, *base..*base + l.bytes))
            })
            .collect()
    }

    /// Gives back the memory `lenders` (all: `None`) lent to `pool` that none of its blocks
    /// holds (see [`State::give_back_lent`]).
    pub(crate) fn give_back_lent(&self, pool: PoolId, lenders: Option<&[usize]>) {
        let mut st = lock(&self.state);
        self.take_returned(&mut st);
        st.give_back_lent(pool, lenders);
    }

    /// Waits for the device, then gives back what `pool` holds free if none of its graphs can
    /// run (see [`GraphPool::trim`]).
    pub(crate) fn trim_pool(&self, pool: PoolId) -> Result<()> {
        self.synchronize()?;
        let mut st = lock(&self.state);
        self.release_idle_pool(&mut st, pool)
    }

    /// Unmaps the free ends of the expandable segments of `pool`'s arena. The caller has
    /// synchronized the device and knows that no graph that may run uses the arena's free blocks.
    fn release_free_ends(&self, st: &mut State, pool: Option<PoolId>) -> Result<()> {
        let Some(x) = self.expandable else { return Ok(()) };
        let ends = st.arena(pool).map(|a| a.free_tails(x.chunk)).unwrap_or_default();
        for (segment, size) in ends {
            let raw = st.segments[&segment].clone();
            let unmapped = self.dev.unmap_raw(&raw, size);
            if let Some(arena) = st.arena(pool) {
                arena.track_mapped(segment, raw.mapped());
            }
            tracing::trace!(allocator = self.id, ?pool, segment, size = raw.mapped(), "graphed: shrink");
            unmapped?;
        }
        Ok(())
    }
}

impl CachingAllocator {
    /// An allocator over `dev`'s memory, with expandable segments where the device supports
    /// them (see [`AllocatorConfig::expandable`]).
    pub fn new(dev: &Device) -> CachingAllocator {
        CachingAllocator::build(dev, false, expandable_on(dev, None).unwrap_or(None))
    }

    /// An allocator that fills every block it hands out with 0xFF bytes (NaN in f32, bf16 and
    /// f16), so that reading memory nobody wrote shows up in results.
    pub fn with_poison(dev: &Device) -> CachingAllocator {
        CachingAllocator::build(dev, true, expandable_on(dev, None).unwrap_or(None))
    }

    /// An allocator configured by `config`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when `config` asks for expandable segments and the device has no
    /// virtual memory management; device errors while asking it.
    pub fn with_config(dev: &Device, config: AllocatorConfig) -> Result<CachingAllocator> {
        Ok(CachingAllocator::build(dev, config.poison, expandable_on(dev, config.expandable)?))
    }

    fn build(dev: &Device, poison: bool, expandable: Option<Expandable>) -> CachingAllocator {
        let inner = Inner {
            dev: dev.clone(),
            id: crate::device::ids::next_id(),
            poison,
            expandable,
            state: Mutex::default(),
            returned: Mutex::default(),
        };
        CachingAllocator { inner: Arc::new(inner) }
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.dev
    }

    /// A new, empty graph pool.
    pub fn new_pool(&self) -> GraphPool {
        let mut st = lock(&self.inner.state);
        st.next_pool += 1;
        let id = PoolId(st.next_pool);
        st.pools.insert(id, PoolState::default());
        GraphPool { id, alloc: self.inner.clone() }
    }

    /// `len` elements for work on `stream`. On a stream capturing through
    /// [`CachingAllocator::capture`], the block comes from that capture's pool.
    ///
    /// # Errors
    /// [`Error::NoCapturePool`] on a stream capturing without the allocator; device errors.
    pub fn alloc<T: Elem>(&self, stream: &Stream, len: usize) -> Result<DeviceBuffer<T>> {
        let mut one = self.alloc_many::<T>(stream, &[len])?;
        Ok(one.pop().expect("one buffer per length"))
    }

    /// A buffer of each length of `lens`, as [`alloc`](CachingAllocator::alloc) allocates them,
    /// under one lock and one query of the stream's capture (an offload switch allocates a few
    /// dozen at once). If one fails, those allocated before it go back.
    ///
    /// ```
    /// use graphed::device::Device;
    /// use graphed::memory::CachingAllocator;
    ///
    /// let dev = Device::sim();
    /// let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
    /// let bufs = alloc.alloc_many::<f32>(&s, &[256, 1024])?;
    /// assert_eq!(bufs.iter().map(|b| b.len()).collect::<Vec<_>>(), [256, 1024]);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`alloc`](CachingAllocator::alloc).
    pub fn alloc_many<T: Elem>(&self, stream: &Stream, lens: &[usize]) -> Result<Vec<DeviceBuffer<T>>> {
        const OP: &str = "CachingAllocator::alloc";
        self.inner.dev.check_same(OP, "stream", stream.device().id())?;
        let capture = stream.capture_id()?;
        let mut st = lock(&self.inner.state);
        self.inner.take_returned(&mut st);
        let pool = st.pool_of(OP, stream, capture)?;
        let mut bufs = Vec::with_capacity(lens.len());
        for &len in lens {
            // On failure the buffers allocated so far drop and go back, as any freed block.
            let block = self.place(&mut st, stream, pool, capture.is_some(), len * T::DTYPE.size())?;
            bufs.push(DeviceBuffer::from_block(block));
        }
        st.note_peaks();
        drop(st);
        if self.inner.poison {
            bufs.iter().try_for_each(|b| stream.memset(b, 0xFF))?;
        }
        Ok(bufs)
    }

    /// A block of `bytes` for `stream` from `pool`'s arena (the cache's for `None`), grown if
    /// nothing free fits; `capturing` when the stream captures, so that growth does not
    /// invalidate the capture.
    fn place(
        &self,
        st: &mut State,
        stream: &Stream,
        pool: Option<PoolId>,
        capturing: bool,
        bytes: usize,
    ) -> Result<Block> {
        const OP: &str = "CachingAllocator::alloc";
        let key = stream.id().raw();
        // Memory lent to the pool serves first the requests it is open to (Note [Lent gradients]);
        // a block expected to die within its pass first the lent memory only such blocks may take
        // (Note [Pass-local blocks]), which is of no use to the others.
        // Outside captures, memory lent to the cache serves its stream (Note [Lent gradients in
        // the warmup]).
        let (open, wide) = match pool {
            Some(p) => st.pools.get_mut(&p).map(|p| (p.open_lent(), p.wide_for(bytes, key))).unwrap_or_default(),
            None => match st.eager_lent.get(&key) {
                Some(e) => (e.open.clone(), Vec::new()),
                None => Default::default(),
            },
        };
        let only_wide = |s: SegmentId| wide.contains(&s) && !open.contains(&s);
        let arena = st.arena(pool).ok_or(Error::NoCapturePool { op: OP, stream: stream.id() })?;
        let mut lent = None;
        if !wide.is_empty() {
            lent = arena.alloc_lent(bytes, key, &only_wide);
        }
        if lent.is_none() && !open.is_empty() {
            lent = arena.alloc_lent(bytes, key, &|s| open.contains(&s));
        }
        let (segment, offset, size) = match lent.or_else(|| arena.alloc(bytes, key)) {
            Some(b) => b,
            None => {
                // Grown in relaxed mode, so that a capture on this thread is not invalidated (the
                // growth itself is not captured: a plain cuMemAlloc, or pages mapped).
                self.inner.grow(st, pool, bytes, key, capturing)?;
                let arena = st.arena(pool).expect("the arena was found above");
                arena.alloc(bytes, key).expect("the grown arena fits the request")
            }
        };
        tracing::trace!(allocator = self.inner.id, ?pool, segment, offset, size, bytes, stream = key, "graphed: alloc");
        let raw = st.segments[&segment].clone();
        let base = st.bases.get(&segment).copied().unwrap_or(0);
        let id = BufferId(ids::next_id());
        st.live.insert((pool, segment, offset), id);
        if only_wide(segment) {
            if let Some(e) = pool.and_then(|p| st.pools.get_mut(&p)).and_then(|p| p.expect.as_mut()) {
                e.placed.push((segment, offset, id, size));
            }
        }
        if let Some(l) = st.learning.as_mut().filter(|l| l.stream == key && pool.is_none()) {
            l.seen.push((bytes, (pool, segment, offset), id));
        }
        let lease = Lease { alloc: Arc::downgrade(&self.inner), pool, segment, offset };
        Ok(Block::new(raw, base + offset, Some(bytes.min(size)), id, Some(Arc::new(lease))))
    }

    /// Begins capturing `stream` into `pool`: allocations on the capture's streams come from the
    /// pool until [`PoolCapture::finish`]. Cached blocks outside pools are released first, so
    /// that warmup memory is not held twice (in the cache and in the pool).
    pub fn capture<'s>(&self, stream: &'s Stream, mode: CaptureMode, pool: &GraphPool) -> Result<PoolCapture<'s>> {
        self.check_pool("CachingAllocator::capture", pool)?;
        self.empty_cache()?;
        let cap = stream.capture(mode)?;
        let id = stream
            .capture_id()?
            .ok_or(Error::NoCapturePool { op: "CachingAllocator::capture", stream: stream.id() })?;
        let mut st = lock(&self.inner.state);
        st.captures.insert(id, pool.id);
        if let Some(p) = st.pools.get_mut(&pool.id) {
            p.capturing = Some(id);
            p.capture_frees.clear();
        }
        drop(st);
        Ok(PoolCapture { cap: Some(cap), alloc: self.inner.clone(), pool: pool.clone(), id })
    }

    /// Learns which of the allocations on `stream` (outside captures) die before the returned
    /// guard's [`finish`](Learn::finish): the warmup's account of a pass, which its capture
    /// expects (Note [Pass-local blocks]). One stream at a time; a new call replaces the last.
    pub(crate) fn learn(&self, stream: &Stream) -> Learn<'_> {
        lock(&self.inner.state).learning = Some(Learning { stream: stream.id().raw(), seen: Vec::new() });
        Learn { alloc: self, stream: stream.clone() }
    }

    /// Runs `f`, whose allocations on `stream` are outside the sequence the capture in progress
    /// expects (Note [Pass-local blocks]): they take no memory lent for the pass alone and do
    /// not move the expectation on. For allocations the pass's warmup does not make, which
    /// would otherwise stand in for the warmup's next allocation of the same size: the
    /// offload's reloads (its warmup runs with offloading off), which outlive the pass that
    /// issues them. Outside a capture, or without an expectation, it only runs `f`.
    pub(crate) fn outside_expectation<T>(&self, stream: &Stream, f: impl FnOnce() -> T) -> T {
        let key = stream.id().raw();
        let capture = stream.capture_id().ok().flatten();
        let pause = |paused: bool| -> Option<bool> {
            let mut st = lock(&self.inner.state);
            let pool = *st.captures.get(&capture?)?;
            let e = st.pools.get_mut(&pool)?.expect.as_mut().filter(|e| e.stream == key)?;
            Some(std::mem::replace(&mut e.paused, paused))
        };
        let was = pause(true);
        let out = f();
        if let Some(was) = was {
            pause(was);
        }
        out
    }

    /// Lends `lent` to the cache for the allocations on `stream` outside captures, until the
    /// returned guard ends the lending; they take none of it until
    /// [`EagerLending::open`] names its lenders (Note [Lent gradients in the warmup] in
    /// `graph/lend.rs`). A new call for the same stream ends its last lending first.
    pub(crate) fn lend_eager(&self, stream: &Stream, lent: Vec<LentRange>) -> EagerLending<'_> {
        let key = stream.id().raw();
        let mut st = lock(&self.inner.state);
        self.inner.take_returned(&mut st);
        st.end_eager_lent(key);
        let mut segments = Vec::with_capacity(lent.len());
        for LentRange { lender, block, start, bytes } in lent {
            let segment = st.lent_segment(&block, start);
            st.default.add_lent(segment, bytes);
            segments.push((segment, lender, block));
        }
        st.eager_lent.insert(key, EagerLent { lent: segments, open: Vec::new() });
        EagerLending { alloc: self, stream: key }
    }

    /// Refuses a pool that another allocator made.
    ///
    /// # Errors
    /// [`Error::ForeignPool`] naming `op`.
    pub fn check_pool(&self, op: &'static str, pool: &GraphPool) -> Result<()> {
        match Arc::ptr_eq(&pool.alloc, &self.inner) {
            true => Ok(()),
            false => Err(Error::ForeignPool { op, pool: pool.id }),
        }
    }

    /// Waits for the device, then lets every cached block be reused by any stream, and every
    /// pool be replayed on any stream next.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    /// [`synchronize`](CachingAllocator::synchronize), then gives the device back every segment
    /// outside pools that has no block in use, and the free ends of expandable segments outside
    /// pools; of a pool none of whose graphs can run any more (Note [Expandable segments]), both
    /// its free segments and its free ends.
    pub fn empty_cache(&self) -> Result<()> {
        self.synchronize()?;
        let mut st = lock(&self.inner.state);
        for (segment, _) in st.default.release_empty() {
            st.segments.remove(&segment);
            tracing::trace!(allocator = self.inner.id, pool = ?None::<PoolId>, segment, "graphed: release");
        }
        if !st.captures.is_empty() {
            // A capture of this allocator began on another thread after the synchronize: its
            // streams may use what is free now.
            return Ok(());
        }
        self.inner.release_free_ends(&mut st, None)?;
        let pools: Vec<PoolId> = st.pools.keys().copied().collect();
        for pool in pools {
            self.inner.release_idle_pool(&mut st, pool)?;
        }
        Ok(())
    }

    /// The bytes its reserved memory moves by, where segments are expandable: they grow and
    /// give back whole pages of this size (Note [Expandable segments]). `None` with fixed
    /// segments, which come in several sizes.
    pub fn page_bytes(&self) -> Option<usize> {
        self.inner.expandable.map(|x| x.chunk)
    }

    /// Byte counts: allocated, reserved and their peaks, and the largest free range, in total,
    /// outside pools and per pool.
    pub fn stats(&self) -> MemoryStats {
        let mut st = lock(&self.inner.state);
        self.inner.take_returned(&mut st);
        let mut pools: Vec<(PoolId, Stats)> = st.pools.iter().map(|(id, p)| (*id, p.arena.stats())).collect();
        pools.sort_by_key(|(id, _)| *id);
        MemoryStats {
            total: st.total(),
            default: st.default.stats(),
            pools,
            expandable: self.inner.expandable.is_some(),
        }
    }

    /// The most bytes one request on `stream` can take now without reserving more memory or
    /// raising the peak of its arena (the pool `stream` captures into, else the cache outside
    /// pools): the largest block free to it, at most the arena's peak allocated bytes less what
    /// it holds now. Scratch whose size is a speed choice (cuDNN's attention backward runs in
    /// fewer executions with more) asks this, so that it costs the run no memory. 0 while the
    /// stream's pass has its allocations learned or expected for lent gradients (Note
    /// [Pass-local blocks]): their sizes must not depend on what is free.
    ///
    /// # Errors
    /// [`Error::NoCapturePool`] on a stream capturing without the allocator; device errors.
    pub fn headroom(&self, stream: &Stream) -> Result<usize> {
        const OP: &str = "CachingAllocator::headroom";
        self.inner.dev.check_same(OP, "stream", stream.device().id())?;
        let capture = stream.capture_id()?;
        let mut st = lock(&self.inner.state);
        self.inner.take_returned(&mut st);
        let pool = st.pool_of(OP, stream, capture)?;
        let key = stream.id().raw();
        // A pass whose allocations are learned or expected (Note [Pass-local blocks]) must ask
        // for the same sizes in its warmup and its capture, which see different rooms.
        let learned = st.learning.as_ref().is_some_and(|l| l.stream == key && pool.is_none());
        let expected = pool.and_then(|p| st.pools.get(&p)).is_some_and(|p| p.expect.is_some());
        if learned || expected {
            return Ok(0);
        }
        let arena = st.arena(pool).ok_or(Error::NoCapturePool { op: OP, stream: stream.id() })?;
        let below_peak = arena.peak_allocated() - arena.allocated();
        Ok(arena.largest_free_for(key).min(below_peak))
    }

    /// Every block: its pool (`None`: outside pools), place and state, and the buffer that
    /// holds it if it is handed out.
    pub fn blocks(&self) -> Vec<BlockEntry> {
        let mut st = lock(&self.inner.state);
        self.inner.take_returned(&mut st);
        let mut arenas: Vec<(Option<PoolId>, &Arena)> = vec![(None, &st.default)];
        let mut pools: Vec<_> = st.pools.iter().map(|(id, p)| (Some(*id), &p.arena)).collect();
        pools.sort_by_key(|(id, _)| *id);
        arenas.extend(pools);
        arenas
            .into_iter()
            .flat_map(|(pool, arena)| {
                let live = &st.live;
                arena.blocks().into_iter().map(move |info| BlockEntry {
                    pool,
                    info,
                    buffer: live.get(&(pool, info.segment, info.offset)).copied(),
                    lent: arena.is_lent(info.segment),
                })
            })
            .collect()
    }

    /// The segments of `pool`, as the [`Access::memory`](crate::device::Access::memory) of their
    /// blocks' accesses; not the memory lent to it.
    pub fn pool_segments(&self, pool: &GraphPool) -> Vec<BufferId> {
        let st = lock(&self.inner.state);
        let mut ids: Vec<BufferId> = (st.pools.get(&pool.id).into_iter())
            .flat_map(|p| p.arena.blocks().into_iter().filter(|b| !p.arena.is_lent(b.segment)))
            .filter_map(|b| st.segments.get(&b.segment).map(|raw| raw.id))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Where the block of `buffer` is, if this allocator handed it out and it is still held.
    pub fn block_of(&self, buffer: BufferId) -> Option<BlockEntry> {
        self.blocks().into_iter().find(|b| b.buffer == Some(buffer))
    }
}

/// A capture into a pool (see [`CachingAllocator::capture`]). Dropping it without
/// [`finish`](PoolCapture::finish) ends the capture and discards the graph.
#[must_use = "a capture ends when its guard is dropped; call finish() to keep the graph"]
pub struct PoolCapture<'s> {
    cap: Option<Capture<'s>>,
    alloc: Arc<Inner>,
    pool: GraphPool,
    id: u64,
}

impl PoolCapture<'_> {
    /// Lets this capture allocate from the memory `lenders` lent its pool (none: no lent
    /// memory), until it ends (Note [Lent gradients] in `graph/lend.rs`).
    pub(crate) fn open_lent(&self, lenders: &[usize]) {
        self.pool.open_lent(lenders);
    }

    /// Ends the capture and returns the graph, registered in the pool's replay order.
    pub fn finish(mut self) -> Result<PoolGraph> {
        let cap = self.cap.take().expect("finish consumes the guard");
        let graph = cap.finish();
        let mut st = lock(&self.alloc.state);
        self.alloc.take_returned(&mut st);
        st.captures.remove(&self.id);
        let Some(pool) = st.pools.get_mut(&self.pool.id) else {
            return Err(Error::ForeignPool { op: "PoolCapture::finish", pool: self.pool.id });
        };
        pool.capturing = None;
        pool.close_lent();
        // Every stream of the capture was joined back before it ended, so what they freed is
        // ordered before the end of the graph: later captures of the pool may reuse it.
        for stream in std::mem::take(&mut pool.capture_frees) {
            pool.arena.mark_ordered(stream);
        }
        let graph = graph?;
        pool.add_graph(graph.id());
        Ok(PoolGraph { graph, pool: self.pool.clone() })
    }
}

/// Memory lent to the cache for one stream's eager allocations
/// ([`CachingAllocator::lend_eager`]); dropping it ends the lending as
/// [`finish`](EagerLending::finish) does, without its count.
pub(crate) struct EagerLending<'a> {
    alloc: &'a CachingAllocator,
    stream: StreamKey,
}

impl EagerLending<'_> {
    /// Lets the stream's allocations take the memory of `lenders` (none: no lent memory), the
    /// blocks that fit there first.
    pub(crate) fn open(&self, lenders: &[usize]) {
        if let Some(e) = lock(&self.alloc.inner.state).eager_lent.get_mut(&self.stream) {
            e.open = e.lent.iter().filter(|l| lenders.contains(&l.1)).map(|l| l.0).collect();
        }
    }

    /// Waits for the device, then gives the lent memory back; returns the bytes of blocks there
    /// still held, which the caller refuses: their memory stays with the cache, never handed
    /// out again, but its owner will write it.
    ///
    /// # Errors
    /// Device errors while waiting.
    pub(crate) fn finish(self) -> Result<usize> {
        self.alloc.synchronize()?;
        let mut st = lock(&self.alloc.inner.state);
        self.alloc.inner.take_returned(&mut st);
        Ok(st.end_eager_lent(self.stream))
    }
}

impl Drop for EagerLending<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.alloc.inner.state);
        self.alloc.inner.take_returned(&mut st);
        st.end_eager_lent(self.stream);
    }
}

/// Allocations being learned ([`CachingAllocator::learn`]); dropping it stops the learning.
pub(crate) struct Learn<'a> {
    alloc: &'a CachingAllocator,
    stream: Stream,
}

impl Learn<'_> {
    /// What was learned: each allocation's size, and whether it was freed by now. Waits for the
    /// stream first: a block dropped while queued work still uses it comes back after that work.
    ///
    /// # Errors
    /// Device errors while waiting.
    pub(crate) fn finish(self) -> Result<Lifetimes> {
        self.stream.synchronize()?;
        let mut st = lock(&self.alloc.inner.state);
        self.alloc.inner.take_returned(&mut st);
        let seen = st.learning.take().map(|l| l.seen).unwrap_or_default();
        let freed = |(bytes, place, id): (usize, Place, BufferId)| (bytes, st.live.get(&place) != Some(&id));
        Ok(Lifetimes(seen.into_iter().map(freed).collect()))
    }
}

impl Drop for Learn<'_> {
    fn drop(&mut self) {
        lock(&self.alloc.inner.state).learning = None;
    }
}

impl Drop for PoolCapture<'_> {
    fn drop(&mut self) {
        if self.cap.take().is_some() {
            let mut st = lock(&self.alloc.state);
            st.captures.remove(&self.id);
            if let Some(p) = st.pools.get_mut(&self.pool.id) {
                p.capturing = None;
                p.close_lent();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Policy, SimConfig};
    use crate::ops::elementwise;

    const MIB: usize = 1 << 20;

    fn small_sim() -> Device {
        // Small enough that the host's free memory never limits what the simulator reports.
        Device::sim_with(SimConfig { policy: Policy::InOrder, seed: 0, memory: 256 * MIB })
    }

    /// A stream of [`small_sim`] and a caching allocator of fixed segments.
    fn stream_and_allocator() -> Result<(Stream, CachingAllocator)> {
        let dev = small_sim();
        Ok((dev.stream()?, CachingAllocator::new(&dev)))
    }

    #[test]
    fn a_refused_batch_gives_back_what_it_allocated_before() -> Result<()> {
        let (s, alloc) = stream_and_allocator()?;
        let fits = alloc.alloc_many::<f32>(&s, &[1024, MIB])?;
        assert_eq!(fits.iter().map(DeviceBuffer::len).collect::<Vec<_>>(), [1024, MIB]);
        drop(fits);
        let before = alloc.stats().total.allocated;
        // The second request is larger than the device.
        match alloc.alloc_many::<f32>(&s, &[MIB, 128 * MIB, 1024]) {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!("expected out of memory, got {:?}", other.map(|b| b.len())),
        }
        assert_eq!(alloc.stats().total.allocated, before, "the first buffer went back");
        Ok(())
    }

    #[test]
    fn pages_given_back_are_free_on_the_device_again() -> Result<()> {
        let dev = small_sim();
        let s = dev.stream()?;
        let alloc = CachingAllocator::with_config(&dev, AllocatorConfig::default().expandable(true))?;
        let free = || dev.memory_info().map(|(free, _)| free);
        let idle = free()?;
        let a = alloc.alloc::<f32>(&s, 1024)?;
        let b = alloc.alloc::<f32>(&s, 10 * MIB)?;
        assert_eq!(free()?, idle - 42 * MIB, "only mapped pages count, not the reserved range");
        drop(b);
        alloc.empty_cache()?;
        assert_eq!(free()?, idle - 2 * MIB);
        drop(a);
        alloc.empty_cache()?;
        assert_eq!(free()?, idle);
        match alloc.alloc::<f32>(&s, 65 * MIB) {
            Err(Error::OutOfMemory { op: "CachingAllocator::alloc", requested, .. }) => {
                assert_eq!(requested, 260 * MIB, "the growth that did not fit")
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert_eq!((free()?, alloc.stats().total.reserved), (idle, 0), "a failed growth maps nothing");
        Ok(())
    }

    #[test]
    fn a_graph_replayed_after_its_pool_gave_pages_back_is_an_error_on_the_simulator() -> Result<()> {
        let dev = small_sim();
        let s = dev.stream()?;
        let alloc = CachingAllocator::with_config(&dev, AllocatorConfig::default().expandable(true))?;
        // Above 1 MiB: small requests take fixed segments (Note [Small segments]).
        let out = dev.alloc::<f32>(1 << 19)?;
        let pool = alloc.new_pool();
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
        let tmp = alloc.alloc::<f32>(&s, 1 << 19)?;
        elementwise::fill(tmp.view(), 2.0, &s)?;
        elementwise::scale(out.view(), tmp.view(), 1.0, &s)?;
        drop(tmp);
        let graph = cap.finish()?;
        let mut exec = graph.instantiate()?;
        // Outside the pool's order: the escape hatch that bypasses R5 bypasses this too.
        let raw = graph.graph().instantiate()?;
        exec.reset()?;
        alloc.empty_cache()?;
        assert_eq!(pool.stats().reserved, 0);
        raw.launch(&s)?;
        let e = s.synchronize().expect_err("the graph touched pages given back");
        assert!(e.to_string().contains("are not mapped"), "{e}");
        Ok(())
    }

    /// Memory that one stream used, given back for another after an event recorded there (the
    /// offload switch's resident tensors: written by graphs on a side stream, freed for the
    /// stream the steps join on), serves that other stream once the event completed, instead of
    /// waiting for a synchronize of the device while the cache grows.
    #[test]
    fn a_block_used_on_one_stream_serves_its_fence_stream_after_the_fence() -> Result<()> {
        let dev = small_sim();
        let (main, side, fence) = (dev.stream()?, dev.stream()?, dev.event()?);
        let alloc = CachingAllocator::new(&dev);
        let a = alloc.alloc::<f32>(&main, 4 * MIB)?;
        elementwise::fill(a.view(), 1.0, &side)?;
        side.record(&fence)?;
        main.wait(&fence)?;
        main.record(&fence)?;
        a.release_after(&fence, &main);
        drop(a);
        fence.synchronize()?;
        let reserved = alloc.stats().total.reserved;
        let _b = alloc.alloc::<f32>(&main, 4 * MIB)?;
        assert_eq!(alloc.stats().total.reserved, reserved, "the block given back serves the fence's stream");
        Ok(())
    }

    #[test]
    fn total_peaks_are_peaks_of_the_sums() -> Result<()> {
        let (s, alloc) = stream_and_allocator()?;
        let eager = alloc.alloc::<f32>(&s, MIB)?;
        drop(eager);
        let pool = alloc.new_pool();
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
        let captured = alloc.alloc::<f32>(&s, MIB)?;
        elementwise::fill(captured.view(), 1.0, &s)?;
        let st = alloc.stats();
        assert_eq!(st.default.peak_allocated + st.pools[0].1.peak_allocated, 8 * MIB);
        assert_eq!(st.total.peak_allocated, 4 * MIB, "the two arenas peaked at different times");
        assert_eq!(st.total.allocated, 4 * MIB);
        assert_eq!(pool.stats(), st.pools[0].1);
        drop(captured);
        let exec = cap.finish()?.instantiate()?;
        // Allocated after the capture, and live while the graph replays at its capture peak.
        let later = alloc.alloc::<f32>(&s, 2 * MIB)?;
        assert_eq!(alloc.stats().total.peak_allocated, 8 * MIB, "nothing replayed yet");
        exec.launch(&s)?;
        assert_eq!(alloc.stats().total.peak_allocated, 12 * MIB, "the replay's pool beside the later block");
        drop(later);
        Ok(())
    }

    /// Lent memory is opened through a capture's guard, for that capture alone: it serves the
    /// capture's allocations from the opening on, and none of the next capture's, which opens
    /// none (`PoolCapture::open_lent`).
    #[test]
    fn lent_memory_opened_by_a_capture_serves_that_capture_alone() -> Result<()> {
        let (s, alloc) = stream_and_allocator()?;
        let grads = alloc.alloc::<f32>(&s, MIB)?;
        let pool = alloc.new_pool();
        pool.lend(LentRange::of(7, &grads, 0..MIB).expect("aligned"));
        let lent = |b: &DeviceBuffer<f32>| alloc.block_of(b.id()).is_some_and(|e| e.lent);
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
        let before = alloc.alloc::<f32>(&s, 1024)?;
        cap.open_lent(&[7]);
        let after = alloc.alloc::<f32>(&s, 1024)?;
        assert!(!lent(&before) && lent(&after), "before the opening: {}, after: {}", lent(&before), lent(&after));
        drop((before, after));
        cap.finish()?;
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
        let next = alloc.alloc::<f32>(&s, 1024)?;
        assert!(!lent(&next), "the next capture took memory the last one opened");
        drop(next);
        cap.finish()?;
        pool.give_back_lent(None);
        Ok(())
    }
}
