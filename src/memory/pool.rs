//! Graph pools: memory shared by the graphs captured into it, and the replay order that makes
//! the sharing safe (replay contract R5).
//!
//! Note [Pool replay order]: a block freed inside the capture of graph A is reused by a later
//! capture B of the same pool, so A and B overlap in memory. Replaying them in capture order on
//! one stream is safe: B's reads of the shared block come after A is done with it. Any other
//! order, or A and B running at once on two streams, corrupts data silently on a GPU. The pool
//! therefore records the capture order and refuses a replay that breaks it (cyclically: after
//! the last graph comes the first again), and refuses a replay on another stream than the
//! previous one until [`GraphPool::join`] or [`CachingAllocator::synchronize`] orders them.
//! The pool keeps this bookkeeping itself: [`PoolExec::launch_on`] checks the order, makes the
//! replay stream wait for the caller's and advances the order, so no caller can forget a step.
//!
//! [`CachingAllocator::synchronize`]: super::CachingAllocator::synchronize

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use super::allocator::Inner;
use super::arena::{Arena, SegmentId, Stats, StreamKey, ALIGN};
use super::lifetimes::{Expectation, Lifetimes};
use crate::device::memory::Block;
use crate::device::{BufferId, DeviceBuffer, Elem, Event, Graph, GraphExec, GraphId, Stream};
use crate::{Error, Result};

/// Identity of a [`GraphPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub(crate) u64);

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pool{}", self.0)
    }
}

/// What the allocator keeps for a pool.
#[derive(Default)]
pub(crate) struct PoolState {
    pub(crate) arena: Arena,
    /// Graphs in capture order.
    order: Vec<GraphId>,
    /// Index in `order` of the graph that must be replayed next.
    cursor: usize,
    /// The previous replay: its graph and stream (a clone, to join on).
    last: Option<(GraphId, Stream)>,
    /// The capture in progress, and the streams that freed pool blocks during it.
    pub(crate) capturing: Option<u64>,
    pub(crate) capture_frees: BTreeSet<StreamKey>,
    /// Whether replays are checked (only tests that show the hazard turn this off).
    unguarded: bool,
    /// Launches of each graph so far.
    launches: HashMap<GraphId, u64>,
    /// Names given to graphs, for errors.
    names: HashMap<GraphId, String>,
    /// Memory lent to the pool (Note [Lent gradients]), and the lent segments the capture in
    /// progress may allocate from.
    pub(crate) lent: Vec<Lent>,
    open: Vec<SegmentId>,
    /// What the capture in progress expects of its allocations (Note [Pass-local blocks]).
    pub(crate) expect: Option<Expectation>,
}

/// A range of another owner's memory lent to a pool: a segment of its arena.
pub(crate) struct Lent {
    pub(crate) segment: SegmentId,
    /// Who lent it: the graph layer's index of the lender (a layer of a graphed stack).
    pub(crate) lender: usize,
    pub(crate) bytes: usize,
    /// Lent for a capture in progress: kept while the pool has no graph yet.
    pub(crate) pinned: bool,
    /// The owner's block, kept alive while the pool may hand out its memory.
    pub(crate) _keep: Arc<Block>,
}

/// Memory one owner lends: the 256-byte aligned part of a range of its block.
pub(crate) struct LentRange {
    /// Who lends it (a layer of a graphed stack).
    pub(crate) lender: usize,
    pub(crate) block: Arc<Block>,
    /// Where it begins in the block's allocation, and its length, in bytes.
    pub(crate) start: usize,
    pub(crate) bytes: usize,
}

impl LentRange {
    /// The aligned part of `buffer`'s elements `range`; `None` if nothing of it is aligned.
    pub(crate) fn of<T: Elem>(
        lender: usize,
        buffer: &DeviceBuffer<T>,
        range: std::ops::Range<usize>,
    ) -> Option<LentRange> {
        let block = buffer.block.clone();
        let size = T::DTYPE.size();
        let start = (block.base + range.start * size).div_ceil(ALIGN) * ALIGN;
        let end = (block.base + range.end.min(buffer.len()) * size) / ALIGN * ALIGN;
        (end > start).then_some(LentRange { lender, block, start, bytes: end - start })
    }
}

impl PoolState {
    pub(crate) fn add_graph(&mut self, graph: GraphId) {
        self.order.push(graph);
    }

    /// Whether no graph of the pool can run: none is in the replay order (every executable was
    /// reset), none is being captured, and replays are checked (an unchecked pool launches
    /// whatever it is asked to). Only then may the pool give memory back.
    pub(crate) fn idle(&self) -> bool {
        self.order.is_empty() && self.capturing.is_none() && !self.unguarded
    }

