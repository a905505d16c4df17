//! The feed-forward block of the benchmark layer: `FC2(GELU_tanh(FC1(x)))` with FC1: C → 4C and
//! FC2: 4C → C, in two GEMMs forward (FC1's bias and the GELU in its epilogue, FC2's bias and an
//! optional residual in its) and four backward (FC2's data gradient carries GELU's backward in its
//! epilogue, the weight gradients' GEMMs the bias gradients). In FP8, GELU's backward is instead
//! fused with FC1's cast of its gradient and FC1's bias gradient ([`Linear::backward_through_gelu`]).

use super::layernorm::{as_rows, single_input};
use super::saved::saved_or_given;
use super::{BiasGrad, Builder, Inputs, Linear, LinearForward, Module, Param, SaveHook, SavedTensor};
use crate::device::Stream;
use crate::memory::CachingAllocator;
use crate::ops::gelu;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The MLP of a transformer layer over `(.., C)` inputs.
pub struct Mlp {
    name: String,
    /// `C → 4C`.
    pub fc1: Linear,
    /// `4C → C`.
    pub fc2: Linear,
    /// Whether the backward recomputes the activation
    /// ([`Recompute::gelu`](super::Recompute::gelu)) instead of saving it.
    recompute_act: bool,
    /// Whether the forward saves its input; when not, whoever runs the backward gives it again
    /// (a [`TransformerLayer`](super::TransformerLayer) recomputing its LayerNorm output).
    keep_input: bool,
    alloc: CachingAllocator,
}

/// What the forward saves: the input rows (none when the caller gives them again), the
/// pre-activation and the activation (none when the backward recomputes it).
pub struct MlpCtx {
    shape: Vec<usize>,
    x: Option<SavedTensor>,
    pre: SavedTensor,
    act: Option<SavedTensor>,
}

impl Mlp {
    /// The parameters an MLP on `dim` features adds to its store.
    pub fn parameter_count(dim: usize) -> usize {
        Linear::parameter_count((dim, 4 * dim)) + Linear::parameter_count((4 * dim, dim))
    }

    /// An MLP on `dim` features: `{prefix}.fc1` initialized from `vb`'s seed, `{prefix}.fc2`
    /// from seed + 1; its backward recomputes what `vb`'s [`Recompute`](super::Recompute) says.
    ///
    /// # Errors
    /// [`Error::Shape`] when the store is full; [`Error::Unsupported`] for
    /// the GELU output recomputed with FP8, before any parameter is added.
    pub fn new(vb: &Builder, dim: usize) -> Result<Mlp> {
        let recompute_act = vb.recompute().gelu();
        if recompute_act && vb.fp8().is_some() {
            return Err(Error::Unsupported {
                op: "Mlp::new",
                backend: "any",
                why: "recomputing the GELU output is not supported with FP8, whose FC2 keeps its input quantized; \
                      drop the recompute setting (--recompute none) or train in bf16",
            });
        }
        let fc1 = Linear::new(&vb.pp("fc1"), (dim, 4 * dim))?;
        let fc2 = Linear::new(&vb.pp("fc2").with_seed(vb.seed().wrapping_add(1)), (4 * dim, dim))?;
        let alloc = vb.alloc().clone();
        Ok(Mlp { name: vb.prefix().to_string(), fc1, fc2, recompute_act, keep_input: true, alloc })
    }

    /// Stops saving the input: the backward then needs it given again
    /// ([`backward_with`](Mlp::backward_with)'s `input`).
    pub(crate) fn forget_input(&mut self) {
        self.keep_input = false;
    }

    fn dim(&self) -> usize {
        self.fc2.weight.value.shape()[0]
    }

    /// `residual + MLP(x)` (just `MLP(x)` without a residual), the add in FC2's GEMM.
    pub fn forward_residual(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        hook: &dyn SaveHook,
        stream: &Stream,
    ) -> Result<(Tensor, MlpCtx)> {
        const OP: &str = "Mlp::forward";
        let rows = as_rows(OP, x, self.dim())?;
        let residual = residual.map(|r| as_rows(OP, r, self.dim())).transpose()?;
        let (LinearForward { y: act, input: kept_x }, pre) = self.fc1.forward_gelu(&rows, stream)?;
        let LinearForward { y, input: kept_act } = self.fc2.forward_keeping_input(&act, residual.as_ref(), stream)?;
        hook.open_group(&self.name)?;
        let x_saved = match self.keep_input {
            true => Some(hook.save("input", kept_x, stream)?),
            false => None,
        };
        let pre = hook.save("pre", pre, stream)?;
        let act = match self.recompute_act {
            true => None,
            false => Some(hook.save("act", kept_act, stream)?),
        };
        hook.commit_group(&self.name, stream)?;
        Ok((y.reshape(x.shape())?, MlpCtx { shape: x.shape().to_vec(), x: x_saved, pre, act }))
    }

    /// The input gradient from the output gradient `dy`; parameter gradients `+=`, FC2's bias
    /// gradient as `fc2_bias` says (a LayerNorm backward that also reads `dy` can add it).
    /// `input` is the forward's input again, for an MLP that did not save it.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the forward did not save its input and `input` is `None`.
    pub fn backward_with(
        &self,
        ctx: MlpCtx,
        dy: &Tensor,
        fc2_bias: BiasGrad,
        input: Option<&Tensor>,
        stream: &Stream,
    ) -> Result<Tensor> {
        const OP: &str = "Mlp::backward";
        dy.expect_shape(OP, &ctx.shape)?;
        // A saved input is as FC1 kept it (in FP8 its quantized transpose); one given is rows.
        let given = input.map(|x| as_rows(OP, x, self.dim())).transpose()?;
        let x = saved_or_given(ctx.x, given.as_ref(), OP, stream)?;
        let dy = as_rows(OP, dy, self.dim())?;
        let pre = ctx.pre.take(stream)?;
        let act = match ctx.act {
            Some(act) => act.take(stream)?,
            None => {
                let act = Tensor::uninit(&self.alloc, stream, pre.shape(), pre.dtype())?;
                gelu::gelu_forward(&act, &pre, stream)?;
                act
            }
        };
        let dpre = self.fc2.backward_through_gelu(&dy, act, &pre, fc2_bias, &self.fc1, stream)?;
        let dx = self.fc1.backward_from(dpre, &x, stream)?;
        dx.reshape(&ctx.shape)
    }
}

impl Module for Mlp {
    type Ctx = MlpCtx;

    /// One contiguous input `(.., C)`, one output of its shape.
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, MlpCtx)> {
        let (y, ctx) = self.forward_residual(inputs.only("Mlp::forward")?, None, hook, stream)?;
        Ok((vec![y], ctx))
    }

    fn backward(&self, ctx: MlpCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        let dy = single_input("Mlp::backward", grad_outputs)?;
        Ok(vec![Some(self.backward_with(ctx, dy, BiasGrad::Compute, None, stream)?)])
    }

    /// The weight gradients its linears left for later, if split (`Linear::set_split_dw`).
    fn backward_dw(&self, stream: &Stream) -> Result<()> {
        self.fc2.backward_dw(stream)?;
        self.fc1.backward_dw(stream)
    }

    fn splits_dw(&self) -> bool {
        self.fc1.splits_dw() || self.fc2.splits_dw()
    }

    fn parameters(&self) -> Vec<&Param> {
        [self.fc1.parameters(), self.fc2.parameters()].concat()
    }

    fn pass_state(&self) -> Vec<Tensor> {
        [self.fc1.pass_state(), self.fc2.pass_state()].concat()
    }

    fn set_training(&mut self, _training: bool) {}
}
