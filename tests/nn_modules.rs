//! The transformer layer's modules (LayerNorm, dropout, MLP, causal self-attention, the whole
//! pre-LN layer): input and parameter gradients against finite differences on the simulator,
//! CUDA against the simulator, gradient accumulation, dropout's dependence on the step counter;
//! the fused attention against the unfused one, and its memory.

#[path = "common/mod.rs"]
mod common;

use anyhow::ensure;
use common::{ensure_close, lcg, numeric_grad};
use graphed::device::DType;
use graphed::device::{Device, DeviceKind, Stream};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    AttentionKind, AttentionSpec, Builder, CausalSelfAttention, Dropout, Inputs, KeepOnDevice, LayerNorm, Layers, Mlp,
    Module, ParamStore, Recompute, TransformerLayer,
};
use graphed::ops::rng;
use graphed::tensor::Tensor;
use graphed::Error;

type Result<T = ()> = anyhow::Result<T>;

/// Batch, sequence, width and heads of every case: tiny, so that finite differences stay cheap.
const SHAPE: [usize; 3] = [2, 3, 8];
const HEADS: usize = 2;

/// The tiny cases' attention: heads of 4 features, which only the unfused form runs (the fused
/// one is checked against it below, at heads of 32).
fn tiny(dim: usize, heads: usize) -> AttentionSpec {
    AttentionSpec::new(dim, heads).kind(AttentionKind::Unfused)
}

/// A builder over `store` whose dropouts drop with probability `p` (RNG seed 1234) from site
/// `site`, its step counter at step 1.
fn builder<'a>(
    store: &'a ParamStore,
    alloc: &CachingAllocator,
    s: &Stream,
    p: f32,
    site: u32,
) -> graphed::Result<Builder<'a>> {
    let vb = Builder::new(store, alloc, s)?.with_dropout(p, 1234).with_site(site);
    rng::step_write(vb.step(), 1, s)?;
    Ok(vb)
}

/// Builds the module under test the same way on any device, from a [`builder`] of p = 0 at site 0.
type Build<M> = fn(&Builder) -> graphed::Result<M>;

/// The layer of the gradient cases, its dropouts dropping with probability `p`.
fn layer(vb: &Builder, p: f32) -> graphed::Result<TransformerLayer> {
    TransformerLayer::new(&vb.pp("layer").with_seed(9).with_dropout(p, 1234), tiny(SHAPE[2], HEADS))
}

/// One module on one device with a fixed input `x` and loss weights `r` (loss = Σ y⊙r).
struct Case<M> {
    s: Stream,
    alloc: CachingAllocator,
    store: ParamStore,
    module: M,
    x: Vec<f32>,
    r: Vec<f32>,
}

/// The results of one forward and backward with `dy = r`.
struct Run {
    y: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<f32>,
}

impl<M: Module> Case<M> {
    fn new(dev: &Device, build: Build<M>) -> Result<Case<M>> {
        let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
        let store = ParamStore::new(&alloc, &s, 1024)?;
        let module = build(&builder(&store, &alloc, &s, 0.0, 0)?)?;
        let n = SHAPE.iter().product();
        Ok(Case { s, alloc, store, module, x: lcg(n, 1), r: lcg(n, 2) })
    }

    fn put(&self, data: &[f32]) -> Result<Tensor> {
        Ok(Tensor::from_host(&self.alloc, &self.s, data, &SHAPE)?)
    }

    fn set_params(&self, values: &[f32]) -> Result {
        let staging = Tensor::from_host(&self.alloc, &self.s, values, &[values.len()])?;
        Ok(self.s.copy_d2d(staging.view::<f32>()?, self.store.values()?.view::<f32>()?)?)
    }

    fn forward(&self, x: &[f32]) -> Result<Vec<f32>> {
        let (y, _) = self.module.forward(&Inputs::one(&self.put(x)?), &KeepOnDevice, &self.s)?;
        Ok(y[0].to_vec(&self.s)?)
    }

    fn loss(&self, x: &[f32]) -> Result<f64> {
        Ok(self.forward(x)?.iter().zip(&self.r).map(|(y, r)| f64::from(*y) * f64::from(*r)).sum())
    }

