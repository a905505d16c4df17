//! FP8 training of the Linear layers (`nn::Fp8Training`): a layer in FP8 against the same layer in
//! bf16, the recipe's scales moving with the data, a bf16 capture after an FP8 one, and the
//! refusals. Graphed = eager bitwise in FP8 is in tests/graphed (`*_in_fp8`).

#[path = "common/mod.rs"]
mod common;

use anyhow::ensure;
use common::lcg;
use graphed::device::{DType, Device, Stream};
use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    input_grad, BiasGrad, Builder, DelayedRecipe, Fp8Recipe, Fp8Scaling, Fp8Training, Inputs, KeepOnDevice, Layers,
    Linear, LinearForward, Mlp, Module, ParamStore, PreActGrad, Recompute, Stack, TransformerLayer,
};
use graphed::ops::fp8::Fp8Format;
use graphed::tensor::Tensor;
use graphed::Error;

/// Tokens and width: multiples of 16, as FP8 GEMMs need; heads of 32.
const TOKENS: usize = 32;
const DIM: usize = 64;

/// One transformer layer (seed 5) in bf16, its Linear layers in FP8 with `fp8`.
struct Layer {
    s: Stream,
    alloc: CachingAllocator,
    store: ParamStore,
    stack: Stack<TransformerLayer>,
    fp8: Option<Fp8Training>,
}

impl Layer {
    fn new(dev: &Device, fp8: bool) -> anyhow::Result<Layer> {
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let store = ParamStore::with_dtype(&alloc, &s, TransformerLayer::parameter_count(DIM), DType::BF16)?;
        let fp8 = fp8.then(|| {
            Fp8Training::new(
                &alloc,
                Fp8Recipe {
                    scaling: Fp8Scaling::Delayed(DelayedRecipe { history_len: 2, ..DelayedRecipe::default() }),
                    ..Fp8Recipe::default()
                },
            )
        });
        let vb = Builder::new(&store, &alloc, &s)?.with_seed(5);
        let vb = match &fp8 {
            Some(f) => vb.with_fp8(f),
            None => vb,
        };
        let layers = TransformerLayer::stack(&vb, (DIM, DIM / 32), &Layers::first(1))?;
        if let Some(f) = &fp8 {
            f.start(&s)?;
        }
        Ok(Layer { s, alloc, store, stack: Stack::new(layers), fp8 })
    }

    fn data(&self, seed: u64) -> anyhow::Result<(Tensor, Tensor)> {
        let s = &self.s;
        let x = Tensor::from_f32(&self.alloc, s, &lcg(TOKENS * DIM, seed), &[1, TOKENS, DIM], DType::BF16)?;
        let dy = Tensor::from_f32(&self.alloc, s, &lcg(TOKENS * DIM, seed + 1), &[1, TOKENS, DIM], DType::BF16)?;
        Ok((x, dy))
    }

    /// Forward and backward of `x`; (y, dx, parameter gradients).
    fn run(&self, x: &Tensor, dy: &Tensor) -> anyhow::Result<[Vec<f32>; 3]> {
        let s = &self.s;
        let (y, ctx) = self.stack.forward(&Inputs::one(x), &KeepOnDevice, s)?;
        let dx = input_grad("fp8 test", self.stack.backward(ctx, &[dy], s)?)?;
        Ok([y[0].to_f32_vec(s)?, dx.to_f32_vec(s)?, self.store.grads()?.to_f32_vec(s)?])
    }
}

/// ‖got − want‖ / ‖want‖.
fn relative(got: &[f32], want: &[f32]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(g, w)| f64::from(g - w).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| f64::from(*w).powi(2)).sum();
    (diff / norm).sqrt()
}

/// The FP8 layer computes what the bf16 layer does within FP8's rounding: E4M3 keeps 3 bits of
/// mantissa (relative error up to 2⁻⁴ per value) and E5M2 2 bits (2⁻³), which sums over k
/// average down; the bound is loose enough for that and far below a wrong scale or layout.
fn fp8_layer_tracks_the_bf16_layer(dev: &Device) -> anyhow::Result<()> {
    let (bf16, fp8) = (Layer::new(dev, false)?, Layer::new(dev, true)?);
    let (x, dy) = bf16.data(1)?;
    let (x8, dy8) = fp8.data(1)?;
    let [want_y, want_dx, want_g] = bf16.run(&x, &dy)?;
    let [y, dx, g] = fp8.run(&x8, &dy8)?;
    for (what, got, want, bound) in
        [("y", &y, &want_y, 0.05), ("dx", &dx, &want_dx, 0.15), ("grads", &g, &want_g, 0.15)]
    {
        let r = relative(got, want);
        ensure!(r < bound, "{what}: relative error {r:.4} against bf16 (bound {bound})");
        ensure!(r > 0.0, "{what}: equal to bf16, so FP8 did not run");
    }
    Ok(())
}

