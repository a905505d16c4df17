//! Inverted dropout with graph-safe randomness (Note [Graph-safe RNG] in `rng.rs`): the forward
//! keeps each element with probability 1 − p, scales kept ones by 1/(1 − p) and saves the mask
//! (`u8`: 1 kept, 0 dropped) for the backward, on f32 or bf16 activations (one CUDA template and
//! one generic CPU path; kept values are scaled in f32 and rounded once). Its CUDA entry points in
//! `dropout.cu` are compiled after `rng.cu`, whose Philox they call. Masks and outputs are bitwise
//! equal on both devices.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::{dropout, rng};
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let x = Tensor::from_host(&alloc, &s, &[1.0f32; 8], &[2, 4])?;
//! let (y, mask) = (Tensor::zeros(&alloc, &s, &[2, 4], graphed::device::DType::F32)?, Tensor::zeros(&alloc, &s, &[2, 4], graphed::device::DType::U8)?);
//! let step = Tensor::zeros(&alloc, &s, &[1], graphed::device::DType::U64)?;
//! rng::step_write(&step, 1, &s)?;
//! dropout::dropout_forward(&y, &mask, &x, 0.5, 1234, 0, &step, &s)?;
//! let (y, mask) = (y.to_vec::<f32>(&s)?, mask.to_vec::<u8>(&s)?);
//! assert!(y.iter().zip(&mask).all(|(&y, &m)| y == 2.0 * f32::from(m)));
//! # Ok::<(), graphed::Error>(())
//! ```

use half::bf16;

use super::rng;
use super::{count, dense, float_dtype, lanes, stride_dims, with_float, PerFloat};
use crate::device::{args, CpuArgs, Float, In, Kernel, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("rng.cu"), include_str!("dropout.cu"));

/// Dropout forward in f32: the output and the mask.
pub static DROPOUT_FORWARD: Kernel = Kernel {
    name: "dropout_forward_f32",
    source: SOURCE,
    params: &["out", "mask", "inp", "step", "threshold", "scale", "seed", "site", "n"],
    cpu: forward_cpu::<f32>,
    strided: false,
};

/// Dropout forward in bf16 (kept values scaled in f32, rounded once).
pub static DROPOUT_FORWARD_BF16: Kernel = Kernel {
    name: "dropout_forward_bf16",
    source: SOURCE,
    params: &["out", "mask", "inp", "step", "threshold", "scale", "seed", "site", "n"],
    cpu: forward_cpu::<bf16>,
    strided: false,
};

fn forward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (inp, step) = (a.input::<T>("inp")?, rng::step_of(a, "step")?);
    let (threshold, scale, seed, site) = (a.u32("threshold")?, a.f32("scale")?, a.u32("seed")?, a.u32("site")?);
    let (mut out, mut mask) = (a.output::<T>("out")?, a.output::<u8>("mask")?);
    let groups = out.chunks_mut(4).zip(mask.chunks_mut(4)).zip(inp.chunks(4));
    for (group, ((out, mask), inp)) in groups.enumerate() {
        let bits = rng::random_block(seed, site, step, group as u64);
        for (((y, m), x), &r) in out.iter_mut().zip(mask.iter_mut()).zip(inp).zip(&bits) {
            let keep = r >= threshold;
            *y = T::from_f32(if keep { x.to_f32() * scale } else { 0.0 });
            *m = u8::from(keep);
        }
    }
    Ok(())
}

/// `out = mask · inp / (1 − p)` with `mask[i]` drawn from (`seed`, `site`, `*step`, `i`); `out`
/// and `inp` of one element type, f32 or bf16 (kept values scaled in f32 and rounded once), the
/// mask `u8`, all contiguous, `out` and `mask` of `inp`'s shape. Give each dropout layer its own
/// `site`, and write a new `step` before each replay of a graph that captured this launch.
///
/// # Errors
/// [`Error::UnsupportedDType`] or [`Error::DTypeMismatch`] for other element types;
/// [`Error::Shape`] for mismatched shapes or a step counter that is not one element;
/// [`Error::Unsupported`] unless `0 ≤ p < 1`; [`Error::NotContiguous`] for a strided tensor; all
/// before anything is enqueued.
#[allow(clippy::too_many_arguments)] // outputs, input, p, the RNG's coordinates (seed, site, step), stream
pub fn dropout_forward(
    out: &Tensor,
    mask: &Tensor,
    inp: &Tensor,
    p: f32,
    seed: u32,
    site: u32,
    step: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "dropout_forward";
    let dtype = float_dtype(OP, inp, &[out])?;
    out.expect_shape(OP, inp.shape())?;
    mask.expect_shape(OP, inp.shape())?;
    let (threshold, scale) = keep_rule(OP, p)?;
    let n = count(OP, inp.numel())?;
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &DROPOUT_FORWARD, bf16: &DROPOUT_FORWARD_BF16 }.of::<T>(OP)?;
        let (out, mask, inp, step) =
            (dense::<T>(OP, out)?, dense::<u8>(OP, mask)?, dense::<T>(OP, inp)?, rng::step_view(OP, step)?);
        let dims = stride_dims(inp.len().div_ceil(lanes::<T>()));
        stream.launch(kernel, dims, &args![Out(out), Out(mask), In(inp), In(step), threshold, scale, seed, site, n])
    })
}

