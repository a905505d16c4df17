//! NCCL communicators and their operations on our streams (cudarc's `nccl` bindings, loaded at
//! run time like the driver).
//!
//! A rank's communicator is two NCCL communicators of the same ranks. Making a group (joining
//! it, splitting it) waits for every rank at the host, so it runs on a non-blocking one: NCCL
//! waits on a thread of its own while we poll it against the timeout and the group's watch, and
//! abort it when either ends the wait, instead of hanging in NCCL when a rank never comes. The
//! collectives run on a blocking twin, split from it: NCCL 2.28 launches a non-blocking
//! communicator's collectives from a thread it starts for each call, which costs a thread per
//! collective and launches outside the thread that captures them.
//!
//! cudarc looks for `libnccl.so` (not the `libnccl.so.2` that NCCL's packages ship) and panics
//! when it is missing, so its presence is checked first and the error says how to expose it.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::nccl::{result, sys};

use super::memory::kernel_arg;
use super::stream::CuStream;
use crate::device::backend::{Op, Repr};
use crate::device::comm::{Collective, Patience};
use crate::device::{CommErrorKind, DType, ErrorSlot};
use crate::{Error, Result};

/// One rank's NCCL communicator; shared with the graphs that captured its operations.
#[derive(Clone)]
pub(crate) struct NcclComm(Arc<NcclInner>);

pub(crate) struct NcclInner {
    rank: usize,
    /// Blocking: the collectives. Declared first, so that it is destroyed before the
    /// communicator it was split from.
    data: Handle,
    /// Non-blocking: joins and splits.
    control: Handle,
}

/// The rank of an aborted communicator among `comms` (those whose collectives a graph
/// captured), if any: launching the graph would run NCCL's kernels on freed resources. Checked
/// just before a launch, without holding the communicators for it: a launch can block (CUDA's
/// queue full behind a collective that waits on a dead rank) until the abort that ends that
/// collective, so holding them would keep the abort from ever running. An abort that lands
/// between this check and the launch is not seen.
pub(super) fn aborted_among(comms: &[Arc<NcclInner>]) -> Option<usize> {
    comms.iter().find(|c| c.data.aborted()).map(|c| c.rank)
}

/// One NCCL communicator, used under a lock (NCCL's calls on a communicator must not run
/// concurrently) and aborted at most once.
struct Handle {
    comm: Mutex<Option<CommPtr>>,
    /// Set before an abort takes the lock, so that a poller learns of the abort at once.
    aborting: AtomicBool,
    /// This process's rank in the group the communicator was made from, for the error of its
    /// drop.
    rank: usize,
    /// Where its drop keeps an error, for the device's next call.
    errors: Arc<ErrorSlot>,
}

struct CommPtr(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every use goes through the mutex.
unsafe impl Send for CommPtr {}

fn aborted() -> CommErrorKind {
    CommErrorKind::Nccl("the communicator was aborted".into())
}

/// A communicator's configuration: blocking or not, the rest NCCL's defaults (or its
/// environment's), as `NCCL_CONFIG_INITIALIZER` makes it for cudarc's 2.28 layout.
fn config(blocking: bool) -> sys::ncclConfig_t {
    const UNSET: c_int = c_int::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // NCCL_VERSION(2, 28, 0): the layout the fields below follow.
        version: 22800,
        blocking: c_int::from(blocking),
        cgaClusterSize: UNSET,
        minCTAs: UNSET,
        maxCTAs: UNSET,
        netName: std::ptr::null(),
        splitShare: UNSET,
        trafficClass: UNSET,
        commName: std::ptr::null(),
        collnetEnable: UNSET,
        CTAPolicy: UNSET,
        shrinkShare: UNSET,
        nvlsCTAs: UNSET,
        nChannelsPerNetPeer: UNSET,
        nvlinkCentricSched: UNSET,
    }
}

impl Handle {
    fn new(comm: sys::ncclComm_t, rank: usize, errors: &Arc<ErrorSlot>) -> Handle {
        Handle { comm: Mutex::new(Some(CommPtr(comm))), aborting: AtomicBool::new(false), rank, errors: errors.clone() }
    }

    fn aborted(&self) -> bool {
        self.aborting.load(Ordering::SeqCst)
    }

    /// `f` on the communicator, under its lock.
    fn with<T>(&self, f: impl FnOnce(sys::ncclComm_t) -> T) -> Result<T, CommErrorKind> {
        if self.aborted() {
            return Err(aborted());
        }
        let guard = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        guard.as_ref().map(|c| f(c.0)).ok_or_else(aborted)
    }