    fn run(&self) -> Result<Run> {
        let (y, ctx) = self.module.forward(&Inputs::one(&self.put(&self.x)?), &KeepOnDevice, &self.s)?;
        let mut dx = self.module.backward(ctx, &[&self.put(&self.r)?], &self.s)?;
        ensure!(y.len() == 1 && dx.len() == 1 && y[0].shape() == SHAPE, "one output and one gradient");
        let dx = dx.remove(0).ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
        ensure!(dx.shape() == SHAPE, "the input gradient has the input's shape");
        Ok(Run { y: y[0].to_vec(&self.s)?, dx: dx.to_vec(&self.s)?, grads: self.store.grads()?.to_vec(&self.s)? })
    }
}

/// Gradients of `build`'s module: on the simulator against central differences (every
/// `stride`-th parameter), on CUDA against the simulator; and a second backward doubles the
/// parameter gradients.
fn check_gradients<M: Module>(dev: &Device, build: Build<M>, stride: usize) -> Result {
    let case = Case::new(dev, build)?;
    let first = case.run()?;
    let twice = case.run()?.grads;
    let doubled: Vec<f64> = first.grads.iter().map(|g| 2.0 * f64::from(*g)).collect();
    ensure_close("accumulated parameter gradients", &twice, &doubled, 1e-6, 1e-5)?;
    if dev.kind() == DeviceKind::Cuda {
        let sim = Case::new(&Device::sim(), build)?.run()?;
        let wide = |v: &[f32]| v.iter().map(|x| f64::from(*x)).collect::<Vec<_>>();
        ensure_close("output vs simulator", &first.y, &wide(&sim.y), 1e-5, 1e-4)?;
        ensure_close("input gradient vs simulator", &first.dx, &wide(&sim.dx), 1e-5, 1e-4)?;
        return ensure_close("parameter gradients vs simulator", &first.grads, &wide(&sim.grads), 1e-5, 1e-4);
    }
    let (atol, rtol, eps) = (2e-3, 1e-2, 1e-2);
    let want_dx = numeric_grad(|x| case.loss(x), &case.x, eps)?;
    ensure_close("input gradient", &first.dx, &want_dx, atol, rtol)?;
    let values = case.store.values()?.to_vec(&case.s)?;
    let picked: Vec<usize> = (0..values.len()).step_by(stride).collect();
    let sub: Vec<f32> = picked.iter().map(|&i| values[i]).collect();
    let want = numeric_grad(
        |sub| {
            let mut all = values.clone();
            picked.iter().zip(sub).for_each(|(&i, v)| all[i] = *v);
            case.set_params(&all)?;
            case.loss(&case.x)
        },
        &sub,
        eps,
    )?;
    let got: Vec<f32> = picked.iter().map(|&i| first.grads[i]).collect();
    ensure_close("parameter gradients", &got, &want, atol, rtol)
}

fn layernorm_gradients(dev: &Device) -> Result {
    check_gradients(dev, |vb| LayerNorm::new(&vb.pp("ln"), SHAPE[2]), 1)
}

fn mlp_gradients(dev: &Device) -> Result {
    check_gradients(dev, |vb| Mlp::new(&vb.pp("mlp").with_seed(3), SHAPE[2]), 3)
}

fn mlp_recomputing_its_activation_gradients(dev: &Device) -> Result {
    check_gradients(dev, |vb| Mlp::new(&vb.pp("mlp").with_seed(3).with_recompute(Recompute::Gelu), SHAPE[2]), 3)
}

/// What the forward of the module `build` makes (f32, `(2, 64, 32)` in, `count` parameters)
/// holds for its backward, and its output, input gradient and parameter gradients.
fn held_and_run<M: Module>(
    dev: &Device,
    count: usize,
    build: impl Fn(&Builder) -> graphed::Result<M>,
) -> Result<(usize, Run)> {
    const ROWS: usize = 128;
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::new(&alloc, &s, count)?;
    let m = build(&Builder::new(&store, &alloc, &s)?)?;
    let x = Tensor::from_host(&alloc, &s, &lcg(ROWS * 32, 1), &[2, 64, 32])?;
    let dy = Tensor::from_host(&alloc, &s, &lcg(ROWS * 32, 2), &[2, 64, 32])?;
    s.synchronize()?;
    let before = alloc.stats().total.allocated;
    let (y, ctx) = m.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
    let y = y[0].to_vec(&s)?;
    let held = alloc.stats().total.allocated - before;
    let dx = m.backward(ctx, &[&dy], &s)?.remove(0).ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
    Ok((held, Run { y, dx: dx.to_vec(&s)?, grads: store.grads()?.to_vec(&s)? }))
}

