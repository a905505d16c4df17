//! The amax of a tensor, max |x|, into one f32 on the device: what delayed scaling records and
//! current scaling computes its scale from. NaN is kept (Note [Amax as integer bits] in
//! `amax.cu`): an input with a NaN gives the amax `0x7fffffff`, which the recipes treat as "not
//! finite" and answer by keeping the previous scale.

use half::bf16;

use super::SOURCE;
use crate::device::{args, CpuArgs, DType, Elem, Float, In, InOut, Kernel, Stream, View};
use crate::ops::cast::one_f32;
use crate::ops::{count, dense, lanes, stride_dims, unsupported_dtype};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// `amax = max(amax, max |inp|)` over f32.
pub static AMAX: Kernel =
    Kernel { name: "amax_f32", source: SOURCE, params: &["amax", "inp", "n"], cpu: amax_cpu::<f32>, strided: false };

/// `amax = max(amax, max |inp|)` over bf16.
pub static AMAX_BF16: Kernel =
    Kernel { name: "amax_bf16", source: SOURCE, params: &["amax", "inp", "n"], cpu: amax_cpu::<bf16>, strided: false };

/// |v|'s bits with every NaN made `0x7fffffff`: ordered as integers as the magnitudes are, NaN
/// above +∞ (Note [Amax as integer bits]).
pub(crate) fn amax_bits(v: f32) -> u32 {
    let a = v.to_bits() & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        0x7fff_ffff
    } else {
        a
    }
}

/// Folds `bits` (an amax's, [`amax_bits`]) into the slot a CPU path received as `amax`.
pub(crate) fn accumulate_amax(a: &CpuArgs, bits: u32) -> Result<()> {
    let mut slot = a.output::<f32>("amax")?;
    let slot = slot.first_mut().ok_or_else(|| Error::KernelArg {
        kernel: a.kernel.name,
        param: "amax".into(),
        expected: "an f32 buffer of 1 element".into(),
        found: "an empty buffer".into(),
    })?;
    *slot = f32::from_bits(slot.to_bits().max(bits));
    Ok(())
}

/// The amax bits ([`amax_bits`]) of the input a CPU path received as `inp` (0 when empty).
pub(crate) fn input_amax_bits<T: Float>(a: &CpuArgs) -> Result<u32> {
    Ok(a.input::<T>("inp")?.iter().map(|x| amax_bits(x.to_f32())).max().unwrap_or(0))
}

fn amax_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    accumulate_amax(a, input_amax_bits::<T>(a)?)
}

/// Whether [`amax()`] replaces the value in its slot or folds into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amax {
    /// The slot becomes this tensor's amax (+0 for an empty tensor).
    Overwrite,
    /// The slot becomes the max of its value and this tensor's amax: several tensors (or a
    /// tensor in pieces) into one slot. The slot must hold an amax (as these ops write it) or
    /// +0: values are compared by their bits, which order non-negative floats and NaN.
    Accumulate,
}

/// `amax_out = max |inp|` (or its max with `amax_out`, per `mode`), `amax_out` one f32 on the
/// device, `inp` f32 or bf16, contiguous. −0 counts as +0, ∞ as ∞, and any NaN makes the amax
/// NaN (`0x7fffffff`). Deterministic and bitwise equal on both devices (max is order-free).
///
/// # Errors
/// [`Error::UnsupportedDType`] for another input type; [`Error::DTypeMismatch`] or
/// [`Error::Shape`] for an `amax_out` that is not one f32; [`Error::NotContiguous`] for a strided
/// tensor; all before anything is enqueued.
pub fn amax(amax_out: &Tensor, inp: &Tensor, mode: Amax, stream: &Stream) -> Result<()> {
    const OP: &str = "amax";
    let slot = one_f32(OP, amax_out)?;
    match inp.dtype() {
        DType::F32 => launch(OP, &AMAX, slot, dense::<f32>(OP, inp)?, mode, stream),
        DType::BF16 => launch(OP, &AMAX_BF16, slot, dense::<bf16>(OP, inp)?, mode, stream),
        dtype => Err(unsupported_dtype(OP, dtype)),
    }
}

fn launch<T: Elem>(
    op: &'static str,
    kernel: &'static Kernel,
    slot: View<'_, f32>,
    inp: View<'_, T>,
    mode: Amax,
    stream: &Stream,
) -> Result<()> {
    let n = count(op, inp.len())?;
    if mode == Amax::Overwrite {
        stream.memset(slot, 0)?;
    }
    if n == 0 {
        return Ok(());
    }
    stream.launch(kernel, stride_dims(inp.len().div_ceil(lanes::<T>())), &args![InOut(slot), In(inp), n])
}

#[cfg(test)]
mod tests {
    use super::amax_bits;

    #[test]
    fn amax_bits_order_as_magnitudes_with_nan_on_top() {
        let order = [-0.0f32, 1e-45, 1.0, -2.0, f32::MAX, f32::NEG_INFINITY];
        let bits: Vec<u32> = order.iter().map(|&v| amax_bits(v)).collect();
        assert!(bits.windows(2).all(|w| w[0] < w[1]), "{bits:x?}");
        assert_eq!(bits[0], 0, "-0 counts as +0");
        for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001)] {
            assert_eq!(amax_bits(nan), 0x7fff_ffff);
        }
    }
}
