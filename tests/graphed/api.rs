//! The API's promises: hooks, transactional capture, named inputs, unused inputs, output
//! lifetimes, argument and replay-choice errors, the pool's order across calls.

use graphed::device::DType;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use anyhow::{bail, ensure};
use graphed::device::{AccessMode, BufferId, Device, Region, Stream};
use graphed::graph::{make_graphed_callables, make_graphed_stack, Callable, GraphOptions, GraphedErrorKind, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Inputs, Linear, Module, Param, ParamStore, SaveHook, Stack};
use graphed::tensor::Tensor;

use super::fixtures::{lcg, Model, Result, Shifted};

/// Fails unless `r` is a graphed error that `want` accepts.
pub fn expect_kind<T: std::fmt::Debug>(r: graphed::Result<T>, want: impl Fn(&GraphedErrorKind) -> bool) -> Result {
    match r {
        Err(e) if e.graphed_kind().is_some_and(&want) => Ok(()),
        other => bail!("unexpected: {other:?}"),
    }
}

/// Whether `k` is a graphed call's refusal for a `what` of another device.
fn wrong_device(k: &GraphedErrorKind, what: &str) -> bool {
    matches!(k, GraphedErrorKind::Refused(e) if matches!(**e, graphed::Error::WrongDevice { what: w, .. } if w == what))
}

fn samples(stack: &Model) -> Result<Vec<Inputs>> {
    let (x0, _) = stack.data(0)?;
    Ok(stack.layers().iter().map(|_| Inputs::one(&x0)).collect())
}

/// Each pass bracketed by its pre and post hook, all outside capture: in the warmup, each
/// layer's forward then its backward, layer by layer (PyTorch's per-callable warmup); in the
/// capture, TransformerEngine's order, every forward in order, then every backward in reverse;
/// the warmup hooks once each around the warmup; nothing more at replay.
pub fn hooks_run_in_order_outside_capture(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let log: Rc<RefCell<Vec<String>>> = Rc::default();
    let (l1, l2, l3) = (log.clone(), log.clone(), log.clone());
    let options = GraphOptions::default()
        .warmup_iters(2)
        .pre_warmup(move |_| {
            l1.borrow_mut().push("pre".into());
            Ok(())
        })
        .post_warmup(move |_| {
            l2.borrow_mut().push("post".into());
            Ok(())
        })
        .capture_time_hook(move |i, phase, s: &Stream| {
            let capturing = s.capture_id()?.is_some();
            l3.borrow_mut().push(format!("{i}{phase:?}{}", if capturing { "!" } else { "" }));
            Ok(())
        });
    let g = stack.graph(options)?;
    let warmup = [
        "0ForwardPre",
        "0Forward",
        "0BackwardPre",
        "0Backward",
        "1ForwardPre",
        "1Forward",
        "1BackwardPre",
        "1Backward",
    ];
    let pass = [
        "0ForwardPre",
        "0Forward",
        "1ForwardPre",
        "1Forward",
        "1BackwardPre",
        "1Backward",
        "0BackwardPre",
        "0Backward",
    ];
    let mut want = vec!["pre".to_string()];
    want.extend(warmup.iter().chain(&warmup).map(|p| p.to_string()));
    want.push("post".into());
    want.extend(pass.iter().map(|p| p.to_string()));
    ensure!(*log.borrow() == want, "hook log {:?}, want {want:?}", log.borrow());
    let (x, dy) = stack.data(1)?;
    stack.graphed(&g, &x, &dy, Replay::caller())?;
    ensure!(log.borrow().len() == want.len(), "hooks ran at replay");
    Ok(())
}

/// A module that fails on its `fail_at`-th forward (1-based), else is `inner`.
struct Failing<'a, M: Module> {
    inner: &'a M,
    fail_at: usize,
    calls: AtomicUsize,
}

impl<M: Module> Module for Failing<'_, M> {
    type Ctx = M::Ctx;

    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, M::Ctx)> {
        if self.calls.fetch_add(1, Ordering::SeqCst) + 1 == self.fail_at {
            return Err(graphed::Error::Unsupported { op: "Failing::forward", backend: "any", why: "planted failure" });
        }
        self.inner.forward(inputs, hook, s)
    }

    fn backward(&self, ctx: M::Ctx, dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        self.inner.backward(ctx, dys, s)
    }

    fn parameters(&self) -> Vec<&Param> {
        self.inner.parameters()
    }

    fn set_training(&mut self, _training: bool) {}
}

