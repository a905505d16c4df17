//! Lent gradients (`GraphOptions::lend_gradients`): the layers' gradient memory holds the
//! activations of the layers above while it is dead, with the results of eager training bit for
//! bit, a lower pool peak, outputs that refuse reads once zeroed, and refusals that change nothing.

use anyhow::ensure;
use graphed::device::{AccessMode, DType, Device, Stream};
use graphed::graph::{
    make_graphed_callables, make_graphed_fn, make_graphed_stack, GraphOptions, GraphedErrorKind, Phase, Replay,
};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    Builder, Inputs, KeepOnDevice, Linear, Module, Param, ParamStore, SaveHook, Stack, TransformerLayer,
};
use graphed::ops::attention::AttentionBackend;
use graphed::ops::elementwise;
use graphed::tensor::Tensor;
use std::sync::{Arc, Mutex};

use super::api::expect_kind;
use super::fixtures::{Model, Result};

/// Three layers: layer 0 lends to the forwards of layers 1 and 2 and to layer 2's backward,
/// layer 1 to layer 2's forward.
const LAYERS: usize = 3;
const STEPS: u64 = 3;

fn lend() -> GraphOptions {
    GraphOptions::default().lend_gradients(true)
}

/// Twin models, eager and graphed with lent gradients (side stream, so the sync-point rules are
/// verified with lent memory in the tails), one microbatch per step: outputs, input gradients,
/// parameter gradients after each backward and parameters after each AdamW step, bit for bit.
fn lent_training(dev: &Device, dtype: DType, side: bool) -> Result {
    let eager = Model::deep(dev, dtype, LAYERS)?;
    let graphed = Model::deep(dev, dtype, LAYERS)?;
    let (stream, event) = (dev.stream()?, dev.event()?);
    let (options, replay) = match side {
        true => (lend().sync_event(&event), Replay::side(&stream)),
        false => (lend(), Replay::caller()),
    };
    let g = graphed.graph(options)?;
    let optimizer = make_graphed_fn(&graphed.alloc, |s| graphed.optimizer.step(s))?;
    ensure!(graphed.alloc.blocks().iter().any(|b| b.lent), "no layer lent its gradients");
    for step in 0..STEPS {
        let (x, dy) = eager.data(step)?;
        let want = eager.eager(&x, &dy)?;
        let (x, dy) = graphed.data(step)?;
        ensure!(graphed.graphed(&g, &x, &dy, replay)? == want, "step {step}: outputs or input gradients differ");
        ensure!(eager.grads()? == graphed.grads()?, "step {step}: parameter gradients differ");
        eager.optimizer_step()?;
        g.take_gradients()?;
        optimizer.replay(&graphed.s)?;
        ensure!(eager.params()? == graphed.params()?, "step {step}: parameters differ after AdamW");
    }
    ensure!(eager.params()? != Model::deep(dev, dtype, LAYERS)?.params()?, "training changed nothing");
    Ok(())
}

pub fn lent_gradients_match_eager(dev: &Device) -> Result {
    lent_training(dev, DType::F32, false)
}

pub fn lent_gradients_match_eager_on_a_side_stream_in_bf16(dev: &Device) -> Result {
    lent_training(dev, DType::BF16, true)
}

/// The pool's peak drops: the layers above layer 0 keep their activations in its gradients,
/// by at most what the lending layers' gradients hold. (Reserved memory comes in 2 MiB pages,
/// more than this model's pool: the benchmarks measure it.)
pub fn lent_gradients_lower_the_pool_peak(dev: &Device) -> Result {
    let peak = |options: GraphOptions| -> Result<usize> {
        let m = Model::deep(dev, DType::BF16, LAYERS)?;
        let g = m.graph(options)?;
        let (x, dy) = m.data(0)?;
        m.graphed(&g, &x, &dy, Replay::caller())?;
        Ok(g.pool().stats().peak_allocated)
    };
    let (kept, lent) = (peak(GraphOptions::default())?, peak(lend())?);
    let m = Model::deep(dev, DType::BF16, LAYERS)?;
    let unit = m.shape.iter().product::<usize>() * DType::BF16.size();
    let lendable = (LAYERS - 1) * TransformerLayer::parameter_count(m.shape[2]) * DType::BF16.size();
    ensure!(
        lent + 4 * unit <= kept && kept - lent <= lendable,
        "the pool peaked at {lent} B lending, {kept} B not; four activations are {} B, the lent gradients {lendable} B",
        4 * unit
    );
    Ok(())
}