/// [`held_and_run`] of an MLP on 32 features, recomputing as `recompute` says.
fn mlp_held_and_run(dev: &Device, recompute: Recompute) -> Result<(usize, Run)> {
    held_and_run(dev, Mlp::parameter_count(32), |vb| {
        Mlp::new(&vb.clone().with_seed(3).with_recompute(recompute).pp("mlp"), 32)
    })
}

/// Recomputing the GELU output keeps exactly its bytes (rows × 4C f32) fewer from the forward to
/// the backward. On the simulator, in f32, the recomputed output is the forward's bit for bit
/// (the same GELU on the same unrounded pre-activation), so every gradient is too; on CUDA the
/// forward's GELU is cuBLASLt's epilogue, so they agree within rounding.
fn mlp_recompute_holds_less_and_matches(dev: &Device) -> Result {
    let (kept, want) = mlp_held_and_run(dev, Recompute::Nothing)?;
    let (recomputed, got) = mlp_held_and_run(dev, Recompute::Gelu)?;
    ensure!(kept - recomputed == 128 * 4 * 32 * 4, "the forward held {kept} B kept against {recomputed} B recomputed");
    ensure!(got.y == want.y, "the forward does not depend on the backward's recompute");
    if dev.kind() == DeviceKind::Cuda {
        let wide = |v: &[f32]| v.iter().map(|x| f64::from(*x)).collect::<Vec<_>>();
        ensure_close("input gradient", &got.dx, &wide(&want.dx), 1e-5, 1e-4)?;
        return ensure_close("parameter gradients", &got.grads, &wide(&want.grads), 1e-5, 1e-4);
    }
    ensure!(got.dx == want.dx && got.grads == want.grads, "the recomputed activation's gradients differ");
    Ok(())
}

fn transformer_layer_recomputing_its_norms_gradients(dev: &Device) -> Result {
    check_gradients(dev, |vb| layer(&vb.clone().with_recompute(Recompute::GeluAndNorms), 0.0), 5)
}

/// [`held_and_run`] of a transformer layer on 32 features in one head, recomputing as
/// `recompute` says.
fn layer_held_and_run(dev: &Device, recompute: Recompute) -> Result<(usize, Run)> {
    held_and_run(dev, TransformerLayer::parameter_count(32), |vb| {
        TransformerLayer::new(&vb.clone().with_seed(9).with_recompute(recompute).pp("layer"), tiny(32, 1))
    })
}

/// Recomputing the LayerNorm outputs keeps exactly their bytes (2 × rows × C f32) fewer from
/// the forward to the backward, and changes no bit: the backward runs the same LayerNorm kernel
/// on the same saved input, on either device.
fn layer_norm_recompute_holds_less_and_matches(dev: &Device) -> Result {
    let (kept, want) = layer_held_and_run(dev, Recompute::Nothing)?;
    let (recomputed, got) = layer_held_and_run(dev, Recompute::Norms)?;
    ensure!(kept - recomputed == 2 * 128 * 32 * 4, "the forward held {kept} B kept against {recomputed} B recomputed");
    ensure!(got.y == want.y, "the forward does not depend on the backward's recompute");
    ensure!(got.dx == want.dx && got.grads == want.grads, "the recomputed LayerNorm outputs' gradients differ");
    Ok(())
}

fn attention_gradients(dev: &Device) -> Result {
    check_gradients(dev, |vb| CausalSelfAttention::new(&vb.pp("attn").with_seed(5), tiny(SHAPE[2], HEADS)), 2)
}

fn transformer_layer_gradients(dev: &Device) -> Result {
    check_gradients(dev, |vb| layer(vb, 0.0), 5)
}

/// With the step fixed the mask is fixed, so dropout (p = 0.5) is differentiable as any module.
fn dropout_gradients(dev: &Device) -> Result {
    check_gradients(dev, |vb| Dropout::new(&vb.clone().with_dropout(0.5, 1234).with_site(3)), 1)
}

fn dropout_follows_the_step_and_the_mode(dev: &Device) -> Result {
    let mut case = Case::new(dev, |vb| layer(vb, 0.5))?;
    let step = case.module.drop1.step().clone();
    let first = case.forward(&case.x)?;
    ensure!(case.forward(&case.x)? == first, "the same step draws the same masks");
    rng::step_write(&step, 2, &case.s)?;
    let second = case.forward(&case.x)?;
    ensure!(second != first, "a new step draws new masks");
    case.module.set_training(false);
    let eval = case.forward(&case.x)?;
    ensure!(eval != first && eval != second, "evaluation does not drop");
    rng::step_write(&step, 3, &case.s)?;
    ensure!(case.forward(&case.x)? == eval, "evaluation is deterministic");
    Ok(())
}

