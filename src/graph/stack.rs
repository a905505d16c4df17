//! A graphed stack: the layers of an `nn::Stack` replayed as chained graphed callables, through
//! the same traversal as the eager stack.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use super::capture::distinct;
use super::error::refusal;
use super::graphed::{CaptureTimes, GraphedCallable, Pass};
use super::replay::{Route, StaticTensor, Tails};
use super::{GraphedErrorKind, Replay};
use crate::device::{Event, RangeName, Stream};
use crate::memory::{GraphPool, PoolExec};
use crate::nn::{backward_pass, forward_pass, Traverse};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The layers of a stack captured by [`make_graphed_stack`](super::make_graphed_stack): a replay
/// copies only the stack's input (forward) and upstream gradient (backward) into static buffers;
/// each layer reads the previous layer's static output directly. The stack keeps the route of
/// each forward for its backward (R8) and the tails of side-stream replays until
/// [`join`](GraphedStack::join). Replays take `&self`.
///
/// A step of several microbatches is `forward`, `backward` per microbatch, then `join` before
/// anything reads what the tails wrote (the optimizer). With lent gradients
/// (`GraphOptions::lend_gradients`) a step is one microbatch, and
/// [`take_gradients`](GraphedStack::take_gradients) comes before the optimizer.
pub struct GraphedStack {
    layers: Vec<GraphedCallable>,
    tails: Mutex<Tails>,
    /// The stack's random-number step counter, advanced before every forward replay.
    rng_step: Option<Tensor>,
    /// The range names of its passes (`stack forward`), indexed by `pass as usize`: the
    /// layers' replay ranges nest inside.
    ranges: [RangeName; 3],
    /// With lent gradients, whether a backward wrote the layers' gradients since they were last
    /// taken ([`take_gradients`](GraphedStack::take_gradients)); `None` without.
    written: Option<AtomicBool>,
}

/// Replays every layer's graph of one pass, layer by layer, collecting the tails.
struct Replayer<'a> {
    layers: &'a [GraphedCallable],
    caller: &'a Stream,
    /// The forward's route; the backward uses each layer's last one.
    route: Option<Route>,
    /// The stack's input (forward) or upstream gradient (backward), unless it is the static
    /// buffer itself.
    source: Option<&'a Tensor>,
    /// Whether the layer it feeds reads it in place where it can, rather than a copy.
    in_place: bool,
    tails: Tails,
}

impl Replayer<'_> {
    fn replay(&mut self, i: usize, pass: Pass, feeds_source: bool) -> Result<()> {
        let layer = &self.layers[i];
        let route = self.route.clone().unwrap_or_else(|| layer.last_route());
        let (sources, statics) = match feeds_source {
            true => {
                let target = layer.static_copy_target(pass)?;
                let readers = layer.fed_readers(pass)?;
                (layer.bind_sources(&[self.source], &[readers], self.in_place)?, vec![target])
            }
            false => (Vec::new(), Vec::new()),
        };
        // `GraphedStack::run` checked the whole pass against the pools' order.
        self.tails.push(layer.replay_checked(pass, self.caller, &route, &sources, &statics)?);
        Ok(())
    }
}

impl Traverse for Replayer<'_> {
    type Act = ();
    type Grad = ();
    type Saved = ();

    fn forward(&mut self, i: usize, (): ()) -> Result<((), ())> {
        self.replay(i, Pass::Forward, i == 0)?;
        Ok(((), ()))
    }

    fn backward(&mut self, i: usize, (): (), (): ()) -> Result<()> {
        self.replay(i, Pass::Backward, i + 1 == self.layers.len())
    }
}

impl GraphedStack {
    /// `lends`: its layers lend their gradients (`GraphOptions::lend_gradients`).
    pub(crate) fn new(layers: Vec<GraphedCallable>, rng_step: Option<Tensor>, lends: bool) -> GraphedStack {
        let ranges = Pass::ALL.map(|p| RangeName::new(&format!("stack {}", p.name())));
        let written = lends.then(|| AtomicBool::new(false));
        GraphedStack { layers, tails: Mutex::new(Tails::new()), rng_step, ranges, written }
    }

