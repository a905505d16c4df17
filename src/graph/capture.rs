//! `make_graphed_callables`: warmup, capture in execution order into one pool, verification of
//! the sync event, and the static surfaces. Transactional: on any error the parameters'
//! gradients, the pool's replay order and the hooks are as they were.

use std::sync::Arc;

use super::callable::{Callable, Inputs, Saved};
use super::graphed::{Captured, GraphedCallable, Pass, Shared, Slot};
use super::options::{GraphOptions, Mode, Phase};
use super::replay::{Origin, Route};
use super::verify::{verify_sync_point, Surface};
use super::GraphedErrorKind;
use crate::check::Checker;
use crate::device::{AccessMode, GraphId, Stream};
use crate::memory::{CachingAllocator, GraphPool, PoolGraph};
use crate::nn::Param;
use crate::tensor::Tensor;
use crate::{Error, Result};

fn refuse(kind: GraphedErrorKind) -> Error {
    Error::Graphed { callable: "make_graphed_callables".into(), kind }
}

/// Captures each callable's forward and backward into CUDA graphs (simulated ones on the
/// simulator) and returns callables that replay them over static buffers.
///
/// In order: `pre_warmup`; `warmup_iters` eager iterations on the capture stream (all forwards in
/// order, then all backwards in reverse, capture-time hooks around each pass); `post_warmup`
/// (also when the warmup failed); the parameters' gradients restored to their values before the
/// warmup; capture of every forward in order, then every backward in reverse, then every split
/// weight-gradient pass in reverse, all into one pool; verification of the sync event; upload.
/// The samples' values become the static inputs' initial contents.
///
/// ```
/// use graphed::device::Device;
/// use graphed::graph::{make_graphed_callables, Callable, GraphOptions, Inputs, Replay};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Linear, ParamStore};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let mut store = ParamStore::new(&alloc, &s, 64)?;
/// let fc = Linear::new(&mut store, &alloc, "fc", (4, 3), 1, &s)?;
/// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
/// let mut g = make_graphed_callables(&alloc, &[&fc as &dyn Callable], &[Inputs::args(&[&x])], GraphOptions::default())?;
/// let (y, _tail) = g[0].forward(&s, &Inputs::args(&[&x]), Replay::caller())?;
/// let dy = Tensor::from_host(&alloc, &s, &[1.0f32; 6], &[2, 3])?;
/// let (dx, _tail) = g[0].backward(&s, &[&dy])?;
/// assert_eq!(dx[0].as_ref().unwrap().shape(), &[2, 4]);
/// assert_eq!(y[0].get()?.shape(), &[2, 3]);
/// # Ok::<(), graphed::Error>(())
/// ```
///
/// # Errors
/// [`Error::Graphed`] for arguments that cannot be graphed or a capture that breaks the replay
/// contract; the callables' own errors; capture errors (work that cannot be captured).
pub fn make_graphed_callables(
    alloc: &CachingAllocator,
    callables: &[&dyn Callable],
    samples: &[Inputs],
    mut options: GraphOptions,
) -> Result<Vec<GraphedCallable>> {
    let n = callables.len();
    if n == 0 {
        return Err(refuse(GraphedErrorKind::NoCallables));
    }
    if samples.len() != n {
        return Err(refuse(GraphedErrorKind::SampleCount { callables: n, samples: samples.len() }));
    }
    let training = options.mode == Mode::Training;
    if training && options.warmup_iters == 0 {
        return Err(refuse(GraphedErrorKind::ZeroWarmup));
    }
    let names: Vec<String> = callables.iter().enumerate().map(|(i, c)| format!("{}#{i}", c.name())).collect();
    let named = |i: usize, kind| Error::Graphed { callable: names[i].clone(), kind };
    for (i, sample) in samples.iter().enumerate() {
        let mut seen = Vec::new();
        for name in sample.named_inputs().iter().filter_map(|x| x.name.as_deref()) {
            if seen.contains(&name) {
                return Err(named(i, GraphedErrorKind::DuplicateInput { name: name.into() }));
            }
            seen.push(name);
        }
        if options.chain && i > 0 && sample.positional_inputs().is_empty() {
            let output = samples[i - 1].positional().next().map(|t| t.shape().to_vec()).unwrap_or_default();
            return Err(named(i, GraphedErrorKind::ChainShape { output, input: vec![] }));
        }
    }

    let dev = alloc.device().clone();
    let stream = match &options.stream {
        Some(s) => s.clone(),
        None => dev.stream()?,
    };
    let pool = options.pool.clone().unwrap_or_else(|| alloc.new_pool());
    // Samples may come from any stream.
    alloc.synchronize()?;
    let statics = static_inputs(alloc, &stream, samples, options.chain)?;
    let params: Vec<Param> = callables.iter().flat_map(|c| c.parameters().into_iter().cloned()).collect();
    let grads_before = snapshot(alloc, &stream, &params)?;

    let mut w = Warmup { alloc, stream: &stream, callables, samples, statics: &statics, names: &names };
    if let Some(h) = &mut options.pre_warmup {
        h(&stream)?;
    }
    let warmed = w.run(&mut options);
    let post = options.post_warmup.as_mut().map_or(Ok(()), |h| h(&stream));
    let restored = restore(&stream, &params, &grads_before);
    drop(grads_before);
    warmed?;
    post?;
    restored?;

    let mark = pool.order_len();
    let captured = w.capture(&pool, &mut options);
    if captured.is_err() {
        pool.roll_back(mark);
    }
    let callables = captured?;
    stream.synchronize()?;
    Ok(callables)
}

