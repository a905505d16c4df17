//! Graphed against eager, bitwise: outputs, input gradients, parameter gradients and parameters
//! over 3 AdamW steps of 2 microbatches each, dropout on, with new inputs every microbatch; the
//! graphed side also replays its optimizer step as a graph.

use anyhow::ensure;
use graphed::device::{DType, Device};
use graphed::graph::{
    make_graphed_callables, make_graphed_fn, Callable, GraphOptions, GraphedCallable, GraphedStack, Replay,
};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Inputs, KeepOnDevice, Linear, Module, ParamStore};
use graphed::tensor::Tensor;

use super::fixtures::{lcg, Model, Result, LAYERS, SHAPE};

const STEPS: u64 = 3;
const MICROBATCHES: u64 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    Caller,
    Joined,
    Side,
    /// One graphed callable per layer, each input copied in.
    PerLayer,
    /// One graphed callable per layer, each reading its input in place.
    InPlace,
    /// A stack on a side stream, reading its input and upstream gradient in place.
    StackInPlace,
}

/// Trains twin models, one eagerly and one graphed (its optimizer step a graph too), and
/// compares everything bitwise.
fn twin_training(dev: &Device, how: How, dtype: DType) -> Result {
    twins(dev, how, &|dev| Model::with_dtype(dev, dtype))
}

/// As [`twin_training`], of the models `make` builds.
fn twins(dev: &Device, how: How, make: &dyn Fn(&Device) -> Result<Model>) -> Result {
    let eager = make(dev)?;
    let graphed = make(dev)?;
    let side = dev.stream()?;
    let event = dev.event()?;
    let options = match how {
        How::Side | How::StackInPlace => GraphOptions::default().sync_event(&event),
        _ => GraphOptions::default(),
    };
    let step_before = graphed.step.to_vec::<u64>(&graphed.s)?;
    let grads_before = graphed.grads()?;
    let (stack, layers) = match how {
        How::PerLayer | How::InPlace => {
            let (x0, _) = graphed.data(0)?;
            let samples: Vec<Inputs> = graphed.layers().iter().map(|_| Inputs::one(&x0)).collect();
            (None, make_graphed_callables(&graphed.alloc, &graphed.callables(), &samples, options)?)
        }
        _ => (Some(graphed.graph(options)?), Vec::new()),
    };
    let optimizer = make_graphed_fn(&graphed.alloc, |s| graphed.optimizer.step(s))?;
    ensure!(graphed.step.to_vec::<u64>(&graphed.s)? == step_before, "warmup and capture moved the RNG step counter");
    ensure!(graphed.grads()? == grads_before, "warmup left gradients behind");
    ensure!(graphed.optimizer.steps(&graphed.s)? == 0, "capturing the optimizer stepped it");
    let statics = |g: &GraphedCallable| -> Result<[Vec<f32>; 2]> {
        Ok([g.static_inputs()?[0].to_f32_vec(&graphed.s)?, g.static_grad_outputs()?[0].to_f32_vec(&graphed.s)?])
    };
    let statics_before: Vec<[Vec<f32>; 2]> = layers.iter().map(statics).collect::<Result<_>>()?;
    if how == How::InPlace {
        for g in &layers {
            // Read by the layer norm and the residual add: our own kernels.
            ensure!(g.in_place_inputs()? == [true], "{}: {:?}", g.name(), g.in_place_inputs()?);
        }
    }
    let replay = match how {
        How::Caller | How::PerLayer | How::InPlace => Replay::caller(),
        How::Joined => Replay::joined(&side),
        How::Side | How::StackInPlace => Replay::side(&side),
    };
    if let (How::StackInPlace, Some(g)) = (how, &stack) {
        ensure!(g.in_place_input()? && g.in_place_grad_output()?, "the fixture's layers read both in place");
    }
    let stack_input = |g: &GraphedStack| -> Result<Vec<f32>> { Ok(g.static_input()?.to_f32_vec(&graphed.s)?) };
    let stack_before = stack.as_ref().map(stack_input).transpose()?;
    for step in 0..STEPS {
        for mb in 0..MICROBATCHES {
            let k = step * MICROBATCHES + mb;
            let (x, dy) = eager.data(k)?;
            let (ye, dxe) = eager.eager(&x, &dy)?;
            let (x, dy) = graphed.data(k)?;
            let (yg, dxg) = match &stack {
                Some(g) if how == How::StackInPlace => graphed.graphed_in_place(g, &x, &dy, replay)?,
                Some(g) => graphed.graphed(g, &x, &dy, replay)?,
                None if how == How::InPlace => graphed.per_layer_in_place(&layers, &x, &dy)?,
                None => graphed.per_layer(&layers, &x, &dy)?,
            };
            ensure!(ye == yg, "step {step} microbatch {mb}: outputs differ");
            ensure!(dxe == dxg, "step {step} microbatch {mb}: input gradients differ");
        }
        ensure!(eager.grads()? == graphed.grads()?, "step {step}: accumulated parameter gradients differ");
        eager.optimizer_step()?;
        optimizer.replay(&graphed.s)?;
        ensure!(eager.params()? == graphed.params()?, "step {step}: parameters differ after AdamW");
        ensure!(graphed.grads()?.iter().all(|g| *g == 0.0), "step {step}: the graphed optimizer left gradients");
    }
    ensure!(graphed.optimizer.steps(&graphed.s)? == STEPS, "the graphed optimizer counted its steps");
    let draws = vec![STEPS * MICROBATCHES];
    ensure!(eager.step.to_vec::<u64>(&eager.s)? == draws, "the eager stack advanced its step counter once per forward");
    ensure!(
        graphed.step.to_vec::<u64>(&graphed.s)? == draws,
        "the graphed stack advanced its step counter once per forward"
    );
    ensure!(eager.params()? != make(dev)?.params()?, "training changed nothing");
    if let (Some(g), Some(before)) = (&stack, &stack_before) {
        let copied = stack_input(g)? != *before;
        ensure!(copied != (how == How::StackInPlace), "{how:?}: the stack's static input");
    }
    for (g, before) in layers.iter().zip(&statics_before) {
        let now = statics(g)?;
        let in_place = [g.in_place_inputs()?[0], g.in_place_grad_outputs()?[0]];
        for k in 0..2 {
            let copied = now[k] != before[k];
            ensure!(copied != (how == How::InPlace && in_place[k]), "{how:?}: static {k} of {}", g.name());
        }
    }
    Ok(())
}

