//! GELU's backward fused into the E5M2 cast of its result, with the column sums of that result:
//! TransformerEngine's dgelu-cast-transpose-dbias. In FP8 training the MLP's backward computes
//! `dpre = GELU′(pre) ⊙ dact`, which FC1's backward then casts to E5M2 (row-major for its data
//! gradient, transposed for its weight gradient) and sums over rows (its bias gradient). Unfused,
//! that is three passes over `dpre` and a bf16 copy of it in memory; here it is one read of `pre`
//! and `dact` (`fp8_dgelu_cast_transpose_bf16_e5m2` in `cast_transpose.cu`), and a small second
//! kernel that adds the tiles' sums per column ([`sum_tiles`]).
//!
//! The values cast are exactly [`gelu_backward`](crate::ops::gelu::gelu_backward)'s in bf16, so
//! the FP8 bytes and the amax equal those of `gelu_backward` then [`cast_transpose`](super::cast_transpose()),
//! bit for bit. The column sums have their own fixed order (see `cast_transpose.cu`), which the
//! CPU path repeats, so each device is reproducible run to run and graphed equals eager.
//!
//! ```
//! use graphed::device::{DType, Device};
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::fp8::{dgelu_cast_transpose, sum_tiles, tile_rows};
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let bf = |v: &[f32]| Tensor::from_f32(&alloc, &s, v, &[2, 2], DType::BF16);
//! let (dact, pre) = (bf(&[1.0, 2.0, -1.0, 0.5])?, bf(&[0.0, 0.0, 0.0, 0.0])?);
//! let (q, q_t) = (Tensor::zeros(&alloc, &s, &[2, 2], DType::F8E5M2)?, Tensor::zeros(&alloc, &s, &[2, 2], DType::F8E5M2)?);
//! let (amax, scale) = (Tensor::from_host(&alloc, &s, &[0.0f32], &[1])?, Tensor::from_host(&alloc, &s, &[1.0f32], &[1])?);
//! let tiles = Tensor::zeros(&alloc, &s, &[tile_rows(2), 2], DType::F32)?;
//! dgelu_cast_transpose((&q, &q_t), &amax, &tiles, (&dact, &pre), &scale, &s)?;
//! let db = Tensor::zeros(&alloc, &s, &[2], DType::BF16)?;
//! sum_tiles(&db, &tiles, &s)?;
//! // GELU′(0) = 1/2: the gradient halves, its columns sum to 0 and 1.25, its amax is 1.
//! assert_eq!(q.to_f32_vec(&s)?, vec![0.5, 1.0, -0.5, 0.25]);
//! assert_eq!(db.to_f32_vec(&s)?, vec![0.0, 1.25]);
//! assert_eq!(amax.to_vec::<f32>(&s)?, vec![1.0]);
//! # Ok::<(), graphed::Error>(())
//! ```

use float8::{F8E4M3, F8E5M2};
use half::bf16;

use super::cast_transpose::{cast_values_cpu, matrix, TILE_COLS, TILE_ROWS, TILE_THREADS};
use super::SOURCE;
use crate::device::{args, Arg, CpuArgs, DType, Elem, Float8, In, InOut, Kernel, Out, Stream};
use crate::ops::cast::one_f32;
use crate::ops::gelu::gelu_grad;
use crate::ops::{checked, column_sums, count, dense, grid};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The parameters of both [`DGELU_CAST_TRANSPOSE`] kernels.
const DGELU_PARAMS: &[&str] = &["out", "out_t", "amax", "tile_sums", "dout", "pre", "scale", "rows", "cols"];

/// `fp8_dgelu_cast_transpose_bf16_e5m2` and `…_e4m3` in `cast_transpose.cu`, by output format.
pub static DGELU_CAST_TRANSPOSE: [Kernel; 2] = [
    Kernel {
        name: "fp8_dgelu_cast_transpose_bf16_e5m2",
        source: SOURCE,
        params: DGELU_PARAMS,
        cpu: dgelu_cast_cpu::<F8E5M2>,
        strided: false,
    },
    Kernel {
        name: "fp8_dgelu_cast_transpose_bf16_e4m3",
        source: SOURCE,
        params: DGELU_PARAMS,
        cpu: dgelu_cast_cpu::<F8E4M3>,
        strided: false,
    },
];

