//! The CUDA backend: CUDA's own streams, events, memory, kernels, capture and graphs, through the
//! driver API (cudarc 0.19 with the CUDA 13.0 bindings).
//!
//! - [`context`] opens a GPU without ever panicking (cudarc panics on a missing library);
//! - [`stream`] has streams and events, [`memory`] allocations and copies, [`launch`] kernels
//!   (compiled and cached by [`nvrtc`]);
//! - [`capture`] is the process-wide registry of captures: what each graph must keep alive, and
//!   the frees that must wait until no capture is active;
//! - [`graph`] owns graphs and executables and reads nodes back;
//! - [`ffi`] holds the few raw driver and NVRTC calls, each wrapped once; [`error`] maps result
//!   codes to [`Error`](crate::Error);
//! - [`cudnn`] runs fused attention through cuDNN's backend graph API, after probing for it;
//! - [`nvtx`] pushes and pops profiler ranges, after probing for NVTX's library;
//! - [`baseline`] measures raw cudarc launches, the yardstick for graphed's launch overhead
//!   (`graphed bench launch`'s, re-exported as `device::baseline`).
//!
//! cudarc's event tracking is off: it would make every use of memory wait on events recorded
//! before a capture, which CUDA refuses (isolation). All ordering is graphed's, through events.

#![allow(unsafe_code)]

pub mod baseline;
mod blas;

pub(crate) use nccl::{nccl_unique_id, NcclComm};
mod capture;
mod context;
mod cudnn;
mod disk_cache;
mod error;
mod ffi;
mod graph;
mod launch;
mod memory;
mod nccl;
mod nvrtc;
pub(crate) mod nvtx;
mod stream;
#[cfg(test)]
mod tests;

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, CudaContext};

use self::error as err;
use self::graph::{CuExec, CuGraph};
use self::launch::Kernels;
use self::memory::CuMem;
use self::stream::{CuEvent, CuStream};
use super::backend::{Backend, CopyDir, Op};
use super::memory::MemKind;
use super::{CaptureMode, CaptureStatus, DeviceId, ErrorSlot, EventId, NodeInfo, StreamId};
use crate::error::CaptureSite;
use crate::Result;

/// The device pointer a kernel is given for byte `offset` of `raw`.
pub(crate) fn kernel_address(raw: &super::memory::RawBuffer, offset: usize) -> Result<u64> {
    memory::kernel_arg("device_address", raw, offset)
}

/// One GPU, through its primary context.
pub(crate) struct CudaDevice {
    ctx: Arc<CudaContext>,
    kernels: Kernels,
    blas: blas::Blas,
    cudnn: cudnn::Cudnn,
    description: String,
    /// The device's error slot, handed to every stream and allocation.
    errors: Arc<ErrorSlot>,
}

impl CudaDevice {
    /// Where the node that `op` just added to `stream`'s capture can be patched: our own
    /// kernels and device-source copies, found as the capture's new frontier.
    fn patch_node(&self, stream: &CuStream, op: &Op<'_>) -> Result<capture::Patchable> {
        let template = match *op {
            Op::Kernel { kernel, dims, args } => {
                let (func, dims, values) = self.kernels.template(stream, kernel, &dims, args)?;
                graph::Template::Kernel { func, dims, values }
            }
            Op::Copy { dir: CopyDir::DeviceToHost, .. } => {
                graph::Template::Copy { device_dst: false, captured: OnceLock::new() }
            }
            Op::Copy { dir: CopyDir::DeviceToDevice, .. } => {
                graph::Template::Copy { device_dst: true, captured: OnceLock::new() }
            }
            // A copy from pinned memory, which no rebind moves (its destination is a write), and
            // a memset (a write): held to be turned off and on.
            Op::Copy { .. } | Op::Memset { .. } => graph::Template::Fixed,
            // Library calls and collectives: their sites are opaque.
            _ => return Ok(capture::Patchable::Never),
        };
        let frontier =
            ffi::capture_frontier(&stream.raw).map_err(|e| err::at(op.name(), CaptureSite::Stream(stream.id), e))?;
        Ok(match frontier[..] {
            [node] => capture::Patchable::At(graph::PatchNode { node, template }),
            // Not the one node expected: left alone, and what it reads refuses to move.
            _ => capture::Patchable::Unknown,
        })
    }