/// The cache's rise over its steady allocation while `m`'s stack is captured with `options`:
/// the warmup's, which holds one layer's activations and transients at a time.
fn warmup_rise(m: &Model, options: GraphOptions) -> Result<usize> {
    let steady = m.alloc.stats().default.allocated;
    let g = m.graph(options)?;
    let rise = m.alloc.stats().default.peak_allocated - steady;
    drop(g);
    Ok(rise)
}

/// A lending stack's warmup places its passes' blocks in the gradients of the layers other
/// than their own (Note [Lent gradients in the warmup]): the cache rises during the capture by
/// at most what does not fit there, with the results of eager training still bit for bit.
pub fn a_lending_stack_warms_up_in_its_gradients(dev: &Device) -> Result {
    const DEEP: usize = 4;
    let kept = warmup_rise(&Model::deep(dev, DType::BF16, DEEP)?, GraphOptions::default())?;
    let m = Model::deep(dev, DType::BF16, DEEP)?;
    let lent = warmup_rise(&m, lend())?;
    let unit = m.shape.iter().product::<usize>() * DType::BF16.size();
    ensure!(lent + 4 * unit <= kept, "the warmup rose by {lent} B lending, {kept} B not: one unit is {unit} B");
    ensure!(m.alloc.blocks().iter().all(|b| !b.lent), "the warmup left lent memory in the cache");
    Ok(())
}

/// The stack's output lies in lent memory: readable until the backward zeroes it, refused after
/// (a stale read, not gradients read as activations), and refused after release; the pool then
/// holds nothing, and the gradients, zeroed, train eagerly as a model's that never lent.
pub fn a_lent_output_refuses_reads_once_zeroed(dev: &Device) -> Result {
    let m = Model::deep(dev, DType::F32, LAYERS)?;
    let mut g = m.graph(lend())?;
    let (x, dy) = m.data(1)?;
    let y = g.forward(&m.s, &x, Replay::caller())?;
    let grads = m.store.grads()?.access(AccessMode::Read)?;
    ensure!(y.get()?.access(AccessMode::Read)?.overlaps(&grads), "the last layer's output is not in lent memory");
    y.get()?.to_f32_vec(&m.s)?;
    g.backward(&m.s, &dy)?;
    g.join(&m.s)?;
    expect_kind(y.get(), |k| matches!(k, GraphedErrorKind::StaleOutput { .. }))?;
    g.take_gradients()?;
    let y = g.forward(&m.s, &x, Replay::caller())?;
    y.get()?;
    g.release_static_state()?;
    expect_kind(y.get(), |k| matches!(k, GraphedErrorKind::OutputReleased { .. }))?;
    ensure!(m.alloc.blocks().iter().all(|b| !b.lent), "released, the pool still holds lent memory");
    let held = g.pool().stats();
    ensure!((held.allocated, held.reserved, held.lent) == (0, 0, 0), "released, the pool holds {held:?}");
    // The forward left the gradients undefined (the contract); from zero they are the store's.
    let twin = Model::deep(dev, DType::F32, LAYERS)?;
    let drawn = Tensor::from_host(&twin.alloc, &twin.s, &m.step.to_vec::<u64>(&m.s)?, &[1])?;
    twin.step.copy_from(&drawn, &twin.s)?;
    m.store.grads()?.zero(&m.s)?;
    ensure!(m.eager(&x, &dy)? == twin.eager(&x, &dy)?, "eager after the release differs from a model that never lent");
    ensure!(m.grads()? == twin.grads()?, "eager gradients after the release differ from a model that never lent");
    Ok(())
}