/// A module whose backward notes whether its output gradient lies where its latest forward's
/// output does.
struct Echoed<'a, M: Module> {
    inner: &'a M,
    output: Mutex<Option<(BufferId, Region)>>,
    read_output: Mutex<Vec<bool>>,
}

fn place(t: &Tensor) -> graphed::Result<(BufferId, Region)> {
    t.access(AccessMode::Read).map(|a| (a.memory, a.at))
}

impl<M: Module> Module for Echoed<'_, M> {
    type Ctx = M::Ctx;

    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, M::Ctx)> {
        let (ys, ctx) = self.inner.forward(inputs, hook, s)?;
        *self.output.lock().unwrap() = Some(place(&ys[0])?);
        Ok((ys, ctx))
    }

    fn backward(&self, ctx: M::Ctx, dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        let same = *self.output.lock().unwrap() == Some(place(dys[0])?);
        self.read_output.lock().unwrap().push(same);
        self.inner.backward(ctx, dys, s)
    }

    fn parameters(&self) -> Vec<&Param> {
        self.inner.parameters()
    }

    fn set_training(&mut self, _training: bool) {}
}

/// The warmup's backward takes its forward's output as the output gradient instead of a new
/// buffer of zeros (the gradients it accumulates are given back); the capture's backward reads
/// the static output gradient. The gradients come back as they were.
pub fn the_warmups_backward_reads_its_forwards_output(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let before = stack.grads()?;
    let layers: Vec<Echoed<'_, _>> = (stack.layers().iter())
        .map(|inner| Echoed { inner, output: Mutex::new(None), read_output: Mutex::new(Vec::new()) })
        .collect();
    let callables: Vec<&dyn Callable> = layers.iter().map(|l| l as &dyn Callable).collect();
    make_graphed_callables(&stack.alloc, &callables, &samples(&stack)?, GraphOptions::default())?;
    for (i, layer) in layers.iter().enumerate() {
        let seen = layer.read_output.lock().unwrap().clone();
        ensure!(seen == [true, false], "layer {i}: backward read its forward's output {seen:?} (warmup, capture)");
    }
    ensure!(stack.grads()? == before, "the warmup's gradients were not given back");
    Ok(())
}

/// The post-warmup hook pairs with the pre-warmup hook when the warmup fails, and the gradients
/// the failed warmup touched are restored.
pub fn post_warmup_runs_when_warmup_fails(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let failing = Failing { inner: &stack.layers()[1], fail_at: 2, calls: AtomicUsize::new(0) };
    let count = Rc::new(RefCell::new((0, 0)));
    let (c1, c2) = (count.clone(), count.clone());
    let options = GraphOptions::default()
        .pre_warmup(move |_| {
            c1.borrow_mut().0 += 1;
            Ok(())
        })
        .post_warmup(move |_| {
            c2.borrow_mut().1 += 1;
            Ok(())
        });
    let grads = stack.grads()?;
    let callables: Vec<&dyn Callable> = vec![&stack.layers()[0], &failing];
    ensure!(
        make_graphed_callables(&stack.alloc, &callables, &samples(&stack)?, options).is_err(),
        "the planted failure passed"
    );
    ensure!(*count.borrow() == (1, 1), "warmup hooks ran {:?} times, want once each", count.borrow());
    ensure!(stack.grads()? == grads, "the failed warmup left gradients behind");
    Ok(())
}

/// Gradients accumulated before a capture come back from its warmup bit for bit: the first
/// layer's (values, and `-0.0`, whose bits are not zero) from a host copy, the second layer's
/// (all zero bits, found so on the device) by zeroing.
pub fn warmup_gives_nonzero_gradients_back_bit_for_bit(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let grads = stack.store.grads()?;
    let n = grads.numel();
    let first = stack.layers()[0].parameters().iter().map(|p| p.grad.numel()).sum::<usize>();
    let planted: Vec<f32> = (0..n)
        .map(|i| {
            if i >= first {
                0.0
            } else if i % 3 == 0 {
                -0.0
            } else {
                i as f32 * 1e-3
            }
        })
        .collect();
    grads.copy_from(&Tensor::from_host(&stack.alloc, &stack.s, &planted, grads.shape())?, &stack.s)?;
    make_graphed_callables(&stack.alloc, &stack.callables(), &samples(&stack)?, GraphOptions::default())?;
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    ensure!(bits(stack.grads()?) == bits(planted), "the warmup changed the gradients' bits");
    Ok(())
}