    /// The lent segments the capture in progress may allocate from.
    pub(crate) fn open_lent(&self) -> Vec<SegmentId> {
        self.open.clone()
    }

    /// No capture may allocate from lent memory until one opens it again
    /// ([`PoolCapture::open_lent`](super::PoolCapture::open_lent)).
    pub(crate) fn close_lent(&mut self) {
        self.open.clear();
        self.expect = None;
    }

    /// The lent segments an allocation of `bytes` on `stream` may take besides the open ones:
    /// those the expectation names if it dies within the pass (Note [Pass-local blocks]), else
    /// none.
    pub(crate) fn wide_for(&mut self, bytes: usize, stream: StreamKey) -> Vec<SegmentId> {
        let Some(e) = self.expect.as_mut().filter(|e| e.stream == stream) else { return Vec::new() };
        if e.pass_local(bytes) {
            e.wide.clone()
        } else {
            Vec::new()
        }
    }

    /// The host saw everything finish: a replay may use any stream next.
    pub(crate) fn forget_last_stream(&mut self) {
        self.last = None;
    }

    /// Whether launching `graphs` one after another on `stream` keeps the pool's order, when
    /// `stream` first waits for everything queued on `caller`; the first refusal otherwise.
    /// Changes nothing.
    fn check_run(&self, pool: PoolId, graphs: &[GraphId], stream: &Stream, caller: &Stream) -> Result<()> {
        if self.unguarded {
            return Ok(());
        }
        let mut cursor = self.cursor;
        let mut last = self.last.as_ref().map(|(g, s)| (*g, s.id()));
        if let Some((_, s)) = &mut last {
            if *s == caller.id() {
                *s = stream.id();
            }
        }
        for &graph in graphs {
            match self.order.get(cursor) {
                Some(next) if *next == graph => {}
                Some(next) => {
                    return Err(Error::PoolOrder {
                        pool,
                        graph,
                        graph_name: self.names.get(&graph).cloned(),
                        expected: *next,
                        expected_name: self.names.get(next).cloned(),
                    })
                }
                None => return Err(Error::GraphReset { op: "PoolExec::launch" }),
            }
            if let Some((previous, previous_stream)) = last {
                if previous_stream != stream.id() {
                    let stream = stream.id();
                    return Err(Error::PoolConcurrent {
                        pool,
                        graph,
                        graph_name: self.names.get(&graph).cloned(),
                        stream,
                        previous,
                        previous_name: self.names.get(&previous).cloned(),
                        previous_stream,
                    });
                }
            }
            cursor = (cursor + 1) % self.order.len();
            last = Some((graph, stream.id()));
        }
        Ok(())
    }

    pub(crate) fn launched(&mut self, graph: GraphId, stream: &Stream) {
        if let Some(i) = self.order.iter().position(|g| *g == graph) {
            self.cursor = (i + 1) % self.order.len();
        }
        self.last = Some((graph, stream.clone()));
        *self.launches.entry(graph).or_default() += 1;
    }

    /// Takes `graph` out of the replay order (its executable was reset).
    fn remove(&mut self, graph: GraphId) {
        self.names.remove(&graph);
        if let Some(i) = self.order.iter().position(|g| *g == graph) {
            self.order.remove(i);
            if i < self.cursor {
                self.cursor -= 1;
            }
            if self.cursor >= self.order.len() {
                self.cursor = 0;
            }
        }
    }
}

/// A pool of memory shared by the graphs captured into it. Cloning yields the same pool.
#[derive(Clone)]
pub struct GraphPool {
    pub(crate) id: PoolId,
    pub(crate) alloc: Arc<Inner>,
}

impl GraphPool {
    /// The pool's identity.
    pub fn id(&self) -> PoolId {
        self.id
    }

    /// Makes `stream` wait for every replay of the pool so far, so that the next replay may run
    /// on `stream`.
    pub fn join(&self, stream: &Stream) -> Result<()> {
        self.alloc.dev.check_same("GraphPool::join", "stream", stream.device().id())?;
        let last = self.alloc.with_pool(self.id, |p| p.last.as_ref().map(|(_, s)| s.clone()));
        if let Some(previous) = last.flatten() {
            if previous.id() != stream.id() {
                stream.wait_stream(&previous)?;
            }
        }
        self.alloc.with_pool(self.id, |p| {
            if let Some((_, s)) = &mut p.last {
                *s = stream.clone();
            }
        });
        Ok(())
    }