/// Lending is refused where it cannot work, before anything runs: inference, a pool per
/// callable, callables graphed one by one, and layers that split their weight gradients out
/// (what `backward_dw` reads would live past the backwards below, which zero it).
pub fn lending_is_refused_where_it_cannot_work(dev: &Device) -> Result {
    let m = Model::deep(dev, DType::F32, LAYERS)?;
    let before = (m.grads()?, m.alloc.stats().pools.len());
    let refused = |k: &GraphedErrorKind| matches!(k, GraphedErrorKind::LendGradients { .. });
    let (x0, _) = m.data(0)?;
    expect_kind(make_graphed_stack(&m.alloc, &m.stack, &x0, lend().inference()), refused)?;
    expect_kind(make_graphed_stack(&m.alloc, &m.stack, &x0, lend().pool_per_callable(true)), refused)?;
    let samples: Vec<Inputs> = m.layers().iter().map(|_| Inputs::one(&x0)).collect();
    expect_kind(make_graphed_callables(&m.alloc, &m.callables(), &samples, lend()), refused)?;
    ensure!((m.grads()?, m.alloc.stats().pools.len()) == before, "a refused capture changed the model or made a pool");
    let store = ParamStore::new(&m.alloc, &m.s, 2 * Linear::parameter_count((8, 8)))?;
    let vb = Builder::new(&store, &m.alloc, &m.s)?;
    let mut layers = vec![Linear::new(&vb.pp("fc0"), (8, 8))?, Linear::new(&vb.pp("fc1"), (8, 8))?];
    layers[1].set_split_dw(true);
    let x = Tensor::from_host(&m.alloc, &m.s, &[0.5f32; 24], &[3, 8])?;
    expect_kind(make_graphed_stack(&m.alloc, &Stack::new(layers), &x, lend()), refused)?;
    Ok(())
}

/// The pool's (peak, allocated) bytes after each forward a capture-time hook sees (the warmup's
/// too, before the pool holds anything), for the stack graphed with `options`.
fn after_forwards(dev: &Device, options: GraphOptions) -> Result<Vec<(usize, usize)>> {
    let m = Model::deep(dev, DType::BF16, LAYERS)?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (alloc, log) = (m.alloc.clone(), seen.clone());
    let options = options.capture_time_hook(move |_, phase, _| {
        if let (Phase::Forward, Some((_, p))) = (phase, alloc.stats().pools.last()) {
            log.lock().unwrap().push((p.peak_allocated, p.allocated));
        }
        Ok(())
    });
    m.graph(options)?;
    let seen = seen.lock().unwrap().clone();
    Ok(seen)
}

/// Blocks that die within their pass take gradient memory dead for that pass alone (Note
/// [Pass-local blocks]): every layer's gradients, the last layer's included, during any forward.
/// So no captured forward raises the pool above what it keeps, as it does when the gradients are
/// kept (the first forward's transients, which no lower layer's gradients could take).
pub fn pass_local_blocks_take_gradients_dead_for_their_pass(dev: &Device) -> Result {
    let lent = after_forwards(dev, lend())?;
    ensure!(lent.iter().any(|&(_, allocated)| allocated > 0), "the hook never saw the pool hold anything: {lent:?}");
    ensure!(
        lent.iter().all(|&(peak, allocated)| peak == allocated),
        "a forward's transients were in the pool: {lent:?}"
    );
    let kept = after_forwards(dev, GraphOptions::default())?;
    ensure!(
        kept.iter().any(|&(peak, allocated)| peak > allocated),
        "keeping the gradients, no transient was: {kept:?}"
    );
    Ok(())
}

/// `y = x` with a parameter whose gradient the backward bumps, and a scratch block of `x`'s size
/// that the forward keeps when captured (a pass that allocates otherwise when captured than in
/// the warmup), or, `first`, on its first pass (state made in the warmup).
struct Hoarder {
    p: Param,
    alloc: CachingAllocator,
    kept: Mutex<Option<Tensor>>,
    first: bool,
}

impl Module for Hoarder {
    type Ctx = ();

