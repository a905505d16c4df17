//! LayerNorm over the last dimension (LN1 and LN2 of the benchmark layer), a module around
//! [`ops::layernorm`](crate::ops::layernorm): weight 1, bias 0, eps 1e-5 as PyTorch's default.

use super::{Builder, Inputs, Module, Param, SaveHook, SavedTensor};
use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::ops::layernorm::{self, LayerNormWorkspace, ResidualGrad};
use crate::tensor::Tensor;
use crate::{Error, Result};

const EPS: f32 = 1e-5;

/// LayerNorm of `(.., C)` inputs; any leading dimensions are treated as rows.
pub struct LayerNorm {
    name: String,
    alloc: CachingAllocator,
    /// `(C)`, the scale.
    pub weight: Param,
    /// `(C)`, the shift.
    pub bias: Param,
    /// The backward's column-sum scratch, allocated once.
    workspace: LayerNormWorkspace,
}

/// What the forward saves: the input as rows and each row's statistics.
pub struct LayerNormCtx {
    shape: Vec<usize>,
    input: SavedTensor,
    mean: SavedTensor,
    rstd: SavedTensor,
}

/// The one input of a single-input module, or a shape error naming `op`.
pub(super) fn single_input<'a>(op: &'static str, inputs: &[&'a Tensor]) -> Result<&'a Tensor> {
    match inputs {
        [x] => Ok(x),
        _ => Err(Error::Shape { op, expected: "exactly one tensor".into(), found: vec![inputs.len()] }),
    }
}

/// `t` as `(N, c)` rows (contiguous tensors only), or a shape error naming `op`.
pub(super) fn as_rows(op: &'static str, t: &Tensor, c: usize) -> Result<Tensor> {
    match t.shape().last() {
        Some(&last) if last == c => t.reshape(&[t.numel() / c.max(1), c]),
        _ => Err(Error::Shape { op, expected: format!("(.., {c})"), found: t.shape().to_vec() }),
    }
}

impl LayerNorm {
    /// The parameters a LayerNorm over `dim` features adds to its store.
    pub fn parameter_count(dim: usize) -> usize {
        2 * dim
    }

    /// A LayerNorm over `dim` features, parameters `{prefix}.weight` and `{prefix}.bias` of `vb`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the store is full.
    pub fn new(vb: &Builder, dim: usize) -> Result<LayerNorm> {
        let weight = vb.add("weight", &[dim], &vec![1.0; dim])?;
        let bias = vb.add("bias", &[dim], &vec![0.0; dim])?;
        let workspace = LayerNormWorkspace::new(vb.alloc(), vb.stream(), dim)?;
        Ok(LayerNorm { name: vb.prefix().to_string(), alloc: vb.alloc().clone(), weight, bias, workspace })
    }

    fn dim(&self) -> usize {
        self.weight.value.numel()
    }

    /// The forward's output again, `(N, C)` rows, from the input `ctx` saved (brought back once
    /// if it was away, and kept for the backward): the same kernel on the same bits, so the same
    /// bits (for a caller that did not keep the output, `nn::Recompute::norms`).
    ///
    /// # Errors
    /// The save hook's, for an input that was away; the allocation's.
    pub fn recompute(&self, ctx: &mut LayerNormCtx, stream: &Stream) -> Result<Tensor> {
        let rows = ctx.input.peek(stream)?;
        let n = rows.shape()[0];
        let out = Tensor::uninit(&self.alloc, stream, rows.shape(), rows.dtype())?;
        let stats = || Tensor::uninit(&self.alloc, stream, &[n], DType::F32);
        let (mean, rstd) = (stats()?, stats()?);
        layernorm::layernorm_forward(&out, &mean, &rstd, &rows, &self.weight.value, &self.bias.value, EPS, stream)?;
        Ok(out)
    }

    /// The input gradient from the output gradient `dy`, plus `residual.grad` when given (the
    /// gradient that reaches the same input around the layer, added in the same kernel), whose
    /// column sums it also adds to `residual.colsum` when given; parameter gradients `+=`.
    pub fn backward_with(
        &self,
        ctx: LayerNormCtx,
        dy: &Tensor,
        residual: Option<ResidualGrad<'_>>,
        stream: &Stream,
    ) -> Result<Tensor> {
        const OP: &str = "LayerNorm::backward";
        dy.expect_shape(OP, &ctx.shape)?;
        let dy = as_rows(OP, dy, self.dim())?;
        let residual_rows = match &residual {
            Some(r) => {
                r.grad.expect_shape(OP, &ctx.shape)?;
                Some(as_rows(OP, r.grad, self.dim())?)
            }
            None => None,
        };
        let residual = residual.zip(residual_rows.as_ref()).map(|(r, grad)| ResidualGrad { grad, colsum: r.colsum });
        let dx = Tensor::uninit(&self.alloc, stream, dy.shape(), dy.dtype())?;
        let (w, b) = (&self.weight, &self.bias);
        let (input, mean, rstd) = (&ctx.input.take(stream)?, &ctx.mean.take(stream)?, &ctx.rstd.take(stream)?);
        layernorm::layernorm_backward(
            &dx,
            &w.grad,
            &b.grad,
            &dy,
            input,
            &w.value,
            mean,
            rstd,
            residual,
            &self.workspace,
            stream,
        )?;
        dx.reshape(&ctx.shape)
    }
}

impl Module for LayerNorm {
    type Ctx = LayerNormCtx;

    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, LayerNormCtx)> {
        const OP: &str = "LayerNorm::forward";
        let x = inputs.only(OP)?;
        let rows = as_rows(OP, x, self.dim())?;
        let n = rows.shape()[0];
        let out = Tensor::uninit(&self.alloc, stream, rows.shape(), rows.dtype())?;
        let (mean, rstd) = (
            Tensor::uninit(&self.alloc, stream, &[n], DType::F32)?,
            Tensor::uninit(&self.alloc, stream, &[n], DType::F32)?,
        );
        layernorm::layernorm_forward(&out, &mean, &rstd, &rows, &self.weight.value, &self.bias.value, EPS, stream)?;
        hook.open_group(&self.name)?;
        let input = hook.save("input", rows, stream)?;
        let mean = hook.save("mean", mean, stream)?;
        let rstd = hook.save("rstd", rstd, stream)?;
        hook.commit_group(&self.name, stream)?;
        Ok((vec![out.reshape(x.shape())?], LayerNormCtx { shape: x.shape().to_vec(), input, mean, rstd }))
    }

    fn backward(&self, ctx: LayerNormCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        let dy = single_input("LayerNorm::backward", grad_outputs)?;
        Ok(vec![Some(self.backward_with(ctx, dy, None, stream)?)])
    }

    fn parameters(&self) -> Vec<&Param> {
        vec![&self.weight, &self.bias]
    }

    fn set_training(&mut self, _training: bool) {}
}