/// A capture that fails midway (the second callable's forward capture) leaves the shared pool's
/// order, the gradients and the step counter as they were; the pool's earlier graphs still
/// replay, and a new capture into it works.
pub fn failed_capture_changes_nothing(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let first: Vec<&dyn Callable> = vec![&stack.layers()[0]];
    let (x0, _) = stack.data(0)?;
    let g0 = make_graphed_callables(&stack.alloc, &first, &[Inputs::one(&x0)], GraphOptions::default())?;
    let pool = g0[0].pool().clone();
    let order = pool.order();
    let (grads, step) = (stack.grads()?, stack.step.to_vec::<u64>(&stack.s)?);
    // Warmup 3 forwards, then the capture's forward fails.
    let failing = Failing { inner: &stack.layers()[1], fail_at: 4, calls: AtomicUsize::new(0) };
    let both: Vec<&dyn Callable> = vec![&stack.layers()[0], &failing];
    let options = GraphOptions::default().pool(&pool).warmup_iters(3);
    let r = make_graphed_callables(&stack.alloc, &both, &samples(&stack)?, options);
    ensure!(r.is_err(), "the planted capture failure passed");
    ensure!(pool.order() == order, "the failed capture left graphs in the pool's order");
    ensure!(stack.grads()? == grads && stack.step.to_vec::<u64>(&stack.s)? == step, "the failed capture changed state");
    let (y, _t) = g0[0].forward(&stack.s, &Inputs::one(&x0), Replay::caller())?;
    let dy = Tensor::zeros(&stack.alloc, &stack.s, y[0].shape(), y[0].dtype())?;
    let (_dx, _t) = g0[0].backward(&stack.s, &[&dy])?;
    let second: Vec<&dyn Callable> = vec![&stack.layers()[1]];
    let g1 = make_graphed_callables(&stack.alloc, &second, &[Inputs::one(&x0)], GraphOptions::default().pool(&pool))?;
    let (_y, _t) = g0[0].forward(&stack.s, &Inputs::one(&x0), Replay::caller())?;
    let (_dx, _t) = g0[0].backward(&stack.s, &[&dy])?;
    let (_y, _t) = g1[0].forward(&stack.s, &Inputs::one(&x0), Replay::caller())?;
    Ok(())
}

/// A stream, an allocator, a small store, and `x` and `shift` of shape (2, 3).
type ShiftedSetup = (Stream, CachingAllocator, ParamStore, Tensor, Tensor);

fn shifted_setup(dev: &Device) -> Result<ShiftedSetup> {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let store = ParamStore::new(&alloc, &s, 16)?;
    let x = Tensor::from_host(&alloc, &s, &lcg(6, 1), &[2, 3])?;
    let shift = Tensor::from_host(&alloc, &s, &lcg(6, 2), &[2, 3])?;
    Ok((s, alloc, store, x, shift))
}

