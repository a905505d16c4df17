//! The yardstick for launch overhead: the same kernel launched through cudarc directly, eagerly
//! and from a graph, with nothing of graphed in between but the NVRTC cache.
//!
//! graphed's goal is at most 0.3 µs more host time per launch than [`RawLaunchTimes::eager_host_us`].
//! A benchmarking aid for `graphed bench launch`, which no product type uses: it opens its own
//! CUDA context.

use std::time::Instant;

use cudarc::driver::{sys, CudaEvent, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::context;
use super::error as err;
use super::nvrtc::Compiler;
use crate::device::Kernel;
use crate::{Error, Result};

const OP: &str = "raw_launch_baseline";

/// What one repetition measures: host and GPU time for the whole batch.
struct Sample {
    host_us: f64,
    gpu_us: f64,
}

/// The kernel, its one-element buffer, and where and how to launch it.
struct Bench {
    stream: std::sync::Arc<CudaStream>,
    func: CudaFunction,
    x: CudaSlice<f32>,
    start: CudaEvent,
    end: CudaEvent,
}

/// Raw cudarc timings of the launch benchmark's kernel: the baseline graphed's launch path is
/// compared against. Per kernel, except `graph_launch_host_us` (per graph launch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RawLaunchTimes {
    /// Host µs to issue one eager launch.
    pub eager_host_us: f64,
    /// GPU µs per kernel of eager launches.
    pub eager_gpu_us: f64,
    /// Host µs to issue one launch of a graph of `n` kernels.
    pub graph_launch_host_us: f64,
    /// GPU µs per kernel inside the graph.
    pub graph_gpu_us: f64,
}

/// Launches `kernel`, which must take `(float* y, float c, unsigned n)` (as
/// `ops::elementwise::ADD_SCALAR`), on a fresh context of GPU `ordinal` with one thread and
/// `n = 1`: `n_kernels` launches per repetition, `reps` repetitions after one warm-up, eagerly
/// and as one captured graph; per kernel, the median of the repetitions.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a GPU; [`Error::Unsupported`] for no launches.
pub fn raw_launch_baseline(ordinal: usize, kernel: &Kernel, n_kernels: usize, reps: usize) -> Result<RawLaunchTimes> {
    let (source, name) = (kernel.source, kernel.name);
    if n_kernels == 0 || reps == 0 {
        return Err(Error::Unsupported { op: OP, backend: "cuda", why: "n_kernels and reps must be at least 1" });
    }
    if name.contains('\0') {
        return Err(Error::Cuda { op: OP, message: "the kernel name contains a NUL byte".into() });
    }
    let opened = context::open(ordinal)?;
    let cubin = Compiler::new(opened.cc)?.cubin(name, source)?;
    let fail = |e: DriverError| err::driver(OP, None, e);
    let ctx = opened.ctx;
    let func = ctx.load_module(Ptx::from_binary(cubin)).and_then(|m| m.load_function(name)).map_err(fail)?;
    let stream = ctx.new_stream().map_err(fail)?;
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut bench = Bench {
        x: stream.alloc_zeros::<f32>(1).map_err(fail)?,
        start: ctx.new_event(timing).map_err(fail)?,
        end: ctx.new_event(timing).map_err(fail)?,
        func,
        stream,
    };

    bench.eager(n_kernels).map_err(fail)?;
    let eager: Vec<Sample> = (0..reps).map(|_| bench.eager(n_kernels)).collect::<Result<_, _>>().map_err(fail)?;

    let graph = bench.capture(n_kernels).map_err(fail)?;
    graph.upload().map_err(fail)?;
    bench.replay(&graph).map_err(fail)?;
    let replays: Vec<Sample> = (0..reps).map(|_| bench.replay(&graph)).collect::<Result<_, _>>().map_err(fail)?;

    let per_kernel = n_kernels as f64;
    Ok(RawLaunchTimes {
        eager_host_us: median(eager.iter().map(|s| s.host_us)) / per_kernel,
        eager_gpu_us: median(eager.iter().map(|s| s.gpu_us)) / per_kernel,
        graph_launch_host_us: median(replays.iter().map(|s| s.host_us)),
        graph_gpu_us: median(replays.iter().map(|s| s.gpu_us)) / per_kernel,
    })
}

impl Bench {
    const CONFIG: LaunchConfig = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    const C: f32 = 1.0;
    const N: u32 = 1;

    fn launch_all(&mut self, n_kernels: usize) -> Result<(), DriverError> {
        for _ in 0..n_kernels {
            // SAFETY: the kernel takes `(float* y, float c, unsigned n)` (the contract of
            // `raw_launch_baseline`) and `x` holds the one element that `n = 1` lets it touch.
            unsafe {
                self.stream.launch_builder(&self.func).arg(&mut self.x).arg(&Self::C).arg(&Self::N).launch(Self::CONFIG)
            }?;
        }
        Ok(())
    }

    /// Times `body` on the host, between timing events on the stream, and waits for the GPU.
    fn timed(&mut self, body: impl FnOnce(&mut Self) -> Result<(), DriverError>) -> Result<Sample, DriverError> {
        self.start.record(&self.stream)?;
        let t = Instant::now();
        body(self)?;
        let host = t.elapsed();
        self.end.record(&self.stream)?;
        self.stream.synchronize()?;
        let gpu_ms = self.start.elapsed_ms(&self.end)?;
        Ok(Sample { host_us: host.as_secs_f64() * 1e6, gpu_us: f64::from(gpu_ms) * 1e3 })
    }

    fn eager(&mut self, n_kernels: usize) -> Result<Sample, DriverError> {
        self.timed(|b| b.launch_all(n_kernels))
    }

    /// One graph of `n_kernels` launches, instantiated.
    fn capture(&mut self, n_kernels: usize) -> Result<cudarc::driver::CudaGraph, DriverError> {
        self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let launched = self.launch_all(n_kernels);
        // The capture is ended even if a launch failed, so the stream is left usable.
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        graph?.ok_or(DriverError(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED))
    }

    fn replay(&mut self, graph: &cudarc::driver::CudaGraph) -> Result<Sample, DriverError> {
        self.timed(|_| graph.launch())
    }
}

/// The median (the mean of the middle two for an even count); NaN for none.
pub(super) fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static KERNEL: Kernel = Kernel {
        name: "touch",
        source: r#"extern "C" __global__ void touch(float* y, float c, unsigned n) { if (threadIdx.x < n) y[threadIdx.x] += c; }"#,
        params: &["y", "c", "n"],
        cpu: |_| Ok(()),
        strided: false,
    };

    #[test]
    fn the_kernel_names_its_parameters_as_its_source_does() {
        let params = crate::device::kernel::entry_params(KERNEL.source, KERNEL.name);
        assert_eq!(params.as_deref(), Some(KERNEL.params));
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
        assert!(median(std::iter::empty()).is_nan());
    }

    #[test]
    fn the_baseline_runs_on_a_gpu_and_is_a_typed_error_without_one() {
        let _serial = super::super::tests::serial();
        match raw_launch_baseline(0, &KERNEL, 8, 3) {
            Ok(t) => {
                for v in [t.eager_host_us, t.eager_gpu_us, t.graph_launch_host_us, t.graph_gpu_us] {
                    assert!(v.is_finite() && v > 0.0, "{t:?}");
                }
            }
            Err(Error::CudaUnavailable { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn empty_runs_are_refused() {
        assert!(matches!(raw_launch_baseline(0, &KERNEL, 0, 1), Err(Error::Unsupported { .. })));
    }
}