pub fn stack_caller_matches_eager(dev: &Device) -> Result {
    twin_training(dev, How::Caller, DType::F32)
}

pub fn stack_joined_matches_eager(dev: &Device) -> Result {
    twin_training(dev, How::Joined, DType::F32)
}

pub fn stack_side_stream_matches_eager(dev: &Device) -> Result {
    twin_training(dev, How::Side, DType::F32)
}

/// Mixed precision: bf16 activations, weights and gradients, f32 master weights in AdamW.
pub fn stack_caller_matches_eager_in_bf16(dev: &Device) -> Result {
    twin_training(dev, How::Caller, DType::BF16)
}

pub fn stack_side_stream_matches_eager_in_bf16(dev: &Device) -> Result {
    twin_training(dev, How::Side, DType::BF16)
}

/// bf16 with the MLPs' GELU output recomputed in the backward: graphed and eager recompute it
/// alike.
pub fn stack_side_stream_matches_eager_recomputing(dev: &Device) -> Result {
    twins(dev, How::Side, &Model::recomputing)
}

/// bf16 with the GELU output and the LayerNorm outputs recomputed in the backward.
pub fn stack_side_stream_matches_eager_recomputing_all(dev: &Device) -> Result {
    twins(dev, How::Side, &Model::recomputing_all)
}

/// Recomputing the GELU output lowers the graph pool's peak: from the forward to the backward no
/// layer holds its activation (batch · seq · 4C). By how much depends on where the peak falls:
/// in the last layer's backward it is every other layer's activation, in the first layer's
/// backward nothing, as that layer then holds its recomputed one.
pub fn recomputing_lowers_the_pool_peak(dev: &Device) -> Result {
    let peak = |m: &Model| -> Result<usize> {
        let g = m.graph(GraphOptions::default())?;
        let (x, dy) = m.data(0)?;
        m.graphed(&g, &x, &dy, Replay::caller())?;
        let id = g.pool().id();
        let stats = m.alloc.stats();
        let pool = stats.pools.iter().find(|(p, _)| *p == id).ok_or_else(|| anyhow::anyhow!("no pool"))?;
        Ok(pool.1.peak_allocated)
    };
    let (kept, recomputed) = (peak(&Model::with_dtype(dev, DType::BF16)?)?, peak(&Model::recomputing(dev)?)?);
    let act = SHAPE[0] * SHAPE[1] * 4 * SHAPE[2] * DType::BF16.size();
    ensure!(
        recomputed < kept && kept - recomputed <= (LAYERS - 1) * act,
        "the pool peaked at {kept} B kept, {recomputed} B recomputed"
    );
    Ok(())
}

/// FP8: the layers' GEMMs in FP8, the scales updated and the weights quantized by the
/// optimizer's step (graphed with it on the graphed side).
pub fn stack_caller_matches_eager_in_fp8(dev: &Device) -> Result {
    twins(dev, How::Caller, &Model::fp8)
}

pub fn stack_side_stream_matches_eager_in_fp8(dev: &Device) -> Result {
    twins(dev, How::Side, &Model::fp8)
}

