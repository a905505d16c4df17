//! Layer 1, the execution substrate: devices, streams, events, memory, kernels, capture, graphs.
//!
//! | CUDA                          | graphed                                  | simulator                       |
//! |-------------------------------|------------------------------------------|---------------------------------|
//! | `CUcontext` on one GPU        | [`Device`] (`Device::cuda`, `::sim`)     | host memory, seeded scheduler   |
//! | `CUstream` (non-blocking)     | [`Stream`]                               | a deferred queue                |
//! | `CUevent`                     | [`Event`]                                | a binding to a queued record    |
//! | `cuMemAlloc`, `cuMemHostAlloc`| [`DeviceBuffer`], [`PinnedBuffer`]       | 8-byte aligned host memory      |
//! | `cuLaunchKernel`              | [`Stream::launch`] of a [`Kernel`]       | the kernel's CPU path           |
//! | `cublasLtMatmul`              | [`Stream::gemm`] of a [`Gemm`]           | a CPU loop, same sum order      |
//! | `cuStreamBeginCapture` / End  | [`Stream::begin_capture`] / `end_capture`| the same capture rules          |
//! | `CUgraph` / `CUgraphExec`     | [`Graph`] / [`GraphExec`]                | a DAG of deferred operations    |
//!
//! This layer uses no other layer of graphed, with one exception: the simulator comes with the
//! stream-safety checker (layer 2) installed, through the `observe` hook. Only `cuda/` names
//! cudarc. Every enqueued operation declares its [`Access`]es, derived from its typed arguments.

mod access;
pub(crate) mod backend;
mod capture;
mod cuda;
mod deferred_stub;
mod dtype;
mod event;
mod gemm;
mod graph;
pub(crate) mod ids;
pub mod kernel;
pub(crate) mod memory;
pub(crate) mod observe;
pub mod sim;
mod stream;

use std::sync::Arc;

pub use access::{Access, AccessMode, AccessRole, Dim, Region};
pub use capture::{Capture, CaptureMode, CaptureStatus};
pub use dtype::{DType, Elem};
pub use event::Event;
pub use gemm::{Gemm, GemmElem};
pub use graph::{Graph, GraphExec, NodeInfo, NodeKind};
pub use ids::{BufferId, DeviceId, EventId, GraphId, StreamId};
pub use kernel::{args, Arg, CpuArgs, In, InOut, IntoView, Kernel, LaunchDims, Out, Scalar};
pub use memory::{DeviceBuffer, HostView, MemKind, PinnedBuffer, View};
pub use sim::{Policy, SimConfig};
pub use stream::Stream;

use backend::{dispatch, BackendImpl, Repr};
use memory::{Block, RawBuffer};

use crate::{Error, Result};

/// Which backend a [`Device`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// An NVIDIA GPU through the CUDA driver.
    Cuda,
    /// The CPU simulator.
    Sim,
}

/// A device: an NVIDIA GPU or the CPU simulator, behind one API.
///
/// Cloning is cheap and yields the same device.
///
/// ```
/// use graphed::device::{Device, DeviceKind};
/// let dev = Device::sim();
/// assert_eq!(dev.kind(), DeviceKind::Sim);
/// let s = dev.stream()?;
/// let e = dev.event()?;
/// s.record(&e)?;
/// e.synchronize()?;
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    id: DeviceId,
    backend: BackendImpl,
    /// The stream-safety checker, when on (always on the simulator).
    observer: Option<Arc<dyn observe::Observer>>,
}

impl Device {
    /// The simulator with the default configuration (random scheduling, seed 0).
    pub fn sim() -> Device {
        Device::sim_with(SimConfig::default())
    }

    /// The simulator with a chosen scheduling policy and seed. Its stream-safety checker is
    /// always on (see [`crate::check`]).
    pub fn sim_with(config: SimConfig) -> Device {
        let id = DeviceId(ids::next_id());
        // The one reference from this layer to a later one: the simulator comes with the checker.
        let observer = Some(crate::check::Checker::new_observer(false));
        Device { inner: Arc::new(DeviceInner { id, backend: BackendImpl::Sim(sim::SimDevice::new(config)), observer }) }
    }

