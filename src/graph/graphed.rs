//! A graphed callable: its captured graphs, static surfaces and replay.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError};

use super::edge::{End, GraphEdge};
use super::error::refusal;
use super::in_place::Readers;
use super::output::StaticOutput;
use super::replay::{Origin, Route, StaticTensor, Tail};
use super::{GraphedErrorKind, Mode, Replay};
use crate::check::Checker;
use crate::device::{Event, EventId, Graph, NodeKind, RangeName, Stream};
use crate::memory::{GraphPool, PoolExec, PoolGraph};
use crate::nn::{Input, Inputs, SaveHook};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Which pass a graph captures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pass {
    /// The forward.
    Forward,
    /// The backward (input gradients, and weight gradients unless split).
    Backward,
    /// The split weight-gradient pass.
    BackwardDw,
}

impl Pass {
    /// Its name in profiler ranges: `forward`, `backward` or `backward_dw`.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
            Pass::BackwardDw => "backward_dw",
        }
    }

    /// Every pass, in the order of [`GraphedCallable`]'s range names.
    pub(crate) const ALL: [Pass; 3] = [Pass::Forward, Pass::Backward, Pass::BackwardDw];
}

/// One captured graph of a callable and its executable.
pub(crate) struct Captured {
    pub(crate) pass: Pass,
    pub(crate) graph: PoolGraph,
    pub(crate) exec: PoolExec,
    /// The typed edges it records or waits on ([`GraphOptions::signals`](super::GraphOptions::signals)).
    pub(crate) edges: Vec<(GraphEdge, End)>,
}

/// What the callables of one capture share.
pub(crate) struct Shared {
    pub(crate) sync_event: Option<Event>,
    pub(crate) mode: Mode,
    pub(crate) times: CaptureTimes,
}

/// Where the host time of one [`make_graphed_callables`](super::make_graphed_callables) (or
/// stack, or schedule) went: shared by the callables it made. vLLM reports its captures taking
/// up to a minute; these say which phase to shorten.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CaptureTimes {
    /// Saving what the warmup changes (the gradients and the passes' state, to the host), the
    /// warmup passes, the window probe if any, and restoring what they changed, until the device
    /// finished them.
    pub warmup: std::time::Duration,
    /// Recording the passes into graphs (host work only: a capture runs nothing).
    pub record: std::time::Duration,
    /// Verifying the graphs, instantiating them and enqueueing their uploads.
    pub instantiate: std::time::Duration,
}

impl CaptureTimes {
    /// The three together.
    pub fn total(&self) -> std::time::Duration {
        self.warmup + self.record + self.instantiate
    }
}

/// A static tensor of a surface and what it is.
pub(crate) struct Slot {
    pub(crate) input: Input,
    /// Whether it is the previous layer's output (in a stack): never copied into.
    pub(crate) chained: bool,
    /// The passes that read it, if a replay can read the caller's tensor in place instead.
    pub(crate) readers: Readers,
}

/// One callable of [`make_graphed_callables`](super::make_graphed_callables) (or one layer of a
/// [`GraphedStack`](super::GraphedStack)): its forward, backward and split weight-gradient
/// graphs, replayed over static buffers.
///
/// Outputs and input gradients are [`StaticTensor`]s: views of static buffers that the next
/// replay of the same graph overwrites, which they detect. Parameter gradients accumulate in
/// place into the parameters' own gradient buffers, so nothing a replay returns aliases them.
pub struct GraphedCallable {
    pub(crate) name: Arc<str>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) pool: GraphPool,
    /// Its graphs and static buffers; `None` once released, which every later call refuses.
    pub(crate) state: Option<StaticState>,
    pub(crate) positional: usize,
    /// A layer of a stack: replayed only through the stack.
    pub(crate) in_stack: bool,
    /// The last forward's replay choice, for the backward (R8).
    pub(crate) route: Mutex<Route>,
    pub(crate) done: Event,
    /// Its replays' range names (`replay h3.forward`), made once, indexed by `pass as usize`
    /// (declaration order, as [`Pass::ALL`]).
    pub(crate) ranges: [RangeName; 3],
    /// The dropout step counter its forward replays advance, and its place among the callables
    /// that share it; `None` when it draws nothing, or when a stack or a schedule's traversal
    /// advances the counter.
    pub(crate) draws: Option<(Arc<Draws>, usize)>,
    /// How many graph nodes the last replay's rebinding changed (see
    /// [`rebound_nodes`](GraphedCallable::rebound_nodes)).
    pub(crate) rebound: AtomicUsize,
}

