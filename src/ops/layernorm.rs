//! LayerNorm over the last dimension of an `(N, C)` matrix of f32 or bf16, with f32 statistics and
//! f32 math (LN1 and LN2 of the benchmark layer, eps 1e-5): one kernel per direction and element
//! type, the CPU path of each beside its CUDA entry point in `layernorm.cu`. The forward saves each
//! row's mean and reciprocal standard deviation (`rstd`), so the backward does not recompute them.
//!
//! The backward is one kernel for the input gradient and the parameter gradients, and it can fuse
//! the residual stream: given the residual's gradient (`ResidualGrad`), it adds it into
//! `dinp` and can accumulate its column sums (the bias gradient of the Linear whose output
//! gradient it is). Its column sums go through a [`LayerNormWorkspace`] (Note [LayerNorm
//! backward's column sums]).
//!
//! Gradient convention (llm.c `layernorm.cuh`): parameter gradients accumulate (`dweight +=`,
//! `dbias +=`, `dcolsum +=`), so micro-batches sum into one buffer; the activation gradient is
//! written (`dinp =`, the residual's gradient added). Every value is widened to f32 once and
//! rounded to its type once, on both devices. Tensors must be contiguous; outputs must not alias
//! inputs; rows have at most [`MAX_FEATURES`] features.
//!
//! ```
//! use graphed::device::{DType, Device};
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::layernorm;
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let inp = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0, 3.0, 4.0], &[1, 4])?;
//! let (weight, bias) = (Tensor::from_host(&alloc, &s, &[1.0f32; 4], &[4])?, Tensor::zeros(&alloc, &s, &[4], DType::F32)?);
//! let out = Tensor::uninit(&alloc, &s, &[1, 4], DType::F32)?;
//! let (mean, rstd) = (Tensor::uninit(&alloc, &s, &[1], DType::F32)?, Tensor::uninit(&alloc, &s, &[1], DType::F32)?);
//! layernorm::layernorm_forward(&out, &mean, &rstd, &inp, &weight, &bias, 1e-5, &s)?;
//! assert_eq!(mean.to_vec::<f32>(&s)?, vec![2.5]);
//! let y = out.to_vec::<f32>(&s)?;
//! assert!(y.iter().sum::<f32>().abs() < 1e-6 && (y[3] - 1.3416).abs() < 1e-4);
//!
//! // The backward, with the residual stream's gradient added into dinp.
//! let ws = layernorm::LayerNormWorkspace::new(&alloc, &s, 4)?;
//! let (dinp, dweight, dbias) = (Tensor::uninit(&alloc, &s, &[1, 4], DType::F32)?, Tensor::zeros(&alloc, &s, &[4], DType::F32)?, Tensor::zeros(&alloc, &s, &[4], DType::F32)?);
//! let (dout, residual) = (Tensor::zeros(&alloc, &s, &[1, 4], DType::F32)?, Tensor::from_host(&alloc, &s, &[0.5f32; 4], &[1, 4])?);
//! let res = layernorm::ResidualGrad { grad: &residual, colsum: None };
//! layernorm::layernorm_backward(&dinp, &dweight, &dbias, &dout, &inp, &weight, &mean, &rstd, Some(res), &ws, &s)?;
//! assert_eq!(dinp.to_vec::<f32>(&s)?, vec![0.5; 4], "a zero dout leaves the residual's gradient");
//! # Ok::<(), graphed::Error>(())
//! ```
//!
//! # Note [LayerNorm backward's column sums]
//!
//! The parameter gradients are sums over all rows, and the rows are spread over the blocks of one
//! launch. Each block sums its rows' contributions per column in f32 (in row order, its row groups
//! in group order) and writes them to its slot of the workspace's scratch (3·C floats: dweight,
//! dbias, dcolsum). A second, small kernel (`layernorm_column_sums`) then adds the slots into the
//! gradients: 32 columns per block of 8 warps, warp r summing its run of consecutive slots in slot
//! order, the 8 runs added in run order. No atomics and no counters: the order of additions
//! depends only on N and C, so results are bitwise identical run to run (and a replayed graph
//! needs no state reset). The grid has at most [`BACKWARD_BLOCKS`] blocks whatever the GPU, so the
//! order does not depend on the device either. An earlier design let the last block of each span
//! of blocks (a ticket counter) add the slots inside the one kernel, as llm.c does; measured on the
//! H200 at N = C = 4096 that tail was 65 of the kernel's 157 µs, since a handful of blocks did it
//! alone while the others sat idle, where the second kernel spreads it over the whole GPU. The
//! simulator's CPU path sums each column over all rows in row order into slot 0 (the other slots
//! zeroed), so the column sums add the same totals (the devices agree to rounding, not bitwise).
//!
//! With few rows (at most [`backward_column_path_rows`]), the kernel splits the columns over the
//! blocks instead (`LN_COLUMNS`, see [`layernorm_backward`]): each column's sums stay in the one
//! block that owns it, added over rows in row order and over its row groups in group order, and
//! neither the workspace nor the second kernel is used (the workspace is still declared, so the
//! checker's ordering is the same).

