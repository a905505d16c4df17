//! A schedule's passes run eagerly.

use std::collections::HashMap;

use super::error::refuse;
use super::{ScheduleErrorKind, SchedulePasses};
use crate::device::Stream;
use crate::nn::{Inputs, Module, SaveHook};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The layers of a schedule run eagerly, each (layer, microbatch)'s context kept for its
/// backward.
pub struct EagerPasses<'a, M: Module> {
    layers: &'a [M],
    hook: &'a dyn SaveHook,
    stream: &'a Stream,
    saved: HashMap<(usize, usize), M::Ctx>,
}

impl<'a, M: Module> EagerPasses<'a, M> {
    /// `layers` (every chunk's, chunk by chunk), saving through `hook`, on `stream`.
    pub fn new(layers: &'a [M], hook: &'a dyn SaveHook, stream: &'a Stream) -> EagerPasses<'a, M> {
        EagerPasses { layers, hook, stream, saved: HashMap::new() }
    }
}

impl<M: Module> SchedulePasses for EagerPasses<'_, M> {
    type Out = Tensor;

    fn advance_rng(&mut self, step: &Tensor, by: u64) -> Result<()> {
        crate::ops::rng::step_add(step, by, self.stream)
    }

    fn forward(&mut self, layer: usize, microbatch: usize, x: &Tensor) -> Result<Tensor> {
        let (mut y, ctx) = self.layers[layer].forward(&Inputs::one(x), self.hook, self.stream)?;
        self.saved.insert((layer, microbatch), ctx);
        Ok(y.remove(0))
    }

    fn backward(&mut self, layer: usize, microbatch: usize, dy: &Tensor) -> Result<Tensor> {
        let ctx = (self.saved.remove(&(layer, microbatch)))
            .ok_or(Error::Schedule(ScheduleErrorKind::BackwardBeforeForward { layer, microbatch }))?;
        crate::nn::input_grad("EagerPasses::backward", self.layers[layer].backward(ctx, &[dy], self.stream)?)
    }

    fn weight_grad(&mut self, layer: usize, _microbatch: usize) -> Result<()> {
        self.layers[layer].backward_dw(self.stream)
    }

    fn splits_weight_grads(&self, layer: usize) -> Result<bool> {
        let Some(m) = self.layers.get(layer) else {
            return refuse(ScheduleErrorKind::NoSuchLayer { layer, layers: self.layers.len() });
        };
        Ok(m.splits_dw())
    }
}
