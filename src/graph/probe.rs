//! The window probe, for a capture whose options ask for it (an offload manager's automatic
//! policy): after the warmup, each callable's passes captured as they will be replayed, but with
//! nothing offloaded, into graphs of a pool of their own; each forward and backward replayed a
//! few times between timing events on the capture stream; the graphs and their pool's memory
//! released callable by callable, before the next callable and before the real capture. The
//! times are then those of graph replays, without the launch gaps of the eager warmup.
//!
//! Given copies to plan with (an offload manager's, [`ProbeCopies`]), it times each pass twice
//! more: with the copies started beside it, in a graph of their own (what copy traffic costs the
//! pass's kernels), and captured again with a small copy in its own graph's tail, forked at its
//! start and joined at its end as the offload graphs carry theirs (what a graph pays for
//! carrying copies at all: on an H100 about 8 µs per graph at M, however small the copy).
//!
//! The probe holds one callable's graphs at a time, and, in a stack, a copy of the outputs that
//! feed the next callable. Its backward replays accumulate into the parameters' gradients, which
//! the capture restores after the warmup, as it does for the warmup's own backwards. Where the
//! stack lends its gradients, the probe's pool borrows them as the warmup does (Note [Lent
//! gradients in the warmup] in `lend.rs`): callable `i`'s graphs take the memory of every
//! layer's gradients but `i`'s, which its backward writes. Otherwise the probe of one layer,
//! whose activations have no lent memory to lie in, would hold more than the lending step: at L
//! on an H100 it raised the capture's reserved peak by 384 MiB over the step's 4054.

use super::graphed::Pass;
use super::lend::Lending;
use super::options::{GraphOptions, Phase};
use super::plan::Plan;
use super::record::Layout;
use crate::device::Stream;
use crate::memory::{GraphPool, PoolExec};
use crate::nn::{KeepOnDevice, NoGradHook, Step};
use crate::tensor::Tensor;
use crate::Result;

/// Replays of each probed pass; the median is kept.
pub(crate) const PROBE_REPLAYS: usize = 5;

/// The probe's times of one callable: the median GPU milliseconds of its forward and backward
/// graphs (`None` on a device without a clock, and for a pass not captured: no backward in
/// inference).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PassTimes {
    /// The callable's place in its chunk (the unit an offload manager counts): its index outside
    /// a schedule, its layer's place in its chunk under one.
    pub(crate) unit: usize,
    pub(crate) forward_ms: Option<f64>,
    pub(crate) backward_ms: Option<f64>,
    /// The same, with the probe's [`ProbeCopies`] started beside each replay (`None` without).
    pub(crate) forward_beside_ms: Option<f64>,
    pub(crate) backward_beside_ms: Option<f64>,
    /// The same passes captured with the probe's small copy in their graph's tail (`None`
    /// without [`ProbeCopies`]).
    pub(crate) forward_tail_ms: Option<f64>,
    pub(crate) backward_tail_ms: Option<f64>,
}

/// Copies the window probe times the passes with, as the offload graphs will run them: out with
/// a forward, back with a backward.
pub(crate) trait ProbeCopies {
    /// Starts one unit's copies for `pass` on a stream of their own, after `stream`'s work so far.
    fn start_beside(&self, pass: Pass, stream: &Stream) -> Result<()>;
    /// Orders `stream` after the copies started beside it.
    fn join_beside(&self, stream: &Stream) -> Result<()>;
    /// Inside a capture on `stream`: forks a small copy for `pass` from it, runs `body` (the pass),
    /// and joins the copy back, as an offload graph's tail.
    fn capture_in_tail(&self, pass: Pass, stream: &Stream, body: &mut dyn FnMut() -> Result<()>) -> Result<()>;
}

/// The probe a window-probe hook calls: the callables' times, with `copies` if given.
pub(crate) type Probe<'a> = dyn FnMut(Option<&dyn ProbeCopies>) -> Result<Vec<PassTimes>> + 'a;

/// Runs the options' window probe hook, if any, with the probe of `plan`'s callables (probed
/// once per layer: under a schedule, its first microbatch's callable) for it to call.
pub(crate) fn probe_windows(
    plan: &Plan<'_>,
    layout: Option<&Layout>,
    lending: Option<&Lending>,
    options: &mut GraphOptions,
) -> Result<()> {
    let Some(mut hook) = options.window_probe.take() else { return Ok(()) };
    let result = hook(plan.stream, &mut |copies| probe(plan, (layout, lending), options, copies));
    options.window_probe = Some(hook);
    result
}