    /// Opens GPU `ordinal`; [`Error::CudaUnavailable`](crate::Error::CudaUnavailable) when the
    /// driver, NVRTC or the GPU is missing, or the GPU is older than compute capability 7.0.
    /// Handles whose destruction fails keep the error in `errors`.
    pub(crate) fn new(_id: DeviceId, ordinal: usize, errors: Arc<ErrorSlot>) -> Result<CudaDevice> {
        let opened = context::open(ordinal)?;
        let version = ffi::driver_version().map_err(|e| err::driver("Device::cuda", None, e))?;
        let compiler = nvrtc::Compiler::new(opened.cc)?;
        let description =
            format!("{} ({}, driver {}.{})", opened.name, compiler.arch(), version / 1000, version % 1000 / 10);
        Ok(CudaDevice {
            kernels: Kernels::new(opened.ctx.clone(), compiler)?,
            blas: blas::Blas::default(),
            cudnn: cudnn::Cudnn::default(),
            ctx: opened.ctx,
            description,
            errors,
        })
    }

    /// The GPU's ordinal in this process.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// "NVIDIA H200 (sm_90, driver 13.0)".
    pub(crate) fn describe(&self) -> String {
        self.description.clone()
    }

    /// Makes the device's context current on this thread, as driver calls without a stream need;
    /// also reports an error that one of cudarc's destructors (streams, events, modules) left on
    /// the context.
    fn bind(&self, op: &'static str) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| err::driver(op, None, e))
    }

    /// Joins NCCL group `id` as `rank` of `size` on this GPU, waiting for the others as
    /// `patience` allows.
    pub(crate) fn nccl_comm(
        &self,
        rank: usize,
        size: usize,
        id: &[u8; 128],
        patience: &crate::device::comm::Patience<'_>,
    ) -> Result<NcclComm, crate::device::CommErrorKind> {
        self.bind("Communicator::nccl").map_err(|e| crate::device::CommErrorKind::Nccl(e.to_string()))?;
        nccl::init(rank, size, id, patience, &self.errors)
    }

    /// [`NcclComm::split`] with this device's context current.
    pub(crate) fn nccl_split(
        &self,
        comm: &NcclComm,
        color: Option<i32>,
        key: i32,
        patience: &crate::device::comm::Patience<'_>,
    ) -> Result<Option<(NcclComm, usize, usize)>, crate::device::CommErrorKind> {
        self.bind("Communicator::split").map_err(|e| crate::device::CommErrorKind::Nccl(e.to_string()))?;
        comm.split(color, key, patience)
    }
}

impl Backend for CudaDevice {
    type Stream = CuStream;
    type Event = CuEvent;
    type Mem = CuMem;
    type Graph = CuGraph;
    type Exec = CuExec;

    fn create_stream(&self, id: StreamId, priority: i32) -> Result<CuStream> {
        stream::create(&self.ctx, &self.errors, id, priority)
    }

    fn legacy_stream(&self, id: StreamId) -> Result<CuStream> {
        Ok(stream::legacy(&self.ctx, &self.errors, id))
    }

    fn priority_range(&self) -> Result<(i32, i32)> {
        const OP: &str = "priority_range";
        self.bind(OP)?;
        result::stream::get_priority_range().map_err(|e| err::driver(OP, None, e))
    }

    fn create_event(&self, id: EventId, timing: bool) -> Result<CuEvent> {
        stream::create_event(&self.ctx, id, timing)
    }

    fn elapsed_ms(&self, start: &CuEvent, end: &CuEvent) -> Result<f32> {
        self.bind("Event::elapsed_ms")?;
        stream::elapsed_ms(start, end)
    }

    fn alloc(&self, bytes: usize, kind: MemKind, relaxed: bool) -> Result<CuMem> {
        self.bind("alloc")?;
        if relaxed {
            capture::relaxed(|| memory::alloc(&self.ctx, &self.errors, bytes, kind))
        } else {
            memory::alloc(&self.ctx, &self.errors, bytes, kind)
        }
    }

    fn vm_granularity(&self) -> Result<Option<usize>> {
        const OP: &str = "CachingAllocator::new";
        self.bind(OP)?;
        ffi::vm_granularity(&self.ctx).map_err(|e| err::driver(OP, None, e))
    }