/// After a step the scales are the recipe's (fp8 max / amax of what the passes saw), not the
/// starting 1, and finite.
fn the_step_sets_scales_from_the_amaxes(dev: &Device) -> anyhow::Result<()> {
    let layer = Layer::new(dev, true)?;
    let (s, fp8) = (&layer.s, layer.fp8.as_ref().expect("fp8"));
    let (x, dy) = layer.data(3)?;
    layer.run(&x, &dy)?;
    fp8.step(s)?;
    let (forward, backward) = fp8.state()?;
    let scales = forward.scales().to_vec::<f32>(s)?;
    ensure!(scales.iter().all(|v| v.is_finite() && *v > 0.0), "{scales:?}");
    ensure!(scales.iter().any(|v| *v != 1.0), "no scale moved: {scales:?}");
    let grads = backward.scales().to_vec::<f32>(s)?;
    ensure!(grads.iter().all(|v| v.is_finite() && *v > 0.0 && *v != 1.0), "gradient scales: {grads:?}");
    Ok(())
}

/// A bf16 model graphed after an FP8 model was graphed and stepped computes exactly what a bf16
/// model graphed alone does: nothing of FP8 is process-wide.
fn a_capture_after_an_fp8_capture_carries_nothing_over(dev: &Device) -> anyhow::Result<()> {
    let step = |layer: &Layer| -> anyhow::Result<Vec<f32>> {
        let (s, (x, dy)) = (&layer.s, layer.data(7)?);
        let g = make_graphed_stack(&layer.alloc, &layer.stack, &x, GraphOptions::default())?;
        let y = g.forward(s, &x, Replay::caller())?.get()?.to_f32_vec(s)?;
        g.backward(s, &dy)?;
        g.join(s)?;
        Ok([y, layer.store.grads()?.to_f32_vec(s)?].concat())
    };
    let alone = step(&Layer::new(dev, false)?)?;
    let fp8 = Layer::new(dev, true)?;
    step(&fp8)?;
    fp8.fp8.as_ref().expect("fp8").step(&fp8.s)?;
    let after = step(&Layer::new(dev, false)?)?;
    ensure!(alone == after, "the bf16 model after an FP8 capture differs");
    Ok(())
}

/// With the weight gradients split out (zero-bubble schedules), an FP8 layer keeps the output
/// gradient's transposed E5M2 copy for `backward_dw` and ends with the gradients of the layer
/// that computes them at once, bit for bit, the amaxes included.
fn fp8_split_weight_gradients_equal_the_joined_ones(dev: &Device) -> anyhow::Result<()> {
    let run = |split: bool| -> anyhow::Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let mut layer = Layer::new(dev, true)?;
        for linear in layer
            .stack
            .layers_mut()
            .iter_mut()
            .flat_map(|l| [&mut l.attn.qkv, &mut l.attn.proj, &mut l.mlp.fc1, &mut l.mlp.fc2])
        {
            linear.set_split_dw(split);
        }
        let (x, dy) = layer.data(3)?;
        let [_, dx, before] = layer.run(&x, &dy)?;
        layer.stack.backward_dw(&layer.s)?;
        let grads = layer.store.grads()?.to_f32_vec(&layer.s)?;
        if split {
            ensure!(before.iter().any(|g| *g != 0.0) && before != grads, "the split layers deferred nothing");
        }
        let (_, backward) = layer.fp8.as_ref().expect("fp8").state()?;
        Ok((dx, grads, backward.amaxes().to_f32_vec(&layer.s)?))
    };
    ensure!(run(true)? == run(false)?, "split and joined weight gradients differ");
    Ok(())
}