fn bad_shapes_are_refused(dev: &Device) -> Result {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::new(&alloc, &s, 1024)?;
    let vb = Builder::new(&store, &alloc, &s)?.with_seed(1);
    let bad = CausalSelfAttention::new(&vb.pp("attn"), tiny(SHAPE[2], 3));
    ensure!(matches!(bad, Err(Error::Shape { .. })), "3 heads do not divide 8 features");
    let certain = CausalSelfAttention::new(&vb.clone().with_dropout(1.0, 1).pp("attn"), tiny(SHAPE[2], HEADS));
    ensure!(matches!(certain, Err(Error::Unsupported { .. })), "attention dropout of p = 1 is refused");
    ensure!(store.values()?.numel() == 0, "refused before adding parameters");
    // Heads of 48 features: the fused form refuses them, naming the way out; the unfused runs them.
    let fused = CausalSelfAttention::new(&vb.pp("attn"), (96, 2));
    ensure!(
        matches!(&fused, Err(Error::Unsupported { why, .. }) if why.contains("--attention unfused")),
        "fused heads of 48: {:?}",
        fused.err()
    );
    let attn = CausalSelfAttention::new(&vb.pp("attn"), tiny(SHAPE[2], HEADS))?;
    let flat = Tensor::zeros(&alloc, &s, &[6, 8], DType::F32)?;
    ensure!(matches!(attn.forward(&Inputs::one(&flat), &KeepOnDevice, &s), Err(Error::Shape { .. })), "(B, T, C) only");
    let ln = LayerNorm::new(&vb.pp("ln"), 4)?;
    ensure!(matches!(ln.forward(&Inputs::one(&flat), &KeepOnDevice, &s), Err(Error::Shape { .. })), "width 4, not 8");
    ensure!(matches!(Dropout::new(&vb.with_dropout(1.0, 1)), Err(Error::Unsupported { .. })), "p < 1");
    Ok(())
}

/// Each module's `parameter_count` is exactly what it adds to its store: a store of that size
/// holds it with no room left.
fn parameter_counts_are_exact(dev: &Device) -> Result {
    use graphed::nn::{Embedding, LmHead};
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let (d, v, t) = (16, 11, 7);
    let exact = |count: usize, build: &dyn Fn(&Builder) -> graphed::Result<()>| -> Result {
        let store = ParamStore::new(&alloc, &s, count)?;
        build(&Builder::new(&store, &alloc, &s)?)?;
        ensure!(store.values()?.numel() == count, "the store holds {} of {count}", store.values()?.numel());
        Ok(())
    };
    exact(LayerNorm::parameter_count(d), &|vb| LayerNorm::new(vb, d).map(|_| ()))?;
    exact(Mlp::parameter_count(d), &|vb| Mlp::new(vb, d).map(|_| ()))?;
    exact(CausalSelfAttention::parameter_count(d), &|vb| CausalSelfAttention::new(vb, tiny(d, 2)).map(|_| ()))?;
    exact(TransformerLayer::parameter_count(d), &|vb| TransformerLayer::new(vb, tiny(d, 2)).map(|_| ()))?;
    exact(Embedding::parameter_count((v, t, d)), &|vb| Embedding::new(vb, (v, t, d)).map(|_| ()))?;
    exact(LmHead::parameter_count((d, v)), &|vb| LmHead::new(vb, (d, v)).map(|_| ()))?;
    let small = ParamStore::new(&alloc, &s, TransformerLayer::parameter_count(d) - 1)?;
    ensure!(
        matches!(TransformerLayer::new(&Builder::new(&small, &alloc, &s)?, tiny(d, 2)), Err(Error::Shape { .. })),
        "a store one element short is refused"
    );
    Ok(())
}

