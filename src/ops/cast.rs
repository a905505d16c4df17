//! Casts between f32 and bf16 (mixed-precision weights and activations), FP8 quantization with a
//! per-tensor scale, and the residual add, each one CUDA template in `cast.cu` with an entry
//! point per element type and one generic CPU path here. Casts round to nearest, ties to even,
//! and are bitwise equal to [`half::bf16::from_f32`] and [`half::bf16::to_f32`] on both devices
//! (the CUDA side does the same integer operations on the bits); FP8 conversions are
//! [`Float8`]'s, likewise on both; the residual add is one f32 add, rounded once.
//!
//! ```
//! use graphed::device::{DType, Device};
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::cast;
//! use graphed::tensor::Tensor;
//! use half::bf16;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let x = Tensor::from_host(&alloc, &s, &[1.0f32, 1.00390625, 3.0e38], &[3])?;
//! let h = Tensor::zeros(&alloc, &s, &[3], DType::BF16)?;
//! cast::cast(&h, &x, &s)?;
//! let h = h.to_vec::<half::bf16>(&s)?;
//! assert_eq!(h[1], bf16::ONE, "1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even");
//! assert_eq!(h[2].to_bits(), bf16::from_f32(3.0e38).to_bits());
//! # Ok::<(), graphed::Error>(())
//! ```

use float8::{F8E4M3, F8E5M2};
use half::bf16;

use super::{count, dense, float_dtype, lanes, stride_dims, unsupported_dtype, with_float, PerFloat, FLOATS};
use crate::device::{args, CpuArgs, DType, Elem, Float, Float8, In, Kernel, Out, Stream, View};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("fp8.cu"), include_str!("cast.cu"));

/// f32 → bf16.
pub static CAST_F32_TO_BF16: Kernel = Kernel {
    name: "cast_f32_to_bf16",
    source: SOURCE,
    params: &["out", "inp", "n"],
    cpu: cast_cpu::<bf16, f32>,
    strided: false,
};

/// bf16 → f32.
pub static CAST_BF16_TO_F32: Kernel = Kernel {
    name: "cast_bf16_to_f32",
    source: SOURCE,
    params: &["out", "inp", "n"],
    cpu: cast_cpu::<f32, bf16>,
    strided: false,
};

fn cast_cpu<O: Float, I: Float>(a: &CpuArgs) -> Result<()> {
    let inp = a.input::<I>("inp")?;
    a.output::<O>("out")?.iter_mut().zip(inp.iter()).for_each(|(y, x)| *y = O::from_f32(x.to_f32()));
    Ok(())
}

/// `out = inp` converted to `out`'s element type: f32 → bf16 rounds to nearest even, bf16 → f32
/// is exact, and between tensors of one type (f32 or bf16) it is a copy. Shapes equal, both
/// contiguous.
///
/// # Errors
/// [`Error::UnsupportedDType`] for an element type other than f32 and bf16; [`Error::Shape`] for
/// unequal shapes; [`Error::NotContiguous`] for a strided tensor; all before anything is enqueued.
pub fn cast(out: &Tensor, inp: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "cast";
    for t in [out, inp] {
        if !matches!(t.dtype(), DType::F32 | DType::BF16) {
            return Err(Error::UnsupportedDType { op: OP, dtype: t.dtype(), supported: FLOATS });
        }
    }
    out.expect_shape(OP, inp.shape())?;
    let n = count(OP, inp.numel())?;
    if n == 0 {
        return Ok(());
    }
    let dims = stride_dims(inp.numel().div_ceil(8));
    match (out.dtype(), inp.dtype()) {
        (DType::BF16, DType::F32) => {
            stream.launch(&CAST_F32_TO_BF16, dims, &args![Out(dense::<bf16>(OP, out)?), In(dense::<f32>(OP, inp)?), n])
        }
        (DType::F32, DType::BF16) => {
            stream.launch(&CAST_BF16_TO_F32, dims, &args![Out(dense::<f32>(OP, out)?), In(dense::<bf16>(OP, inp)?), n])
        }
        (dtype, _) => with_float!(OP, dtype, T => stream.copy_d2d(dense::<T>(OP, inp)?, dense::<T>(OP, out)?)),
    }
}

/// `out = a + b` in f32.
pub static RESIDUAL_ADD: Kernel = Kernel {
    name: "residual_add_f32",
    source: SOURCE,
    params: &["out", "a", "b", "n"],
    cpu: residual_add_cpu::<f32>,
    strided: false,
};

/// `out = bf16(a + b)`, added in f32.
pub static RESIDUAL_ADD_BF16: Kernel = Kernel {
    name: "residual_add_bf16",
    source: SOURCE,
    params: &["out", "a", "b", "n"],
    cpu: residual_add_cpu::<bf16>,
    strided: false,
};

fn residual_add_cpu<T: Float>(args: &CpuArgs) -> Result<()> {
    let (a, b) = (args.input::<T>("a")?, args.input::<T>("b")?);
    let mut out = args.output::<T>("out")?;
    out.iter_mut().zip(a.iter().zip(b.iter())).for_each(|(y, (a, b))| *y = T::from_f32(a.to_f32() + b.to_f32()));
    Ok(())
}