    fn forward(&self, inputs: &Inputs, _hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, ())> {
        let x = inputs.only("Hoarder::forward")?;
        let scratch = Tensor::zeros(&self.alloc, s, x.shape(), x.dtype())?;
        let y = Tensor::uninit(&self.alloc, s, x.shape(), x.dtype())?;
        y.copy_from(x, s)?;
        let mut kept = self.kept.lock().unwrap();
        if (self.first && kept.is_none()) || (!self.first && s.capture_id()?.is_some()) {
            *kept = Some(scratch);
        }
        Ok((vec![y], ()))
    }

    fn backward(&self, (): (), dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        let dx = Tensor::uninit(&self.alloc, s, dys[0].shape(), dys[0].dtype())?;
        dx.copy_from(dys[0], s)?;
        elementwise::add_scalar(self.p.grad.view::<f32>()?, 1.0, s)?;
        Ok(vec![Some(dx)])
    }

    fn parameters(&self) -> Vec<&Param> {
        vec![&self.p]
    }

    fn set_training(&mut self, _training: bool) {}
}

/// A pass whose capture keeps a block its warmup freed is refused when gradients are lent: the
/// block would lie in gradient memory lent for the pass alone, which a later pass zeroes. The
/// refusal leaves the gradients as they were, and the pool gives the lent memory back once the
/// kept blocks are dropped; the same stack graphs without lending.
pub fn a_pass_that_keeps_what_its_warmup_freed_is_refused(dev: &Device) -> Result {
    let held = |k: &GraphedErrorKind| matches!(k, GraphedErrorKind::PassLocalHeld { bytes } if *bytes > 0);
    let (alloc, stack, x) = hoarders_refused(dev, false, held)?;
    stack.layers().iter().for_each(|h| drop(h.kept.lock().unwrap().take()));
    alloc.empty_cache()?;
    ensure!(alloc.blocks().iter().all(|b| !b.lent), "lent memory is held by more than what the layers kept");
    make_graphed_stack(&alloc, &stack, &x, GraphOptions::default())?;
    Ok(())
}

/// Two hoarders (`first`: keeping state made in their first pass) over one store, and an input.
fn hoarders(dev: &Device, first: bool) -> Result<(CachingAllocator, Stream, ParamStore, Stack<Hoarder>, Tensor)> {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let store = ParamStore::new(&alloc, &s, 2 * 1024)?;
    let layer = |i: usize| -> Result<Hoarder> {
        let p = store.add(&format!("hoarder{i}.p"), &[1024], &[0.0; 1024], &s)?;
        Ok(Hoarder { p, alloc: alloc.clone(), kept: Mutex::new(None), first })
    };
    let stack = Stack::new(vec![layer(0)?, layer(1)?]);
    let x = Tensor::from_host(&alloc, &s, &[0.5f32; 64], &[2, 32])?;
    Ok((alloc, s, store, stack, x))
}

/// [`hoarders`] whose lending capture is refused as `held` says, the gradients left as they were.
fn hoarders_refused(
    dev: &Device,
    first: bool,
    held: impl Fn(&GraphedErrorKind) -> bool,
) -> Result<(CachingAllocator, Stack<Hoarder>, Tensor)> {
    let (alloc, s, store, stack, x) = hoarders(dev, first)?;
    let before = store.grads()?.to_f32_vec(&s)?;
    expect_kind(make_graphed_stack(&alloc, &stack, &x, lend()), held)?;
    ensure!(store.grads()?.to_f32_vec(&s)? == before, "the refused capture changed the gradients");
    Ok((alloc, stack, x))
}

/// State a module makes in its first pass lands, in a lending stack's warmup, in another
/// layer's gradient memory, which the restored gradients overwrite: the capture is refused,
/// gradients as they were, and no pool is left holding lent memory. Made before graphing (one
/// eager step), the same state graphs with lending.
pub fn state_made_in_a_lending_warmup_is_refused(dev: &Device) -> Result {
    let held = |k: &GraphedErrorKind| matches!(k, GraphedErrorKind::WarmupLentState { bytes } if *bytes > 0);
    let (alloc, _, _) = hoarders_refused(dev, true, held)?;
    ensure!(alloc.stats().pools.iter().all(|(_, p)| p.lent == 0), "a pool holds lent memory after the refusal");
    let (alloc, s, _store, stack, x) = hoarders(dev, true)?;
    let (_, ctx) = stack.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
    drop(ctx);
    make_graphed_stack(&alloc, &stack, &x, lend())?;
    Ok(())
}