/// The graphs of `pool` that write memory of `t` (all of them if the device's checker did not see
/// their captures, which cannot happen for captures made through the allocator).
fn writers_of(pool: &GraphPool, t: &Tensor<f32>) -> Arc<[GraphId]> {
    let order = pool.order();
    let (Some(checker), Ok(view)) = (Checker::of(pool.device()), t.view()) else { return order.into() };
    let access = view.access(AccessMode::Write);
    order.into_iter().filter(|g| checker.graph_writes(*g, &access).unwrap_or(true)).collect()
}

/// Static input buffers: copies of the samples, except the chained first inputs (`None`), which
/// are the previous callable's outputs.
fn static_inputs(
    alloc: &CachingAllocator,
    stream: &Stream,
    samples: &[Inputs],
    chain: bool,
) -> Result<Vec<Vec<Option<Tensor<f32>>>>> {
    let mut all = Vec::with_capacity(samples.len());
    for (i, sample) in samples.iter().enumerate() {
        let mut mine = Vec::with_capacity(sample.len());
        for (k, input) in sample.iter().enumerate() {
            if chain && i > 0 && k == 0 {
                mine.push(None);
                continue;
            }
            let t = Tensor::uninit(alloc, stream, input.tensor.shape())?;
            stream.copy_d2d(input.tensor.view()?, t.view()?)?;
            mine.push(Some(t));
        }
        all.push(mine);
    }
    Ok(all)
}

fn snapshot(alloc: &CachingAllocator, stream: &Stream, params: &[Param]) -> Result<Vec<Tensor<f32>>> {
    params
        .iter()
        .map(|p| {
            let t = Tensor::uninit(alloc, stream, p.grad.shape())?;
            stream.copy_d2d(p.grad.view()?, t.view()?)?;
            Ok(t)
        })
        .collect()
}

/// A callable's output gradients: `given[k]` where there is one; else, for the first output, the
/// next callable's first input gradient (`chained_dx`) when the shapes agree; else zeros.
fn output_grads(
    alloc: &CachingAllocator,
    stream: &Stream,
    outputs: &[Tensor<f32>],
    given: &[Option<Tensor<f32>>],
    chained_dx: Option<&Tensor<f32>>,
) -> Result<Vec<Tensor<f32>>> {
    (outputs.iter().enumerate())
        .map(|(k, y)| match (given.get(k).cloned().flatten(), chained_dx) {
            (Some(d), _) => Ok(d),
            (None, Some(dx)) if k == 0 && dx.shape() == y.shape() => Ok(dx.clone()),
            _ => Tensor::zeros(alloc, stream, y.shape()),
        })
        .collect()
}

fn restore(stream: &Stream, params: &[Param], saved: &[Tensor<f32>]) -> Result<()> {
    for (p, t) in params.iter().zip(saved) {
        stream.copy_d2d(t.view()?, p.grad.view()?)?;
    }
    stream.synchronize()
}

