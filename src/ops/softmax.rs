//! Causal masked softmax over attention scores (B, H, T, T), f32: the middle step of the benchmark
//! layer's unfused attention (GEMM, masked softmax, GEMM, with scale 1/8 for head dim 64). The CPU
//! path of each kernel sits beside its CUDA entry point in `softmax.cu`.
//!
//! Query `i` sees keys `j ≤ i`; the probabilities above the diagonal are written as exactly 0 and
//! the scores there are never read, so they need not be initialized. The row maximum is subtracted
//! before `exp`, so large scores do not overflow.
//!
//! Gradient convention (llm.c `layernorm.cuh`): activation gradients are written (`dscores =`);
//! this op has no parameters. Tensors must be contiguous; outputs must not alias inputs.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::softmax;
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let scores = Tensor::from_host(&alloc, &s, &[5.0f32, 9.0, 2.0, 2.0], &[1, 1, 2, 2])?;
//! let probs = Tensor::uninit(&alloc, &s, &[1, 1, 2, 2], graphed::device::DType::F32)?;
//! softmax::softmax_causal_forward(&probs, &scores, 0.125, &s)?;
//! assert_eq!(probs.to_vec::<f32>(&s)?, vec![1.0, 0.0, 0.5, 0.5]);
//! # Ok::<(), graphed::Error>(())
//! ```

use super::{checked, count, row_blocks};
use crate::device::{args, CpuArgs, In, Kernel, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("reduce.cu"), include_str!("softmax.cu"));

/// `probs = softmax(scale·scores)` over the visible keys of each row (one block per row on CUDA).
pub static SOFTMAX_CAUSAL_FORWARD: Kernel = Kernel {
    name: "softmax_causal_forward_f32",
    source: SOURCE,
    params: &["probs", "scores", "scale", "rows", "T"],
    cpu: forward_cpu,
    strided: false,
};

fn forward_cpu(a: &CpuArgs) -> Result<()> {
    let (scores, scale, t) = (a.input::<f32>("scores")?, a.f32("scale")?, a.u32("T")? as usize);
    let mut probs = a.output::<f32>("probs")?;
    for (row, (p, x)) in probs.chunks_exact_mut(t).zip(scores.chunks_exact(t)).enumerate() {
        let (visible, masked) = p.split_at_mut(row % t + 1);
        let x = &x[..visible.len()];
        let m = x.iter().map(|v| scale * v).fold(f32::NEG_INFINITY, |m, z| if z > m { z } else { m });
        let sum = x.iter().map(|v| (scale * v - m).exp()).sum::<f32>();
        visible.iter_mut().zip(x).for_each(|(p, v)| *p = (scale * v - m).exp() / sum);
        masked.fill(0.0);
    }
    Ok(())
}

/// Writes `probs[b, h, i, j] = softmax_j(scale·scores[b, h, i, j])` over `j ≤ i`, and exactly 0
/// for `j > i`.
///
/// # Errors
/// [`Error::Shape`] unless `scores` is (B, H, T, T) with T > 0 and `probs` has its shape;
/// [`Error::NotContiguous`] for a strided tensor.
pub fn softmax_causal_forward(probs: &Tensor, scores: &Tensor, scale: f32, stream: &Stream) -> Result<()> {
    const OP: &str = "softmax_causal_forward";
    let (rows, t) = rows_of(OP, scores)?;
    let shape = scores.shape();
    let args = args![
        Out(checked::<f32>(OP, "probs", probs, shape)?),
        In(checked::<f32>(OP, "scores", scores, shape)?),
        scale,
        count(OP, rows)?,
        count(OP, t)?,
    ];
    stream.launch(&SOFTMAX_CAUSAL_FORWARD, row_blocks(OP, rows)?, &args)
}

/// `dscores = scale·probs ⊙ (dprobs − Σ dprobs ⊙ probs)` over the visible keys of each row (one
/// block per row on CUDA).
pub static SOFTMAX_CAUSAL_BACKWARD: Kernel = Kernel {
    name: "softmax_causal_backward_f32",
    source: SOURCE,
    params: &["dscores", "probs", "dprobs", "scale", "rows", "T"],
    cpu: backward_cpu,
    strided: false,
};

fn backward_cpu(a: &CpuArgs) -> Result<()> {
    let (probs, dprobs) = (a.input::<f32>("probs")?, a.input::<f32>("dprobs")?);
    let (scale, t) = (a.f32("scale")?, a.u32("T")? as usize);
    let mut dscores = a.output::<f32>("dscores")?;
    let rows = dscores.chunks_exact_mut(t).zip(probs.chunks_exact(t)).zip(dprobs.chunks_exact(t));
    for (row, ((ds, p), dp)) in rows.enumerate() {
        let (visible, masked) = ds.split_at_mut(row % t + 1);
        let (p, dp) = (&p[..visible.len()], &dp[..visible.len()]);
        let dot = dp.iter().zip(p).map(|(dp, p)| dp * p).sum::<f32>();
        visible.iter_mut().zip(p.iter().zip(dp)).for_each(|(ds, (p, dp))| *ds = scale * (p * (dp - dot)));
        masked.fill(0.0);
    }
    Ok(())
}

/// Writes `dscores = scale·probs ⊙ (dprobs − Σ_j dprobs ⊙ probs)` per row over `j ≤ i`, and
/// exactly 0 for `j > i`, from the `probs` of [`softmax_causal_forward`] with the same `scale`.
///
/// # Errors
/// [`Error::Shape`] unless `probs` is (B, H, T, T) with T > 0 and `dscores` and `dprobs` have its
/// shape; [`Error::NotContiguous`] for a strided tensor.
pub fn softmax_causal_backward(
    dscores: &Tensor,
    probs: &Tensor,
    dprobs: &Tensor,
    scale: f32,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "softmax_causal_backward";
    let (rows, t) = rows_of(OP, probs)?;
    let shape = probs.shape();
    let args = args![
        Out(checked::<f32>(OP, "dscores", dscores, shape)?),
        In(checked::<f32>(OP, "probs", probs, shape)?),
        In(checked::<f32>(OP, "dprobs", dprobs, shape)?),
        scale,
        count(OP, rows)?,
        count(OP, t)?,
    ];
    stream.launch(&SOFTMAX_CAUSAL_BACKWARD, row_blocks(OP, rows)?, &args)
}

/// The number of rows (B·H·T) and T of attention scores (B, H, T, T); T = 0 has no visible key.
fn rows_of(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match *t.shape() {
        [b, h, q, k] if q == k && k > 0 => Ok((b * h * q, k)),
        _ => Err(Error::Shape {
            op,
            expected: "attention scores (B, H, T, T) with T > 0".into(),
            found: t.shape().to_vec(),
        }),
    }
}