    /// The device of the pool's memory.
    pub fn device(&self) -> &crate::device::Device {
        &self.alloc.dev
    }

    /// The pool's byte counts: allocated, reserved, their peaks, and its largest free range.
    pub fn stats(&self) -> Stats {
        self.alloc.pool_stats(self.id).unwrap_or_default()
    }

    /// Waits for the device, then, if none of the pool's graphs can run any more (every
    /// executable was reset) and no capture of its allocator is active, gives the device back
    /// the pool's free memory: its fixed segments with no block in use and the free ends of its
    /// expandable segments. A pool whose blocks are all free then reserves nothing. The same
    /// path as [`CachingAllocator::empty_cache`](super::CachingAllocator::empty_cache), for one
    /// pool.
    pub(crate) fn trim(&self) -> Result<()> {
        self.alloc.trim_pool(self.id)
    }

    /// Lends `lent` to the pool, to be handed out only to the captures that its lender is opened
    /// to ([`GraphPool::open_lent`]). The pool keeps the lender's memory alive and gives it back
    /// when none of its graphs can run any more and none of its blocks there is held (Note [Lent
    /// gradients] in `graph/lend.rs` says when that is safe).
    pub(crate) fn lend(&self, lent: LentRange) {
        self.alloc.lend(self.id, lent);
    }

    /// Lets the capture in progress allocate from the memory of `lenders` (none: no lent memory):
    /// through its guard ([`PoolCapture::open_lent`](super::PoolCapture::open_lent)), since
    /// beginning a capture on an idle pool closes the pool's lent memory, and ending one does.
    pub(super) fn open_lent(&self, lenders: &[usize]) {
        self.alloc.with_pool(self.id, |p| {
            p.open = p.lent.iter().filter(|l| lenders.contains(&l.lender)).map(|l| l.segment).collect();
        });
    }

    /// Until [`GraphPool::end_expect`], the capture in progress expects its allocations on
    /// `stream`, the capture stream, to follow `lifetimes`, learned in the warmup of the same
    /// pass: those the warmup freed may take the memory of `wide` (lenders) too (Note
    /// [Pass-local blocks]).
    pub(crate) fn expect(&self, stream: &Stream, lifetimes: &Lifetimes, wide: &[usize]) {
        self.alloc.with_pool(self.id, |p| {
            let wide = p.lent.iter().filter(|l| wide.contains(&l.lender)).map(|l| l.segment).collect();
            p.expect = Some(Expectation::new(stream.id().raw(), lifetimes.clone(), wide));
        });
    }

    /// Ends the expectation [`GraphPool::expect`] began: the bytes of the blocks it placed in
    /// memory that only pass-local blocks may take and that are still held (a capture that holds
    /// any must be refused).
    pub(crate) fn end_expect(&self) -> usize {
        self.alloc.end_expect(self.id)
    }

    /// The memory `lenders` lent to the pool: each range's allocation and bytes there, as the
    /// accesses of its blocks name them.
    pub(crate) fn lent_memory(&self, lenders: &[usize]) -> Vec<(BufferId, std::ops::Range<usize>)> {
        self.alloc.lent_memory(self.id, lenders)
    }

    /// Ends the pin of the memory `lenders` lent: the capture it was lent for ended, and the pool
    /// gives the memory back once none of its graphs can run.
    pub(crate) fn unpin_lent(&self, lenders: &[usize]) {
        self.alloc.with_pool(self.id, |p| {
            p.lent.iter_mut().filter(|l| lenders.contains(&l.lender)).for_each(|l| l.pinned = false);
        });
    }

    /// Gives the memory lent by `lenders` (all lenders: `None`) that no block holds back to its
    /// owners, and the rest of `lenders`' once the pool is idle and its blocks free; closes the
    /// pool's lent memory to captures. The caller knows that no graph that may run uses it.
    pub(crate) fn give_back_lent(&self, lenders: Option<&[usize]>) {
        self.alloc.give_back_lent(self.id, lenders);
    }

    /// How many graphs the pool's order holds: a mark to [`GraphPool::roll_back`] to.
    pub(crate) fn order_len(&self) -> usize {
        self.alloc.with_pool(self.id, |p| p.order.len()).unwrap_or(0)
    }

    /// Forgets the graphs captured after `mark` (a capture that failed midway leaves the pool's
    /// order as it found it).
    pub(crate) fn roll_back(&self, mark: usize) {
        self.alloc.with_pool(self.id, |p| {
            p.order.truncate(mark);
            if p.cursor >= p.order.len() {
                p.cursor = 0;
            }
        });
    }

