//! Casts between f32 and bf16 (mixed-precision weights and activations) and the residual add.
//! The CPU paths sit beside the CUDA entry points in `cast.cu`. Casts round to nearest, ties to
//! even, and are bitwise equal to [`half::bf16::from_f32`] and [`half::bf16::to_f32`] on both
//! devices (the CUDA side does the same integer operations on the bits).
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::cast;
//! use graphed::tensor::Tensor;
//! use half::bf16;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let x = Tensor::from_host(&alloc, &s, &[1.0f32, 1.00390625, 3.0e38], &[3])?;
//! let h = Tensor::zeros(&alloc, &s, &[3], graphed::device::DType::BF16)?;
//! cast::cast_f32_to_bf16(&h, &x, &s)?;
//! let h = h.to_vec::<half::bf16>(&s)?;
//! assert_eq!(h[1], bf16::ONE, "1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even");
//! assert_eq!(h[2].to_bits(), bf16::from_f32(3.0e38).to_bits());
//! # Ok::<(), graphed::Error>(())
//! ```

use super::dense;
use half::bf16;

use crate::device::{args, CpuArgs, In, Kernel, LaunchDims, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = include_str!("cast.cu");

/// f32 → bf16.
pub static CAST_F32_TO_BF16: Kernel = Kernel {
    name: "cast_f32_to_bf16",
    source: SOURCE,
    params: &["out", "inp", "n"],
    cpu: f32_to_bf16_cpu,
    strided: false,
};

fn f32_to_bf16_cpu(a: &CpuArgs) -> Result<()> {
    let inp = a.input::<f32>("inp")?;
    a.output::<bf16>("out")?.iter_mut().zip(inp.iter()).for_each(|(y, &x)| *y = bf16::from_f32(x));
    Ok(())
}

/// `out = bf16(inp)`, rounding to nearest even; shapes equal, both contiguous.
///
/// # Errors
/// [`Error::Shape`] for unequal shapes; [`Error::NotContiguous`] for a strided tensor.
pub fn cast_f32_to_bf16(out: &Tensor, inp: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "cast_f32_to_bf16";
    out.expect_shape(OP, inp.shape())?;
    let Some((dims, n)) = elems(OP, inp.numel())? else { return Ok(()) };
    stream.launch(&CAST_F32_TO_BF16, dims, &args![Out(dense::<bf16>(OP, out)?), In(dense::<f32>(OP, inp)?), n])
}

/// bf16 → f32.
pub static CAST_BF16_TO_F32: Kernel = Kernel {
    name: "cast_bf16_to_f32",
    source: SOURCE,
    params: &["out", "inp", "n"],
    cpu: bf16_to_f32_cpu,
    strided: false,
};

fn bf16_to_f32_cpu(a: &CpuArgs) -> Result<()> {
    let inp = a.input::<bf16>("inp")?;
    a.output::<f32>("out")?.iter_mut().zip(inp.iter()).for_each(|(y, &x)| *y = x.to_f32());
    Ok(())
}

/// `out = f32(inp)`, exact; shapes equal, both contiguous.
///
/// # Errors
/// [`Error::Shape`] for unequal shapes; [`Error::NotContiguous`] for a strided tensor.
pub fn cast_bf16_to_f32(out: &Tensor, inp: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "cast_bf16_to_f32";
    out.expect_shape(OP, inp.shape())?;
    let Some((dims, n)) = elems(OP, inp.numel())? else { return Ok(()) };
    stream.launch(&CAST_BF16_TO_F32, dims, &args![Out(dense::<f32>(OP, out)?), In(dense::<bf16>(OP, inp)?), n])
}

/// `out = a + b` in f32.
pub static RESIDUAL_ADD: Kernel = Kernel {
    name: "residual_add_f32",
    source: SOURCE,
    params: &["out", "a", "b", "n"],
    cpu: residual_add_cpu,
    strided: false,
};

fn residual_add_cpu(args: &CpuArgs) -> Result<()> {
    let (a, b) = (args.input::<f32>("a")?, args.input::<f32>("b")?);
    args.output::<f32>("out")?.iter_mut().zip(a.iter().zip(b.iter())).for_each(|(y, (&a, &b))| *y = a + b);
    Ok(())
}

/// `out = a + b` (a residual connection's forward; its backward passes the gradient to both
/// inputs unchanged); shapes equal, all contiguous. Bitwise equal on both devices.
///
/// # Errors
/// [`Error::Shape`] for unequal shapes; [`Error::NotContiguous`] for a strided tensor.
pub fn residual_add(out: &Tensor, a: &Tensor, b: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "residual_add";
    out.expect_shape(OP, a.shape())?;
    b.expect_shape(OP, a.shape())?;
    let Some((dims, n)) = elems(OP, a.numel())? else { return Ok(()) };
    stream.launch(
        &RESIDUAL_ADD,
        dims,
        &args![Out(dense::<f32>(OP, out)?), In(dense::<f32>(OP, a)?), In(dense::<f32>(OP, b)?), n],
    )
}

/// One thread per element, or `None` for no elements.
fn elems(op: &'static str, n: usize) -> Result<Option<(LaunchDims, u32)>> {
    if n == 0 {
        return Ok(None);
    }
    let count = u32::try_from(n).map_err(|_| Error::Unsupported {
        op,
        backend: "any",
        why: "tensors of 2^32 elements or more are not supported by this kernel; split the tensor",
    })?;
    Ok(Some((LaunchDims::for_elems(n), count)))
}