    /// The GPU with this ordinal. The stream-safety checker is off unless the environment
    /// variable `GRAPHED_CHECK` is `1` (reports) or `strict` (hazards become errors).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] when the driver, the GPU or a needed library is missing.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        let check = std::env::var("GRAPHED_CHECK").ok();
        let strict = check.as_deref() == Some("strict");
        Device::open_cuda(ordinal, matches!(check.as_deref(), Some("1") | Some("strict")), strict)
    }

    /// The GPU with this ordinal, with the stream-safety checker on (host-side bookkeeping on
    /// every call; see `graphed bench check` for its cost).
    pub fn cuda_checked(ordinal: usize) -> Result<Device> {
        Device::open_cuda(ordinal, true, false)
    }

    fn open_cuda(ordinal: usize, check: bool, strict: bool) -> Result<Device> {
        let id = DeviceId(ids::next_id());
        let backend = cuda::CudaDevice::new(id, ordinal)?;
        // Without the full checker, captures are still watched: the graph layer verifies the
        // replay contract from their access summaries.
        let observer = match check {
            true => crate::check::Checker::new_observer(strict),
            false => crate::check::Checker::new_capture_observer(),
        };
        Ok(Device {
            inner: Arc::new(DeviceInner { id, backend: BackendImpl::Cuda(backend), observer: Some(observer) }),
        })
    }

    pub(crate) fn observer(&self) -> Option<&Arc<dyn observe::Observer>> {
        self.inner.observer.as_ref()
    }

    /// GPU 0 when a driver and a GPU are present, else the simulator; says which on stderr in one
    /// line when it falls back.
    pub fn auto() -> Device {
        match Device::cuda(0) {
            Ok(dev) => dev,
            Err(e) => {
                eprintln!("graphed: {e}; using the simulator");
                Device::sim()
            }
        }
    }

    /// The device's identity.
    pub fn id(&self) -> DeviceId {
        self.inner.id
    }

    /// CUDA or simulator.
    pub fn kind(&self) -> DeviceKind {
        match &self.inner.backend {
            BackendImpl::Sim(_) => DeviceKind::Sim,
            BackendImpl::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// A human-readable name ("NVIDIA H200", "simulator (random, seed 0)").
    pub fn name(&self) -> String {
        match &self.inner.backend {
            BackendImpl::Sim(b) => b.describe(),
            BackendImpl::Cuda(b) => b.describe(),
        }
    }

    pub(crate) fn backend(&self) -> &BackendImpl {
        &self.inner.backend
    }

    pub(crate) fn check_same(&self, op: &'static str, what: &'static str, other: DeviceId) -> Result<()> {
        if other != self.inner.id {
            return Err(Error::WrongDevice { op, what, expected: self.inner.id, found: other });
        }
        Ok(())
    }

    /// A new non-blocking stream at default priority.
    pub fn stream(&self) -> Result<Stream> {
        self.stream_with_priority(0)
    }

    /// A new non-blocking stream; lower numbers are higher priority (see [`Device::priority_range`]).
    pub fn stream_with_priority(&self, priority: i32) -> Result<Stream> {
        let id = StreamId(ids::next_id());
        let repr = dispatch!(self.backend(), |b, _pick| b.wrap_stream(b.create_stream(id, priority)?));
        Ok(Stream::new(self.clone(), id, priority, false, repr))
    }

    /// The legacy default stream. It cannot be captured; it exists so that code can be checked
    /// against that rule.
    pub fn legacy_stream(&self) -> Result<Stream> {
        let id = StreamId(ids::next_id());
        let repr = dispatch!(self.backend(), |b, _pick| b.wrap_stream(b.legacy_stream(id)?));
        Ok(Stream::new(self.clone(), id, 0, true, repr))
    }

    /// `(least, greatest)` stream priority: numerically `(0, -5)` style, greatest is the most urgent.
    pub fn priority_range(&self) -> Result<(i32, i32)> {
        dispatch!(self.backend(), |b, _pick| b.priority_range())
    }

    /// A new event (no timing: the cheapest to record and wait on).
    pub fn event(&self) -> Result<Event> {
        self.new_event(false)
    }

    /// A new event that can measure elapsed GPU time with [`Event::elapsed_ms`]. The simulator
    /// has no clock: its timing events record and wait like others, and `elapsed_ms` is an error.
    pub fn timing_event(&self) -> Result<Event> {
        self.new_event(true)
    }

    fn new_event(&self, timing: bool) -> Result<Event> {
        let id = EventId(ids::next_id());
        let repr = dispatch!(self.backend(), |b, _pick| b.wrap_event(b.create_event(id, timing)?));
        Ok(Event::new(self.clone(), id, repr))
    }

    pub(crate) fn alloc_raw(&self, bytes: usize, kind: MemKind, relaxed: bool) -> Result<RawBuffer> {
        let mem = dispatch!(self.backend(), |b, _pick| b.wrap_mem(b.alloc(bytes, kind, relaxed)?));
        Ok(RawBuffer {
            id: BufferId(ids::next_id()),
            device: self.id(),
            bytes,
            kind,
            mem,
            observer: self.inner.observer.clone(),
        })
    }

    /// Device memory for `len` elements. Contents are unspecified (zero on the simulator).
    ///
    /// A plain allocation is synchronous: the capture modes forbid it like CUDA does (see
    /// [`CaptureMode`]).
    pub fn alloc<T: Elem>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        Ok(DeviceBuffer::from_block(Block::whole(self.alloc_raw(len * T::DTYPE.size(), MemKind::Device, false)?)))
    }

    /// Page-locked host memory for `len` elements, zeroed.
    pub fn alloc_pinned<T: Elem>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        let buf =
            PinnedBuffer::from_block(Block::whole(self.alloc_raw(len * T::DTYPE.size(), MemKind::Pinned, false)?));
        buf.write(&vec![T::zeroed(); len])?;
        Ok(buf)
    }

    /// Device memory holding a copy of `data`, written after the work queued on `stream`
    /// (a blocking copy).
    pub fn alloc_from<T: Elem>(&self, stream: &Stream, data: &[T]) -> Result<DeviceBuffer<T>> {
        let buf = self.alloc::<T>(data.len())?;
        buf.write_from(stream, data)?;
        Ok(buf)
    }

    /// Compiles (on CUDA, or reads from the on-disk cache) and loads `kernel`'s module now.
    /// Launches load modules on first use, so this is only needed to keep compilation time out
    /// of a timed or captured region; CUDA 13.0 allows loading during a capture of any mode.
    pub fn load_kernel(&self, kernel: &'static Kernel) -> Result<()> {
        dispatch!(self.backend(), |b, _pick| b.load_kernel(kernel))
    }

    /// Waits for all work on all streams of this device.
    pub fn synchronize(&self) -> Result<()> {
        dispatch!(self.backend(), |b, _pick| b.synchronize())?;
        if let Some(o) = self.observer() {
            o.host_sync(observe::HostSync::Device);
        }
        Ok(())
    }
}