/// FP8 with E4M3 gradients: GELU's fused backward cast to E4M3, the backward's GEMMs E4M3 × E4M3.
pub fn stack_side_stream_matches_eager_in_fp8_e4m3_gradients(dev: &Device) -> Result {
    twins(dev, How::Side, &Model::fp8_e4m3_gradients)
}

/// FP8 with current scaling: the amax and scale of every tensor inside the graphs, before its
/// cast.
pub fn stack_side_stream_matches_eager_in_fp8_current(dev: &Device) -> Result {
    twins(dev, How::Side, &Model::fp8_current)
}

/// Per layer, not chained: every input is copied into its layer's static input.
pub fn layers_unchained_match_eager(dev: &Device) -> Result {
    twin_training(dev, How::PerLayer, DType::F32)
}

/// A Linear with its weight gradient split out: backward then backward_dw, graphed and eager.
/// One graphed callable per layer, each reading its input where the caller's tensor (or the
/// previous layer's output) is: bit for bit eager, and nothing copied into the static inputs.
pub fn layers_read_in_place_match_eager(dev: &Device) -> Result {
    twin_training(dev, How::InPlace, DType::F32)
}

/// A stack on a side stream reading its input and upstream gradient in place: bit for bit eager.
pub fn stack_read_in_place_matches_eager(dev: &Device) -> Result {
    twin_training(dev, How::StackInPlace, DType::F32)
}

/// As [`layers_read_in_place_match_eager`] in bf16.
pub fn layers_read_in_place_match_eager_in_bf16(dev: &Device) -> Result {
    twin_training(dev, How::InPlace, DType::BF16)
}

pub fn split_weight_gradient_matches_eager(dev: &Device) -> Result {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let store = ParamStore::new(&alloc, &s, 2 * Linear::parameter_count((8, 4)))?;
    let vb = Builder::new(&store, &alloc, &s)?.with_seed(3);
    let (mut eager, mut graphed) = (Linear::new(&vb.pp("e"), (8, 4))?, Linear::new(&vb.pp("g"), (8, 4))?);
    eager.set_split_dw(true);
    graphed.set_split_dw(true);
    let x0 = Tensor::from_host(&alloc, &s, &lcg(24, 1), &[3, 8])?;
    let g = make_graphed_callables(&alloc, &[&graphed as &dyn Callable], &[Inputs::one(&x0)], GraphOptions::default())?;
    for k in 0..3 {
        let x = Tensor::from_host(&alloc, &s, &lcg(24, 10 + k), &[3, 8])?;
        let dy = Tensor::from_host(&alloc, &s, &lcg(12, 20 + k), &[3, 4])?;
        let (_, ctx) = eager.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
        let dxe = eager.backward(ctx, &[&dy], &s)?.remove(0).expect("an input gradient").to_vec::<f32>(&s)?;
        ensure!(eager.weight.grad.to_vec::<f32>(&s)? == graphed.weight.grad.to_vec::<f32>(&s)?, "dw ran in backward");
        eager.backward_dw(&s)?;
        let (_, _t) = g[0].forward(&s, &Inputs::one(&x), Replay::caller())?;
        let (dx, _t) = g[0].backward(&s, &[&dy])?;
        ensure!(dx[0].as_ref().unwrap().get()?.to_vec::<f32>(&s)? == dxe, "input gradients differ");
        let _t = g[0].backward_dw(&s)?;
        ensure!(
            eager.weight.grad.to_vec::<f32>(&s)? == graphed.weight.grad.to_vec::<f32>(&s)?,
            "weight gradients differ"
        );
        ensure!(eager.bias.grad.to_vec::<f32>(&s)? == graphed.bias.grad.to_vec::<f32>(&s)?, "bias gradients differ");
    }
    Ok(())
}

/// The same layers graphed twice, for training (dropout on) and, in their own pool, for
/// inference (dropout off); interleaved, both match eager. In one pool, the inference forward
/// out of the training order is refused.
pub fn training_and_inference_graphs_mix(dev: &Device) -> Result {
    let eager = Model::new(dev)?;
    let mut graphed = Model::new(dev)?;
    let train = graphed.graph(GraphOptions::default())?;
    graphed.stack.set_training(false);
    let infer = graphed.graph(GraphOptions::default().inference())?;
    let mut eval = Model::new(dev)?;
    eval.stack.set_training(false);
    for k in 0..3 {
        let (x, dy) = graphed.data(k)?;
        let (ye, dxe) = eager.eager(&x, &dy)?;
        let (yg, dxg) = graphed.graphed(&train, &x, &dy, Replay::caller())?;
        ensure!(ye == yg && dxe == dxg, "training replay {k} differs from eager");
        // Inference: forward only, no dropout, with the parameters the training shares.
        let h = infer.forward(&graphed.s, &x, Replay::caller())?.get()?.to_vec::<f32>(&graphed.s)?;
        let (he, _) = eval.stack.forward(&Inputs::one(&x), &KeepOnDevice, &eval.s)?;
        ensure!(h == he[0].to_vec::<f32>(&eval.s)?, "inference replay {k} differs from eager evaluation");
        match infer.backward(&graphed.s, &dy) {
            Err(e) if matches!(e.graphed_kind(), Some(graphed::graph::GraphedErrorKind::Inference)) => {}
            other => anyhow::bail!("backward of an inference graph: {other:?}"),
        }
    }
    // Inference graphs captured into the training pool: out of order when interleaved.
    let shared = graphed.graph(GraphOptions::default().inference().pool(train.pool()))?;
    let (x, _) = graphed.data(9)?;
    train.forward(&graphed.s, &x, Replay::caller())?;
    match shared.forward(&graphed.s, &x, Replay::caller()) {
        Err(e) if matches!(e.refused_by(), Some(graphed::Error::PoolOrder { .. })) => Ok(()),
        other => anyhow::bail!("an out-of-order replay in a shared pool: {other:?}"),
    }
}

