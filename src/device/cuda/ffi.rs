//! The raw driver and NVRTC calls that cudarc's safe layer does not offer, each wrapped once.
//!
//! Handles come in as the owners that keep them alive (cudarc's `CudaStream`, `CudaEvent` and
//! `CudaFunction`, and [`OwnedGraph`], [`OwnedExec`] and [`Program`] here), so most wrappers are
//! safe functions. Wrappers that take raw device or host addresses, or a kernel's parameter list,
//! are `unsafe` and say what the caller guarantees. Enums that a newer driver may extend (node
//! types, capture status) are read as `u32`: an unknown value stored into a Rust enum would be
//! undefined behaviour.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError};
use cudarc::nvrtc::result::{self as nvrtc_result, NvrtcError};
use cudarc::nvrtc::sys as nvrtc_sys;

use super::error as err;
use crate::device::{ErrorSlot, LaunchDims};

// ---- streams and events -----------------------------------------------------------------------

/// `CUstreamCaptureStatus` values, as `u32`.
pub(super) const CAPTURE_NONE: u32 = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as u32;
pub(super) const CAPTURE_ACTIVE: u32 = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE as u32;
pub(super) const CAPTURE_INVALIDATED: u32 = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED as u32;

/// A stream's capture state: `status` is a `CAPTURE_*` value (or a newer driver's), and `id` the
/// capture's process-unique id when `status` is not [`CAPTURE_NONE`].
#[derive(Clone, Copy, Debug)]
pub(super) struct CaptureInfo {
    pub(super) status: u32,
    pub(super) id: u64,
}

/// `cuStreamGetCaptureInfo_v3` (the only form bound for CUDA 13.0), without the graph outputs.
pub(super) fn capture_info(stream: &CudaStream) -> Result<CaptureInfo, DriverError> {
    query_capture(stream, None)
}

/// The nodes a capturing stream's next work would depend on (`cuStreamGetCaptureInfo_v3`'s
/// dependencies): right after an enqueue, the nodes it added at the stream's end.
pub(super) fn capture_frontier(stream: &CudaStream) -> Result<Vec<RawNode>, DriverError> {
    let mut frontier = Vec::new();
    let info = query_capture(stream, Some(&mut frontier))?;
    Ok(if info.status == CAPTURE_ACTIVE { frontier } else { Vec::new() })
}

/// `cuStreamGetCaptureInfo_v3`, with the dependencies copied into `frontier` when asked for.
fn query_capture(stream: &CudaStream, frontier: Option<&mut Vec<RawNode>>) -> Result<CaptureInfo, DriverError> {
    let mut status: u32 = CAPTURE_NONE;
    let mut id: u64 = 0;
    let mut deps: *const sys::CUgraphNode = ptr::null();
    let mut count: usize = 0;
    let (deps_out, count_out) = match frontier {
        Some(_) => (&mut deps as *mut *const sys::CUgraphNode, &mut count as *mut usize),
        None => (ptr::null_mut(), ptr::null_mut()),
    };
    // SAFETY: the stream is alive while borrowed; the status is a 4-byte C enum written into a
    // `u32`. The graph and edge-data outputs are optional and passed as null, and so are the
    // dependency outputs unless asked for; then the driver points `deps` at an array it owns,
    // valid until the next call on the stream, copied out below before any.
    unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream.cu_stream(),
            (&mut status as *mut u32).cast::<sys::CUstreamCaptureStatus>(),
            &mut id,
            ptr::null_mut(),
            deps_out,
            ptr::null_mut(),
            count_out,
        )
    }
    .result()?;
    if let Some(out) = frontier {
        if !deps.is_null() && count > 0 {
            // SAFETY: the driver's array holds `count` nodes (see above).
            out.extend(unsafe { std::slice::from_raw_parts(deps, count) }.iter().map(|n| RawNode(*n)));
        }
    }
    Ok(CaptureInfo { status, id })
}

/// `cuStreamQuery`: `Ok(false)` while work is pending (`CUDA_ERROR_NOT_READY`).
pub(super) fn stream_query(stream: &CudaStream) -> Result<bool, DriverError> {
    // SAFETY: the stream is alive while borrowed.
    match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => Err(DriverError(code)),
    }
}

