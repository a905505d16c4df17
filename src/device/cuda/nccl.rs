//! NCCL communicators and their operations on our streams (cudarc's `nccl` bindings, loaded at
//! run time like the driver).
//!
//! cudarc looks for `libnccl.so` (not the `libnccl.so.2` that NCCL's packages ship) and panics
//! when it is missing, so its presence is checked first and the error says how to expose it.

use std::sync::{Arc, Mutex};

use cudarc::nccl::{result, sys};

use super::memory::kernel_arg;
use super::stream::CuStream;
use crate::device::backend::{Op, Repr};
use crate::device::comm::Collective;
use crate::device::{CommErrorKind, DType};
use crate::{Error, Result};

/// One rank's NCCL communicator; shared with the graphs that captured its operations.
#[derive(Clone)]
pub(crate) struct NcclComm(Arc<NcclInner>);

pub(crate) struct NcclInner {
    rank: usize,
    comm: Mutex<Option<CommPtr>>,
}

struct CommPtr(sys::ncclComm_t);

impl NcclInner {
    /// Whether the communicator was aborted (its resources are gone).
    pub(super) fn aborted(&self) -> bool {
        self.comm.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// Its rank in its group.
    pub(super) fn rank(&self) -> usize {
        self.rank
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every use goes through the mutex.
unsafe impl Send for CommPtr {}

impl Drop for NcclInner {
    fn drop(&mut self) {
        if let Some(c) = self.comm.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            // SAFETY: the communicator is valid and no longer used by anyone (this is the last
            // handle, graphs included). A failure here leaves nothing to retry.
            let _ = unsafe { result::comm_destroy(c.0) };
        }
    }
}

fn missing() -> CommErrorKind {
    CommErrorKind::Nccl(
        "libnccl.so was not found; NCCL's packages ship libnccl.so.2: link it as libnccl.so in a folder on LD_LIBRARY_PATH (`graphed launch` does this for the copy in PyTorch's nvidia-nccl package)".into(),
    )
}

fn present() -> Result<(), CommErrorKind> {
    // SAFETY: only tries to load the library under cudarc's names.
    match unsafe { sys::is_culib_present() } {
        true => Ok(()),
        false => Err(missing()),
    }
}

fn nccl(call: &str, e: result::NcclError) -> CommErrorKind {
    CommErrorKind::Nccl(format!("{call} failed with {:?}", e.0))
}

/// A new unique id (opens rank 0's bootstrap socket).
pub(crate) fn nccl_unique_id() -> Result<[u8; 128], CommErrorKind> {
    present()?;
    let id = result::get_uniqueid().map_err(|e| nccl("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

/// Joins group `id` as `rank` of `size` on the current context's GPU.
pub(crate) fn init(rank: usize, size: usize, id: &[u8; 128]) -> Result<NcclComm, CommErrorKind> {
    present()?;
    let id = sys::ncclUniqueId { internal: id.map(|b| b as ::core::ffi::c_char) };
    let mut comm = std::ptr::null_mut();
    let (n, r) = (i32::try_from(size), i32::try_from(rank));
    let (Ok(n), Ok(r)) = (n, r) else {
        return Err(CommErrorKind::BadPeer { peer: rank, size });
    };
    // SAFETY: `comm` is a valid out-pointer; NCCL blocks until every rank joined.
    unsafe { result::comm_init_rank(&mut comm, n, id, r) }.map_err(|e| nccl("ncclCommInitRank", e))?;
    Ok(NcclComm(Arc::new(NcclInner { rank, comm: Mutex::new(Some(CommPtr(comm))) })))
}

impl NcclComm {
    /// What NCCL reports for the communicator's asynchronous work (a peer's failure).
    pub(crate) fn async_error(&self) -> Result<(), CommErrorKind> {
        let guard = self.0.comm.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = guard.as_ref() else { return Err(CommErrorKind::Nccl("the communicator was aborted".into())) };
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a valid communicator and out-pointer.
        unsafe { sys::ncclCommGetAsyncError(c.0, &mut state) }
            .result()
            .map_err(|e| nccl("ncclCommGetAsyncError", e))?;
        state.result().map(|_| ()).map_err(|e| nccl("a collective", e))
    }

    /// `ncclCommSplit` on the current context's GPU: this rank's communicator among the ranks
    /// that gave the same `color`, ranked by `key`, with its rank and size; `None` without a
    /// color. Every rank of the group calls it, and it blocks until all have.
    pub(crate) fn split(
        &self,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<(NcclComm, usize, usize)>, CommErrorKind> {
        let guard = self.0.comm.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = guard.as_ref() else { return Err(CommErrorKind::Nccl("the communicator was aborted".into())) };
        let too_big = |what: &str| CommErrorKind::Nccl(format!("a split {what} above {}", i32::MAX));
        // NCCL_SPLIT_NOCOLOR: this rank joins no new communicator.
        let color = color.map_or(Ok(-1), |c| i32::try_from(c).map_err(|_| too_big("color")))?;
        let key = i32::try_from(key).map_err(|_| too_big("key"))?;
        let mut new = std::ptr::null_mut();
        // SAFETY: a valid communicator and out-pointer; a null config inherits the parent's.
        // (cudarc's `result::comm_split` is compiled for CUDA 12.2 to 12.5 only.)
        unsafe { sys::ncclCommSplit(c.0, color, key, &mut new, std::ptr::null_mut()) }
            .result()
            .map_err(|e| nccl("ncclCommSplit", e))?;
        if new.is_null() {
            return Ok(None);
        }
        // SAFETY: `new` is the valid communicator just made.
        let query = unsafe { result::comm_user_rank(new).and_then(|r| Ok((r, result::comm_count(new)?))) };
        let placed = query.ok().and_then(|(r, n)| usize::try_from(r).ok().zip(usize::try_from(n).ok()));
        let Some((rank, size)) = placed else {
            // SAFETY: `new` is valid and used by no one else.
            let _ = unsafe { result::comm_destroy(new) };
            return Err(CommErrorKind::Nccl("ncclCommSplit made a communicator without a rank and size".into()));
        };
        Ok(Some((NcclComm(Arc::new(NcclInner { rank, comm: Mutex::new(Some(CommPtr(new))) })), rank, size)))
    }

    /// Aborts the communicator: its pending operations end, later ones fail.
    pub(crate) fn abort(&self) {
        // Taken out first: a second caller (a waiting host thread) returns at once instead of
        // waiting for this abort, which may take as long as NCCL needs to give up on a peer.
        let taken = self.0.comm.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(c) = taken {
            // SAFETY: a valid communicator, not used after this.
            let _ = unsafe { result::comm_abort(c.0) };
        }
    }

    pub(super) fn inner(&self) -> &Arc<NcclInner> {
        &self.0
    }
}

fn data_type(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::U32 => sys::ncclDataType_t::ncclUint32,
        DType::U64 => sys::ncclDataType_t::ncclUint64,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

/// Enqueues a collective, or a group of sends and receives, on `stream`.
pub(super) fn enqueue(stream: &CuStream, op: &Op<'_>) -> Result<()> {
    let Op::Collective { comm, parts, dtype } = *op else { return Ok(()) };
    let name = op.name();
    let Repr::Cuda(comm) = comm else {
        return Err(Error::Unsupported {
            op: name,
            backend: "cuda",
            why: "a simulated communicator reached a GPU; use Communicator::nccl",
        });
    };
    let rank = comm.0.rank;
    let fail = |call: &str, e| crate::device::comm::comm_error(name, rank, nccl(call, e));
    let guard = comm.0.comm.lock().unwrap_or_else(|p| p.into_inner());
    let Some(c) = guard.as_ref() else {
        return Err(crate::device::comm::comm_error(
            name,
            rank,
            CommErrorKind::Nccl("the communicator was aborted".into()),
        ));
    };
    let mut pointers = Vec::with_capacity(parts.len());
    for p in parts {
        let s = kernel_arg(name, &p.src.0.raw, p.src.1)? as *mut std::ffi::c_void;
        let d = kernel_arg(name, &p.dst.0.raw, p.dst.1)? as *mut std::ffi::c_void;
        pointers.push((p, s, d));
    }
    let (t, raw) = (data_type(dtype), stream.raw.cu_stream() as sys::cudaStream_t);
    let sum = sys::ncclRedOp_t::ncclSum;
    let grouped = parts.len() > 1;
    if grouped {
        result::group_start().map_err(|e| fail("ncclGroupStart", e))?;
    }
    let mut first_error = None;
    for (p, s, d) in pointers {
        let count = p.count;
        // SAFETY: the pointers are bounds-checked views of live device memory that the stream's
        // ordering (and, in a capture, the graph's holdings) keeps alive until the operation ran.
        let done = unsafe {
            match p.kind {
                Collective::AllReduce => result::all_reduce(s, d, count, t, sum, c.0, raw),
                Collective::ReduceScatter => result::reduce_scatter(s, d, count, t, sum, c.0, raw),
                Collective::AllGather => result::all_gather(s, d, count, t, c.0, raw),
                Collective::Send(peer) => result::send(s, count, t, peer as i32, c.0, raw),
                Collective::Recv(peer) => result::recv(d, count, t, peer as i32, c.0, raw),
            }
        };
        if let Err(e) = done {
            first_error = Some(fail(p.kind.name(), e));
            break;
        }
    }
    // A started group is always ended, so that NCCL's per-thread group state stays balanced.
    let ended = if grouped { result::group_end().map(|_| ()).map_err(|e| fail("ncclGroupEnd", e)) } else { Ok(()) };
    match first_error {
        Some(e) => Err(e),
        None => ended,
    }
}