/// What a graphed callable holds for its replays, and gives back in
/// [`release_static_state`](GraphedCallable::release_static_state): its graphs and executables,
/// the static buffers they replay over (outputs and input gradients in the graph pool, owned or
/// shared with the pool's later graphs (Note [Shared static outputs]); static inputs and output
/// gradients in the cache), and the save hook they baked in.
pub(crate) struct StaticState {
    pub(crate) graphs: Vec<Captured>,
    pub(crate) inputs: Vec<Slot>,
    pub(crate) outputs: Vec<StaticOutput>,
    pub(crate) grad_outputs: Vec<Tensor>,
    /// Per output gradient, the passes that read it, if it can be read in place.
    pub(crate) grad_readers: Vec<Readers>,
    pub(crate) grad_inputs: Vec<Option<StaticOutput>>,
    /// Per output, and per input gradient, what it is and the graphs that write its memory.
    pub(crate) output_origins: Vec<Origin>,
    pub(crate) grad_origins: Vec<Origin>,
    /// The save hook its graphs were captured with (its chunk's): kept alive with what they
    /// baked in of it, and told of every launch.
    pub(crate) hook: Arc<dyn SaveHook>,
}

/// The dropout step counter of callables graphed together, advanced by their forward replays
/// as a stack's forward advances it: by one before the forward of a callable that already drew at
/// the counter's value. Every forward replay of a callable then draws new masks, and callables
/// replayed once each per microbatch draw at one value per microbatch, as the eager stack does.
pub(crate) struct Draws {
    step: Tensor,
    /// Per callable sharing the counter, whether it drew at the counter's value.
    drawn: Mutex<Vec<bool>>,
}

impl Draws {
    /// The counter `step` of `members` callables. They start as if each had drawn at its value,
    /// so that the first forward advances it, as the stack's first forward does.
    pub(crate) fn new(step: &Tensor, members: usize) -> Draws {
        Draws { step: step.clone(), drawn: Mutex::new(vec![true; members]) }
    }

    /// Before a forward replay of callable `member` on `stream`: advances the counter if the
    /// callable drew at its value.
    fn before_forward(&self, member: usize, stream: &Stream) -> Result<()> {
        let mut drawn = self.drawn.lock().unwrap_or_else(PoisonError::into_inner);
        if drawn[member] {
            crate::ops::rng::step_add(&self.step, 1, stream)?;
            drawn.fill(false);
        }
        drawn[member] = true;
        Ok(())
    }
}

impl GraphedCallable {
    fn err(&self, kind: GraphedErrorKind) -> Error {
        Error::Graphed { callable: self.name.to_string(), kind }
    }

    /// Its name: the callable's name and index.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pool its graphs were captured into.
    pub fn pool(&self) -> &GraphPool {
        &self.pool
    }

    /// The event its graphs record for side-stream replays, if captured with one.
    pub fn sync_event(&self) -> Option<&Event> {
        self.shared.sync_event.as_ref()
    }

    /// Its graphs and static buffers, unless released.
    /// Its executables, every pass's (none once its static state is released).
    pub(crate) fn executables(&self) -> impl Iterator<Item = &PoolExec> {
        self.state.iter().flat_map(|st| st.graphs.iter().map(|c| &c.exec))
    }

    pub(crate) fn state(&self) -> Result<&StaticState> {
        self.state.as_ref().ok_or_else(|| self.err(GraphedErrorKind::Released))
    }

    /// The static input buffers, in [`Inputs::iter`] order: pass them to skip the copy-in.
    ///
    /// # Errors
    /// [`GraphedErrorKind::Released`] after [`release_static_state`](GraphedCallable::release_static_state).
    pub fn static_inputs(&self) -> Result<Vec<&Tensor>> {
        Ok(self.state()?.inputs.iter().map(|s| &s.input.tensor).collect())
    }

