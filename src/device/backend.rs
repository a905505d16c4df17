//! The contract between the public device API and its two backends.
//!
//! [`Backend`] is implemented by `sim::SimDevice` and `cuda::CudaDevice`; the public types
//! (`Stream`, `Event`, buffers, `Graph`, `GraphExec`) hold a [`Repr`] with the backend's own
//! handle and dispatch with one `match`. Argument checks that do not depend on the backend
//! (device identity, bounds, lengths) are done once in the public layer before dispatch.

use std::sync::Arc;

use super::kernel::{Arg, Kernel, LaunchDims};
use super::memory::{Block, MemKind, RawBuffer};
use super::{cuda, sim, CaptureMode, CaptureStatus, NodeInfo};
use crate::{Error, Result};

/// A backend's handle for one object, or the other backend's.
pub(crate) enum Repr<S, C> {
    Sim(S),
    Cuda(C),
}

impl<S, C> Repr<S, C> {
    pub(crate) fn sim(&self) -> Result<&S> {
        match self {
            Repr::Sim(s) => Ok(s),
            Repr::Cuda(_) => Err(mixed()),
        }
    }

    pub(crate) fn cuda(&self) -> Result<&C> {
        match self {
            Repr::Cuda(c) => Ok(c),
            Repr::Sim(_) => Err(mixed()),
        }
    }
}

// Unreachable through the public API, which compares device ids first; kept as an error rather
// than a panic so that a bug here cannot abort a training run.
fn mixed() -> Error {
    Error::Unsupported {
        op: "dispatch",
        backend: "sim",
        why: "an object of one backend reached the other; please report this as a bug",
    }
}

pub(crate) type StreamRepr = Repr<<sim::SimDevice as Backend>::Stream, <cuda::CudaDevice as Backend>::Stream>;
pub(crate) type EventRepr = Repr<<sim::SimDevice as Backend>::Event, <cuda::CudaDevice as Backend>::Event>;
pub(crate) type MemRepr = Repr<<sim::SimDevice as Backend>::Mem, <cuda::CudaDevice as Backend>::Mem>;
pub(crate) type GraphRepr = Repr<<sim::SimDevice as Backend>::Graph, <cuda::CudaDevice as Backend>::Graph>;
pub(crate) type ExecRepr = Repr<<sim::SimDevice as Backend>::Exec, <cuda::CudaDevice as Backend>::Exec>;

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyDir {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// An operation to enqueue. Offsets are in bytes from the start of the block's `raw`
/// allocation; everything is already bounds-checked.
pub(crate) enum Op<'a> {
    Kernel {
        kernel: &'static Kernel,
        dims: LaunchDims,
        args: &'a [Arg<'a>],
    },
    /// A GEMM: `kernel` is its CPU path and name, `args` as `Gemm::args` lays them out.
    Gemm {
        kernel: &'static Kernel,
        args: &'a [Arg<'a>],
        spec: super::gemm::GemmSpec,
        alpha: f32,
        beta: f32,
    },
    /// cuDNN's fused attention: `kernel` names it, `args` as `Sdpa::args` lays them out.
    Sdpa {
        kernel: &'static Kernel,
        args: &'a [Arg<'a>],
        spec: super::sdpa::SdpaSpec,
    },
    Copy {
        dir: CopyDir,
        src: &'a Arc<Block>,
        src_offset: usize,
        dst: &'a Arc<Block>,
        dst_offset: usize,
        bytes: usize,
    },
    Memset {
        dst: &'a Arc<Block>,
        offset: usize,
        bytes: usize,
        value: u8,
    },
    /// A collective, or sends and receives issued as one group (NCCL's `ncclGroupStart`/`End`):
    /// a group's parts progress together, so two ranks that send to each other meet.
    Collective {
        comm: &'a super::comm::CommRepr,
        parts: &'a [Part<'a>],
        dtype: super::DType,
    },
}

/// One operation of a collective group: `src` is read (and written, in place), `dst` written;
/// `count` is NCCL's count for the operation.
pub(crate) struct Part<'a> {
    pub(crate) kind: super::comm::Collective,
    pub(crate) src: (&'a Arc<Block>, usize),
    pub(crate) dst: (&'a Arc<Block>, usize),
    pub(crate) count: usize,
}

impl Op<'_> {
    /// The operation's name in graphs and reports.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::Kernel { kernel, .. } | Op::Gemm { kernel, .. } | Op::Sdpa { kernel, .. } => kernel.name,
            Op::Copy { dir: CopyDir::HostToDevice, .. } => "memcpy_h2d",
            Op::Copy { dir: CopyDir::DeviceToHost, .. } => "memcpy_d2h",
            Op::Copy { dir: CopyDir::DeviceToDevice, .. } => "memcpy_d2d",
            Op::Memset { .. } => "memset",
            Op::Collective { parts: [one], .. } => one.kind.name(),
            Op::Collective { .. } => "p2p_group",
        }
    }
}