/// An FP8 Linear's forward keeps its input as the E4M3 transpose its cast wrote (half the bytes
/// of the bf16 input), and its backward from that gives the gradients it gives from the input
/// itself, bit for bit; a layer not in FP8 refuses such an input.
fn fp8_forward_keeps_the_input_quantized_and_transposed(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let fp8 = Fp8Training::new(&alloc, Fp8Recipe::default());
    let store = ParamStore::with_dtype(&alloc, &s, 2 * Linear::parameter_count((32, 16)), DType::BF16)?;
    let fc = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(2).with_fp8(&fp8).pp("fc"), (32, 16))?;
    let plain = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(2).pp("plain"), (32, 16))?;
    fp8.start(&s)?;
    let x = Tensor::from_f32(&alloc, &s, &lcg(48 * 32, 4), &[48, 32], DType::BF16)?;
    let dy = Tensor::from_f32(&alloc, &s, &lcg(48 * 16, 5), &[48, 16], DType::BF16)?;
    let kept = fc.forward_keeping_input(&x, None, &s)?;
    ensure!(kept.input.dtype() == DType::F8E4M3 && kept.input.shape() == [32, 48], "kept {:?}", kept.input.shape());
    let grads = |input: &Tensor| -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
        store.grads()?.zero(&s)?;
        let dx = fc.backward_with(&dy, input, None, BiasGrad::Compute, &s)?;
        Ok((dx.to_f32_vec(&s)?, store.grads()?.to_f32_vec(&s)?))
    };
    ensure!(grads(&kept.input)? == grads(&x)?, "the kept input's gradients differ from the input's");
    let r = plain.backward_with(&dy, &kept.input, None, BiasGrad::Compute, &s);
    ensure!(matches!(r, Err(Error::DTypeMismatch { .. })), "an FP8 input to a bf16 layer: {:?}", r.err());
    Ok(())
}

/// Current scaling: each tensor's scale is E4M3's max over its own amax, set just before its
/// cast (the weight's when the state starts, the input's in the forward), and the layer computes
/// what the bf16 layer does within FP8's rounding; the state keeps no history.
fn current_scaling_scales_each_tensor_by_its_own_amax(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let fp8 = Fp8Training::new(&alloc, Fp8Recipe { scaling: Fp8Scaling::Current, ..Fp8Recipe::default() });
    let store = ParamStore::with_dtype(&alloc, &s, 2 * Linear::parameter_count((32, 16)), DType::BF16)?;
    let fc = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(2).with_fp8(&fp8).pp("fc"), (32, 16))?;
    let plain = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(2).pp("plain"), (32, 16))?;
    fp8.start(&s)?;
    let x = Tensor::from_f32(&alloc, &s, &lcg(48 * 32, 4), &[48, 32], DType::BF16)?;
    let amax = |t: &Tensor| -> anyhow::Result<f32> { Ok(t.to_f32_vec(&s)?.iter().fold(0.0f32, |m, v| m.max(v.abs()))) };
    let y = fc.forward_with(&x, None, &s)?.to_f32_vec(&s)?;
    let want = plain.forward_with(&x, None, &s)?.to_f32_vec(&s)?;
    let scales = fp8.scales()?.0.to_vec::<f32>(&s)?;
    ensure!(scales[0] == 448.0 / amax(&x)?, "the input's scale {} from its amax {}", scales[0], amax(&x)?);
    ensure!(scales[1] == 448.0 / amax(&fc.weight.value)?, "the weight's scale {}", scales[1]);
    let r = relative(&y, &want);
    ensure!(r > 0.0 && r < 0.05, "y: relative error {r:.4} against bf16");
    ensure!(matches!(fp8.state(), Err(Error::Unsupported { .. })), "current scaling has no history to show");
    ensure!(fp8.named_state()?.is_empty(), "nothing for a checkpoint to keep");
    Ok(())
}

