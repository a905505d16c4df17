//! Graph-safe random numbers: counter-based Philox4x32-10 on the host and in `rng.cu`, and the
//! device-resident step counters that random and step-dependent kernels read.
//!
//! Note [Graph-safe RNG]: a number is a pure function of (seed, site, step, element). The seed
//! and the site (which layer draws) form Philox's key; the element's group of four and the step
//! form its counter. Seed and site are launch scalars, frozen when a graph captures the launch;
//! the step is read from device memory when the kernel runs. So a captured graph draws new
//! numbers when the caller writes a new step before each replay ([`step_write`], or [`step_add`]
//! captured with the work), draws the same numbers again for the same step, and no host-side
//! generator state can drift between warmup, capture and replay (docs/design.md, R9). The CPU path of
//! every kernel calls [`philox4x32_10`], so the simulator and CUDA draw bitwise equal numbers.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::rng;
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let (bits, step) = (Tensor::zeros(&alloc, &s, &[6], graphed::device::DType::U32)?, Tensor::zeros(&alloc, &s, &[1], graphed::device::DType::U64)?);
//! rng::step_write(&step, 7, &s)?;
//! rng::random_bits(&bits, 42, 3, &step, &s)?;
//! assert_eq!(bits.to_vec::<u32>(&s)?[5], rng::random_u32(42, 3, 7, 5));
//! # Ok::<(), graphed::Error>(())
//! ```

use super::{count, dense};
use crate::device::{args, CpuArgs, In, InOut, Kernel, LaunchDims, Out, Stream, View};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = include_str!("rng.cu");

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds (Salmon et al., SC'11), as Random123's `philox4x32` and cuRAND's
/// Philox use it: a bijection of the 128-bit counter under a 64-bit key, so distinct counters give
/// independent-looking blocks of four `u32`s with no state to carry.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// The four numbers of elements `4·group .. 4·group + 3` (see Note [Graph-safe RNG]).
pub(crate) fn random_block(seed: u32, site: u32, step: u64, group: u64) -> [u32; 4] {
    philox4x32_10([group as u32, (group >> 32) as u32, step as u32, (step >> 32) as u32], [seed, site])
}

/// The random `u32` that kernels draw for element `index` at `step` (the host model of the
/// device, for tests and host-side checks).
pub fn random_u32(seed: u32, site: u32, step: u64, index: u64) -> u32 {
    random_block(seed, site, step, index / 4)[(index % 4) as usize]
}

/// Fills a `u32` tensor with random bits.
pub static RANDOM_U32: Kernel = Kernel {
    name: "random_u32",
    source: SOURCE,
    params: &["out", "step", "seed", "site", "n"],
    cpu: random_u32_cpu,
    strided: false,
};

fn random_u32_cpu(a: &CpuArgs) -> Result<()> {
    let step = step_of(a, "step")?;
    let (seed, site) = (a.u32("seed")?, a.u32("site")?);
    for (group, out) in a.output::<u32>("out")?.chunks_mut(4).enumerate() {
        let bits = random_block(seed, site, step, group as u64);
        out.copy_from_slice(&bits[..out.len()]);
    }
    Ok(())
}

/// Fills `out` (contiguous) with the random bits of (`seed`, `site`, `*step`): element `i` gets
/// [`random_u32`]`(seed, site, step, i)`, on either device.
///
/// # Errors
/// [`Error::Shape`] unless `step` is one element; [`Error::NotContiguous`] for a strided `out`.
pub fn random_bits(out: &Tensor, seed: u32, site: u32, step: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "random_bits";
    let (out_v, n) = (dense::<u32>(OP, out)?, count(OP, out.numel())?);
    let dims = LaunchDims::for_elems(out.numel().div_ceil(4));
    stream.launch(&RANDOM_U32, dims, &args![Out(out_v), In(step_view(OP, step)?), seed, site, n])
}

/// Sets a step counter to a value.
pub static STEP_WRITE: Kernel =
    Kernel { name: "step_write_u64", source: SOURCE, params: &["step", "value"], cpu: step_write_cpu, strided: false };

fn step_write_cpu(a: &CpuArgs) -> Result<()> {
    let value = a.u64("value")?;
    a.output::<u64>("step")?.iter_mut().for_each(|s| *s = value);
    Ok(())
}

/// Sets the one-element step counter `step` to `value`, in stream order. The value is a launch
/// scalar, frozen if captured: call it eagerly before each replay of a graph that reads `step`.
///
/// # Errors
/// [`Error::Shape`] unless `step` is one element.
pub fn step_write(step: &Tensor, value: u64, stream: &Stream) -> Result<()> {
    stream.launch(&STEP_WRITE, ONE_THREAD, &args![Out(step_view("step_write", step)?), value])
}

/// Adds to a step counter.
pub static STEP_ADD: Kernel =
    Kernel { name: "step_add_u64", source: SOURCE, params: &["step", "by"], cpu: step_add_cpu, strided: false };

fn step_add_cpu(a: &CpuArgs) -> Result<()> {
    let by = a.u64("by")?;
    a.output::<u64>("step")?.iter_mut().for_each(|s| *s = s.wrapping_add(by));
    Ok(())
}

/// Adds `by` to the one-element step counter `step`, in stream order. Captured into a graph, it
/// advances the counter on every replay (as an optimizer's step count must).
///
/// # Errors
/// [`Error::Shape`] unless `step` is one element.
pub fn step_add(step: &Tensor, by: u64, stream: &Stream) -> Result<()> {
    stream.launch(&STEP_ADD, ONE_THREAD, &args![InOut(step_view("step_add", step)?), by])
}

const ONE_THREAD: LaunchDims =
    LaunchDims { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0, grid_stride: false };

/// The view of a step counter: one contiguous `u64`.
pub(crate) fn step_view<'t>(op: &'static str, step: &'t Tensor) -> Result<View<'t, u64>> {
    if step.numel() != 1 {
        return Err(Error::Shape { op, expected: "a step counter of 1 element".into(), found: step.shape().to_vec() });
    }
    step.view()
}

/// The step counter a CPU path received as parameter `param`.
pub(crate) fn step_of(a: &CpuArgs, param: &str) -> Result<u64> {
    let step = a.input::<u64>(param)?;
    step.first().copied().ok_or_else(|| Error::KernelArg {
        kernel: a.kernel.name,
        param: param.into(),
        expected: "a u64 buffer of 1 element".into(),
        found: "an empty buffer".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123 1.14 `examples/kat_vectors`, the three `philox4x32 10` lines (counter, key,
    /// expected output).
    #[test]
    fn philox_matches_random123_known_answers() {
        let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            ([0; 4], [0; 2], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
            ([u32::MAX; 4], [u32::MAX; 2], [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (counter, key, want) in kat {
            assert_eq!(philox4x32_10(counter, key), want, "counter {counter:x?} key {key:x?}");
        }
    }

    #[test]
    fn numbers_depend_on_every_coordinate() {
        let base = random_u32(1, 2, 3, 4);
        assert_eq!(base, random_block(1, 2, 3, 1)[0], "element 4 is word 0 of group 1");
        let others = [random_u32(9, 2, 3, 4), random_u32(1, 9, 3, 4), random_u32(1, 2, 9, 4), random_u32(1, 2, 3, 5)];
        assert!(others.iter().all(|&o| o != base), "{base:x} vs {others:x?}");
        assert_ne!(random_u32(1, 2, 1 << 32, 4), base, "the step's high word counts");
    }
}