use half::bf16;

use super::{checked, count, grid, row_group, rows_cols, unsupported_dtype};
use crate::device::{args, CpuArgs, DType, Float, In, InOut, Kernel, Out, Stream};
use crate::memory::CachingAllocator;
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("rows.cu"), include_str!("layernorm.cu"));

/// The most features (C) a row may have: each thread keeps its part of a row in registers (a
/// row group of up to 512 threads in the backward, 8 values each, which its registers allow).
pub const MAX_FEATURES: usize = 4096;

/// Values of a row per thread in the forward (`LN_FWD_VALS` in `layernorm.cu`) and its threads
/// per block.
const FWD_VALS: usize = 16;
const FWD_BLOCK: usize = 256;
/// Values of a row per thread in the backward (`LN_BWD_VALS`) and its threads per block: its
/// registers (about 120 a thread) allow at most 512.
const BWD_VALS: usize = 8;
const BWD_BLOCK: usize = 512;
/// The backward's blocks at most: one per SM of an H200 (132), whatever the GPU, so that the
/// order of the column sums depends only on the shapes. Fewer when there are fewer row groups.
pub const BACKWARD_BLOCKS: usize = 132;
/// Threads per block of the column sums: `LN_SUM_RUNS` warps over 32 columns.
const SUM_BLOCK: usize = 256;
const SUM_COLUMNS: usize = 32;
/// The backward's small-N path: taken while each row group walks at most this many rows with
/// one block per column slice, which is while the row path would have at most this many blocks
/// (see [`layernorm_backward`]).
const COLUMN_PATH_ROWS: usize = 8;
/// The small-N path's blocks at most: within one wave of an H200's 132 SMs, and a power of two,
/// so that it divides every row group.
const COLUMN_BLOCKS: usize = 128;
/// The backward's `flags` (`LN_RESIDUAL`, `LN_COLSUM`, `LN_COLUMNS`).
const RESIDUAL: u32 = 1;
const COLSUM: u32 = 2;
const COLUMNS: u32 = 4;

const FORWARD_PARAMS: &[&str] = &["out", "mean", "rstd", "inp", "weight", "bias", "eps", "rows", "C", "G"];

/// Normalizes each row of f32 and saves its statistics (a row group per row on CUDA).
pub static LAYERNORM_FORWARD_F32: Kernel = Kernel {
    name: "layernorm_forward_f32",
    source: SOURCE,
    params: FORWARD_PARAMS,
    cpu: forward_cpu::<f32>,
    strided: false,
};

/// Normalizes each row of bf16 and saves its f32 statistics (a row group per row on CUDA).
pub static LAYERNORM_FORWARD_BF16: Kernel = Kernel {
    name: "layernorm_forward_bf16",
    source: SOURCE,
    params: FORWARD_PARAMS,
    cpu: forward_cpu::<bf16>,
    strided: false,
};