/// `fp8_sum_tiles_bf16` in `cast_transpose.cu`.
pub static SUM_TILES: Kernel = Kernel {
    name: "fp8_sum_tiles_bf16",
    source: SOURCE,
    params: &["out", "tile_sums", "tiles", "cols"],
    cpu: sum_tiles_cpu,
    strided: false,
};

/// The threads of a [`sum_tiles`] block: 64, so that L's 16384 columns make 256 blocks, about
/// two per SM, each thread's loads in flight together.
const SUM_THREADS: usize = 64;

/// bf16 elements of one 16-byte load, and the threads that load one tile row (`CtGeometry`).
const LANES: usize = 8;
const THREADS_PER_ROW: usize = TILE_COLS / LANES;
/// Rows of a tile a block's threads cover in one pass, and threads of one column in a warp.
const ROWS_PER_PASS: usize = TILE_THREADS / THREADS_PER_ROW;
const ROWS_PER_WARP: usize = 32 / THREADS_PER_ROW;

/// The rows of the `tile_sums` that [`dgelu_cast_transpose`] writes for a matrix of `rows` rows:
/// one per tile of 64 rows.
pub fn tile_rows(rows: usize) -> usize {
    rows.div_ceil(TILE_ROWS)
}

/// GELU's backward, `g = bf16(GELU′(pre) · dout)` (as [`gelu_backward`](crate::ops::gelu::gelu_backward)
/// in bf16), cast to E5M2 or E4M3 (the outputs' type) with `scale` into `out` (`[rows, cols]`)
/// and `out_t` (its transpose), its
/// amax folded into `amax`, and the column sums of `g` over each tile of 64 rows written to
/// `tile_sums` (`[tile_rows(rows), cols]`, f32), which [`sum_tiles`] adds up: one pass over `pre`
/// and `dout` (`[rows, cols]`, bf16).
///
/// # Errors
/// [`Error::UnsupportedDType`] unless `dout` and `pre` are bf16 and `out` E5M2 or E4M3;
/// [`Error::DTypeMismatch`] unless `out_t` is of `out`'s type and `tile_sums`, `amax` and `scale`
/// f32; [`Error::Shape`] for shapes that do not match; [`Error::NotContiguous`] for a strided
/// tensor; all before anything is enqueued.
pub fn dgelu_cast_transpose(
    (out, out_t): (&Tensor, &Tensor),
    amax: &Tensor,
    tile_sums: &Tensor,
    (dout, pre): (&Tensor, &Tensor),
    scale: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "dgelu_cast_transpose";
    let (rows, cols) = matrix(OP, dout)?;
    for t in [dout, pre] {
        if t.dtype() != DType::BF16 {
            return Err(Error::UnsupportedDType { op: OP, dtype: t.dtype(), supported: "bf16" });
        }
    }
    let (kernel, [out, out_t]) = match out.dtype() {
        DType::F8E5M2 => (&DGELU_CAST_TRANSPOSE[0], outputs::<F8E5M2>(OP, out, out_t, (rows, cols))?),
        DType::F8E4M3 => (&DGELU_CAST_TRANSPOSE[1], outputs::<F8E4M3>(OP, out, out_t, (rows, cols))?),
        dtype => return Err(Error::UnsupportedDType { op: OP, dtype, supported: "f8e5m2 or f8e4m3 outputs" }),
    };
    let list = args![
        out,
        out_t,
        InOut(one_f32(OP, amax)?),
        Out(checked::<f32>(OP, "tile_sums", tile_sums, &[tile_rows(rows), cols])?),
        In(dense::<bf16>(OP, dout)?),
        In(checked::<bf16>(OP, "pre", pre, &[rows, cols])?),
        In(one_f32(OP, scale)?),
        count(OP, rows)?,
        count(OP, cols)?,
    ];
    count(OP, rows * cols)?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let tiles = tile_rows(rows) * cols.div_ceil(TILE_COLS);
    stream.launch(kernel, grid(OP, tiles, TILE_THREADS)?, &list)
}