/// `out = a + b` (a residual connection's forward; its backward passes the gradient to both
/// inputs unchanged), in f32 or bf16 (added in f32, rounded once); shapes and element types
/// equal, all contiguous. Bitwise equal on both devices.
///
/// # Errors
/// [`Error::UnsupportedDType`] or [`Error::DTypeMismatch`] for other element types;
/// [`Error::Shape`] for unequal shapes; [`Error::NotContiguous`] for a strided tensor; all before
/// anything is enqueued.
pub fn residual_add(out: &Tensor, a: &Tensor, b: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "residual_add";
    let dtype = float_dtype(OP, out, &[a, b])?;
    out.expect_shape(OP, a.shape())?;
    b.expect_shape(OP, a.shape())?;
    let n = count(OP, a.numel())?;
    if n == 0 {
        return Ok(());
    }
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &RESIDUAL_ADD, bf16: &RESIDUAL_ADD_BF16 }.of::<T>(OP)?;
        let (out, a, b) = (dense::<T>(OP, out)?, dense::<T>(OP, a)?, dense::<T>(OP, b)?);
        stream.launch(kernel, stride_dims(a.len().div_ceil(lanes::<T>())), &args![Out(out), In(a), In(b), n])
    })
}

/// The FP8 element types (for [`Error::UnsupportedDType`]).
pub(crate) const FP8: &str = "f8e4m3 or f8e5m2";