/// `cuEventRecordWithFlags(CU_EVENT_RECORD_EXTERNAL)`: inside a capture, an event-record node.
pub(super) fn record_external(event: &CudaEvent, stream: &CudaStream) -> Result<(), DriverError> {
    let flags = sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as c_uint;
    // SAFETY: the event and the stream are alive while borrowed.
    unsafe { sys::cuEventRecordWithFlags(event.cu_event(), stream.cu_stream(), flags) }.result()
}

/// `cuStreamWaitEvent`, with `CU_EVENT_WAIT_EXTERNAL` (an event-wait node inside a capture) or
/// the default flag (a capture edge).
pub(super) fn wait(stream: &CudaStream, event: &CudaEvent, external: bool) -> Result<(), DriverError> {
    let flags = if external {
        sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL
    } else {
        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT
    };
    // SAFETY: the stream and the event are alive while borrowed.
    unsafe { result::stream::wait_event(stream.cu_stream(), event.cu_event(), flags) }
}

/// `cuEventElapsedTime_v2`, without synchronizing first: `CUDA_ERROR_NOT_READY` if a record has
/// not completed, as in CUDA.
pub(super) fn elapsed_ms(start: &CudaEvent, end: &CudaEvent) -> Result<f32, DriverError> {
    // SAFETY: both events are alive while borrowed.
    unsafe { result::event::elapsed(start.cu_event(), end.cu_event()) }
}

/// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
/// Swaps this thread's capture-interaction mode (`cuThreadExchangeStreamCaptureMode`) and
/// returns the previous one.
pub(super) fn exchange_capture_mode(mode: sys::CUstreamCaptureMode) -> Result<sys::CUstreamCaptureMode, DriverError> {
    let mut mode = mode;
    // SAFETY: the driver reads and overwrites the one mode value passed by pointer.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result()?;
    Ok(mode)
}

pub(super) fn driver_version() -> Result<i32, DriverError> {
    let mut version: c_int = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    Ok(version)
}

// ---- memory -----------------------------------------------------------------------------------

/// `cuMemAlloc`, synchronous (never `cuMemAllocAsync`: graphed keeps memory nodes out of graphs).
/// Needs the device's context bound and `bytes > 0`.
pub(super) fn mem_alloc(bytes: usize) -> Result<sys::CUdeviceptr, DriverError> {
    // SAFETY: returns fresh memory that is only ever used as bytes.
    unsafe { result::malloc_sync(bytes) }
}

/// `cuMemGetInfo`: the device's (free, total) bytes. Needs the context bound.
pub(super) fn mem_get_info() -> Result<(usize, usize), DriverError> {
    result::mem_get_info()
}

/// `cuMemHostAlloc` with flags 0 (page-locked, not write-combined). Needs the context bound.
pub(super) fn mem_alloc_host(bytes: usize) -> Result<NonNull<u8>, DriverError> {
    // SAFETY: returns fresh host memory that is only ever used as bytes.
    let ptr = unsafe { result::malloc_host(bytes, 0) }?;
    NonNull::new(ptr.cast::<u8>()).ok_or(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))
}

/// `cuMemFree`.
///
/// # Safety
/// `ptr` came from [`mem_alloc`], is freed once, and no queued work or graph still uses it.
pub(super) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<(), DriverError> {
    result::free_sync(ptr)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` came from [`mem_alloc_host`], is freed once, and nothing still uses it.
pub(super) unsafe fn mem_free_host(ptr: NonNull<u8>) -> Result<(), DriverError> {
    result::free_host(ptr.as_ptr().cast())
}

// ---- expandable memory (virtual memory management) ---------------------------------------------

/// The properties of plain device memory on GPU `ordinal`, for `cuMemCreate` and its granularity.
fn device_prop(ordinal: c_int) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`, then the minimum granularity
/// (`cuMemGetAllocationGranularity`) of device memory: `None` without virtual memory management.
pub(super) fn vm_granularity(ctx: &CudaContext) -> Result<Option<usize>, DriverError> {
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
    if ctx.attribute(attr)? == 0 {
        return Ok(None);
    }
    let prop = device_prop(ctx.ordinal() as c_int);
    let mut granularity = 0usize;
    let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: both pointers are to live locals of the declared types.
    unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, minimum) }.result()?;
    Ok(Some(granularity))
}

