//! Device and pinned allocations, and the copies and memsets that use them.
//!
//! Allocation is synchronous (`cuMemAlloc`, `cuMemHostAlloc`), never stream-ordered, so captured
//! graphs never contain memory nodes. A zero-byte buffer gets a one-byte allocation: every buffer
//! then has a valid address for copies and kernel arguments, and allocating under a capture is
//! refused the same way whatever the size.
//!
//! Expandable memory (virtual memory management) is an address range reserved once, whose
//! prefix is mapped and unmapped in chunks of one `cuMemCreate` each: growing never moves
//! memory, so addresses baked into graphs stay valid. Unmapping must cover whole mappings,
//! hence one mapping per chunk; and it does not wait for the device as `cuMemFree` does, hence
//! the synchronize before every unmap.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{sys, CudaContext};

use super::capture;
use super::error as err;
use super::ffi;
use super::stream::CuStream;
use crate::device::backend::CopyDir;
use crate::device::memory::{MemKind, RawBuffer};
use crate::device::ErrorSlot;
use crate::error::CaptureSite;
use crate::{Error, Result};

/// The address of an allocation.
#[derive(Clone, Copy)]
enum Ptr {
    Device(sys::CUdeviceptr),
    Host(NonNull<u8>),
}

/// One device or pinned allocation, freed when dropped (later, if a capture is active then).
pub(crate) struct CuMem {
    ptr: Ptr,
    /// The size asked for; the allocation may be larger (see the module docs). For expandable
    /// memory, the size of its address range.
    bytes: usize,
    /// How expandable memory is mapped; `None` for a plain allocation.
    vm: Option<Vm>,
    ctx: Arc<CudaContext>,
    errors: Arc<ErrorSlot>,
    /// Serializes host reads and writes of pinned memory, which would otherwise race.
    host: Mutex<()>,
}

/// The mapped prefix of an expandable allocation.
struct Vm {
    /// Bytes per mapping.
    chunk: usize,
    /// Bytes mapped from the start, a multiple of `chunk`: read by every range check.
    mapped: AtomicUsize,
    /// Serializes mapping and unmapping.
    changing: Mutex<()>,
}

// SAFETY: the allocation is owned by this value and freed once, on drop; host accesses to pinned
// memory go through `host`, and device accesses are ordered by streams, as CUDA requires.
unsafe impl Send for CuMem {}
// SAFETY: as for Send: shared access reads the address, or takes `host` to touch the bytes.
unsafe impl Sync for CuMem {}

/// An allocation on its way to being freed, with the context it belongs to and its device's
/// error slot.
pub(super) struct Alloc {
    ptr: Ptr,
    /// For expandable memory: (address range, bytes mapped, bytes per mapping).
    vm: Option<(usize, usize, usize)>,
    ctx: Arc<CudaContext>,
    errors: Arc<ErrorSlot>,
}

// SAFETY: the allocation is no longer reachable from anything but this value.
unsafe impl Send for Alloc {}