/// Dropout backward in f32: the input's gradient from the saved mask.
pub static DROPOUT_BACKWARD: Kernel = Kernel {
    name: "dropout_backward_f32",
    source: SOURCE,
    params: &["dinp", "dout", "mask", "scale", "n"],
    cpu: backward_cpu::<f32>,
    strided: false,
};

/// Dropout backward in bf16.
pub static DROPOUT_BACKWARD_BF16: Kernel = Kernel {
    name: "dropout_backward_bf16",
    source: SOURCE,
    params: &["dinp", "dout", "mask", "scale", "n"],
    cpu: backward_cpu::<bf16>,
    strided: false,
};

fn backward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (dout, mask, scale) = (a.input::<T>("dout")?, a.input::<u8>("mask")?, a.f32("scale")?);
    for ((dx, dy), &m) in a.output::<T>("dinp")?.iter_mut().zip(dout.iter()).zip(mask.iter()) {
        *dx = T::from_f32(if m != 0 { dy.to_f32() * scale } else { 0.0 });
    }
    Ok(())
}

/// `dinp = mask · dout / (1 − p)` (an activation gradient: overwritten, not accumulated), with
/// the mask and `p` of the forward; `dinp` and `dout` of one element type, f32 or bf16.
///
/// # Errors
/// As [`dropout_forward`].
pub fn dropout_backward(dinp: &Tensor, dout: &Tensor, mask: &Tensor, p: f32, stream: &Stream) -> Result<()> {
    const OP: &str = "dropout_backward";
    let dtype = float_dtype(OP, dout, &[dinp])?;
    dinp.expect_shape(OP, dout.shape())?;
    mask.expect_shape(OP, dout.shape())?;
    let (_, scale) = keep_rule(OP, p)?;
    let n = count(OP, dout.numel())?;
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &DROPOUT_BACKWARD, bf16: &DROPOUT_BACKWARD_BF16 }.of::<T>(OP)?;
        let (dinp, dout, mask) = (dense::<T>(OP, dinp)?, dense::<T>(OP, dout)?, dense::<u8>(OP, mask)?);
        let dims = stride_dims(dout.len().div_ceil(lanes::<T>()));
        stream.launch(kernel, dims, &args![Out(dinp), In(dout), In(mask), scale, n])
    })
}

/// The keep threshold on a random `u32` (kept iff `bits ≥ threshold`, probability
/// (2³² − threshold)/2³² ≈ 1 − p) and the scale 1/(1 − p). Computed once on the host, so both
/// devices compare the same integers and multiply by the same float.
pub(crate) fn keep_rule(op: &'static str, p: f32) -> Result<(u32, f32)> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::Unsupported { op, backend: "any", why: "the drop probability p must be in [0, 1)" });
    }
    // Below 2^32 for every f32 p < 1 (the largest is 1 − 2^-24), so the conversion is exact.
    let threshold = (f64::from(p) * 4_294_967_296.0).round() as u32;
    Ok((threshold, 1.0 / (1.0 - p)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_rule_maps_p_to_an_integer_threshold() {
        assert_eq!(keep_rule("t", 0.0).unwrap(), (0, 1.0), "p = 0 keeps everything");
        assert_eq!(keep_rule("t", 0.5).unwrap(), (1 << 31, 2.0));
        assert_eq!(keep_rule("t", 1.0 - f32::EPSILON / 2.0).unwrap().0, u32::MAX - 255, "the largest p below 1");
        for bad in [1.0, -0.1, f32::NAN] {
            assert!(matches!(keep_rule("t", bad), Err(Error::Unsupported { .. })), "p = {bad}");
        }
    }
}
