//! Causal softmax over attention scores `(.., T, T)` of f32 or bf16 with f32 math: the middle
//! step of the benchmark layer's unfused attention (GEMM, masked softmax, GEMM). The scale
//! 1/√head_dim is the score GEMM's `alpha`, so it is not applied here. One kernel per direction and
//! element type, the CPU path of each beside its CUDA entry point in `softmax.cu`.
//!
//! Query `i` sees keys `j ≤ i`: both directions read only the lower triangle (the upper one need
//! not be initialized, and NaN there changes nothing) and write every element, exactly 0 above
//! the diagonal, since the next GEMM reads whole rows. The row maximum is subtracted before
//! `exp`, so large scores do not overflow. Every value is widened to f32 once and rounded to its
//! type once, on both devices.
//!
//! Gradient convention (llm.c `layernorm.cuh`): activation gradients are written (`dscores =`);
//! this op has no parameters. Tensors must be contiguous; outputs must not alias inputs; T is at
//! most [`MAX_SEQ`].
//!
//! ```
//! use graphed::device::{DType, Device};
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::softmax;
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let scores = Tensor::from_host(&alloc, &s, &[5.0f32, f32::NAN, 2.0, 2.0], &[1, 2, 2])?;
//! let probs = Tensor::uninit(&alloc, &s, &[1, 2, 2], DType::F32)?;
//! softmax::softmax_causal_forward(&probs, &scores, &s)?;
//! assert_eq!(probs.to_vec::<f32>(&s)?, vec![1.0, 0.0, 0.5, 0.5]);
//! # Ok::<(), graphed::Error>(())
//! ```

use half::bf16;

use super::{checked, count, grid, row_group, unsupported_dtype};
use crate::device::{args, CpuArgs, DType, Float, In, Kernel, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("rows.cu"), include_str!("softmax.cu"));

/// The longest sequence (T): each thread keeps its part of a row in registers (a row group of
/// up to 512 threads, 16 values each).
pub const MAX_SEQ: usize = 8192;

/// Values of a row per thread (`SM_VALS` in `softmax.cu`), and the fewest threads per block.
const VALS: usize = 16;
const MIN_BLOCK: usize = 256;

const FORWARD_PARAMS: &[&str] = &["probs", "scores", "rows", "T", "G"];

/// `probs = softmax(scores)` over the visible keys of each row of f32 (a row group per row on
/// CUDA).
pub static SOFTMAX_CAUSAL_FORWARD_F32: Kernel = Kernel {
    name: "softmax_causal_forward_f32",
    source: SOURCE,
    params: FORWARD_PARAMS,
    cpu: forward_cpu::<f32>,
    strided: false,
};

/// [`SOFTMAX_CAUSAL_FORWARD_F32`] for bf16.
pub static SOFTMAX_CAUSAL_FORWARD_BF16: Kernel = Kernel {
    name: "softmax_causal_forward_bf16",
    source: SOURCE,
    params: FORWARD_PARAMS,
    cpu: forward_cpu::<bf16>,
    strided: false,
};

fn forward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (scores, t) = (a.input::<T>("scores")?, a.u32("T")? as usize);
    let mut probs = a.output::<T>("probs")?;
    for (row, (p, x)) in probs.chunks_exact_mut(t).zip(scores.chunks_exact(t)).enumerate() {
        let (visible, masked) = p.split_at_mut(row % t + 1);
        let z: Vec<f32> = x[..visible.len()].iter().map(|v| v.to_f32()).collect();
        let m = z.iter().fold(f32::NEG_INFINITY, |m, &z| m.max(z));
        let e: Vec<f32> = z.iter().map(|z| (z - m).exp()).collect();
        let sum = e.iter().sum::<f32>();
        visible.iter_mut().zip(e).for_each(|(p, e)| *p = T::from_f32(e / sum));
        masked.fill(T::from_f32(0.0));
    }
    Ok(())
}

