//! Cross-entropy of logits `(N, V)` against `u32` targets `(N)`: the forward saves the softmax
//! for the backward, which turns it into the logits' gradient (an activation gradient:
//! overwritten). Logits and their gradient are f32 or bf16; the losses and the saved softmax are
//! always f32 (see [`cross_entropy_forward`]), and everything is computed in f32. Each kernel is
//! one CUDA template in `loss.cu` with one generic CPU path beside it here.
//!
//! Both subtract the row's maximum before `exp`, so large logits do not overflow. On CUDA a row
//! is reduced by one block in a fixed order (see `loss.cu`), so results are reproducible run to
//! run; they match the CPU path to rounding, not bitwise (`expf` and the summation order differ).
//! A target not below V makes the CPU path fail (reported by the next synchronizing call); a
//! kernel cannot fail, so CUDA writes a NaN loss and subtracts no one-hot term instead.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::loss;
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let logits = Tensor::from_host(&alloc, &s, &[0.0f32, 0.0, 1000.0, 1000.0], &[2, 2])?;
//! let targets = Tensor::from_host(&alloc, &s, &[1u32, 0], &[2])?;
//! let (losses, probs) = (Tensor::zeros(&alloc, &s, &[2], graphed::device::DType::F32)?, Tensor::zeros(&alloc, &s, &[2, 2], graphed::device::DType::F32)?);
//! loss::cross_entropy_forward(&losses, &probs, &logits, &targets, &s)?;
//! assert_eq!(losses.to_vec::<f32>(&s)?, vec![std::f32::consts::LN_2; 2]);
//! # Ok::<(), graphed::Error>(())
//! ```

use half::bf16;

use super::{count, dense, float_dtype, with_float, PerFloat};
use crate::device::{args, CpuArgs, Float, In, Kernel, LaunchDims, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("loss.cu"));

/// Threads per block, one block per row: `CE_THREADS` in `loss.cu`, which sizes the kernels'
/// shared memory (a unit test keeps the two equal).
const THREADS: u32 = 256;

const FORWARD: [&str; 5] = ["losses", "probs", "logits", "targets", "v"];

/// Cross-entropy forward of f32 logits: per-row losses and the saved softmax.
pub static CROSS_ENTROPY_FORWARD: Kernel = Kernel {
    name: "cross_entropy_forward_f32",
    source: SOURCE,
    params: &FORWARD,
    cpu: forward_cpu::<f32>,
    strided: false,
};

/// Cross-entropy forward of bf16 logits (widened exactly; losses and softmax in f32).
pub static CROSS_ENTROPY_FORWARD_BF16: Kernel = Kernel {
    name: "cross_entropy_forward_bf16",
    source: SOURCE,
    params: &FORWARD,
    cpu: forward_cpu::<bf16>,
    strided: false,
};

fn forward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (logits, targets, v) = (a.input::<T>("logits")?, a.input::<u32>("targets")?, a.u32("v")? as usize);
    let (mut losses, mut probs) = (a.output::<f32>("losses")?, a.output::<f32>("probs")?);
    let mut x = vec![0.0f32; v];
    let rows = logits.chunks_exact(v).zip(probs.chunks_exact_mut(v)).zip(losses.iter_mut().zip(targets.iter()));
    for (row, ((wide, p), (loss, &t))) in rows.enumerate() {
        x.iter_mut().zip(wide).for_each(|(x, w)| *x = w.to_f32());
        let max = x.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum = x.iter().fold(0.0f32, |s, &x| s + (x - max).exp());
        let inv = 1.0 / sum;
        p.iter_mut().zip(&x).for_each(|(p, &x)| *p = (x - max).exp() * inv);
        let xt = x.get(t as usize).ok_or_else(|| bad_target(a.kernel.name, row, t, v))?;
        *loss = sum.ln() - (xt - max);
    }
    Ok(())
}

/// `losses[n] = −log softmax(logits[n])[targets[n]]`, saving the softmax in `probs`. Shapes:
/// `losses (N)`, `probs (N, V)`, `logits (N, V)`, `targets (N)`, all contiguous, V ≥ 1. The
/// logits are f32 or bf16; losses and probabilities are f32 whatever the logits' type: the
/// backward subtracts a one-hot from the probabilities, and in bf16 (8 bits of mantissa) a
/// probability near 1 would lose most of the difference that is its gradient.
///
/// # Errors
/// [`Error::UnsupportedDType`] for logits of another type, [`Error::DTypeMismatch`] for `losses`,
/// `probs` not f32 or `targets` not u32; [`Error::Shape`] for other shapes;
/// [`Error::NotContiguous`] for a strided tensor; all before anything is enqueued.
pub fn cross_entropy_forward(
    losses: &Tensor,
    probs: &Tensor,
    logits: &Tensor,
    targets: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "cross_entropy_forward";
    let dtype = float_dtype(OP, logits, &[])?;
    let (n, v) = rows_cols(OP, logits)?;
    probs.expect_shape(OP, &[n, v])?;
    losses.expect_shape(OP, &[n])?;
    targets.expect_shape(OP, &[n])?;
    let (losses, probs, targets) = (dense::<f32>(OP, losses)?, dense::<f32>(OP, probs)?, dense::<u32>(OP, targets)?);
    let Some(dims) = row_blocks(OP, n)? else { return Ok(()) };
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &CROSS_ENTROPY_FORWARD, bf16: &CROSS_ENTROPY_FORWARD_BF16 }.of::<T>(OP)?;
        let logits = dense::<T>(OP, logits)?;
        stream.launch(kernel, dims, &args![Out(losses), Out(probs), In(logits), In(targets), count(OP, v)?])
    })
}

