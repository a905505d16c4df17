//! A stack of transformer layers trained with a cross-entropy loss, stepped eagerly and as a
//! graphed stack replayed on a side stream (the caller resuming at the event each graph records),
//! the head and its loss eager between the forward and backward replays, the optimizer step as
//! one more graph: the loss falls, and the two runs agree bit for bit.
//!
//! `cargo run --example graphed_stack`: on the GPU when there is one (`Device::auto`), else on the
//! simulator.

use graphed::device::{DType, Device, Stream};
use graphed::graph::{make_graphed_fn, make_graphed_stack, GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    input_grad, Builder, Inputs, KeepOnDevice, Layers, LmHead, Module, ParamStore, Stack, TransformerLayer,
};
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;

const SHAPE: [usize; 3] = [4, 16, 32];
const CLASSES: usize = 8;

/// Two layers of width 32 (dropout on) and a head to `CLASSES` over one parameter store, and
/// their optimizer.
struct Model {
    alloc: CachingAllocator,
    s: Stream,
    store: ParamStore,
    stack: Stack<TransformerLayer>,
    head: LmHead,
    opt: AdamW,
}

fn model(dev: &Device) -> graphed::Result<Model> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let count = 2 * TransformerLayer::parameter_count(32) + LmHead::parameter_count((32, CLASSES));
    let store = ParamStore::new(&alloc, &s, count)?;
    let vb = Builder::new(&store, &alloc, &s)?.with_dropout(0.1, 1);
    let stack = Stack::new(TransformerLayer::stack(&vb, (32, 1), &Layers::first(2))?).with_rng_step(vb.step());
    let head = LmHead::new(&vb.pp("head").with_seed(7), (32, CLASSES))?;
    let opt = AdamW::new(&alloc, &store, AdamWHyper::default(), LrSchedule::Constant(3e-3), &s)?;
    Ok(Model { alloc, s, store, stack, head, opt })
}

/// Batch `k`: inputs, and as each position's class the largest of its first `CLASSES` features.
fn batch(m: &Model, k: usize) -> graphed::Result<(Tensor, Tensor)> {
    let n: usize = SHAPE.iter().product();
    let x: Vec<f32> = (0..n).map(|i| ((i * 31 + k * 7) % 17) as f32 / 17.0 - 0.5).collect();
    let class = |row: &[f32]| (0..CLASSES).fold(0, |best, c| if row[c] > row[best] { c } else { best }) as u32;
    let targets: Vec<u32> = x.chunks(SHAPE[2]).map(class).collect();
    Ok((Tensor::from_host(&m.alloc, &m.s, &x, &SHAPE)?, Tensor::from_host(&m.alloc, &m.s, &targets, &[n / SHAPE[2]])?))
}

/// The head's mean loss over the stack's output `y`, and the gradient it sends back into `y`.
fn loss(m: &Model, y: &Tensor, targets: &Tensor) -> graphed::Result<(f32, Tensor)> {
    let rows = targets.numel();
    let (losses, ctx) = m.head.forward(&y.reshape(&[rows, SHAPE[2]])?, targets, &m.s)?;
    let dlosses = Tensor::from_f32(&m.alloc, &m.s, &vec![1.0 / rows as f32; rows], &[rows], DType::F32)?;
    let dy = m.head.backward(ctx, &dlosses, &m.s)?.reshape(&SHAPE)?;
    Ok((losses.to_vec::<f32>(&m.s)?.iter().sum::<f32>() / rows as f32, dy))
}

fn main() -> graphed::Result<()> {
    let dev = Device::auto();
    let (eager, graphed) = (model(&dev)?, model(&dev)?);
    let (side, ready) = (dev.stream()?, dev.event()?);
    let sample = batch(&graphed, 0)?.0;
    let stack =
        make_graphed_stack(&graphed.alloc, &graphed.stack, &sample, GraphOptions::default().sync_event(&ready))?;
    let opt_step = make_graphed_fn(&graphed.alloc, |s| graphed.opt.step(s))?;
    let mut losses = Vec::new();
    for k in 0..12 {
        let (x, targets) = batch(&eager, k % 4)?;
        let (y, ctx) = eager.stack.forward(&Inputs::one(&x), &KeepOnDevice, &eager.s)?;
        let (want_loss, dy) = loss(&eager, &y[0], &targets)?;
        let want_dx = input_grad("eager", eager.stack.backward(ctx, &[&dy], &eager.s)?)?.to_vec::<f32>(&eager.s)?;
        eager.opt.step(&eager.s)?;

        let (x, targets) = batch(&graphed, k % 4)?;
        let y = stack.forward(&graphed.s, &x, Replay::side(&side))?;
        let (loss, dy) = loss(&graphed, y.get()?, &targets)?;
        let dx = stack.backward(&graphed.s, &dy)?.expect("an input gradient").get()?.to_vec::<f32>(&graphed.s)?;
        stack.join(&graphed.s)?; // the tails, before the optimizer reads the gradients
        opt_step.replay(&graphed.s)?;
        let same = loss == want_loss
            && dx == want_dx
            && graphed.store.values()?.to_vec::<f32>(&graphed.s)? == eager.store.values()?.to_vec::<f32>(&eager.s)?;
        println!(
            "step {k}: loss {loss:.4}; graphed and eager losses, gradients and parameters equal bit for bit: {same}"
        );
        assert!(same);
        losses.push(loss);
    }
    let (first, last) = (losses[..4].iter().sum::<f32>(), losses[losses.len() - 4..].iter().sum::<f32>());
    assert!(last < 0.9 * first, "the loss over the four batches must fall: {first} then {last}");
    Ok(())
}
