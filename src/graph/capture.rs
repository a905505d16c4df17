//! The entry points, [`make_graphed_callables`] and [`make_graphed_stack`], and the transaction
//! around warmup and capture: on any error the parameters' gradients, the pools' replay order and
//! the hooks are as they were.

use super::build::build;
use super::callable::Callable;
use super::edge::End;
use super::error::refusal;
use super::graphed::{CaptureTimes, Draws, Pass};
use super::lend::{Learned, Lending};
use super::options::{GraphOptions, Mode};
use super::plan::{Named, Plan, RangeLabel};
use super::probe::probe_windows;
use super::record::{record, Layout};
use super::warmup::warmup;
use super::{GraphedCallable, GraphedErrorKind, GraphedStack};
use crate::device::{with_dtype, DType, Stream};
use crate::memory::{CachingAllocator, GraphPool};
use crate::nn::{Chunk, Inputs, Module, Param, SaveHook, Schedule, Stack, Step};
use crate::ops::elementwise;
use crate::tensor::Tensor;
use crate::{Error, Result};
use std::sync::Arc;
use std::time::Instant;

fn refuse(kind: GraphedErrorKind) -> Error {
    Error::Graphed { callable: "make_graphed_callables".into(), kind }
}

/// Captures each callable's forward and backward into CUDA graphs (simulated ones on the
/// simulator) and returns callables that replay them over static buffers; each callable has its
/// own inputs (for a stack of layers that feed each other, see [`make_graphed_stack`]).
///
/// In order: `pre_warmup`; `warmup_iters` eager iterations on the capture stream, each running
/// every callable's forward and at once its backward (its outputs as their own gradients),
/// callable by callable (as PyTorch and TransformerEngine do: the warmup holds one callable's saved
/// activations at a time), capture-time hooks around each pass; with an offload manager's
/// automatic policy, its window probe (each callable's passes captured without offloading into
/// a pool of their own, replayed between timing events, and released); `post_warmup` (also when
/// the warmup failed); the parameters' gradients restored to their values before the
/// warmup; capture of every forward in order, then every backward in reverse, then every split
/// weight-gradient pass in reverse, all into one pool; verification of the sync event; upload.
/// The samples' values become the static inputs' initial contents.
///
/// In training, callables whose modules draw random numbers (dropout, see
/// [`Module::draws_from`]) own their step counter as a graphed stack does: a forward replay first
/// advances it by one if that callable already drew at its value, so that every forward draws new
/// masks and callables replayed once each per microbatch draw the masks of the eager stack; do
/// not advance it yourself. Under a schedule, [`nn::run_schedule`](crate::nn::run_schedule)
/// advances it instead (give it the counter).
///
/// ```
/// use graphed::device::Device;
/// use graphed::graph::{make_graphed_callables, Callable, GraphOptions, Replay};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Inputs, Linear, ParamStore};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &s, 64)?;
/// let fc = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(1).pp("fc"), (4, 3))?;
/// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
/// let g = make_graphed_callables(&alloc, &[&fc as &dyn Callable], &[Inputs::one(&x)], GraphOptions::default())?;
/// let (y, _tail) = g[0].forward(&s, &Inputs::one(&x), Replay::caller())?;
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
    options: GraphOptions,
) -> Result<Vec<GraphedCallable>> {
    if options.lend_gradients {
        let why = "is for make_graphed_stack, whose layers feed each other in a known order; graph a stack";
        return Err(refuse(GraphedErrorKind::LendGradients { why }));
    }
    let Some(schedule) = options.schedule.clone() else {
        if samples.len() != callables.len() {
            return Err(refuse(GraphedErrorKind::SampleCount { callables: callables.len(), samples: samples.len() }));
        }
        let names = callables.iter().enumerate().map(|(i, c)| named(i, *c)).collect();
        let training = options.mode == Mode::Training;
        let mut graphed =
            capture(alloc, callables, names, samples.iter().cloned().map(Some).collect(), None, options, None)?;
        if training {
            share_draws(callables, &mut graphed);
        }
        return Ok(graphed);
    };
    if options.mode == Mode::Inference {
        return Err(refuse(GraphedErrorKind::ScheduleInInference));
    }
    // One instance of each layer per microbatch, in the samples' order: chunk by chunk,
    // microbatch by microbatch, layer by layer.
    let microbatches = schedule.microbatches();
    let layers = chunk_layers(&options, &schedule, callables.len())?;
    if samples.len() != callables.len() * microbatches {
        let (samples, callables) = (samples.len(), callables.len());
        return Err(refuse(GraphedErrorKind::ScheduleSamples { samples, callables, microbatches }));
    }
    let (mut instances, mut names) = (Vec::with_capacity(samples.len()), Vec::with_capacity(samples.len()));
    schedule.check_weight_grads(&layers, &mut |l| Ok(callables[l].splits_dw_dyn()))?;
    let mut first = 0;
    for (k, &n) in layers.iter().enumerate() {
        for j in 0..microbatches {
            for (l, c) in callables.iter().enumerate().skip(first).take(n) {
                instances.push(*c);
                let label = format!("{} chunk {k} microbatch {j}", label(l, *c));
                names.push(Named { label, range: RangeLabel { layer: layer(l, *c), microbatch: Some(j) } });
            }
        }
        first += n;
    }
    let mut layout = Layout { schedule, layers, grad_sets: None, share_outputs: false };
    let mut input_sets = None;
    if options.reuse_buffers && options.mode == Mode::Training {
        // Inputs are keyed by their names, shapes and types, so that any layers may share.
        let signature = |i: usize| -> Vec<_> {
            samples[i].iter().map(|x| (x.name.clone(), x.tensor.shape().to_vec(), x.tensor.dtype())).collect()
        };
        let (inputs, grads) = layout.sharing(signature);
        input_sets = Some(inputs);
        layout.grad_sets = Some(grads);
        layout.share_outputs = true;
    }
    let samples = samples.iter().cloned().map(Some).collect();
    capture(alloc, &instances, names, samples, input_sets.as_deref(), options, Some(layout))
}