const BACKWARD: [&str; 5] = ["dlogits", "probs", "targets", "dlosses", "v"];

/// Cross-entropy backward: the f32 logits' gradient.
pub static CROSS_ENTROPY_BACKWARD: Kernel = Kernel {
    name: "cross_entropy_backward_f32",
    source: SOURCE,
    params: &BACKWARD,
    cpu: backward_cpu::<f32>,
    strided: false,
};

/// Cross-entropy backward: the bf16 logits' gradient (computed in f32, rounded once).
pub static CROSS_ENTROPY_BACKWARD_BF16: Kernel = Kernel {
    name: "cross_entropy_backward_bf16",
    source: SOURCE,
    params: &BACKWARD,
    cpu: backward_cpu::<bf16>,
    strided: false,
};

fn backward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (probs, targets, dlosses, v) =
        (a.input::<f32>("probs")?, a.input::<u32>("targets")?, a.input::<f32>("dlosses")?, a.u32("v")? as usize);
    let mut dlogits = a.output::<T>("dlogits")?;
    let rows = dlogits.chunks_exact_mut(v).zip(probs.chunks_exact(v)).zip(targets.iter().zip(dlosses.iter()));
    for (row, ((dx, p), (&t, &dl))) in rows.enumerate() {
        if t as usize >= v {
            return Err(bad_target(a.kernel.name, row, t, v));
        }
        for (j, (dx, &p)) in dx.iter_mut().zip(p).enumerate() {
            let onehot = if j == t as usize { 1.0 } else { 0.0 };
            *dx = T::from_f32((p - onehot) * dl);
        }
    }
    Ok(())
}

/// `dlogits[n] = (probs[n] − onehot(targets[n]))·dlosses[n]`, with the f32 `probs` of the
/// forward and f32 `dlosses`; `dlogits` in the logits' type, f32 or bf16 (computed in f32,
/// rounded once). Shapes as in [`cross_entropy_forward`], `dlosses (N)`.
///
/// # Errors
/// As [`cross_entropy_forward`], for `dlogits` in the logits' role.
pub fn cross_entropy_backward(
    dlogits: &Tensor,
    probs: &Tensor,
    targets: &Tensor,
    dlosses: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let dtype = float_dtype(OP, dlogits, &[])?;
    let (n, v) = rows_cols(OP, probs)?;
    dlogits.expect_shape(OP, &[n, v])?;
    targets.expect_shape(OP, &[n])?;
    dlosses.expect_shape(OP, &[n])?;
    let (probs, targets, dlosses) = (dense::<f32>(OP, probs)?, dense::<u32>(OP, targets)?, dense::<f32>(OP, dlosses)?);
    let Some(dims) = row_blocks(OP, n)? else { return Ok(()) };
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &CROSS_ENTROPY_BACKWARD, bf16: &CROSS_ENTROPY_BACKWARD_BF16 }.of::<T>(OP)?;
        let dlogits = dense::<T>(OP, dlogits)?;
        stream.launch(kernel, dims, &args![Out(dlogits), In(probs), In(targets), In(dlosses), count(OP, v)?])
    })
}

fn bad_target(kernel: &'static str, row: usize, target: u32, v: usize) -> Error {
    Error::KernelFailed {
        kernel,
        message: format!("target {target} of row {row} is not below the vocabulary size {v}"),
    }
}

/// `(N, V)` of a 2-D tensor with V ≥ 1.
fn rows_cols(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match *t.shape() {
        [n, v] if v > 0 => Ok((n, v)),
        _ => Err(Error::Shape { op, expected: "(N, V) logits with V ≥ 1".into(), found: t.shape().to_vec() }),
    }
}

/// One block of [`THREADS`] per row; `None` for no rows (a grid of 0 blocks is not a launch).
fn row_blocks(op: &'static str, n: usize) -> Result<Option<LaunchDims>> {
    if n == 0 {
        return Ok(None);
    }
    let grid = u32::try_from(n).ok().filter(|&g| g <= i32::MAX as u32).ok_or(Error::Unsupported {
        op,
        backend: "any",
        why: "at most 2^31 − 1 rows (CUDA's grid limit); split the batch",
    })?;
    Ok(Some(LaunchDims { grid: (grid, 1, 1), block: (THREADS, 1, 1), shared_mem_bytes: 0, grid_stride: false }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_size_matches_the_cuda_source() {
        assert!(SOURCE.contains(&format!("#define CE_THREADS {THREADS}\n")));
    }
}
