//! Layer 4, kernels: each op's CPU path beside its CUDA C, launched through the device layer on
//! [`Tensor`]s or views. Launchers take outputs, then inputs, then sizes,
//! and the stream last. Kernels with reductions sum in a fixed order without atomics, so results
//! are bitwise reproducible run to run on each device.
//!
//! Mixed precision: the training ops other than LayerNorm, softmax and GELU run in f32 or bf16.
//! Such an op is one CUDA template over its element type (`float.cu` holds bf16, the conversions
//! and the 16-byte chunk moves), an `extern "C"` entry point and a [`Kernel`] per type, and one
//! CPU path generic over [`Float`](crate::device::Float); both compute in f32 and round once per
//! stored value, so the elementwise ops agree bitwise between the devices in bf16 too. The
//! launcher reads the element type off its tensors and refuses others
//! ([`Error::UnsupportedDType`]) and disagreeing operands ([`Error::DTypeMismatch`]) before
//! anything is enqueued.

pub mod adamw;
pub mod attention;
pub mod cast;
pub mod copy;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod fp8;
pub mod gelu;
pub mod heads;
pub mod layernorm;
pub mod loss;
pub mod matmul;
pub mod rng;
pub mod schedule;
pub mod softmax;

use crate::device::{DType, Elem, Kernel, LaunchDims, View};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The element types of the ops that run in f32 or bf16 (for [`Error::UnsupportedDType`]).
pub(crate) const FLOATS: &str = "f32 or bf16";

/// Runs `$body` with `$t` bound to the Rust type of `$dtype` when it is f32 or bf16, and
/// returns [`Error::UnsupportedDType`] naming `$op` for any other element type.
macro_rules! with_float {
    ($op:expr, $dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::device::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::device::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            dtype => Err($crate::ops::unsupported_dtype($op, dtype)),
        }
    };
}
pub(crate) use with_float;

/// An op's two kernels, one per element type: the same CUDA template and the same generic CPU
/// path, instantiated for f32 and for bf16.
pub(crate) struct PerFloat {
    pub(crate) f32: &'static Kernel,
    pub(crate) bf16: &'static Kernel,
}

impl PerFloat {
    /// The kernel for `T`, or [`Error::UnsupportedDType`] naming `op`.
    pub(crate) fn of<T: Elem>(&self, op: &'static str) -> Result<&'static Kernel> {
        match T::DTYPE {
            DType::F32 => Ok(self.f32),
            DType::BF16 => Ok(self.bf16),
            dtype => Err(unsupported_dtype(op, dtype)),
        }
    }
}

/// The element type of `first`, which must be f32 or bf16 and shared by every tensor of
/// `others`: [`Error::UnsupportedDType`] or [`Error::DTypeMismatch`] (naming `op`) otherwise.
pub(crate) fn float_dtype(op: &'static str, first: &Tensor, others: &[&Tensor]) -> Result<DType> {
    let dtype = first.dtype();
    if !matches!(dtype, DType::F32 | DType::BF16) {
        return Err(unsupported_dtype(op, dtype));
    }
    for t in others {
        t.expect_dtype(op, dtype)?;
    }
    Ok(dtype)
}

/// Elements of `T` in one 16-byte access (`Lanes<T>::N` in `float.cu`): 4 f32, 8 bf16.
pub(crate) fn lanes<T: Elem>() -> usize {
    16 / T::DTYPE.size()
}

/// Streaming multiprocessors of the GPU the grids are sized for (an H100 SXM or an H200).
const SMS: usize = 132;

/// Resident blocks of 256 threads per SM (2048 threads, Hopper's limit).
const BLOCKS_PER_SM: usize = 8;

/// Blocks of 256 threads for a grid-stride kernel over `units` work items (`float.cu`): one
/// item per thread up to 132 × 8 blocks, the most an SM's 2048 threads hold; past that each
/// thread loops. The launch is marked [`grid_stride`](LaunchDims::grid_stride), so a CUDA
/// device trims it to the blocks its SMs hold at once at the kernel's occupancy: one wave, with
/// no partial second one. At least one block, as CUDA refuses an empty grid.
pub(crate) fn stride_dims(units: usize) -> LaunchDims {
    let blocks = units.div_ceil(256).clamp(1, SMS * BLOCKS_PER_SM) as u32;
    LaunchDims { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0, grid_stride: true }
}

/// The tensor's view as `T`, refused unless the tensor holds `T` and is contiguous: the CUDA
/// kernels index densely, so a strided view would be right on the simulator (which gathers)
/// and wrong on the GPU.
pub(crate) fn dense<'t, T: Elem>(op: &'static str, t: &'t Tensor) -> Result<View<'t, T>> {
    t.expect_dtype(op, T::DTYPE)?;
    t.expect_contiguous(op)?;
    t.view()
}

/// `t`'s dense view, refused unless its shape is `shape` (`name` names the argument).
pub(crate) fn checked<'t, T: Elem>(
    op: &'static str,
    name: &str,
    t: &'t Tensor,
    shape: &[usize],
) -> Result<View<'t, T>> {
    if t.shape() != shape {
        return Err(Error::Shape { op, expected: format!("{name} of shape {shape:?}"), found: t.shape().to_vec() });
    }
    dense(op, t)
}