/// Under current scaling a microbatch's backward reads nothing another microbatch's cast
/// rescaled: two forwards then two backwards (a schedule's order) accumulate the gradients that
/// each forward followed by its backward does, bit for bit. (Under delayed scaling the scales
/// hold for the whole step, so the forward may keep its FP8 input; here it may not.)
fn current_scaling_keeps_microbatches_apart(dev: &Device) -> anyhow::Result<()> {
    let run = |interleaved: bool| -> anyhow::Result<Vec<f32>> {
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let fp8 = Fp8Training::new(&alloc, Fp8Recipe { scaling: Fp8Scaling::Current, ..Fp8Recipe::default() });
        let store = ParamStore::with_dtype(&alloc, &s, Linear::parameter_count((32, 16)), DType::BF16)?;
        let fc = Linear::new(&Builder::new(&store, &alloc, &s)?.with_seed(2).with_fp8(&fp8).pp("fc"), (32, 16))?;
        fp8.start(&s)?;
        // Microbatch k's values are k + 1 times as large: their scales differ.
        let data = |k: usize, n: usize, seed: u64| -> graphed::Result<Tensor> {
            let v: Vec<f32> = lcg(16 * n, seed).iter().map(|v| v * (k + 1) as f32).collect();
            Tensor::from_f32(&alloc, &s, &v, &[16, n], DType::BF16)
        };
        let (x, dy) = ([data(0, 32, 1)?, data(1, 32, 2)?], [data(0, 16, 3)?, data(1, 16, 4)?]);
        if interleaved {
            let (_, c0) = fc.forward(&Inputs::one(&x[0]), &KeepOnDevice, &s)?;
            let (_, c1) = fc.forward(&Inputs::one(&x[1]), &KeepOnDevice, &s)?;
            fc.backward(c1, &[&dy[1]], &s)?;
            fc.backward(c0, &[&dy[0]], &s)?;
        } else {
            let (_, c1) = fc.forward(&Inputs::one(&x[1]), &KeepOnDevice, &s)?;
            fc.backward(c1, &[&dy[1]], &s)?;
            let (_, c0) = fc.forward(&Inputs::one(&x[0]), &KeepOnDevice, &s)?;
            fc.backward(c0, &[&dy[0]], &s)?;
        }
        Ok(store.grads()?.to_f32_vec(&s)?)
    };
    ensure!(run(true)? == run(false)?, "a backward read another microbatch's scale");
    Ok(())
}

