//! FP8 with data parallelism: each step takes the amaxes' max across the ranks inside the
//! optimizer's graphed step (`Fp8Training::reduce_amaxes_over`), so two ranks with a microbatch
//! each scale as one rank with both would, and always alike.

use anyhow::{ensure, Context};
use graphed::device::{CommOptions, Communicator, DType, Device, Policy, Stream};
use graphed::graph::{make_graphed_fn, make_graphed_stack, GraphOptions, GraphedFn, GraphedStack, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    Builder, DelayedRecipe, Fp8Recipe, Fp8Scaling, Fp8Training, Layers, ParamStore, Stack, TransformerLayer,
};
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;
use graphed::Error;

use super::common::{lcg, Ranks};
use graphed::dist::DataParallel;

/// Width and tokens per microbatch: multiples of 16, as FP8 GEMMs need.
const DIM: usize = 32;
const TOKENS: usize = 16;
const STEPS: u64 = 3;

/// Two bf16 layers whose Linear layers run in FP8, an optimizer that steps the recipes, and the
/// layers and the optimizer's step graphed.
struct Model {
    alloc: CachingAllocator,
    s: Stream,
    store: ParamStore,
    fp8: Fp8Training,
    stack: Stack<TransformerLayer>,
    opt: AdamW,
}

fn model(dev: &Device) -> graphed::Result<Model> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::with_dtype(&alloc, &s, 2 * TransformerLayer::parameter_count(DIM), DType::BF16)?;
    let fp8 = Fp8Training::new(
        &alloc,
        Fp8Recipe {
            scaling: Fp8Scaling::Delayed(DelayedRecipe { history_len: 4, ..DelayedRecipe::default() }),
            ..Fp8Recipe::default()
        },
    );
    let vb = Builder::new(&store, &alloc, &s)?.with_seed(3).with_fp8(&fp8);
    let stack = Stack::new(TransformerLayer::stack(&vb, (DIM, 1), &Layers::first(2))?);
    fp8.start(&s)?;
    let opt = AdamW::new(&alloc, &store, AdamWHyper::default(), LrSchedule::Constant(1e-2), &s)?.with_fp8(&fp8);
    Ok(Model { alloc, s, store, fp8, stack, opt })
}

/// Microbatch `k` of step `step`, `(x, dy)`: microbatch `k`'s values are `k + 1` times as large,
/// so that the ranks' amaxes differ and only their max gives one rank's scales.
fn data(m: &Model, step: u64, k: u64) -> graphed::Result<(Tensor, Tensor)> {
    let at =
        |salt: u64| -> Vec<f32> { lcg(TOKENS * DIM, step * 17 + salt).iter().map(|v| v * (k + 1) as f32).collect() };
    Ok((
        Tensor::from_f32(&m.alloc, &m.s, &at(1), &[1, TOKENS, DIM], DType::BF16)?,
        Tensor::from_f32(&m.alloc, &m.s, &at(2), &[1, TOKENS, DIM], DType::BF16)?,
    ))
}

/// Per step: the gradients, then the parameters and every scale after the optimizer's step.
type Trace = Vec<[Vec<f32>; 3]>;

/// The scales of both recipes.
fn scales(m: &Model) -> graphed::Result<Vec<f32>> {
    let (forward, backward) = m.fp8.state()?;
    Ok([forward.scales().to_f32_vec(&m.s)?, backward.scales().to_f32_vec(&m.s)?].concat())
}

/// Runs `steps` steps of `m` through its graphs, microbatches `ks` of each step on this rank.
fn train(m: &Model, graphed: &GraphedStack, step_fn: &GraphedFn, ks: &[u64]) -> graphed::Result<Trace> {
    let mut trace = Vec::new();
    for step in 0..STEPS {
        for &k in ks {
            let (x, dy) = data(m, step, k)?;
            graphed.forward(&m.s, &x, Replay::caller())?;
            graphed.backward(&m.s, &dy)?;
        }
        graphed.join(&m.s)?;
        let grads = m.store.grads()?.to_f32_vec(&m.s)?;
        step_fn.replay(&m.s)?;
        trace.push([grads, m.store.values()?.to_f32_vec(&m.s)?, scales(m)?]);
    }
    Ok(trace)
}