    /// Whether the work NCCL does on its own thread for the last call has ended; NCCL's error
    /// for it, or one a peer's failure left.
    fn ready(&self) -> Result<bool, CommErrorKind> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a valid communicator and out-pointer.
        let asked = self.with(|c| unsafe { sys::ncclCommGetAsyncError(c, &mut state) })?;
        asked.result().map_err(|e| nccl("ncclCommGetAsyncError", e))?;
        match state {
            sys::ncclResult_t::ncclInProgress => Ok(false),
            state => state.result().map(|_| true).map_err(|e| nccl("the communicator's work", e)),
        }
    }

    /// Waits until [`ready`](Handle::ready), polling against `patience`; aborts the
    /// communicator when the wait fails (NCCL's error included: what it waited for is over).
    fn settle(&self, patience: &Patience<'_>, waiting: &str) -> Result<(), CommErrorKind> {
        let ready = || self.ready().map_err(|kind| patience.named(kind)).inspect_err(|_| self.abort());
        patience.poll(&|| waiting.to_string(), &|| self.abort(), |kind| kind, ready)
    }

    /// Aborts the communicator: its pending operations end, later ones fail. Returns once
    /// NCCL's abort has, whichever thread ran it.
    fn abort(&self) {
        self.aborting.store(true, Ordering::SeqCst);
        // Under the lock: whoever finds the communicator gone knows that NCCL's abort returned,
        // and with it any work of NCCL's threads for it (a split's writes included).
        let mut guard = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = guard.take() {
            // SAFETY: a valid communicator, not used after this. A failure leaves nothing to
            // retry, and the communicator is gone either way.
            let _ = unsafe { result::comm_abort(c.0) };
        }
    }

    /// Its rank and size.
    fn placement(&self) -> Result<(usize, usize), CommErrorKind> {
        // SAFETY: a valid communicator whose making has ended.
        let query =
            self.with(|c| unsafe { result::comm_user_rank(c).and_then(|r| Ok((r, result::comm_count(c)?))) })?;
        let placed = query.ok().and_then(|(r, n)| usize::try_from(r).ok().zip(usize::try_from(n).ok()));
        placed.ok_or_else(|| CommErrorKind::Nccl("NCCL made a communicator without a rank and size".into()))
    }

    /// `ncclCommSplit` of this non-blocking communicator, polled as [`settle`](Handle::settle)
    /// does: the new communicator of the ranks that gave the same `color` (`None`: none),
    /// ranked by `key`, blocking or not. A failed split aborts this communicator (the others
    /// wait in it), and the communicator NCCL made for it.
    fn split(
        &self,
        color: Option<c_int>,
        key: c_int,
        blocking: bool,
        patience: &Patience<'_>,
    ) -> Result<Option<Handle>, CommErrorKind> {
        // NCCL's thread writes the new communicator here when the split ends, even a failed one;
        // every way out below has waited for that (`settle` ends with the split, or aborts,
        // which joins NCCL's thread).
        let made = AtomicPtr::new(std::ptr::null_mut());
        let mut config = config(blocking);
        // NCCL_SPLIT_NOCOLOR: this rank joins no new communicator.
        let color = color.unwrap_or(-1);
        // SAFETY: a valid communicator; `made` and `config` outlive NCCL's use of them.
        let started = self.with(|c| unsafe { sys::ncclCommSplit(c, color, key, made.as_ptr(), &mut config) })?;
        let settled = match started.result() {
            Err(e) => {
                self.abort();
                Err(nccl("ncclCommSplit", e))
            }
            Ok(_) => self.settle(patience, "every rank to split the NCCL group"),
        };
        let made = made.load(Ordering::Acquire);
        let made = (!made.is_null()).then(|| Handle::new(made, self.rank, &self.errors));
        // The parent was aborted first (above): until a split succeeds, the parent's abort also
        // writes the child's abort flag, which must still exist then.
        if let (Err(_), Some(made)) = (&settled, &made) {
            made.abort();
        }
        settled.map(|()| made)
    }
}

