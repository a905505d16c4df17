//! The fused FP8 cast of a matrix, TransformerEngine's cast_transpose: Hopper's FP8 GEMMs take
//! both operands with K contiguous, so the backward needs activations, gradients and weights
//! transposed as well as row-major. One read of x writes `fp8(x · scale)` in either layout or
//! both, and records max |x| for the recipe (`cast_transpose.cu`: tiles through shared memory,
//! 16-byte loads and 4-byte transposed stores, a block per tile).

use float8::{F8E4M3, F8E5M2};
use half::bf16;

use super::amax::{accumulate_amax, amax_bits};
use super::SOURCE;
use crate::device::{Arg, CpuArgs, DType, Elem, Float, Float8, In, InOut, Kernel, Out, Stream};
use crate::ops::cast::{one_f32, scale_of, FP8};
use crate::ops::{checked, count, dense, grid, unsupported_dtype};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// `CT_ROWS` and `CT_COLS` in `cast_transpose.cu`: the tile a block converts per trip.
pub(super) const TILE_ROWS: usize = 64;
pub(super) const TILE_COLS: usize = 64;
/// `CT_BLOCK`: the threads of a block.
pub(super) const TILE_THREADS: usize = 256;

const BOTH: &[&str] = &["out", "out_t", "amax", "inp", "scale", "rows", "cols"];
const ROWS: &[&str] = &["out", "amax", "inp", "scale", "rows", "cols"];
const COLS: &[&str] = &["out_t", "amax", "inp", "scale", "rows", "cols"];

/// Declares the kernels, one per (input type, format, outputs), and their table.
macro_rules! cast_kernels {
    ($($static:ident = $name:literal, $params:ident, $o:ty, $i:ty, $row:literal, $col:literal;)*) => {
        $(
            #[doc = concat!("`", $name, "` in `cast_transpose.cu`.")]
            pub(crate) static $static: Kernel = Kernel {
                name: $name, source: SOURCE, params: $params, cpu: cast_cpu::<$o, $i, $row, $col>, strided: false,
            };
        )*
        /// Every kernel of [`cast_transpose`]: f32 then bf16 input, E4M3 then E5M2, and for each
        /// both outputs, the row-major one, the transposed one.
        pub static CAST_TRANSPOSE: [&Kernel; 12] = [$(&$static),*];
    };
}

cast_kernels! {
    CT_F32_E4M3 = "fp8_cast_transpose_f32_e4m3", BOTH, F8E4M3, f32, true, true;
    ROWS_F32_E4M3 = "fp8_cast_rows_f32_e4m3", ROWS, F8E4M3, f32, true, false;
    COLS_F32_E4M3 = "fp8_cast_cols_f32_e4m3", COLS, F8E4M3, f32, false, true;
    CT_F32_E5M2 = "fp8_cast_transpose_f32_e5m2", BOTH, F8E5M2, f32, true, true;
    ROWS_F32_E5M2 = "fp8_cast_rows_f32_e5m2", ROWS, F8E5M2, f32, true, false;
    COLS_F32_E5M2 = "fp8_cast_cols_f32_e5m2", COLS, F8E5M2, f32, false, true;
    CT_BF16_E4M3 = "fp8_cast_transpose_bf16_e4m3", BOTH, F8E4M3, bf16, true, true;
    ROWS_BF16_E4M3 = "fp8_cast_rows_bf16_e4m3", ROWS, F8E4M3, bf16, true, false;
    COLS_BF16_E4M3 = "fp8_cast_cols_bf16_e4m3", COLS, F8E4M3, bf16, false, true;
    CT_BF16_E5M2 = "fp8_cast_transpose_bf16_e5m2", BOTH, F8E5M2, bf16, true, true;
    ROWS_BF16_E5M2 = "fp8_cast_rows_bf16_e5m2", ROWS, F8E5M2, bf16, true, false;
    COLS_BF16_E5M2 = "fp8_cast_cols_bf16_e5m2", COLS, F8E5M2, bf16, false, true;
}

/// The rows and columns of `t`, which the tile kernels read as one matrix; [`Error::Shape`]
/// naming `op` for another rank.
pub(super) fn matrix(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match *t.shape() {
        [rows, cols] => Ok((rows, cols)),
        _ => Err(Error::Shape { op, expected: "a matrix [rows, cols]".into(), found: t.shape().to_vec() }),
    }
}

fn cast_cpu<O: Float8, I: Float, const ROW: bool, const COL: bool>(a: &CpuArgs) -> Result<()> {
    let inp = a.input::<I>("inp")?;
    cast_values_cpu::<O, ROW, COL>(a, inp.iter().map(|x| x.to_f32()))
}

/// The CPU path of every cast here once its values are known: `values` (row-major, `rows × cols`
/// of the call) converted into the outputs the call has, their amax folded into its slot.
pub(super) fn cast_values_cpu<O: Float8, const ROW: bool, const COL: bool>(
    a: &CpuArgs,
    values: impl Iterator<Item = f32>,
) -> Result<()> {
    let s = scale_of(a, "scale")?;
    let (rows, cols) = (a.u32("rows")? as usize, a.u32("cols")? as usize);
    let mut out = if ROW { Some(a.output::<O>("out")?) } else { None };
    let mut out_t = if COL { Some(a.output::<O>("out_t")?) } else { None };
    let mut bits = 0;
    for (at, x) in values.enumerate().take(rows * cols) {
        bits = bits.max(amax_bits(x));
        let q = O::from_f32(x * s);
        if let Some(out) = out.as_deref_mut() {
            out[at] = q;
        }
        if let Some(out_t) = out_t.as_deref_mut() {
            out_t[at % cols * rows + at / cols] = q;
        }
    }
    accumulate_amax(a, bits)
}