/// Puts a backend's handle into the matching [`Repr`] variant.
pub(crate) trait WrapRepr: backend::Backend {
    fn wrap_stream(&self, s: Self::Stream) -> backend::StreamRepr;
    fn wrap_event(&self, e: Self::Event) -> backend::EventRepr;
    fn wrap_mem(&self, m: Self::Mem) -> backend::MemRepr;
    fn wrap_graph(&self, g: Self::Graph) -> backend::GraphRepr;
    fn wrap_exec(&self, x: Self::Exec) -> backend::ExecRepr;
}

macro_rules! wrap_repr {
    ($ty:ty, $variant:ident) => {
        impl WrapRepr for $ty {
            fn wrap_stream(&self, s: Self::Stream) -> backend::StreamRepr {
                Repr::$variant(s)
            }
            fn wrap_event(&self, e: Self::Event) -> backend::EventRepr {
                Repr::$variant(e)
            }
            fn wrap_mem(&self, m: Self::Mem) -> backend::MemRepr {
                Repr::$variant(m)
            }
            fn wrap_graph(&self, g: Self::Graph) -> backend::GraphRepr {
                Repr::$variant(g)
            }
            fn wrap_exec(&self, x: Self::Exec) -> backend::ExecRepr {
                Repr::$variant(x)
            }
        }
    };
}
wrap_repr!(sim::SimDevice, Sim);
wrap_repr!(cuda::CudaDevice, Cuda);

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({}, {})", self.inner.id, self.name())
    }
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

/// Measures `n` launches of `kernel` (signature `(float* y, float c, unsigned n)`, as
/// `ops::elementwise::ADD_SCALAR`) through cudarc directly, eagerly and as one graph; the median
/// of `reps` repetitions. A benchmarking aid: it opens its own CUDA context.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a GPU.
pub fn raw_cuda_launch_baseline(
    ordinal: usize,
    kernel: &'static Kernel,
    n: usize,
    reps: usize,
) -> Result<RawLaunchTimes> {
    cuda::raw_launch_baseline(ordinal, kernel, n, reps)
}