/// [`Error::LengthMismatch`] naming `op` unless `y` and `x` have the same length.
pub(crate) fn same_len<T: Elem>(op: &'static str, y: &View<'_, T>, x: &View<'_, T>) -> Result<()> {
    if y.len() != x.len() {
        return Err(Error::LengthMismatch { op, src: x.len(), dst: y.len() });
    }
    Ok(())
}

/// A size as the kernels' `unsigned`.
pub(crate) fn count(op: &'static str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Unsupported {
        op,
        backend: "any",
        why: "sizes of 2^32 or more are not supported by this kernel; split the tensor",
    })
}

/// The (rows, columns) of a matrix with at least one column.
pub(crate) fn rows_cols(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match *t.shape() {
        [n, c] if c > 0 => Ok((n, c)),
        _ => Err(Error::Shape { op, expected: "a matrix (N, C) with C > 0".into(), found: t.shape().to_vec() }),
    }
}

/// Threads of the row group that shares a row of `len` elements, each thread holding at most
/// `vals` of them: a power of two, at least a warp (`rows.cu` describes row groups).
pub(crate) fn row_group(len: usize, vals: usize) -> usize {
    len.div_ceil(vals).next_power_of_two().max(32)
}

/// A grid of `blocks` blocks (at least one, as CUDA refuses an empty grid; the kernels skip rows
/// past the end) of `block` threads.
pub(crate) fn grid(op: &'static str, blocks: usize, block: usize) -> Result<LaunchDims> {
    Ok(LaunchDims {
        grid: (count(op, blocks.max(1))?, 1, 1),
        block: (count(op, block)?, 1, 1),
        shared_mem_bytes: 0,
        grid_stride: false,
    })
}

/// The error of an op with f32 and bf16 kernels (or of a float-only store) given another
/// element type.
/// The column sums of a row-major matrix of `cols` columns (whole rows of `x`), each column's rows
/// added in order from 0: the CPU side of `float.cu`'s `column_sum`, the one order of the
/// column-sum kernels.
pub(crate) fn column_sums(x: &[f32], cols: usize) -> Vec<f32> {
    let mut sums = vec![0.0f32; cols];
    if cols == 0 {
        return sums;
    }
    for row in x.chunks_exact(cols) {
        sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
    }
    sums
}

pub(crate) fn unsupported_dtype(op: &'static str, dtype: DType) -> Error {
    Error::UnsupportedDType { op, dtype, supported: FLOATS }
}

#[cfg(test)]
mod tests {
    use crate::device::kernel::entry_params;
    use crate::device::Kernel;

    #[test]
    fn row_groups_are_powers_of_two_of_at_least_a_warp() {
        use super::row_group;
        assert_eq!([row_group(1, 16), row_group(512, 16), row_group(513, 16), row_group(4096, 16)], [32, 32, 64, 256]);
        assert_eq!(row_group(4096, 8), 512);
        for len in 1..5000 {
            let g = row_group(len, 8);
            assert!(g.is_power_of_two() && g >= 32 && len <= g * 8 && (g == 32 || len > g / 2 * 8), "{len}: {g}");
        }
    }