impl Drop for Handle {
    /// Destroys the communicator, or aborts one in error; what failed (NCCL's error for its
    /// work, which no wait reported, or the destroy's) is kept for the device's next call. One
    /// aborted before (after a failed wait, a split or a rank's death) is already reported.
    fn drop(&mut self) {
        let Some(c) = self.comm.get_mut().unwrap_or_else(PoisonError::into_inner).take() else { return };
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a valid communicator and out-pointer.
        let asked = unsafe { sys::ncclCommGetAsyncError(c.0, &mut state) };
        let healthy = asked == sys::ncclResult_t::ncclSuccess && state == sys::ncclResult_t::ncclSuccess;
        // An error, not one still in progress (a making never waited for: nothing to report).
        let failed = match (asked.result(), state.result()) {
            (Err(e), _) => Some(nccl("ncclCommGetAsyncError, as the communicator was dropped", e)),
            (_, Err(e)) => Some(nccl("the work of a communicator dropped without a wait that reported it", e)),
            _ => None,
        };
        // SAFETY: the communicator is valid and no longer used by anyone (this is the last
        // handle, graphs included). One not healthy is aborted: destroying it would wait for
        // work that may wait on a rank that is gone. Its abort's own failure adds nothing.
        let failed = match healthy {
            false => {
                let _ = unsafe { result::comm_abort(c.0) };
                failed
            }
            true => unsafe { result::comm_destroy(c.0) }.err().map(|e| {
                // NCCL 2.28's ncclCommDestroy returns without ending the group it started when
                // an error appeared since the check above; ending it keeps this thread's later
                // NCCL calls from being held in that group. The communicator is left as it is:
                // aborting it could free it twice, should the destroy have gone further.
                let _ = result::group_end();
                nccl("ncclCommDestroy", e)
            }),
        };
        if let Some(kind) = failed {
            let e = crate::device::comm::comm_error("dropping an NCCL communicator", self.rank, kind);
            self.errors.record("an NCCL communicator", e);
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
    match e.0 {
        sys::ncclResult_t::ncclRemoteError => CommErrorKind::PeerFailed { call: call.to_string() },
        other => CommErrorKind::Nccl(format!("{call} failed with {other:?}")),
    }
}

/// A new unique id (opens rank 0's bootstrap socket).
pub(crate) fn nccl_unique_id() -> Result<[u8; 128], CommErrorKind> {
    present()?;
    let id = result::get_uniqueid().map_err(|e| nccl("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

/// Joins group `id` as `rank` of `size` on the current context's GPU, waiting for the others
/// as `patience` allows.
pub(crate) fn init(
    rank: usize,
    size: usize,
    id: &[u8; 128],
    patience: &Patience<'_>,
    errors: &Arc<ErrorSlot>,
) -> Result<NcclComm, CommErrorKind> {
    present()?;
    // NCCL applies it to every communicator, over their configurations: the twins would both
    // block (no wait could be ended) or both not (collectives launched from NCCL's threads).
    if let Some(v) = std::env::var_os("NCCL_COMM_BLOCKING") {
        return Err(CommErrorKind::Nccl(format!(
            "NCCL_COMM_BLOCKING is set ({v:?}), but graphed sets each communicator's own (a non-blocking one makes \
             the group, a blocking one runs the collectives): unset it"
        )));
    }
    let id = sys::ncclUniqueId { internal: id.map(|b| b as ::core::ffi::c_char) };
    let (n, r) = (c_int::try_from(size), c_int::try_from(rank));
    let (Ok(n), Ok(r)) = (n, r) else {
        return Err(CommErrorKind::BadPeer { peer: rank, size });
    };
    let mut comm = std::ptr::null_mut();
    let mut config = config(false);
    // SAFETY: valid out-pointers; a non-blocking init returns at once and joins on NCCL's thread.
    let started = unsafe { sys::ncclCommInitRankConfig(&mut comm, n, id, r, &mut config) };
    if comm.is_null() {
        let e = started.result().err().unwrap_or(result::NcclError(sys::ncclResult_t::ncclInternalError));
        return Err(nccl("ncclCommInitRankConfig", e));
    }
    let control = Handle::new(comm, rank, errors);
    if let Err(e) = started.result() {
        control.abort();
        return Err(nccl("ncclCommInitRankConfig", e));
    }
    control.settle(patience, "every rank to join the NCCL group")?;
    twin(rank, control, patience)
}

/// The communicator of `control`'s ranks, with a blocking twin for its collectives.
fn twin(rank: usize, control: Handle, patience: &Patience<'_>) -> Result<NcclComm, CommErrorKind> {
    let key = c_int::try_from(rank).map_err(|_| CommErrorKind::Nccl(format!("rank {rank} above {}", c_int::MAX)))?;
    let Some(data) = control.split(Some(0), key, true, patience)? else {
        control.abort();
        return Err(CommErrorKind::Nccl("ncclCommSplit left a rank without the group's blocking twin".into()));
    };
    Ok(NcclComm(Arc::new(NcclInner { rank, data, control })))
}

impl NcclComm {
    /// What NCCL reports for the collectives' asynchronous work (a peer's failure).
    pub(crate) fn async_error(&self) -> Result<(), CommErrorKind> {
        self.0.data.ready().map(|_| ())
    }

    /// `ncclCommSplit` on the current context's GPU: this rank's communicator among the ranks
    /// that gave the same `color`, ranked by `key`, with its rank and size; `None` without a
    /// color. Every rank of the group calls it; it waits for all as `patience` allows, and a
    /// failure aborts this communicator, both twins (the others wait in it).
    pub(crate) fn split(
        &self,
        color: Option<c_int>,
        key: c_int,
        patience: &Patience<'_>,
    ) -> Result<Option<(NcclComm, usize, usize)>, CommErrorKind> {
        let split = (|| {
            let Some(control) = self.0.control.split(color, key, false, patience)? else { return Ok(None) };
            let (rank, size) = control.placement()?;
            Ok(Some((twin(rank, control, patience)?, rank, size)))
        })();
        // The others wait in this split, or in collectives matched with it: the group is over.
        if split.is_err() {
            self.abort();
        }
        split
    }

    /// Aborts the communicator: its pending operations end, later ones fail.
    pub(crate) fn abort(&self) {
        self.0.data.abort();
        self.0.control.abort();
    }

    /// Marks the communicator aborted, so that every later use fails at once (a graph that
    /// captured it is refused at launch); whether this call was the first to. NCCL's abort itself
    /// is [`abort`](NcclComm::abort)'s, which the caller runs where it can wait for it.
    pub(crate) fn begin_abort(&self) -> bool {
        let marked = [&self.0.data, &self.0.control].map(|h| h.aborting.swap(true, Ordering::SeqCst));
        marked != [true, true]
    }

    pub(super) fn inner(&self) -> &Arc<NcclInner> {
        &self.0
    }

    /// Whether another handle holds this communicator (a graph that captured its operations
    /// holds one).
    pub(crate) fn shared(&self) -> bool {
        Arc::strong_count(&self.0) > 1
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
        // Moved, never summed: `Communicator` refuses to reduce FP8 before it enqueues.
        DType::F8E4M3 => sys::ncclDataType_t::ncclFloat8e4m3,
        DType::F8E5M2 => sys::ncclDataType_t::ncclFloat8e5m2,
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
    let fail = |kind| crate::device::comm::comm_error(name, rank, kind);
    let mut pointers = Vec::with_capacity(parts.len());
    for p in parts {
        let s = kernel_arg(name, &p.src.0.raw, p.src.1)? as *mut std::ffi::c_void;
        let d = kernel_arg(name, &p.dst.0.raw, p.dst.1)? as *mut std::ffi::c_void;
        pointers.push((p, s, d));
    }
    let (t, raw) = (data_type(dtype), stream.raw.cu_stream() as sys::cudaStream_t);
    let sum = sys::ncclRedOp_t::ncclSum;
    let grouped = parts.len() > 1;
    // Each call's result, in order. The data twin is blocking (NCCL_COMM_BLOCKING, which could
    // change that, is refused at init): a call that returns has launched its work.
    let issued = comm.0.data.with(|c| {
        let mut results = Vec::with_capacity(parts.len() + 2);
        if grouped {
            results.push(("ncclGroupStart", result::group_start()));
        }
        for (p, s, d) in pointers {
            let count = p.count;
            // SAFETY: the pointers are bounds-checked views of live device memory that the
            // stream's ordering (and, in a capture, the graph's holdings) keeps alive until the
            // operation ran.
            let done = unsafe {
                match p.kind {
                    Collective::AllReduce => result::all_reduce(s, d, count, t, sum, c, raw),
                    Collective::AllReduceAmax => result::all_reduce(s, d, count, t, sys::ncclRedOp_t::ncclMax, c, raw),
                    Collective::ReduceScatter => result::reduce_scatter(s, d, count, t, sum, c, raw),
                    Collective::AllGather => result::all_gather(s, d, count, t, c, raw),
                    Collective::Send(peer) => result::send(s, count, t, peer as i32, c, raw),
                    Collective::Recv(peer) => result::recv(d, count, t, peer as i32, c, raw),
                }
            };
            let failed = done.is_err();
            results.push((p.kind.name(), done));
            if failed {
                break;
            }
        }
        // A started group is always ended, so that NCCL's per-thread group state stays balanced.
        if grouped {
            results.push(("ncclGroupEnd", result::group_end()));
        }
        results
    });
    for (call, done) in issued.map_err(fail)? {
        done.map_err(|e| fail(nccl(call, e)))?;
    }
    Ok(())
}