    /// Makes `into` wait, through `event` recorded on `from` now, for everything queued on
    /// `from`; if the pool's last replay ran there, its next may run on `into` (R5). The one way
    /// the graph layer orders a replay stream and the caller's, so that the pool's view of which
    /// stream may replay next cannot drift from the events that order them.
    pub(crate) fn join_from(&self, from: &Stream, into: &Stream, event: &Event) -> Result<()> {
        // The replay the record covers: the pool's last, if it ran on `from` before the record.
        let covered =
            self.alloc.with_pool(self.id, |p| p.last.as_ref().filter(|(_, s)| s.id() == from.id()).map(|(g, _)| *g));
        from.record(event)?;
        into.wait(event)?;
        if let Some(graph) = covered.flatten() {
            self.alloc.with_pool(self.id, |p| match &mut p.last {
                Some((g, s)) if *g == graph && s.id() == from.id() => *s = into.clone(),
                _ => {}
            });
        }
        Ok(())
    }

    /// Whether `other` is this pool (pool ids count from 1 in every allocator).
    fn is(&self, other: &GraphPool) -> bool {
        self.id == other.id && Arc::ptr_eq(&self.alloc, &other.alloc)
    }

    /// Names `graph` for the pool's errors (the graph layer names each graph by module and pass).
    pub fn name_graph(&self, graph: GraphId, name: impl Into<String>) {
        let name = name.into();
        self.alloc.with_pool(self.id, |p| p.names.insert(graph, name));
    }

    /// The name given to `graph` ([`GraphPool::name_graph`]), if any.
    pub fn graph_name(&self, graph: GraphId) -> Option<String> {
        self.alloc.with_pool(self.id, |p| p.names.get(&graph).cloned()).flatten()
    }

    /// How many times each of `graphs` was launched.
    pub(crate) fn launch_counts(&self, graphs: &[GraphId]) -> Vec<u64> {
        self.alloc
            .with_pool(self.id, |p| graphs.iter().map(|g| p.launches.get(g).copied().unwrap_or(0)).collect())
            .unwrap_or_default()
    }

    /// The graphs of the pool in their replay order.
    pub fn order(&self) -> Vec<GraphId> {
        self.alloc.with_pool(self.id, |p| p.order.clone()).unwrap_or_default()
    }

    /// Stops checking the replay order of this pool. Only for demonstrating what the check
    /// prevents: out-of-order replays then corrupt data.
    pub fn disable_order_check(&self) {
        self.alloc.with_pool(self.id, |p| p.unguarded = true);
    }
}

impl fmt::Debug for GraphPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GraphPool({})", self.id)
    }
}

/// A graph captured into a pool. Its executables replay only in the pool's order.
pub struct PoolGraph {
    pub(crate) graph: Graph,
    pub(crate) pool: GraphPool,
}

impl PoolGraph {
    /// The captured graph, for inspection.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The pool it was captured into.
    pub fn pool(&self) -> &GraphPool {
        &self.pool
    }

    /// Instantiates an executable that replays under the pool's order check.
    pub fn instantiate(&self) -> Result<PoolExec> {
        let entry = self.graph.device().event()?;
        Ok(PoolExec { exec: self.graph.instantiate()?, pool: self.pool.clone(), entry })
    }
}

/// An executable graph of a pool: its launches check and advance the pool's order (R5), so that
/// no caller has to.
pub struct PoolExec {
    exec: GraphExec,
    pool: GraphPool,
    /// Recorded on the caller's stream for a launch on another stream to wait for (R1).
    entry: Event,
}

impl PoolExec {
    /// The graph's identity.
    pub fn id(&self) -> GraphId {
        self.exec.id()
    }

    /// Uploads the executable (see [`GraphExec::upload`]).
    pub fn upload(&self, stream: &Stream) -> Result<()> {
        self.exec.upload(stream)
    }

