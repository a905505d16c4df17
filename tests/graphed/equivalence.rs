//! Graphed against eager, bitwise: outputs, input gradients, parameter gradients and parameters
//! over 3 AdamW steps of 2 microbatches each, dropout on, with new inputs every microbatch.

use anyhow::ensure;
use graphed::device::Device;
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, Inputs, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{KeepOnDevice, Linear, Module, ParamStore};
use graphed::tensor::Tensor;

use super::fixtures::{lcg, Result, Stack};

const STEPS: u64 = 3;
const MICROBATCHES: u64 = 2;

#[derive(Clone, Copy)]
enum How {
    Caller,
    Joined,
    Side,
}

/// Trains twin stacks, one eagerly and one graphed, and compares everything bitwise.
fn twin_training(dev: &Device, how: How, chain: bool) -> Result {
    let eager = Stack::new(dev)?;
    let graphed = Stack::new(dev)?;
    let side = dev.stream()?;
    let event = dev.event()?;
    let (x0, _) = graphed.data(0)?;
    let samples: Vec<Inputs> = (0..graphed.layers.len()).map(|_| Inputs::args(&[&x0])).collect();
    let mut options = GraphOptions::default().chain(chain);
    if let How::Side = how {
        options = options.sync_event(&event);
    }
    let step_before = graphed.step.to_vec(&graphed.s)?;
    let grads_before = graphed.grads()?;
    let mut g = make_graphed_callables(&graphed.alloc, &graphed.callables(), &samples, options)?;
    ensure!(graphed.step.to_vec(&graphed.s)? == step_before, "warmup and capture moved the RNG step counter");
    ensure!(graphed.grads()? == grads_before, "warmup left gradients behind");
    let replay = match how {
        How::Caller => Replay::caller(),
        How::Joined => Replay::joined(&side),
        How::Side => Replay::resume_at(&side, &event),
    };
    for step in 0..STEPS {
        for mb in 0..MICROBATCHES {
            let k = step * MICROBATCHES + mb;
            let (x, dy) = eager.data(k)?;
            let (ye, dxe) = eager.eager(&x, &dy)?;
            let (x, dy) = graphed.data(k)?;
            let (yg, dxg) = graphed.graphed(&mut g, &x, &dy, replay)?;
            ensure!(ye == yg, "step {step} microbatch {mb}: outputs differ");
            ensure!(dxe == dxg, "step {step} microbatch {mb}: input gradients differ");
        }
        ensure!(eager.grads()? == graphed.grads()?, "step {step}: accumulated parameter gradients differ");
        eager.optimizer_step()?;
        graphed.optimizer_step()?;
        ensure!(eager.params()? == graphed.params()?, "step {step}: parameters differ after AdamW");
    }
    ensure!(eager.params()? != Stack::new(dev)?.params()?, "training changed nothing");
    Ok(())
}

pub fn stack_caller_matches_eager(dev: &Device) -> Result {
    twin_training(dev, How::Caller, true)
}

pub fn stack_joined_matches_eager(dev: &Device) -> Result {
    twin_training(dev, How::Joined, true)
}

pub fn stack_side_stream_matches_eager(dev: &Device) -> Result {
    twin_training(dev, How::Side, true)
}

/// Per layer, not chained: every input is copied into its layer's static input.
pub fn layers_unchained_match_eager(dev: &Device) -> Result {
    twin_training(dev, How::Caller, false)
}