    /// The static output-gradient buffers: pass them to `backward` to skip the copy-in.
    ///
    /// # Errors
    /// [`GraphedErrorKind::Released`] after [`release_static_state`](GraphedCallable::release_static_state).
    pub fn static_grad_outputs(&self) -> Result<&[Tensor]> {
        Ok(&self.state()?.grad_outputs)
    }

    /// Whether `pass` was captured.
    pub(crate) fn has_pass(&self, pass: Pass) -> Result<bool> {
        Ok(self.state()?.graphs.iter().any(|c| c.pass == pass))
    }

    pub(crate) fn exec(&self, pass: Pass) -> Result<&PoolExec> {
        match self.state()?.graphs.iter().find(|c| c.pass == pass) {
            Some(c) => Ok(&c.exec),
            None if self.shared.mode == Mode::Inference => Err(self.err(GraphedErrorKind::Inference)),
            None => Err(self.err(GraphedErrorKind::NoSplitDw)),
        }
    }

    /// The route of `replay` from `caller`, or why it is refused.
    pub(crate) fn route_for(&self, caller: &Stream, replay: Replay<'_>) -> Result<Route> {
        let dev = self.pool.device();
        let same = |what, s: &Stream| dev.check_same("graphed replay", what, s.device().id());
        same("caller's stream", caller).map_err(|e| refusal(&self.name, e))?;
        if let Replay::Joined(s) | Replay::Side(s) = replay {
            same("replay stream", s).map_err(|e| refusal(&self.name, e))?;
        }
        Ok(match replay {
            Replay::Caller => Route::Caller,
            Replay::Joined(s) if s.id() == caller.id() => Route::Caller,
            Replay::Joined(s) => Route::Joined(s.clone()),
            Replay::Side(s) => {
                if self.shared.sync_event.is_none() {
                    return Err(self.err(GraphedErrorKind::NoSyncEvent));
                }
                if s.id() == caller.id() {
                    return Err(self.err(GraphedErrorKind::SideIsCaller));
                }
                Route::Side(s.clone())
            }
        })
    }

    /// The route of the last forward, for its backward (R8).
    pub(crate) fn last_route(&self) -> Route {
        self.route.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) fn refuse_in_stack(&self) -> Result<()> {
        match self.in_stack {
            true => Err(self.err(GraphedErrorKind::StackLayer)),
            false => Ok(()),
        }
    }