/// `cuMemAddressReserve`: `bytes` of address range (a multiple of the granularity), nothing
/// mapped. Needs the context bound.
pub(super) fn mem_address_reserve(bytes: usize) -> Result<sys::CUdeviceptr, DriverError> {
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: `base` is a live local; no hint address, default alignment, no flags.
    unsafe { sys::cuMemAddressReserve(&mut base, bytes, 0, 0, 0) }.result()?;
    Ok(base)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `base` and `bytes` are those of one [`mem_address_reserve`], freed once, with nothing mapped
/// in it any more.
pub(super) unsafe fn mem_address_free(base: sys::CUdeviceptr, bytes: usize) -> Result<(), DriverError> {
    sys::cuMemAddressFree(base, bytes).result()
}

/// `cuMemCreate` of `bytes` (a multiple of the granularity) of device memory on GPU `ordinal`,
/// then `cuMemMap` of it at `at`, then `cuMemRelease` of the handle: the memory lives while it
/// is mapped, and [`mem_unmap`] gives it back. Needs the context bound.
///
/// # Safety
/// `[at, at + bytes)` lies in a reserved range and nothing is mapped there.
pub(super) unsafe fn mem_create_mapped(at: sys::CUdeviceptr, bytes: usize, ordinal: usize) -> Result<(), DriverError> {
    let prop = device_prop(ordinal as c_int);
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    sys::cuMemCreate(&mut handle, bytes, &prop, 0).result()?;
    let mapped = sys::cuMemMap(at, bytes, 0, handle, 0).result();
    // Released whether or not it was mapped: mapped, the mapping keeps the memory alive;
    // otherwise this frees it.
    let released = sys::cuMemRelease(handle).result();
    if let (Ok(()), Err(e)) = (mapped, released) {
        // All or nothing, so that the caller knows what is mapped.
        let _ = sys::cuMemUnmap(at, bytes);
        return Err(e);
    }
    mapped
}

/// `cuMemSetAccess`: read-write access for GPU `ordinal` to `[at, at + bytes)`, which a fresh
/// mapping lacks.
///
/// # Safety
/// `[at, at + bytes)` is entirely mapped.
pub(super) unsafe fn mem_set_access(at: sys::CUdeviceptr, bytes: usize, ordinal: usize) -> Result<(), DriverError> {
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as c_int,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    sys::cuMemSetAccess(at, bytes, &desc, 1).result()
}

/// `cuMemUnmap` of one whole mapping made by [`mem_create_mapped`], which frees its memory.
///
/// # Safety
/// `at` and `bytes` are those of one earlier mapping, and no queued work or graph that can still
/// run uses it: unlike `cuMemFree`, unmapping does not wait for the device.
pub(super) unsafe fn mem_unmap(at: sys::CUdeviceptr, bytes: usize) -> Result<(), DriverError> {
    sys::cuMemUnmap(at, bytes).result()
}

/// `cuMemcpyHtoDAsync_v2`.
///
/// # Safety
/// `dst` and `src` address `bytes` bytes of live device and pinned host memory that stay alive
/// until the copy has run (inside a capture: as long as the graph can run).
pub(super) unsafe fn copy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream.cu_stream()).result()
}

/// `cuMemcpyDtoHAsync_v2`.
///
/// # Safety
/// As [`copy_htod_async`], and the host holds no reference into `dst` while the copy may run.
pub(super) unsafe fn copy_dtoh_async(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream.cu_stream()).result()
}

/// `cuMemcpyDtoDAsync_v2`.
///
/// # Safety
/// As [`copy_htod_async`], with both addresses in device memory.
pub(super) unsafe fn copy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream())
}

/// `cuMemsetD8Async`.
///
/// # Safety
/// `dst` addresses `bytes` bytes of device memory that stay alive as in [`copy_htod_async`].
pub(super) unsafe fn memset_async(
    dst: sys::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    result::memset_d8_async(dst, value, bytes, stream.cu_stream())
}

