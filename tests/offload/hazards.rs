//! The hazards of `notes/offload.md` §3.6 that apply to this library, each planted (a step of
//! the protocol left out with `OffloadManager::inject`, or a misuse) and caught by the checker
//! or refused by the API, next to its clean twin.

use anyhow::ensure;
use graphed::check::Checker;
use graphed::device::{DType, Device};
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, GraphedErrorKind, Replay};
use graphed::nn::{Chunk, Inputs, KeepOnDevice, Module};
use graphed::offload::{Fault, OffloadErrorKind, OffloadManager};
use graphed::CaptureErrorKind;

use super::common::expect_capture;
use super::fixtures::{config, expect_clean, expect_hazards_on, KeepAlive, Model, Result, DIMS};

/// Eager iterations with `fault` planted (if any) after the warmup; with `keep`, every saved
/// tensor stays referenced (see [`KeepAlive`]).
fn eager_with(dev: &Device, fault: Option<Fault>, margin: usize, keep: bool) -> Result<Model> {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = model.offload(config().margin(margin))?;
    if let Some(f) = fault {
        m.inject(f);
    }
    for k in 1..3 {
        match keep {
            true => model.eager(&KeepAlive::new(m.chunk(Chunk::default())), k)?,
            false => model.eager(&m.chunk(Chunk::default()), k)?,
        };
        m.end_iteration(&model.s)?;
    }
    Ok(model)
}

/// H7: device memory released for reuse before its copy out ran: later work that reuses it
/// writes what the copy still reads. The simulator's queue holds a block until the work using
/// it ran, and its adversarial schedule runs the copy only when something waits for it, so
/// there the copy keeps its source alive and nothing is reused; the other schedules, and CUDA,
/// reuse it.
pub fn h7_release_before_copy_is_caught(dev: &Device) -> Result {
    eager_with(dev, None, 1, false)?;
    expect_clean(dev)?;
    eager_with(dev, Some(Fault::ReleaseBeforeCopy), 1, false)?;
    if dev.name().contains("Adversarial") {
        Checker::of(dev).map(|c| c.take_hazards());
        return Ok(());
    }
    expect_hazards_on(dev, &["copy_d2h"])
}

/// H9: a copy back that does not wait for its copy out (the margin at 0, so the last unit is
/// copied out and straight back).
pub fn h9_copy_back_before_copy_out_is_caught(dev: &Device) -> Result {
    eager_with(dev, None, 0, true)?;
    expect_clean(dev)?;
    eager_with(dev, Some(Fault::SkipCopyOutWait), 0, true)?;
    expect_hazards_on(dev, &["copy_h2d", "copy_d2h"])
}

/// H9: the backward using a copied-back tensor without waiting for the copy.
pub fn h9_use_before_copy_back_is_caught(dev: &Device) -> Result {
    eager_with(dev, None, 1, true)?;
    expect_clean(dev)?;
    eager_with(dev, Some(Fault::SkipCopyBackWait), 1, true)?;
    expect_hazards_on(dev, &["copy_h2d"])
}

/// H8: two chunks interleaved (chunk B's forward between chunk A's prefetch and its use, as a
/// pipeline schedule does): a host buffer returned at A's copy back is reused by B's copy out,
/// which must wait for the copy back.
fn interleaved(dev: &Device, fault: Option<Fault>) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = graphed::offload::OffloadManager::new(&model.alloc, config())?;
    let (a, b) = (Chunk { microbatch: 0, stage: 0 }, Chunk { microbatch: 1, stage: 0 });
    let run = |k: u64| -> Result {
        let (ha, hb) = (KeepAlive::new(m.chunk(a)), KeepAlive::new(m.chunk(b)));
        let (x, dy) = model.data(k)?;
        let (ya, ctx_a) = model.stack.forward(&Inputs::one(&x), &ha, &model.s)?;
        // A's backward of its last layer prefetches the layer before it, then B's forward.
        let layers = model.stack.layers();
        let mut ctx_a = ctx_a.into_layers();
        let last = ctx_a.pop().expect("layers");
        let d = layers[layers.len() - 1].backward(last, &[&dy], &model.s)?;
        let (yb, ctx_b) = model.stack.forward(&Inputs::one(&ya[0]), &hb, &model.s)?;
        let mut d = d[0].clone().expect("an input gradient");
        for (l, ctx) in ctx_a.into_iter().enumerate().rev() {
            d = layers[l].backward(ctx, &[&d], &model.s)?[0].clone().expect("an input gradient");
        }
        model.stack.backward(ctx_b, &[&yb[0]], &model.s)?;
        Ok(())
    };
    run(0)?;
    m.end_iteration(&model.s)?;
    if let Some(f) = fault {
        m.inject(f);
    }
    for k in 1..3 {
        run(k)?;
        m.end_iteration(&model.s)?;
    }
    Ok(())
}