fn forward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (inp, weight, bias) = (a.input::<T>("inp")?, a.input::<T>("weight")?, a.input::<T>("bias")?);
    let (eps, c) = (a.f32("eps")?, a.u32("C")? as usize);
    let (mut out, mut mean, mut rstd) = (a.output::<T>("out")?, a.output::<f32>("mean")?, a.output::<f32>("rstd")?);
    let rows = out.chunks_exact_mut(c).zip(inp.chunks_exact(c));
    for ((y, x), (m_out, r_out)) in rows.zip(mean.iter_mut().zip(rstd.iter_mut())) {
        let m = x.iter().map(|v| v.to_f32()).sum::<f32>() / c as f32;
        let var = x.iter().map(|v| (v.to_f32() - m) * (v.to_f32() - m)).sum::<f32>() / c as f32;
        let r = 1.0 / (var + eps).sqrt();
        for (((y, x), w), b) in y.iter_mut().zip(x).zip(weight.iter()).zip(bias.iter()) {
            *y = T::from_f32((x.to_f32() - m) * r * w.to_f32() + b.to_f32());
        }
        (*m_out, *r_out) = (m, r);
    }
    Ok(())
}

/// `out = (inp − mean)·rstd·weight + bias` over each row of `inp` (N, C), with
/// `rstd = 1/√(var + eps)` and the biased variance; writes `mean` and `rstd` (N, f32) for
/// [`layernorm_backward`]. `inp`, `out`, `weight` and `bias` are all f32 or all bf16.
///
/// On CUDA a row group of 32 to 256 threads (C/16 rounded up to a power of two) holds each row in
/// registers, 16 values a thread, in 16-byte loads where C allows (a multiple of 8 for bf16, of 4
/// for f32, else one element at a time); blocks of 256 threads, so several rows per block for
/// C ≤ 2048.
///
/// # Errors
/// Before anything is enqueued: [`Error::UnsupportedDType`] unless `inp` is f32 or bf16;
/// [`Error::DTypeMismatch`] unless `out`, `weight` and `bias` have its type and `mean`, `rstd`
/// are f32; [`Error::Shape`] unless `inp` is (N, C) with 0 < C ≤ [`MAX_FEATURES`]
/// ([`Error::Unsupported`] above it), `out` (N, C), `mean` and `rstd` (N), `weight` and `bias`
/// (C); [`Error::NotContiguous`] for a strided tensor.
#[allow(clippy::too_many_arguments)] // llm.c's order: outputs, inputs, sizes, stream
pub fn layernorm_forward(
    out: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    inp: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
    stream: &Stream,
) -> Result<()> {
    let tensors = [out, mean, rstd, inp, weight, bias];
    match inp.dtype() {
        DType::F32 => forward::<f32>(&LAYERNORM_FORWARD_F32, tensors, eps, stream),
        DType::BF16 => forward::<bf16>(&LAYERNORM_FORWARD_BF16, tensors, eps, stream),
        dtype => Err(unsupported_dtype(FORWARD, dtype)),
    }
}

const FORWARD: &str = "layernorm_forward";

fn forward<T: Float>(kernel: &'static Kernel, tensors: [&Tensor; 6], eps: f32, stream: &Stream) -> Result<()> {
    const OP: &str = FORWARD;
    let [out, mean, rstd, inp, weight, bias] = tensors;
    let (n, c) = features(OP, inp)?;
    let g = row_group(c, FWD_VALS);
    let args = args![
        Out(checked::<T>(OP, "out", out, &[n, c])?),
        Out(checked::<f32>(OP, "mean", mean, &[n])?),
        Out(checked::<f32>(OP, "rstd", rstd, &[n])?),
        In(checked::<T>(OP, "inp", inp, &[n, c])?),
        In(checked::<T>(OP, "weight", weight, &[c])?),
        In(checked::<T>(OP, "bias", bias, &[c])?),
        eps,
        count(OP, n)?,
        count(OP, c)?,
        count(OP, g)?,
    ];
    stream.launch(kernel, grid(OP, n.div_ceil(FWD_BLOCK / g), FWD_BLOCK)?, &args)
}

