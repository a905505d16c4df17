//! Device and pinned allocations, and the copies and memsets that use them.
//!
//! Allocation is synchronous (`cuMemAlloc`, `cuMemHostAlloc`), never stream-ordered, so captured
//! graphs never contain memory nodes. A zero-byte buffer gets a one-byte allocation: every buffer
//! then has a valid address for copies and kernel arguments, and allocating under a capture is
//! refused the same way whatever the size.

use std::ptr::NonNull;
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
    /// The size asked for; the allocation may be larger (see the module docs).
    bytes: usize,
    ctx: Arc<CudaContext>,
    errors: Arc<ErrorSlot>,
    /// Serializes host reads and writes of pinned memory, which would otherwise race.
    host: Mutex<()>,
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
        capture::free_or_defer(Alloc { ptr: self.ptr, ctx: self.ctx.clone(), errors: self.errors.clone() });
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
    Ok(CuMem { ptr, bytes, ctx: ctx.clone(), errors: errors.clone(), host: Mutex::new(()) })
}

/// The error for a buffer the public layer should not have let through; it names the bug.
fn bug(op: &'static str, why: &'static str) -> Error {
    Error::Unsupported { op, backend: "cuda", why }
}

fn check_range(op: &'static str, mem: &CuMem, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= mem.bytes => Ok(()),
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