/// `out` (`[rows, cols]`) and `out_t` (`[cols, rows]`) as outputs of `O`, the FP8 format the
/// kernel writes.
fn outputs<'t, O: Elem>(
    op: &'static str,
    out: &'t Tensor,
    out_t: &'t Tensor,
    (rows, cols): (usize, usize),
) -> Result<[Arg<'t>; 2]> {
    Ok([
        Out(checked::<O>(op, "out", out, &[rows, cols])?).into(),
        Out(checked::<O>(op, "out_t", out_t, &[cols, rows])?).into(),
    ])
}

/// `out[c] = Σ_t tile_sums[t, c]`, in tile order from 0, rounded once to bf16: the column sums
/// of the matrix that [`dgelu_cast_transpose`] wrote `tile_sums` (`[tiles, cols]`, f32) for.
///
/// # Errors
/// [`Error::DTypeMismatch`] unless `out` is bf16 and `tile_sums` f32; [`Error::Shape`] unless
/// `out` is `[cols]`; [`Error::NotContiguous`] for a strided tensor; before anything is enqueued.
pub fn sum_tiles(out: &Tensor, tile_sums: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "sum_tiles";
    let [tiles, cols] = *tile_sums.shape() else {
        return Err(Error::Shape { op: OP, expected: "[tiles, cols]".into(), found: tile_sums.shape().to_vec() });
    };
    let list = args![
        Out(checked::<bf16>(OP, "out", out, &[cols])?),
        In(dense::<f32>(OP, tile_sums)?),
        count(OP, tiles)?,
        count(OP, cols)?,
    ];
    count(OP, tiles * cols)?;
    if cols == 0 {
        return Ok(());
    }
    stream.launch(&SUM_TILES, grid(OP, cols.div_ceil(SUM_THREADS), SUM_THREADS)?, &list)
}

fn dgelu_cast_cpu<O: Float8>(a: &CpuArgs) -> Result<()> {
    let (dout, pre) = (a.input::<bf16>("dout")?, a.input::<bf16>("pre")?);
    let (rows, cols) = (a.u32("rows")? as usize, a.u32("cols")? as usize);
    let g: Vec<f32> = (pre.iter().zip(dout.iter()))
        .map(|(p, d)| bf16::from_f32(gelu_grad(p.to_f32()) * d.to_f32()).to_f32())
        .take(rows * cols)
        .collect();
    for (t, row) in a.output::<f32>("tile_sums")?.chunks_mut(cols).enumerate().take(tile_rows(rows)) {
        for (c, sum) in row.iter_mut().enumerate() {
            *sum = tile_column_sum(&g, (rows, cols), t * TILE_ROWS, c);
        }
    }
    cast_values_cpu::<O, true, true>(a, g.into_iter())
}

/// Column `c`'s sum over the tile from row `r0`, in the kernel's order: each thread adds its rows
/// (`first`, `first + 32`, …) from 0, the threads of a warp combine as a butterfly (lane `j` adds
/// lane `j ^ d`'s value for d = 1, 2, …), and the warps are added in order from 0.
fn tile_column_sum(g: &[f32], (rows, cols): (usize, usize), r0: usize, c: usize) -> f32 {
    let thread = |first: usize| {
        (first..TILE_ROWS)
            .step_by(ROWS_PER_PASS)
            .map(|r| r0 + r)
            .filter(|&r| r < rows)
            .fold(0.0f32, |s, r| s + g[r * cols + c])
    };
    (0..TILE_THREADS / 32).fold(0.0f32, |total, warp| {
        let mut v: Vec<f32> = (0..ROWS_PER_WARP).map(|j| thread(warp * ROWS_PER_WARP + j)).collect();
        let mut d = 1;
        while d < ROWS_PER_WARP {
            v = (0..ROWS_PER_WARP).map(|j| v[j] + v[j ^ d]).collect();
            d *= 2;
        }
        total + v[0]
    })
}

fn sum_tiles_cpu(a: &CpuArgs) -> Result<()> {
    let (tiles, cols) = (a.u32("tiles")? as usize, a.u32("cols")? as usize);
    let sums = column_sums(&a.input::<f32>("tile_sums")?[..tiles * cols], cols);
    a.output::<bf16>("out")?.iter_mut().zip(sums).for_each(|(out, s)| *out = bf16::from_f32(s));
    Ok(())
}
