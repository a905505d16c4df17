//! Causal multi-head self-attention, unfused as in the benchmark layer: a QKV projection, then
//! per batch element `scores = Q_h·K_hᵀ` batched over heads, a causal softmax with scale
//! 1/√head_dim over all of (B, H, T, T) in one launch, `att_h = probs·V_h`, and the output
//! projection. Heads are column blocks of the `(B·T, 3C)` QKV activation and of the `(B·T, C)`
//! attention output, passed to the GEMMs as strided views, so no head is ever copied.

use super::layernorm::single_input;
use super::{Linear, LinearCtx, Module, Param, ParamStore, SaveHook};
use crate::device::{Gemm, Stream};
use crate::memory::CachingAllocator;
use crate::ops::softmax;
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

/// What the forward saves: the projections' contexts (their inputs x and att), qkv and probs.
pub struct AttentionCtx {
    dims: Dims,
    qkv_ctx: LinearCtx,
    qkv: Tensor<f32>,
    probs: Tensor<f32>,
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
    /// Head-major `(H, T, hd)` view of batch element `b` in a `(B·T, parts·C)` activation, block
    /// `part` of `parts` (Q, K, V of the QKV activation; the only one of a `(B·T, C)` one).
    fn heads(&self, t: &Tensor<f32>, parts: usize, b: usize, part: usize) -> Result<Tensor<f32>> {
        t.reshape(&[self.batch, self.seq, parts, self.heads, self.hd])?
            .narrow(0, b, 1)?
            .narrow(2, part, 1)?
            .transpose(1, 3)
    }

    fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }
}

/// `c = op(a)·op(b)` for the `batch` matrices of `(m, n, k)` (`beta` 0).
fn batched(
    stream: &Stream,
    (c, a, b): (&Tensor<f32>, &Tensor<f32>, &Tensor<f32>),
    (m, n, k): (usize, usize, usize),
    batch: usize,
    (trans_a, trans_b): (bool, bool),
) -> Result<()> {
    stream.gemm(Gemm { batch, trans_a, trans_b, ..Gemm::new(c.view()?, a.view()?, b.view()?, (m, n, k)) })
}

impl CausalSelfAttention {
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

    fn dims(&self, op: &'static str, x: &Tensor<f32>) -> Result<Dims> {
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
    fn forward(
        &self,
        inputs: &[&Tensor<f32>],
        hook: &dyn SaveHook,
        stream: &Stream,
    ) -> Result<(Vec<Tensor<f32>>, AttentionCtx)> {
        const OP: &str = "CausalSelfAttention::forward";
        let x = single_input(OP, inputs)?;
        let d = self.dims(OP, x)?;
        let (bt, c) = (d.batch * d.seq, d.heads * d.hd);
        let (mut qkv, qkv_ctx) = self.qkv.forward(&[&x.reshape(&[bt, c])?], hook, stream)?;
        let qkv = qkv.remove(0);
        let tt = [d.batch, d.heads, d.seq, d.seq];
        let (scores, probs) = (Tensor::uninit(&self.alloc, stream, &tt)?, Tensor::uninit(&self.alloc, stream, &tt)?);
        for b in 0..d.batch {
            let (q, k) = (d.heads(&qkv, 3, b, 0)?, d.heads(&qkv, 3, b, 1)?);
            batched(stream, (&scores.narrow(0, b, 1)?, &q, &k), (d.seq, d.seq, d.hd), d.heads, (false, true))?;
        }
        softmax::softmax_causal_forward(&probs, &scores, d.scale(), stream)?;
        let att = Tensor::uninit(&self.alloc, stream, &[bt, c])?;
        for b in 0..d.batch {
            let (p, v) = (probs.narrow(0, b, 1)?, d.heads(&qkv, 3, b, 2)?);
            batched(stream, (&d.heads(&att, 1, b, 0)?, &p, &v), (d.seq, d.hd, d.seq), d.heads, (false, false))?;
        }
        hook.open_group(&self.name)?;
        let qkv = hook.save("qkv", qkv, stream)?;
        let probs = hook.save("probs", probs, stream)?;
        hook.commit_group(&self.name)?;
        let (mut y, proj_ctx) = self.proj.forward(&[&att], hook, stream)?;
        let y = y.remove(0).reshape(x.shape())?;
        Ok((vec![y], AttentionCtx { dims: d, qkv_ctx, qkv, probs, proj_ctx }))
    }

    fn backward(&self, ctx: AttentionCtx, grad_outputs: &[&Tensor<f32>], stream: &Stream) -> Result<Vec<Tensor<f32>>> {
        const OP: &str = "CausalSelfAttention::backward";
        let dy = single_input(OP, grad_outputs)?;
        let d = ctx.dims;
        let (bt, c) = (d.batch * d.seq, d.heads * d.hd);
        dy.expect_shape(OP, &[d.batch, d.seq, c])?;
        let datt = self.proj.backward(ctx.proj_ctx, &[&dy.reshape(&[bt, c])?], stream)?.remove(0);
        let (qkv, probs) = (&ctx.qkv, &ctx.probs);
        let tt = [d.batch, d.heads, d.seq, d.seq];
        let (dprobs, dscores) = (Tensor::uninit(&self.alloc, stream, &tt)?, Tensor::uninit(&self.alloc, stream, &tt)?);
        let dqkv = Tensor::uninit(&self.alloc, stream, &[bt, 3 * c])?;
        let (t, hd, h) = (d.seq, d.hd, d.heads);
        for b in 0..d.batch {
            let (da, v) = (d.heads(&datt, 1, b, 0)?, d.heads(qkv, 3, b, 2)?);
            batched(stream, (&dprobs.narrow(0, b, 1)?, &da, &v), (t, t, hd), h, (false, true))?;
            batched(stream, (&d.heads(&dqkv, 3, b, 2)?, &probs.narrow(0, b, 1)?, &da), (t, hd, t), h, (true, false))?;
        }
        softmax::softmax_causal_backward(&dscores, probs, &dprobs, d.scale(), stream)?;
        for b in 0..d.batch {
            let (ds, q, k) = (dscores.narrow(0, b, 1)?, d.heads(qkv, 3, b, 0)?, d.heads(qkv, 3, b, 1)?);
            batched(stream, (&d.heads(&dqkv, 3, b, 0)?, &ds, &k), (t, hd, t), h, (false, false))?;
            batched(stream, (&d.heads(&dqkv, 3, b, 1)?, &ds, &q), (t, hd, t), h, (true, false))?;
        }
        let dx = self.qkv.backward(ctx.qkv_ctx, &[&dqkv], stream)?.remove(0);
        Ok(vec![dx.reshape(&[d.batch, d.seq, c])?])
    }

    fn parameters(&self) -> Vec<&Param> {
        [self.qkv.parameters(), self.proj.parameters()].concat()
    }

    fn set_training(&mut self, _training: bool) {}
}