/// What each backend implements. Handles carry their own ids for error messages.
pub(crate) trait Backend: Send + Sync + 'static {
    type Stream: Send + Sync;
    type Event: Send + Sync;
    type Mem: Send + Sync;
    type Graph: Send + Sync;
    type Exec: Send + Sync;

    fn create_stream(&self, id: super::StreamId, priority: i32) -> Result<Self::Stream>;
    fn legacy_stream(&self, id: super::StreamId) -> Result<Self::Stream>;
    fn priority_range(&self) -> Result<(i32, i32)>;
    /// A new event; `timing` events can measure elapsed time (and are slower to record).
    fn create_event(&self, id: super::EventId, timing: bool) -> Result<Self::Event>;
    /// Milliseconds between two completed records of timing events.
    fn elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> Result<f32>;
    /// A plain (synchronous) allocation. `relaxed` makes it in relaxed capture-interaction mode
    /// for this thread, so that an allocator can grow during a capture (as PyTorch's does).
    fn alloc(&self, bytes: usize, kind: MemKind, relaxed: bool) -> Result<Self::Mem>;
    /// The granularity in bytes of expandable device memory (CUDA's virtual memory management:
    /// an address range whose pages are mapped and unmapped), or `None` without it.
    fn vm_granularity(&self) -> Result<Option<usize>>;
    /// Expandable device memory: `capacity` bytes of address range with nothing mapped, to be
    /// mapped in pieces of `chunk` bytes (a multiple of the granularity, dividing `capacity`).
    /// `relaxed` as for `alloc`.
    fn reserve(&self, capacity: usize, chunk: usize, relaxed: bool) -> Result<Self::Mem>;
    /// Maps expandable memory so that its first `bytes` (a multiple of its chunk) are usable;
    /// bytes already mapped keep their contents and addresses. `relaxed` as for `alloc`.
    fn map_to(&self, mem: &Self::Mem, bytes: usize, relaxed: bool) -> Result<()>;
    /// Waits for the device, then unmaps expandable memory after its first `bytes` (a multiple of
    /// its chunk), giving the pages back. The caller guarantees that no graph uses those bytes.
    fn unmap_from(&self, mem: &Self::Mem, bytes: usize) -> Result<()>;
    /// Bytes of expandable memory mapped now (after a failed `map_to` or `unmap_from` too).
    fn mapped(mem: &Self::Mem) -> usize;
    /// The device's free and total memory in bytes (the driver's `cuMemGetInfo`).
    fn memory_info(&self) -> Result<(usize, usize)>;
    /// The id of the active capture `stream` takes part in, if any.
    fn capture_id(&self, stream: &Self::Stream) -> Result<Option<u64>>;

    /// Compiles (or reads from the cache) and loads the kernel's module now.
    fn load_kernel(&self, kernel: &'static Kernel) -> Result<()>;
    /// Bytes of the per-stream workspace a GEMM is given (and declares as a hidden access).
    fn gemm_workspace_bytes(&self) -> usize;
    /// cuDNN's plan for a fused attention call (planned once per spec), or why there is none.
    fn sdpa_plan(&self, spec: &super::sdpa::SdpaSpec) -> Result<super::sdpa::SdpaPlan>;
    fn enqueue(&self, stream: &Self::Stream, op: &Op<'_>) -> Result<()>;
    fn record(&self, stream: &Self::Stream, event: &Self::Event, external: bool) -> Result<()>;
    fn wait(&self, stream: &Self::Stream, event: &Self::Event, external: bool) -> Result<()>;

    fn stream_synchronize(&self, stream: &Self::Stream) -> Result<()>;
    fn stream_query(&self, stream: &Self::Stream) -> Result<bool>;
    fn event_query(&self, event: &Self::Event) -> Result<bool>;
    fn event_synchronize(&self, event: &Self::Event) -> Result<()>;
    fn synchronize(&self) -> Result<()>;

    /// Copies `out.len()` bytes at `offset` of device memory to the host after all work queued on
    /// `stream`, and waits for it.
    fn read_blocking(&self, stream: &Self::Stream, mem: &Self::Mem, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Copies `data` to device memory at `offset` after all work queued on `stream`, and waits.
    fn write_blocking(&self, stream: &Self::Stream, mem: &Self::Mem, offset: usize, data: &[u8]) -> Result<()>;
    /// Host read of pinned memory at byte `offset`, now (no ordering).
    fn read_pinned(mem: &Self::Mem, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Host write of pinned memory at byte `offset`, now (no ordering).
    fn write_pinned(mem: &Self::Mem, offset: usize, data: &[u8]) -> Result<()>;

    fn begin_capture(&self, stream: &Self::Stream, mode: CaptureMode) -> Result<()>;
    fn end_capture(&self, stream: &Self::Stream) -> Result<Self::Graph>;
    fn capture_status(&self, stream: &Self::Stream) -> Result<CaptureStatus>;

    fn graph_nodes(&self, graph: &Self::Graph) -> Result<Vec<NodeInfo>>;
    fn graph_dot(&self, graph: &Self::Graph) -> Result<String>;
    /// How each captured operation's node names buffers, in capture order.
    fn graph_sites(&self, graph: &Self::Graph) -> Arc<[super::patch::Site]>;
    fn instantiate(&self, graph: &Self::Graph) -> Result<Self::Exec>;
    /// Points the uses of the listed sites (indices into `sites`) at their bound buffers in the
    /// executable, the others as captured, for later launches.
    fn rebind(
        &self,
        exec: &Self::Exec,
        sites: &[super::patch::Site],
        changes: &[super::patch::SiteChange],
    ) -> Result<()>;
    /// Turns the nodes of the listed sites off or on in the executable, for later launches.
    fn set_enabled(&self, exec: &Self::Exec, sites: &[usize], enabled: bool) -> Result<()>;
    fn upload(&self, exec: &Self::Exec, stream: &Self::Stream) -> Result<()>;
    fn launch(&self, exec: &Self::Exec, stream: &Self::Stream) -> Result<()>;
}

/// Which backend a device runs on.
pub(crate) enum BackendImpl {
    Sim(sim::SimDevice),
    Cuda(cuda::CudaDevice),
}

/// Dispatches one backend call: `dispatch!(backend, b => call)`, where `call` uses `b` and the
/// `.sim()?`/`.cuda()?` accessor named by `pick!`.
macro_rules! dispatch {
    ($backend:expr, |$b:ident, $pick:ident| $body:expr) => {
        match $backend {
            $crate::device::backend::BackendImpl::Sim($b) => {
                #[allow(unused_imports)]
                use $crate::device::{backend::Backend as _, WrapRepr as _};
                #[allow(unused_macros)]
                macro_rules! $pick {
                    ($e:expr) => {
                        $e.sim()?
                    };
                }
                $body
            }
            $crate::device::backend::BackendImpl::Cuda($b) => {
                #[allow(unused_imports)]
                use $crate::device::{backend::Backend as _, WrapRepr as _};
                #[allow(unused_macros)]
                macro_rules! $pick {
                    ($e:expr) => {
                        $e.cuda()?
                    };
                }
                $body
            }
        }
    };
}
pub(crate) use dispatch;

pub(crate) fn mapped(raw: &RawBuffer) -> usize {
    match &raw.mem {
        Repr::Sim(m) => <sim::SimDevice as Backend>::mapped(m),
        Repr::Cuda(m) => <cuda::CudaDevice as Backend>::mapped(m),
    }
}

/// The address a kernel is given for byte `offset` of `raw`: CUDA's device pointer, or the
/// simulator's own ([`sim::address`]).
pub(crate) fn device_address(raw: &RawBuffer, offset: usize) -> Result<u64> {
    match &raw.mem {
        Repr::Sim(_) => Ok(sim::address(raw.id, offset)),
        Repr::Cuda(_) => cuda::kernel_address(raw, offset),
    }
}

pub(crate) fn read_pinned(block: &Block, out: &mut [u8]) -> Result<()> {
    match &block.raw.mem {
        Repr::Sim(m) => <sim::SimDevice as Backend>::read_pinned(m, block.base, out),
        Repr::Cuda(m) => <cuda::CudaDevice as Backend>::read_pinned(m, block.base, out),
    }
}

pub(crate) fn write_pinned(block: &Block, data: &[u8]) -> Result<()> {
    match &block.raw.mem {
        Repr::Sim(m) => <sim::SimDevice as Backend>::write_pinned(m, block.base, data),
        Repr::Cuda(m) => <cuda::CudaDevice as Backend>::write_pinned(m, block.base, data),
    }
}