    /// Launches the graph on `stream` if that keeps the pool's replay order (Note [Pool replay
    /// order]); otherwise [`Error::PoolOrder`] or [`Error::PoolConcurrent`], naming both graphs.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        self.launch_on(stream, stream)
    }

    /// Launches the graph on `stream` after everything queued on `caller` (`stream` waits for
    /// `caller` through an event, unless they are one stream), if that keeps the pool's replay
    /// order; otherwise [`Error::PoolOrder`] or [`Error::PoolConcurrent`], naming both graphs,
    /// before anything is enqueued. The pool learns of the wait itself: a replay on a side
    /// stream after one on the caller's is ordered, not concurrent.
    pub fn launch_on(&self, stream: &Stream, caller: &Stream) -> Result<()> {
        PoolExec::check_launches(&[self], stream, caller)?;
        if stream.id() != caller.id() {
            self.pool.join_from(caller, stream, &self.entry)?;
        }
        self.exec.launch(stream)?;
        self.pool.alloc.launched(self.pool.id, self.exec.id(), stream);
        Ok(())
    }

    /// Whether launching `execs` one after another, each with
    /// [`launch_on(stream, caller)`](PoolExec::launch_on), keeps their pools' replay orders; the
    /// refusal that the first out-of-order launch would get otherwise. Nothing changes either
    /// way, so a caller can refuse a replay of several graphs before it copies or enqueues
    /// anything.
    pub fn check_launches(execs: &[&PoolExec], stream: &Stream, caller: &Stream) -> Result<()> {
        for (k, exec) in execs.iter().enumerate() {
            // Each pool once, with its graphs in launch order.
            if execs[..k].iter().any(|e| e.pool.is(&exec.pool)) {
                continue;
            }
            let mine: Vec<GraphId> = execs.iter().filter(|e| e.pool.is(&exec.pool)).map(|e| e.id()).collect();
            let pool = exec.pool.id;
            exec.pool.alloc.with_pool(pool, |p| p.check_run(pool, &mine, stream, caller)).unwrap_or(Ok(()))?;
        }
        Ok(())
    }

    /// Moves the executable's captured reads (see [`GraphExec::rebind`]).
    pub fn rebind(&self, rebinds: &[crate::device::Rebind<'_>]) -> Result<usize> {
        self.exec.rebind(rebinds)
    }

    /// Turns the nodes naming `buffers` off or on (see [`GraphExec::set_enabled`]).
    pub fn set_enabled(&self, buffers: &[crate::device::BufferId], enabled: bool) -> Result<usize> {
        self.exec.set_enabled(buffers, enabled)
    }

    /// See [`GraphExec::resolve`].
    pub(crate) fn resolve(&self, rebind: &crate::device::Rebind<'_>) -> Result<crate::device::patch::Resolved> {
        self.exec.resolve(rebind)
    }

    /// See [`GraphExec::rebind_resolved`].
    pub(crate) fn rebind_resolved(&self, rebinds: &[crate::device::ResolvedRebind<'_>]) -> Result<usize> {
        self.exec.rebind_resolved(rebinds)
    }

    /// See [`GraphExec::sites_naming`].
    pub(crate) fn sites_naming(&self, buffers: &[crate::device::BufferId]) -> Result<Vec<usize>> {
        self.exec.sites_naming(buffers)
    }

    /// See [`GraphExec::set_sites_enabled`].
    pub(crate) fn set_sites_enabled(&self, sites: &[usize], enabled: bool) -> Result<usize> {
        self.exec.set_sites_enabled(sites, enabled)
    }

    /// See [`GraphExec::disabled_ops`].
    pub fn disabled_ops(&self) -> Vec<&'static str> {
        self.exec.disabled_ops()
    }

    /// How many captured nodes name `buffer`.
    pub(crate) fn naming(&self, buffer: crate::device::BufferId) -> usize {
        self.exec.naming(buffer)
    }

    /// Whether a captured node names `buffer`.
    pub(crate) fn names(&self, buffer: crate::device::BufferId) -> bool {
        self.exec.names(buffer)
    }

    /// The name its pool knows its graph by, if any.
    pub(crate) fn name(&self) -> Option<String> {
        self.pool.graph_name(self.exec.id())
    }

    /// Its pool's identity.
    pub(crate) fn pool_id(&self) -> PoolId {
        self.pool.id
    }

    /// Whether the pool's next graph in its replay order is its first: its replays are between
    /// two runs of the order (steps), not inside one.
    pub(crate) fn between_runs(&self) -> bool {
        self.pool.alloc.with_pool(self.pool.id, |p| p.cursor == 0).unwrap_or(true)
    }

    /// Destroys the executable (see [`GraphExec::reset`]) and takes its graph out of the pool's
    /// replay order, so that the pool's other graphs replay without it.
    pub fn reset(&mut self) -> Result<()> {
        if !self.exec.is_reset() {
            let graph = self.exec.id();
            self.pool.alloc.with_pool(self.pool.id, |p| p.remove(graph));
        }
        self.exec.reset()
    }

    /// Whether [`reset`](PoolExec::reset) was called.
    pub fn is_reset(&self) -> bool {
        self.exec.is_reset()
    }
}