/// A graphed stack of Linears with split weight gradients: `backward_dw` replays every layer's
/// split pass (last layer first) and matches eager; out of the pool's order it is refused before
/// any layer's pass runs.
pub fn stack_split_weight_gradient_matches_eager(dev: &Device) -> Result {
    use graphed::nn::Stack;
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let store = ParamStore::new(&alloc, &s, 4 * Linear::parameter_count((8, 8)))?;
    let vb = Builder::new(&store, &alloc, &s)?;
    let linears = |seed: u64| -> Result<Stack<Linear>> {
        let mut layers = Vec::new();
        for l in 0..2 {
            let mut fc = Linear::new(&vb.pp(&format!("fc{seed}{l}")).with_seed(seed + l), (8, 8))?;
            fc.set_split_dw(true);
            layers.push(fc);
        }
        Ok(Stack::new(layers))
    };
    let (eager, graphed) = (linears(1)?, linears(1)?);
    let x0 = Tensor::from_host(&alloc, &s, &lcg(24, 1), &[3, 8])?;
    let g = graphed::graph::make_graphed_stack(&alloc, &graphed, &x0, GraphOptions::default())?;
    let grads = |st: &Stack<Linear>| -> Result<Vec<Vec<f32>>> {
        Ok(st.layers().iter().map(|l| l.weight.grad.to_vec(&s)).collect::<graphed::Result<_>>()?)
    };
    let before = grads(&graphed)?;
    match g.backward_dw(&s) {
        Err(e) if matches!(e.refused_by(), Some(graphed::Error::PoolOrder { .. })) => {}
        other => anyhow::bail!("backward_dw before any forward: {other:?}"),
    }
    ensure!(grads(&graphed)? == before, "the refused backward_dw changed a weight gradient");
    for k in 0..2 {
        let x = Tensor::from_host(&alloc, &s, &lcg(24, 10 + k), &[3, 8])?;
        let dy = Tensor::from_host(&alloc, &s, &lcg(24, 20 + k), &[3, 8])?;
        let (_, ctx) = eager.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
        eager.backward(ctx, &[&dy], &s)?;
        eager.backward_dw(&s)?;
        g.forward(&s, &x, Replay::caller())?;
        g.backward(&s, &dy)?;
        g.backward_dw(&s)?;
        g.join(&s)?;
        ensure!(grads(&eager)? == grads(&graphed)?, "microbatch {k}: weight gradients differ");
    }
    Ok(())
}

/// Layers graphed one by one own the dropout step counter as the stack does: the same input
/// twice draws new masks, the counter moves by one per microbatch of the layers (nobody else
/// advances it here), and both microbatches equal the eager stack's, bit for bit.
pub fn graphed_callables_draw_new_masks_every_microbatch(dev: &Device) -> Result {
    let eager = Model::new(dev)?;
    let graphed = Model::new(dev)?;
    let (x, dy) = graphed.data(0)?;
    let samples: Vec<Inputs> = graphed.layers().iter().map(|_| Inputs::one(&x)).collect();
    let g = make_graphed_callables(&graphed.alloc, &graphed.callables(), &samples, GraphOptions::default())?;
    ensure!(graphed.step.to_vec::<u64>(&graphed.s)? == vec![0], "capture moved the counter");
    let first = graphed.per_layer(&g, &x, &dy)?;
    let second = graphed.per_layer(&g, &x, &dy)?;
    ensure!(first.0 != second.0, "the same input twice drew the same masks");
    ensure!(graphed.step.to_vec::<u64>(&graphed.s)? == vec![2], "one advance per microbatch");
    ensure!(first == eager.eager(&x, &dy)? && second == eager.eager(&x, &dy)?, "graphed differs from eager");
    Ok(())
}