/// FP8's MLP backward under delayed scaling runs GELU's backward fused with FC1's cast (to E5M2,
/// or E4M3 with those gradients, and then no E5M2 kernel runs) and its bias sums (`Linear::backward_through_gelu`): it gives what the unfused composition gives
/// (FC2's backward to the bf16 pre-activation gradient, then FC1's backward from that) bit for
/// bit, input gradient, weight gradients and amaxes, and FC1's bias gradient, summed in another
/// order, within bf16's rounding of the exact column sums; it launches no GELU backward and moves
/// fewer bytes. 160 tokens: two whole tiles of 64 rows and a partial one.
fn fp8_mlp_fuses_gelu_backward_into_the_cast(dev: &Device) -> anyhow::Result<()> {
    const N: usize = 160;
    struct Run {
        dx: Vec<f32>,
        grads: Vec<Vec<f32>>,
        fc1_bias: Vec<f32>,
        amaxes: Vec<f32>,
        dpre: Option<Vec<f32>>,
        kernels: Vec<&'static str>,
        bytes: u64,
    }
    let run = |fused: bool, gradients: Fp8Format| -> anyhow::Result<Run> {
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let fp8 = Fp8Training::new(&alloc, Fp8Recipe { gradients, ..Fp8Recipe::default() });
        let store = ParamStore::with_dtype(&alloc, &s, Mlp::parameter_count(DIM), DType::BF16)?;
        let mlp = Mlp::new(&Builder::new(&store, &alloc, &s)?.with_seed(3).with_fp8(&fp8).pp("mlp"), DIM)?;
        fp8.start(&s)?;
        let x = Tensor::from_f32(&alloc, &s, &lcg(N * DIM, 8), &[N, DIM], DType::BF16)?;
        let dy = Tensor::from_f32(&alloc, &s, &lcg(N * DIM, 9), &[N, DIM], DType::BF16)?;
        let (act, pre, kept_x) = {
            let (LinearForward { y: act, input: kept_x }, pre) = mlp.fc1.forward_gelu(&x, &s)?;
            (act, pre, kept_x)
        };
        let kept_act = mlp.fc2.forward_keeping_input(&act, None, &s)?.input;
        let profile = s.profile()?;
        let (dx, dpre) = if fused {
            let dpre = mlp.fc2.backward_through_gelu(&dy, kept_act.clone(), &pre, BiasGrad::Compute, &mlp.fc1, &s)?;
            ensure!(matches!(dpre, PreActGrad::Quantized(_)), "delayed scaling: the gradient leaves quantized");
            (mlp.fc1.backward_from(dpre, &kept_x, &s)?, None)
        } else {
            let dpre = mlp.fc2.backward_with(&dy, &kept_act, Some(&pre), BiasGrad::Compute, &s)?;
            (mlp.fc1.backward_with(&dpre, &kept_x, None, BiasGrad::Compute, &s)?, Some(dpre))
        };
        let launches = profile.finish()?;
        let (forward, backward) = fp8.state()?;
        let params = [&mlp.fc1.weight, &mlp.fc2.weight, &mlp.fc2.bias];
        Ok(Run {
            dx: dx.to_f32_vec(&s)?,
            grads: params.iter().map(|p| p.grad.to_f32_vec(&s)).collect::<graphed::Result<_>>()?,
            fc1_bias: mlp.fc1.bias.grad.to_f32_vec(&s)?,
            amaxes: [forward.amaxes().to_f32_vec(&s)?, backward.amaxes().to_f32_vec(&s)?].concat(),
            dpre: dpre.map(|d| d.to_f32_vec(&s)).transpose()?,
            kernels: launches.iter().map(|k| k.name).collect(),
            bytes: launches.iter().map(|k| k.bytes).sum(),
        })
    };
    for gradients in [Fp8Format::E5M2, Fp8Format::E4M3] {
        let (fused, plain) = (run(true, gradients)?, run(false, gradients)?);
        ensure!(fused.dx == plain.dx, "dx differs from the unfused composition's");
        ensure!(fused.grads == plain.grads, "a weight gradient or FC2's bias gradient differs");
        ensure!(fused.amaxes == plain.amaxes, "the amaxes differ");
        let dpre = plain.dpre.expect("the unfused run keeps its gradient");
        let cols = 4 * DIM;
        for (c, got) in fused.fc1_bias.iter().enumerate() {
            let exact: f64 = (0..N).map(|r| f64::from(dpre[r * cols + c])).sum();
            let magnitude: f64 = (0..N).map(|r| f64::from(dpre[r * cols + c].abs())).sum();
            let bound = exact.abs() / 256.0 + magnitude * 1e-6;
            ensure!((f64::from(*got) - exact).abs() <= bound, "FC1's bias gradient {c}: {got}, exactly {exact}");
        }
        let dgelu = format!("fp8_dgelu_cast_transpose_bf16_{}", gradients.name());
        ensure!(fused.kernels.contains(&dgelu.as_str()), "not fused: {:?}", fused.kernels);
        let e5m2 = fused.kernels.iter().any(|k| k.contains("e5m2"));
        ensure!(e5m2 == (gradients == Fp8Format::E5M2), "{gradients:?} gradients ran {:?}", fused.kernels);
        ensure!(!fused.kernels.contains(&"gelu_backward_bf16"), "GELU's backward ran alone: {:?}", fused.kernels);
        ensure!(fused.bytes < plain.bytes, "fused moved {} bytes, unfused {}", fused.bytes, plain.bytes);
    }
    Ok(())
}

/// A quantized pre-activation gradient carries the layer whose gradient scale made it: given to
/// another layer of the same shape (another MLP's FC1), it is refused with a typed error and
/// nothing changes; its own layer takes it.
fn a_quantized_gradient_goes_only_to_its_layer(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let fp8 = Fp8Training::new(&alloc, Fp8Recipe::default());
    let store = ParamStore::with_dtype(&alloc, &s, 2 * Mlp::parameter_count(DIM), DType::BF16)?;
    let vb = Builder::new(&store, &alloc, &s)?.with_seed(3).with_fp8(&fp8);
    let (mlp, other) = (Mlp::new(&vb.pp("mlp"), DIM)?, Mlp::new(&vb.pp("other"), DIM)?);
    fp8.start(&s)?;
    let x = Tensor::from_f32(&alloc, &s, &lcg(TOKENS * DIM, 8), &[TOKENS, DIM], DType::BF16)?;
    let dy = Tensor::from_f32(&alloc, &s, &lcg(TOKENS * DIM, 9), &[TOKENS, DIM], DType::BF16)?;
    let (LinearForward { y: act, input: kept_x }, pre) = mlp.fc1.forward_gelu(&x, &s)?;
    let kept_act = mlp.fc2.forward_keeping_input(&act, None, &s)?.input;
    let pass = |layer: &Linear| -> anyhow::Result<graphed::Result<Tensor>> {
        let grad = mlp.fc2.backward_through_gelu(&dy, kept_act.clone(), &pre, BiasGrad::Compute, &mlp.fc1, &s)?;
        Ok(layer.backward_from(grad, &kept_x, &s))
    };
    let before = other.fc1.weight.grad.to_f32_vec(&s)?;
    let r = pass(&other.fc1)?;
    ensure!(matches!(r, Err(Error::Unsupported { .. })), "another layer's quantized gradient: {:?}", r.err());
    ensure!(other.fc1.weight.grad.to_f32_vec(&s)? == before, "the refused backward changed a gradient");
    ensure!(pass(&mlp.fc1)?.is_ok(), "its own layer takes it");
    Ok(())
}