/// Writes `probs[.., i, j] = softmax_j(scores[.., i, j])` over `j ≤ i`, and exactly 0 for
/// `j > i`, for scores `(.., T, T)` (any leading dimensions, such as `(B·H, T, T)` or
/// `(B, H, T, T)`); `probs` and `scores` both f32 or both bf16.
///
/// On CUDA a row group of 32 to 512 threads (T/16 rounded up to a power of two) holds each row's
/// visible scores in registers, 16 values a thread, in 16-byte accesses where T allows (a multiple
/// of 8 for bf16, of 4 for f32, else one element at a time); blocks of at least 256 threads, so
/// several rows per block for T ≤ 2048.
///
/// # Errors
/// Before anything is enqueued: [`Error::UnsupportedDType`] unless `scores` is f32 or bf16;
/// [`Error::DTypeMismatch`] unless `probs` has its type; [`Error::Shape`] unless `scores` is
/// `(.., T, T)` with 0 < T ≤ [`MAX_SEQ`] ([`Error::Unsupported`] above it) and `probs` has its
/// shape; [`Error::NotContiguous`] for a strided tensor.
pub fn softmax_causal_forward(probs: &Tensor, scores: &Tensor, stream: &Stream) -> Result<()> {
    match scores.dtype() {
        DType::F32 => forward::<f32>(&SOFTMAX_CAUSAL_FORWARD_F32, probs, scores, stream),
        DType::BF16 => forward::<bf16>(&SOFTMAX_CAUSAL_FORWARD_BF16, probs, scores, stream),
        dtype => Err(unsupported_dtype(FORWARD, dtype)),
    }
}

const FORWARD: &str = "softmax_causal_forward";

fn forward<T: Float>(kernel: &'static Kernel, probs: &Tensor, scores: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = FORWARD;
    let (rows, t) = rows_of(OP, scores)?;
    let shape = scores.shape();
    let (g, dims) = launch_shape(OP, rows, t)?;
    let args = args![
        Out(checked::<T>(OP, "probs", probs, shape)?),
        In(checked::<T>(OP, "scores", scores, shape)?),
        count(OP, rows)?,
        count(OP, t)?,
        g,
    ];
    stream.launch(kernel, dims, &args)
}

const BACKWARD_PARAMS: &[&str] = &["dscores", "probs", "dprobs", "rows", "T", "G"];

/// `dscores = probs ⊙ (dprobs − Σ probs ⊙ dprobs)` over the visible keys of each row of f32 (a
/// row group per row on CUDA).
pub static SOFTMAX_CAUSAL_BACKWARD_F32: Kernel = Kernel {
    name: "softmax_causal_backward_f32",
    source: SOURCE,
    params: BACKWARD_PARAMS,
    cpu: backward_cpu::<f32>,
    strided: false,
};

/// [`SOFTMAX_CAUSAL_BACKWARD_F32`] for bf16.
pub static SOFTMAX_CAUSAL_BACKWARD_BF16: Kernel = Kernel {
    name: "softmax_causal_backward_bf16",
    source: SOURCE,
    params: BACKWARD_PARAMS,
    cpu: backward_cpu::<bf16>,
    strided: false,
};

fn backward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (probs, dprobs, t) = (a.input::<T>("probs")?, a.input::<T>("dprobs")?, a.u32("T")? as usize);
    let mut dscores = a.output::<T>("dscores")?;
    let rows = dscores.chunks_exact_mut(t).zip(probs.chunks_exact(t)).zip(dprobs.chunks_exact(t));
    for (row, ((ds, p), dp)) in rows.enumerate() {
        let (visible, masked) = ds.split_at_mut(row % t + 1);
        let (p, dp) = (&p[..visible.len()], &dp[..visible.len()]);
        let dot = p.iter().zip(dp).map(|(p, dp)| p.to_f32() * dp.to_f32()).sum::<f32>();
        for (ds, (p, dp)) in visible.iter_mut().zip(p.iter().zip(dp)) {
            *ds = T::from_f32(p.to_f32() * (dp.to_f32() - dot));
        }
        masked.fill(T::from_f32(0.0));
    }
    Ok(())
}