/// The FP8 conversion kernels: `name`, the scale's parameter name, the CPU path.
macro_rules! fp8_kernels {
    ($($(#[$doc:meta])* $id:ident = $name:literal, $scale:literal, $cpu:expr;)*) => {$(
        $(#[$doc])*
        pub static $id: Kernel =
            Kernel { name: $name, source: SOURCE, params: &["out", "inp", $scale, "n"], cpu: $cpu, strided: false };
    )*};
}

fp8_kernels! {
    /// f32 → E4M3, scaled.
    QUANTIZE_F32_TO_E4M3 = "quantize_f32_to_e4m3", "scale", quantize_cpu::<F8E4M3, f32>;
    /// f32 → E5M2, scaled.
    QUANTIZE_F32_TO_E5M2 = "quantize_f32_to_e5m2", "scale", quantize_cpu::<F8E5M2, f32>;
    /// bf16 → E4M3, scaled.
    QUANTIZE_BF16_TO_E4M3 = "quantize_bf16_to_e4m3", "scale", quantize_cpu::<F8E4M3, bf16>;
    /// bf16 → E5M2, scaled.
    QUANTIZE_BF16_TO_E5M2 = "quantize_bf16_to_e5m2", "scale", quantize_cpu::<F8E5M2, bf16>;
    /// E4M3 → f32, scaled.
    DEQUANTIZE_E4M3_TO_F32 = "dequantize_e4m3_to_f32", "scale_inv", dequantize_cpu::<f32, F8E4M3>;
    /// E5M2 → f32, scaled.
    DEQUANTIZE_E5M2_TO_F32 = "dequantize_e5m2_to_f32", "scale_inv", dequantize_cpu::<f32, F8E5M2>;
    /// E4M3 → bf16, scaled in f32 and rounded once.
    DEQUANTIZE_E4M3_TO_BF16 = "dequantize_e4m3_to_bf16", "scale_inv", dequantize_cpu::<bf16, F8E4M3>;
    /// E5M2 → bf16, scaled in f32 and rounded once.
    DEQUANTIZE_E5M2_TO_BF16 = "dequantize_e5m2_to_bf16", "scale_inv", dequantize_cpu::<bf16, F8E5M2>;
}

fn quantize_cpu<O: Float8, I: Float>(a: &CpuArgs) -> Result<()> {
    let (inp, scale) = (a.input::<I>("inp")?, scale_of(a, "scale")?);
    a.output::<O>("out")?.iter_mut().zip(inp.iter()).for_each(|(y, x)| *y = O::from_f32(x.to_f32() * scale));
    Ok(())
}

fn dequantize_cpu<O: Float, I: Float8>(a: &CpuArgs) -> Result<()> {
    let (inp, scale) = (a.input::<I>("inp")?, scale_of(a, "scale_inv")?);
    let mut out = a.output::<O>("out")?;
    out.iter_mut().zip(inp.iter()).for_each(|(y, x)| *y = O::from_f32(canonical(x.to_f32() * scale)));
    Ok(())
}

/// NaN as the GPU's f32 arithmetic returns it (`0x7fffffff`); a CPU's multiply may return
/// another one (x86 gives `0xffc00000` for ∞ · 0).
pub(crate) fn canonical(v: f32) -> f32 {
    if v.is_nan() {
        f32::from_bits(0x7fff_ffff)
    } else {
        v
    }
}

/// The scale a CPU path received as parameter `param`.
pub(crate) fn scale_of(a: &CpuArgs, param: &str) -> Result<f32> {
    a.input::<f32>(param)?.first().copied().ok_or_else(|| Error::KernelArg {
        kernel: a.kernel.name,
        param: param.into(),
        expected: "an f32 buffer of 1 element".into(),
        found: "an empty buffer".into(),
    })
}

/// `out = fp8(inp · scale)`, `scale` a one-element f32 tensor on the device (FP8 recipes keep
/// their scales there, so a replayed graph uses the scale of its replay and the host reads
/// nothing). `inp` f32 or bf16, `out` [`DType::F8E4M3`] or [`DType::F8E5M2`], shapes equal, all
/// contiguous. The product is one f32 multiply, rounded to nearest even, saturated to the
/// largest finite value (±448, ±57344), NaN to `0x7f` ([`Float8`]); bitwise equal on both
/// devices.
///
/// # Errors
/// [`Error::UnsupportedDType`] for other element types; [`Error::DTypeMismatch`] or
/// [`Error::Shape`] for a scale that is not one f32; [`Error::Shape`] for unequal shapes;
/// [`Error::NotContiguous`] for a strided tensor; all before anything is enqueued.
pub fn quantize(out: &Tensor, inp: &Tensor, scale: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "quantize";
    let ops = (out, inp, scale, stream);
    match (out.dtype(), inp.dtype()) {
        (DType::F8E4M3, DType::F32) => scaled::<F8E4M3, f32>(OP, &QUANTIZE_F32_TO_E4M3, ops),
        (DType::F8E5M2, DType::F32) => scaled::<F8E5M2, f32>(OP, &QUANTIZE_F32_TO_E5M2, ops),
        (DType::F8E4M3, DType::BF16) => scaled::<F8E4M3, bf16>(OP, &QUANTIZE_BF16_TO_E4M3, ops),
        (DType::F8E5M2, DType::BF16) => scaled::<F8E5M2, bf16>(OP, &QUANTIZE_BF16_TO_E5M2, ops),
        (DType::F8E4M3 | DType::F8E5M2, dtype) => Err(unsupported_dtype(OP, dtype)),
        (dtype, _) => Err(Error::UnsupportedDType { op: OP, dtype, supported: FP8 }),
    }
}

/// `out = f32(inp) · scale_inv`, rounded to `out`'s type once: the inverse of [`quantize`] with
/// `scale_inv = 1 / scale`, read from the device as `scale` is. `inp` [`DType::F8E4M3`] or
/// [`DType::F8E5M2`], `out` f32 or bf16, shapes equal, all contiguous. Widening is exact; NaNs come
/// out as the canonical NaN. Bitwise equal on both devices.
///
/// # Errors
/// As [`quantize`].
pub fn dequantize(out: &Tensor, inp: &Tensor, scale_inv: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "dequantize";
    let ops = (out, inp, scale_inv, stream);
    match (out.dtype(), inp.dtype()) {
        (DType::F32, DType::F8E4M3) => scaled::<f32, F8E4M3>(OP, &DEQUANTIZE_E4M3_TO_F32, ops),
        (DType::F32, DType::F8E5M2) => scaled::<f32, F8E5M2>(OP, &DEQUANTIZE_E5M2_TO_F32, ops),
        (DType::BF16, DType::F8E4M3) => scaled::<bf16, F8E4M3>(OP, &DEQUANTIZE_E4M3_TO_BF16, ops),
        (DType::BF16, DType::F8E5M2) => scaled::<bf16, F8E5M2>(OP, &DEQUANTIZE_E5M2_TO_BF16, ops),
        (DType::F32 | DType::BF16, dtype) => Err(Error::UnsupportedDType { op: OP, dtype, supported: FP8 }),
        (dtype, _) => Err(unsupported_dtype(OP, dtype)),
    }
}

/// Checks the operands (output, input, scale, stream) of an FP8 conversion whose element types
/// `kernel` takes, and launches it.
fn scaled<O: Elem, I: Elem>(
    op: &'static str,
    kernel: &'static Kernel,
    (out, inp, scale, stream): (&Tensor, &Tensor, &Tensor, &Stream),
) -> Result<()> {
    let scale = one_f32(op, scale)?;
    out.expect_shape(op, inp.shape())?;
    let (out, inp) = (dense::<O>(op, out)?, dense::<I>(op, inp)?);
    let n = count(op, inp.len())?;
    if n == 0 {
        return Ok(());
    }
    stream.launch(kernel, stride_dims(inp.len().div_ceil(16)), &args![Out(out), In(inp), In(scale), n])
}

/// A scale's view: an f32 tensor of one element (of any shape).
pub(crate) fn one_f32<'t>(op: &'static str, t: &'t Tensor) -> Result<View<'t, f32>> {
    if t.numel() != 1 {
        return Err(Error::Shape { op, expected: "a scale of 1 f32 element".into(), found: t.shape().to_vec() });
    }
    dense::<f32>(op, t)
}