/// A stack runs its layers in order and their backwards in reverse, the same as calling them one
/// by one; its parameters are its layers'; a layer that gives no input gradient is refused.
fn stack_runs_its_layers_in_order(dev: &Device) -> Result {
    use graphed::nn::{input_grad, Stack};
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let c = SHAPE[2];
    let store = ParamStore::new(&alloc, &s, 2 * (12 * c * c + 13 * c))?;
    let vb = builder(&store, &alloc, &s, 0.0, 0)?.with_seed(5);
    let stack = Stack::new(TransformerLayer::stack(&vb, tiny(c, 2), &Layers::first(2))?);
    let n: usize = SHAPE.iter().product();
    let x = Tensor::from_host(&alloc, &s, &lcg(n, 1), &SHAPE)?;
    let dy = Tensor::from_host(&alloc, &s, &lcg(n, 2), &SHAPE)?;
    let (y, ctx) = stack.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
    let dx = input_grad("stack", stack.backward(ctx, &[&dy], &s)?)?;
    let (y, dx, grads) = (y[0].to_vec::<f32>(&s)?, dx.to_vec::<f32>(&s)?, store.grads()?.to_vec::<f32>(&s)?);
    s.memset(store.grads()?.view::<f32>()?, 0)?;
    let [a, b] = stack.layers() else { anyhow::bail!("two layers") };
    let (h, ca) = a.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
    let (y2, cb) = b.forward(&Inputs::one(&h[0]), &KeepOnDevice, &s)?;
    let dh = input_grad("b", b.backward(cb, &[&dy], &s)?)?;
    let dx2 = input_grad("a", a.backward(ca, &[&dh], &s)?)?;
    ensure!(
        y == y2[0].to_vec::<f32>(&s)? && dx == dx2.to_vec::<f32>(&s)?,
        "the stack differs from its layers one by one"
    );
    ensure!(grads == store.grads()?.to_vec::<f32>(&s)?, "parameter gradients differ");
    ensure!(stack.parameters().len() == a.parameters().len() + b.parameters().len(), "the layers' parameters");
    // Two inputs for a layer that takes one.
    let two = Inputs::one(&x).arg(&x);
    ensure!(matches!(stack.forward(&two, &KeepOnDevice, &s), Err(Error::InputArity { .. })), "two inputs refused");
    Ok(())
}

/// `TransformerLayer::stack` builds layer `l` of a model as `TransformerLayer::new` does from the
/// builder one level down, at `h{l}`, seeded `seed + l·stride`, its dropouts from site `2l`: the
/// same parameter names and values, and the same outputs with dropout on.
fn stack_builds_each_layer_as_new_does(dev: &Device) -> Result {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let (c, part) = (SHAPE[2], [1u32, 3]);
    let count = part.len() * TransformerLayer::parameter_count(c);
    let (stacked, single) = (ParamStore::new(&alloc, &s, count)?, ParamStore::new(&alloc, &s, count)?);
    let vb = builder(&stacked, &alloc, &s, 0.5, 0)?.with_seed(5);
    let layers = TransformerLayer::stack(&vb, tiny(c, 2), &Layers::of(part.map(|l| l as usize)).seed_stride(4))?;
    let vb = builder(&single, &alloc, &s, 0.5, 0)?;
    let want = (part.iter())
        .map(|&l| {
            let seed = 5 + 4 * u64::from(l);
            TransformerLayer::new(&vb.pp(&format!("h{l}")).with_seed(seed).with_site(2 * l), tiny(c, 2))
        })
        .collect::<graphed::Result<Vec<_>>>()?;
    ensure!(stacked.ranges() == single.ranges(), "names and layout: {:?}", stacked.ranges());
    ensure!(stacked.ranges()[0].0 == "h1.ln1.weight", "the first name is {}", stacked.ranges()[0].0);
    ensure!(stacked.values()?.to_vec::<f32>(&s)? == single.values()?.to_vec::<f32>(&s)?, "initial values");
    let x = Tensor::from_host(&alloc, &s, &lcg(SHAPE.iter().product(), 1), &SHAPE)?;
    for (l, (got, want)) in part.iter().zip(layers.iter().zip(&want)) {
        let (got, _) = got.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
        let (want, _) = want.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
        ensure!(got[0].to_vec::<f32>(&s)? == want[0].to_vec::<f32>(&s)?, "layer {l} draws other masks");
    }
    Ok(())
}

/// A transformer layer whose four linears leave their weight gradients to `backward_dw`: after
/// it, the same input gradient and parameter gradients as without the split, bit for bit; and
/// the layer says it splits.
fn transformer_layer_split_weight_gradients(dev: &Device) -> Result {
    let build: Build<TransformerLayer> = |vb| layer(vb, 0.0);
    let whole = Case::new(dev, build)?.run()?;
    let mut case = Case::new(dev, build)?;
    ensure!(!case.module.splits_dw(), "no split by default");
    let m = &mut case.module;
    for lin in [&mut m.mlp.fc1, &mut m.mlp.fc2, &mut m.attn.qkv, &mut m.attn.proj] {
        lin.set_split_dw(true);
    }
    ensure!(case.module.splits_dw(), "a layer whose linears split says so");
    let split = case.run()?;
    ensure!(split.grads != whole.grads, "the weight gradients wait for backward_dw");
    case.module.backward_dw(&case.s)?;
    let grads = case.store.grads()?.to_vec::<f32>(&case.s)?;
    ensure!(split.dx == whole.dx && grads == whole.grads, "split and whole differ");
    Ok(())
}

