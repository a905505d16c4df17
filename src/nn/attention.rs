//! Causal multi-head self-attention, unfused as in the benchmark layer: a QKV projection; the
//! heads of Q, K and V permuted from column blocks of the `(B·T, 3C)` activation into
//! `(B, H, T, hd)` (`ops::heads`), so that one strided-batched GEMM covers every (batch element,
//! head) pair; `scores = Q·Kᵀ/√head_dim` (the scale is the GEMM's alpha), a causal softmax, `att = probs·V`, permuted
//! back into `(B·T, C)`; and the output projection. A call costs a fixed number of launches,
//! whatever the batch.

use super::layernorm::single_input;
use super::{input_grad, Inputs, Linear, LinearCtx, Module, Param, ParamStore, SaveHook};
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

/// What the forward saves: the projections' contexts (their inputs x and att), the heads of
/// q, k and v, and the attention probabilities.
pub struct AttentionCtx {
    dims: Dims,
    qkv_ctx: LinearCtx,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    proj_ctx: LinearCtx,
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
    batch: usize,
    (trans_a, trans_b): (bool, bool),
    alpha: f32,
) -> Result<()> {
    matmul(Matmul { batch, trans_a, trans_b, alpha, ..Matmul::new(c, a, b, (m, n, k)) }, stream)
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

impl Module for CausalSelfAttention {
    type Ctx = AttentionCtx;

    /// One contiguous input `(B, T, C)`, one output `(B, T, C)`.
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, AttentionCtx)> {
        const OP: &str = "CausalSelfAttention::forward";
        let x = inputs.only(OP)?;
        let d = self.dims(OP, x)?;
        let (bt, c) = (d.batch * d.seq, d.heads * d.hd);
        let (mut qkv, qkv_ctx) = self.qkv.forward(&Inputs::one(&x.reshape(&[bt, c])?), hook, stream)?;
        let qkv = qkv.remove(0);
        let heads = |part| -> Result<Tensor> {
            let t = Tensor::uninit(&self.alloc, stream, &d.head_shape(), x.dtype())?;
            heads::heads_from_rows(&t, &qkv, part, stream)?;
            Ok(t)
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let tt = [d.batch, d.heads, d.seq, d.seq];
        let (scores, probs) = (
            Tensor::uninit(&self.alloc, stream, &tt, x.dtype())?,
            Tensor::uninit(&self.alloc, stream, &tt, x.dtype())?,
        );
        batched(stream, (&scores, &q, &k), (d.seq, d.seq, d.hd), d.pairs(), (false, true), d.scale())?;
        softmax::softmax_causal_forward(&probs, &scores, stream)?;
        let att_heads = Tensor::uninit(&self.alloc, stream, &d.head_shape(), x.dtype())?;
        batched(stream, (&att_heads, &probs, &v), (d.seq, d.hd, d.seq), d.pairs(), (false, false), 1.0)?;
        let att = Tensor::uninit(&self.alloc, stream, &[bt, c], x.dtype())?;
        heads::rows_from_heads(&att, 0, &att_heads, stream)?;
        hook.open_group(&self.name)?;
        let (q, k, v) = (hook.save("q", q, stream)?, hook.save("k", k, stream)?, hook.save("v", v, stream)?);
        let probs = hook.save("probs", probs, stream)?;
        hook.commit_group(&self.name)?;
        let (mut y, proj_ctx) = self.proj.forward(&Inputs::one(&att), hook, stream)?;
        let y = y.remove(0).reshape(x.shape())?;
        Ok((vec![y], AttentionCtx { dims: d, qkv_ctx, q, k, v, probs, proj_ctx }))
    }

    fn backward(&self, ctx: AttentionCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        const OP: &str = "CausalSelfAttention::backward";
        let dy = single_input(OP, grad_outputs)?;
        let d = ctx.dims;
        let (bt, c) = (d.batch * d.seq, d.heads * d.hd);
        dy.expect_shape(OP, &[d.batch, d.seq, c])?;
        let datt = input_grad(OP, self.proj.backward(ctx.proj_ctx, &[&dy.reshape(&[bt, c])?], stream)?)?;
        let (q, k, v, probs) = (&ctx.q, &ctx.k, &ctx.v, &ctx.probs);
        let heads = || Tensor::uninit(&self.alloc, stream, &d.head_shape(), dy.dtype());
        let datt_heads = heads()?;
        heads::heads_from_rows(&datt_heads, &datt, 0, stream)?;
        let tt = [d.batch, d.heads, d.seq, d.seq];
        let (dprobs, dscores) = (
            Tensor::uninit(&self.alloc, stream, &tt, dy.dtype())?,
            Tensor::uninit(&self.alloc, stream, &tt, dy.dtype())?,
        );
        let (t, hd, pairs) = (d.seq, d.hd, d.pairs());
        let (dq, dk, dv) = (heads()?, heads()?, heads()?);
        batched(stream, (&dprobs, &datt_heads, v), (t, t, hd), pairs, (false, true), 1.0)?;
        batched(stream, (&dv, probs, &datt_heads), (t, hd, t), pairs, (true, false), 1.0)?;
        softmax::softmax_causal_backward(&dscores, probs, &dprobs, stream)?;
        // scores = scale·q·kᵀ, so the scale is the alpha of both gradients' GEMMs too.
        batched(stream, (&dq, &dscores, k), (t, hd, t), pairs, (false, false), d.scale())?;
        batched(stream, (&dk, &dscores, q), (t, hd, t), pairs, (true, false), d.scale())?;
        let dqkv = Tensor::uninit(&self.alloc, stream, &[bt, 3 * c], dy.dtype())?;
        for (part, g) in [&dq, &dk, &dv].into_iter().enumerate() {
            heads::rows_from_heads(&dqkv, part, g, stream)?;
        }
        let dx = input_grad(OP, self.qkv.backward(ctx.qkv_ctx, &[&dqkv], stream)?)?;
        Ok(vec![Some(dx.reshape(&[d.batch, d.seq, c])?)])
    }

    fn parameters(&self) -> Vec<&Param> {
        [self.qkv.parameters(), self.proj.parameters()].concat()
    }

    fn set_training(&mut self, _training: bool) {}
}