/// Named inputs: matched by name in any order, with clear errors for a missing or unknown name,
/// a wrong shape, element type or count; a module that takes one positional input refuses named ones.
pub fn named_inputs_are_checked(dev: &Device) -> Result {
    let (s, alloc, store, x, shift) = shifted_setup(dev)?;
    let f = Shifted::new(&store, &alloc, &s)?;
    let sample = Inputs::new().arg(&x).named("shift", &shift);
    let g = make_graphed_callables(&alloc, &[&f as &dyn Callable], &[sample], GraphOptions::default())?;
    let x2 = Tensor::from_host(&alloc, &s, &lcg(6, 3), &[2, 3])?;
    let (y, _t) = g[0].forward(&s, &Inputs::new().named("shift", &shift).arg(&x2), Replay::caller())?;
    let want: Vec<f32> = x2.to_vec::<f32>(&s)?.iter().zip(shift.to_vec::<f32>(&s)?).map(|(a, b)| a + b).collect();
    ensure!(y[0].get()?.to_vec::<f32>(&s)? == want, "y = x + shift");
    let (grads, _t) = g[0].backward(&s, &[&x2])?;
    ensure!(grads.len() == 2 && grads.iter().all(Option::is_some), "a gradient for x and for the named shift");
    ensure!(f.p.grad.to_vec::<f32>(&s)? == vec![1.0], "the parameter gradient accumulated once (warmup restored)");
    let wrong = Tensor::zeros(&alloc, &s, &[3, 2], DType::F32)?;
    let call = |i: Inputs| g[0].forward(&s, &i, Replay::caller()).map(|_| ());
    expect_kind(
        call(Inputs::new().arg(&x)),
        |k| matches!(k, GraphedErrorKind::MissingInput { name } if name == "shift"),
    )?;
    expect_kind(
        call(Inputs::new().arg(&x).named("shift", &shift).named("bias", &shift)),
        |k| matches!(k, GraphedErrorKind::UnknownInput { name } if name == "bias"),
    )?;
    expect_kind(
        call(Inputs::new().arg(&wrong).named("shift", &shift)),
        |k| matches!(k, GraphedErrorKind::InputShape { input, .. } if input == "input 0"),
    )?;
    expect_kind(call(Inputs::new().named("shift", &shift)), |k| matches!(k, GraphedErrorKind::InputCount { .. }))?;
    // Of the captured shape but another element type: refused before the copy into the static
    // input, which keeps x2.
    let half = Tensor::zeros(&alloc, &s, &[2, 3], DType::BF16)?;
    expect_kind(
        call(Inputs::new().arg(&half).named("shift", &shift)),
        |k| matches!(k, GraphedErrorKind::InputDType { input, expected: DType::F32, found: DType::BF16 } if input == "input 0"),
    )?;
    ensure!(g[0].static_inputs()?[0].to_vec::<f32>(&s)? == x2.to_vec::<f32>(&s)?, "the refused call copied its input");
    let lin = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(1).pp("fc"), (3, 1))?;
    let r = make_graphed_callables(
        &alloc,
        &[&lin as &dyn Callable],
        &[Inputs::new().arg(&x).named("m", &x)],
        GraphOptions::default(),
    );
    match r {
        Err(graphed::Error::InputArity { op: "Linear::forward", positional: 1, named: 1, .. }) => Ok(()),
        other => bail!("a named input to a Linear: {other:?}"),
    }
}

/// A differentiable input without a gradient is refused unless allowed; a constant input never
/// gets one.
pub fn unused_inputs_are_refused_unless_allowed(dev: &Device) -> Result {
    let (s, alloc, store, x, shift) = shifted_setup(dev)?;
    let mut f = Shifted::new(&store, &alloc, &s)?;
    f.grad_x = false;
    let sample = || Inputs::new().arg(&x).constant("shift", &shift);
    let r = make_graphed_callables(&alloc, &[&f as &dyn Callable], &[sample()], GraphOptions::default());
    expect_kind(r, |k| matches!(k, GraphedErrorKind::UnusedInput { input } if input == "input 0"))?;
    let options = GraphOptions::default().allow_unused_input(true);
    let g = make_graphed_callables(&alloc, &[&f as &dyn Callable], &[sample()], options)?;
    let (_y, _t) = g[0].forward(&s, &sample(), Replay::caller())?;
    let (grads, _t) = g[0].backward(&s, &[&x])?;
    ensure!(grads.iter().all(Option::is_none), "no gradient for an unused input nor for a constant");
    Ok(())
}

/// Outputs and input gradients refuse reads after a later replay of a graph that writes their
/// memory (their own graph, or one whose internals reuse it in the pool) overwrote them; a copy
/// taken before stays.
pub fn outputs_refuse_reads_after_overwrite(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let g =
        make_graphed_callables(&stack.alloc, &stack.callables()[..1], &samples(&stack)?[..1], GraphOptions::default())?;
    let (x, dy) = stack.data(1)?;
    let (y, _t) = g[0].forward(&stack.s, &Inputs::one(&x), Replay::caller())?;
    let kept = y[0].to_owned(&stack.alloc, &stack.s)?;
    let before = kept.to_vec::<f32>(&stack.s)?;
    let (dx, _t) = g[0].backward(&stack.s, &[&dy])?;
    ensure!(dx[0].as_ref().unwrap().is_fresh() && y[0].is_fresh(), "both fresh before the next replay");
    let (x2, _) = stack.data(2)?;
    let (y2, _t) = g[0].forward(&stack.s, &Inputs::one(&x2), Replay::caller())?;
    expect_kind(y[0].get(), |k| matches!(k, GraphedErrorKind::StaleOutput { .. }))?;
    ensure!(y2[0].is_fresh(), "the new output is fresh");
    ensure!(
        kept.to_vec::<f32>(&stack.s)? == before && before != y2[0].get()?.to_vec::<f32>(&stack.s)?,
        "the copy kept its values"
    );
    let (_dx, _t) = g[0].backward(&stack.s, &[&dy])?;
    ensure!(!dx[0].as_ref().unwrap().is_fresh(), "the input gradient was overwritten");
    Ok(())
}