const BACKWARD_PARAMS: &[&str] = &[
    "dinp", "dweight", "dbias", "dcolsum", "scratch", "dout", "inp", "weight", "mean", "rstd", "residual", "rows", "C",
    "G", "flags",
];

/// The input gradient (plus the residual's), and the parameter gradients accumulated, of rows of
/// f32 (row groups on CUDA, column sums as Note [LayerNorm backward's column sums]).
pub static LAYERNORM_BACKWARD_F32: Kernel = Kernel {
    name: "layernorm_backward_f32",
    source: SOURCE,
    params: BACKWARD_PARAMS,
    cpu: backward_cpu::<f32>,
    strided: false,
};

/// [`LAYERNORM_BACKWARD_F32`] for rows of bf16.
pub static LAYERNORM_BACKWARD_BF16: Kernel = Kernel {
    name: "layernorm_backward_bf16",
    source: SOURCE,
    params: BACKWARD_PARAMS,
    cpu: backward_cpu::<bf16>,
    strided: false,
};

fn backward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (dout, inp, weight) = (a.input::<T>("dout")?, a.input::<T>("inp")?, a.input::<T>("weight")?);
    let (mean, rstd, residual) = (a.input::<f32>("mean")?, a.input::<f32>("rstd")?, a.input::<T>("residual")?);
    let (c, flags) = (a.u32("C")? as usize, a.u32("flags")?);
    let (has_residual, has_colsum) = (flags & RESIDUAL != 0, flags & COLSUM != 0);
    let w: Vec<f32> = weight.iter().map(|w| w.to_f32()).collect();
    // Column sums over rows in row order, added to the gradients once at the end.
    let (mut dw, mut db, mut dr) = (vec![0.0f32; c], vec![0.0f32; c], vec![0.0f32; c]);
    let mut dinp = a.output::<T>("dinp")?;
    let rows = dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c));
    for (row, ((dx, g), x)) in rows.enumerate() {
        let (m, r) = (mean[row], rstd[row]);
        let norm: Vec<f32> = x.iter().map(|x| (x.to_f32() - m) * r).collect();
        let (mut sum, mut sum_norm) = (0.0f32, 0.0f32);
        for col in 0..c {
            let (g, dn) = (g[col].to_f32(), g[col].to_f32() * w[col]);
            sum += dn;
            sum_norm += dn * norm[col];
            dw[col] += g * norm[col];
            db[col] += g;
        }
        let (mean_dn, mean_dn_norm) = (sum / c as f32, sum_norm / c as f32);
        for col in 0..c {
            let mut d = (g[col].to_f32() * w[col] - mean_dn - norm[col] * mean_dn_norm) * r;
            if has_residual {
                let res = residual[row * c + col].to_f32();
                d += res;
                if has_colsum {
                    dr[col] += res;
                }
            }
            dx[col] = T::from_f32(d);
        }
    }
    if flags & COLUMNS == 0 {
        // The row path: the sums into slot 0, the others zero, for the column sums to add.
        let mut scratch = a.output::<f32>("scratch")?;
        scratch.fill(0.0);
        let parts = [dw, db, dr];
        scratch.chunks_exact_mut(c).zip(parts.iter()).for_each(|(slot, sums)| slot.copy_from_slice(sums));
        return Ok(());
    }
    let add = |grad: &mut [T], sums: Vec<f32>| {
        grad.iter_mut().zip(sums).for_each(|(acc, s)| *acc = T::from_f32(acc.to_f32() + s));
    };
    add(&mut a.output::<T>("dweight")?, dw);
    add(&mut a.output::<T>("dbias")?, db);
    if has_colsum {
        add(&mut a.output::<T>("dcolsum")?, dr);
    }
    Ok(())
}

const SUMS_PARAMS: &[&str] = &["dweight", "dbias", "dcolsum", "scratch", "slots", "C", "parts"];

