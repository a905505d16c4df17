//! The sync event's contract, verified at capture (R2, R3, R7), and the overlap it buys.

use anyhow::ensure;
use graphed::device::{Device, DeviceKind, Stream};
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, GraphedErrorKind, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Inputs, Linear, Module, Param, ParamStore, SaveHook};
use graphed::tensor::Tensor;
use graphed::CaptureErrorKind;
use std::sync::Arc;

use super::api::expect_kind;
use super::fixtures::{lcg, Model, Result, TailHook, TailWork};

/// A Linear (8 → 4) in a store of its own, and an input (2, 8).
struct LinearSetup {
    s: Stream,
    alloc: CachingAllocator,
    store: ParamStore,
    lin: Linear,
    x: Tensor,
}

impl LinearSetup {
    fn new(dev: &Device) -> Result<LinearSetup> {
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let store = ParamStore::new(&alloc, &s, Linear::parameter_count((8, 4)))?;
        let lin = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(1).pp("fc"), (8, 4))?;
        let x = Tensor::from_host(&alloc, &s, &lcg(16, 1), &[2, 8])?;
        Ok(LinearSetup { s, alloc, store, lin, x })
    }
}

/// Graphs a Linear with `hook` and a sync event; returns the result of the capture.
fn capture_linear(
    dev: &Device,
    make_hook: impl FnOnce(&CachingAllocator) -> Result<TailHook>,
) -> Result<graphed::Result<()>> {
    let LinearSetup { s: _s, alloc, store: _store, lin, x } = LinearSetup::new(dev)?;
    let hook = Arc::new(make_hook(&alloc)?);
    let options = GraphOptions::default().sync_event(&dev.event()?).save_hook(hook);
    Ok(make_graphed_callables(&alloc, &[&lin as &dyn Callable], &[Inputs::one(&x)], options).map(|_| ()))
}

fn contract(rule: &'static str) -> impl Fn(&GraphedErrorKind) -> bool {
    move |k| matches!(k, GraphedErrorKind::SyncContract { rule: r, .. } if *r == rule)
}

/// A tail that reads the static input, which the caller overwrites with the next input as soon
/// as it resumes: R3.
pub fn tail_reading_static_input_is_refused(dev: &Device) -> Result {
    expect_kind(capture_linear(dev, |a| TailHook::new(dev, a, TailWork::ReadSaved))?, contract("R3"))
}

/// A tail that writes memory the caller reads after resuming: R2.
pub fn tail_writing_output_is_refused(dev: &Device) -> Result {
    expect_kind(capture_linear(dev, |a| TailHook::new(dev, a, TailWork::WriteSaved))?, contract("R2"))
}

/// The event recorded twice inside the graph: no single sync point (R2).
pub fn event_recorded_twice_is_refused(dev: &Device) -> Result {
    let LinearSetup { s: _s, alloc, store: _store, lin, x } = LinearSetup::new(dev)?;
    let e = dev.event()?;
    let mut hook = TailHook::new(dev, &alloc, TailWork::Churn(1))?;
    hook.extra_record = Some(e.clone());
    let options = GraphOptions::default().sync_event(&e).save_hook(Arc::new(hook));
    let r = make_graphed_callables(&alloc, &[&lin as &dyn Callable], &[Inputs::one(&x)], options);
    expect_kind(r, contract("R2"))
}

/// A graph that waits on an external event cannot resume the caller at its sync event (R7).
pub fn external_wait_is_refused(dev: &Device) -> Result {
    // Recorded once outside, so that the wait is on a real event (on CUDA too).
    let other = dev.event()?;
    dev.stream()?.record(&other)?;
    expect_kind(
        capture_linear(dev, |a| {
            let mut h = TailHook::new(dev, a, TailWork::Churn(1))?;
            h.extra_wait = Some(other.clone());
            Ok(h)
        })?,
        contract("R7"),
    )
}