/// A Linear with its weight gradient split out: backward then backward_dw, graphed and eager.
pub fn split_weight_gradient_matches_eager(dev: &Device) -> Result {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let mut store = ParamStore::new(&alloc, &s, 2 * (8 * 4 + 4))?;
    let mut eager = Linear::new(&mut store, &alloc, "e", (8, 4), 3, &s)?;
    let mut graphed = Linear::new(&mut store, &alloc, "g", (8, 4), 3, &s)?;
    eager.set_split_dw(true);
    graphed.set_split_dw(true);
    let x0 = Tensor::from_host(&alloc, &s, &lcg(24, 1), &[3, 8])?;
    let mut g =
        make_graphed_callables(&alloc, &[&graphed as &dyn Callable], &[Inputs::args(&[&x0])], GraphOptions::default())?;
    for k in 0..3 {
        let x = Tensor::from_host(&alloc, &s, &lcg(24, 10 + k), &[3, 8])?;
        let dy = Tensor::from_host(&alloc, &s, &lcg(12, 20 + k), &[3, 4])?;
        let (_, ctx) = Module::forward(&eager, &[&x], &KeepOnDevice, &s)?;
        let dxe = Module::backward(&eager, ctx, &[&dy], &s)?.remove(0).to_vec(&s)?;
        ensure!(eager.weight.grad.to_vec(&s)? == graphed.weight.grad.to_vec(&s)?, "dw ran in backward");
        Module::backward_dw(&eager, &s)?;
        let (_, _t) = g[0].forward(&s, &Inputs::args(&[&x]), Replay::caller())?;
        let (dx, _t) = g[0].backward(&s, &[&dy])?;
        ensure!(dx[0].as_ref().unwrap().get()?.to_vec(&s)? == dxe, "input gradients differ");
        let _t = g[0].backward_dw(&s)?;
        ensure!(eager.weight.grad.to_vec(&s)? == graphed.weight.grad.to_vec(&s)?, "weight gradients differ");
        ensure!(eager.bias.grad.to_vec(&s)? == graphed.bias.grad.to_vec(&s)?, "bias gradients differ");
    }
    Ok(())
}

/// The same layers graphed twice, for training (dropout on) and, in their own pool, for
/// inference (dropout off); interleaved, both match eager. In one pool, the inference forward
/// out of the training order is refused.
pub fn training_and_inference_graphs_mix(dev: &Device) -> Result {
    let eager = Stack::new(dev)?;
    let mut graphed = Stack::new(dev)?;
    let (x0, _) = graphed.data(0)?;
    let samples: Vec<Inputs> = (0..graphed.layers.len()).map(|_| Inputs::args(&[&x0])).collect();
    let mut train =
        make_graphed_callables(&graphed.alloc, &graphed.callables(), &samples, GraphOptions::default().chain(true))?;
    graphed.layers.iter_mut().for_each(|l| l.set_training(false));
    let mut infer = make_graphed_callables(
        &graphed.alloc,
        &graphed.callables(),
        &samples,
        GraphOptions::default().chain(true).inference(),
    )?;
    let mut eval = Stack::new(dev)?;
    eval.layers.iter_mut().for_each(|l| l.set_training(false));
    for k in 0..3 {
        let (x, dy) = graphed.data(k)?;
        let (ye, dxe) = eager.eager(&x, &dy)?;
        let (yg, dxg) = graphed.graphed(&mut train, &x, &dy, Replay::caller())?;
        ensure!(ye == yg && dxe == dxg, "training replay {k} differs from eager");
        // Inference: forward only, no dropout, with the parameters the training shares.
        let mut h = x.clone();
        for gi in infer.iter_mut() {
            let (y, _t) = gi.forward(&graphed.s, &Inputs::args(&[&h]), Replay::caller())?;
            h = y[0].get()?.clone();
        }
        let mut he = x.clone();
        for l in &eval.layers {
            he = Module::forward(l, &[&he], &KeepOnDevice, &eval.s)?.0.remove(0);
        }
        ensure!(h.to_vec(&graphed.s)? == he.to_vec(&eval.s)?, "inference replay {k} differs from eager evaluation");
        match infer[0].backward(&graphed.s, &[&dy]) {
            Err(e) if matches!(e.graphed_kind(), Some(graphed::graph::GraphedErrorKind::Inference)) => {}
            other => anyhow::bail!("backward of an inference graph: {other:?}"),
        }
    }
    // Inference graphs captured into the training pool: out of order when interleaved.
    let mut shared = make_graphed_callables(
        &graphed.alloc,
        &graphed.callables(),
        &samples,
        GraphOptions::default().chain(true).inference().pool(train[0].pool()),
    )?;
    let (x, _) = graphed.data(9)?;
    let (_y, _t) = train[0].forward(&graphed.s, &Inputs::args(&[&x]), Replay::caller())?;
    match shared[0].forward(&graphed.s, &Inputs::args(&[&x]), Replay::caller()) {
        Err(graphed::Error::PoolOrder { .. }) => Ok(()),
        other => anyhow::bail!("an out-of-order replay in a shared pool: {other:?}"),
    }
}
