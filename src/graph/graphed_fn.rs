//! Any eager work captured as one graph, replayed on the caller's stream: the optimizer step of
//! a graphed training loop, say.

use super::edge::{Edges, End, GraphEdge};
use super::error::GraphedErrorKind;
use crate::device::{CaptureMode, Graph, RangeName, Stream};
use crate::memory::{CachingAllocator, GraphPool, PoolExec, PoolGraph};
use crate::Result;

/// Work captured by [`make_graphed_fn`], in a pool of its own.
pub struct GraphedFn {
    graph: PoolGraph,
    exec: PoolExec,
    /// Its name in errors (`graphed fn`, or as `with_name` says).
    name: String,
    /// Its replays' range name: `replay graphed fn`, or `replay {name}` (see `with_name`).
    range: RangeName,
    /// The edges it waits on or records ([`make_graphed_fn_with_edges`]).
    edges: Vec<(GraphEdge, End)>,
}

/// Captures what `f` enqueues on a capture stream into one graph (in a new pool of `alloc`, so
/// that it replays in any order with other graphs) and uploads it. Nothing runs: `f` is called
/// once, during the capture, and must not synchronize. Its scalars are frozen, so anything that
/// changes from step to step must live in device memory (the optimizer's step counter and
/// learning rate do).
///
/// ```
/// use graphed::device::Device;
/// use graphed::graph::make_graphed_fn;
/// use graphed::memory::CachingAllocator;
/// use graphed::ops::elementwise;
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let x = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0], &[2])?;
/// let double = make_graphed_fn(&alloc, |c| elementwise::scale(x.view::<f32>()?, x.view()?, 2.0, c))?;
/// double.replay(&s)?;
/// double.replay(&s)?;
/// assert_eq!(x.to_vec::<f32>(&s)?, vec![4.0, 8.0]);
/// # Ok::<(), graphed::Error>(())
/// ```
///
/// # Errors
/// `f`'s own errors and capture errors (work that cannot be captured); the capture then leaves
/// nothing behind.
pub fn make_graphed_fn(alloc: &CachingAllocator, f: impl FnOnce(&Stream) -> Result<()>) -> Result<GraphedFn> {
    make_graphed_fn_with_edges(alloc, Edges::default(), f)
}

/// As [`make_graphed_fn`], the graph taking part in typed edges ([`GraphEdge`]): it waits on
/// `edges.waits_on` before its work and records `edges.signals` after all of it, and each replay
/// of it that waits on an edge is refused unless the edge's producer was replayed since (see the
/// example on [`GraphEdge`]).
///
/// # Errors
/// [`GraphedErrorKind::EdgeTaken`] for an edge end another graph holds, or both ends of one edge,
/// before anything is captured; as [`make_graphed_fn`]. A failed capture takes no edge.
pub fn make_graphed_fn_with_edges(
    alloc: &CachingAllocator,
    edges: Edges<'_>,
    f: impl FnOnce(&Stream) -> Result<()>,
) -> Result<GraphedFn> {
    const NAME: &str = "graphed fn";
    let ends: Vec<(GraphEdge, End)> = (edges.waits_on.iter().map(|e| ((*e).clone(), End::Consumer)))
        .chain(edges.signals.iter().map(|e| ((*e).clone(), End::Producer)))
        .collect();
    for (i, (edge, end)) in ends.iter().enumerate() {
        edge.check_free(*end).map_err(|k| GraphEdge::error(NAME, k))?;
        if ends[..i].iter().any(|(other, _)| other.same(edge)) {
            let why =
                "appears twice in one capture (a graph waiting on its own record would wait forever); give it one end";
            return Err(GraphEdge::error(NAME, GraphedErrorKind::EdgeTaken { edge: edge.name().to_string(), why }));
        }
        alloc.device().check_same("make_graphed_fn_with_edges", "edge", edge.event().device().id())?;
    }
    let _range = alloc.device().range_with(|| "capture graphed fn".into());
    let stream = alloc.device().stream()?;
    let pool: GraphPool = alloc.new_pool();
    // The allocator's capture waits for the device first, so `f` may use work of any stream.
    let cap = alloc.capture(&stream, CaptureMode::ThreadLocal, &pool)?;
    for (edge, _) in ends.iter().filter(|(_, end)| *end == End::Consumer) {
        stream.wait_external(edge.event())?;
    }
    f(&stream)?;
    for (edge, _) in ends.iter().filter(|(_, end)| *end == End::Producer) {
        stream.record_external(edge.event())?;
    }
    let graph = cap.finish()?;
    graph.graph().set_name(NAME);
    let exec = graph.instantiate()?;
    exec.upload(&stream)?;
    stream.synchronize()?;
    for (edge, end) in &ends {
        edge.claim(*end);
    }
    Ok(GraphedFn { graph, exec, name: NAME.into(), range: RangeName::new("replay graphed fn"), edges: ends })
}

impl GraphedFn {
    /// Names its replays' profiler ranges `replay {name}` (`replay optimizer step`) instead of
    /// `replay graphed fn`, and its graph `name` in the reports of the collectives it holds.
    pub fn with_name(mut self, name: &str) -> GraphedFn {
        self.graph.graph().set_name(name);
        self.range = RangeName::new(&format!("replay {name}"));
        self.name = name.to_string();
        self
    }

    /// Replays the work on `caller`, after everything queued there (and, for the edges it waits
    /// on, after their producers' replays, on whatever stream those ran).
    ///
    /// # Errors
    /// [`GraphedErrorKind::EdgeNotProduced`] when an edge it waits on was not produced since its
    /// last replay, before anything is enqueued; launch errors.
    pub fn replay(&self, caller: &Stream) -> Result<()> {
        for (edge, _) in self.edges.iter().filter(|(_, end)| *end == End::Consumer) {
            edge.check_produced().map_err(|k| GraphEdge::error(&self.name, k))?;
        }
        let _range = caller.device().range(&self.range);
        self.exec.launch(caller)?;
        for (edge, end) in &self.edges {
            edge.launched(*end);
        }
        Ok(())
    }

    /// Its name in errors: `graphed fn`, or as [`with_name`](Self::with_name) set it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The captured graph, for inspection.
    pub fn graph(&self) -> &Graph {
        self.graph.graph()
    }
}

impl std::fmt::Debug for GraphedFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphedFn({})", self.graph.graph().id())
    }
}