    /// Every kernel of the ops.
    fn all_kernels() -> Vec<&'static Kernel> {
        use super::*;
        let mut kernels = vec![&adamw::ADAMW, &adamw::ADAMW_BF16, &adamw::NONFINITE_SCAN, &adamw::NONFINITE_SCAN_BF16];
        kernels.extend(fp8::CAST_TRANSPOSE.iter().copied());
        for table in [&attention::FORWARD, &attention::DELTA, &attention::BACKWARD_DKDV, &attention::BACKWARD_DQ] {
            kernels.extend(table.iter().copied());
        }
        kernels.extend([
            &cast::CAST_F32_TO_BF16,
            &cast::CAST_BF16_TO_F32,
            &cast::RESIDUAL_ADD,
            &cast::RESIDUAL_ADD_BF16,
            &cast::QUANTIZE_F32_TO_E4M3,
            &cast::QUANTIZE_F32_TO_E5M2,
            &cast::QUANTIZE_BF16_TO_E4M3,
            &cast::QUANTIZE_BF16_TO_E5M2,
            &cast::DEQUANTIZE_E4M3_TO_F32,
            &cast::DEQUANTIZE_E5M2_TO_F32,
            &cast::DEQUANTIZE_E4M3_TO_BF16,
            &cast::DEQUANTIZE_E5M2_TO_BF16,
            &copy::COPY_BYTES,
            &copy::COPY_BYTES_VIA,
            &fp8::AMAX,
            &fp8::AMAX_BF16,
            &fp8::DGELU_CAST_TRANSPOSE[0],
            &fp8::DGELU_CAST_TRANSPOSE[1],
            &fp8::AMAX_SCALE,
            &fp8::AMAX_SCALE_BF16,
            &fp8::SUM_TILES,
            &fp8::DELAYED_SCALING_UPDATE,
            &fp8::CURRENT_SCALING_UPDATE,
            &dropout::DROPOUT_FORWARD,
            &dropout::DROPOUT_FORWARD_BF16,
            &dropout::DROPOUT_BACKWARD,
            &dropout::DROPOUT_BACKWARD_BF16,
            &elementwise::FILL,
            &elementwise::FILL_BF16,
            &elementwise::ADD_SCALAR,
            &elementwise::ADD_SCALAR_BF16,
            &elementwise::SCALE,
            &elementwise::SCALE_BF16,
            &elementwise::AXPY,
            &elementwise::AXPY_BF16,
            &elementwise::ACCUMULATE,
            &elementwise::ACCUMULATE_BF16,
            &elementwise::ANY_NONZERO,
            &elementwise::ANY_NONZERO_BF16,
            &elementwise::SCALE_ROWS,
            &elementwise::SCALE_ROWS_BF16,
            &embedding::EMBEDDING_FORWARD,
            &embedding::EMBEDDING_FORWARD_BF16,
            &embedding::EMBEDDING_BACKWARD_WTE,
            &embedding::EMBEDDING_BACKWARD_WTE_BF16,
            &embedding::EMBEDDING_BACKWARD_WPE,
            &embedding::EMBEDDING_BACKWARD_WPE_BF16,
            &gelu::GELU_FORWARD,
            &gelu::GELU_FORWARD_BF16,
            &gelu::GELU_BACKWARD,
            &gelu::GELU_BACKWARD_BF16,
            &gelu::BIAS_GELU_FORWARD,
            &gelu::BIAS_GELU_BACKWARD,
            &gelu::COLUMN_SUM_ADD,
            &heads::HEADS_FROM_ROWS,
            &heads::HEADS_FROM_ROWS_BF16,
            &heads::ROWS_FROM_HEADS,
            &heads::ROWS_FROM_HEADS_BF16,
            &heads::SPLIT_QKV,
            &heads::SPLIT_QKV_BF16,
            &heads::MERGE_QKV,
            &heads::MERGE_QKV_BF16,
            &layernorm::LAYERNORM_FORWARD_F32,
            &layernorm::LAYERNORM_FORWARD_BF16,
            &layernorm::LAYERNORM_BACKWARD_F32,
            &layernorm::LAYERNORM_BACKWARD_BF16,
            &layernorm::LAYERNORM_COLUMN_SUMS_F32,
            &layernorm::LAYERNORM_COLUMN_SUMS_BF16,
            &loss::CROSS_ENTROPY_FORWARD,
            &loss::CROSS_ENTROPY_FORWARD_BF16,
            &loss::CROSS_ENTROPY_BACKWARD,
            &loss::CROSS_ENTROPY_BACKWARD_BF16,
            &rng::RANDOM_U32,
            &rng::STEP_WRITE,
            &rng::STEP_ADD,
            &schedule::LR_SCHEDULE_STEP,
            &softmax::SOFTMAX_CAUSAL_FORWARD_F32,
            &softmax::SOFTMAX_CAUSAL_FORWARD_BF16,
            &softmax::SOFTMAX_CAUSAL_BACKWARD_F32,
            &softmax::SOFTMAX_CAUSAL_BACKWARD_BF16,
        ]);
        kernels
    }

    /// The CPU paths read arguments by these names, so they must be the CUDA signature's.
    #[test]
    fn every_kernel_names_the_parameters_of_its_entry_point() {
        for k in all_kernels() {
            assert_eq!(entry_params(k.source, k.name).as_deref(), Some(k.params), "{}", k.name);
        }
    }

    /// Every CUDA source under `src/ops` (path, contents), embedded at compile time by `build.rs`.
    const SOURCES: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/ops_sources.rs"));

    /// The names of the CUDA entry points defined in `text`.
    fn entry_points(text: &str) -> Vec<String> {
        const ENTRY: &str = "extern \"C\" __global__ void ";
        text.match_indices(ENTRY)
            .map(|(at, _)| text[at + ENTRY.len()..].split('(').next().unwrap_or_default().trim().to_string())
            .collect()
    }

    /// Keeps [`all_kernels`] complete: every CUDA entry point under `src/ops` has its `Kernel`
    /// there, and every listed kernel is an entry point. The sources are embedded, so the test
    /// does not depend on where it was built.
    #[test]
    fn all_kernels_lists_every_entry_point_of_the_ops() {
        assert!(SOURCES.iter().any(|(name, _)| *name == "float.cu"), "build.rs embedded src/ops");
        let mut defined: Vec<String> = SOURCES.iter().flat_map(|(_, text)| entry_points(text)).collect();
        let mut listed: Vec<String> = all_kernels().iter().map(|k| k.name.to_string()).collect();
        defined.sort();
        listed.sort();
        assert_eq!(defined, listed);
    }
}