    /// Checks `given` against the static input slots: the same positional count, every named
    /// input once, equal shapes. Returns, per slot, the tensor to copy from (`None`: no copy).
    pub(crate) fn match_inputs<'a>(&self, given: &'a Inputs) -> Result<Vec<Option<&'a Tensor>>> {
        let slots = &self.state()?.inputs;
        let positional = given.positional_inputs();
        if positional.len() != self.positional {
            let (expected, found) = (self.positional, positional.len());
            return Err(self.err(GraphedErrorKind::InputCount { what: "positional inputs", expected, found }));
        }
        let mut named: BTreeMap<&str, &Tensor> = BTreeMap::new();
        for i in given.named_inputs() {
            let name = i.name.as_deref().unwrap_or_default();
            if named.insert(name, &i.tensor).is_some() {
                return Err(self.err(GraphedErrorKind::DuplicateInput { name: name.into() }));
            }
            if !slots.iter().any(|s| s.input.name.as_deref() == Some(name)) {
                return Err(self.err(GraphedErrorKind::UnknownInput { name: name.into() }));
            }
        }
        let mut sources = Vec::with_capacity(slots.len());
        for (k, slot) in slots.iter().enumerate() {
            let src = match &slot.input.name {
                None => &positional[k].tensor,
                Some(n) => {
                    named.get(n.as_str()).ok_or_else(|| self.err(GraphedErrorKind::MissingInput { name: n.clone() }))?
                }
            };
            sources.push(self.copy_source(src, &slot.input.tensor, || slot.input.label(k))?);
        }
        Ok(sources)
    }

    /// `src` if it must be copied into `dst` (`None` when it is `dst`), or a shape or type error.
    pub(crate) fn copy_source<'a>(
        &self,
        src: &'a Tensor,
        dst: &Tensor,
        label: impl FnOnce() -> String,
    ) -> Result<Option<&'a Tensor>> {
        let dev = self.pool.device();
        dev.check_same("graphed replay", "tensor", src.device_id()).map_err(|e| refusal(&self.name, e))?;
        if src.shape() != dst.shape() {
            let (expected, found) = (dst.shape().to_vec(), src.shape().to_vec());
            return Err(self.err(GraphedErrorKind::InputShape { input: label(), expected, found }));
        }
        if src.dtype() != dst.dtype() {
            let (expected, found) = (dst.dtype(), src.dtype());
            return Err(self.err(GraphedErrorKind::InputDType { input: label(), expected, found }));
        }
        Ok((!src.is_same_view(dst)).then_some(src))
    }

    /// The static buffer that a stack's input (forward) or upstream gradient (backward) is
    /// copied into.
    pub(crate) fn static_copy_target(&self, pass: Pass) -> Result<&Tensor> {
        let state = self.state()?;
        let target = match pass {
            Pass::Forward => state.inputs.first().map(|s| &s.input.tensor),
            _ => state.grad_outputs.first(),
        };
        let what = if pass == Pass::Forward { "inputs" } else { "output gradients" };
        target.ok_or_else(|| self.err(GraphedErrorKind::InputCount { what, expected: 1, found: 0 }))
    }

    /// Checks output gradients against the static ones; returns the tensors to copy.
    pub(crate) fn match_grad_outputs<'a>(&self, given: &[&'a Tensor]) -> Result<Vec<Option<&'a Tensor>>> {
        let statics = &self.state()?.grad_outputs;
        if given.len() != statics.len() {
            let (expected, found) = (statics.len(), given.len());
            return Err(self.err(GraphedErrorKind::InputCount { what: "output gradients", expected, found }));
        }
        (given.iter().zip(statics).enumerate())
            .map(|(k, (src, dst))| self.copy_source(src, dst, || format!("output gradient {k}")))
            .collect()
    }

    /// The edge ends of `pass`'s graph.
    fn edges(&self, pass: Pass) -> Result<&[(GraphEdge, End)]> {
        Ok(self.state()?.graphs.iter().find(|c| c.pass == pass).map_or(&[][..], |c| &c.edges[..]))
    }

    /// Refuses a replay of `pass` whose graph waits on an edge not produced since its last replay.
    pub(crate) fn check_edges(&self, pass: Pass) -> Result<()> {
        for (edge, _) in self.edges(pass)?.iter().filter(|(_, end)| *end == End::Consumer) {
            edge.check_produced().map_err(|kind| self.err(kind))?;
        }
        Ok(())
    }

    /// `replay` (`in_place.rs`) for a caller that has already checked this launch
    /// against the pool's order (a graphed stack checks its whole pass at once).
    pub(crate) fn replay_checked(
        &self,
        pass: Pass,
        caller: &Stream,
        route: &Route,
        sources: &[Option<&Tensor>],
        statics: &[&Tensor],
    ) -> Result<Tail> {
        let exec = self.exec(pass)?;
        let _range = caller.device().range(&self.ranges[pass as usize]);
        if let (Pass::Forward, Some((draws, member))) = (pass, &self.draws) {
            draws.before_forward(*member, caller)?;
        }
        for (src, dst) in sources.iter().zip(statics) {
            if let Some(src) = src {
                dst.copy_from(src, caller)?;
            }
        }
        let tail = self.launch(exec, caller, route)?;
        for (edge, end) in self.edges(pass)? {
            edge.launched(*end);
        }
        self.state()?.hook.replayed(caller)?;
        if pass == Pass::Forward {
            *self.route.lock().unwrap_or_else(PoisonError::into_inner) = route.clone();
        }
        Ok(tail)
    }

    /// Launches `exec` under `route` after the copies on `caller`; returns the tail.
    fn launch(&self, exec: &PoolExec, caller: &Stream, route: &Route) -> Result<Tail> {
        exec.launch_on(route.stream(caller), caller)?;
        match (route, &self.shared.sync_event) {
            (Route::Caller, _) => Ok(Tail::none()),
            (Route::Side(side), Some(event)) => {
                caller.wait(event)?;
                Ok(Tail::pending(&self.name, self.done.clone(), side, caller, &self.pool))
            }
            (Route::Joined(side) | Route::Side(side), _) => {
                self.pool.join_from(side, caller, &self.done)?;
                Ok(Tail::none())
            }
        }
    }

    /// The outputs of the last forward replay.
    pub(crate) fn static_outputs(&self) -> Result<Vec<StaticTensor>> {
        let state = self.state()?;
        Ok(state.outputs.iter().zip(&state.output_origins).map(|(y, o)| StaticTensor::new(y, &self.pool, o)).collect())
    }

    /// The input gradients of the last backward replay.
    pub(crate) fn static_grad_inputs(&self) -> Result<Vec<Option<StaticTensor>>> {
        let state = self.state()?;
        Ok((state.grad_inputs.iter().zip(&state.grad_origins))
            .map(|(g, o)| g.as_ref().map(|d| StaticTensor::new(d, &self.pool, o)))
            .collect())
    }

    /// Replays the forward graph: copies `inputs` into the static inputs on `caller` (skipping
    /// any input that is its static buffer), replays as `replay` says, and returns the outputs
    /// and the tail. The backward replays the same way unless told otherwise (R8).
    ///
    /// Keep the tail (`let (y, tail) = ...`) until the caller may wait for it: dropping it, as
    /// `let _ = g.forward(...)` does, joins it at once and gives up the overlap.
    ///
    /// # Errors
    /// [`Error::Graphed`] for every refusal: inputs that do not match the capture, a refused
    /// replay choice, a layer of a stack, a stream of another device, a replay out of the pool's
    /// order; nothing was copied or enqueued then.
    pub fn forward(&self, caller: &Stream, inputs: &Inputs, replay: Replay<'_>) -> Result<(Vec<StaticTensor>, Tail)> {
        self.forward_fed(caller, inputs, replay, false)
    }

    /// Replays the backward graph the way the last forward replayed: copies `grad_outputs` into
    /// the static output gradients (skipping any that is its static buffer), and returns one
    /// gradient per input (`None` for constant or unused inputs) and the tail. Parameter
    /// gradients accumulate into the parameters' gradient buffers.
    pub fn backward(&self, caller: &Stream, grad_outputs: &[&Tensor]) -> Result<(Vec<Option<StaticTensor>>, Tail)> {
        self.backward_routed(caller, grad_outputs, self.last_route())
    }

    /// [`backward`](GraphedCallable::backward) with another replay choice than the forward's.
    pub fn backward_with(
        &self,
        caller: &Stream,
        grad_outputs: &[&Tensor],
        replay: Replay<'_>,
    ) -> Result<(Vec<Option<StaticTensor>>, Tail)> {
        let route = self.route_for(caller, replay)?;
        self.backward_routed(caller, grad_outputs, route)
    }

    fn backward_routed(
        &self,
        caller: &Stream,
        grad_outputs: &[&Tensor],
        route: Route,
    ) -> Result<(Vec<Option<StaticTensor>>, Tail)> {
        self.backward_fed(caller, grad_outputs, route, false)
    }

    /// Replays the split weight-gradient graph (after the backward), the way the backward's
    /// forward replayed.
    pub fn backward_dw(&self, caller: &Stream) -> Result<Tail> {
        self.refuse_in_stack()?;
        self.replay(Pass::BackwardDw, caller, &self.last_route(), (&[], &[]), &[], false)
    }

    /// Gives back what the callable holds for its replays, once it will not be replayed again:
    /// waits for the device (so that no tail still runs: R4), destroys its executables (taking
    /// them out of the pool's replay order, so that the pool's other graphs replay without them)
    /// and its graphs, and drops its static buffers and the save hook they baked in. The pool's
    /// allocated bytes then drop to what other graphs of the pool hold; once none of them can
    /// run, its reserved bytes go back to the device. Later calls return
    /// [`GraphedErrorKind::Released`]; releasing again does nothing.
    ///
    /// A [`StaticTensor`] still held keeps its buffer (and the values of the last replay), so
    /// reading it stays correct; its bytes go back to the pool when it is dropped, and to the
    /// device at [`CachingAllocator::empty_cache`](crate::memory::CachingAllocator::empty_cache).
    /// The static inputs and output gradients live outside the pool: they go back to the
    /// allocator's cache, which `empty_cache` empties too.
    ///
    /// ```
    /// use graphed::device::Device;
    /// use graphed::graph::{make_graphed_callables, Callable, GraphOptions, GraphedErrorKind, Replay};
    /// use graphed::memory::CachingAllocator;
    /// use graphed::nn::{Builder, Inputs, Linear, ParamStore};
    /// use graphed::tensor::Tensor;
    ///
    /// let dev = Device::sim();
    /// let s = dev.stream()?;
    /// let alloc = CachingAllocator::new(&dev);
    /// let store = ParamStore::new(&alloc, &s, 64)?;
    /// let fc = Linear::new(&Builder::new(&store, &alloc, &s)?.pp("fc"), (4, 3))?;
    /// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
    /// let mut g = make_graphed_callables(&alloc, &[&fc as &dyn Callable], &[Inputs::one(&x)], GraphOptions::default())?;
    /// let (y, _tail) = g[0].forward(&s, &Inputs::one(&x), Replay::caller())?;
    /// let kept = y[0].to_owned(&alloc, &s)?; // a copy outside the pool outlives the graphs
    /// drop(y);
    /// g[0].release_static_state()?;
    /// let pool = g[0].pool().stats();
    /// assert_eq!((pool.allocated, pool.reserved), (0, 0));
    /// let refused = g[0].forward(&s, &Inputs::one(&x), Replay::caller()).unwrap_err();
    /// assert!(matches!(refused.graphed_kind(), Some(GraphedErrorKind::Released)));
    /// assert_eq!(kept.shape(), &[2, 3]);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// Device errors while waiting for it (nothing was released then); in the checker's strict
    /// mode, a hazard that the reset of an executable reports (everything was released).
    pub fn release_static_state(&mut self) -> Result<()> {
        if self.state.is_none() {
            return Ok(());
        }
        self.pool.device().synchronize()?;
        let dropped = self.drop_static_state();
        self.pool.trim()?;
        dropped
    }

    /// The part of [`release_static_state`](GraphedCallable::release_static_state) after the
    /// device was synchronized: resets every executable (the first error is returned, after all
    /// were reset) and drops the state; the pool is left untrimmed.
    pub(crate) fn drop_static_state(&mut self) -> Result<()> {
        let Some(mut state) = self.state.take() else { return Ok(()) };
        let reset: Vec<Result<()>> = state.graphs.iter_mut().map(|c| c.exec.reset()).collect();
        drop(state);
        reset.into_iter().collect()
    }

    /// Where the host time of the capture that made this callable went.
    pub fn capture_times(&self) -> CaptureTimes {
        self.shared.times
    }

    /// What was captured, for `graphed inspect`.
    ///
    /// # Errors
    /// [`GraphedErrorKind::Released`] after [`release_static_state`](GraphedCallable::release_static_state).
    pub fn report(&self) -> Result<CallableReport> {
        let state = self.state()?;
        let mut graphs = Vec::new();
        for c in &state.graphs {
            graphs.push(GraphReport {
                pass: c.pass,
                graph: c.graph.graph().id().to_string(),
                nodes: c.graph.graph().node_counts()?,
                records: c.graph.graph().external_record_events()?,
                tail: self.tail_of(c.graph.graph()),
                disabled: c.exec.disabled_ops(),
            });
        }
        let bytes = |ts: &mut dyn Iterator<Item = &Tensor>| ts.map(Tensor::bytes).sum::<usize>();
        Ok(CallableReport {
            name: self.name.to_string(),
            graphs,
            input_shapes: state.inputs.iter().map(|s| s.input.tensor.shape().to_vec()).collect(),
            output_shapes: state.outputs.iter().map(|y| y.tensor().shape().to_vec()).collect(),
            shared_outputs: state.outputs.iter().map(StaticOutput::is_shared).collect(),
            shared_grad_inputs: state
                .grad_inputs
                .iter()
                .map(|d| d.as_ref().is_some_and(StaticOutput::is_shared))
                .collect(),
            static_bytes: bytes(&mut state.inputs.iter().filter(|s| !s.chained).map(|s| &s.input.tensor))
                + bytes(&mut state.grad_outputs.iter()),
        })
    }

    /// What `graph` writes after its sync event (its tail), per operation, from the checker's
    /// summary of its capture; empty without a sync event.
    fn tail_of(&self, graph: &Graph) -> Vec<TailOp> {
        let (Some(event), Some(checker)) = (&self.shared.sync_event, Checker::of(graph.device())) else {
            return Vec::new();
        };
        let Some(point) = checker.sync_point(graph.id(), event.id()) else { return Vec::new() };
        let mut ops: Vec<TailOp> = Vec::new();
        for t in point.tail.iter().filter(|t| t.access.mode.writes()) {
            let bytes = t.access.region.len() * t.access.elem_bytes;
            match ops.iter_mut().find(|o| o.op == t.op) {
                Some(o) => {
                    o.writes += 1;
                    o.bytes += bytes;
                }
                None => ops.push(TailOp { op: t.op, writes: 1, bytes }),
            }
        }
        ops
    }

    /// The captured graphs, for DOT dumps and node listings; none once released.
    pub fn graphs(&self) -> Vec<(Pass, &Graph)> {
        self.state.iter().flat_map(|s| &s.graphs).map(|c| (c.pass, c.graph.graph())).collect()
    }
}