/// The row path's second step: the blocks' column sums in the workspace added into the parameter
/// gradients of f32 (Note [LayerNorm backward's column sums]).
pub static LAYERNORM_COLUMN_SUMS_F32: Kernel = Kernel {
    name: "layernorm_column_sums_f32",
    source: SOURCE,
    params: SUMS_PARAMS,
    cpu: column_sums_cpu::<f32>,
    strided: false,
};

/// [`LAYERNORM_COLUMN_SUMS_F32`] for gradients of bf16.
pub static LAYERNORM_COLUMN_SUMS_BF16: Kernel = Kernel {
    name: "layernorm_column_sums_bf16",
    source: SOURCE,
    params: SUMS_PARAMS,
    cpu: column_sums_cpu::<bf16>,
    strided: false,
};

fn column_sums_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let scratch = a.input::<f32>("scratch")?;
    let (slots, c, parts) = (a.u32("slots")? as usize, a.u32("C")? as usize, a.u32("parts")? as usize);
    for (p, name) in ["dweight", "dbias", "dcolsum"].into_iter().enumerate().take(parts) {
        let mut grad = a.output::<T>(name)?;
        for (col, acc) in grad.iter_mut().enumerate() {
            let sum = (0..slots).map(|b| scratch[(b * 3 + p) * c + col]).fold(0.0f32, |s, v| s + v);
            *acc = T::from_f32(acc.to_f32() + sum);
        }
    }
    Ok(())
}

/// The gradient of the residual stream beside a LayerNorm, for [`layernorm_backward`] to fuse.
#[derive(Clone, Copy)]
pub struct ResidualGrad<'t> {
    /// `(N, C)`, of the input's type: added into `dinp` (the residual add's backward).
    pub grad: &'t Tensor,
    /// `(C)`, of the input's type: if given, `colsum += Σ_rows grad`, the bias gradient of the
    /// Linear whose output gradient `grad` is.
    pub colsum: Option<&'t Tensor>,
}

/// The backward's scratch for one C: `BACKWARD_BLOCKS` slots of 3·C f32 partial column sums
/// (Note [LayerNorm backward's column sums]). Launches that share a workspace are ordered by the
/// checker like any other writes to one buffer, so give concurrent backwards a workspace each.
pub struct LayerNormWorkspace {
    features: usize,
    /// `(BACKWARD_BLOCKS · 3 · C)` f32.
    scratch: Tensor,
}

impl LayerNormWorkspace {
    /// A workspace for rows of `features` (C) values, zeroed on `stream` (the backward writes
    /// every slot it reads; zeroed so that no read ever sees uninitialized memory).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for 0 or more than [`MAX_FEATURES`] features; allocation errors.
    pub fn new(alloc: &CachingAllocator, stream: &Stream, features: usize) -> Result<LayerNormWorkspace> {
        check_features("LayerNormWorkspace::new", features)?;
        Ok(LayerNormWorkspace {
            features,
            scratch: Tensor::zeros(alloc, stream, &[BACKWARD_BLOCKS * 3 * features], DType::F32)?,
        })
    }

    /// The C it serves.
    pub fn features(&self) -> usize {
        self.features
    }

    /// Its size in device memory, in bytes.
    pub fn bytes(&self) -> usize {
        self.scratch.bytes()
    }
}

