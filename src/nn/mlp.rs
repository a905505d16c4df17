//! The feed-forward block of the benchmark layer: `FC2(GELU_tanh(FC1(x)))` with FC1: C → 4C and
//! FC2: 4C → C. FC1's bias rides in its GEMM's epilogue, so the activation is the plain GELU and
//! each bias gradient is accumulated once, by its [`Linear`].

use super::layernorm::{as_rows, single_input};
use super::{input_grad, Inputs, Linear, LinearCtx, Module, Param, ParamStore, SaveHook};
use crate::device::Stream;
use crate::memory::CachingAllocator;
use crate::ops::gelu;
use crate::tensor::Tensor;
use crate::Result;

/// The MLP of a transformer layer over `(.., C)` inputs.
pub struct Mlp {
    name: String,
    alloc: CachingAllocator,
    /// `C → 4C`.
    pub fc1: Linear,
    /// `4C → C`.
    pub fc2: Linear,
}

/// What the forward saves: both layers' contexts and the pre-activation.
pub struct MlpCtx {
    shape: Vec<usize>,
    fc1: LinearCtx,
    pre: Tensor,
    fc2: LinearCtx,
}

impl Mlp {
    /// The parameters an MLP on `dim` features adds to its store.
    pub fn parameter_count(dim: usize) -> usize {
        Linear::parameter_count((dim, 4 * dim)) + Linear::parameter_count((4 * dim, dim))
    }

    /// An MLP on `dim` features: `{name}.fc1` initialized from `seed`, `{name}.fc2` from `seed + 1`.
    pub fn new(
        store: &mut ParamStore,
        alloc: &CachingAllocator,
        name: &str,
        dim: usize,
        seed: u64,
        stream: &Stream,
    ) -> Result<Mlp> {
        let fc1 = Linear::new(store, alloc, &format!("{name}.fc1"), (dim, 4 * dim), seed, stream)?;
        let fc2 = Linear::new(store, alloc, &format!("{name}.fc2"), (4 * dim, dim), seed.wrapping_add(1), stream)?;
        Ok(Mlp { name: name.to_string(), alloc: alloc.clone(), fc1, fc2 })
    }

    fn dim(&self) -> usize {
        self.fc2.weight.value.shape()[0]
    }
}

impl Module for Mlp {
    type Ctx = MlpCtx;

    /// One contiguous input `(.., C)`, one output of its shape.
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, MlpCtx)> {
        const OP: &str = "Mlp::forward";
        let x = inputs.only(OP)?;
        let rows = as_rows(OP, x, self.dim())?;
        let (mut pre, fc1) = self.fc1.forward(&Inputs::one(&rows), hook, stream)?;
        let pre = pre.remove(0);
        let act = Tensor::uninit(&self.alloc, stream, pre.shape(), pre.dtype())?;
        gelu::gelu_forward(&act, &pre, stream)?;
        hook.open_group(&self.name)?;
        let pre = hook.save("pre", pre, stream)?;
        hook.commit_group(&self.name)?;
        let (mut y, fc2) = self.fc2.forward(&Inputs::one(&act), hook, stream)?;
        Ok((vec![y.remove(0).reshape(x.shape())?], MlpCtx { shape: x.shape().to_vec(), fc1, pre, fc2 }))
    }

    fn backward(&self, ctx: MlpCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        const OP: &str = "Mlp::backward";
        let dy = single_input(OP, grad_outputs)?;
        dy.expect_shape(OP, &ctx.shape)?;
        let dact = input_grad(OP, self.fc2.backward(ctx.fc2, &[&as_rows(OP, dy, self.dim())?], stream)?)?;
        let dpre = Tensor::uninit(&self.alloc, stream, dact.shape(), dact.dtype())?;
        gelu::gelu_backward(&dpre, &ctx.pre, &dact, stream)?;
        let dx = input_grad(OP, self.fc1.backward(ctx.fc1, &[&dpre], stream)?)?;
        Ok(vec![Some(dx.reshape(&ctx.shape)?)])
    }

    fn parameters(&self) -> Vec<&Param> {
        [self.fc1.parameters(), self.fc2.parameters()].concat()
    }

    fn set_training(&mut self, _training: bool) {}
}
