//! A pipeline schedule on one device: four layers in two virtual stages, four microbatches under
//! interleaved 1F1B, run eagerly and as one graph per (layer, microbatch) replayed in the
//! schedule's order with buffer reuse; the two agree bit for bit.
//!
//! `cargo run --example schedule`

use graphed::device::{DType, Device};
use graphed::graph::{make_graphed_schedule, static_bytes, Callable, GraphOptions, StaticTensor};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    run_schedule, Builder, EagerPasses, Inputs, KeepOnDevice, Layers, ParamStore, Schedule, TransformerLayer,
};
use graphed::tensor::Tensor;

fn main() -> graphed::Result<()> {
    let dev = Device::auto();
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(&dev);
    let layers =
        |store: &ParamStore| TransformerLayer::stack(&Builder::new(store, &alloc, &s)?, (32, 1), &Layers::first(4));
    let count = 4 * TransformerLayer::parameter_count(32);
    let (eager_store, graphed_store) = (ParamStore::new(&alloc, &s, count)?, ParamStore::new(&alloc, &s, count)?);
    let (eager, graphed) = (layers(&eager_store)?, layers(&graphed_store)?);

    let schedule = Schedule::interleaved_1f1b(1, 0, 2, 4)?;
    let per_chunk = [2, 2];
    println!("{schedule}");
    let input =
        |j: usize| Tensor::from_f32(&alloc, &s, &vec![0.1 * (j + 1) as f32; 2 * 8 * 32], &[2, 8, 32], DType::F32);
    let inputs = (0..4).map(input).collect::<graphed::Result<Vec<_>>>()?;
    let dy = Tensor::from_f32(&alloc, &s, &vec![1.0; 2 * 8 * 32], &[2, 8, 32], DType::F32)?;

    let want = run_schedule(
        &mut EagerPasses::new(&eager, &KeepOnDevice, &s),
        &schedule,
        &per_chunk,
        &inputs,
        None,
        &mut |_, _: Tensor| Ok(dy.clone()),
    )?;
    let callables: Vec<&dyn Callable> = graphed.iter().map(|l| l as &dyn Callable).collect();
    let samples: Vec<Inputs> = (0..4 * 4).map(|_| Inputs::one(&inputs[0])).collect();
    let options = GraphOptions::default().reuse_buffers(true).layers_per_chunk(&per_chunk);
    let g = make_graphed_schedule(&alloc, &callables, &schedule, &samples, options)?;
    // Graphed, the head's input is a static tensor, readable until the next step's replay.
    let got = g.run(&s, &inputs, None, &mut |_, _: StaticTensor| Ok(dy.clone()))?;
    let mut same = eager_store.grads()?.to_vec::<f32>(&s)? == graphed_store.grads()?.to_vec::<f32>(&s)?;
    for (a, b) in want.iter().zip(&got) {
        same &= a.to_vec::<f32>(&s)? == b.get()?.to_vec::<f32>(&s)?;
    }
    println!(
        "{} graphs, {} static bytes with buffer reuse",
        g.callables().iter().map(|c| c.graphs().len()).sum::<usize>(),
        static_bytes(g.callables())
    );
    println!("graphed schedule equal to eager, bit for bit: {same}");
    assert!(same);
    Ok(())
}