/// The callables to probe, with their units: every callable in order outside a schedule (a stack
/// feeds each from the one before), else each layer's callable of microbatch 0.
fn probed(plan: &Plan<'_>, layout: Option<&Layout>) -> Vec<(usize, usize)> {
    match layout {
        None => (0..plan.len()).map(|i| (i, i)).collect(),
        Some(l) => (l.schedule.visits(&l.layers).into_iter())
            .filter(|v| matches!(v.step, Step::Forward(_)) && v.microbatch == 0)
            .map(|v| (v.instance, v.in_chunk))
            .collect(),
    }
}

/// Probes the callables one by one in a new pool, borrowing the gradients `lending` lends,
/// which gives its memory back at the end, also after a failure.
fn probe(
    plan: &Plan<'_>,
    (layout, lending): (Option<&Layout>, Option<&Lending>),
    options: &mut GraphOptions,
    copies: Option<&dyn ProbeCopies>,
) -> Result<Vec<PassTimes>> {
    let _range = plan.stream.device().range_with(|| "window probe".into());
    let pool = plan.alloc.new_pool();
    let mut times = Vec::new();
    let mut previous = Vec::new();
    let mut result = lending.map_or(Ok(()), |l| l.lend(&pool));
    for (i, unit) in probed(plan, layout).into_iter().take_while(|_| result.is_ok()) {
        let lenders = lending.map(|l| l.warmup_lenders(i)).unwrap_or_default();
        let mut execs = Vec::new();
        let timed = probe_one(plan, options, (&pool, &lenders, copies), (i, unit), &previous, &mut execs);
        // The replays end before their executables are destroyed, and the pool then holds
        // nothing that can run: the next callable reuses its blocks.
        let released = release(plan, &mut execs);
        match timed.and_then(|t| released.map(|()| t)) {
            Ok((t, outputs)) => {
                times.push(t);
                previous = outputs;
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    drop(previous);
    pool.roll_back(0);
    if let Some(l) = lending {
        l.give_back(&pool);
    }
    let trimmed = pool.trim();
    result.and(trimmed).map(|()| times)
}

/// Waits for the device, then destroys `execs`, which takes them out of their pool's order.
fn release(plan: &Plan<'_>, execs: &mut Vec<PoolExec>) -> Result<()> {
    let synced = plan.stream.device().synchronize();
    // Every one is reset; the first error is returned.
    let reset: Vec<Result<()>> = execs.iter_mut().map(PoolExec::reset).collect();
    execs.clear();
    synced.and(reset.into_iter().collect())
}

/// Callable `i` (unit `unit`) captured into `pool` with its inputs (its static inputs, or copies
/// of `previous` outputs) and the capture-time hooks around its forward and backward, as in the
/// capture; its executables, in `execs`, replayed [`PROBE_REPLAYS`] times; with `copies`, as many
/// again with them beside, then its passes captured again with a copy in their tails and every
/// executable replayed as often. Returns its times, and copies of its outputs when they feed the
/// next callable.
fn probe_one(
    plan: &Plan<'_>,
    options: &mut GraphOptions,
    (pool, lenders, copies): (&GraphPool, &[usize], Option<&dyn ProbeCopies>),
    (i, unit): (usize, usize),
    previous: &[Tensor],
    execs: &mut Vec<PoolExec>,
) -> Result<(PassTimes, Vec<Tensor>)> {
    let outputs = capture_passes(plan, options, (pool, lenders, i, previous), None, execs)?;
    let plain = execs.len();
    let ms = replay(plan, execs, None)?;
    let (mut with, mut tail) = (vec![None; plain], vec![None; plain]);
    if let Some(c) = copies {
        with = replay(plan, execs, Some(c))?;
        // Captured after the plain passes, so replayed after them in the pool's order.
        capture_passes(plan, options, (pool, lenders, i, previous), Some(c), execs)?;
        tail = replay(plan, execs, None)?.split_off(plain);
    }
    let backward = |v: &[Option<f64>]| v.get(1).copied().flatten().filter(|_| plan.training);
    let times = PassTimes {
        unit,
        forward_ms: ms[0],
        backward_ms: backward(&ms),
        forward_beside_ms: with[0],
        backward_beside_ms: backward(&with),
        forward_tail_ms: tail[0],
        backward_tail_ms: backward(&tail),
    };
    let kept = match plan.feeds_next(i) {
        true => outputs.iter().map(|y| copy(plan, y)).collect::<Result<Vec<_>>>()?,
        false => Vec::new(),
    };
    Ok((times, kept))
}

/// Callable `i`'s forward, and in training its backward (and split weight-gradient pass),
/// captured into `pool`, open to the memory `lenders` lent it, in that order with their
/// capture-time hooks, each with `tail`'s copy in its graph's tail if given, their executables
/// pushed to `execs` as they are made (so that a failure leaves them for the caller to
/// release); returns the forward's outputs.
fn capture_passes(
    plan: &Plan<'_>,
    options: &mut GraphOptions,
    (pool, lenders, i, previous): (&GraphPool, &[usize], usize, &[Tensor]),
    tail: Option<&dyn ProbeCopies>,
    execs: &mut Vec<PoolExec>,
) -> Result<Vec<Tensor>> {
    let (stream, callable, mode) = (plan.stream, plan.callables[i], options.capture_mode);
    let inputs = plan.inputs(i, previous);
    let mut capture = |phases: Option<[Phase; 2]>, pass: Pass, f: &mut dyn FnMut() -> Result<()>| -> Result<PoolExec> {
        if let Some([pre, _]) = phases {
            options.run_pass_hook(i, pre, stream)?;
        }
        let cap = plan.alloc.capture(stream, mode, pool)?;
        cap.open_lent(lenders);
        match tail {
            Some(c) if pass != Pass::BackwardDw => c.capture_in_tail(pass, stream, f)?,
            _ => f()?,
        }
        let exec = cap.finish()?.instantiate()?;
        if let Some([_, post]) = phases {
            options.run_pass_hook(i, post, stream)?;
        }
        exec.upload(stream)?;
        Ok(exec)
    };
    let mut result = None;
    execs.push(capture(Some([Phase::ForwardPre, Phase::Forward]), Pass::Forward, &mut || {
        result = Some(callable.forward_dyn(&inputs, &KeepOnDevice, stream)?);
        Ok(())
    })?);
    let (ys, saved) = result.expect("the capture ran the forward");
    if plan.training {
        let dys =
            (ys.iter()).map(|y| Tensor::zeros(plan.alloc, stream, y.shape(), y.dtype())).collect::<Result<Vec<_>>>()?;
        let mut saved = Some(saved);
        execs.push(capture(Some([Phase::BackwardPre, Phase::Backward]), Pass::Backward, &mut || {
            let s = saved.take().expect("captured once");
            callable.backward_dyn(s, &dys.iter().collect::<Vec<_>>(), &NoGradHook, stream).map(drop)
        })?);
        // Replayed in the cycle that the pool's order asks for, not timed.
        if callable.splits_dw_dyn() {
            execs.push(capture(None, Pass::BackwardDw, &mut || callable.backward_dw_dyn(stream))?);
        }
    }
    Ok(ys)
}

/// `y` copied into the allocator's cache, on the plan's stream.
fn copy(plan: &Plan<'_>, y: &Tensor) -> Result<Tensor> {
    let t = Tensor::uninit(plan.alloc, plan.stream, y.shape(), y.dtype())?;
    t.copy_from(y, plan.stream)?;
    Ok(t)
}

/// Launches `execs` (per capture, its forward, backward, then a split weight-gradient pass) in
/// their capture order [`PROBE_REPLAYS`] times on the plan's stream, a timing event before and
/// after each launch, `copies` started beside each forward and backward and joined after it;
/// per executable, the median milliseconds (`None` without a clock).
fn replay(plan: &Plan<'_>, execs: &[PoolExec], copies: Option<&dyn ProbeCopies>) -> Result<Vec<Option<f64>>> {
    let (stream, dev) = (plan.stream, plan.stream.device());
    let mut events = Vec::with_capacity(PROBE_REPLAYS * execs.len());
    for _ in 0..PROBE_REPLAYS {
        for (k, exec) in execs.iter().enumerate() {
            let pass = [Pass::Forward, Pass::Backward].get(k).copied();
            let beside = copies.zip(pass);
            if let Some((c, pass)) = beside {
                c.start_beside(pass, stream)?;
            }
            let (start, end) = (dev.timing_event()?, dev.timing_event()?);
            stream.record(&start)?;
            exec.launch(stream)?;
            stream.record(&end)?;
            if let Some((c, _)) = beside {
                c.join_beside(stream)?;
            }
            events.push((start, end));
        }
    }
    stream.synchronize()?;
    if !dev.has_clock() {
        return Ok(vec![None; execs.len()]);
    }
    let mut ms = vec![Vec::with_capacity(PROBE_REPLAYS); execs.len()];
    for (k, (start, end)) in events.iter().enumerate() {
        ms[k % execs.len()].push(f64::from(start.elapsed_ms(end)?));
    }
    Ok(ms.into_iter().map(|v| Some(median(v))).collect())
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::check::Checker;
    use crate::device::{Device, Stream};
    use crate::graph::{make_graphed_callables, make_graphed_stack, Callable};
    use crate::memory::CachingAllocator;
    use crate::nn::{Builder, Inputs, Linear, ParamStore, Schedule, Stack};
    use crate::Error;

    /// A stack of `n` linear layers (4 → 4) on the simulator, its parameters' gradients all 0.25.
    fn stack(n: usize) -> Result<(Device, Stream, CachingAllocator, ParamStore, Stack<Linear>)> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(&dev);
        let store = ParamStore::new(&alloc, &s, 20 * n)?;
        let vb = Builder::new(&store, &alloc, &s)?;
        let layers = (0..n).map(|i| Linear::new(&vb.pp(&format!("fc{i}")).with_seed(i as u64), (4, 4)));
        let stack = Stack::new(layers.collect::<Result<Vec<_>>>()?);
        let grads = store.grads()?;
        grads.copy_from(&Tensor::from_host(&alloc, &s, &vec![0.25f32; grads.numel()], grads.shape())?, &s)?;
        Ok((dev, s, alloc, store, stack))
    }

    /// Every pool of `alloc` but `kept` holds nothing, and some did hold memory (the probe's).
    fn probe_pool_released(alloc: &CachingAllocator, kept: Option<&GraphPool>) -> bool {
        let others: Vec<_> =
            alloc.stats().pools.into_iter().filter(|(id, _)| Some(*id) != kept.map(|p| p.id())).collect();
        others.iter().all(|(_, s)| s.allocated == 0 && s.reserved == 0)
            && others.iter().any(|(_, s)| s.peak_allocated > 0)
    }

    #[test]
    fn the_probe_times_every_layer_in_graphs_it_releases() -> Result<()> {
        let (dev, s, alloc, store, stack) = stack(3)?;
        let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
        let (times, phases) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(0)));
        let (t, p) = (times.clone(), phases.clone());
        let options = GraphOptions::default()
            .capture_time_hook(move |_, _, _| {
                *p.lock().unwrap() += 1;
                Ok(())
            })
            .window_probe(move |_, probe| {
                *t.lock().unwrap() = probe(None)?;
                Ok(())
            });
        let g = make_graphed_stack(&alloc, &stack, &x, options)?;
        let times = times.lock().unwrap().clone();
        let units: Vec<usize> = times.iter().map(|t| t.unit).collect();
        assert_eq!(units, [0, 1, 2], "every layer probed, in order");
        assert!(times.iter().all(|t| t.forward_ms.is_none() && t.backward_ms.is_none()), "the simulator has no clock");
        assert!(probe_pool_released(&alloc, Some(g.pool())), "{:?}", alloc.stats());
        // Hooks around each forward and backward: the warmup iteration, the probe, the capture.
        assert_eq!(*phases.lock().unwrap(), (1 + 1 + 1) * 3 * 4);
        assert_eq!(store.grads()?.to_vec::<f32>(&s)?, vec![0.25f32; 60], "the probe's backwards were undone");
        assert!(Checker::of(&dev).is_some_and(|c| c.hazards().is_empty()));
        Ok(())
    }

    /// Counts what the probe starts beside its passes, the joins, and the passes captured with a
    /// tail.
    #[derive(Default)]
    struct Counted {
        started: Mutex<Vec<Pass>>,
        joined: Mutex<usize>,
        tailed: Mutex<Vec<Pass>>,
    }

    impl ProbeCopies for Counted {
        fn start_beside(&self, pass: Pass, _stream: &Stream) -> Result<()> {
            self.started.lock().unwrap().push(pass);
            Ok(())
        }

        fn join_beside(&self, _stream: &Stream) -> Result<()> {
            *self.joined.lock().unwrap() += 1;
            Ok(())
        }

        fn capture_in_tail(&self, pass: Pass, stream: &Stream, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
            assert!(stream.capture_id()?.is_some(), "the tail is captured with its pass");
            body()?;
            self.tailed.lock().unwrap().push(pass);
            Ok(())
        }
    }

    #[test]
    fn the_probe_times_each_pass_with_copies_beside_it_and_in_its_tail() -> Result<()> {
        let (dev, s, alloc, store, stack) = stack(2)?;
        let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
        let counted = Arc::new(Counted::default());
        let (c, times) = (counted.clone(), Arc::new(Mutex::new(Vec::new())));
        let t = times.clone();
        let options = GraphOptions::default().window_probe(move |_, probe| {
            *t.lock().unwrap() = probe(Some(c.as_ref()))?;
            Ok(())
        });
        let g = make_graphed_stack(&alloc, &stack, &x, options)?;
        let started = counted.started.lock().unwrap().clone();
        let per_layer = [vec![Pass::Forward; PROBE_REPLAYS], vec![Pass::Backward; PROBE_REPLAYS]].concat();
        assert_eq!(started.len(), 2 * per_layer.len(), "{started:?}");
        for layer in started.chunks(2 * PROBE_REPLAYS) {
            let mut sorted = layer.to_vec();
            sorted.sort_by_key(|p| *p != Pass::Forward);
            assert_eq!(sorted, per_layer, "each replay of each pass, once");
        }
        assert_eq!(*counted.joined.lock().unwrap(), started.len(), "every start joined");
        let tailed = counted.tailed.lock().unwrap().clone();
        assert_eq!(tailed, [Pass::Forward, Pass::Backward].repeat(2), "each layer's passes captured once with a tail");
        let times = times.lock().unwrap().clone();
        let timed = |t: &PassTimes| [t.forward_beside_ms, t.forward_tail_ms, t.backward_tail_ms];
        assert!(times.iter().flat_map(timed).all(|ms| ms.is_none()), "the simulator has no clock");
        assert!(probe_pool_released(&alloc, Some(g.pool())), "{:?}", alloc.stats());
        assert_eq!(store.grads()?.to_vec::<f32>(&s)?, vec![0.25f32; 40], "the probe's backwards were undone");
        assert!(Checker::of(&dev).is_some_and(|c| c.hazards().is_empty()));
        Ok(())
    }

    #[test]
    fn a_failed_probe_changes_nothing() -> Result<()> {
        let (_dev, s, alloc, store, stack) = stack(2)?;
        let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
        let pool = alloc.new_pool();
        let options = GraphOptions::default().pool(&pool).window_probe(|_, probe| {
            probe(None)?;
            Err(Error::GraphReset { op: "the probe's user" })
        });
        let refused = make_graphed_stack(&alloc, &stack, &x, options).map(drop);
        assert!(matches!(refused, Err(Error::GraphReset { op: "the probe's user" })), "{refused:?}");
        assert!(pool.order().is_empty() && probe_pool_released(&alloc, Some(&pool)), "{:?}", alloc.stats());
        assert_eq!(store.grads()?.to_vec::<f32>(&s)?, vec![0.25f32; 40]);
        Ok(())
    }

    #[test]
    fn under_a_schedule_each_layer_is_probed_once_as_a_unit_of_its_chunk() -> Result<()> {
        let (_dev, s, alloc, _store, stack) = stack(4)?;
        let schedule = Schedule::interleaved_1f1b(1, 0, 2, 4)?;
        let callables: Vec<&dyn Callable> = stack.layers().iter().map(|l| l as &dyn Callable).collect();
        let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
        let samples = vec![Inputs::one(&x); 4 * schedule.microbatches()];
        let units = Arc::new(Mutex::new(Vec::new()));
        let u = units.clone();
        let options = GraphOptions::default().schedule(&schedule).window_probe(move |_, probe| {
            *u.lock().unwrap() = probe(None)?.into_iter().map(|t| t.unit).collect();
            Ok(())
        });
        let g = make_graphed_callables(&alloc, &callables, &samples, options)?;
        let mut units = units.lock().unwrap().clone();
        units.sort_unstable();
        assert_eq!(units, [0, 0, 1, 1], "two chunks of two layers, microbatch 0 only");
        assert!(probe_pool_released(&alloc, Some(g[0].pool())));
        Ok(())
    }
}