/// Arguments that cannot be graphed, and layers of a graphed stack replayed on their own.
pub fn bad_arguments_are_refused(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let all = samples(&stack)?;
    let none: Vec<&dyn Callable> = vec![];
    expect_kind(make_graphed_callables(&stack.alloc, &none, &[], GraphOptions::default()), |k| {
        matches!(k, GraphedErrorKind::NoCallables)
    })?;
    let (x0, _) = stack.data(1)?;
    let empty: Stack<Linear> = Stack::new(Vec::new());
    expect_kind(make_graphed_stack(&stack.alloc, &empty, &x0, GraphOptions::default()), |k| {
        matches!(k, GraphedErrorKind::NoCallables)
    })?;
    expect_kind(make_graphed_callables(&stack.alloc, &stack.callables(), &all[..1], GraphOptions::default()), |k| {
        matches!(k, GraphedErrorKind::SampleCount { callables: 2, samples: 1 })
    })?;
    expect_kind(
        make_graphed_callables(&stack.alloc, &stack.callables(), &all, GraphOptions::default().warmup_iters(0)),
        |k| matches!(k, GraphedErrorKind::ZeroWarmup),
    )?;
    let pool = stack.alloc.new_pool();
    let (x0, _) = stack.data(0)?;
    let options = GraphOptions::default().pool(&pool).pool_per_callable(true);
    expect_kind(make_graphed_stack(&stack.alloc, &stack.stack, &x0, options), |k| {
        matches!(k, GraphedErrorKind::ConflictingPools)
    })?;
    // A pool of another allocator, a stream of another device: refused before any work.
    let other = CachingAllocator::new(dev);
    let r =
        make_graphed_callables(&stack.alloc, &stack.callables(), &all, GraphOptions::default().pool(&other.new_pool()));
    expect_kind(r, |k| matches!(k, GraphedErrorKind::Refused(e) if matches!(**e, graphed::Error::ForeignPool { .. })))?;
    let elsewhere = Device::sim().stream()?;
    let r = make_graphed_callables(&stack.alloc, &stack.callables(), &all, GraphOptions::default().stream(&elsewhere));
    expect_kind(r, |k| wrong_device(k, "stream"))?;
    make_graphed_callables(
        &stack.alloc,
        &stack.callables(),
        &all,
        GraphOptions::default().warmup_iters(0).inference(),
    )?;
    // Layers whose shapes do not chain: the second gets the first's (2, 4) output.
    let store = ParamStore::new(&stack.alloc, &stack.s, 2 * Linear::parameter_count((8, 4)))?;
    let vb = Builder::new(&store, &stack.alloc, &stack.s)?;
    let (a, b) = (Linear::new(&vb.pp("a").with_seed(1), (8, 4))?, Linear::new(&vb.pp("b").with_seed(2), (8, 4))?);
    let x = Tensor::zeros(&stack.alloc, &stack.s, &[2, 8], DType::F32)?;
    match make_graphed_stack(&stack.alloc, &Stack::new(vec![a, b]), &x, GraphOptions::default()) {
        Err(graphed::Error::Shape { op: "Linear::forward", .. }) => {}
        other => bail!("layers whose shapes do not chain: {other:?}"),
    }
    // A layer of a stack feeds on its neighbours' static buffers: only the stack replays it.
    let g = stack.graph(GraphOptions::default())?;
    let (x, dy) = stack.data(1)?;
    expect_kind(g.layers()[1].forward(&stack.s, &Inputs::one(&x), Replay::caller()), |k| {
        matches!(k, GraphedErrorKind::StackLayer)
    })?;
    expect_kind(g.layers()[0].backward(&stack.s, &[&dy]), |k| matches!(k, GraphedErrorKind::StackLayer))?;
    Ok(())
}

