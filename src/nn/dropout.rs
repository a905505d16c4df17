//! Dropout as a module around [`ops::dropout`](crate::ops::dropout), with the model's shared
//! device-side step counter (Note [Graph-safe RNG] in `ops/rng.rs`): a captured graph draws new
//! masks when the step is written between replays, and the same mask again for the same step.

use super::layernorm::single_input;
use super::{Builder, Inputs, Module, Param, SaveHook};
use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::ops::dropout;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Where a model's dropout layers draw their masks from: a [`Builder`] carries one, and each
/// dropout built from it keeps a copy.
#[derive(Clone, Debug)]
pub struct DropoutSpec {
    /// Drop probability, in `[0, 1)`; 0 turns dropout off.
    pub p: f32,
    /// The model's RNG seed.
    pub seed: u32,
    /// The layer's site, distinct per dropout layer so that layers draw independent masks.
    pub site: u32,
    /// The one-element step counter shared by the model.
    pub step: Tensor,
}

/// Inverted dropout; the identity when `p == 0` or in evaluation.
pub struct Dropout {
    p: f32,
    seed: u32,
    site: u32,
    step: Tensor,
    training: bool,
    alloc: CachingAllocator,
}

/// What the forward saves: the mask, or nothing when the forward was the identity.
pub struct DropoutCtx {
    mask: Option<Tensor>,
}

impl DropoutCtx {
    /// The context of a forward that was the identity.
    pub(crate) fn identity() -> DropoutCtx {
        DropoutCtx { mask: None }
    }

    /// Whether the forward was the identity (so the backward is too).
    pub fn is_identity(&self) -> bool {
        self.mask.is_none()
    }
}

impl Dropout {
    /// A dropout layer drawing from `vb`'s [`dropout`](Builder::dropout) (at its site), in
    /// training mode.
    ///
    /// # Errors
    /// [`Error::Unsupported`] unless `0 ≤ p < 1`.
    pub fn new(vb: &Builder) -> Result<Dropout> {
        let spec = vb.dropout();
        if !(0.0..1.0).contains(&spec.p) {
            return Err(Error::Unsupported {
                op: "Dropout::new",
                backend: "any",
                why: "the drop probability p must be in [0, 1)",
            });
        }
        Ok(Dropout {
            p: spec.p,
            seed: spec.seed,
            site: spec.site,
            step: spec.step.clone(),
            training: true,
            alloc: vb.alloc().clone(),
        })
    }

    /// The step counter the masks depend on, shared with the model's other dropout layers.
    pub fn step(&self) -> &Tensor {
        &self.step
    }

    /// Whether the forward draws a mask (training with p > 0); else it is the identity.
    pub fn is_active(&self) -> bool {
        self.training && self.p > 0.0
    }
}

impl Module for Dropout {
    type Ctx = DropoutCtx;

    /// One input of any contiguous shape, one output of its shape: the input itself (no copy)
    /// when inactive.
    fn forward(&self, inputs: &Inputs, _hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, DropoutCtx)> {
        let x = inputs.only("Dropout::forward")?;
        if !self.is_active() {
            return Ok((vec![x.clone()], DropoutCtx { mask: None }));
        }
        let out = Tensor::uninit(&self.alloc, stream, x.shape(), x.dtype())?;
        let mask = Tensor::uninit(&self.alloc, stream, x.shape(), DType::U8)?;
        dropout::dropout_forward(&out, &mask, x, self.p, self.seed, self.site, &self.step, stream)?;
        Ok((vec![out], DropoutCtx { mask: Some(mask) }))
    }

    /// The output gradient itself when the forward was the identity.
    fn backward(&self, ctx: DropoutCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        let dy = single_input("Dropout::backward", grad_outputs)?;
        let Some(mask) = ctx.mask else { return Ok(vec![Some(dy.clone())]) };
        let dx = Tensor::uninit(&self.alloc, stream, dy.shape(), dy.dtype())?;
        dropout::dropout_backward(&dx, dy, &mask, self.p, stream)?;
        Ok(vec![Some(dx)])
    }

    fn draws_from(&self) -> Option<&Tensor> {
        self.is_active().then_some(&self.step)
    }

    fn parameters(&self) -> Vec<&Param> {
        Vec::new()
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}
