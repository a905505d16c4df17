//! A stack of transformer layers stepped eagerly and as a graphed stack replayed on a side stream
//! (the caller resuming at the event each graph records), with the optimizer step as one more
//! graph: the two runs agree bit for bit.
//!
//! `cargo run --example graphed_stack`: on the GPU when there is one (`Device::auto`), else on the
//! simulator.

use graphed::device::{DType, Device};
use graphed::graph::{make_graphed_fn, make_graphed_stack, GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{input_grad, DropoutSpec, Inputs, KeepOnDevice, Module, ParamStore, Stack, TransformerLayer};
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;

/// Two layers of width 32 over one parameter store, dropout on, and their optimizer.
fn model(
    dev: &Device,
) -> graphed::Result<(CachingAllocator, graphed::device::Stream, ParamStore, Stack<TransformerLayer>, AdamW)> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let mut store = ParamStore::new(&alloc, &s, 2 * TransformerLayer::parameter_count(32))?;
    let step = Tensor::zeros(&alloc, &s, &[1], DType::U64)?;
    let mut layers = Vec::new();
    for l in 0..2u32 {
        let dropout = DropoutSpec { p: 0.1, seed: 1, site: 2 * l, step: step.clone() };
        layers.push(TransformerLayer::new(&mut store, &alloc, &format!("h{l}"), (32, 1), &dropout, l.into(), &s)?);
    }
    let opt = AdamW::new(&alloc, &store, AdamWHyper::default(), LrSchedule::Constant(1e-3), &s)?;
    Ok((alloc, s, store, Stack::new(layers).with_rng_step(&step), opt))
}

fn main() -> graphed::Result<()> {
    let dev = Device::auto();
    let (ea, es, estore, eager, eopt) = model(&dev)?;
    let (ga, gs, gstore, stack, gopt) = model(&dev)?;
    let (side, ready) = (dev.stream()?, dev.event()?);
    let data = |alloc: &CachingAllocator, s, k: u64| {
        let v: Vec<f32> = (0..4 * 16 * 32).map(|i| ((i as u64 * 31 + k * 7) % 17) as f32 / 17.0 - 0.5).collect();
        Tensor::from_host(alloc, s, &v, &[4, 16, 32])
    };
    let x0 = data(&ga, &gs, 0)?;
    let graphed = make_graphed_stack(&ga, &stack, &x0, GraphOptions::default().sync_event(&ready))?;
    let opt_graph = make_graphed_fn(&ga, |s| gopt.step(s))?;
    for k in 0..3 {
        let (x, dy) = (data(&ea, &es, k)?, data(&ea, &es, k + 100)?);
        let (y, ctx) = eager.forward(&Inputs::one(&x), &KeepOnDevice, &es)?;
        let dx = input_grad("eager", eager.backward(ctx, &[&dy], &es)?)?;
        let (want_y, want_dx) = (y[0].to_vec::<f32>(&es)?, dx.to_vec::<f32>(&es)?);
        eopt.step(&es)?;

        let (x, dy) = (data(&ga, &gs, k)?, data(&ga, &gs, k + 100)?);
        let y = graphed.forward(&gs, &x, Replay::side(&side))?.get()?.to_vec::<f32>(&gs)?;
        let dx = graphed.backward(&gs, &dy)?.expect("an input gradient").get()?.to_vec::<f32>(&gs)?;
        graphed.join(&gs)?; // the tails, before the optimizer reads the gradients
        opt_graph.replay(&gs)?;
        let same = y == want_y
            && dx == want_dx
            && gstore.values()?.to_vec::<f32>(&gs)? == estore.values()?.to_vec::<f32>(&es)?;
        println!("step {k}: graphed and eager outputs, gradients and parameters equal bit for bit: {same}");
        assert!(same);
    }
    Ok(())
}
