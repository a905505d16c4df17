//! How [`make_graphed_callables`](super::make_graphed_callables) warms up and captures.

use std::fmt;
use std::sync::Arc;

use super::probe::Probe;
use crate::device::{CaptureMode, Event, Stream};
use crate::memory::GraphPool;
use crate::nn::{Chunk, KeepOnDevice, SaveHook, Schedule};
use crate::Result;

/// Which pass a capture-time hook runs around.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Before a forward.
    ForwardPre,
    /// After a forward.
    Forward,
    /// Before a backward.
    BackwardPre,
    /// After a backward.
    Backward,
}

/// Forward and backward graphs (training), or forward graphs only (inference).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward, backward (and split weight-gradient) graphs.
    Training,
    /// Forward graphs only; the callables' modules should be in evaluation mode.
    Inference,
}

type WarmupHook = Box<dyn FnMut(&Stream) -> Result<()>>;
/// The first-iteration hook: the warmup's stream, and what each layer lends the pool (empty
/// without lending).
type FirstIterationHook = Box<dyn FnMut(&Stream, &[usize]) -> Result<()>>;
type PassHook = Box<dyn FnMut(usize, Phase, &Stream) -> Result<()>>;
type ChunkHandler = Box<dyn FnMut(Chunk) -> Result<Arc<dyn SaveHook>>>;
/// Given the capture stream and the probe to run, if it wants the callables' graph times.
type WindowProbe = Box<dyn FnMut(&Stream, &mut Probe<'_>) -> Result<()>>;

/// Options of [`make_graphed_callables`](super::make_graphed_callables) and
/// [`make_graphed_stack`](super::make_graphed_stack), built by chaining.
///
/// ```
/// use graphed::graph::GraphOptions;
/// let options = GraphOptions::default()
///     .warmup_iters(2)
///     .pre_warmup(|_| Ok(()))   // e.g. turn activation offloading off
///     .post_warmup(|_| Ok(())); // and on again
/// ```
pub struct GraphOptions {
    pub(crate) warmup_iters: usize,
    pub(crate) mode: Mode,
    pub(crate) pool: Option<GraphPool>,
    pub(crate) stream: Option<Stream>,
    pub(crate) capture_mode: CaptureMode,
    pub(crate) allow_unused_input: bool,
    pub(crate) pool_per_callable: bool,
    pub(crate) sync_event: Option<Event>,
    pub(crate) save_hook: Arc<dyn SaveHook>,
    pub(crate) chunk_handler: Option<ChunkHandler>,
    pub(crate) schedule: Option<Schedule>,
    pub(crate) layers_per_chunk: Option<Vec<usize>>,
    pub(crate) reuse_buffers: bool,
    pub(crate) lend_gradients: bool,
    pub(crate) pre_warmup: Option<WarmupHook>,
    pub(crate) post_warmup: Option<WarmupHook>,
    /// Called after the first warmup iteration, on the warmup stream, with what each layer
    /// lends the pool: where an offload manager whose policy is not frozen yet ends its
    /// recording iteration.
    pub(crate) first_iteration: Option<FirstIterationHook>,
    /// Called when the capture fails after a warmup that succeeded: where that offload manager
    /// forgets the policy the warmup froze, so that a refused capture changes nothing.
    pub(crate) abandoned: Option<Box<dyn FnMut()>>,
    /// Called after the warmup (before `post_warmup`), with the window probe
    /// (`super::probe`) to run: where an offload manager with the automatic policy times the
    /// layers' graphs before it decides.
    pub(crate) window_probe: Option<WindowProbe>,
    pub(crate) pass_hook: Option<PassHook>,
    pub(crate) grad_sync: Option<Arc<dyn super::GradSync>>,
    /// Typed edges the callables' passes take part in.
    pub(crate) edges: Vec<PassEdge>,
}

/// An end of a typed edge held by one pass of one callable.
#[derive(Clone, Debug)]
pub(crate) struct PassEdge {
    pub(crate) callable: usize,
    pub(crate) pass: super::Pass,
    pub(crate) edge: super::GraphEdge,
    pub(crate) end: super::edge::End,
    /// Given as the pass that completes the callable's gradients ([`GraphOptions::signals_gradients`]):
    /// `pass` is the backward until the capture knows whether the callable splits its weight
    /// gradients out.
    pub(crate) gradients: bool,
}

impl Default for GraphOptions {
    fn default() -> GraphOptions {
        GraphOptions {
            warmup_iters: 1,
            mode: Mode::Training,
            pool: None,
            stream: None,
            capture_mode: CaptureMode::ThreadLocal,
            allow_unused_input: false,
            pool_per_callable: false,
            sync_event: None,
            save_hook: Arc::new(KeepOnDevice),
            chunk_handler: None,
            schedule: None,
            layers_per_chunk: None,
            reuse_buffers: false,
            lend_gradients: false,
            pre_warmup: None,
            post_warmup: None,
            first_iteration: None,
            abandoned: None,
            window_probe: None,
            pass_hook: None,
            grad_sync: None,
            edges: Vec::new(),
        }
    }
}

impl GraphOptions {
    /// Eager iterations before capture, each running every callable's forward and then its
    /// backward, callable by callable; at least 1 in training. Default 1, where PyTorch and
    /// TransformerEngine take 3: graphed's modules make every lazy state (kernel modules,
    /// cuBLASLt and cuDNN plans, their workspaces) in their first call, and each further
    /// iteration costs a whole eager step of capture time (about 40 ms of the L step's). Raise
    /// it for callables that settle over several calls.
    pub fn warmup_iters(mut self, n: usize) -> GraphOptions {
        self.warmup_iters = n;
        self
    }

    /// Forward graphs only.
    pub fn inference(mut self) -> GraphOptions {
        self.mode = Mode::Inference;
        self
    }

    /// Captures into `pool`, shared with other captures (replayed in one cyclic order with them:
    /// replay contract R5), instead of a new pool.
    pub fn pool(mut self, pool: &GraphPool) -> GraphOptions {
        self.pool = Some(pool.clone());
        self
    }

    /// Warms up and captures on `stream` instead of a new stream. The legacy default stream
    /// cannot capture.
    pub fn stream(mut self, stream: &Stream) -> GraphOptions {
        self.stream = Some(stream.clone());
        self
    }

    /// Work on the parameter gradients inside the captured backward passes, such as the
    /// data-parallel reduction of `dist::DataParallel` (see [`GradSync`](super::GradSync)). The
    /// gradients are complete only after the stack's or tail's join. A callable's gradients are
    /// worked on after its last pass that accumulates them: its backward, or its split
    /// weight-gradient pass; under a schedule, its last microbatch's. Inference is refused
    /// before the warmup.
    pub fn grad_sync(mut self, sync: Arc<dyn super::GradSync>) -> GraphOptions {
        self.grad_sync = Some(sync);
        self
    }

    /// The capture mode (default [`CaptureMode::ThreadLocal`]).
    pub fn capture_mode(mut self, mode: CaptureMode) -> GraphOptions {
        self.capture_mode = mode;
        self
    }

    /// Lets a differentiable input get no gradient (it then has none at replay).
    pub fn allow_unused_input(mut self, allow: bool) -> GraphOptions {
        self.allow_unused_input = allow;
        self
    }

    /// Captures each callable (each layer of a stack) into a pool of its own instead of one
    /// shared pool: more memory, no replay order between them.
    pub fn pool_per_callable(mut self, yes: bool) -> GraphOptions {
        self.pool_per_callable = yes;
        self
    }

    /// Records `event` as an external event inside every graph, after the pass's last write the
    /// caller can observe and before the save hook's [`end_pass`](SaveHook::end_pass) joins the
    /// tail; verified at capture (R2, R3, R7). Side-stream replays
    /// ([`Replay::side`](super::Replay::side)) then resume the caller at it.
    pub fn sync_event(mut self, event: &Event) -> GraphOptions {
        self.sync_event = Some(event.clone());
        self
    }

    /// Where saved activations go, the same hook for every chunk (default: they stay on the
    /// device). The graphs keep it alive, with what they baked in of it (host buffers).
    pub fn save_hook(mut self, hook: Arc<dyn SaveHook>) -> GraphOptions {
        self.save_hook = hook;
        self.chunk_handler = None;
        self
    }

    /// Makes the save hook of each captured chunk (a microbatch of a pipeline stage) with `f`,
    /// called once per chunk before its warmup: TransformerEngine's `init_chunk_handler`, which
    /// an offload manager uses to keep one handler per chunk. A capture is one chunk
    /// ([`Chunk::default`]) until pipeline schedules capture several.
    pub fn init_chunk_handler(mut self, f: impl FnMut(Chunk) -> Result<Arc<dyn SaveHook>> + 'static) -> GraphOptions {
        self.chunk_handler = Some(Box::new(f));
        self
    }

    /// Called once before the whole warmup, on the warmup stream.
    pub fn pre_warmup(mut self, f: impl FnMut(&Stream) -> Result<()> + 'static) -> GraphOptions {
        self.pre_warmup = Some(Box::new(f));
        self
    }

    /// Called once after the whole warmup, on the warmup stream; also when the warmup failed,
    /// so that it pairs with [`pre_warmup`](GraphOptions::pre_warmup).
    pub fn post_warmup(mut self, f: impl FnMut(&Stream) -> Result<()> + 'static) -> GraphOptions {
        self.post_warmup = Some(Box::new(f));
        self
    }

    /// Called with (callable index, phase, stream) around every forward and backward of the
    /// warmup and of the capture (and of the window probe, which an offload manager's automatic
    /// policy asks for), outside the captured region: never part of a graph, never
    /// replayed (for work that cannot be captured, such as host-side state updates).
    pub fn capture_time_hook(mut self, f: impl FnMut(usize, Phase, &Stream) -> Result<()> + 'static) -> GraphOptions {
        self.pass_hook = Some(Box::new(f));
        self
    }
}

impl GraphOptions {
    /// Captures in the order of a pipeline `schedule` (see
    /// [`make_graphed_callables`](super::make_graphed_callables)): the callables are the
    /// chunks' layers, chunk by chunk, each chunk `callables / chunks` layers unless
    /// [`layers_per_chunk`](GraphOptions::layers_per_chunk) says otherwise.
    pub fn schedule(mut self, schedule: &Schedule) -> GraphOptions {
        self.schedule = Some(schedule.clone());
        self
    }

    /// With a schedule in training, lets callables share static input and output-gradient
    /// buffers where the schedule never uses them at once (TransformerEngine's
    /// `_reuse_graph_input_output_buffers`): a callable's inputs are in use from its forward to
    /// its backward (or split weight-gradient pass), its output gradients from its backward to
    /// that pass. Outputs that only the next layer of their chunk reads, and input gradients
    /// that only the previous layer of their chunk reads, go back to the pool once the capture
    /// reaches that reader, so that the graphs captured after it reuse their memory (Note
    /// [Shared static outputs] in `graph/output.rs`); what crosses a chunk stays the callable's.
    /// The caller then must replay in the schedule's order, which the pool enforces, and read an
    /// output before the next graph replays, which its [`StaticTensor`](super::StaticTensor)
    /// enforces.
    pub fn reuse_buffers(mut self, yes: bool) -> GraphOptions {
        self.reuse_buffers = yes;
        self
    }

    /// For [`make_graphed_stack`](super::make_graphed_stack) in training: each layer lends the
    /// memory of its parameters' gradients to the graph pool while they are dead, from the
    /// optimizer's read to the layer's backward, so that the activations of the layers above it
    /// live there instead of in more pool memory (PyTorch's graph pools get the same saving by
    /// placing gradients among the activations). Every layer's backward graph then begins by
    /// zeroing its gradients. The price is a contract: **the parameters' gradients hold data
    /// only from the backward replay to the next forward replay**, so one backward per
    /// optimizer step (no accumulation over microbatches: a second backward would start from
    /// zero), and the optimizer and anything else that reads gradients run between the backward
    /// and the next forward. Note [Lent gradients] in `graph/lend.rs` gives the rules.
    ///
    /// Refused ([`GraphedErrorKind::LendGradients`](super::GraphedErrorKind::LendGradients)) in
    /// inference, with a pool per callable, for a parameter shared by two layers or a layer that
    /// splits its weight gradients out, and by `make_graphed_callables`. Gradient work
    /// (`grad_sync`) runs on lent gradients as on kept ones: it has them from the backward on,
    /// until the join before the optimizer.
    pub fn lend_gradients(mut self, yes: bool) -> GraphOptions {
        self.lend_gradients = yes;
        self
    }

    /// The layers of each chunk of the schedule, when they differ between chunks.
    pub fn layers_per_chunk(mut self, layers: &[usize]) -> GraphOptions {
        self.layers_per_chunk = Some(layers.to_vec());
        self
    }

    /// The save hook of `chunk`: the chunk handler's, if one was given.
    pub(crate) fn chunk_hook(&mut self, chunk: Chunk) -> Result<Arc<dyn SaveHook>> {
        match &mut self.chunk_handler {
            Some(f) => f(chunk),
            None => Ok(self.save_hook.clone()),
        }
    }

    /// Sets the hook run after the first warmup iteration.
    pub(crate) fn after_first_iteration(
        mut self,
        f: impl FnMut(&Stream, &[usize]) -> Result<()> + 'static,
    ) -> GraphOptions {
        self.first_iteration = Some(Box::new(f));
        self
    }

    /// Sets the hook run when the capture fails after its warmup.
    pub(crate) fn on_abandon(mut self, f: impl FnMut() + 'static) -> GraphOptions {
        self.abandoned = Some(Box::new(f));
        self
    }

    /// Sets the hook run after the warmup with the window probe.
    pub(crate) fn window_probe(
        mut self,
        f: impl FnMut(&Stream, &mut Probe<'_>) -> Result<()> + 'static,
    ) -> GraphOptions {
        self.window_probe = Some(Box::new(f));
        self
    }

    /// Runs the first-iteration hook, if any, with what each layer lends (`lent`).
    pub(crate) fn run_first_iteration_hook(&mut self, stream: &Stream, lent: &[usize]) -> Result<()> {
        self.first_iteration.as_mut().map_or(Ok(()), |h| h(stream, lent))
    }

    /// Callable `callable`'s `pass` graph records `edge` as its last node, after all its work,
    /// tail included: it is the edge's producer ([`GraphEdge`](super::GraphEdge)).
    pub fn signals(mut self, callable: usize, pass: super::Pass, edge: &super::GraphEdge) -> GraphOptions {
        let (edge, end) = (edge.clone(), super::edge::End::Producer);
        self.edges.push(PassEdge { callable, pass, edge, end, gradients: false });
        self
    }

    /// The pass that completes callable `callable`'s parameter gradients records `edge` after
    /// all its work, tail included: its backward, or its weight-gradient pass where it splits
    /// those out. A consumer of `edge` then reads the gradients complete, whichever pass wrote
    /// them last ([`ReductionGraphs`](crate::dist::ReductionGraphs) reduces them so).
    pub fn signals_gradients(mut self, callable: usize, edge: &super::GraphEdge) -> GraphOptions {
        let (edge, end, pass) = (edge.clone(), super::edge::End::Producer, super::Pass::Backward);
        self.edges.push(PassEdge { callable, pass, edge, end, gradients: true });
        self
    }

    /// Callable `callable`'s `pass` graph waits on `edge` before its work: it is the edge's
    /// consumer, replayed only after the producer's replay of the same step, on any stream.
    /// With a sync event, such a wait is the one external wait a graph may have (R7): its
    /// producer was enqueued before it, so the caller cannot be the one to signal it.
    pub fn waits_on(mut self, callable: usize, pass: super::Pass, edge: &super::GraphEdge) -> GraphOptions {
        let (edge, end) = (edge.clone(), super::edge::End::Consumer);
        self.edges.push(PassEdge { callable, pass, edge, end, gradients: false });
        self
    }

    /// Moves the edges given as the gradients' ([`signals_gradients`](Self::signals_gradients))
    /// to the weight-gradient pass of the callables that `splits` says split theirs out.
    pub(crate) fn place_gradient_edges(&mut self, splits: impl Fn(usize) -> bool) {
        for e in self.edges.iter_mut().filter(|e| e.gradients && splits(e.callable)) {
            e.pass = super::Pass::BackwardDw;
        }
    }

    /// The edge ends of callable `i`'s `pass` graph.
    pub(crate) fn edges_of(&self, i: usize, pass: super::Pass) -> impl Iterator<Item = &PassEdge> + '_ {
        self.edges.iter().filter(move |e| e.callable == i && e.pass == pass)
    }

    /// Runs the capture-time hook, if any, for pass `phase` of callable `i`.
    pub(crate) fn run_pass_hook(&mut self, i: usize, phase: Phase, stream: &Stream) -> Result<()> {
        self.pass_hook.as_mut().map_or(Ok(()), |h| h(i, phase, stream))
    }
}

impl fmt::Debug for GraphOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphOptions")
            .field("warmup_iters", &self.warmup_iters)
            .field("mode", &self.mode)
            .field("pool", &self.pool)
            .field("capture_mode", &self.capture_mode)
            .field("allow_unused_input", &self.allow_unused_input)
            .field("pool_per_callable", &self.pool_per_callable)
            .field("sync_event", &self.sync_event.as_ref().map(|e| e.id()))
            .finish_non_exhaustive()
    }
}
