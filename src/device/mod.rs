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
//! | `cublasLtMatmul` in FP8       | [`Stream::fp8_gemm`] of an [`Fp8Gemm`]   | the same loop, exact products   |
//! | `cudnnBackendExecute` (SDPA)  | `ops::attention` on the cuDNN backend    | refused: no cuDNN               |
//! | `cuStreamBeginCapture` / End  | [`Stream::begin_capture`] / `end_capture`| the same capture rules          |
//! | `CUgraph` / `CUgraphExec`     | [`Graph`] / [`GraphExec`]                | a DAG of deferred operations    |
//! | `nvtxRangePush` / `Pop`       | [`Device::range`], a [`Range`] guard     | the same range log              |
//!
//! This layer uses no other layer of graphed, with one exception: the simulator comes with the
//! stream-safety checker (layer 2) installed, through the `observe` hook. Only `cuda/` names
//! cudarc. Every enqueued operation declares its [`Access`]es, derived from its typed arguments.

mod access;
pub(crate) mod backend;
mod capture;
mod comm;
mod cuda;
mod dtype;
mod event;
pub(crate) mod gemm;
mod graph;
pub(crate) mod ids;
pub mod kernel;
pub(crate) mod memory;
pub(crate) mod observe;
pub(crate) mod patch;
mod profile;
mod range;
pub(crate) mod sdpa;
pub mod sim;
mod stream;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

