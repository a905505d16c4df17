//! The language-model head: logits `x·Wᵀ + b` over the vocabulary and their cross-entropy.
//!
//! The loss of each position is weighted in the backward (`dlosses`): a weight of 0 leaves a
//! position out (the prompt of a task), `1/count` averages over the positions that count.

use super::{input_grad, Builder, Inputs, KeepOnDevice, Linear, LinearCtx, Module, Param};
use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::ops::loss::{cross_entropy_backward, cross_entropy_forward};
use crate::tensor::Tensor;
use crate::Result;

/// Projection to the vocabulary, with the loss.
pub struct LmHead {
    alloc: CachingAllocator,
    proj: Linear,
}

/// What the forward saves.
pub struct LmHeadCtx {
    linear: LinearCtx,
    /// `(N, vocab)` softmax of the logits, f32.
    pub probs: Tensor,
    targets: Tensor,
    /// The logits' element type, which their gradient takes.
    dtype: DType,
}

impl LmHead {
    /// The parameters a head from `dim` to `vocab` adds to its store.
    pub fn parameter_count((dim, vocab): (usize, usize)) -> usize {
        Linear::parameter_count((dim, vocab))
    }

    /// A head from `dim` to `vocab`, its projection the [`Linear`] of `vb`'s prefix and seed.
    ///
    /// # Errors
    /// [`Error::Shape`](crate::Error::Shape) when the store is full.
    pub fn new(vb: &Builder, (dim, vocab): (usize, usize)) -> Result<LmHead> {
        Ok(LmHead { alloc: vb.alloc().clone(), proj: Linear::new(vb, (dim, vocab))? })
    }

    /// Per-position losses `(N)` of `x` (`(N, dim)`) against `targets` (`(N)`).
    pub fn forward(&self, x: &Tensor, targets: &Tensor, stream: &Stream) -> Result<(Tensor, LmHeadCtx)> {
        let (mut logits, linear) = self.proj.forward(&Inputs::one(x), &KeepOnDevice, stream)?;
        let logits = logits.remove(0);
        let n = logits.shape()[0];
        let losses = Tensor::uninit(&self.alloc, stream, &[n], DType::F32)?;
        // f32 whatever the logits' type: see `ops::loss::cross_entropy_forward`.
        let probs = Tensor::uninit(&self.alloc, stream, logits.shape(), DType::F32)?;
        cross_entropy_forward(&losses, &probs, &logits, targets, stream)?;
        Ok((losses, LmHeadCtx { linear, probs, targets: targets.clone(), dtype: logits.dtype() }))
    }

    /// The gradient of `Σ dlosses ⊙ losses` with respect to `x` (parameter gradients `+=`).
    pub fn backward(&self, ctx: LmHeadCtx, dlosses: &Tensor, stream: &Stream) -> Result<Tensor> {
        let dlogits = Tensor::uninit(&self.alloc, stream, ctx.probs.shape(), ctx.dtype)?;
        cross_entropy_backward(&dlogits, &ctx.probs, &ctx.targets, dlosses, stream)?;
        input_grad("LmHead::backward", self.proj.backward(ctx.linear, &[&dlogits], stream)?)
    }

    /// The projection's weight and bias.
    pub fn parameters(&self) -> Vec<&Param> {
        self.proj.parameters()
    }
}
