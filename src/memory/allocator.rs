//! The caching allocator: device segments split into blocks by an [`Arena`], the same code on
//! both backends (only segment allocation differs), with graph pools for captures.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use super::arena::{block_size, segment_size, Arena, BlockInfo, FreeTag, SegmentId, Stats, StreamKey};
use super::pool::{GraphPool, PoolGraph, PoolId, PoolState};
use crate::device::memory::{Block, BlockOwner, Fence, MemKind, RawBuffer};
use crate::device::{ids, BufferId, Capture, CaptureMode, Device, DeviceBuffer, Elem, Stream, StreamId};
use crate::{Error, Result};

/// A stream key for blocks used on several streams: only a full synchronize orders them.
const MANY_STREAMS: StreamKey = u64::MAX;

/// Byte counts of the allocator: in total, outside pools, and per pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryStats {
    /// Everything.
    pub total: Stats,
    /// Blocks allocated outside captures.
    pub default: Stats,
    /// Each graph pool.
    pub pools: Vec<(PoolId, Stats)>,
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
}

/// A caching allocator over one device's memory.
///
/// Blocks are 256-byte aligned and come from 2 MiB segments (requests up to 1 MiB), 20 MiB
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
    poison: bool,
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
    next_segment: SegmentId,
    next_pool: u64,
    /// Which pool each allocator capture allocates from, by capture id.
    captures: HashMap<u64, PoolId>,
    /// Where each handed-out block is.
    live: HashMap<(Option<PoolId>, SegmentId, usize), BufferId>,
    /// Freed blocks waiting for their fence's event.
    fenced: Vec<Returned>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the bookkeeping consistent before it can fail.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl State {
    fn arena(&mut self, pool: Option<PoolId>) -> Option<&mut Arena> {
        match pool {
            None => Some(&mut self.default),
            Some(p) => self.pools.get_mut(&p).map(|p| &mut p.arena),
        }
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
            // Pool blocks follow the pool's replay order instead (note [Pool replay order]).
            let fence = fence.filter(|_| self.pool.is_none() && streams_used > 1);
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
        for mut r in returned {
            if let Some(f) = r.fence.take() {
                match f.event.query() {
                    Ok(true) => r.stream = Some(f.stream.raw()),
                    Ok(false) => {
                        r.fence = Some(f);
                        st.fenced.push(r);
                        continue;
                    }
                    // Its record cannot be waited for: the block waits for a synchronize.
                    Err(_) => {}
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
            }
        }
    }

    pub(crate) fn with_pool<T>(&self, pool: PoolId, f: impl FnOnce(&mut PoolState) -> T) -> Option<T> {
        lock(&self.state).pools.get_mut(&pool).map(f)
    }
}

impl CachingAllocator {
    /// An allocator over `dev`'s memory.
    pub fn new(dev: &Device) -> CachingAllocator {
        CachingAllocator::build(dev, false)
    }

    /// An allocator that fills every block it hands out with 0xFF bytes (NaN in f32, bf16 and
    /// f16), so that reading memory nobody wrote shows up in results.
    pub fn with_poison(dev: &Device) -> CachingAllocator {
        CachingAllocator::build(dev, true)
    }

    fn build(dev: &Device, poison: bool) -> CachingAllocator {
        let inner = Inner { dev: dev.clone(), poison, state: Mutex::default(), returned: Mutex::default() };
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
        const OP: &str = "CachingAllocator::alloc";
        self.inner.dev.check_same(OP, "stream", stream.device().id())?;
        let capture = stream.capture_id()?;
        let bytes = len * T::DTYPE.size();
        let mut st = lock(&self.inner.state);
        self.inner.take_returned(&mut st);
        let pool = match capture {
            None => None,
            Some(id) => Some(*st.captures.get(&id).ok_or(Error::NoCapturePool { op: OP, stream: stream.id() })?),
        };
        let key = stream.id().raw();
        let arena = st.arena(pool).ok_or(Error::NoCapturePool { op: OP, stream: stream.id() })?;
        let (segment, offset, size) = match arena.alloc(bytes, key) {
            Some(b) => b,
            None => {
                // Grown in relaxed mode, so that a capture on this thread is not invalidated (the
                // allocation itself is not captured: it is a plain cuMemAlloc).
                let seg_bytes = segment_size(block_size(bytes));
                let raw =
                    self.inner.dev.alloc_raw(seg_bytes, MemKind::Device, capture.is_some()).map_err(|e| match e {
                        Error::OutOfMemory { free, total, .. } => Error::OutOfMemory {
                            op: OP,
                            requested: seg_bytes,
                            what: "a new segment of the caching allocator",
                            free,
                            total,
                        },
                        other => other,
                    })?;
                let raw = Arc::new(raw);
                st.next_segment += 1;
                let id = st.next_segment;
                st.segments.insert(id, raw);
                let arena = st.arena(pool).expect("the arena was found above");
                arena.add_segment(id, seg_bytes);
                arena.alloc(bytes, key).expect("a new segment fits the request")
            }
        };
        let raw = st.segments[&segment].clone();
        let id = BufferId(ids::next_id());
        st.live.insert((pool, segment, offset), id);
        drop(st);
        let lease = Lease { alloc: Arc::downgrade(&self.inner), pool, segment, offset };
        let block = Block::new(raw, offset, Some(bytes.min(size)), id, Some(Arc::new(lease)));
        let buf = DeviceBuffer::from_block(block);
        if self.inner.poison {
            stream.memset(&buf, 0xFF)?;
        }
        Ok(buf)
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
        self.inner.dev.synchronize()?;
        let mut st = lock(&self.inner.state);
        self.inner.take_returned(&mut st);
        st.default.mark_all_ordered();
        for p in st.pools.values_mut() {
            p.arena.mark_all_ordered();
            p.forget_last_stream();
        }
        Ok(())
    }

    /// [`synchronize`](CachingAllocator::synchronize), then gives the device back every segment
    /// outside pools that has no block in use.
    pub fn empty_cache(&self) -> Result<()> {
        self.synchronize()?;
        let mut st = lock(&self.inner.state);
        for (segment, _) in st.default.release_empty() {
            st.segments.remove(&segment);
        }
        Ok(())
    }

    /// Byte counts: allocated, reserved and their peaks, in total, outside pools and per pool.
    pub fn stats(&self) -> MemoryStats {
        let mut st = lock(&self.inner.state);
        self.inner.take_returned(&mut st);
        let mut pools: Vec<(PoolId, Stats)> = st.pools.iter().map(|(id, p)| (*id, p.arena.stats())).collect();
        pools.sort_by_key(|(id, _)| *id);
        let default = st.default.stats();
        let mut total = default;
        for (_, s) in &pools {
            total.allocated += s.allocated;
            total.reserved += s.reserved;
            total.peak_allocated += s.peak_allocated;
            total.peak_reserved += s.peak_reserved;
        }
        MemoryStats { total, default, pools }
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
                })
            })
            .collect()
    }

    /// The segments of `pool`, as the [`Access::memory`](crate::device::Access::memory) of their
    /// blocks' accesses.
    pub fn pool_segments(&self, pool: &GraphPool) -> Vec<BufferId> {
        let st = lock(&self.inner.state);
        let mut ids: Vec<BufferId> = (st.pools.get(&pool.id).into_iter())
            .flat_map(|p| p.arena.blocks())
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

impl Drop for PoolCapture<'_> {
    fn drop(&mut self) {
        if self.cap.take().is_some() {
            let mut st = lock(&self.alloc.state);
            st.captures.remove(&self.id);
            if let Some(p) = st.pools.get_mut(&self.pool.id) {
                p.capturing = None;
            }
        }
    }
}