/// Writes `dinp = residual.grad + LNᵀ(dout)` (without `residual`, just the LayerNorm's input
/// gradient) and accumulates `dweight += Σ_rows dout·x̂`, `dbias += Σ_rows dout` and, if
/// `residual.colsum` is given, `colsum += Σ_rows residual.grad`, with `x̂ = (inp − mean)·rstd`
/// from the `mean` and `rstd` that [`layernorm_forward`] saved for `inp`. One kernel, and a
/// second small one that adds the blocks' column sums on the row path; the activations, `weight`
/// and the gradients are all f32 or all bf16, the statistics f32.
///
/// On CUDA at most [`BACKWARD_BLOCKS`] blocks of 512 threads, one per SM, walk the rows, a row
/// group of 32 to 512 threads (C/8 rounded up to a power of two) per row, 8 values a thread kept
/// in registers between the row's two sums and its write, in 16-byte accesses where C allows, the
/// next row's `inp` and `dout` (and this row's residual) read while this row's sums cross the
/// group; each thread sums its columns' parameter gradients over its rows in registers, and the
/// blocks' sums meet as Note [LayerNorm backward's column sums] says.
///
/// Small N (at most [`backward_column_path_rows`]`(C)` rows: 8 row groups' worth, 128 rows at
/// C = 256) takes another path. The row path would launch at most 8 blocks there (8 of the
/// H200's 132 SMs, 8 at the benchmark's config S), each of one pass over its rows, and its time is
/// the blocks' partial sums going through the workspace and the column sums, not the rows. So
/// the column path splits the columns instead: min(G, 128) blocks (a power of two within one wave
/// of 132 SMs; 32 at C ≤ 256, 128 from C = 1024 on) each own a slice of every row group's lanes,
/// walk all N rows (at most 8 per row group), compute each row's two sums over the whole row as
/// the row path does, and write `dinp` and sum the parameter gradients only for their slice. A
/// column's sums never leave its block (its row groups add theirs in shared memory, in group
/// order), so there is no workspace traffic and no second kernel, and the order of additions
/// still depends only on N and C: deterministic, without atomics. The cost is that every block
/// reads all N rows of `inp` and `dout` (at most 64 K values a block, from L2), which is why the
/// path stops at 8 rows per row group. `dinp` is computed in the same order on both paths; the
/// parameter gradients differ between them by rounding (another order of additions). The launch declares the workspace
/// as read and written on both paths, so the checker orders launches that share one either way.
///
/// # Errors
/// Before anything is enqueued: [`Error::UnsupportedDType`] unless `dout` is f32 or bf16;
/// [`Error::DTypeMismatch`] for an operand of another type (`mean` and `rstd` must be f32);
/// [`Error::Shape`] unless `dout` is (N, C) with 0 < C ≤ [`MAX_FEATURES`] ([`Error::Unsupported`]
/// above it), `dinp`, `inp` and `residual.grad` (N, C), `dweight`, `dbias`, `weight` and
/// `residual.colsum` (C), `mean` and `rstd` (N), and `workspace` is for C;
/// [`Error::NotContiguous`] for a strided tensor.
#[allow(clippy::too_many_arguments)] // llm.c's order: outputs, inputs, sizes, stream
pub fn layernorm_backward(
    dinp: &Tensor,
    dweight: &Tensor,
    dbias: &Tensor,
    dout: &Tensor,
    inp: &Tensor,
    weight: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    residual: Option<ResidualGrad<'_>>,
    workspace: &LayerNormWorkspace,
    stream: &Stream,
) -> Result<()> {
    let tensors = [dinp, dweight, dbias, dout, inp, weight, mean, rstd];
    match dout.dtype() {
        DType::F32 => {
            backward::<f32>([&LAYERNORM_BACKWARD_F32, &LAYERNORM_COLUMN_SUMS_F32], tensors, residual, workspace, stream)
        }
        DType::BF16 => backward::<bf16>(
            [&LAYERNORM_BACKWARD_BF16, &LAYERNORM_COLUMN_SUMS_BF16],
            tensors,
            residual,
            workspace,
            stream,
        ),
        dtype => Err(unsupported_dtype(BACKWARD, dtype)),
    }
}

const BACKWARD: &str = "layernorm_backward";