/// Captures the layers of `stack` as graphed callables chained through their static buffers:
/// layer i's outputs are layer i+1's static inputs and layer i+1's input gradients are layer i's
/// static output gradients, so a replay of the stack copies only its input and upstream
/// gradient. Warmup and capture are those of [`make_graphed_callables`]; `sample` is the first
/// layer's input, and each layer's warmup takes the previous layer's warmup output, so that the
/// warmup's peak memory is one layer's saved activations plus the chain of outputs. Like the
/// eager stack, every forward replay of training graphs first advances the stack's
/// random-number step counter ([`Stack::with_rng_step`]).
///
/// With activation offloading, pass
/// [`OffloadManager::graph_options`](crate::offload::OffloadManager::graph_options): the first
/// warmup iteration records what each layer saves, the manager freezes its policy, and the
/// capture bakes the host buffers into the graphs; no separate recording step is needed.
///
/// ```
/// use graphed::device::Device;
/// use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Linear, ParamStore, Stack};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &s, 40)?;
/// let vb = Builder::new(&store, &alloc, &s)?;
/// let stack = Stack::new(vec![
///     Linear::new(&vb.pp("fc0").with_seed(1), (4, 4))?,
///     Linear::new(&vb.pp("fc1").with_seed(2), (4, 4))?,
/// ]);
/// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
/// let graphed = make_graphed_stack(&alloc, &stack, &x, GraphOptions::default())?;
/// let y = graphed.forward(&s, &x, Replay::caller())?;
/// let dx = graphed.backward(&s, y.get()?)?;
/// graphed.join(&s)?;
/// assert_eq!(dx.map(|d| d.shape().to_vec()), Some(vec![2, 4]));
/// # Ok::<(), graphed::Error>(())
/// ```
///
/// # What is checked
/// Every replay is checked before anything is enqueued, and a refused call changes nothing: the
/// input's and upstream gradient's shape and element type, the streams' and the pool's device,
/// the pool's capture order and concurrent replays on another stream (R5), a side-stream replay
/// without a sync event or on the caller's own stream, a replay of a released stack, and a read of
/// a [`StaticTensor`](super::StaticTensor) that a later replay overwrote. At capture, the sync
/// event's placement (R2, R3, R7) and inputs that get no gradient.
///
/// # What stays the caller's duty
/// CUDA graphs replay fixed work at fixed addresses, so, as with PyTorch's
/// `make_graphed_callables`:
/// - keep the stack as captured: no layer added, removed or swapped, and parameters and their
///   gradients updated in place (as [`AdamW`](crate::optim::AdamW) and checkpoint restores do),
///   never moved to new buffers;
/// - set up every hook before the capture (offloading's save hook through
///   [`GraphOptions`], gradient reduction through `grad_sync`): replays run what was captured;
/// - keep in device memory whatever changes from step to step (a learning rate, a step counter):
///   the graphs freeze host values, launch scalars and host-side control flow, and no module may
///   synchronize with the host inside its passes;
/// - copy an output that you need after the next replay
///   ([`StaticTensor::to_owned`](super::StaticTensor::to_owned)): outputs and input gradients
///   live in buffers that replays reuse;
/// - join the tails ([`GraphedStack::join`]) before anything reads what they wrote, such as the
///   optimizer reading the gradients (R4);
/// - join any stream a module forks (a save hook's copies) before its pass returns;
/// - on CUDA, run a step with the checker on (`GRAPHED_CHECK=1`) after changing how work is
///   ordered: without it only captures are checked, not the races of eager work and replays.
///
/// # Errors
/// As [`make_graphed_callables`]; [`GraphedErrorKind::StackGradient`] when a layer gives no
/// gradient for an input that the layer before it produced.
pub fn make_graphed_stack<M: Module>(
    alloc: &CachingAllocator,
    stack: &Stack<M>,
    sample: &Tensor,
    options: GraphOptions,
) -> Result<GraphedStack> {
    let callables: Vec<&dyn Callable> = stack.layers().iter().map(|l| l as &dyn Callable).collect();
    if options.schedule.is_some() {
        return Err(refuse(GraphedErrorKind::ScheduleForStack));
    }
    // A stack replays each pass of its layers at once and checks no wait there; its layers'
    // records are counted as any callable's are.
    if let Some(e) = options.edges.iter().find(|e| e.end == End::Consumer) {
        let (edge, pass) = (e.edge.name().to_string(), format!("layer {}'s {}", e.callable, e.pass.name()));
        let why = "would wait inside its stack's pass, which replays its layers at once (a stack's layers may \
                   signal edges; give waits to make_graphed_callables' callables)";
        return Err(refuse(GraphedErrorKind::EdgePass { edge, pass, why }));
    }
    let samples = (0..callables.len()).map(|i| (i == 0).then(|| Inputs::one(sample))).collect();
    // Graphs for inference draw nothing: only training replays advance the counter.
    let rng_step = stack.rng_step().filter(|_| options.mode == Mode::Training).cloned();
    let names = callables.iter().enumerate().map(|(i, c)| named(i, *c)).collect();
    let lends = options.lend_gradients;
    let mut graphed = capture(alloc, &callables, names, samples, None, options, None)?;
    // Its layers replay only through the stack: their inputs are their neighbours' buffers.
    graphed.iter_mut().for_each(|g| g.in_stack = true);
    Ok(GraphedStack::new(graphed, rng_step, lends))
}