/// Writes `dscores = probs ⊙ (dprobs − Σ_j probs ⊙ dprobs)` per row over `j ≤ i`, and exactly 0
/// for `j > i`, from the `probs` of [`softmax_causal_forward`]; all three of one shape `(.., T, T)`
/// and one type, f32 or bf16. The launch shape is the forward's.
///
/// # Errors
/// Before anything is enqueued: [`Error::UnsupportedDType`] unless `probs` is f32 or bf16;
/// [`Error::DTypeMismatch`] unless `dscores` and `dprobs` have its type; [`Error::Shape`] unless
/// `probs` is `(.., T, T)` with 0 < T ≤ [`MAX_SEQ`] ([`Error::Unsupported`] above it) and the
/// others have its shape; [`Error::NotContiguous`] for a strided tensor.
pub fn softmax_causal_backward(dscores: &Tensor, probs: &Tensor, dprobs: &Tensor, stream: &Stream) -> Result<()> {
    match probs.dtype() {
        DType::F32 => backward::<f32>(&SOFTMAX_CAUSAL_BACKWARD_F32, [dscores, probs, dprobs], stream),
        DType::BF16 => backward::<bf16>(&SOFTMAX_CAUSAL_BACKWARD_BF16, [dscores, probs, dprobs], stream),
        dtype => Err(unsupported_dtype(BACKWARD, dtype)),
    }
}

const BACKWARD: &str = "softmax_causal_backward";

fn backward<T: Float>(kernel: &'static Kernel, tensors: [&Tensor; 3], stream: &Stream) -> Result<()> {
    const OP: &str = BACKWARD;
    let [dscores, probs, dprobs] = tensors;
    let (rows, t) = rows_of(OP, probs)?;
    let shape = probs.shape();
    let (g, dims) = launch_shape(OP, rows, t)?;
    let args = args![
        Out(checked::<T>(OP, "dscores", dscores, shape)?),
        In(checked::<T>(OP, "probs", probs, shape)?),
        In(checked::<T>(OP, "dprobs", dprobs, shape)?),
        count(OP, rows)?,
        count(OP, t)?,
        g,
    ];
    stream.launch(kernel, dims, &args)
}

/// The row group and grid for `rows` rows of length `t`: blocks of at least [`MIN_BLOCK`]
/// threads, a row per group.
fn launch_shape(op: &'static str, rows: usize, t: usize) -> Result<(u32, crate::device::LaunchDims)> {
    let g = row_group(t, VALS);
    let block = g.max(MIN_BLOCK);
    Ok((count(op, g)?, grid(op, rows.div_ceil(block / g), block)?))
}

/// The number of rows and T of attention scores `(.., T, T)`.
fn rows_of(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match *t.shape() {
        [.., q, k] if q == k && k > 0 => {
            if k > MAX_SEQ {
                return Err(Error::Unsupported {
                    op,
                    backend: "any",
                    why: "causal softmax rows have at most 8192 keys (ops::softmax::MAX_SEQ): each thread keeps its part of a row in registers",
                });
            }
            Ok((t.numel() / k, k))
        }
        _ => Err(Error::Shape {
            op,
            expected: "attention scores (.., T, T) with T > 0".into(),
            found: t.shape().to_vec(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_cuda_source() {
        assert!(SOURCE.contains(&format!("#define SM_VALS {VALS}\n")), "SM_VALS differs in softmax.cu");
    }

    /// A row fits its group's registers, the groups tile the block, and no block exceeds the 512
    /// threads that the kernels' registers (about 100 a thread) allow.
    #[test]
    fn launch_shapes_fit_the_kernels() {
        for t in 1..=MAX_SEQ {
            let g = row_group(t, VALS);
            let block = g.max(MIN_BLOCK);
            assert!(t <= g * VALS && block.is_multiple_of(g) && block <= 512, "T = {t}: group {g} of block {block}");
        }
    }
}