impl Alloc {
    /// Frees the allocation; an error is kept for the device's next call.
    pub(super) fn free(self) {
        const DURING: &str = "a buffer";
        // Freed even if binding fails: the error may be one left on the context by an earlier
        // destructor of cudarc's, with the context still current.
        if let Err(e) = self.ctx.bind_to_thread() {
            self.errors.record(DURING, err::driver("cuCtxSetCurrent", None, e));
        }
        if let (Some((reserved, mapped, chunk)), Ptr::Device(base)) = (self.vm, self.ptr) {
            // Nothing holds the range any more (as below), but work queued before its last
            // holder went may still run: unmapping does not wait for it.
            if let Err(e) = self.ctx.synchronize() {
                self.errors.record(DURING, err::driver("cuCtxSynchronize", None, e));
            }
            for at in (0..mapped).step_by(chunk) {
                // SAFETY: each chunk is one mapping, unmapped once, after the device finished.
                if let Err(e) = unsafe { ffi::mem_unmap(base + at as u64, chunk) } {
                    self.errors.record(DURING, err::driver("cuMemUnmap", None, e));
                }
            }
            // SAFETY: the range's own base and size, freed once, now that nothing is mapped.
            if let Err(e) = unsafe { ffi::mem_address_free(base, reserved) } {
                self.errors.record(DURING, err::driver("cuMemAddressFree", None, e));
            }
            return;
        }
        // Each pointer came from the matching allocator and this is its only free; no graph
        // holds the buffer (graphs hold the `RawBuffer`, whose drop led here).
        let (op, freed) = match self.ptr {
            // SAFETY: as above.
            Ptr::Device(p) => ("cuMemFree", unsafe { ffi::mem_free(p) }),
            // SAFETY: as above.
            Ptr::Host(p) => ("cuMemFreeHost", unsafe { ffi::mem_free_host(p) }),
        };
        if let Err(e) = freed {
            self.errors.record(DURING, err::driver(op, None, e));
        }
    }
}

impl Drop for CuMem {
    fn drop(&mut self) {
        let vm = self.vm.as_ref().map(|v| (self.bytes, v.mapped.load(Ordering::Acquire), v.chunk));
        capture::free_or_defer(Alloc { ptr: self.ptr, vm, ctx: self.ctx.clone(), errors: self.errors.clone() });
    }
}

/// Allocates `bytes` of `kind` memory, whose free reports to `errors`. The device's context must
/// be bound.
pub(super) fn alloc(ctx: &Arc<CudaContext>, errors: &Arc<ErrorSlot>, bytes: usize, kind: MemKind) -> Result<CuMem> {
    let op = match kind {
        MemKind::Device => "alloc",
        MemKind::Pinned => "alloc_pinned",
    };
    capture::flush_deferred();
    let size = bytes.max(1);
    let ptr = match kind {
        MemKind::Device => ffi::mem_alloc(size).map(Ptr::Device),
        MemKind::Pinned => ffi::mem_alloc_host(size).map(Ptr::Host),
    }
    .map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            let info = ffi::mem_get_info().ok();
            let (free, total) = (info.map(|i| i.0), info.map(|i| i.1));
            let what = if kind == MemKind::Pinned { "pinned host memory" } else { "a device allocation" };
            Error::OutOfMemory { op, requested: bytes, what, free, total }
        }
        _ => err::driver(op, capture::forbidding_site(), e),
    })?;
    Ok(CuMem { ptr, bytes, vm: None, ctx: ctx.clone(), errors: errors.clone(), host: Mutex::new(()) })
}

/// Reserves `capacity` bytes of address range for expandable memory mapped in `chunk`s, nothing
/// mapped yet. The device's context must be bound.
pub(super) fn reserve(ctx: &Arc<CudaContext>, errors: &Arc<ErrorSlot>, capacity: usize, chunk: usize) -> Result<CuMem> {
    const OP: &str = "cuMemAddressReserve";
    capture::flush_deferred();
    let base = ffi::mem_address_reserve(capacity).map_err(|e| err::driver(OP, capture::forbidding_site(), e))?;
    let vm = Vm { chunk, mapped: AtomicUsize::new(0), changing: Mutex::new(()) };
    Ok(CuMem {
        ptr: Ptr::Device(base),
        bytes: capacity,
        vm: Some(vm),
        ctx: ctx.clone(),
        errors: errors.clone(),
        host: Mutex::new(()),
    })
}

fn vm_of<'m>(op: &'static str, mem: &'m CuMem) -> Result<(&'m Vm, sys::CUdeviceptr)> {
    match (&mem.vm, mem.ptr) {
        (Some(vm), Ptr::Device(base)) => Ok((vm, base)),
        _ => Err(bug(op, "a plain allocation reached a mapping call; please report this as a bug")),
    }
}