fn backward<T: Float>(
    [kernel, sums_kernel]: [&'static Kernel; 2],
    tensors: [&Tensor; 8],
    residual: Option<ResidualGrad<'_>>,
    workspace: &LayerNormWorkspace,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = BACKWARD;
    let [dinp, dweight, dbias, dout, inp, weight, mean, rstd] = tensors;
    let (n, c) = features(OP, dout)?;
    if workspace.features != c {
        return Err(Error::Shape {
            op: OP,
            expected: format!("a LayerNormWorkspace for C = {c}"),
            found: vec![workspace.features],
        });
    }
    // An absent residual or colsum is an empty view, which declares no access; the kernel does
    // not touch it, as `flags` says.
    let (res, colsum, flags) = match residual {
        None => (dout.buffer::<T>(OP)?.slice(0..0), dbias.buffer::<T>(OP)?.slice(0..0), 0),
        Some(ResidualGrad { grad, colsum: None }) => {
            (checked::<T>(OP, "residual", grad, &[n, c])?, dbias.buffer::<T>(OP)?.slice(0..0), RESIDUAL)
        }
        Some(ResidualGrad { grad, colsum: Some(sums) }) => {
            (checked::<T>(OP, "residual", grad, &[n, c])?, checked::<T>(OP, "dcolsum", sums, &[c])?, RESIDUAL | COLSUM)
        }
    };
    let shape = BackwardShape::of(n, c);
    let flags = if shape.columns { flags | COLUMNS } else { flags };
    let args = args![
        Out(checked::<T>(OP, "dinp", dinp, &[n, c])?),
        InOut(checked::<T>(OP, "dweight", dweight, &[c])?),
        InOut(checked::<T>(OP, "dbias", dbias, &[c])?),
        InOut(colsum),
        InOut(workspace.scratch.view::<f32>()?),
        In(checked::<T>(OP, "dout", dout, &[n, c])?),
        In(checked::<T>(OP, "inp", inp, &[n, c])?),
        In(checked::<T>(OP, "weight", weight, &[c])?),
        In(checked::<f32>(OP, "mean", mean, &[n])?),
        In(checked::<f32>(OP, "rstd", rstd, &[n])?),
        In(res),
        count(OP, n)?,
        count(OP, c)?,
        count(OP, shape.group)?,
        flags,
    ];
    let mut dims = grid(OP, shape.blocks, BWD_BLOCK)?;
    dims.shared_mem_bytes = count(OP, shape.shared_floats * std::mem::size_of::<f32>())?;
    stream.launch(kernel, dims, &args)?;
    if shape.columns {
        return Ok(());
    }
    let parts: u32 = if flags & COLSUM != 0 { 3 } else { 2 };
    let sums = args![
        InOut(checked::<T>(OP, "dweight", dweight, &[c])?),
        InOut(checked::<T>(OP, "dbias", dbias, &[c])?),
        InOut(colsum),
        In(workspace.scratch.view::<f32>()?),
        count(OP, shape.blocks)?,
        count(OP, c)?,
        parts,
    ];
    stream.launch(sums_kernel, grid(OP, (parts as usize * c).div_ceil(SUM_COLUMNS), SUM_BLOCK)?, &sums)
}

/// The most rows for which [`layernorm_backward`] takes its small-N path (its column split) at C
/// = `features`: 8 rows per row group of a block.
pub fn backward_column_path_rows(features: usize) -> usize {
    COLUMN_PATH_ROWS * (BWD_BLOCK / row_group(features, BWD_VALS))
}

/// How the backward is launched for N rows of C.
#[derive(Debug, Clone, Copy, PartialEq)]
struct BackwardShape {
    /// Threads per row (`G`).
    group: usize,
    /// Blocks of `BWD_BLOCK` threads.
    blocks: usize,
    /// The small-N path (`LN_COLUMNS`).
    columns: bool,
    /// Dynamic shared memory (`block_sums`), in f32.
    shared_floats: usize,
}

impl BackwardShape {
    fn of(n: usize, c: usize) -> BackwardShape {
        let group = row_group(c, BWD_VALS);
        let groups = BWD_BLOCK / group;
        if n <= backward_column_path_rows(c) {
            // Each block's lanes are `group / blocks` of every row group: a row group's sums of
            // their 8 values in 3 parts.
            let blocks = group.min(COLUMN_BLOCKS);
            let shared_floats = groups * 3 * (group / blocks) * BWD_VALS;
            return BackwardShape { group, blocks, columns: true, shared_floats };
        }
        // Several row groups per block add their column sums in shared memory; one writes its
        // slot directly.
        let shared_floats = if groups > 1 { 3 * c } else { 0 };
        BackwardShape { group, blocks: n.div_ceil(groups).min(BACKWARD_BLOCKS), columns: false, shared_floats }
    }
}

/// The (N, C) of a LayerNorm's rows, refused unless 0 < C ≤ [`MAX_FEATURES`].
fn features(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    let (n, c) = rows_cols(op, t)?;
    check_features(op, c)?;
    Ok((n, c))
}

fn check_features(op: &'static str, c: usize) -> Result<()> {
    if c == 0 || c > MAX_FEATURES {
        return Err(Error::Unsupported {
            op,
            backend: "any",
            why: "LayerNorm rows have 1 to 4096 features (ops::layernorm::MAX_FEATURES): each thread keeps its part of a row in registers",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_cuda_source() {
        let defines = [
            format!("LN_FWD_VALS {FWD_VALS}"),
            format!("LN_BWD_VALS {BWD_VALS}"),
            format!("LN_BWD_BLOCK {BWD_BLOCK}"),
            format!("LN_SUM_RUNS {}", SUM_BLOCK / SUM_COLUMNS),
            format!("LN_RESIDUAL {RESIDUAL}u"),
            format!("LN_COLSUM {COLSUM}u"),
            format!("LN_COLUMNS {COLUMNS}u"),
        ];
        for d in defines {
            assert!(SOURCE.contains(&format!("#define {d}\n")), "layernorm.cu does not define {d}");
        }
    }

    /// The launch shapes keep the CUDA kernels' contract: a row fits its group's registers, the
    /// groups tile the block, and the widest row group fits the block.
    #[test]
    fn launch_shapes_fit_the_kernels() {
        for c in 1..=MAX_FEATURES {
            for (vals, block) in [(FWD_VALS, FWD_BLOCK), (BWD_VALS, BWD_BLOCK)] {
                let g = row_group(c, vals);
                assert!(c <= g * vals && g <= block && block.is_multiple_of(g), "C = {c}: group {g} of block {block}");
            }
        }
        assert_eq!(row_group(MAX_FEATURES, BWD_VALS), BWD_BLOCK, "the widest row fills a backward block");
    }

    /// The backward's two paths meet at [`backward_column_path_rows`], where the row path would
    /// have [`COLUMN_PATH_ROWS`] blocks; the column split divides every row group and stays
    /// within one wave of 132 SMs; each path's shared memory fits the 48 KiB a launch gets
    /// without opting in. Config S (128 rows of 256) takes the column path, M and L the row path.
    #[test]
    fn backward_paths_meet_at_the_threshold() {
        for c in (1..=MAX_FEATURES).step_by(7).chain([256, 1024, 4096]) {
            let limit = backward_column_path_rows(c);
            let (small, large) = (BackwardShape::of(limit, c), BackwardShape::of(limit + 1, c));
            assert!(small.columns && !large.columns, "C = {c}: the paths meet at {limit} rows");
            assert_eq!(limit.div_ceil(BWD_BLOCK / small.group), COLUMN_PATH_ROWS, "C = {c}");
            assert!(small.group.is_multiple_of(small.blocks) && small.blocks <= COLUMN_BLOCKS, "C = {c}: {small:?}");
            for shape in [small, large, BackwardShape::of(1, c), BackwardShape::of(100_000, c)] {
                assert!(shape.shared_floats * 4 <= 48 * 1024 && shape.blocks >= 1, "C = {c}: {shape:?}");
            }
        }
        assert_eq!(backward_column_path_rows(256), 128);
        assert_eq!(
            BackwardShape::of(128, 256),
            BackwardShape { group: 32, blocks: 32, columns: true, shared_floats: 384 }
        );
        assert!(!BackwardShape::of(4 * 512, 1024).columns && !BackwardShape::of(2 * 2048, 4096).columns);
    }
}