/// Warms up and captures `callables` (named `names`), in `layout`'s schedule if given, else as a
/// stack; `samples[i]` is `None` for a callable fed by the previous one's outputs.
fn capture(
    alloc: &CachingAllocator,
    callables: &[&dyn Callable],
    names: Vec<Named>,
    samples: Vec<Option<Inputs>>,
    input_sets: Option<&[usize]>,
    mut options: GraphOptions,
    layout: Option<Layout>,
) -> Result<Vec<GraphedCallable>> {
    check(alloc, callables.len(), &names, &samples, &options)?;
    let lending = Lending::plan(callables, &options)?;
    let n = callables.len();
    let dev = alloc.device().clone();
    // The whole capture, warmup included: its passes' ranges nest inside.
    let _range = dev.range_with(|| "graph capture".into());
    let stream = match &options.stream {
        Some(s) => s.clone(),
        None => dev.stream()?,
    };
    let pools: Vec<GraphPool> = match (&options.pool, options.pool_per_callable) {
        (_, true) => (0..n).map(|_| alloc.new_pool()).collect(),
        (Some(p), false) => vec![p.clone(); n],
        (None, false) => vec![alloc.new_pool(); n],
    };
    // Samples may come from any stream.
    alloc.synchronize()?;
    let hooks = chunk_hooks(&mut options, n, layout.as_ref())?;
    let plan = Plan::new(alloc, &stream, callables, names, &samples, input_sets, &options, hooks)?;
    options.place_gradient_edges(|i| callables.get(i).is_some_and(|c| c.splits_dw_dyn()));
    check_edges(&plan, &options, layout.is_some())?;
    // A schedule's layers appear once per microbatch: their parameters once.
    let mut params: Vec<Param> = Vec::new();
    for p in callables.iter().flat_map(|c| c.parameters_dyn()) {
        if !params.iter().any(|q| q.value.id() == p.value.id() && q.name == p.name) {
            params.push(p.clone());
        }
    }
    // What the warmup writes and must leave as it found it: the gradients and the passes' state.
    let kept: Vec<Tensor> =
        params.iter().map(|p| p.grad.clone()).chain(callables.iter().flat_map(|c| c.pass_state_dyn())).collect();
    let began = Instant::now();
    let kept_before = snapshot(&stream, &kept)?;

    if let Some(h) = &mut options.pre_warmup {
        h(&stream)?;
    }
    // The window probe, if asked for, runs with the warmup's state (offloading off, gradients
    // not yet restored), so that a failed probe is undone as a failed warmup is.
    let mut learned = Learned::new(lending.is_some());
    let warmed = warmup(&plan, &mut options, &mut learned, lending.as_ref())
        .and_then(|()| probe_windows(&plan, layout.as_ref(), lending.as_ref(), &mut options));
    let post = options.post_warmup.as_mut().map_or(Ok(()), |h| h(&stream));
    let restored = restore(alloc, &stream, &kept, &kept_before);
    drop(kept_before);
    warmed?;
    post?;
    restored?;
    stream.synchronize()?;
    let warmup_time = began.elapsed();

    let marks: Vec<(GraphPool, usize)> = distinct(&pools).into_iter().map(|p| (p.clone(), p.order_len())).collect();
    let began = Instant::now();
    let lent = lending.as_ref().map_or(Ok(()), |l| l.lend(&pools[0]));
    let captured = lent.and_then(|()| record(&plan, &pools, &mut options, layout.as_ref(), lending.as_ref(), &learned));
    let captured = captured.and_then(|mut recorded| {
        if lending.is_some() {
            Lending::seal(alloc, &pools[0], &mut recorded)?;
        }
        let times = CaptureTimes { warmup: warmup_time, record: began.elapsed(), ..CaptureTimes::default() };
        build(&plan, &pools, &options, recorded, times, lending.as_ref())
    });
    if captured.is_err() {
        for (pool, mark) in &marks {
            pool.roll_back(*mark);
        }
        if let Some(lending) = &lending {
            lending.give_back(&pools[0]);
        }
        if let Some(sync) = &options.grad_sync {
            sync.abandon();
        }
        if let Some(abandoned) = &mut options.abandoned {
            abandoned();
        }
    }
    let callables = captured?;
    if let Some(lending) = &lending {
        lending.unpin(&pools[0]);
    }
    stream.synchronize()?;
    Ok(callables)
}