/// Bytes of the static buffers outside the pool (inputs that are not a neighbour's output, and
/// output gradients) of `callables`, each buffer once: what buffer reuse across microbatches
/// saves shows here. Released callables hold none.
pub fn static_bytes(callables: &[GraphedCallable]) -> usize {
    let mut seen = std::collections::HashSet::new();
    let statics = callables.iter().filter_map(|c| c.state.as_ref()).flat_map(|c| {
        let inputs = c.inputs.iter().filter(|s| !s.chained).map(|s| &s.input.tensor);
        inputs.chain(c.grad_outputs.iter())
    });
    statics.filter(|t| seen.insert(t.id())).map(Tensor::bytes).sum()
}

impl Drop for GraphedCallable {
    /// Releases the static state, which waits for the device first (R4: nothing of a graph may
    /// still run when its static buffers go back to the pool); an error is kept for the device's
    /// next call.
    fn drop(&mut self) {
        if let Err(e) = self.release_static_state() {
            self.pool.device().record_drop_err("a graphed callable (its release)", e);
        }
    }
}

impl std::fmt::Debug for GraphedCallable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GraphedCallable({}, {})",
            self.name,
            match &self.state {
                Some(s) => format!("{} graphs", s.graphs.len()),
                None => "released".into(),
            }
        )
    }
}