    fn reserve(&self, capacity: usize, chunk: usize, relaxed: bool) -> Result<CuMem> {
        self.bind("reserve device addresses")?;
        // A pool's first growth happens inside its first capture.
        if relaxed {
            capture::relaxed(|| memory::reserve(&self.ctx, &self.errors, capacity, chunk))
        } else {
            memory::reserve(&self.ctx, &self.errors, capacity, chunk)
        }
    }

    fn map_to(&self, mem: &CuMem, bytes: usize, relaxed: bool) -> Result<()> {
        self.bind("map device memory")?;
        // As for `alloc`: relaxed, a capture on this thread lets the mapping through. Mapping is
        // a host action, never captured; the pages stay mapped for every replay.
        if relaxed {
            capture::relaxed(|| memory::map_to(mem, bytes, self.ordinal()))
        } else {
            memory::map_to(mem, bytes, self.ordinal())
        }
    }

    fn unmap_from(&self, mem: &CuMem, bytes: usize) -> Result<()> {
        self.bind("unmap device memory")?;
        memory::unmap_from(mem, bytes)
    }

    fn mapped(mem: &CuMem) -> usize {
        memory::usable(mem)
    }

    fn memory_info(&self) -> Result<(usize, usize)> {
        const OP: &str = "Device::memory_info";
        self.bind(OP)?;
        ffi::mem_get_info().map_err(|e| err::driver(OP, None, e))
    }

    fn capture_id(&self, stream: &CuStream) -> Result<Option<u64>> {
        const OP: &str = "Stream::capture_id";
        self.bind(OP)?;
        capture::active_id(&stream.raw).map_err(|e| err::at(OP, CaptureSite::Stream(stream.id), e))
    }

    fn load_kernel(&self, kernel: &'static crate::device::Kernel) -> Result<()> {
        const OP: &str = "Device::load_kernel";
        self.bind(OP)?;
        // A refusal is reported on the capture that forbids the load, as for allocations.
        let on = capture::forbidding_site().unwrap_or(CaptureSite::Stream(StreamId(0)));
        self.kernels.load(kernel, on)
    }

    fn gemm_workspace_bytes(&self) -> usize {
        // cuBLASLt's recommendation for Hopper.
        32 << 20
    }

    fn sdpa_plan(&self, spec: &crate::device::sdpa::SdpaSpec) -> Result<crate::device::sdpa::SdpaPlan> {
        self.bind("attention (cuDNN)")?;
        // Planning may allocate (cuDNN's handle, its engines' setup): let a capture on this
        // thread through, as the allocator's growth does.
        capture::relaxed(|| self.cudnn.plan(spec))
    }

    fn enqueue(&self, stream: &CuStream, op: &Op<'_>) -> Result<()> {
        let name = op.name();
        self.bind(name)?;
        let capture = capture::active_id(&stream.raw).map_err(|e| err::at(name, CaptureSite::Stream(stream.id), e))?;
        match *op {
            Op::Kernel { kernel, dims, args } => self.kernels.launch(stream, kernel, &dims, args)?,
            Op::Gemm { kernel, args, spec, alpha, beta } => self
                .blas
                .gemm(stream, &spec, kernel.params, args, (alpha, beta), self.gemm_workspace_bytes())
                .map_err(|e| match e {
                    // Which GEMM: a layer runs a dozen.
                    crate::Error::Cuda { op, message } => crate::Error::Cuda {
                        op,
                        message: format!(
                            "{message} ({} of {}×{}×{}, beta {beta})",
                            kernel.name, spec.m, spec.n, spec.k
                        ),
                    },
                    e => e,
                })?,
            Op::Sdpa { kernel, args, spec } => self.cudnn.execute(stream, &spec, kernel.params, args)?,
            Op::Copy { dir, src, src_offset, dst, dst_offset, bytes } => {
                memory::copy(name, stream, dir, (&src.raw, src_offset), (&dst.raw, dst_offset), bytes)?
            }
            Op::Memset { dst, offset, bytes, value } => memory::memset(name, stream, (&dst.raw, offset), bytes, value)?,
            Op::Collective { .. } => nccl::enqueue(stream, op)?,
        }
        if let Some(id) = capture {
            let node = self.patch_node(stream, op)?;
            capture::hold_op(id, op, node);
        }
        Ok(())
    }

    fn record(&self, stream: &CuStream, event: &CuEvent, external: bool) -> Result<()> {
        self.bind("record")?;
        stream::record(stream, event, external)
    }

