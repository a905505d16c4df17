//! Causal multi-head self-attention, unfused as in the benchmark layer: a QKV projection; the
//! heads of Q, K and V permuted from column blocks of the `(B·T, 3C)` activation into
//! `(B, H, T, hd)` in one launch (`ops::heads::split_qkv`), so that one strided-batched GEMM covers every (batch element,
//! head) pair; `scores = Q·Kᵀ`, a causal softmax with scale 1/√head_dim, `att = probs·V`, permuted
//! back into `(B·T, C)`; and the output projection, which can add a residual in its GEMM. The
//! 1/√head_dim scale rides in the score GEMM's alpha (and the gradient GEMMs'), so the softmax
//! only masks and normalizes. A call costs a fixed number of launches, whatever the batch.

use super::layernorm::single_input;
use super::{BiasGrad, Inputs, Linear, Module, Param, ParamStore, SaveHook, SavedTensor};
use crate::device::Stream;
use crate::memory::CachingAllocator;
use crate::ops::matmul::{matmul, Matmul};
use crate::ops::{heads, softmax};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Causal self-attention over `(B, T, C)` inputs with `heads` heads of `C / heads` features.
pub struct CausalSelfAttention {
    name: String,
    alloc: CachingAllocator,
    /// `C → 3C`: queries, keys, values, each with head `h` in columns `h·hd..(h+1)·hd`.
    pub qkv: Linear,
    /// `C → C`, the output projection.
    pub proj: Linear,
    heads: usize,
}

/// What the forward saves: the projections' inputs (x and att), the heads of q, k and v, and
/// the attention probabilities.
pub struct AttentionCtx {
    dims: Dims,
    x: SavedTensor,
    q: SavedTensor,
    k: SavedTensor,
    v: SavedTensor,
    probs: SavedTensor,
    att: SavedTensor,
}

/// Batch, sequence, heads and head width of one call.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    seq: usize,
    heads: usize,
    hd: usize,
}

impl Dims {
    /// `(B, H, T, hd)`, the layout of the heads.
    fn head_shape(&self) -> [usize; 4] {
        [self.batch, self.heads, self.seq, self.hd]
    }

    /// Every (batch element, head) pair: the batch of the attention GEMMs.
    fn pairs(&self) -> usize {
        self.batch * self.heads
    }

    fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }
}

/// `c = alpha·op(a)·op(b)` for the `batch` matrices of `(m, n, k)` (`beta` 0).
fn batched(
    stream: &Stream,
    (c, a, b): (&Tensor, &Tensor, &Tensor),
    (m, n, k): (usize, usize, usize),
    (batch, alpha): (usize, f32),
    (trans_a, trans_b): (bool, bool),
) -> Result<()> {
    matmul(Matmul { batch, alpha, trans_a, trans_b, ..Matmul::new(c, a, b, (m, n, k)) }, stream)
}

impl CausalSelfAttention {
    /// The parameters attention on `dim` features adds to its store (QKV and output projection).
    pub fn parameter_count(dim: usize) -> usize {
        Linear::parameter_count((dim, 3 * dim)) + Linear::parameter_count((dim, dim))
    }

    /// Attention on `dim` features in `heads` heads (`dim` a multiple of `heads`): `{name}.qkv`
    /// initialized from `seed`, `{name}.proj` from `seed + 1`.
    ///
    /// # Errors
    /// [`Error::Shape`] unless `heads` divides `dim` (both nonzero).
    pub fn new(
        store: &mut ParamStore,
        alloc: &CachingAllocator,
        name: &str,
        (dim, heads): (usize, usize),
        seed: u64,
        stream: &Stream,
    ) -> Result<CausalSelfAttention> {
        if heads == 0 || dim == 0 || dim % heads != 0 {
            return Err(Error::Shape {
                op: "CausalSelfAttention::new",
                expected: "a nonzero width divisible by the number of heads".into(),
                found: vec![dim, heads],
            });
        }
        let qkv = Linear::new(store, alloc, &format!("{name}.qkv"), (dim, 3 * dim), seed, stream)?;
        let proj = Linear::new(store, alloc, &format!("{name}.proj"), (dim, dim), seed.wrapping_add(1), stream)?;
        Ok(CausalSelfAttention { name: name.to_string(), alloc: alloc.clone(), qkv, proj, heads })
    }

    fn dims(&self, op: &'static str, x: &Tensor) -> Result<Dims> {
        let c = self.proj.weight.value.shape()[0];
        match *x.shape() {
            [batch, seq, width] if width == c => Ok(Dims { batch, seq, heads: self.heads, hd: c / self.heads }),
            _ => Err(Error::Shape { op, expected: format!("(B, T, {c})"), found: x.shape().to_vec() }),
        }
    }
}