/// `cuMemcpyDtoH_v2`, synchronous: forbidden by global and thread-local captures, as in CUDA.
///
/// # Safety
/// `src` addresses `dst.len()` bytes of live device memory.
pub(super) unsafe fn copy_dtoh(dst: &mut [u8], src: sys::CUdeviceptr) -> Result<(), DriverError> {
    result::memcpy_dtoh_sync(dst, src)
}

// ---- kernels ----------------------------------------------------------------------------------

/// A loaded kernel's `CUfunction`, valid while its module stays loaded.
#[derive(Clone, Copy, Debug)]
pub(super) struct Function(sys::CUfunction);

// SAFETY: a CUfunction is an immutable driver handle; the driver allows its use from any thread.
unsafe impl Send for Function {}
// SAFETY: as for Send; no method mutates through it.
unsafe impl Sync for Function {}

impl Function {
    pub(super) fn of(f: &CudaFunction) -> Function {
        Function(f.cu_function())
    }

    /// The handle's address, to look the function up by (also from a graph's kernel nodes).
    pub(super) fn key(self) -> usize {
        self.0 as usize
    }

    /// Blocks of `threads` threads with `shared` bytes of dynamic shared memory that one SM
    /// holds at once (`cuOccupancyMaxActiveBlocksPerMultiprocessor`).
    ///
    /// # Safety
    /// The function's module is loaded.
    pub(super) unsafe fn resident_blocks(self, threads: u32, shared: u32) -> Result<u32, DriverError> {
        let threads = c_int::try_from(threads).unwrap_or(c_int::MAX);
        // SAFETY: the caller guarantees the handle is live.
        let blocks =
            unsafe { result::occupancy::max_active_block_per_multiprocessor(self.0, threads, shared as usize) }?;
        Ok(u32::try_from(blocks).unwrap_or(0))
    }

    /// Allows launches with up to `bytes` of dynamic shared memory
    /// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`; beyond 48 KiB a kernel must opt in).
    ///
    /// # Safety
    /// The function's module is loaded.
    pub(super) unsafe fn allow_dynamic_shared(self, bytes: u32) -> Result<(), DriverError> {
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: the caller guarantees the handle is live.
        unsafe { result::function::set_function_attribute(self.0, attr, bytes as i32) }
    }
}

/// `cuLaunchKernel`.
///
/// # Safety
/// `func`'s module is loaded; `params` has one pointer per kernel parameter, each to a value of
/// that parameter's type and size, and every device address among them stays alive as in
/// [`copy_htod_async`].
pub(super) unsafe fn launch(
    func: Function,
    dims: &LaunchDims,
    stream: &CudaStream,
    params: &mut [*mut c_void],
) -> Result<(), DriverError> {
    result::launch_kernel(func.0, dims.grid, dims.block, dims.shared_mem_bytes, stream.cu_stream(), params)
}

// ---- graphs -----------------------------------------------------------------------------------

/// A `CUgraph`, destroyed on drop. Not `Sync`: the driver requires calls on one graph to be
/// serialized, so shared use goes through a lock.
pub(super) struct OwnedGraph {
    raw: sys::CUgraph,
    /// Keeps the context alive until the graph is destroyed.
    ctx: Arc<CudaContext>,
    errors: Arc<ErrorSlot>,
}

// SAFETY: a CUgraph may be used from any thread as long as calls on it are serialized; without
// `Sync`, an `OwnedGraph` is used by one thread at a time.
unsafe impl Send for OwnedGraph {}

impl Drop for OwnedGraph {
    fn drop(&mut self) {
        // SAFETY: the graph is owned and destroyed once; nodes borrowed from it are gone.
        if let Err(e) = unsafe { result::graph::destroy(self.raw) } {
            self.errors.record("a captured graph", err::driver("cuGraphDestroy", None, e));
        }
    }
}