pub use access::{Access, AccessMode, AccessRole, Dim, Region};
pub use capture::{Capture, CaptureMode, CaptureStatus};
pub(crate) use comm::per_rank_thread;
pub use comm::{
    CapturedCollective, CommErrorKind, CommOptions, Communicator, NcclId, Stalled, StalledLaunch, Transfer,
    PEER_NAMING_GRACE,
};
/// `graphed bench launch`'s yardstick, not part of the product: public only because the
/// benchmark is a binary of this package and only `cuda/` may name cudarc.
pub use cuda::baseline;
pub(crate) use dtype::with_dtype;
pub use dtype::{DType, Elem, Float, Float8};
pub use event::Event;
pub use gemm::{Epilogue, Fp8Gemm, Fp8Pair, Gemm, GemmElem, AUX_LD_MULTIPLE, FP8_ALIGN_BYTES, FP8_SCALE_ALIGN_BYTES};
pub use graph::{Graph, GraphExec, NodeInfo, NodeKind};
pub use ids::{BufferId, DeviceId, EventId, GraphId, StreamId};
pub use kernel::{args, Arg, CpuArgs, In, InOut, IntoView, Kernel, LaunchDims, Out, Scalar};
pub use memory::{DeviceBuffer, HostView, MemKind, PinnedBuffer, View};
pub(crate) use patch::ResolvedRebind;
pub use patch::{Rebind, RebindErrorKind};
pub use profile::{KernelTime, Profile};
pub use range::{Range, RangeEdge, RangeEvent, RangeFault, RangeLog, RangeName, Span, RANGE_LOG_CAPACITY};
pub use sim::{Policy, SimConfig, DEFAULT_SIM_MEMORY};
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
/// Cloning is cheap and yields the same device. An error raised in a `Drop` (destroying a graph,
/// freeing memory) is kept by the device and returned, as [`Error::Deferred`], by its next
/// launch, GEMM, async copy or memset, event record or wait, graph launch or synchronize, which
/// then does nothing else; [`Device::take_error`] returns it sooner.
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
    /// Errors of drops, for the next fallible call; shared with the CUDA backend's handles.
    errors: Arc<ErrorSlot>,
    /// The stream-safety checker, when on (always on the simulator).
    observer: Option<Arc<dyn observe::Observer>>,
    /// The range log ([`Device::record_ranges`]).
    ranges: range::RangeRecorder,
    /// Whether ranges go to NVTX: a CUDA device with NVTX's library present.
    nvtx: bool,
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
        let backend = BackendImpl::Sim(sim::SimDevice::new(config));
        let inner =
            DeviceInner { id, backend, errors: Arc::default(), observer, ranges: Default::default(), nvtx: false };
        Device { inner: Arc::new(inner) }
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
        let errors = Arc::new(ErrorSlot::default());
        let backend = cuda::CudaDevice::new(id, ordinal, errors.clone())?;
        // Without the full checker, captures are still watched: the graph layer verifies the
        // replay contract from their access summaries.
        let observer = match check {
            true => crate::check::Checker::new_observer(strict),
            false => crate::check::Checker::new_capture_observer(),
        };
        let backend = BackendImpl::Cuda(backend);
        let (ranges, nvtx) = (Default::default(), cuda::nvtx::available());
        Ok(Device { inner: Arc::new(DeviceInner { id, backend, errors, observer: Some(observer), ranges, nvtx }) })
    }

    pub(crate) fn observer(&self) -> Option<&Arc<dyn observe::Observer>> {
        self.inner.observer.as_ref()
    }

    /// GPU 0 when a driver and a GPU are present, else the default simulator. Why CUDA was not
    /// used is logged (`tracing`, info level); [`Device::cuda_or_sim`] returns it instead.
    pub fn auto() -> Device {
        let (dev, why) = Device::cuda_or_sim(SimConfig::default());
        if let Some(e) = why {
            tracing::info!("{e}; using the simulator");
        }
        dev
    }

    /// GPU 0 when a driver and a GPU are present, else the simulator with `config`, with the
    /// reason CUDA was not used (an [`Error::CudaUnavailable`], for the caller to show).
    pub fn cuda_or_sim(config: SimConfig) -> (Device, Option<Error>) {
        match Device::cuda(0) {
            Ok(dev) => (dev, None),
            Err(e) => (Device::sim_with(config), Some(e)),
        }
    }

    /// Keeps `e`, an error raised where it cannot be returned (in a `Drop` of something of this
    /// device): the device's next fallible call returns it as [`Error::Deferred`]. Only the
    /// first error is kept until it is returned; later ones are counted in it.
    pub fn record_err(&self, e: Error) {
        self.inner.errors.record("a value of this device", e);
    }

    /// [`Device::record_err`], naming what was being dropped ("a graph executable").
    pub(crate) fn record_drop_err(&self, during: &'static str, e: Error) {
        self.inner.errors.record(during, e);
    }

    /// The kept error of a failed drop, as [`Error::Deferred`], if any; it is cleared, so the
    /// next call does not return it.
    pub fn take_error(&self) -> Option<Error> {
        self.inner.errors.take()
    }

    /// Returns the kept error of a failed drop, once. Called first by the calls made on every
    /// step (launches, copies, event verbs, synchronizes): when nothing is kept, it costs one
    /// atomic load.
    #[inline]
    pub(crate) fn check_err(&self) -> Result<()> {
        match self.inner.errors.take() {
            Some(e) => Err(e),
            None => Ok(()),
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

    /// Whether the device can time work with [`Event::elapsed_ms`]: CUDA can; the simulator has
    /// no clock.
    pub fn has_clock(&self) -> bool {
        self.kind() == DeviceKind::Cuda
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

    /// The granularity of expandable device memory and the device's total memory, or `None`
    /// where the device has no expandable memory (a driver without virtual memory management).
    /// Leaves a kept error for the next call that reports errors.
    pub(crate) fn vm_layout(&self) -> Result<Option<(usize, usize)>> {
        dispatch!(self.backend(), |b, _pick| match b.vm_granularity()? {
            Some(granularity) => Ok(Some((granularity, b.memory_info()?.1))),
            None => Ok(None),
        })
    }

    /// Expandable device memory: an address range of `capacity` bytes, nothing mapped yet (see
    /// [`Device::map_raw`]), mapped in pieces of `chunk` bytes. `relaxed` as for
    /// [`Device::alloc_raw`].
    pub(crate) fn reserve_raw(&self, capacity: usize, chunk: usize, relaxed: bool) -> Result<RawBuffer> {
        let mem = dispatch!(self.backend(), |b, _pick| b.wrap_mem(b.reserve(capacity, chunk, relaxed)?));
        Ok(RawBuffer {
            id: BufferId(ids::next_id()),
            device: self.id(),
            bytes: capacity,
            kind: MemKind::Device,
            mem,
            observer: self.inner.observer.clone(),
        })
    }

    /// Maps the first `bytes` of expandable memory (a multiple of its chunk). Memory already
    /// mapped keeps its contents and addresses. `relaxed` as for [`Device::alloc_raw`].
    pub(crate) fn map_raw(&self, raw: &RawBuffer, bytes: usize, relaxed: bool) -> Result<()> {
        dispatch!(self.backend(), |b, pick| b.map_to(pick!(raw.mem), bytes, relaxed))
    }

    /// Waits for the device, then unmaps expandable memory after its first `bytes`, giving the
    /// pages back. The caller knows that no graph that may still run uses those bytes.
    pub(crate) fn unmap_raw(&self, raw: &RawBuffer, bytes: usize) -> Result<()> {
        dispatch!(self.backend(), |b, pick| b.unmap_from(pick!(raw.mem), bytes))
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

    /// The device's free and total memory in bytes: on CUDA the driver's (`cuMemGetInfo`,
    /// which counts every allocation of every process, the allocator's cached segments
    /// included); on the simulator its configured memory less what it holds (device and pinned
    /// buffers alike), and free no more than the host has available (its device memory is host
    /// memory).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.check_err()?;
        dispatch!(self.backend(), |b, _pick| b.memory_info())
    }

    /// Waits for all work on all streams of this device.
    pub fn synchronize(&self) -> Result<()> {
        self.check_err()?;
        dispatch!(self.backend(), |b, _pick| b.synchronize())?;
        if let Some(o) = self.observer() {
            o.host_sync(observe::HostSync::Device);
        }
        Ok(())
    }
}

/// The error of the first failed drop not yet returned, and how many failed after it. Shared by
/// a device and its CUDA handles, which may be dropped on any thread.
#[derive(Default)]
pub(crate) struct ErrorSlot {
    /// Whether `kept` holds an error: the one load the calls of every step pay.
    pending: AtomicBool,
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    first: Option<(&'static str, Error)>,
    more: usize,
}

impl ErrorSlot {
    /// Keeps the error of dropping `during`, or counts it if one is already kept.
    pub(crate) fn record(&self, during: &'static str, error: Error) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        match kept.first {
            Some(_) => kept.more += 1,
            None => kept.first = Some((during, error)),
        }
        self.pending.store(true, Ordering::Release);
    }

    /// The kept error as [`Error::Deferred`], clearing the slot.
    #[inline]
    pub(crate) fn take(&self) -> Option<Error> {
        if !self.pending.load(Ordering::Acquire) {
            return None;
        }
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        self.pending.store(false, Ordering::Relaxed);
        let (during, error) = kept.first.take()?;
        Some(Error::Deferred { during, error: Box::new(error), more: std::mem::take(&mut kept.more) })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn add_one_cpu(a: &CpuArgs) -> Result<()> {
        a.output::<f32>("y")?.iter_mut().for_each(|y| *y += 1.0);
        Ok(())
    }

    static ADD_ONE: Kernel = Kernel { name: "add_one", source: "", params: &["y"], cpu: add_one_cpu, strided: false };

    fn launch(s: &Stream, y: &DeviceBuffer<f32>) -> Result<()> {
        s.launch(&ADD_ONE, LaunchDims::for_elems(y.len()), &args![InOut(y)])
    }

    fn failed_drop() -> Error {
        Error::Cuda { op: "cuGraphExecDestroy", message: "CUDA_ERROR_INVALID_VALUE".into() }
    }

    #[test]
    fn a_resolved_rebind_moves_its_uses_in_its_own_graph_only() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let (y, other, short) =
            (dev.alloc_from(&s, &[0.0f32; 4])?, dev.alloc_from(&s, &[5.0f32; 4])?, dev.alloc::<f32>(2)?);
        let capture = || -> Result<GraphExec> {
            let cap = s.capture(CaptureMode::ThreadLocal)?;
            launch(&s, &y)?;
            cap.finish()?.instantiate()
        };
        let (exec, elsewhere) = (capture()?, capture()?);
        let resolved = exec.resolve(&Rebind::new(y.view(), y.view())?.moving_writes())?;
        fn to(b: &DeviceBuffer<f32>) -> Option<(&Arc<memory::Block>, usize)> {
            Some((&b.block, 0))
        }
        assert!(matches!(elsewhere.rebind_resolved(&[(&resolved, to(&other))]), Err(Error::Unsupported { .. })));
        assert!(matches!(exec.rebind_resolved(&[(&resolved, to(&short))]), Err(Error::LengthMismatch { .. })));
        assert_eq!(exec.rebind_resolved(&[(&resolved, to(&other))])?, 1);
        exec.launch(&s)?;
        assert_eq!((y.to_vec(&s)?, other.to_vec(&s)?), (vec![0.0; 4], vec![6.0; 4]));
        assert_eq!(exec.rebind_resolved(&[(&resolved, None)])?, 1); // back where it was captured
        exec.launch(&s)?;
        assert_eq!((y.to_vec(&s)?, other.to_vec(&s)?), (vec![1.0; 4], vec![6.0; 4]));
        Ok(())
    }

    #[test]
    fn the_last_rebind_of_a_call_naming_the_same_bytes_wins() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let fill = |v: f32| dev.alloc_from(&s, &[v; 4]);
        let (y, a, b) = (fill(0.0)?, fill(10.0)?, fill(20.0)?);
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        launch(&s, &y)?;
        let exec = cap.finish()?.instantiate()?;
        fn to<'a>(y: &'a DeviceBuffer<f32>, t: &'a DeviceBuffer<f32>) -> Result<Rebind<'a>> {
            Rebind::new(y.view(), t.view()).map(Rebind::moving_writes)
        }
        let values = || -> Result<Vec<Vec<f32>>> { [&y, &a, &b].iter().map(|t| t.to_vec(&s)).collect() };
        assert_eq!(exec.rebind(&[to(&y, &a)?, to(&y, &b)?])?, 1);
        exec.launch(&s)?;
        assert_eq!(values()?, [vec![0.0; 4], vec![10.0; 4], vec![21.0; 4]]);
        // Away and back where it was captured in one call: as if it had never moved.
        assert_eq!(exec.rebind(&[to(&y, &a)?, to(&y, &y)?])?, 1);
        exec.launch(&s)?;
        assert_eq!(values()?, [vec![1.0; 4], vec![10.0; 4], vec![21.0; 4]]);
        Ok(())
    }

    #[test]
    fn a_kept_error_is_returned_by_the_next_launch_once_and_the_launch_does_nothing() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let y = dev.alloc_from(&s, &[0.0f32; 4])?;
        dev.record_drop_err("a graph executable", failed_drop());
        match launch(&s, &y) {
            Err(Error::Deferred { during: "a graph executable", error, more: 0 }) => {
                assert!(matches!(*error, Error::Cuda { op: "cuGraphExecDestroy", .. }));
            }
            other => panic!("expected the kept error, got {other:?}"),
        }
        launch(&s, &y)?;
        s.synchronize()?;
        assert_eq!(y.to_vec(&s)?, vec![1.0; 4]);
        Ok(())
    }

    #[test]
    fn take_error_returns_and_clears_the_kept_error_and_counts_later_ones() -> Result<()> {
        let dev = Device::sim();
        dev.record_err(failed_drop());
        dev.record_err(Error::GraphReset { op: "GraphExec::launch" });
        dev.record_err(Error::GraphReset { op: "GraphExec::launch" });
        let e = dev.take_error().expect("an error was recorded");
        assert!(matches!(&e, Error::Deferred { during: "a value of this device", more: 2, .. }));
        assert!(e.to_string().contains("2 later drops failed too"), "{e}");
        assert!(dev.take_error().is_none());
        dev.synchronize()
    }

    #[test]
    fn with_nothing_kept_every_call_runs() -> Result<()> {
        let dev = Device::sim();
        let (s, t) = (dev.stream()?, dev.stream()?);
        let e = dev.event()?;
        let y = dev.alloc_from(&s, &[0.0f32; 4])?;
        let graph = {
            let cap = s.capture(CaptureMode::ThreadLocal)?;
            launch(&s, &y)?;
            cap.finish()?
        }
        .instantiate()?;
        launch(&s, &y)?;
        graph.launch(&s)?;
        s.record(&e)?;
        t.wait(&e)?;
        s.memset(&y, 0)?;
        dev.synchronize()?;
        assert!(dev.take_error().is_none());
        Ok(())
    }

    #[test]
    fn abandoning_a_capture_keeps_no_error_about_its_discarded_graph() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let y = dev.alloc_from(&s, &[0.0f32; 4])?;
        {
            let _cap = s.capture(CaptureMode::ThreadLocal)?;
            // Invalidates the capture: ending it when the guard drops fails, for that graph only.
            assert!(s.synchronize().is_err());
        }
        assert!(dev.take_error().is_none());
        launch(&s, &y)
    }
}
