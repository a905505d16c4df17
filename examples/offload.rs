//! Activation offloading inside the graphs: the capture's warmup records what the layers save
//! and freezes the policy (printed), and the graphed stack copies the activations to host memory
//! in each graph's tail, with the same results as without offloading.
//!
//! `cargo run --example offload`

use graphed::device::{DType, Device};
use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Layers, ParamStore, Stack, TransformerLayer};
use graphed::offload::{OffloadConfig, OffloadManager};
use graphed::tensor::Tensor;

fn main() -> graphed::Result<()> {
    let dev = Device::auto();
    let (main, side, ready) = (dev.stream()?, dev.stream()?, dev.event()?);
    let alloc = CachingAllocator::new(&dev);
    let store = ParamStore::new(&alloc, &main, 4 * TransformerLayer::parameter_count(64))?;
    let vb = Builder::new(&store, &alloc, &main)?;
    let stack = Stack::new(TransformerLayer::stack(&vb, (64, 2), &Layers::first(4))?);
    let x = Tensor::from_f32(&alloc, &main, &vec![0.25; 4 * 32 * 64], &[4, 32, 64], DType::F32)?;
    let dy = Tensor::from_f32(&alloc, &main, &vec![1.0; 4 * 32 * 64], &[4, 32, 64], DType::F32)?;

    let plain = make_graphed_stack(&alloc, &stack, &x, GraphOptions::default())?;
    // The capture's warmup records every saved tensor, then decides and freezes the policy.
    let offload = OffloadManager::new(&alloc, OffloadConfig::default().min_elements(1024))?;
    let options = offload.graph_options(GraphOptions::default().sync_event(&ready));
    let graphed = make_graphed_stack(&alloc, &stack, &x, options)?;
    println!("{}", offload.summary().expect("frozen by the capture"));
    for g in graphed.layers() {
        for report in g.report()?.graphs.iter().filter(|r| !r.tail.is_empty()) {
            println!("{} {:?}: tail {:?}", g.name(), report.pass, report.tail);
        }
    }
    let y = graphed.forward(&main, &x, Replay::side(&side))?.get()?.to_vec::<f32>(&main)?;
    let dx = graphed.backward(&main, &dy)?.expect("an input gradient").get()?.to_vec::<f32>(&main)?;
    graphed.join(&main)?;
    let y0 = plain.forward(&main, &x, Replay::caller())?.get()?.to_vec::<f32>(&main)?;
    let dx0 = plain.backward(&main, &dy)?.expect("an input gradient").get()?.to_vec::<f32>(&main)?;
    println!("with offloading equal to without, bit for bit: {}", y == y0 && dx == dx0);
    assert!(y == y0 && dx == dx0);
    Ok(())
}