/// `cuStreamEndCapture`: the captured graph, whose destruction reports to `errors`. Needs the
/// context bound.
pub(super) fn end_capture(
    stream: &CudaStream,
    ctx: &Arc<CudaContext>,
    errors: &Arc<ErrorSlot>,
) -> Result<OwnedGraph, DriverError> {
    // SAFETY: the stream is alive while borrowed; the graph returned is owned by the caller.
    let raw = unsafe { result::stream::end_capture(stream.cu_stream()) }?;
    if raw.is_null() {
        // The driver returns no graph only for an invalidated capture, with that code.
        return Err(DriverError(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    }
    Ok(OwnedGraph { raw, ctx: ctx.clone(), errors: errors.clone() })
}

/// A memcpy node's parameters as captured (`cuGraphMemcpyNodeGetParams`), read once and kept:
/// each rebind of the node changes only its addresses.
#[derive(Clone, Copy)]
pub(super) struct MemcpyParams(sys::CUDA_MEMCPY3D);

// SAFETY: plain data; its pointers are addresses the driver reads at a later update, never
// dereferenced here, and the memory they name is held by the executable that keeps them.
unsafe impl Send for MemcpyParams {}
// SAFETY: as for `Send`; shared only to be copied.
unsafe impl Sync for MemcpyParams {}

impl MemcpyParams {
    /// The parameters of memcpy node `node`.
    ///
    /// # Safety
    /// `node` is a memcpy node of a live graph.
    pub(super) unsafe fn of(node: RawNode) -> Result<MemcpyParams, DriverError> {
        let mut p = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::zeroed();
        // SAFETY: the caller's guarantees; the driver fills the struct.
        unsafe { sys::cuGraphMemcpyNodeGetParams(node.0, p.as_mut_ptr()) }.result()?;
        // SAFETY: filled by the driver above (and all-zero is a valid value of the plain struct).
        Ok(MemcpyParams(unsafe { p.assume_init() }))
    }
}

/// A node's handle as a capture reported it: valid while the graph that capture ended in lives
/// (whoever keeps it keeps that graph too).
#[derive(Clone, Copy, Debug)]
pub(super) struct RawNode(sys::CUgraphNode);

// SAFETY: a node handle is an opaque driver value; calls that take it are serialized by the lock
// of its graph's or executable's owner.
unsafe impl Send for RawNode {}
// SAFETY: as for Send; nothing mutates through the handle itself.
unsafe impl Sync for RawNode {}

/// A node of an [`OwnedGraph`], valid while the graph is borrowed.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) struct Node<'g> {
    raw: sys::CUgraphNode,
    graph: PhantomData<&'g OwnedGraph>,
}

/// A kernel node's function: its handle's address (see [`Function::key`]) and the driver's name
/// for it.
pub(super) struct NodeFunction {
    pub(super) key: usize,
    pub(super) name: Option<String>,
}

impl OwnedGraph {
    fn node(&self, raw: sys::CUgraphNode) -> Node<'_> {
        Node { raw, graph: PhantomData }
    }

    /// `cuGraphGetNodes`.
    pub(super) fn nodes(&self) -> Result<Vec<Node<'_>>, DriverError> {
        let mut count: usize = 0;
        // SAFETY: with a null array the driver only writes the count.
        unsafe { sys::cuGraphGetNodes(self.raw, ptr::null_mut(), &mut count) }.result()?;
        if count == 0 {
            return Ok(Vec::new());
        }
        let mut raw = vec![ptr::null_mut(); count];
        // SAFETY: `raw` has room for `count` nodes; the driver writes at most that many and
        // updates `count`.
        unsafe { sys::cuGraphGetNodes(self.raw, raw.as_mut_ptr(), &mut count) }.result()?;
        raw.truncate(count);
        Ok(raw.into_iter().map(|n| self.node(n)).collect())
    }

    /// `cuGraphGetEdges_v2`: every `(from, to)` dependency edge.
    pub(super) fn edges(&self) -> Result<Vec<(Node<'_>, Node<'_>)>, DriverError> {
        let mut count: usize = 0;
        // SAFETY: with null arrays the driver only writes the count.
        unsafe { sys::cuGraphGetEdges_v2(self.raw, ptr::null_mut(), ptr::null_mut(), ptr::null_mut(), &mut count) }
            .result()?;
        if count == 0 {
            // The driver refuses the second call with no room (CUDA_ERROR_INVALID_VALUE).
            return Ok(Vec::new());
        }
        let mut from = vec![ptr::null_mut(); count];
        let mut to = vec![ptr::null_mut(); count];
        // Edge data is asked for too: without it the driver refuses (CUDA_ERROR_LOSSY_QUERY)
        // graphs whose edges carry non-default data.
        let blank = sys::CUgraphEdgeData { from_port: 0, to_port: 0, type_: 0, reserved: [0; 5] };
        let mut data = vec![blank; count];
        // SAFETY: each array has room for `count` entries; the driver writes at most that many
        // and updates `count`.
        unsafe { sys::cuGraphGetEdges_v2(self.raw, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut count) }
            .result()?;
        Ok(from.into_iter().zip(to).take(count).map(|(f, t)| (self.node(f), self.node(t))).collect())
    }

    /// `cuGraphDebugDotPrint` with the verbose flag, into the file at `path`.
    pub(super) fn debug_dot(&self, path: &CStr) -> Result<(), DriverError> {
        let flags = sys::CUgraphDebugDot_flags::CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE as c_uint;
        // SAFETY: the graph is alive and `path` is a NUL-terminated string.
        unsafe { sys::cuGraphDebugDotPrint(self.raw, path.as_ptr(), flags) }.result()
    }

    /// `cuGraphInstantiateWithFlags(graph, 0)`. Needs the context bound.
    pub(super) fn instantiate(&self) -> Result<OwnedExec, DriverError> {
        // SAFETY: the graph is alive; the executable returned is owned by the caller.
        let raw = unsafe { result::graph::instantiate(self.raw, sys::CUgraphInstantiate_flags(0)) }?;
        Ok(OwnedExec { raw, ctx: self.ctx.clone(), errors: self.errors.clone() })
    }
}