/// A side-stream replay of graphs without a sync event, or on the caller's own stream, is
/// refused; so is a replay on the caller's stream while a side-stream tail of the pool is not
/// joined.
pub fn replay_choices_are_checked(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let (side, e) = (dev.stream()?, dev.event()?);
    let (x, dy) = stack.data(1)?;
    let one = &stack.callables()[..1];
    let plain = make_graphed_callables(&stack.alloc, one, &samples(&stack)?[..1], GraphOptions::default())?;
    expect_kind(plain[0].forward(&stack.s, &Inputs::one(&x), Replay::side(&side)), |k| {
        matches!(k, GraphedErrorKind::NoSyncEvent)
    })?;
    let options = GraphOptions::default().sync_event(&e);
    let g = make_graphed_callables(&stack.alloc, one, &samples(&stack)?[..1], options)?;
    expect_kind(g[0].forward(&stack.s, &Inputs::one(&x), Replay::side(&stack.s)), |k| {
        matches!(k, GraphedErrorKind::SideIsCaller)
    })?;
    // Streams of another device: the error names the stream the user passed.
    let elsewhere = Device::sim().stream()?;
    for (caller, replay, what) in [
        (&elsewhere, Replay::caller(), "caller's stream"),
        (&stack.s, Replay::side(&elsewhere), "replay stream"),
        (&stack.s, Replay::joined(&elsewhere), "replay stream"),
    ] {
        expect_kind(g[0].forward(caller, &Inputs::one(&x), replay), |k| wrong_device(k, what))?;
    }
    ensure!(matches!(g[0].pool().join(&elsewhere), Err(graphed::Error::WrongDevice { .. })), "join on another device");
    let (_y, tail) = g[0].forward(&stack.s, &Inputs::one(&x), Replay::side(&side))?;
    match g[0].backward_with(&stack.s, &[&dy], Replay::caller()) {
        Err(e) if matches!(e.refused_by(), Some(graphed::Error::PoolConcurrent { .. })) => {}
        other => bail!("a caller-stream replay racing a side-stream tail of its pool: {other:?}"),
    }
    tail.join(&stack.s)?;
    let (_dx, _t) = g[0].backward_with(&stack.s, &[&dy], Replay::caller())?;
    Ok(())
}

/// Graphs of two calls sharing a pool replay in one cyclic capture order.
pub fn pool_order_is_enforced_across_calls(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let all = samples(&stack)?;
    let a = make_graphed_callables(&stack.alloc, &stack.callables()[..1], &all[..1], GraphOptions::default())?;
    let pool = a[0].pool().clone();
    let b =
        make_graphed_callables(&stack.alloc, &stack.callables()[1..], &all[1..], GraphOptions::default().pool(&pool))?;
    ensure!(pool.order().len() == 4, "forward and backward of each call in one order");
    let (x, dy) = stack.data(1)?;
    let (_y, _t) = a[0].forward(&stack.s, &Inputs::one(&x), Replay::caller())?;
    match b[0].forward(&stack.s, &Inputs::one(&x), Replay::caller()) {
        // The message names both graphs by module and pass, not by id alone.
        Err(e)
            if matches!(e.refused_by(), Some(graphed::Error::PoolOrder { .. }))
                && e.to_string().contains("TransformerLayer#0 (h1)")
                && e.to_string().contains("(TransformerLayer#0 (h0) Backward)") => {}
        other => bail!("replay skipping a graph of the pool: {other:?}"),
    }
    let (_dx, _t) = a[0].backward(&stack.s, &[&dy])?;
    let (_y, _t) = b[0].forward(&stack.s, &Inputs::one(&x), Replay::caller())?;
    let (_dx, _t) = b[0].backward(&stack.s, &[&dy])?;
    Ok(())
}