impl CausalSelfAttention {
    /// `residual + Attn(x)` (just `Attn(x)` without a residual; the add in the output
    /// projection's GEMM) over a contiguous `(B, T, C)` input.
    pub fn forward_residual(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        hook: &dyn SaveHook,
        stream: &Stream,
    ) -> Result<(Tensor, AttentionCtx)> {
        const OP: &str = "CausalSelfAttention::forward";
        let d = self.dims(OP, x)?;
        let (bt, c, dtype) = (d.batch * d.seq, d.heads * d.hd, x.dtype());
        if let Some(r) = residual {
            r.expect_shape(OP, x.shape())?;
        }
        let rows = x.reshape(&[bt, c])?;
        let qkv = self.qkv.forward_with(&rows, None, stream)?;
        let head = || Tensor::uninit(&self.alloc, stream, &d.head_shape(), dtype);
        let (q, k, v) = (head()?, head()?, head()?);
        heads::split_qkv(&q, &k, &v, &qkv, stream)?;
        let tt = [d.batch, d.heads, d.seq, d.seq];
        let (scores, probs) =
            (Tensor::uninit(&self.alloc, stream, &tt, dtype)?, Tensor::uninit(&self.alloc, stream, &tt, dtype)?);
        batched(stream, (&scores, &q, &k), (d.seq, d.seq, d.hd), (d.pairs(), d.scale()), (false, true))?;
        softmax::softmax_causal_forward(&probs, &scores, stream)?;
        let att_heads = Tensor::uninit(&self.alloc, stream, &d.head_shape(), dtype)?;
        batched(stream, (&att_heads, &probs, &v), (d.seq, d.hd, d.seq), (d.pairs(), 1.0), (false, false))?;
        let att = Tensor::uninit(&self.alloc, stream, &[bt, c], dtype)?;
        heads::rows_from_heads(&att, 0, &att_heads, stream)?;
        let residual = residual.map(|r| r.reshape(&[bt, c])).transpose()?;
        let y = self.proj.forward_with(&att, residual.as_ref(), stream)?;
        hook.open_group(&self.name)?;
        let x = hook.save("input", rows, stream)?;
        let (q, k, v) = (hook.save("q", q, stream)?, hook.save("k", k, stream)?, hook.save("v", v, stream)?);
        let probs = hook.save("probs", probs, stream)?;
        let att = hook.save("att", att, stream)?;
        hook.commit_group(&self.name, stream)?;
        Ok((y.reshape(&[d.batch, d.seq, c])?, AttentionCtx { dims: d, x, q, k, v, probs, att }))
    }

    /// The input gradient from the output gradient `dy`; parameter gradients `+=`, the output
    /// projection's bias gradient as `proj_bias` says.
    pub fn backward_with(
        &self,
        ctx: AttentionCtx,
        dy: &Tensor,
        proj_bias: BiasGrad,
        stream: &Stream,
    ) -> Result<Tensor> {
        const OP: &str = "CausalSelfAttention::backward";
        let d = ctx.dims;
        let (bt, c, dtype) = (d.batch * d.seq, d.heads * d.hd, dy.dtype());
        dy.expect_shape(OP, &[d.batch, d.seq, c])?;
        let dy = dy.reshape(&[bt, c])?;
        let datt = self.proj.data_grad(&dy, stream)?;
        self.proj.weight_grads(&dy, &ctx.att.take(stream)?, proj_bias, stream)?;
        let (q, k, v, probs) =
            (&ctx.q.take(stream)?, &ctx.k.take(stream)?, &ctx.v.take(stream)?, &ctx.probs.take(stream)?);
        let heads = || Tensor::uninit(&self.alloc, stream, &d.head_shape(), dtype);
        let datt_heads = heads()?;
        heads::heads_from_rows(&datt_heads, &datt, 0, stream)?;
        let tt = [d.batch, d.heads, d.seq, d.seq];
        let (dprobs, dscores) =
            (Tensor::uninit(&self.alloc, stream, &tt, dtype)?, Tensor::uninit(&self.alloc, stream, &tt, dtype)?);
        let (t, hd, pairs, scale) = (d.seq, d.hd, d.pairs(), d.scale());
        let (dq, dk, dv) = (heads()?, heads()?, heads()?);
        batched(stream, (&dprobs, &datt_heads, v), (t, t, hd), (pairs, 1.0), (false, true))?;
        batched(stream, (&dv, probs, &datt_heads), (t, hd, t), (pairs, 1.0), (true, false))?;
        softmax::softmax_causal_backward(&dscores, probs, &dprobs, stream)?;
        batched(stream, (&dq, &dscores, k), (t, hd, t), (pairs, scale), (false, false))?;
        batched(stream, (&dk, &dscores, q), (t, hd, t), (pairs, scale), (true, false))?;
        let dqkv = Tensor::uninit(&self.alloc, stream, &[bt, 3 * c], dtype)?;
        heads::merge_qkv(&dqkv, &dq, &dk, &dv, stream)?;
        let dx = self.qkv.data_grad(&dqkv, stream)?;
        self.qkv.weight_grads(&dqkv, &ctx.x.take(stream)?, BiasGrad::Compute, stream)?;
        dx.reshape(&[d.batch, d.seq, c])
    }
}

impl Module for CausalSelfAttention {
    type Ctx = AttentionCtx;

    /// One contiguous input `(B, T, C)`, one output `(B, T, C)`.
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, AttentionCtx)> {
        let x = inputs.only("CausalSelfAttention::forward")?;
        let (y, ctx) = self.forward_residual(x, None, hook, stream)?;
        Ok((vec![y], ctx))
    }

    fn backward(&self, ctx: AttentionCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        let dy = single_input("CausalSelfAttention::backward", grad_outputs)?;
        Ok(vec![Some(self.backward_with(ctx, dy, BiasGrad::Compute, stream)?)])
    }

    /// The weight gradients its projections left for later, if split (`Linear::set_split_dw`).
    fn backward_dw(&self, stream: &Stream) -> Result<()> {
        self.proj.backward_dw(stream)?;
        self.qkv.backward_dw(stream)
    }

    fn splits_dw(&self) -> bool {
        self.qkv.splits_dw() || self.proj.splits_dw()
    }

    fn parameters(&self) -> Vec<&Param> {
        [self.qkv.parameters(), self.proj.parameters()].concat()
    }

    fn set_training(&mut self, _training: bool) {}
}
