//! Kernel profiles: the GPU time, declared bytes and FLOPs of each launch on a stream, so that a
//! benchmark can say where a step's time goes without an external profiler.
//!
//! [`Stream::profile`] brackets every [`Stream::launch`] and [`Stream::gemm`] on the stream with
//! two timing events until the returned [`Profile`] finishes. Bytes and FLOPs come from what the
//! launch declares (its [`Arg`]s and a GEMM's dimensions), so they are the same on CUDA and on
//! the simulator; only the elapsed time needs a clock, and the simulator has none. Work enqueued
//! while the stream captures is not profiled: it runs only when its graph is launched, and a
//! caller times a graph launch as a whole.

use super::kernel::Arg;
use super::{Event, Stream};
use crate::Result;

/// One profiled launch or GEMM.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    /// The kernel's [`Kernel::name`](super::Kernel::name), with its dtype and epilogue
    /// (`gemm_bf16_bias`, `layernorm_forward_bf16`): the class it is reported under.
    pub name: &'static str,
    /// Bytes its buffer arguments declare: each region's length × element size, once if it is
    /// read or written and twice if both. A GEMM's hidden workspace is left out: it is declared
    /// whole, and cuBLASLt touches little or none of it.
    pub bytes: u64,
    /// For a GEMM, 2·m·n·k·batch (the epilogue's few operations per element are not counted);
    /// for a kernel launched with [`Stream::launch_counting`](super::Stream::launch_counting),
    /// what it declared (the fused attention's matrix products); none for other kernels.
    pub flops: Option<u64>,
    /// GPU µs between the timing events recorded just before and just after it; none on the
    /// simulator, which has no clock.
    pub elapsed_us: Option<f64>,
}

/// A profiled launch whose events may not have completed yet.
pub(crate) struct Pending {
    pub(crate) time: KernelTime,
    pub(crate) start: Event,
    pub(crate) end: Event,
}

/// The bytes `args` declare (see [`KernelTime::bytes`]).
pub(crate) fn declared_bytes(args: &[Arg<'_>]) -> u64 {
    args.iter()
        .map(|a| match a {
            Arg::Buf(b) if b.hidden.is_none() => {
                let passes = u64::from(b.mode.reads()) + u64::from(b.mode.writes());
                passes * (b.region.len() * b.dtype.size()) as u64
            }
            _ => 0,
        })
        .sum()
}

/// A kernel profile of one stream, begun by [`Stream::profile`]. [`Profile::finish`] returns what
/// was recorded; dropping the guard ends the profile and discards it, so an error in the profiled
/// region never leaves a stream profiled. The timing events live until then.
///
/// ```
/// use graphed::device::{Device, Gemm};
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let (a, c) = (dev.alloc::<f32>(6)?, dev.alloc::<f32>(4)?);
/// let profile = s.profile()?;
/// s.gemm(Gemm::new(c.view(), a.view(), a.view(), (2, 2, 3)))?; // C (2×2) = A (2×3) · B (3×2)
/// let times = profile.finish()?;
/// assert_eq!((times[0].name, times[0].bytes, times[0].flops), ("gemm_f32", (4 + 6 + 6) * 4, Some(24)));
/// assert_eq!(times[0].elapsed_us, None, "the simulator has no clock");
/// # Ok::<(), graphed::Error>(())
/// ```
#[must_use = "a profile ends when its guard is dropped; call finish() to keep what it recorded"]
pub struct Profile<'s> {
    stream: &'s Stream,
    /// Set by `finish`, which has ended the profile already.
    done: bool,
}

impl<'s> Profile<'s> {
    pub(crate) fn new(stream: &'s Stream) -> Profile<'s> {
        Profile { stream, done: false }
    }

    /// The profiled stream.
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }

    /// Ends the profile, waits for the stream, and returns each profiled launch in enqueue order.
    ///
    /// # Errors
    /// Those of [`Stream::synchronize`] (a capture error if the stream is capturing: end the
    /// capture first) and of [`Event::elapsed_ms`].
    pub fn finish(mut self) -> Result<Vec<KernelTime>> {
        self.done = true;
        let pending = self.stream.end_profile();
        self.stream.synchronize()?;
        let clock = self.stream.device().has_clock();
        pending
            .into_iter()
            .map(|p| {
                let elapsed_us = if clock { Some(f64::from(p.start.elapsed_ms(&p.end)?) * 1e3) } else { None };
                Ok(KernelTime { elapsed_us, ..p.time })
            })
            .collect()
    }
}