/// What the warmup and the capture share.
struct Warmup<'a> {
    alloc: &'a CachingAllocator,
    stream: &'a Stream,
    callables: &'a [&'a dyn Callable],
    samples: &'a [Inputs],
    statics: &'a [Vec<Option<Tensor<f32>>>],
    names: &'a [String],
}

/// A forward's results, kept for its backward.
struct Forward {
    inputs: Inputs,
    outputs: Vec<Tensor<f32>>,
    saved: Option<Saved>,
}

impl Warmup<'_> {
    fn err(&self, i: usize, kind: GraphedErrorKind) -> Error {
        Error::Graphed { callable: self.names[i].clone(), kind }
    }

    fn hook(options: &mut GraphOptions, i: usize, phase: Phase, stream: &Stream) -> Result<()> {
        options.pass_hook.as_mut().map_or(Ok(()), |h| h(i, phase, stream))
    }

    /// Callable `i`'s inputs: its statics, with the chained first input taken from `previous`.
    fn inputs(&self, i: usize, previous: Option<&Forward>) -> Result<Inputs> {
        let mut tensors = Vec::with_capacity(self.statics[i].len());
        for (k, t) in self.statics[i].iter().enumerate() {
            match (t, previous) {
                (Some(t), _) => tensors.push(t.clone()),
                (None, Some(prev)) => {
                    let out = prev
                        .outputs
                        .first()
                        .ok_or(self.err(i, GraphedErrorKind::ChainShape { output: vec![], input: vec![] }))?;
                    let want = self.samples[i].iter().nth(k).map(|x| x.tensor.shape().to_vec()).unwrap_or_default();
                    if out.shape() != want.as_slice() {
                        return Err(
                            self.err(i, GraphedErrorKind::ChainShape { output: out.shape().to_vec(), input: want })
                        );
                    }
                    tensors.push(out.clone());
                }
                (None, None) => unreachable!("only callables after the first are chained"),
            }
        }
        Ok(self.samples[i].with_tensors(tensors))
    }

    /// Checks a backward's gradients against the inputs: one per input, none missing for a
    /// differentiable input unless allowed.
    fn check_grads(&self, i: usize, inputs: &Inputs, grads: &[Option<Tensor<f32>>], allow_unused: bool) -> Result<()> {
        if grads.len() != inputs.len() {
            let (expected, found) = (inputs.len(), grads.len());
            return Err(self
                .err(i, GraphedErrorKind::InputCount { what: "input gradients from the backward", expected, found }));
        }
        for (k, (input, g)) in inputs.iter().zip(grads).enumerate() {
            if input.differentiable && g.is_none() && !allow_unused {
                return Err(self.err(i, GraphedErrorKind::UnusedInput { input: input.label(k) }));
            }
        }
        Ok(())
    }

    fn run(&mut self, options: &mut GraphOptions) -> Result<()> {
        let (stream, n) = (self.stream, self.callables.len());
        let training = options.mode == Mode::Training;
        for _ in 0..options.warmup_iters {
            let mut forwards: Vec<Forward> = Vec::with_capacity(n);
            for (i, c) in self.callables.iter().enumerate() {
                Self::hook(options, i, Phase::ForwardPre, stream)?;
                let inputs = self.inputs(i, forwards.last())?;
                let (outputs, saved) = c.forward(&inputs, options.save_hook.as_ref(), stream)?;
                Self::hook(options, i, Phase::Forward, stream)?;
                forwards.push(Forward { inputs, outputs, saved: Some(saved) });
            }
            if !training {
                continue;
            }
            let mut next_dx: Option<Tensor<f32>> = None;
            for i in (0..n).rev() {
                Self::hook(options, i, Phase::BackwardPre, stream)?;
                let f = &mut forwards[i];
                let chained_dx = if options.chain { next_dx.as_ref() } else { None };
                let dys = output_grads(self.alloc, stream, &f.outputs, &[], chained_dx)?;
                let saved = f.saved.take().expect("each forward is backed once");
                let grads = self.callables[i].backward(saved, &dys.iter().collect::<Vec<_>>(), stream)?;
                self.check_grads(i, &f.inputs, &grads, options.allow_unused_input)?;
                if self.callables[i].splits_dw() {
                    self.callables[i].backward_dw(stream)?;
                }
                Self::hook(options, i, Phase::Backward, stream)?;
                next_dx = grads.into_iter().next().flatten();
            }
        }
        stream.synchronize()
    }

    /// Captures every pass into `pool` and builds the graphed callables.
    fn capture(&self, pool: &GraphPool, options: &mut GraphOptions) -> Result<Vec<GraphedCallable>> {
        let (stream, n) = (self.stream, self.callables.len());
        let training = options.mode == Mode::Training;
        let (mode, event, save_hook) = (options.capture_mode, options.sync_event.clone(), options.save_hook.clone());
        let capture = |f: &mut dyn FnMut() -> Result<()>| -> Result<PoolGraph> {
            let cap = self.alloc.capture(stream, mode, pool)?;
            f()?;
            if let Some(e) = &event {
                stream.record_external(e)?;
            }
            save_hook.end_pass(stream)?;
            cap.finish()
        };
        let mut graphs: Vec<Vec<(Pass, PoolGraph)>> = (0..n).map(|_| Vec::new()).collect();
        let mut forwards: Vec<Forward> = Vec::with_capacity(n);
        for (i, c) in self.callables.iter().enumerate() {
            let inputs = self.inputs(i, forwards.last())?;
            Self::hook(options, i, Phase::ForwardPre, stream)?;
            let mut result = None;
            let g = capture(&mut || {
                result = Some(c.forward(&inputs, save_hook.as_ref(), stream)?);
                Ok(())
            })?;
            Self::hook(options, i, Phase::Forward, stream)?;
            let (outputs, saved) = result.expect("the forward ran");
            graphs[i].push((Pass::Forward, g));
            forwards.push(Forward { inputs, outputs, saved: training.then_some(saved) });
        }
        // Output gradients outside the pool, allocated before the backward captures.
        let mut grad_outputs: Vec<Vec<Option<Tensor<f32>>>> = Vec::with_capacity(n);
        for (i, f) in forwards.iter().enumerate() {
            let chained_next = options.chain && i + 1 < n;
            let mine = f
                .outputs
                .iter()
                .enumerate()
                .map(|(k, y)| match (training, chained_next && k == 0) {
                    (true, false) => Tensor::zeros(self.alloc, stream, y.shape()).map(Some),
                    _ => Ok(None),
                })
                .collect::<Result<Vec<_>>>()?;
            grad_outputs.push(mine);
        }
        let mut grad_inputs: Vec<Vec<Option<Tensor<f32>>>> = (0..n).map(|_| Vec::new()).collect();
        if training {
            for i in (0..n).rev() {
                let next_dx = grad_inputs.get(i + 1).and_then(|g| g.first().cloned().flatten());
                let dys = output_grads(self.alloc, stream, &forwards[i].outputs, &grad_outputs[i], next_dx.as_ref())?;
                Self::hook(options, i, Phase::BackwardPre, stream)?;
                let saved = forwards[i].saved.take().expect("each forward is backed once");
                let mut saved = Some(saved);
                let mut result = None;
                let g = capture(&mut || {
                    let s = saved.take().expect("captured once");
                    result = Some(self.callables[i].backward(s, &dys.iter().collect::<Vec<_>>(), stream)?);
                    Ok(())
                })?;
                Self::hook(options, i, Phase::Backward, stream)?;
                let grads = result.expect("the backward ran");
                self.check_grads(i, &forwards[i].inputs, &grads, options.allow_unused_input)?;
                graphs[i].push((Pass::Backward, g));
                grad_inputs[i] = grads
                    .into_iter()
                    .zip(forwards[i].inputs.iter())
                    .map(|(g, x)| g.filter(|_| x.differentiable))
                    .collect();
                grad_outputs[i] = dys.into_iter().map(Some).collect();
            }
            for i in (0..n).rev().filter(|i| self.callables[*i].splits_dw()) {
                let g = capture(&mut || self.callables[i].backward_dw(stream))?;
                graphs[i].push((Pass::BackwardDw, g));
            }
        }
        self.verify(pool, options, &graphs, &forwards, &grad_outputs, &grad_inputs)?;

        let shared =
            Arc::new(Shared { pool: pool.clone(), sync_event: options.sync_event.clone(), mode: options.mode });
        let dev = stream.device();
        let mut out = Vec::with_capacity(n);
        for (i, ((mine, f), (dys, dxs))) in
            graphs.into_iter().zip(forwards).zip(grad_outputs.into_iter().zip(grad_inputs)).enumerate()
        {
            let mut captured = Vec::with_capacity(mine.len());
            for (pass, graph) in mine {
                let exec = graph.instantiate()?;
                exec.upload(stream)?;
                captured.push(Captured { pass, graph, exec });
            }
            let inputs = f
                .inputs
                .iter()
                .enumerate()
                .map(|(k, x)| Slot { input: x.clone(), chained: self.statics[i][k].is_none() })
                .collect();
            let name = &self.names[i];
            let origin = |what: String, t: Option<&Tensor<f32>>| Origin {
                what: what.into(),
                writers: t.map_or_else(|| Arc::from([]), |t| writers_of(pool, t)),
            };
            let output_origins =
                f.outputs.iter().enumerate().map(|(k, y)| origin(format!("{name}: output {k}"), Some(y))).collect();
            let grad_origins = (dxs.iter().zip(f.inputs.iter()).enumerate())
                .map(|(k, (d, x))| origin(format!("{name}: gradient of {}", x.label(k)), d.as_ref()))
                .collect();
            out.push(GraphedCallable {
                name: self.names[i].clone(),
                shared: shared.clone(),
                graphs: captured,
                inputs,
                positional: f.inputs.positional_inputs().len(),
                outputs: f.outputs,
                grad_outputs: dys.into_iter().flatten().collect(),
                grad_inputs: dxs,
                output_origins,
                grad_origins,
                route: Route::Caller,
                entry: dev.event()?,
                done: dev.event()?,
                reset: false,
            });
        }
        Ok(out)
    }

    /// Checks every graph's sync event against the surfaces (R2, R3, R7).
    fn verify(
        &self,
        pool: &GraphPool,
        options: &GraphOptions,
        graphs: &[Vec<(Pass, PoolGraph)>],
        forwards: &[Forward],
        grad_outputs: &[Vec<Option<Tensor<f32>>>],
        grad_inputs: &[Vec<Option<Tensor<f32>>>],
    ) -> Result<()> {
        let Some(event) = &options.sync_event else { return Ok(()) };
        let graph_of = |i: usize, pass: Pass| graphs[i].iter().find(|(p, _)| *p == pass).map(|(_, g)| g.graph().id());
        let mut surfaces: Vec<Surface<'_>> = Vec::new();
        for (i, f) in forwards.iter().enumerate() {
            let name = &self.names[i];
            let (fwd, bwd) = (graph_of(i, Pass::Forward), graph_of(i, Pass::Backward));
            let mut add = |what: String, tensor, owner| surfaces.push(Surface { what, tensor, owner });
            for (k, x) in f.inputs.iter().enumerate() {
                // A chained input is the previous callable's output: its forward graph makes it.
                let owner = if self.statics[i][k].is_none() { graph_of(i - 1, Pass::Forward) } else { None };
                add(format!("{name} {}", x.label(k)), &x.tensor, owner);
            }
            for (k, y) in f.outputs.iter().enumerate() {
                add(format!("{name} output {k}"), y, fwd);
            }
            for (k, d) in grad_outputs[i].iter().flatten().enumerate() {
                let chained = options.chain && k == 0 && i + 1 < forwards.len();
                add(
                    format!("{name} output gradient {k}"),
                    d,
                    if chained { graph_of(i + 1, Pass::Backward) } else { None },
                );
            }
            for (k, d) in grad_inputs[i].iter().enumerate() {
                if let Some(d) = d {
                    add(format!("{name} gradient of input {k}"), d, bwd);
                }
            }
            for p in self.callables[i].parameters() {
                add(format!("parameter {}", p.name), &p.value, None);
                add(format!("gradient of {}", p.name), &p.grad, None);
            }
        }
        for (i, mine) in graphs.iter().enumerate() {
            for (_, g) in mine {
                verify_sync_point(self.alloc, pool, g.graph(), event, &surfaces).map_err(|kind| self.err(i, kind))?;
            }
        }
        Ok(())
    }
}