pub fn h8_host_buffer_reused_before_copy_back_is_caught(dev: &Device) -> Result {
    interleaved(dev, None)?;
    expect_clean(dev)?;
    interleaved(dev, Some(Fault::SkipHostBufferWait))?;
    expect_hazards_on(dev, &["copy_d2h", "copy_h2d"])
}

/// Graphs of the stack with `fault` planted before capture.
fn captured_with(dev: &Device, fault: Option<Fault>) -> Result<graphed::Result<()>> {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = model.offload(config())?;
    // An eager iteration records the groups' own events outside any capture.
    model.eager(&m.chunk(Chunk::default()), 1)?;
    if let Some(f) = fault {
        m.inject(f);
    }
    let e = dev.event()?;
    let (x0, _) = model.data(0)?;
    let options = m.graph_options(GraphOptions::default().sync_event(&e));
    Ok(graphed::graph::make_graphed_stack(&model.alloc, &model.stack, &x0, options).map(|_| ()))
}

/// H3: the copy streams forked into a capture and never joined: capture fails, typed.
pub fn h3_unjoined_copies_fail_the_capture(dev: &Device) -> Result {
    captured_with(dev, None)??;
    expect_capture(captured_with(dev, Some(Fault::SkipJoin))?, CaptureErrorKind::Unjoined)
}

/// H4: inside a capture, a wait on an event recorded outside it: capture fails, typed.
pub fn h4_wait_outside_capture_fails_the_capture(dev: &Device) -> Result {
    captured_with(dev, None)??;
    let r = captured_with(dev, Some(Fault::WaitOutsideCapture))?;
    ensure!(r.as_ref().err().and_then(|e| e.capture_kind()).is_some(), "expected a capture error, got {r:?}");
    Ok(())
}

/// H5: the whole stack as one graph, where copies back and their uses meet in one capture: the
/// capture-local join orders them; without it the checker sees the race at replay.
fn whole_stack(dev: &Device, fault: Option<Fault>) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = OffloadManager::new(&model.alloc, config())?;
    if let Some(f) = fault {
        m.inject(f);
    }
    let (x0, dy) = model.data(0)?;
    let g = make_graphed_callables(
        &model.alloc,
        &[&model.stack as &dyn Callable],
        &[Inputs::one(&x0)],
        m.graph_options(GraphOptions::default()),
    )?;
    let _tail = g[0].forward(&model.s, &Inputs::one(&x0), Replay::caller())?;
    let _tail = g[0].backward(&model.s, &[&dy])?;
    model.s.synchronize()?;
    Ok(())
}

pub fn h5_copy_back_and_use_in_one_graph_are_joined(dev: &Device) -> Result {
    whole_stack(dev, None)?;
    expect_clean(dev)?;
    whole_stack(dev, Some(Fault::SkipCaptureLocalWait))?;
    expect_hazards_on(dev, &["copy_h2d"])
}

/// H1: a side-stream replay without an event recorded in the graph is refused (the upstream
/// bug: a wait on an event that the graph never records).
pub fn h1_side_replay_without_sync_event_is_refused(dev: &Device) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = OffloadManager::new(&model.alloc, config())?;
    let g = model.graph(m.graph_options(GraphOptions::default()))?;
    let side = dev.stream()?;
    let (x, _) = model.data(1)?;
    match g.forward(&model.s, &x, Replay::side(&side)) {
        Err(e) if matches!(e.graphed_kind(), Some(GraphedErrorKind::NoSyncEvent)) => {}
        other => anyhow::bail!("expected NoSyncEvent, got {other:?}"),
    }
    model.graphed(&g, 1, Replay::joined(&side))?;
    Ok(())
}