/// In one pass over `inp` (`[rows, cols]`, f32 or bf16): `out = fp8(inp · scale)` (`[rows,
/// cols]`), `out_t` its transpose (`[cols, rows]`, row-major), either or both, and
/// `amax = max(amax, max |inp|)` as [`amax`](super::amax()) accumulates it (the recipes zero the
/// slot of the step). The outputs are FP8 of one format; `scale` and `amax` are one f32 each on
/// the device, read and written by the kernel. Each element is converted as
/// [`quantize`](crate::ops::cast::quantize) converts it, bit for bit, on both devices.
///
/// # Errors
/// [`Error::Unsupported`] without an output; [`Error::UnsupportedDType`] for other element
/// types; [`Error::DTypeMismatch`] for outputs of two formats or a scale or amax not f32;
/// [`Error::Shape`] for shapes that do not match; [`Error::NotContiguous`] for a strided tensor;
/// all before anything is enqueued.
pub fn cast_transpose(
    out: Option<&Tensor>,
    out_t: Option<&Tensor>,
    amax: &Tensor,
    inp: &Tensor,
    scale: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "cast_transpose";
    let (rows, cols) = matrix(OP, inp)?;
    let outputs = match (out, out_t) {
        (Some(o), Some(t)) => {
            t.expect_dtype(OP, o.dtype())?;
            Outputs::Both(o, t)
        }
        (Some(o), None) => Outputs::Rows(o),
        (None, Some(t)) => Outputs::Cols(t),
        (None, None) => {
            return Err(Error::Unsupported { op: OP, backend: "any", why: "no output: pass out, out_t or both" })
        }
    };
    let operands = Operands { outputs, amax, inp, scale, rows, cols };
    match (operands.outputs.format(), inp.dtype()) {
        (DType::F8E4M3, DType::F32) => operands.launch::<F8E4M3, f32>(OP, 0, stream),
        (DType::F8E5M2, DType::F32) => operands.launch::<F8E5M2, f32>(OP, 3, stream),
        (DType::F8E4M3, DType::BF16) => operands.launch::<F8E4M3, bf16>(OP, 6, stream),
        (DType::F8E5M2, DType::BF16) => operands.launch::<F8E5M2, bf16>(OP, 9, stream),
        (DType::F8E4M3 | DType::F8E5M2, dtype) => Err(unsupported_dtype(OP, dtype)),
        (dtype, _) => Err(Error::UnsupportedDType { op: OP, dtype, supported: FP8 }),
    }
}

/// The outputs of a [`cast_transpose`] call: at least one.
#[derive(Clone, Copy)]
enum Outputs<'a> {
    Both(&'a Tensor, &'a Tensor),
    Rows(&'a Tensor),
    Cols(&'a Tensor),
}

impl Outputs<'_> {
    /// The element type of the (first) output.
    fn format(self) -> DType {
        match self {
            Outputs::Both(t, _) | Outputs::Rows(t) | Outputs::Cols(t) => t.dtype(),
        }
    }
}

/// The operands of one [`cast_transpose`] call.
struct Operands<'a> {
    outputs: Outputs<'a>,
    amax: &'a Tensor,
    inp: &'a Tensor,
    scale: &'a Tensor,
    rows: usize,
    cols: usize,
}

impl Operands<'_> {
    /// Checks the operands as `O` from `I` and launches the kernel of [`CAST_TRANSPOSE`] at
    /// `first` plus the outputs' offset.
    fn launch<O: Elem, I: Elem>(&self, op: &'static str, first: usize, stream: &Stream) -> Result<()> {
        let (rows, cols) = (self.rows, self.cols);
        let (amax, scale, inp) = (one_f32(op, self.amax)?, one_f32(op, self.scale)?, dense::<I>(op, self.inp)?);
        let (shape, shape_t) = ([rows, cols], [cols, rows]);
        let (which, mut list): (usize, Vec<Arg>) = match self.outputs {
            Outputs::Both(o, t) => (
                0,
                vec![
                    Out(checked::<O>(op, "out", o, &shape)?).into(),
                    Out(checked::<O>(op, "out_t", t, &shape_t)?).into(),
                ],
            ),
            Outputs::Rows(o) => (1, vec![Out(checked::<O>(op, "out", o, &shape)?).into()]),
            Outputs::Cols(t) => (2, vec![Out(checked::<O>(op, "out_t", t, &shape_t)?).into()]),
        };
        let (r, c) = (count(op, rows)?, count(op, cols)?);
        count(op, rows * cols)?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        list.extend([InOut(amax).into(), In(inp).into(), In(scale).into(), r.into(), c.into()]);
        let tiles = rows.div_ceil(TILE_ROWS) * cols.div_ceil(TILE_COLS);
        // A block per tile, not one wave of blocks looping over tiles (`cast_transpose.cu`).
        stream.launch(CAST_TRANSPOSE[first + which], grid(op, tiles, TILE_THREADS)?, &list)
    }
}