/// A long legal tail (work on the pool's scratch memory after the event): capture accepts it, the
/// results equal a plain replay's, and on CUDA the caller's stream measurably resumes before the
/// tail ends.
pub fn side_stream_resumes_before_tail_ends(dev: &Device) -> Result {
    let churn = if dev.kind() == DeviceKind::Cuda { 400 } else { 2 };
    let plain = Model::new(dev)?;
    let stack = Model::new(dev)?;
    let (side, e) = (dev.stream()?, dev.event()?);
    let (x0, _) = stack.data(0)?;
    let hook = Arc::new(TailHook::new(dev, &stack.alloc, TailWork::Churn(churn))?);
    let options = GraphOptions::default().sync_event(&e).save_hook(hook);
    let g = make_graphed_callables(&stack.alloc, &stack.callables()[..1], &[Inputs::one(&x0)], options)?;
    let p =
        make_graphed_callables(&plain.alloc, &plain.callables()[..1], &[Inputs::one(&x0)], GraphOptions::default())?;
    for k in 1..4 {
        let (x, _) = stack.data(k)?;
        let (resumed, tail_end) = (dev.timing_event()?, dev.timing_event()?);
        let (y, tail) = g[0].forward(&stack.s, &Inputs::one(&x), Replay::side(&side))?;
        stack.s.record(&resumed)?;
        side.record(&tail_end)?;
        let got = y[0].get()?.to_vec::<f32>(&stack.s)?;
        tail.join(&stack.s)?;
        let (yp, _t) = p[0].forward(&plain.s, &Inputs::one(&x), Replay::caller())?;
        ensure!(got == yp[0].get()?.to_vec::<f32>(&plain.s)?, "replay {k}: side-stream output differs");
        let dy = Tensor::zeros(&stack.alloc, &stack.s, y[0].shape(), y[0].dtype())?;
        let (_dx, _t) = g[0].backward(&stack.s, &[&dy])?;
        let dy = Tensor::zeros(&plain.alloc, &plain.s, y[0].shape(), y[0].dtype())?;
        let (_dx, _t) = p[0].backward(&plain.s, &[&dy])?;
        if dev.kind() == DeviceKind::Cuda {
            tail_end.synchronize()?;
            let lead = resumed.elapsed_ms(&tail_end)?;
            println!("replay {k}: the caller resumed {lead:.3} ms before the tail ended");
            ensure!(lead > 0.0, "replay {k}: the caller resumed only after the tail ({lead} ms)");
        }
    }
    Ok(())
}

/// A Linear whose forward records the sync event itself, as a module must not.
struct RecordsEvent<'a> {
    inner: &'a Linear,
    event: graphed::device::Event,
}

impl Module for RecordsEvent<'_> {
    type Ctx = <Linear as Module>::Ctx;

    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, Self::Ctx)> {
        let out = self.inner.forward(inputs, hook, s)?;
        s.record_external(&self.event)?;
        Ok(out)
    }

    fn backward(&self, ctx: Self::Ctx, dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        self.inner.backward(ctx, dys, s)
    }

    fn parameters(&self) -> Vec<&Param> {
        self.inner.parameters()
    }

    fn set_training(&mut self, _training: bool) {}
}

/// A module that records the sync event itself is refused with the same typed error on both
/// devices: its warmup forward makes an external record outside a capture, which CUDA refuses.
pub fn module_recording_the_sync_event_is_refused(dev: &Device) -> Result {
    let LinearSetup { s, alloc, store, lin, x } = LinearSetup::new(dev)?;
    let e = dev.event()?;
    let m = RecordsEvent { inner: &lin, event: e.clone() };
    let grads = store.grads()?.to_vec::<f32>(&s)?;
    let r = make_graphed_callables(
        &alloc,
        &[&m as &dyn Callable],
        &[Inputs::one(&x)],
        GraphOptions::default().sync_event(&e),
    );
    match r {
        Err(err) if err.capture_kind() == Some(CaptureErrorKind::ExternalOutsideCapture) => {}
        other => anyhow::bail!("a module recording the sync event: {other:?}"),
    }
    ensure!(store.grads()?.to_vec::<f32>(&s)? == grads, "the refused capture changed the gradients");
    Ok(())
}