/// The edges' refusals, before anything runs: an edge given to a pass the capture does not make,
/// an end another graph holds, or both ends of one edge in one graph.
fn check_edges(plan: &Plan<'_>, options: &GraphOptions, scheduled: bool) -> Result<()> {
    const OP: &str = "make_graphed_callables";
    for (k, e) in options.edges.iter().enumerate() {
        let name = e.edge.name().to_string();
        let pass = format!("callable {}'s {}", e.callable, e.pass.name());
        let why = if scheduled {
            Some("is a pass of a schedule's microbatches (edges are given to callables captured without a schedule)")
        } else if e.callable >= plan.len() {
            Some("does not exist: there are fewer callables")
        } else if e.pass != Pass::Forward && !plan.training {
            Some("an inference capture does not make")
        } else if e.pass == Pass::BackwardDw && !plan.callables[e.callable].splits_dw_dyn() {
            Some("does not exist: the callable does not split its weight gradients out")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(refuse(GraphedErrorKind::EdgePass { edge: name, pass, why }));
        }
        e.edge.check_free(e.end).map_err(refuse)?;
        let earlier = options.edges[..k].iter().filter(|o| o.edge.same(&e.edge));
        for o in earlier {
            let why = if o.callable == e.callable && o.pass == e.pass {
                "appears twice in one graph (a graph waiting on its own record would wait forever); give it one end"
            } else if o.end == e.end {
                "is given the same end twice; make one edge per producer and consumer"
            } else {
                continue;
            };
            return Err(refuse(GraphedErrorKind::EdgeTaken { edge: name, why }));
        }
        plan.alloc.device().check_same(OP, "edge", e.edge.event().device().id()).map_err(|e| refusal(OP, e))?;
    }
    Ok(())
}