    /// With lent gradients, refuses a `pass` that the gradients' state does not allow: any
    /// replay while a backward's gradients wait to be taken (a forward would overwrite them with
    /// activations, a backward zero them). Changes nothing.
    fn check_lent(&self, pass: Pass) -> Result<()> {
        if !self.written.as_ref().is_some_and(|w| w.load(Ordering::Acquire)) {
            return Ok(());
        }
        Err(self.lent_order(match pass {
            Pass::Forward => "this forward would overwrite the gradients the last backward wrote, which were not taken",
            _ => "this backward would zero the gradients the last backward wrote, which were not taken",
        }))
    }

    fn lent_order(&self, what: &'static str) -> Error {
        let kind = GraphedErrorKind::LentOrder { what };
        Error::Graphed { callable: format!("graphed stack of {} layers", self.layers.len()), kind }
    }

    /// Says that the layers' gradients are about to be read (the optimizer step), so that the
    /// next forward may hold activations in their memory again: with lent gradients
    /// (`GraphOptions::lend_gradients`), call it once per step, after the backward and before
    /// the optimizer; without, it does nothing. It checks that the gradients are whole:
    /// lent memory holds the activations of the layers above until a backward writes it, and
    /// every backward zeroes it first, so a step must be one forward, one backward, then this.
    ///
    /// ```
    /// # use graphed::{device::Device, memory::CachingAllocator, graph::{make_graphed_stack, GraphOptions, Replay}};
    /// # use graphed::nn::{Builder, Linear, ParamStore, Stack};
    /// # use graphed::tensor::Tensor;
    /// # let dev = Device::sim();
    /// # let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
    /// # let store = ParamStore::new(&alloc, &s, 2 * (8 * 8 + 8))?;
    /// # let vb = Builder::new(&store, &alloc, &s)?;
    /// # let stack = Stack::new(vec![Linear::new(&vb.pp("a"), (8, 8))?, Linear::new(&vb.pp("b"), (8, 8))?]);
    /// # let x = Tensor::zeros(&alloc, &s, &[4, 8], graphed::device::DType::F32)?;
    /// let g = make_graphed_stack(&alloc, &stack, &x, GraphOptions::default().lend_gradients(true))?;
    /// g.forward(&s, &x, Replay::caller())?;
    /// g.backward(&s, &x)?;
    /// g.join(&s)?;
    /// g.take_gradients()?; // then the optimizer step
    /// assert!(g.take_gradients().is_err(), "no backward since");
    /// g.forward(&s, &x, Replay::caller())?;
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`GraphedErrorKind::LentOrder`] with lent gradients when no backward ran since the last
    /// call (after a forward alone, they hold activations); nothing changes then.
    pub fn take_gradients(&self) -> Result<()> {
        let Some(written) = &self.written else { return Ok(()) };
        match written.compare_exchange(true, false, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(_) => Err(self.lent_order(
                "the gradients were taken with no backward since they were last taken: they hold activations",
            )),
        }
    }

    fn first(&self) -> &GraphedCallable {
        &self.layers[0]
    }

    fn last(&self) -> &GraphedCallable {
        &self.layers[self.layers.len() - 1]
    }

    /// Every layer's `pass` is ready to replay (none was released; training graphs for a backward):
    /// checked first, so that a stack graphed for inference says so before any argument check.
    fn check_ready(&self, pass: Pass) -> Result<()> {
        self.layers.iter().try_for_each(|l| l.exec(pass).map(|_| ()))
    }

    fn run(
        &self,
        pass: Pass,
        caller: &Stream,
        route: Option<Route>,
        source: Option<&Tensor>,
        in_place: bool,
    ) -> Result<()> {
        let _range = caller.device().range(&self.ranges[pass as usize]);
        // The whole pass is checked against the pools' order before the input is copied.
        let mut execs = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            execs.push(layer.exec(pass)?);
        }
        if pass != Pass::Forward {
            execs.reverse();
        }
        let checked = route.clone().unwrap_or_else(|| self.last().last_route());
        PoolExec::check_launches(&execs, checked.stream(caller), caller).map_err(|e| self.refusal(e))?;
        // As the eager stack does: a new draw per forward, read by the graphs from device memory.
        if let (Pass::Forward, Some(step)) = (pass, &self.rng_step) {
            crate::ops::rng::step_add(step, 1, caller)?;
        }
        let mut r = Replayer { layers: &self.layers, caller, route, source, in_place, tails: Tails::new() };
        let result = match pass {
            Pass::Forward => forward_pass(&mut r, self.layers.len(), ()).map(|_| ()),
            _ => backward_pass(&mut r, vec![(); self.layers.len()], ()),
        };
        self.tails.lock().unwrap_or_else(PoisonError::into_inner).append(r.tails);
        result
    }

    /// Replays every layer's forward: copies `x` into the first layer's static input on `caller`
    /// (skipped when `x` is that buffer), replays as `replay` says, and returns the last layer's
    /// output.
    ///
    /// # Errors
    /// [`Error::Graphed`] for every refusal (an input of another shape, a refused replay choice, a
    /// stream of another device, a replay out of the pool's order); nothing was copied or
    /// enqueued then.
    pub fn forward(&self, caller: &Stream, x: &Tensor, replay: Replay<'_>) -> Result<StaticTensor> {
        self.forward_fed(caller, x, replay, false)
    }

    /// As [`forward`](GraphedStack::forward), the first layer reading `x` where it is instead of
    /// a copy when its graphs allow it ([`in_place_input`](GraphedStack::in_place_input)); keep
    /// `x` unchanged until the backward has run, as [`GraphedCallable::forward_in_place`] says.
    ///
    /// # Errors
    /// As [`forward`](GraphedStack::forward).
    pub fn forward_in_place(&self, caller: &Stream, x: &Tensor, replay: Replay<'_>) -> Result<StaticTensor> {
        self.forward_fed(caller, x, replay, true)
    }

    fn forward_fed(&self, caller: &Stream, x: &Tensor, replay: Replay<'_>, in_place: bool) -> Result<StaticTensor> {
        self.check_ready(Pass::Forward)?;
        self.check_lent(Pass::Forward)?;
        let first = self.first();
        let route = first.route_for(caller, replay)?;
        let target = first.static_copy_target(Pass::Forward)?;
        let source = first.copy_source(x, target, || "input 0".into())?;
        self.run(Pass::Forward, caller, Some(route), source, in_place)?;
        self.last().static_outputs()?.into_iter().next().ok_or_else(|| self.no_output())
    }

    /// Whether [`forward_in_place`](GraphedStack::forward_in_place) reads its input in place: the
    /// first layer's graphs read it only through graphed's kernels (without dropout, the residual
    /// add rides in a cuBLASLt epilogue, and the input is copied in).
    ///
    /// # Errors
    /// [`GraphedErrorKind::Released`] after [`release_static_state`](GraphedStack::release_static_state).
    pub fn in_place_input(&self) -> Result<bool> {
        Ok(self.first().fed_readers(Pass::Forward)?.is_some())
    }

    /// Whether [`backward_in_place`](GraphedStack::backward_in_place) reads its upstream
    /// gradient in place.
    ///
    /// # Errors
    /// As [`in_place_input`](GraphedStack::in_place_input).
    pub fn in_place_grad_output(&self) -> Result<bool> {
        Ok(self.last().fed_readers(Pass::Backward)?.is_some())
    }

    /// Replays every layer's backward, last layer first, each the way its forward replayed (R8):
    /// copies `dy` into the last layer's static output gradient (skipped when `dy` is that
    /// buffer) and returns the first layer's input gradient (`None` if it has none). Parameter
    /// gradients accumulate into the parameters' gradient buffers.
    ///
    /// # Errors
    /// As [`forward`](GraphedStack::forward).
    pub fn backward(&self, caller: &Stream, dy: &Tensor) -> Result<Option<StaticTensor>> {
        self.backward_fed(caller, dy, false)
    }

    /// As [`backward`](GraphedStack::backward), the last layer reading `dy` where it is when its
    /// graphs allow it (keep `dy` unchanged until the replay has run).
    ///
    /// # Errors
    /// As [`backward`](GraphedStack::backward).
    pub fn backward_in_place(&self, caller: &Stream, dy: &Tensor) -> Result<Option<StaticTensor>> {
        self.backward_fed(caller, dy, true)
    }

    fn backward_fed(&self, caller: &Stream, dy: &Tensor, in_place: bool) -> Result<Option<StaticTensor>> {
        self.check_ready(Pass::Backward)?;
        self.check_lent(Pass::Backward)?;
        let last = self.last();
        let source = last.match_grad_outputs(&[dy])?.pop().flatten();
        self.run(Pass::Backward, caller, None, source, in_place)?;
        if let Some(written) = &self.written {
            written.store(true, Ordering::Release);
        }
        Ok(self.first().static_grad_inputs()?.into_iter().next().flatten())
    }

    /// Replays the split weight-gradient graphs of the layers that have one, last layer first,
    /// each the way its forward replayed.
    ///
    /// # Errors
    /// As [`GraphedCallable::backward_dw`]: [`GraphedErrorKind::NoSplitDw`] when no layer splits
    /// its weight gradients out (the backward accumulated them all), [`GraphedErrorKind::Released`]
    /// and [`GraphedErrorKind::Inference`] as for the other passes; a refused replay out of the
    /// pools' order; nothing was enqueued then.
    pub fn backward_dw(&self, caller: &Stream) -> Result<()> {
        self.check_ready(Pass::Backward)?;
        let _range = caller.device().range(&self.ranges[Pass::BackwardDw as usize]);
        let mut splitting: Vec<&GraphedCallable> = Vec::new();
        for layer in self.layers.iter().rev() {
            if layer.has_pass(Pass::BackwardDw)? {
                splitting.push(layer);
            }
        }
        if splitting.is_empty() {
            // As a callable without a split pass refuses it, naming the stack.
            let kind = GraphedErrorKind::NoSplitDw;
            return Err(Error::Graphed { callable: format!("graphed stack of {} layers", self.layers.len()), kind });
        }
        // The whole pass is checked before the first launch, as `run` does.
        let mut execs = Vec::with_capacity(splitting.len());
        for layer in &splitting {
            execs.push(layer.exec(Pass::BackwardDw)?);
        }
        let checked = self.last().last_route();
        PoolExec::check_launches(&execs, checked.stream(caller), caller).map_err(|e| self.refusal(e))?;
        let mut tails = Tails::new();
        for layer in splitting {
            tails.push(layer.replay_checked(Pass::BackwardDw, caller, &layer.last_route(), &[], &[])?);
        }
        self.tails.lock().unwrap_or_else(PoisonError::into_inner).append(tails);
        Ok(())
    }

    /// Makes `caller` wait for the tails of every replay since the last join (R4): before the
    /// optimizer, or anything else that reads what the tails wrote.
    ///
    /// # Errors
    /// As [`Tails::join`]: a refused join leaves every tail pending.
    pub fn join(&self, caller: &Stream) -> Result<()> {
        self.tails.lock().unwrap_or_else(PoisonError::into_inner).join(caller)
    }

    /// The layers, for inspection (reports, graphs, static buffers); they replay only through the
    /// stack.
    pub fn layers(&self) -> &[GraphedCallable] {
        &self.layers
    }

    /// Where the host time of the stack's capture went (one capture made every layer).
    pub fn capture_times(&self) -> CaptureTimes {
        self.layers.first().map_or_else(CaptureTimes::default, GraphedCallable::capture_times)
    }

    /// The pool of the first layer (of every layer, unless captured with a pool per layer).
    pub fn pool(&self) -> &GraphPool {
        self.first().pool()
    }

    /// The sync event the graphs record, if captured with one.
    pub fn sync_event(&self) -> Option<&Event> {
        self.first().sync_event()
    }

    /// The first layer's static input: pass it to `forward` to skip the copy-in.
    ///
    /// # Errors
    /// [`GraphedErrorKind::Released`] after [`release_static_state`](GraphedStack::release_static_state).
    pub fn static_input(&self) -> Result<&Tensor> {
        self.first().static_copy_target(Pass::Forward)
    }

    /// The last layer's static output gradient: pass it to `backward` to skip the copy-in (a
    /// stack captured for inference has none).
    ///
    /// # Errors
    /// [`GraphedErrorKind::Released`] after [`release_static_state`](GraphedStack::release_static_state).
    pub fn static_grad_output(&self) -> Result<Option<&Tensor>> {
        Ok(self.last().static_grad_outputs()?.first())
    }

    /// Gives back what every layer holds for its replays
    /// ([`GraphedCallable::release_static_state`]): joins the pending tails and waits for the
    /// device once (R4), then destroys every layer's executables and graphs and drops their
    /// static buffers, so that the pools' allocated bytes drop to what other graphs hold and a
    /// pool none of whose graphs can run gives its reserved bytes back to the device. Later
    /// calls return [`GraphedErrorKind::Released`]; releasing again does nothing. A
    /// [`StaticTensor`] still held keeps its buffer until it is dropped.
    ///
    /// ```
    /// use graphed::device::Device;
    /// use graphed::graph::{make_graphed_stack, GraphOptions, GraphedErrorKind, Replay};
    /// use graphed::memory::CachingAllocator;
    /// use graphed::nn::{Builder, Linear, ParamStore, Stack};
    /// use graphed::tensor::Tensor;
    ///
    /// let dev = Device::sim();
    /// let s = dev.stream()?;
    /// let alloc = CachingAllocator::new(&dev);
    /// let store = ParamStore::new(&alloc, &s, 40)?;
    /// let vb = Builder::new(&store, &alloc, &s)?;
    /// let stack = Stack::new(vec![Linear::new(&vb.pp("fc0"), (4, 4))?, Linear::new(&vb.pp("fc1"), (4, 4))?]);
    /// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
    /// let mut graphed = make_graphed_stack(&alloc, &stack, &x, GraphOptions::default())?;
    /// let loss = graphed.forward(&s, &x, Replay::caller())?.to_owned(&alloc, &s)?;
    /// graphed.release_static_state()?; // evaluation is over: the pool's memory goes back
    /// assert_eq!(graphed.pool().stats().reserved, 0);
    /// let refused = graphed.forward(&s, &x, Replay::caller()).unwrap_err();
    /// assert!(matches!(refused.graphed_kind(), Some(GraphedErrorKind::Released)));
    /// assert_eq!(loss.shape(), &[2, 4]);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`GraphedCallable::release_static_state`].
    pub fn release_static_state(&mut self) -> Result<()> {
        if self.layers.iter().all(|l| l.state.is_none()) {
            return Ok(());
        }
        let tails = std::mem::take(&mut *self.tails.lock().unwrap_or_else(PoisonError::into_inner));
        drop(tails);
        self.first().pool().device().synchronize()?;
        let dropped: Vec<Result<()>> = self.layers.iter_mut().map(GraphedCallable::drop_static_state).collect();
        let pools: Vec<GraphPool> = self.layers.iter().map(|l| l.pool().clone()).collect();
        distinct(&pools).into_iter().try_for_each(GraphPool::trim)?;
        dropped.into_iter().collect()
    }

    /// A refusal of a pool below, naming the layer whose graph it refused.
    fn refusal(&self, e: Error) -> Error {
        let refused = match &e {
            Error::PoolOrder { graph, .. } | Error::PoolConcurrent { graph, .. } => Some(*graph),
            _ => None,
        };
        let layer = self.layers.iter().find(|l| l.graphs().iter().any(|(_, g)| Some(g.id()) == refused));
        refusal(layer.unwrap_or(self.first()).name(), e)
    }

    fn no_output(&self) -> Error {
        let kind = GraphedErrorKind::InputCount { what: "outputs of the last layer", expected: 1, found: 0 };
        Error::Graphed { callable: self.last().name().to_string(), kind }
    }
}

impl Drop for GraphedStack {
    /// Releases every layer with one wait for the device, instead of one per layer; an error is
    /// kept for the device's next call.
    fn drop(&mut self) {
        if let Err(e) = self.release_static_state() {
            self.first().pool().device().record_drop_err("a graphed stack (its release)", e);
        }
    }
}

impl std::fmt::Debug for GraphedStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphedStack({} layers)", self.layers.len())
    }
}