/// Unmaps the chunks of `[from, to)`, the top one first so that what stays mapped is a prefix;
/// returns the bytes still mapped.
fn unmap_down(vm: &Vm, base: sys::CUdeviceptr, from: usize, to: usize) -> Result<usize> {
    let mut end = to;
    while end > from {
        // SAFETY: the chunk at `end - chunk` is one mapping; callers waited for the device and
        // know no graph uses it.
        unsafe { ffi::mem_unmap(base + (end - vm.chunk) as u64, vm.chunk) }
            .map_err(|e| err::driver("cuMemUnmap", None, e))
            .inspect_err(|_| vm.mapped.store(end, Ordering::Release))?;
        end -= vm.chunk;
    }
    Ok(end)
}

/// Maps expandable memory up to `bytes` (a multiple of its chunk, within its range): all of it,
/// or on failure none of what this call mapped. The device's context must be bound.
pub(super) fn map_to(mem: &CuMem, bytes: usize, ordinal: usize) -> Result<()> {
    const OP: &str = "cuMemMap";
    let (vm, base) = vm_of(OP, mem)?;
    let _changing = vm.changing.lock().unwrap_or_else(PoisonError::into_inner);
    let old = vm.mapped.load(Ordering::Acquire);
    if bytes <= old {
        return Ok(());
    }
    if bytes > mem.bytes || !bytes.is_multiple_of(vm.chunk) {
        return Err(bug(OP, "a mapping outside its range or its chunks was asked for; please report this as a bug"));
    }
    capture::flush_deferred();
    let fail = |at: usize, e: cudarc::driver::DriverError| -> Error {
        if let Err(undo) = unmap_down(vm, base, old, at) {
            mem.errors.record("undoing a failed mapping", undo);
        }
        match e.0 {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let info = ffi::mem_get_info().ok();
                let (free, total) = (info.map(|i| i.0), info.map(|i| i.1));
                Error::OutOfMemory { op: OP, requested: bytes - old, what: "expandable device memory", free, total }
            }
            _ => err::driver(OP, capture::forbidding_site(), e),
        }
    };
    let mut at = old;
    while at < bytes {
        // SAFETY: `[at, at + chunk)` lies in the range (checked above) past its mapped prefix.
        unsafe { ffi::mem_create_mapped(base + at as u64, vm.chunk, ordinal) }.map_err(|e| fail(at, e))?;
        at += vm.chunk;
    }
    // SAFETY: `[old, bytes)` was just mapped, chunk by chunk.
    unsafe { ffi::mem_set_access(base + old as u64, bytes - old, ordinal) }.map_err(|e| fail(bytes, e))?;
    vm.mapped.store(bytes, Ordering::Release);
    Ok(())
}

/// Waits for the device, then unmaps expandable memory after its first `bytes`. The caller
/// knows that no graph uses those bytes. The device's context must be bound.
pub(super) fn unmap_from(mem: &CuMem, bytes: usize) -> Result<()> {
    const OP: &str = "cuMemUnmap";
    let (vm, base) = vm_of(OP, mem)?;
    let _changing = vm.changing.lock().unwrap_or_else(PoisonError::into_inner);
    let old = vm.mapped.load(Ordering::Acquire);
    if bytes >= old {
        return Ok(());
    }
    mem.ctx.synchronize().map_err(|e| err::driver("cuCtxSynchronize", capture::forbidding_site(), e))?;
    let left = unmap_down(vm, base, bytes, old)?;
    vm.mapped.store(left, Ordering::Release);
    Ok(())
}

/// Bytes usable: the size asked for, or the mapped prefix of expandable memory.
pub(super) fn usable(mem: &CuMem) -> usize {
    mem.vm.as_ref().map_or(mem.bytes, |vm| vm.mapped.load(Ordering::Acquire))
}

/// The error for a buffer the public layer should not have let through; it names the bug.
fn bug(op: &'static str, why: &'static str) -> Error {
    Error::Unsupported { op, backend: "cuda", why }
}