/// FP8 needs bf16 weights, a started state and aligned shapes, and keeps the MLP's activation;
/// each is refused with a typed error, before the layer computes or adds anything.
fn fp8_misuse_is_refused(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let fp8 = Fp8Training::new(&alloc, Fp8Recipe::default());
    let f32_store = ParamStore::new(&alloc, &s, Linear::parameter_count((16, 16)))?;
    let r = Linear::new(&Builder::new(&f32_store, &alloc, &s)?.with_fp8(&fp8).pp("fc"), (16, 16));
    ensure!(matches!(r, Err(Error::DTypeMismatch { .. })), "an f32 weight: {:?}", r.err());
    ensure!(matches!(fp8.start(&s), Err(Error::Unsupported { .. })), "started with no layer");
    let store = ParamStore::with_dtype(&alloc, &s, Linear::parameter_count((24, 16)) + 2 * 256, DType::BF16)?;
    let vb = Builder::new(&store, &alloc, &s)?.with_fp8(&fp8);
    let fc = Linear::new(&vb.pp("fc"), (24, 16))?;
    let before = store.ranges().len();
    let r = Mlp::new(&vb.clone().with_recompute(Recompute::Gelu).pp("mlp"), 16);
    ensure!(matches!(r, Err(Error::Unsupported { .. })), "a recomputed GELU output in FP8: {:?}", r.err());
    let r = TransformerLayer::new(&vb.clone().with_recompute(Recompute::Norms).pp("layer"), (32, 1));
    let why = r.err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(why.contains("recomputing the LayerNorm outputs"), "recomputed LayerNorm outputs in FP8: {why}");
    ensure!(store.ranges().len() == before, "the refused MLP added parameters");
    let x = Tensor::from_f32(&alloc, &s, &lcg(16 * 24, 1), &[16, 24], DType::BF16)?;
    let r = fc.forward(&Inputs::one(&x), &KeepOnDevice, &s);
    ensure!(matches!(r, Err(Error::Unsupported { .. })), "a forward before start: {:?}", r.err());
    fp8.start(&s)?;
    ensure!(matches!(fp8.start(&s), Err(Error::Unsupported { .. })), "started twice");
    let r = Linear::new(&vb.pp("late"), (16, 16));
    ensure!(matches!(r, Err(Error::Unsupported { .. })), "a layer after start: {:?}", r.err());
    // 24 input features: rows of 24 bytes in E4M3, not a multiple of 16.
    let r = fc.forward(&Inputs::one(&x), &KeepOnDevice, &s);
    ensure!(matches!(r, Err(Error::Shape { .. })), "misaligned k: {:?}", r.err());
    Ok(())
}

crate::per_device!(
    fp8_layer_tracks_the_bf16_layer,
    the_step_sets_scales_from_the_amaxes,
    a_capture_after_an_fp8_capture_carries_nothing_over,
    fp8_split_weight_gradients_equal_the_joined_ones,
    fp8_forward_keeps_the_input_quantized_and_transposed,
    current_scaling_scales_each_tensor_by_its_own_amax,
    current_scaling_keeps_microbatches_apart,
    fp8_mlp_fuses_gelu_backward_into_the_cast,
    a_quantized_gradient_goes_only_to_its_layer,
    fp8_misuse_is_refused,
);