    fn wait(&self, stream: &CuStream, event: &CuEvent, external: bool) -> Result<()> {
        self.bind("wait")?;
        stream::wait(stream, event, external)
    }

    fn stream_synchronize(&self, stream: &CuStream) -> Result<()> {
        stream::synchronize("Stream::synchronize", stream)
    }

    fn stream_query(&self, stream: &CuStream) -> Result<bool> {
        self.bind("Stream::query")?;
        stream::query(stream)
    }

    fn event_query(&self, event: &CuEvent) -> Result<bool> {
        stream::event_query(event)
    }

    fn event_synchronize(&self, event: &CuEvent) -> Result<()> {
        stream::event_synchronize(event)
    }

    fn synchronize(&self) -> Result<()> {
        const OP: &str = "Device::synchronize";
        self.ctx.synchronize().map_err(|e| err::driver(OP, capture::forbidding_site(), e))?;
        capture::flush_deferred();
        Ok(())
    }

    fn read_blocking(&self, stream: &CuStream, mem: &CuMem, offset: usize, out: &mut [u8]) -> Result<()> {
        self.bind("to_vec")?;
        memory::read_blocking(stream, mem, offset, out)
    }

    fn write_blocking(&self, stream: &CuStream, mem: &CuMem, offset: usize, data: &[u8]) -> Result<()> {
        self.bind("write_from")?;
        memory::write_blocking(stream, mem, offset, data)
    }

    fn read_pinned(mem: &CuMem, offset: usize, out: &mut [u8]) -> Result<()> {
        mem.read_pinned(offset, out)
    }

    fn write_pinned(mem: &CuMem, offset: usize, data: &[u8]) -> Result<()> {
        mem.write_pinned(offset, data)
    }

    fn begin_capture(&self, stream: &CuStream, mode: CaptureMode) -> Result<()> {
        capture::begin(stream, mode)
    }

    fn end_capture(&self, stream: &CuStream) -> Result<CuGraph> {
        self.bind("end_capture")?;
        let (graph, held) = capture::end(stream)?;
        Ok(CuGraph::new(graph, held))
    }

    fn capture_status(&self, stream: &CuStream) -> Result<CaptureStatus> {
        capture::status(stream)
    }

    fn graph_nodes(&self, graph: &CuGraph) -> Result<Vec<NodeInfo>> {
        graph.nodes(&self.kernels)
    }

    fn graph_dot(&self, graph: &CuGraph) -> Result<String> {
        graph.dot()
    }

    fn graph_sites(&self, graph: &CuGraph) -> Arc<[crate::device::patch::Site]> {
        graph.sites()
    }

    fn instantiate(&self, graph: &CuGraph) -> Result<CuExec> {
        self.bind("Graph::instantiate")?;
        graph.instantiate()
    }

    fn rebind(
        &self,
        exec: &CuExec,
        sites: &[crate::device::patch::Site],
        changes: &[crate::device::patch::SiteChange],
    ) -> Result<()> {
        self.bind("GraphExec::rebind")?;
        exec.rebind(sites, changes)
    }

    fn set_enabled(&self, exec: &CuExec, sites: &[usize], enabled: bool) -> Result<()> {
        self.bind("GraphExec::set_enabled")?;
        exec.set_enabled(sites, enabled)
    }

    fn upload(&self, exec: &CuExec, stream: &CuStream) -> Result<()> {
        const OP: &str = "GraphExec::upload";
        self.bind(OP)?;
        exec.upload(&stream.raw).map_err(|e| err::at(OP, CaptureSite::Stream(stream.id), e))
    }

    fn launch(&self, exec: &CuExec, stream: &CuStream) -> Result<()> {
        const OP: &str = "GraphExec::launch";
        self.bind(OP)?;
        if let Some(rank) = exec.aborted_comm() {
            let why = "the graph holds a collective of an aborted communicator; make a new group and capture again";
            return Err(crate::device::comm::comm_error(OP, rank, crate::device::CommErrorKind::Nccl(why.into())));
        }
        // Into a capturing stream CUDA 13.0 refuses it (Unsupported), so no capture ever needs
        // to hold what the graph holds.
        exec.launch(&stream.raw).map_err(|e| err::at(OP, CaptureSite::Stream(stream.id), e))
    }
}