fn check_range(op: &'static str, mem: &CuMem, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= usable(mem) => Ok(()),
        Some(end) if mem.vm.is_some() => Err(Error::Unmapped { op, start: offset, end, mapped: usable(mem) }),
        _ => Err(bug(op, "a range outside its buffer reached the CUDA backend; please report this as a bug")),
    }
}

/// The device address of `len` bytes at `offset` of a device buffer.
fn device_ptr(op: &'static str, raw: &RawBuffer, offset: usize, len: usize) -> Result<sys::CUdeviceptr> {
    let mem = raw.mem.cuda()?;
    check_range(op, mem, offset, len)?;
    match (raw.kind, mem.ptr) {
        (MemKind::Device, Ptr::Device(p)) => Ok(p + offset as u64),
        _ => Err(bug(
            op,
            "a pinned buffer reached the CUDA backend where device memory was expected; please report this as a bug",
        )),
    }
}

/// The host address of `len` bytes at `offset` of a pinned buffer.
fn host_ptr(op: &'static str, raw: &RawBuffer, offset: usize, len: usize) -> Result<*mut u8> {
    let mem = raw.mem.cuda()?;
    check_range(op, mem, offset, len)?;
    match (raw.kind, mem.ptr) {
        (MemKind::Pinned, Ptr::Host(p)) => Ok(p.as_ptr().wrapping_add(offset)),
        _ => Err(bug(
            op,
            "a device buffer reached the CUDA backend where pinned memory was expected; please report this as a bug",
        )),
    }
}

/// A kernel's pointer argument: the device address `offset` bytes into a device buffer.
pub(super) fn kernel_arg(kernel: &'static str, raw: &RawBuffer, offset: usize) -> Result<u64> {
    device_ptr(kernel, raw, offset, 0)
}

/// One side of a copy: the buffer and the byte offset into it.
pub(super) type Side<'a> = (&'a Arc<RawBuffer>, usize);

/// Enqueues an async copy. The device's context must be bound.
pub(super) fn copy(
    op: &'static str,
    stream: &CuStream,
    dir: CopyDir,
    src: Side<'_>,
    dst: Side<'_>,
    bytes: usize,
) -> Result<()> {
    let ((src, src_off), (dst, dst_off)) = (src, dst);
    // In all three arms the addresses were range-checked against live allocations. If the stream
    // is capturing, the caller makes the capture hold both buffers, so they outlive every launch
    // of the graph; otherwise a buffer dropped now is released by `cuMemFree` or `cuMemFreeHost`,
    // which synchronize with the device before releasing memory.
    let copied = match dir {
        CopyDir::HostToDevice => {
            let (s, d) = (host_ptr(op, src, src_off, bytes)?, device_ptr(op, dst, dst_off, bytes)?);
            // SAFETY: as above.
            unsafe { ffi::copy_htod_async(d, s, bytes, &stream.raw) }
        }
        CopyDir::DeviceToHost => {
            let (s, d) = (device_ptr(op, src, src_off, bytes)?, host_ptr(op, dst, dst_off, bytes)?);
            // SAFETY: as above. The host touches pinned memory only by raw copies (`read_pinned`),
            // never through references, so a read racing the copy sees stale bytes, not UB;
            // ordering the two is the caller's job (PinnedBuffer docs).
            unsafe { ffi::copy_dtoh_async(d, s, bytes, &stream.raw) }
        }
        CopyDir::DeviceToDevice => {
            let (s, d) = (device_ptr(op, src, src_off, bytes)?, device_ptr(op, dst, dst_off, bytes)?);
            // SAFETY: as above.
            unsafe { ffi::copy_dtod_async(d, s, bytes, &stream.raw) }
        }
    };
    copied.map_err(|e| err::at(op, CaptureSite::Stream(stream.id), e))
}