/// The fused-vs-unfused cases: heads of 32 features (the narrowest the fused form runs), a
/// sequence that is not a multiple of any tile.
const WIDE: [usize; 3] = [2, 5, 64];
const WIDE_HEADS: usize = 2;

/// One forward and backward of a module of `kind` attention (a `CausalSelfAttention`, or a
/// `TransformerLayer` when `layer`), in `dtype`, dropping with probability `p` (on the
/// probabilities, and after each residual branch in a layer), on a fixed input and upstream
/// gradient: its output, input gradient and parameter gradients, widened to f32.
fn attention_run(dev: &Device, kind: AttentionKind, layer: bool, dtype: DType, p: f32) -> Result<Run> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let c = WIDE[2];
    let store = ParamStore::with_dtype(&alloc, &s, TransformerLayer::parameter_count(c), dtype)?;
    let shape = AttentionSpec::new(c, WIDE_HEADS).kind(kind);
    // Sites as a model's layer 1 uses them: residual dropouts at 2 and 3, attention at 2^31 + 2.
    let vb = builder(&store, &alloc, &s, p, 2)?.with_seed(7);
    let n: usize = WIDE.iter().product();
    let x = Tensor::from_f32(&alloc, &s, &lcg(n, 11), &WIDE, dtype)?;
    let dy = Tensor::from_f32(&alloc, &s, &lcg(n, 12), &WIDE, dtype)?;
    let (y, dx) = if layer {
        let m = TransformerLayer::new(&vb.pp("h1"), shape)?;
        let (y, ctx) = m.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
        (y, m.backward(ctx, &[&dy], &s)?)
    } else {
        let site = graphed::nn::attention_dropout_site(2).expect("a low site");
        let m = CausalSelfAttention::new(&vb.pp("attn").with_site(site), shape)?;
        let (y, ctx) = m.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
        (y, m.backward(ctx, &[&dy], &s)?)
    };
    let dx = dx.into_iter().next().flatten().ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
    Ok(Run { y: y[0].to_f32_vec(&s)?, dx: dx.to_f32_vec(&s)?, grads: store.grads()?.to_f32_vec(&s)? })
}

/// `got` within `tol` of `want` relative to `want`'s largest magnitude (as
/// `bench/torch_reference.py parity` compares): elementwise bounds would fail on the values
/// near zero that sums of opposite terms give.
fn close_to_scale(what: &str, got: &[f32], want: &[f32], tol: f64) -> Result {
    ensure!(got.len() == want.len(), "{what}: {} values, expected {}", got.len(), want.len());
    let scale = want.iter().map(|w| f64::from(w.abs())).fold(0.0, f64::max);
    let (i, diff) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - f64::from(*w)).abs())
        .enumerate()
        .fold((0, 0.0), |best, (i, d)| if d > best.1 { (i, d) } else { best });
    ensure!(diff <= tol * scale, "{what}[{i}]: {} vs {}: {diff:e} off, over {tol} × {scale}", got[i], want[i]);
    Ok(())
}

