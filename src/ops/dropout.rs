//! Inverted dropout with graph-safe randomness (Note [Graph-safe RNG] in `rng.rs`): the forward
//! keeps each element with probability 1 − p, scales kept ones by 1/(1 − p) and saves the mask
//! (`u8`: 1 kept, 0 dropped) for the backward. Its CUDA entry points in `dropout.cu` are compiled
//! after `rng.cu`, whose Philox they call. Masks and outputs are bitwise equal on both devices.
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

use super::rng;
use super::{count, dense};
use crate::device::{args, CpuArgs, In, Kernel, LaunchDims, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("rng.cu"), include_str!("dropout.cu"));

/// Dropout forward: the output and the mask.
pub static DROPOUT_FORWARD: Kernel = Kernel {
    name: "dropout_forward_f32",
    source: SOURCE,
    params: &["out", "mask", "inp", "step", "threshold", "scale", "seed", "site", "n"],
    cpu: forward_cpu,
    strided: false,
};

fn forward_cpu(a: &CpuArgs) -> Result<()> {
    let (inp, step) = (a.input::<f32>("inp")?, rng::step_of(a, "step")?);
    let (threshold, scale, seed, site) = (a.u32("threshold")?, a.f32("scale")?, a.u32("seed")?, a.u32("site")?);
    let (mut out, mut mask) = (a.output::<f32>("out")?, a.output::<u8>("mask")?);
    let groups = out.chunks_mut(4).zip(mask.chunks_mut(4)).zip(inp.chunks(4));
    for (group, ((out, mask), inp)) in groups.enumerate() {
        let bits = rng::random_block(seed, site, step, group as u64);
        for (((y, m), &x), &r) in out.iter_mut().zip(mask.iter_mut()).zip(inp).zip(&bits) {
            let keep = r >= threshold;
            *y = if keep { x * scale } else { 0.0 };
            *m = u8::from(keep);
        }
    }
    Ok(())
}

/// `out = mask · inp / (1 − p)` with `mask[i]` drawn from (`seed`, `site`, `*step`, `i`); all
/// tensors contiguous, `out` and `mask` of `inp`'s shape. Give each dropout layer its own `site`,
/// and write a new `step` before each replay of a graph that captured this launch.
///
/// # Errors
/// [`Error::Shape`] for mismatched shapes or a step counter that is not one element;
/// [`Error::Unsupported`] unless `0 ≤ p < 1`; [`Error::NotContiguous`] for a strided tensor.
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
    out.expect_shape(OP, inp.shape())?;
    mask.expect_shape(OP, inp.shape())?;
    let (threshold, scale) = keep_rule(OP, p)?;
    let n = count(OP, inp.numel())?;
    let (out, mask, inp, step) =
        (dense::<f32>(OP, out)?, dense::<u8>(OP, mask)?, dense::<f32>(OP, inp)?, rng::step_view(OP, step)?);
    let dims = LaunchDims::for_elems(inp.len().div_ceil(4));
    stream.launch(
        &DROPOUT_FORWARD,
        dims,
        &args![Out(out), Out(mask), In(inp), In(step), threshold, scale, seed, site, n],
    )
}

/// Dropout backward: the input's gradient from the saved mask.
pub static DROPOUT_BACKWARD: Kernel = Kernel {
    name: "dropout_backward_f32",
    source: SOURCE,
    params: &["dinp", "dout", "mask", "scale", "n"],
    cpu: backward_cpu,
    strided: false,
};

fn backward_cpu(a: &CpuArgs) -> Result<()> {
    let (dout, mask, scale) = (a.input::<f32>("dout")?, a.input::<u8>("mask")?, a.f32("scale")?);
    for ((dx, &dy), &m) in a.output::<f32>("dinp")?.iter_mut().zip(dout.iter()).zip(mask.iter()) {
        *dx = if m != 0 { dy * scale } else { 0.0 };
    }
    Ok(())
}

/// `dinp = mask · dout / (1 − p)` (an activation gradient: overwritten, not accumulated), with
/// the mask and `p` of the forward.
///
/// # Errors
/// As [`dropout_forward`].
pub fn dropout_backward(dinp: &Tensor, dout: &Tensor, mask: &Tensor, p: f32, stream: &Stream) -> Result<()> {
    const OP: &str = "dropout_backward";
    dinp.expect_shape(OP, dout.shape())?;
    mask.expect_shape(OP, dout.shape())?;
    let (_, scale) = keep_rule(OP, p)?;
    let n = count(OP, dout.numel())?;
    let dims = LaunchDims::for_elems(dout.numel());
    stream.launch(
        &DROPOUT_BACKWARD,
        dims,
        &args![Out(dense::<f32>(OP, dinp)?), In(dense::<f32>(OP, dout)?), In(dense::<u8>(OP, mask)?), scale, n],
    )
}

/// The keep threshold on a random `u32` (kept iff `bits ≥ threshold`, probability
/// (2³² − threshold)/2³² ≈ 1 − p) and the scale 1/(1 − p). Computed once on the host, so both
/// devices compare the same integers and multiply by the same float.
fn keep_rule(op: &'static str, p: f32) -> Result<(u32, f32)> {
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