/// Enqueues an async byte memset. The device's context must be bound.
pub(super) fn memset(op: &'static str, stream: &CuStream, dst: Side<'_>, bytes: usize, value: u8) -> Result<()> {
    let d = device_ptr(op, dst.0, dst.1, bytes)?;
    // SAFETY: as for `copy`.
    unsafe { ffi::memset_async(d, value, bytes, &stream.raw) }
        .map_err(|e| err::at(op, CaptureSite::Stream(stream.id), e))
}

/// Waits for `stream`, then copies device memory to `out` synchronously. Both steps are refused
/// under capture as CUDA refuses them. The device's context must be bound.
pub(super) fn read_blocking(stream: &CuStream, mem: &CuMem, offset: usize, out: &mut [u8]) -> Result<()> {
    const OP: &str = "to_vec";
    super::stream::synchronize(OP, stream)?;
    let src = blocking_ptr(OP, mem, offset, out.len())?;
    // SAFETY: `src` addresses `out.len()` bytes of the live allocation (range-checked).
    unsafe { ffi::copy_dtoh(out, src) }.map_err(|e| blocking_error(OP, stream, e))
}

/// Waits for `stream`, then copies `data` to device memory synchronously.
pub(super) fn write_blocking(stream: &CuStream, mem: &CuMem, offset: usize, data: &[u8]) -> Result<()> {
    const OP: &str = "write_from";
    // Synchronizing first refuses the call inside a capture, as a blocking copy must be.
    super::stream::synchronize(OP, stream)?;
    let dst = blocking_ptr(OP, mem, offset, data.len())?;
    // Not `cuMemcpyHtoD`: from pageable memory it returns once the data is staged, before the
    // DMA lands, and our non-blocking streams are not ordered after the legacy stream it uses,
    // so a kernel queued next could read the old bytes. A copy on the stream itself, waited
    // for, is ordered and complete.
    // SAFETY: `dst` addresses `data.len()` bytes of the live allocation (range-checked); `data`
    // outlives the copy, which the synchronize below waits for.
    unsafe { ffi::copy_htod_async(dst, data.as_ptr(), data.len(), &stream.raw) }
        .map_err(|e| blocking_error(OP, stream, e))?;
    super::stream::synchronize(OP, stream)
}

fn blocking_ptr(op: &'static str, mem: &CuMem, offset: usize, len: usize) -> Result<sys::CUdeviceptr> {
    check_range(op, mem, offset, len)?;
    match mem.ptr {
        Ptr::Device(p) => Ok(p + offset as u64),
        Ptr::Host(_) => Err(bug(op, "a pinned buffer reached a blocking device copy; please report this as a bug")),
    }
}

/// A synchronous copy refused by a capture is reported on the capture that forbids it.
fn blocking_error(op: &'static str, stream: &CuStream, e: cudarc::driver::DriverError) -> Error {
    err::driver(op, capture::forbidding_site().or(Some(CaptureSite::Stream(stream.id))), e)
}

impl CuMem {
    /// Host read of pinned memory, now.
    pub(super) fn read_pinned(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let src = self.pinned("PinnedBuffer::read", offset, out.len())?;
        let _guard = self.host.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `src` addresses `out.len()` bytes of the live pinned allocation (range-checked),
        // which does not overlap `out`; other host accesses are excluded by the lock.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Host write of pinned memory, now.
    pub(super) fn write_pinned(&self, offset: usize, data: &[u8]) -> Result<()> {
        let dst = self.pinned("PinnedBuffer::write", offset, data.len())?;
        let _guard = self.host.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: as for `read_pinned`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    fn pinned(&self, op: &'static str, offset: usize, len: usize) -> Result<*mut u8> {
        check_range(op, self, offset, len)?;
        match self.ptr {
            // SAFETY: `offset + len` is within the allocation (checked above).
            Ptr::Host(p) => Ok(unsafe { p.as_ptr().add(offset) }),
            Ptr::Device(_) => Err(bug(op, "a device buffer reached a pinned host access; please report this as a bug")),
        }
    }
}