/// The fused attention against the unfused one, as a module alone and inside a transformer
/// layer, in f32 and bf16, with dropout off and on (p = 0.3 on the probabilities and, in the
/// layer, after each branch): the output, the input gradient and every parameter gradient agree
/// within rounding. So both forms drop the same elements: a probability dropped by one form only
/// would move its row's output by O(1), far past these bounds.
///
/// The bounds, relative to each tensor's largest magnitude: f32 2e-5, about 170 ulps (2^-24):
/// both forms compute in f32, in different orders (the fused one sums each row's exponentials
/// in one pass with a running maximum and never rounds the probabilities to storage), and the
/// parameter gradients sum B·T = 10 rows of products of such values; the simulator measured at
/// most 2.1e-7 (the input gradient), so the bound leaves a factor 100 for CUDA's different
/// tiling and FMA contraction. bf16 2e-2, about 5 ulps of bf16 (2^-8 = 3.9e-3): the unfused form
/// rounds the scores, the probabilities (and dropped probabilities) and their gradients to bf16
/// at every GEMM and softmax boundary, the fused one keeps them in f32 and rounds only its
/// outputs; each rounding is half an ulp relative, and a gradient passes through four or five
/// of them. The simulator measured at most 6.1e-3 (the input gradient with dropout).
fn fused_attention_matches_unfused(dev: &Device) -> Result {
    for (dtype, tol) in [(DType::F32, 2e-5), (DType::BF16, 2e-2)] {
        for layer in [false, true] {
            for p in [0.0, 0.3] {
                let fused = attention_run(dev, AttentionKind::Fused, layer, dtype, p)?;
                let unfused = attention_run(dev, AttentionKind::Unfused, layer, dtype, p)?;
                let what = |t: &str| format!("{t} ({dtype}, layer {layer}, p {p})");
                close_to_scale(&what("output"), &fused.y, &unfused.y, tol)?;
                close_to_scale(&what("input gradient"), &fused.dx, &unfused.dx, tol)?;
                close_to_scale(&what("parameter gradients"), &fused.grads, &unfused.grads, tol)?;
                if p > 0.0 {
                    let kept = attention_run(dev, AttentionKind::Fused, layer, dtype, 0.0)?;
                    ensure!(kept.y != fused.y, "{}: dropout changes nothing", what("fused"));
                }
            }
        }
    }
    Ok(())
}

/// The fused backward recomputes the dropout mask from the step the forward read: a step
/// advanced in between (another microbatch's forward) changes nothing, and evaluation mode turns
/// the attention dropout off, for both forms.
fn attention_dropout_follows_the_forwards_step_and_the_mode(dev: &Device) -> Result {
    for kind in AttentionKind::ALL {
        let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
        let c = WIDE[2];
        let store = ParamStore::new(&alloc, &s, CausalSelfAttention::parameter_count(c))?;
        let vb = builder(&store, &alloc, &s, 0.5, graphed::nn::ATTENTION_DROPOUT_SITES)?.with_seed(3);
        let mut m = CausalSelfAttention::new(&vb.pp("attn"), AttentionSpec::new(c, WIDE_HEADS).kind(kind))?;
        ensure!(m.draws_from().is_some(), "{kind}: a dropping attention draws from the step counter");
        let n: usize = WIDE.iter().product();
        let x = Tensor::from_host(&alloc, &s, &lcg(n, 1), &WIDE)?;
        let dy = Tensor::from_host(&alloc, &s, &lcg(n, 2), &WIDE)?;
        let step_between = |m: &CausalSelfAttention, advance: bool| -> Result<(Vec<f32>, Vec<f32>)> {
            rng::step_write(vb.step(), 1, &s)?;
            s.memset(store.grads()?.view::<f32>()?, 0)?;
            let (y, ctx) = m.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
            if advance {
                rng::step_write(vb.step(), 2, &s)?;
            }
            m.backward(ctx, &[&dy], &s)?;
            Ok((y[0].to_vec(&s)?, store.grads()?.to_vec(&s)?))
        };
        let (y, grads) = step_between(&m, false)?;
        ensure!(step_between(&m, true)? == (y.clone(), grads), "{kind}: the backward read the advanced step");
        m.set_training(false);
        ensure!(m.draws_from().is_none(), "{kind}: evaluation draws nothing");
        let (eval, _) = step_between(&m, false)?;
        let other = ParamStore::new(&alloc, &s, CausalSelfAttention::parameter_count(c))?;
        let plain = CausalSelfAttention::new(
            &Builder::new(&other, &alloc, &s)?.with_seed(3).pp("attn"),
            AttentionSpec::new(c, WIDE_HEADS).kind(kind),
        )?;
        let (want, _) = plain.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
        ensure!(eval == want[0].to_vec::<f32>(&s)? && eval != y, "{kind}: evaluation is the attention without dropout");
    }
    Ok(())
}

/// Bytes the allocator's peak rises by over one forward and backward of a `(1, T, 32)`
/// attention of `kind` (one head of 32 features) in f32, with its parameters, input and upstream
/// gradient already allocated.
fn attention_peak_rise(dev: &Device, kind: AttentionKind, t: usize) -> Result<usize> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::new(&alloc, &s, CausalSelfAttention::parameter_count(32))?;
    let vb = Builder::new(&store, &alloc, &s)?.with_seed(3).pp("attn");
    let m = CausalSelfAttention::new(&vb, AttentionSpec::new(32, 1).kind(kind))?;
    let x = Tensor::from_host(&alloc, &s, &lcg(t * 32, 1), &[1, t, 32])?;
    let dy = Tensor::from_host(&alloc, &s, &lcg(t * 32, 2), &[1, t, 32])?;
    s.synchronize()?;
    let before = alloc.stats().total.peak_allocated;
    let (_, ctx) = m.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
    m.backward(ctx, &[&dy], &s)?;
    s.synchronize()?;
    Ok(alloc.stats().total.peak_allocated - before)
}