impl Node<'_> {
    /// `cuGraphNodeGetType`, as the C enum's number.
    pub(super) fn kind(self) -> Result<u32, DriverError> {
        let mut kind: u32 = u32::MAX;
        // SAFETY: the node is alive while its graph is borrowed; the type is a 4-byte C enum
        // written into a `u32`.
        unsafe { sys::cuGraphNodeGetType(self.raw, (&mut kind as *mut u32).cast::<sys::CUgraphNodeType>()) }
            .result()?;
        Ok(kind)
    }

    /// The function of a kernel node (`cuGraphKernelNodeGetParams_v2`); `None` if the node names
    /// a library kernel (`CUkernel`) instead of a function.
    pub(super) fn kernel_function(self) -> Result<Option<NodeFunction>, DriverError> {
        let mut params = sys::CUDA_KERNEL_NODE_PARAMS {
            func: ptr::null_mut(),
            gridDimX: 0,
            gridDimY: 0,
            gridDimZ: 0,
            blockDimX: 0,
            blockDimY: 0,
            blockDimZ: 0,
            sharedMemBytes: 0,
            kernelParams: ptr::null_mut(),
            extra: ptr::null_mut(),
            kern: ptr::null_mut(),
            ctx: ptr::null_mut(),
        };
        // SAFETY: the node is a kernel node of a borrowed graph; the driver fills `params`, whose
        // pointers refer to driver-owned storage and are not dereferenced here.
        unsafe { sys::cuGraphKernelNodeGetParams_v2(self.raw, &mut params) }.result()?;
        if params.func.is_null() {
            return Ok(None);
        }
        let mut name: *const c_char = ptr::null();
        // SAFETY: the function is alive while the graph is; the driver returns a pointer to a
        // NUL-terminated name it owns, copied out at once.
        let named = unsafe { sys::cuFuncGetName(&mut name, params.func) }.result();
        let name = match named {
            // SAFETY: as above; checked non-null.
            Ok(()) if !name.is_null() => Some(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()),
            _ => None,
        };
        Ok(Some(NodeFunction { key: params.func as usize, name }))
    }

    /// The event of an event-record node (`cuGraphEventRecordNodeGetEvent`).
    pub(super) fn recorded_event(self) -> Result<sys::CUevent, DriverError> {
        let mut event: sys::CUevent = ptr::null_mut();
        // SAFETY: the node is an event-record node of a borrowed graph; writes one handle.
        unsafe { sys::cuGraphEventRecordNodeGetEvent(self.raw, &mut event) }.result()?;
        Ok(event)
    }

    /// The event of an event-wait node (`cuGraphEventWaitNodeGetEvent`).
    pub(super) fn waited_event(self) -> Result<sys::CUevent, DriverError> {
        let mut event: sys::CUevent = ptr::null_mut();
        // SAFETY: the node is an event-wait node of a borrowed graph; writes one handle.
        unsafe { sys::cuGraphEventWaitNodeGetEvent(self.raw, &mut event) }.result()?;
        Ok(event)
    }
}