/// H6: offloading graphs of one pool replayed on two streams without a join: the pool refuses
/// the second stream until the first one's tail is joined.
pub fn h6_graphs_of_one_pool_on_two_streams_are_refused(dev: &Device) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = OffloadManager::new(&model.alloc, config())?;
    let (x0, _) = model.data(0)?;
    let e = dev.event()?;
    let layers: Vec<&dyn Callable> = model.stack.layers().iter().map(|l| l as &dyn Callable).collect();
    let samples: Vec<Inputs> = layers.iter().map(|_| Inputs::one(&x0)).collect();
    let g = make_graphed_callables(
        &model.alloc,
        &layers,
        &samples,
        m.graph_options(GraphOptions::default().sync_event(&e)),
    )?;
    let side = dev.stream()?;
    let (y, tail) = g[0].forward(&model.s, &Inputs::one(&x0), Replay::side(&side))?;
    let y = y[0].get()?.clone();
    match g[1].forward(&model.s, &Inputs::one(&y), Replay::caller()) {
        Err(e) if matches!(e.refused_by(), Some(graphed::Error::PoolConcurrent { .. })) => {}
        other => anyhow::bail!("expected a pool refusal, got {other:?}"),
    }
    tail.join(&model.s)?;
    let _tail = g[1].forward(&model.s, &Inputs::one(&y), Replay::caller())?;
    Ok(())
}

/// H11: with delayed commits, the copies of eager groups wait for the next graph launch, are
/// dropped from the queue when their backward begins, and a forward without its backward is
/// reported by `end_iteration` (which clears the queue). Layers 0 and 1 run eagerly, layers 2
/// and 3 as graphs, in one chunk.
pub fn h11_delayed_copies_are_flushed_or_reported(dev: &Device) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = model.offload(config().delay_eager_commits(true))?;
    let hook = m.chunk(Chunk::default());
    let (x0, _) = model.data(0)?;
    let layers = model.stack.layers();
    let graphed: Vec<&dyn Callable> = vec![&layers[2], &layers[3]];
    let samples = vec![Inputs::one(&x0), Inputs::one(&x0)];
    let g = make_graphed_callables(&model.alloc, &graphed, &samples, m.graph_options(GraphOptions::default()))?;
    let (x, dy) = model.data(1)?;
    let before = m.stats().copied_out;
    let (h, ctx0) = layers[0].forward(&Inputs::one(&x), &hook, &model.s)?;
    let (h, ctx1) = layers[1].forward(&Inputs::one(&h[0]), &hook, &model.s)?;
    ensure!(m.stats().copied_out == before, "delayed copies ran before a graph launch");
    let (h, _t) = g[0].forward(&model.s, &Inputs::one(&h[0]), Replay::caller())?;
    ensure!(m.stats().copied_out > before, "the launch did not flush the delayed copies");
    let h = h[0].get()?.clone();
    let (_, _t) = g[1].forward(&model.s, &Inputs::one(&h), Replay::caller())?;
    let (d, _t) = g[1].backward(&model.s, &[&dy])?;
    let d = d[0].as_ref().expect("a gradient").get()?.clone();
    let (d, _t) = g[0].backward(&model.s, &[&d])?;
    let d = d[0].as_ref().expect("a gradient").get()?.clone();
    let d = layers[1].backward(ctx1, &[&d], &model.s)?[0].clone().expect("a gradient");
    layers[0].backward(ctx0, &[&d], &model.s)?;
    m.end_iteration(&model.s)?;
    // Forward only: the queue is left full.
    let (_, ctx) = layers[0].forward(&Inputs::one(&x), &hook, &model.s)?;
    drop(ctx);
    match m.end_iteration(&model.s) {
        Err(e) if matches!(e.offload_kind(), Some(OffloadErrorKind::Pending { .. })) => {}
        other => anyhow::bail!("expected Pending, got {other:?}"),
    }
    Ok(())
}

