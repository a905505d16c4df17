//! Casts between f32 and bf16 (mixed-precision weights and activations) and the residual add,
//! each one CUDA template in `cast.cu` with an entry point per element type and one generic CPU
//! path here. Casts round to nearest, ties to even, and are bitwise equal to
//! [`half::bf16::from_f32`] and [`half::bf16::to_f32`] on both devices (the CUDA side does the
//! same integer operations on the bits); the residual add is one f32 add, rounded once.
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

use half::bf16;

use super::{count, dense, float_dtype, lanes, stride_dims, with_float, PerFloat, FLOATS};
use crate::device::{args, CpuArgs, DType, Float, In, Kernel, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("cast.cu"));

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
