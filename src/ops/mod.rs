//! Layer 4, kernels: each op's CPU path beside its CUDA C, launched through the device layer on
//! [`Tensor`]s or views. Launchers take outputs, then inputs, then sizes,
//! and the stream last. Kernels with reductions sum in a fixed order without atomics, so results
//! are bitwise reproducible run to run on each device.

pub mod adamw;
pub mod cast;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gelu;
pub mod heads;
pub mod layernorm;
pub mod loss;
pub mod matmul;
pub mod rng;
pub mod schedule;
pub mod softmax;

use crate::device::{DType, Elem, LaunchDims, View};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The tensor's view as `T`, refused unless the tensor holds `T` and is contiguous: the CUDA
/// kernels index densely, so a strided view would be right on the simulator (which gathers)
/// and wrong on the GPU.
pub(crate) fn dense<'t, T: Elem>(op: &'static str, t: &'t Tensor) -> Result<View<'t, T>> {
    t.expect_dtype(op, T::DTYPE)?;
    if !t.is_contiguous() {
        return Err(Error::NotContiguous { op, buffer: t.id() });
    }
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
    Ok(LaunchDims { grid: (count(op, blocks.max(1))?, 1, 1), block: (count(op, block)?, 1, 1), shared_mem_bytes: 0 })
}

/// The error of an op with f32 and bf16 kernels given another element type.
pub(crate) fn unsupported_dtype(op: &'static str, dtype: DType) -> Error {
    Error::UnsupportedDType { op, dtype, supported: "f32 or bf16" }
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
        vec![
            &adamw::ADAMW,
            &cast::CAST_F32_TO_BF16,
            &cast::CAST_BF16_TO_F32,
            &cast::RESIDUAL_ADD,
            &dropout::DROPOUT_FORWARD,
            &dropout::DROPOUT_BACKWARD,
            &elementwise::FILL,
            &elementwise::ADD_SCALAR,
            &elementwise::SCALE,
            &elementwise::AXPY,
            &elementwise::SCALE_ROWS,
            &embedding::EMBEDDING_FORWARD,
            &embedding::EMBEDDING_BACKWARD_WTE,
            &embedding::EMBEDDING_BACKWARD_WPE,
            &gelu::GELU_FORWARD,
            &gelu::GELU_BACKWARD,
            &gelu::BIAS_GELU_FORWARD,
            &gelu::BIAS_GELU_BACKWARD,
            &gelu::COLUMN_SUM_ADD,
            &heads::HEADS_FROM_ROWS,
            &heads::ROWS_FROM_HEADS,
            &layernorm::LAYERNORM_FORWARD_F32,
            &layernorm::LAYERNORM_FORWARD_BF16,
            &layernorm::LAYERNORM_BACKWARD_F32,
            &layernorm::LAYERNORM_BACKWARD_BF16,
            &loss::CROSS_ENTROPY_FORWARD,
            &loss::CROSS_ENTROPY_BACKWARD,
            &rng::RANDOM_U32,
            &rng::STEP_WRITE,
            &rng::STEP_ADD,
            &schedule::LR_SCHEDULE_STEP,
            &softmax::SOFTMAX_CAUSAL_FORWARD_F32,
            &softmax::SOFTMAX_CAUSAL_FORWARD_BF16,
            &softmax::SOFTMAX_CAUSAL_BACKWARD_F32,
            &softmax::SOFTMAX_CAUSAL_BACKWARD_BF16,
        ]
    }

    /// The CPU paths read arguments by these names, so they must be the CUDA signature's.
    #[test]
    fn every_kernel_names_the_parameters_of_its_entry_point() {
        for k in all_kernels() {
            assert_eq!(entry_params(k.source, k.name).as_deref(), Some(k.params), "{}", k.name);
        }
    }

    /// Keeps [`all_kernels`] complete: every `Kernel` static under `src/ops` is in it.
    #[test]
    fn all_kernels_lists_every_kernel_of_the_ops() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ops");
        let mut declared = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let mut rest = text.as_str();
                while let Some(at) = rest.find("static ") {
                    rest = &rest[at + "static ".len()..];
                    if rest.split('=').next().is_some_and(|decl| decl.trim_end().ends_with(": Kernel")) {
                        let name = rest.split("name: \"").nth(1).and_then(|n| n.split('"').next()).unwrap();
                        declared.push(name.to_string());
                    }
                }
            }
        }
        let mut listed: Vec<String> = all_kernels().iter().map(|k| k.name.to_string()).collect();
        declared.sort();
        listed.sort();
        assert_eq!(declared, listed);
    }
}
