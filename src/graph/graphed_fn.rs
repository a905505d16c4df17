//! Any eager work captured as one graph, replayed on the caller's stream: the optimizer step of
//! a graphed training loop, say.

use crate::device::{CaptureMode, Graph, RangeName, Stream};
use crate::memory::{CachingAllocator, GraphPool, PoolExec, PoolGraph};
use crate::Result;

/// Work captured by [`make_graphed_fn`], in a pool of its own.
pub struct GraphedFn {
    graph: PoolGraph,
    exec: PoolExec,
    /// Its replays' range name: `replay graphed fn`, or `replay {name}` (see `with_name`).
    range: RangeName,
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
    let _range = alloc.device().range_with(|| "capture graphed fn".into());
    let stream = alloc.device().stream()?;
    let pool: GraphPool = alloc.new_pool();
    // The allocator's capture waits for the device first, so `f` may use work of any stream.
    let cap = alloc.capture(&stream, CaptureMode::ThreadLocal, &pool)?;
    f(&stream)?;
    let graph = cap.finish()?;
    graph.graph().set_name("graphed fn");
    let exec = graph.instantiate()?;
    exec.upload(&stream)?;
    stream.synchronize()?;
    Ok(GraphedFn { graph, exec, range: RangeName::new("replay graphed fn") })
}

impl GraphedFn {
    /// Names its replays' profiler ranges `replay {name}` (`replay optimizer step`) instead of
    /// `replay graphed fn`, and its graph `name` in the reports of the collectives it holds.
    pub fn with_name(mut self, name: &str) -> GraphedFn {
        self.graph.graph().set_name(name);
        self.range = RangeName::new(&format!("replay {name}"));
        self
    }

    /// Replays the work on `caller`, after everything queued there.
    pub fn replay(&self, caller: &Stream) -> Result<()> {
        let _range = caller.device().range(&self.range);
        self.exec.launch(caller)
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