/// One graph of a [`CallableReport`].
#[derive(Debug, Clone)]
pub struct GraphReport {
    /// Which pass.
    pub pass: Pass,
    /// The graph's identity.
    pub graph: String,
    /// Nodes by kind.
    pub nodes: BTreeMap<NodeKind, usize>,
    /// The external events it records.
    pub records: Vec<EventId>,
    /// What it writes after the sync event (its tail), per operation; empty without one.
    pub tail: Vec<TailOp>,
    /// The operations of its executable's nodes turned off now, in capture order
    /// ([`GraphExec::disabled_ops`](crate::device::GraphExec::disabled_ops)).
    pub disabled: Vec<&'static str>,
}

/// Writes of one operation in a graph's tail (offload copies, say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailOp {
    /// The operation.
    pub op: &'static str,
    /// How many writes.
    pub writes: usize,
    /// Bytes written.
    pub bytes: usize,
}

/// What a graphed callable holds: its graphs and static surfaces.
#[derive(Debug, Clone)]
pub struct CallableReport {
    /// The callable.
    pub name: String,
    /// Its graphs, in capture order.
    pub graphs: Vec<GraphReport>,
    /// Shapes of the static inputs.
    pub input_shapes: Vec<Vec<usize>>,
    /// Shapes of the static outputs.
    pub output_shapes: Vec<Vec<usize>>,
    /// Per output, whether its memory is shared with the pool's later graphs (under a schedule
    /// with buffer reuse, an output read only by the next layer of its chunk), not the
    /// callable's own.
    pub shared_outputs: Vec<bool>,
    /// Per input, whether its gradient's memory is shared with the pool's later graphs (an
    /// input gradient read only by the previous layer of its chunk); `false` for no gradient.
    pub shared_grad_inputs: Vec<bool>,
    /// Bytes of static buffers outside the pool (inputs not chained, output gradients).
    pub static_bytes: usize,
}