/// [`capture`]'s refusals of its `n` callables' options and samples, before anything runs.
fn check(
    alloc: &CachingAllocator,
    n: usize,
    names: &[Named],
    samples: &[Option<Inputs>],
    options: &GraphOptions,
) -> Result<()> {
    if n == 0 {
        return Err(refuse(GraphedErrorKind::NoCallables));
    }
    let training = options.mode == Mode::Training;
    if training && options.warmup_iters == 0 {
        return Err(refuse(GraphedErrorKind::ZeroWarmup));
    }
    if options.pool_per_callable && options.pool.is_some() {
        return Err(refuse(GraphedErrorKind::ConflictingPools));
    }
    if options.grad_sync.is_some() && !training {
        let why = "needs training mode: inference captures no backward";
        return Err(refuse(GraphedErrorKind::GradSync { why }));
    }
    const OP: &str = "make_graphed_callables";
    if let Some(pool) = &options.pool {
        alloc.check_pool(OP, pool).map_err(|e| refusal(OP, e))?;
    }
    if let Some(stream) = &options.stream {
        alloc.device().check_same(OP, "stream", stream.device().id()).map_err(|e| refusal(OP, e))?;
    }
    for (i, sample) in samples.iter().enumerate() {
        let mut seen = Vec::new();
        for name in sample.iter().flat_map(|s| s.named_inputs()).filter_map(|x| x.name.as_deref()) {
            if seen.contains(&name) {
                let kind = GraphedErrorKind::DuplicateInput { name: name.into() };
                return Err(Error::Graphed { callable: names[i].label.clone(), kind });
            }
            seen.push(name);
        }
    }
    Ok(())
}

/// Gives the callables that draw random numbers ([`Callable::draws_from_dyn`]) their counter,
/// one [`Draws`] per counter, so that their forward replays advance it as a stack's forward does.
fn share_draws(callables: &[&dyn Callable], graphed: &mut [GraphedCallable]) {
    let mut counters: Vec<(&Tensor, Vec<usize>)> = Vec::new();
    for (i, step) in callables.iter().enumerate().filter_map(|(i, c)| Some((i, c.draws_from_dyn()?))) {
        match counters.iter_mut().find(|(t, _)| t.is_same_view(step)) {
            Some((_, members)) => members.push(i),
            None => counters.push((step, vec![i])),
        }
    }
    for (step, members) in counters {
        let draws = Arc::new(Draws::new(step, members.len()));
        for (member, i) in members.into_iter().enumerate() {
            graphed[i].draws = Some((draws.clone(), member));
        }
    }
}

/// The layers of each of `schedule`'s chunks among `callables` layers: as `options` says, else
/// the same number in each.
pub(crate) fn chunk_layers(options: &GraphOptions, schedule: &Schedule, callables: usize) -> Result<Vec<usize>> {
    let chunks = schedule.chunks();
    let layers = match &options.layers_per_chunk {
        Some(l) => l.clone(),
        None if callables.is_multiple_of(chunks) => vec![callables / chunks; chunks],
        None => return Err(refuse(GraphedErrorKind::UnevenChunks { callables, chunks })),
    };
    if layers.len() != chunks || layers.iter().sum::<usize>() != callables || layers.contains(&0) {
        return Err(refuse(GraphedErrorKind::LayersPerChunk { layers, chunks, callables }));
    }
    Ok(layers)
}

/// Each callable's save hook: its chunk's, made by the chunk handler once per chunk (a
/// microbatch of a virtual stage, in the order the schedule first runs it; one chunk without a
/// schedule).
fn chunk_hooks(options: &mut GraphOptions, n: usize, layout: Option<&Layout>) -> Result<Vec<Arc<dyn SaveHook>>> {
    let Some(layout) = layout else {
        return Ok(vec![options.chunk_hook(Chunk::default())?; n]);
    };
    let mut hooks: Vec<Option<Arc<dyn SaveHook>>> = vec![None; n];
    let mut chunk: Option<Arc<dyn SaveHook>> = None;
    for v in layout.schedule.visits(&layout.layers) {
        let Step::Forward(k) = v.step else { continue };
        // A forward step visits its chunk's first layer first: one hook per chunk.
        if v.in_chunk == 0 {
            chunk = Some(options.chunk_hook(Chunk { microbatch: v.microbatch, stage: k })?);
        }
        hooks[v.instance] = chunk.clone();
    }
    Ok(hooks.into_iter().map(|h| h.expect("a validated schedule runs every chunk's forward")).collect())
}