impl Drop for Profile<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.stream.end_profile();
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::device::{args, CaptureMode, CpuArgs, Device, Epilogue, Gemm, In, InOut, Kernel, LaunchDims, Out};
    use crate::{Error, ProfileErrorKind};

    /// `y += a·x`.
    fn axpy_cpu(a: &CpuArgs) -> Result<()> {
        let (x, k) = (a.input::<f32>("x")?, a.f32("a")?);
        for (y, x) in a.output::<f32>("y")?.iter_mut().zip(x.iter()) {
            *y += k * x;
        }
        Ok(())
    }
    static AXPY: Kernel =
        Kernel { name: "axpy_f32", source: "", params: &["y", "x", "a", "n"], cpu: axpy_cpu, strided: false };

    /// `y = bf16(x)`, on a strided `x`.
    fn narrow_cpu(a: &CpuArgs) -> Result<()> {
        let x = a.input::<f32>("x")?;
        for (y, x) in a.output::<bf16>("y")?.iter_mut().zip(x.iter()) {
            *y = bf16::from_f32(*x);
        }
        Ok(())
    }
    static NARROW: Kernel =
        Kernel { name: "narrow_bf16", source: "", params: &["y", "x"], cpu: narrow_cpu, strided: true };

    fn summary(times: &[KernelTime]) -> Vec<(&'static str, u64, Option<u64>)> {
        times.iter().map(|t| (t.name, t.bytes, t.flops)).collect()
    }

    #[test]
    fn a_profile_records_each_launch_with_its_declared_bytes_and_flops() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let x = dev.alloc_from(&s, &(0..12).map(|i| i as f32).collect::<Vec<_>>())?;
        let y = dev.alloc_from(&s, &[1.0f32; 12])?;
        let narrow = dev.alloc::<bf16>(6)?;
        let (c, a, b, bias) =
            (dev.alloc::<bf16>(6)?, dev.alloc::<bf16>(8)?, dev.alloc::<bf16>(12)?, dev.alloc::<bf16>(3)?);
        let (c2, ab2) = (dev.alloc::<f32>(8)?, dev.alloc::<f32>(8)?);

        let profile = s.profile()?;
        // InOut y (12 f32, read and written) and In x (12 f32): 2·48 + 48 bytes.
        s.launch(&AXPY, LaunchDims::for_elems(12), &args![InOut(&y), In(&x), 2.0f32, 12u32])?;
        // A memset is no kernel: not profiled.
        s.memset(&c2, 0)?;
        // Out: 6 bf16; In: 3 rows of 2 of x, 4 apart: 6 f32, not the 10 of its hull.
        let head = x.strided(1, &[(3, 4), (2, 1)]).expect("3 dimensions at most");
        s.launch(&NARROW, LaunchDims::for_elems(6), &args![Out(&narrow), In(head)])?;
        // (m, n, k) = (2, 3, 4), bf16, beta = 1 (C read and written: 2·12 bytes), A a 2×4 view
        // of rows 4 apart (16), B 4×3 (24), the bias (6); the workspace is not counted.
        s.gemm(Gemm {
            beta: 1.0,
            epilogue: Epilogue::Bias(bias.view()),
            ..Gemm::new(c.view(), a.view(), b.view(), (2, 3, 4))
        })?;
        // Two f32 2×2×2 products: C written (32 bytes), A and B read (32 each).
        s.gemm(Gemm { batch: 2, ..Gemm::new(c2.view(), ab2.view(), ab2.view(), (2, 2, 2)) })?;
        let times = profile.finish()?;

        assert_eq!(
            summary(&times),
            vec![
                ("axpy_f32", 2 * 48 + 48, None),
                ("narrow_bf16", 12 + 24, None),
                ("gemm_bf16_bias", 2 * 12 + 16 + 24 + 6, Some(2 * 2 * 3 * 4)),
                ("gemm_f32", 32 + 32 + 32, Some(2 * 2 * 2 * 2 * 2)),
            ]
        );
        assert!(times.iter().all(|t| t.elapsed_us.is_none()), "the simulator has no clock");
        let expected: Vec<f32> = (0..12).map(|i| 1.0 + 2.0 * i as f32).collect();
        assert_eq!(y.to_vec(&s)?, expected, "the profiled launch ran");
        assert_eq!(narrow.to_vec(&s)?, [1.0f32, 2.0, 5.0, 6.0, 9.0, 10.0].map(bf16::from_f32));
        Ok(())
    }

    #[test]
    fn a_profile_cannot_start_on_a_capturing_stream() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let (x, y) = (dev.alloc_from(&s, &[1.0f32; 4])?, dev.alloc::<f32>(4)?);
        let capture = s.capture(CaptureMode::ThreadLocal)?;
        let err = s.profile().map(|_| ()).unwrap_err();
        assert!(
            matches!(err, Error::Profile { stream, kind: ProfileErrorKind::Capturing } if stream == s.id()),
            "{err}"
        );
        assert!(err.to_string().contains("time a graph's launch as a whole"), "{err}");
        s.launch(&AXPY, LaunchDims::for_elems(4), &args![InOut(&y), In(&x), 1.0f32, 4u32])?;
        let graph = capture.finish()?.instantiate()?;
        graph.launch(&s)?;
        // After the capture, the stream profiles again.
        let profile = s.profile()?;
        s.launch(&AXPY, LaunchDims::for_elems(4), &args![InOut(&y), In(&x), 1.0f32, 4u32])?;
        assert_eq!(summary(&profile.finish()?), vec![("axpy_f32", 48, None)]);
        assert_eq!(y.to_vec(&s)?, vec![2.0; 4]);
        Ok(())
    }

    #[test]
    fn launches_inside_a_capture_are_not_profiled() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let (x, y) = (dev.alloc_from(&s, &[1.0f32; 4])?, dev.alloc::<f32>(4)?);
        let profile = s.profile()?;
        s.launch(&AXPY, LaunchDims::for_elems(4), &args![InOut(&y), In(&x), 1.0f32, 4u32])?;
        let capture = s.capture(CaptureMode::ThreadLocal)?;
        s.launch(&AXPY, LaunchDims::for_elems(4), &args![InOut(&y), In(&x), 10.0f32, 4u32])?;
        let graph = capture.finish()?;
        assert_eq!(graph.nodes()?.len(), 1, "the profile's events added no node");
        graph.instantiate()?.launch(&s)?;
        s.launch(&AXPY, LaunchDims::for_elems(4), &args![InOut(&y), In(&x), 100.0f32, 4u32])?;
        assert_eq!(profile.finish()?.len(), 2, "the two eager launches");
        assert_eq!(y.to_vec(&s)?, vec![111.0; 4]);
        Ok(())
    }

    #[test]
    fn one_profile_at_a_time_and_dropping_it_ends_it() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let (x, y) = (dev.alloc_from(&s, &[1.0f32; 4])?, dev.alloc::<f32>(4)?);
        let first = s.profile()?;
        let err = s.profile().map(|_| ()).unwrap_err();
        assert!(matches!(err, Error::Profile { kind: ProfileErrorKind::Active, .. }), "{err}");
        s.launch(&AXPY, LaunchDims::for_elems(4), &args![InOut(&y), In(&x), 1.0f32, 4u32])?;
        drop(first);
        // Unprofiled again: a new profile starts empty and sees only its own launches.
        s.launch(&AXPY, LaunchDims::for_elems(4), &args![InOut(&y), In(&x), 1.0f32, 4u32])?;
        let second = s.profile()?;
        assert_eq!(second.finish()?, vec![]);
        s.launch(&AXPY, LaunchDims::for_elems(4), &args![InOut(&y), In(&x), 1.0f32, 4u32])?;
        assert_eq!(y.to_vec(&s)?, vec![3.0; 4]);
        Ok(())
    }
}