/// One rank accumulating microbatches 0 and 1 of every step.
fn one_rank(dev: &Device) -> graphed::Result<Trace> {
    let m = model(dev)?;
    let (x0, _) = data(&m, 0, 0)?;
    let graphed = make_graphed_stack(&m.alloc, &m.stack, &x0, GraphOptions::default())?;
    let step_fn = make_graphed_fn(&m.alloc, |s| m.opt.step(s))?;
    train(&m, &graphed, &step_fn, &[0, 1])
}

/// Rank `comm.rank()` of two, microbatch `rank` of every step, the gradients reduced inside the
/// backward graphs and, with `reduce_amaxes`, the amaxes inside the optimizer's graph.
fn rank(comm: &Communicator, reduce_amaxes: bool) -> graphed::Result<Trace> {
    let m = model(comm.device())?;
    if reduce_amaxes {
        m.fp8.reduce_amaxes_over(comm)?;
    }
    let dp = DataParallel::for_stack(comm, &m.store, &m.stack)?;
    let (x0, _) = data(&m, 0, 0)?;
    let graphed = make_graphed_stack(&m.alloc, &m.stack, &x0, GraphOptions::default().grad_sync(dp))?;
    let step_fn = make_graphed_fn(&m.alloc, |s| m.opt.step(s))?;
    // Set after a step was captured, the group would miss that graph: refused.
    let late = m.fp8.reduce_amaxes_over(comm);
    if !matches!(late, Err(Error::Unsupported { .. })) {
        return Err(Error::Unsupported { op: "test", backend: "any", why: "a late amax group was not refused" });
    }
    train(&m, &graphed, &step_fn, &[comm.rank() as u64])
}

/// The two ranks' traces against `want`, one rank's with both microbatches, with and without
/// the amax reduction. FP8 runs bf16 gradients, which one rank accumulates with one rounding per
/// microbatch and two ranks sum with one more, so only the first step's scales (which come from
/// the forward's and backward's amaxes, before any gradient) can equal one rank's bit for bit;
/// what the reduction guarantees at every step is that the ranks agree: the same scales, hence
/// the same FP8 weights and the same parameters.
fn ranks_agree_and_scale_as_one(want: &Trace, on: Ranks) -> anyhow::Result<()> {
    let traces = |reduce| -> anyhow::Result<Vec<Trace>> {
        let ranks = on.run(2, CommOptions::default(), |c| rank(c, reduce))?.into_iter().enumerate();
        ranks.map(|(r, t)| t.with_context(|| format!("rank {r} {on:?}"))).collect()
    };
    let reduced = traces(true)?;
    ensure!(
        reduced[0][0][2] == want[0][2],
        "{on:?}: the first step's scales differ from one rank's with both microbatches"
    );
    for (step, (a, b)) in reduced[0].iter().zip(&reduced[1]).enumerate() {
        ensure!(a[2] == b[2], "{on:?}: the ranks' scales differ at step {step}");
        ensure!(a[1] == b[1], "{on:?}: the ranks' parameters differ at step {step}");
    }
    // Without the reduction each rank scales by its own amaxes (the test's data is what makes the
    // reduction matter).
    let alone = traces(false)?;
    ensure!(alone[0][0][2] != alone[1][0][2], "{on:?}: ranks alone should scale by their own amaxes");
    Ok(())
}

#[test]
fn fp8_ranks_reduce_their_amaxes_and_scale_alike() -> anyhow::Result<()> {
    let want = one_rank(&Device::sim())?;
    ranks_agree_and_scale_as_one(&want, Ranks::Sim(Policy::Adversarial))
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL"]
fn two_gpus_fp8_ranks_reduce_their_amaxes_and_scale_alike() -> anyhow::Result<()> {
    let want = one_rank(&Device::cuda_checked(0)?)?;
    ranks_agree_and_scale_as_one(&want, Ranks::Gpus)
}