/// The name a callable's parameters start with (`h1`), if it has any.
fn prefix(c: &dyn Callable) -> Option<String> {
    c.parameters_dyn().first().and_then(|p| p.name.split('.').next().map(str::to_string))
}

/// A callable's name in errors and reports: its type and index, and the name its parameters
/// start with (`TransformerLayer#1 (h1)`), which tells apart layers of different captures.
fn label(i: usize, c: &dyn Callable) -> String {
    match prefix(c) {
        Some(p) => format!("{}#{i} ({p})", c.name()),
        None => format!("{}#{i}", c.name()),
    }
}

/// A callable's layer in profiler ranges: the name its parameters start with (`h1`), the way a
/// model names its layers, else its type and index (`Linear#1`).
fn layer(i: usize, c: &dyn Callable) -> String {
    prefix(c).unwrap_or_else(|| format!("{}#{i}", c.name()))
}

/// Callable `i`'s names outside a schedule.
fn named(i: usize, c: &dyn Callable) -> Named {
    Named { label: label(i, c), range: RangeLabel { layer: layer(i, c), microbatch: None } }
}

/// Each pool of `pools` once.
pub(crate) fn distinct(pools: &[GraphPool]) -> Vec<&GraphPool> {
    let mut out: Vec<&GraphPool> = Vec::new();
    for p in pools {
        if !out.iter().any(|q| q.id() == p.id()) {
            out.push(p);
        }
    }
    out
}

/// A tensor the warmup writes (a parameter's gradient, which it accumulates into; an FP8 amax
/// slot) as it was before: kept in host memory, since a device copy of every gradient would add
/// their whole size to the capture's peak (1.6 GB at the benchmark's L); none when it was all
/// zero bits (the common case of a capture before the first step), restored by zeroing.
struct HostCopy(Option<Vec<u8>>);

/// The kept tensors as the warmup must give them back. Which are all zero bits is found on the
/// device, one flag per tensor read back at once, so that zero gradients (a capture before
/// training, or after an optimizer step) cost no copy of their bytes to the host; the others
/// are copied.
fn snapshot(stream: &Stream, tensors: &[Tensor]) -> Result<Vec<HostCopy>> {
    if tensors.is_empty() {
        return Ok(Vec::new());
    }
    let dev = stream.device();
    let tested = |t: &Tensor| t.is_contiguous() && matches!(t.dtype(), DType::F32 | DType::BF16);
    let start: Vec<u32> = tensors.iter().map(|t| u32::from(!tested(t))).collect();
    let flags = dev.alloc_from(stream, &start)?;
    for (i, t) in tensors.iter().enumerate().filter(|(_, t)| tested(t)) {
        let flag = flags.slice(i..i + 1);
        match t.dtype() {
            DType::BF16 => elementwise::any_nonzero(flag, t.view::<half::bf16>()?, stream)?,
            _ => elementwise::any_nonzero(flag, t.view::<f32>()?, stream)?,
        }
    }
    let flags = flags.to_vec(stream)?;
    tensors
        .iter()
        .zip(flags)
        .map(|(t, set)| {
            if set == 0 {
                return Ok(HostCopy(None));
            }
            let bytes: Vec<u8> = with_dtype!(t.dtype(), T => bytemuck::cast_slice(&t.to_vec::<T>(stream)?).to_vec());
            Ok(HostCopy(bytes.iter().any(|b| *b != 0).then_some(bytes)))
        })
        .collect()
}

fn restore(alloc: &CachingAllocator, stream: &Stream, tensors: &[Tensor], saved: &[HostCopy]) -> Result<()> {
    for (t, HostCopy(bytes)) in tensors.iter().zip(saved) {
        let Some(bytes) = bytes else {
            t.zero(stream)?;
            continue;
        };
        with_dtype!(t.dtype(), T => {
            let mut values = vec![<T as bytemuck::Zeroable>::zeroed(); bytes.len() / t.dtype().size()];
            bytemuck::cast_slice_mut(&mut values).copy_from_slice(bytes);
            t.copy_from(&Tensor::from_host(alloc, stream, &values, t.shape())?, stream)?;
        });
    }
    stream.synchronize()
}