/// A `CUgraphExec`, destroyed on drop; like [`OwnedGraph`], used by one thread at a time.
pub(super) struct OwnedExec {
    raw: sys::CUgraphExec,
    /// Keeps the context alive until the executable is destroyed; copies are patched in it.
    ctx: Arc<CudaContext>,
    errors: Arc<ErrorSlot>,
}

// SAFETY: as for `OwnedGraph`.
unsafe impl Send for OwnedExec {}

impl Drop for OwnedExec {
    fn drop(&mut self) {
        // SAFETY: the executable is owned and destroyed once; launches already queued complete.
        if let Err(e) = unsafe { result::graph::exec_destroy(self.raw) } {
            self.errors.record("a graph executable", err::driver("cuGraphExecDestroy", None, e));
        }
    }
}

impl OwnedExec {
    /// `cuGraphLaunch` on any stream of the device.
    pub(super) fn launch(&self, stream: &CudaStream) -> Result<(), DriverError> {
        // SAFETY: the executable and the stream are alive while borrowed.
        unsafe { result::graph::launch(self.raw, stream.cu_stream()) }
    }

    /// `cuGraphExecKernelNodeSetParams_v2`: kernel node `node` of the executable's graph runs
    /// `func` with `dims` and the parameters in `values` (one 8-byte slot each, as launched) at
    /// later launches. `params` is scratch for the pointers to them, reused across calls so
    /// that a rebind of many nodes allocates nothing per node.
    ///
    /// # Safety
    /// `node` is a kernel node of the graph this executable was instantiated from, that graph is
    /// alive, `func`'s module is loaded, `values` matches the function's signature as for
    /// [`launch`], and every device address among them stays alive while a launch can read it.
    pub(super) unsafe fn set_kernel_params(
        &self,
        node: RawNode,
        func: Function,
        dims: &LaunchDims,
        values: &mut [u64],
        params: &mut Vec<*mut c_void>,
    ) -> Result<(), DriverError> {
        params.clear();
        params.extend(values.iter_mut().map(|v| ptr::from_mut(v).cast::<c_void>()));
        let p = sys::CUDA_KERNEL_NODE_PARAMS {
            func: func.0,
            gridDimX: dims.grid.0,
            gridDimY: dims.grid.1,
            gridDimZ: dims.grid.2,
            blockDimX: dims.block.0,
            blockDimY: dims.block.1,
            blockDimZ: dims.block.2,
            sharedMemBytes: dims.shared_mem_bytes,
            kernelParams: params.as_mut_ptr(),
            extra: ptr::null_mut(),
            kern: ptr::null_mut(),
            ctx: ptr::null_mut(),
        };
        // SAFETY: the caller's guarantees; the driver copies the parameter values during the call.
        unsafe { sys::cuGraphExecKernelNodeSetParams_v2(self.raw, node.0, &p) }.result()
    }

    /// Points memcpy node `node` of the executable's graph at device address `src` as its source
    /// and `dst` as its destination (where given) for later launches
    /// (`cuGraphExecMemcpyNodeSetParams` with only those addresses of `captured` changed, so the
    /// memory types the driver recorded stay: it refuses a change of type, such as a host
    /// destination made a device one).
    ///
    /// # Safety
    /// `node` is a memcpy node of the graph this executable was instantiated from, whose source
    /// (and destination, where `dst` is given) is device memory, that graph is alive,
    /// `captured` is that node's [`MemcpyParams::of`], and `src` and `dst` address as many
    /// bytes of live device memory as the node copies, alive while a launch can use them.
    pub(super) unsafe fn set_memcpy(
        &self,
        node: RawNode,
        captured: &MemcpyParams,
        src: sys::CUdeviceptr,
        dst: Option<sys::CUdeviceptr>,
    ) -> Result<(), DriverError> {
        let mut p = captured.0;
        p.srcDevice = src;
        if let Some(dst) = dst {
            p.dstDevice = dst;
        }
        // SAFETY: the caller's guarantees; the context is the executable's own.
        unsafe { sys::cuGraphExecMemcpyNodeSetParams(self.raw, node.0, &p, self.ctx.cu_ctx()) }.result()
    }