/// H13: the policy is frozen by the recording iteration (here a capture's warmup), and a
/// schedule other than the recorded one is refused; a refused forward leaves the step counter
/// as it was.
pub fn h13_schedule_changes_are_refused(dev: &Device) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = OffloadManager::new(&model.alloc, config())?;
    ensure!(m.summary().is_none(), "a new manager has no policy");
    let _g = model.graph(m.graph_options(GraphOptions::default()))?;
    ensure!(m.summary().is_some(), "the capture's warmup did not freeze the policy");
    // Layer 1, then layer 0: layer 0's groups come before the cursor.
    let (x, _) = model.data(1)?;
    let hook = m.chunk(Chunk::default());
    let _ctx = model.stack.layers()[1].forward(&Inputs::one(&x), &hook, &model.s)?;
    match model.stack.layers()[0].forward(&Inputs::one(&x), &hook, &model.s) {
        Err(e) if matches!(e.offload_kind(), Some(OffloadErrorKind::Schedule { .. })) => {}
        other => anyhow::bail!("expected Schedule, got {:?}", other.map(|_| ())),
    }
    // A chunk the warmup did not see: refused, and the stack's dropout step counter is left as
    // it was (the next forward draws the masks it would have drawn without the refused one).
    let step = || -> Result<Vec<u64>> {
        let step = model.stack.rng_step().ok_or_else(|| anyhow::anyhow!("the stack has no step counter"))?;
        Ok(step.to_vec::<u64>(&model.s)?)
    };
    let before = step()?;
    match model.eager(&m.chunk(Chunk { microbatch: 3, stage: 0 }), 1) {
        Err(e)
            if matches!(
                e.downcast_ref::<graphed::Error>().and_then(|e| e.offload_kind()),
                Some(OffloadErrorKind::Schedule { .. })
            ) => {}
        other => anyhow::bail!("expected Schedule, got {other:?}"),
    }
    ensure!(step()? == before, "the refused forward advanced the step counter from {before:?}");
    Ok(())
}

/// H14: the graphs keep their host buffers and the manager's streams: dropping the manager
/// after the capture changes nothing.
pub fn h14_graphs_outlive_their_manager(dev: &Device) -> Result {
    let eager = Model::new(dev, DIMS, DType::F32)?;
    let off = Model::new(dev, DIMS, DType::F32)?;
    let m = OffloadManager::new(&off.alloc, config())?;
    let g = off.graph(m.graph_options(GraphOptions::default()))?;
    drop(m);
    for k in 1..3 {
        ensure!(off.graphed(&g, k, Replay::caller())? == eager.eager(&KeepOnDevice, k)?, "microbatch {k} differs");
    }
    Ok(())
}

/// A capture of the first layer alone on a wrong-shaped input, whose warmup fails.
fn failed_capture(model: &Model, m: &OffloadManager) -> Result {
    let wrong = graphed::tensor::Tensor::zeros(&model.alloc, &model.s, &[2, 8, 16], DType::F32)?;
    let bad = make_graphed_callables(
        &model.alloc,
        &[&model.stack.layers()[0] as &dyn Callable],
        &[Inputs::one(&wrong)],
        m.graph_options(GraphOptions::default()),
    );
    ensure!(bad.is_err(), "a warmup on a wrong-shaped input passed");
    Ok(())
}

/// H17: a warmup that fails still turns offloading back on (the warmup hooks are paired); one
/// that fails while it records leaves the policy unrecorded, so that the next capture records.
pub fn h17_failed_warmup_turns_offloading_back_on(dev: &Device) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = model.offload(config())?;
    failed_capture(&model, &m)?;
    let before = m.stats().copied_out;
    model.eager(&m.chunk(Chunk::default()), 1)?;
    ensure!(m.stats().copied_out > before, "offloading stayed off after the failed warmup");

    let fresh = OffloadManager::new(&model.alloc, config())?;
    failed_capture(&model, &fresh)?;
    ensure!(fresh.summary().is_none(), "a failed recording froze a policy");
    let g = model.graph(fresh.graph_options(GraphOptions::default()))?;
    ensure!(fresh.summary().is_some_and(|s| s.offloaded_bytes() > 0), "the next capture did not record");
    model.graphed(&g, 1, Replay::caller())?;
    Ok(())
}