/// The fused attention allocates nothing of size T × T: at T = 1024 with heads of 32 features,
/// one f32 `T × T` tensor (4 MiB) is more than everything the forward and backward hold at once
/// otherwise (about 16 tensors of T × 32, 2 MiB), so the allocator's peak rises by less than
/// one. The unfused attention, which holds several, rises by more: the measure can fail.
fn fused_attention_allocates_nothing_of_size_t_squared(dev: &Device) -> Result {
    let t = 1024;
    let square = t * t * 4;
    let fused = attention_peak_rise(dev, AttentionKind::Fused, t)?;
    ensure!(fused < square, "the fused attention's peak rose by {fused} B, past a T × T f32 tensor's {square} B");
    let unfused = attention_peak_rise(dev, AttentionKind::Unfused, t)?;
    ensure!(unfused > 2 * square, "the unfused attention's peak rose by only {unfused} B");
    Ok(())
}

/// A layer's scratch limit reaches cuDNN's backward: bf16 attention of two sequences of 256
/// tokens in two heads of 64 runs its backward as one cuDNN execution by default, and as one per
/// (sequence, head) pair with room for one pair's `T × T` scratch; the output and gradients
/// agree within bf16 rounding. Where cuDNN does not run (the simulator), neither runs any.
fn attention_scratch_limit_reaches_cudnn(dev: &Device) -> Result {
    let (b, t, c, heads) = (2, 256, 128, 2);
    let run = |limit: Option<usize>| -> Result<(usize, Run)> {
        let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
        let store = ParamStore::with_dtype(&alloc, &s, CausalSelfAttention::parameter_count(c), DType::BF16)?;
        let vb = Builder::new(&store, &alloc, &s)?.with_seed(4).pp("attn");
        let spec = AttentionSpec::new(c, heads);
        let m = CausalSelfAttention::new(&vb, limit.map_or(spec, |bytes| spec.scratch_limit(bytes)))?;
        let x = Tensor::from_f32(&alloc, &s, &lcg(b * t * c, 1), &[b, t, c], DType::BF16)?;
        let dy = Tensor::from_f32(&alloc, &s, &lcg(b * t * c, 2), &[b, t, c], DType::BF16)?;
        let (y, ctx) = m.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
        let profile = s.profile()?;
        let dx = m.backward(ctx, &[&dy], &s)?.into_iter().next().flatten();
        let ran = profile.finish()?.iter().filter(|k| k.name == "cudnn_sdpa_backward_bf16").count();
        let dx = dx.ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
        Ok((ran, Run { y: y[0].to_f32_vec(&s)?, dx: dx.to_f32_vec(&s)?, grads: store.grads()?.to_f32_vec(&s)? }))
    };
    let (whole, one) = (run(None)?, run(Some(t * t * 2))?);
    let cudnn = usize::from(whole.0 > 0);
    ensure!(
        (whole.0, one.0) == (cudnn, cudnn * b * heads),
        "cuDNN backward executions: {} by default, {} per pair",
        whole.0,
        one.0
    );
    close_to_scale("output", &one.1.y, &whole.1.y, 0.0)?;
    close_to_scale("input gradient", &one.1.dx, &whole.1.dx, 1.0 / 64.0)?;
    close_to_scale("parameter gradients", &one.1.grads, &whole.1.grads, 1.0 / 64.0)
}

per_device!(
    attention_scratch_limit_reaches_cudnn,
    transformer_layer_split_weight_gradients,
    parameter_counts_are_exact,
    stack_runs_its_layers_in_order,
    stack_builds_each_layer_as_new_does,
    layernorm_gradients,
    mlp_gradients,
    mlp_recomputing_its_activation_gradients,
    mlp_recompute_holds_less_and_matches,
    transformer_layer_recomputing_its_norms_gradients,
    layer_norm_recompute_holds_less_and_matches,
    attention_gradients,
    transformer_layer_gradients,
    dropout_gradients,
    dropout_follows_the_step_and_the_mode,
    bad_shapes_are_refused,
    fused_attention_matches_unfused,
    attention_dropout_follows_the_forwards_step_and_the_mode,
    fused_attention_allocates_nothing_of_size_t_squared,
);