/// What ran each of `m`'s layers' latest attention backward.
fn backward_backends(m: &Model) -> Vec<Option<AttentionBackend>> {
    m.layers().iter().map(|l| l.attn.backends_ran().backward).collect()
}

/// A stack whose attention runs on cuDNN where it can (its backward's `T × T` scratch a
/// transient of the pass, in lent memory where it fits) lends its gradients and matches its
/// eager twin bit for bit, each layer's backward on the backend the twin's ran on.
pub fn a_lending_stack_on_cudnn_matches_eager(dev: &Device) -> Result {
    let (eager, graphed) = (Model::cudnn_shaped(dev)?, Model::cudnn_shaped(dev)?);
    let (x, dy) = eager.data(1)?;
    let want = eager.eager(&x, &dy)?;
    let g = graphed.graph(lend())?;
    ensure!(graphed.alloc.blocks().iter().any(|b| b.lent), "no layer lent its gradients");
    let (x, dy) = graphed.data(1)?;
    ensure!(graphed.graphed(&g, &x, &dy, Replay::caller())? == want, "the graphed stack differs from its eager twin");
    ensure!(graphed.grads()? == eager.grads()?, "parameter gradients differ from the eager twin's");
    let ran = backward_backends(&graphed);
    ensure!(
        backward_backends(&eager) == ran,
        "the eager twin ran {:?}, the graphed stack {ran:?}",
        backward_backends(&eager)
    );
    let cudnn = dev.kind() == graphed::device::DeviceKind::Cuda;
    let want_backend = if cudnn { AttentionBackend::Cudnn } else { AttentionBackend::Kernels };
    ensure!(ran.iter().all(|b| *b == Some(want_backend)), "the backwards ran on {ran:?}");
    Ok(())
}

/// Lent memory allows one backward per optimizer step, and the stack says so before anything
/// runs: a second forward or backward before the gradients are taken is refused (it would write
/// activations into them, or zero them), as is taking them after a forward alone (they hold
/// activations); each refusal changes nothing, and the step then goes on as without it.
pub fn lent_gradients_refuse_a_step_out_of_order(dev: &Device) -> Result {
    let eager = Model::deep(dev, DType::F32, LAYERS)?;
    let m = Model::deep(dev, DType::F32, LAYERS)?;
    let g = m.graph(lend())?;
    let out_of_order = |k: &GraphedErrorKind| matches!(k, GraphedErrorKind::LentOrder { .. });
    let (x, dy) = m.data(0)?;
    g.forward(&m.s, &x, Replay::caller())?;
    expect_kind(g.take_gradients(), out_of_order)?;
    g.backward(&m.s, &dy)?;
    g.join(&m.s)?;
    let grads = m.grads()?;
    expect_kind(g.forward(&m.s, &x, Replay::caller()), out_of_order)?;
    expect_kind(g.backward(&m.s, &dy), out_of_order)?;
    ensure!(m.grads()? == grads, "a refused replay changed the gradients");
    let (ex, edy) = eager.data(0)?;
    eager.eager(&ex, &edy)?;
    ensure!(grads == eager.grads()?, "the gradients differ from eager");
    g.take_gradients()?;
    expect_kind(g.take_gradients(), out_of_order)?;
    let (x, dy) = m.data(1)?;
    eager.store.grads()?.zero(&eager.s)?;
    let (ex, edy) = eager.data(1)?;
    ensure!(m.graphed(&g, &x, &dy, Replay::caller())? == eager.eager(&ex, &edy)?, "the next step differs from eager");
    ensure!(m.grads()? == eager.grads()?, "the next step's gradients differ from eager");
    g.take_gradients()?;
    Ok(())
}
