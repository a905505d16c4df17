//! Cross-entropy of logits `(N, V)` against `u32` targets `(N)`: the forward saves the softmax
//! for the backward, which turns it into the logits' gradient (an activation gradient:
//! overwritten). The CPU paths sit beside the CUDA entry points in `loss.cu`.
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

use super::{count, dense};
use crate::device::{args, CpuArgs, In, Kernel, LaunchDims, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = include_str!("loss.cu");

/// Threads per block, one block per row: `CE_THREADS` in `loss.cu`, which sizes the kernels'
/// shared memory (a unit test keeps the two equal).
const THREADS: u32 = 256;

/// Cross-entropy forward: per-row losses and the saved softmax.
pub static CROSS_ENTROPY_FORWARD: Kernel = Kernel {
    name: "cross_entropy_forward_f32",
    source: SOURCE,
    params: &["losses", "probs", "logits", "targets", "v"],
    cpu: forward_cpu,
    strided: false,
};

fn forward_cpu(a: &CpuArgs) -> Result<()> {
    let (logits, targets, v) = (a.input::<f32>("logits")?, a.input::<u32>("targets")?, a.u32("v")? as usize);
    let (mut losses, mut probs) = (a.output::<f32>("losses")?, a.output::<f32>("probs")?);
    let rows = logits.chunks_exact(v).zip(probs.chunks_exact_mut(v)).zip(losses.iter_mut().zip(targets.iter()));
    for (row, ((x, p), (loss, &t))) in rows.enumerate() {
        let max = x.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum = x.iter().fold(0.0f32, |s, &x| s + (x - max).exp());
        let inv = 1.0 / sum;
        p.iter_mut().zip(x).for_each(|(p, &x)| *p = (x - max).exp() * inv);
        let xt = x.get(t as usize).ok_or_else(|| bad_target(a.kernel.name, row, t, v))?;
        *loss = sum.ln() - (xt - max);
    }
    Ok(())
}

/// `losses[n] = −log softmax(logits[n])[targets[n]]`, saving the softmax in `probs`. Shapes:
/// `losses (N)`, `probs (N, V)`, `logits (N, V)`, `targets (N)`, all contiguous, V ≥ 1.
///
/// # Errors
/// [`Error::Shape`] for other shapes; [`Error::NotContiguous`] for a strided tensor.
pub fn cross_entropy_forward(
    losses: &Tensor,
    probs: &Tensor,
    logits: &Tensor,
    targets: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "cross_entropy_forward";
    let (n, v) = rows_cols(OP, logits)?;
    probs.expect_shape(OP, &[n, v])?;
    losses.expect_shape(OP, &[n])?;
    targets.expect_shape(OP, &[n])?;
    let Some(dims) = row_blocks(OP, n)? else { return Ok(()) };
    let (losses, probs, logits, targets) =
        (dense::<f32>(OP, losses)?, dense::<f32>(OP, probs)?, dense::<f32>(OP, logits)?, dense::<u32>(OP, targets)?);
    stream.launch(&CROSS_ENTROPY_FORWARD, dims, &args![Out(losses), Out(probs), In(logits), In(targets), count(OP, v)?])
}

/// Cross-entropy backward: the logits' gradient.
pub static CROSS_ENTROPY_BACKWARD: Kernel = Kernel {
    name: "cross_entropy_backward_f32",
    source: SOURCE,
    params: &["dlogits", "probs", "targets", "dlosses", "v"],
    cpu: backward_cpu,
    strided: false,
};

fn backward_cpu(a: &CpuArgs) -> Result<()> {
    let (probs, targets, dlosses, v) =
        (a.input::<f32>("probs")?, a.input::<u32>("targets")?, a.input::<f32>("dlosses")?, a.u32("v")? as usize);
    let mut dlogits = a.output::<f32>("dlogits")?;
    let rows = dlogits.chunks_exact_mut(v).zip(probs.chunks_exact(v)).zip(targets.iter().zip(dlosses.iter()));
    for (row, ((dx, p), (&t, &dl))) in rows.enumerate() {
        if t as usize >= v {
            return Err(bad_target(a.kernel.name, row, t, v));
        }
        for (j, (dx, &p)) in dx.iter_mut().zip(p).enumerate() {
            let onehot = if j == t as usize { 1.0 } else { 0.0 };
            *dx = (p - onehot) * dl;
        }
    }
    Ok(())
}

/// `dlogits[n] = (probs[n] − onehot(targets[n]))·dlosses[n]`, with the `probs` of the forward.
/// Shapes as in [`cross_entropy_forward`], `dlosses (N)`.
///
/// # Errors
/// [`Error::Shape`] for other shapes; [`Error::NotContiguous`] for a strided tensor.
pub fn cross_entropy_backward(
    dlogits: &Tensor,
    probs: &Tensor,
    targets: &Tensor,
    dlosses: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let (n, v) = rows_cols(OP, probs)?;
    dlogits.expect_shape(OP, &[n, v])?;
    targets.expect_shape(OP, &[n])?;
    dlosses.expect_shape(OP, &[n])?;
    let Some(dims) = row_blocks(OP, n)? else { return Ok(()) };
    let (dlogits, probs, targets, dlosses) =
        (dense::<f32>(OP, dlogits)?, dense::<f32>(OP, probs)?, dense::<u32>(OP, targets)?, dense::<f32>(OP, dlosses)?);
    stream.launch(
        &CROSS_ENTROPY_BACKWARD,
        dims,
        &args![Out(dlogits), In(probs), In(targets), In(dlosses), count(OP, v)?],
    )
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
    Ok(Some(LaunchDims { grid: (grid, 1, 1), block: (THREADS, 1, 1), shared_mem_bytes: 0 }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_size_matches_the_cuda_source() {
        assert!(SOURCE.contains(&format!("#define CE_THREADS {THREADS}\n")));
    }
}
