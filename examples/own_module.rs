//! A model of your own: a two-layer classifier defined here as an `nn::Module` over `Linear`s,
//! captured with `make_graphed_stack` and trained with cross-entropy on synthetic data (the class
//! is the quadrant of a point's first two features, which no linear model separates). The loss
//! falls, or the program fails. `cargo run --example own_module`: on the GPU when there is one.

use graphed::device::{DType, Device, Stream};
use graphed::graph::{make_graphed_fn, make_graphed_stack, GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{BiasGrad, Builder, Inputs, Linear, Module, Param, ParamStore, SaveHook, Stack};
use graphed::ops::loss::{cross_entropy_backward, cross_entropy_forward};
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;

const BATCH: usize = 64;
const FEATURES: usize = 8;
const HIDDEN: usize = 32;
const CLASSES: usize = 4;

/// `fc2(GELU(fc1(x)))`: logits of `CLASSES` classes for rows of `FEATURES` features.
struct Classifier {
    fc1: Linear,
    fc2: Linear,
}

/// What the forward keeps for the backward: the input, the hidden layer before and after GELU.
struct Saved(Tensor, Tensor, Tensor);

impl Module for Classifier {
    type Ctx = Saved;

    fn forward(&self, inputs: &Inputs, _hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, Saved)> {
        let x = inputs.only("Classifier::forward")?;
        // GELU in the GEMM's epilogue; each layer hands back its input as its backward reads it.
        let (fc1, pre) = self.fc1.forward_gelu(x, s)?;
        let fc2 = self.fc2.forward_keeping_input(&fc1.y, None, s)?;
        Ok((vec![fc2.y], Saved(fc1.input, pre, fc2.input)))
    }

    fn backward(&self, Saved(x, pre, act): Saved, dy: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        let [dy] = dy else {
            return Err(graphed::Error::MissingGradient { op: "Classifier::backward", what: "the logits".into() });
        };
        // Input gradients returned, parameter gradients +=; GELU's backward in fc2's GEMM.
        let dpre = self.fc2.backward_with(dy, &act, Some(&pre), BiasGrad::Compute, s)?;
        let dx = self.fc1.backward_with(&dpre, &x, None, BiasGrad::Compute, s)?;
        Ok(vec![Some(dx)])
    }

    fn parameters(&self) -> Vec<&Param> {
        [self.fc1.parameters(), self.fc2.parameters()].concat()
    }

    fn set_training(&mut self, _training: bool) {}
}

/// Batch `k`: points in [-1, 1)^FEATURES, and each one's quadrant of its first two features.
fn batch(alloc: &CachingAllocator, s: &Stream, k: usize) -> graphed::Result<(Tensor, Tensor)> {
    let n = BATCH * FEATURES;
    let x: Vec<f32> = (k * n..(k + 1) * n).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
    let classes: Vec<u32> = x.chunks(FEATURES).map(|p| u32::from(p[0] > 0.0) + 2 * u32::from(p[1] > 0.0)).collect();
    Ok((Tensor::from_host(alloc, s, &x, &[BATCH, FEATURES])?, Tensor::from_host(alloc, s, &classes, &[BATCH])?))
}

fn main() -> graphed::Result<()> {
    let dev = Device::auto();
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
    let count = Linear::parameter_count((FEATURES, HIDDEN)) + Linear::parameter_count((HIDDEN, CLASSES));
    let store = ParamStore::new(&alloc, &s, count)?;
    let vb = Builder::new(&store, &alloc, &s)?.with_seed(1);
    let stack = Stack::new(vec![Classifier {
        fc1: Linear::new(&vb.pp("fc1"), (FEATURES, HIDDEN))?,
        fc2: Linear::new(&vb.pp("fc2").with_seed(2), (HIDDEN, CLASSES))?,
    }]);
    let opt = AdamW::new(&alloc, &store, AdamWHyper::default(), LrSchedule::Constant(1e-2), &s)?;

    let graphed = make_graphed_stack(&alloc, &stack, &batch(&alloc, &s, 0)?.0, GraphOptions::default())?;
    let opt_step = make_graphed_fn(&alloc, |s| opt.step(s))?;
    let zeros = |shape: &[usize]| Tensor::zeros(&alloc, &s, shape, DType::F32);
    let (losses, probs, dlogits) = (zeros(&[BATCH])?, zeros(&[BATCH, CLASSES])?, zeros(&[BATCH, CLASSES])?);
    let dlosses = Tensor::from_host(&alloc, &s, &[1.0 / BATCH as f32; BATCH], &[BATCH])?; // the batch's mean
    let mut epochs = Vec::new();
    for epoch in 0..10 {
        let mut total = 0.0;
        for k in 0..8 {
            let (x, classes) = batch(&alloc, &s, k)?;
            let logits = graphed.forward(&s, &x, Replay::caller())?;
            cross_entropy_forward(&losses, &probs, logits.get()?, &classes, &s)?; // the loss, eager
            cross_entropy_backward(&dlogits, &probs, &classes, &dlosses, &s)?; // its gradient
            graphed.backward(&s, &dlogits)?;
            graphed.join(&s)?;
            opt_step.replay(&s)?;
            total += losses.to_vec::<f32>(&s)?.iter().sum::<f32>() / (8 * BATCH) as f32;
        }
        println!("epoch {epoch}: mean loss {total:.4}");
        epochs.push(total);
    }
    let (first, last) = (epochs[0], epochs[9]);
    assert!(last < 0.5 * first, "the loss must fall by half: {first} at first, {last} at the end");
    Ok(())
}