/// A replay refused for the pool's order copies nothing: the static input still holds the input
/// of the forward whose backward is pending (a graphed callable and a graphed stack alike).
pub fn refused_replay_changes_nothing(dev: &Device) -> Result {
    let stack = Model::new(dev)?;
    let g =
        make_graphed_callables(&stack.alloc, &stack.callables()[..1], &samples(&stack)?[..1], GraphOptions::default())?;
    let ((x1, dy), (x2, _)) = (stack.data(1)?, stack.data(2)?);
    let (_y, _t) = g[0].forward(&stack.s, &Inputs::one(&x1), Replay::caller())?;
    match g[0].forward(&stack.s, &Inputs::one(&x2), Replay::caller()) {
        Err(e) if matches!(e.refused_by(), Some(graphed::Error::PoolOrder { .. })) => {}
        other => bail!("a second forward before the backward: {other:?}"),
    }
    ensure!(
        g[0].static_inputs()?[0].to_vec::<f32>(&stack.s)? == x1.to_vec::<f32>(&stack.s)?,
        "the refused forward copied its input"
    );
    let (_dx, _t) = g[0].backward(&stack.s, &[&dy])?;
    let graphed = stack.graph(GraphOptions::default())?;
    graphed.forward(&stack.s, &x1, Replay::caller())?;
    match graphed.forward(&stack.s, &x2, Replay::caller()) {
        Err(e) if matches!(e.refused_by(), Some(graphed::Error::PoolOrder { .. })) => {}
        other => bail!("a second stack forward before the backward: {other:?}"),
    }
    ensure!(
        graphed.static_input()?.to_vec::<f32>(&stack.s)? == x1.to_vec::<f32>(&stack.s)?,
        "the refused stack forward copied"
    );
    graphed.backward(&stack.s, &dy)?;
    graphed.join(&stack.s)?;
    Ok(())
}

/// A join into a stream of another device is refused before anything is taken or enqueued: the
/// tails stay pending (a stack's, and a `Tails`'), so a correct join after it still orders the
/// caller after them, and the next caller-stream replay of their pool is accepted (R4).
pub fn refused_join_leaves_the_tails_pending(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let (side, event) = (dev.stream()?, dev.event()?);
    let elsewhere = Device::sim().stream()?;
    let (x, dy) = model.data(1)?;
    let stack = model.graph(GraphOptions::default().sync_event(&event))?;
    stack.forward(&model.s, &x, Replay::side(&side))?;
    stack.backward(&model.s, &dy)?;
    expect_kind(stack.join(&elsewhere), |k| wrong_device(k, "stream"))?;
    stack.join(&model.s)?;
    stack.forward(&model.s, &x, Replay::caller())?;
    stack.backward(&model.s, &dy)?;

    let (x0, _) = model.data(0)?;
    let one: &[&dyn Callable] = &model.callables()[..1];
    let options = GraphOptions::default().sync_event(&event).pool_per_callable(true);
    let g = make_graphed_callables(&model.alloc, one, &[Inputs::one(&x0)], options)?;
    let mut tails = graphed::graph::Tails::new();
    ensure!(tails.is_empty(), "no tails yet");
    let (_y, tail) = g[0].forward(&model.s, &Inputs::one(&x), Replay::side(&side))?;
    tails.push(tail);
    ensure!(tails.len() == 1, "one pending tail, not {}", tails.len());
    expect_kind(tails.join(&elsewhere), |k| wrong_device(k, "stream"))?;
    ensure!(tails.len() == 1, "the refused join left the tail pending");
    tails.join(&model.s)?;
    ensure!(tails.is_empty(), "the join took the tail");
    let (_dx, _t) = g[0].backward_with(&model.s, &[&dy], Replay::caller())?;
    Ok(())
}

/// `backward_dw` with no split weight gradient is refused alike by a callable and a stack
/// (`NoSplitDw`), before anything is enqueued.
pub fn backward_dw_without_a_split_is_refused(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let (x, dy) = model.data(1)?;
    let stack = model.graph(GraphOptions::default())?;
    stack.forward(&model.s, &x, Replay::caller())?;
    stack.backward(&model.s, &dy)?;
    expect_kind(stack.backward_dw(&model.s), |k| matches!(k, GraphedErrorKind::NoSplitDw))?;
    let (x0, _) = model.data(0)?;
    let g =
        make_graphed_callables(&model.alloc, &model.callables()[..1], &[Inputs::one(&x0)], GraphOptions::default())?;
    let _t = g[0].forward(&model.s, &Inputs::one(&x), Replay::caller())?;
    let _t = g[0].backward(&model.s, &[&dy])?;
    expect_kind(g[0].backward_dw(&model.s), |k| matches!(k, GraphedErrorKind::NoSplitDw))?;
    Ok(())
}
