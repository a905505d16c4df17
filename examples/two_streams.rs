//! Two transformer layers graphed as callables, each in a pool of its own, replayed on two
//! streams as two pipeline stages would be on one device: typed edges order them on the device
//! (no host wait between the streams), and each reads the other's output or input gradient where
//! it is, with nothing copied in. Three steps agree with the eager stack bit for bit.
//!
//! `cargo run --example two_streams`

use graphed::device::{DType, Device};
use graphed::graph::{make_graphed_callables, Callable, GraphEdge, GraphOptions, Pass, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Inputs, KeepOnDevice, Layers, Module, ParamStore, Stack, TransformerLayer};
use graphed::tensor::Tensor;

fn main() -> graphed::Result<()> {
    let dev = Device::auto();
    let (s0, s1) = (dev.stream()?, dev.stream()?);
    let alloc = CachingAllocator::new(&dev);
    let count = 2 * TransformerLayer::parameter_count(32);
    // With dropout, the residual adds are graphed's own kernels, which read their inputs in place.
    let model = |store: &ParamStore| -> graphed::Result<Stack<TransformerLayer>> {
        let vb = Builder::new(store, &alloc, &s0)?.with_dropout(0.1, 5);
        Ok(Stack::new(TransformerLayer::stack(&vb, (32, 1), &Layers::first(2))?).with_rng_step(vb.step()))
    };
    let (eager_store, graphed_store) = (ParamStore::new(&alloc, &s0, count)?, ParamStore::new(&alloc, &s0, count)?);
    let (eager, graphed) = (model(&eager_store)?, model(&graphed_store)?);
    let data = |seed: usize| {
        let v: Vec<f32> = (0..2 * 8 * 32).map(|i| ((i * 7 + seed * 13) % 17) as f32 * 0.1 - 0.8).collect();
        Tensor::from_f32(&alloc, &s0, &v, &[2, 8, 32], DType::F32)
    };

    let (forward, backward) = (GraphEdge::new(&dev, "h0 forward")?, GraphEdge::new(&dev, "h1 backward")?);
    let options = GraphOptions::default()
        .pool_per_callable(true)
        .signals(0, Pass::Forward, &forward) // layer 0's forward, then layer 1's
        .waits_on(1, Pass::Forward, &forward)
        .signals(1, Pass::Backward, &backward) // layer 1's backward, then layer 0's
        .waits_on(0, Pass::Backward, &backward);
    let callables: Vec<&dyn Callable> = graphed.layers().iter().map(|l| l as &dyn Callable).collect();
    let x0 = data(0)?;
    let g = make_graphed_callables(&alloc, &callables, &[Inputs::one(&x0), Inputs::one(&x0)], options)?;
    println!("layer 1 reads its input in place: {:?}", g[1].in_place_inputs()?);

    let mut same = true;
    for step in 1..4 {
        let (x, dy) = (data(step)?, data(10 + step)?);
        let (y, ctx) = eager.forward(&Inputs::one(&x), &KeepOnDevice, &s0)?;
        let dx = eager.backward(ctx, &[&dy], &s0)?.remove(0).expect("an input gradient");

        let (y0, _t) = g[0].forward(&s0, &Inputs::one(&x), Replay::caller())?;
        let (y1, _t) = g[1].forward_in_place(&s1, &Inputs::one(y0[0].get()?), Replay::caller())?;
        let (dx1, _t) = g[1].backward(&s1, &[&dy])?;
        let dx1 = dx1[0].as_ref().expect("an input gradient");
        let (dx0, _t) = g[0].backward_in_place(&s0, &[dx1.get()?])?;
        let dx0 = dx0[0].as_ref().expect("an input gradient");
        same &= y[0].to_vec::<f32>(&s0)? == y1[0].get()?.to_vec::<f32>(&s1)?;
        same &= dx.to_vec::<f32>(&s0)? == dx0.get()?.to_vec::<f32>(&s0)?;
    }
    same &= eager_store.grads()?.to_vec::<f32>(&s0)? == graphed_store.grads()?.to_vec::<f32>(&s0)?;
    println!("two streams ordered by edges, equal to eager bit for bit: {same}");
    assert!(same);
    // The checker (always on the simulator) saw every launch: no race between the streams.
    if let Some(checker) = graphed::check::Checker::of(&dev) {
        println!("stream-safety checker: {} hazards", checker.hazards().len());
        assert!(checker.hazards().is_empty());
    }
    Ok(())
}