    /// `cuGraphNodeSetEnabled`: node `node` runs (or does nothing, its edges kept) at later
    /// launches.
    ///
    /// # Safety
    /// `node` is a kernel, memcpy or memset node of the graph this executable was instantiated
    /// from, and that graph is alive.
    pub(super) unsafe fn set_enabled(&self, node: RawNode, enabled: bool) -> Result<(), DriverError> {
        // SAFETY: the caller's guarantees.
        unsafe { sys::cuGraphNodeSetEnabled(self.raw, node.0, u32::from(enabled)) }.result()
    }

    /// `cuGraphUpload` on any stream of the device.
    pub(super) fn upload(&self, stream: &CudaStream) -> Result<(), DriverError> {
        // SAFETY: the executable and the stream are alive while borrowed.
        unsafe { result::graph::upload(self.raw, stream.cu_stream()) }
    }
}

// ---- NVRTC ------------------------------------------------------------------------------------

/// `nvrtcVersion`.
pub(super) fn nvrtc_version() -> Result<(i32, i32), NvrtcError> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }.result()?;
    Ok((major, minor))
}

/// An NVRTC program, destroyed on drop. It keeps its source and name alive because NVRTC may
/// refer to them until then.
pub(super) struct Program {
    raw: nvrtc_sys::nvrtcProgram,
    _source: CString,
    _name: CString,
}

impl Program {
    /// `nvrtcCreateProgram`, with no headers.
    pub(super) fn new(source: CString, name: CString) -> Result<Program, NvrtcError> {
        let raw = nvrtc_result::create_program(&source, Some(&name))?;
        Ok(Program { raw, _source: source, _name: name })
    }

    /// `nvrtcCompileProgram`.
    pub(super) fn compile(&self, options: &[CString]) -> Result<(), NvrtcError> {
        let ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let count =
            c_int::try_from(ptrs.len()).map_err(|_| NvrtcError(nvrtc_sys::nvrtcResult::NVRTC_ERROR_INVALID_INPUT))?;
        // SAFETY: the program is alive; `ptrs` holds `count` NUL-terminated strings that outlive
        // the call.
        unsafe { nvrtc_sys::nvrtcCompileProgram(self.raw, count, ptrs.as_ptr()) }.result()
    }

    /// `nvrtcGetProgramLog`, as text.
    pub(super) fn log(&self) -> Result<String, NvrtcError> {
        // SAFETY: the program is alive.
        let log = unsafe { nvrtc_result::get_program_log(self.raw) }?;
        let bytes: Vec<u8> = log.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// `nvrtcDestroyProgram`, with its error; dropping a program instead discards the error.
    pub(super) fn destroy(mut self) -> Result<(), NvrtcError> {
        // SAFETY: the program is owned and destroyed once: the null handle tells `drop`.
        let destroyed = unsafe { nvrtc_result::destroy_program(self.raw) };
        self.raw = ptr::null_mut();
        destroyed
    }

    /// `nvrtcGetCUBIN` of a program compiled for a real architecture (`sm_XY`).
    pub(super) fn cubin(&self) -> Result<Vec<u8>, NvrtcError> {
        let mut size: usize = 0;
        // SAFETY: the program is alive; writes one size.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(self.raw, &mut size) }.result()?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has the `size` bytes the driver writes.
        unsafe { nvrtc_sys::nvrtcGetCUBIN(self.raw, cubin.as_mut_ptr().cast::<c_char>()) }.result()?;
        Ok(cubin)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // A program is dropped undestroyed only on the way out of a failed compile, whose error
        // is the one its caller gets; a second, from destroying, would add nothing.
        if !self.raw.is_null() {
            // SAFETY: the program is owned and not yet destroyed.
            let _ = unsafe { nvrtc_result::destroy_program(self.raw) };
        }
    }
}
