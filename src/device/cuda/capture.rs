//! The captures graphed has begun, process-wide: what each keeps alive, and the frees that wait
//! for them.
//!
//! A captured graph refers to buffers and events by address, and the user may drop their handles
//! before the graph's last launch. So while a stream captures, every buffer and external event an
//! enqueued operation names is held by its capture, and `end_capture` hands the [`Holdings`] to
//! the graph. Freeing memory (`cuMemFree`, `cuMemFreeHost`) is a synchronous call that global and
//! thread-local captures forbid, and trying it would invalidate them; so while any capture is
//! active, frees are deferred, and run when the last capture ends (or at the next allocation or
//! device synchronize, if none is active then).
//!
//! The registry is process-wide because both facts are: capture ids are unique per process, and a
//! global-mode capture forbids synchronous calls on every thread and context. Its lock also orders
//! frees against `begin_capture`, so a free never lands inside a capture that began meanwhile.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

use cudarc::driver::{sys, CudaStream, DriverError};

use super::error as err;
use super::ffi::{self, OwnedGraph, CAPTURE_ACTIVE, CAPTURE_INVALIDATED, CAPTURE_NONE};
use super::graph::PatchNode;
use super::memory::Alloc;
use super::stream::{CuStream, EventInner};
use crate::device::backend::Op;
use crate::device::kernel::Arg;
use crate::device::memory::Block;
use crate::device::patch::Site;
use crate::device::{BufferId, CaptureMode, CaptureStatus, EventId, StreamId};
use crate::error::{CaptureErrorKind, CaptureSite};
use crate::{Error, Result};

/// What a captured graph keeps alive: the buffers and events its nodes name. (CUDA 13.0 refuses
/// to launch a graph into a capture, so graphs never hold other graphs.)
#[derive(Default)]
pub(super) struct Holdings {
    buffers: HashMap<BufferId, Arc<Block>>,
    events: HashMap<EventId, Arc<EventInner>>,
    /// The communicators of captured collectives.
    comms: Vec<Arc<super::nccl::NcclInner>>,
    /// How each captured operation's node names buffers, in capture order, and the node where
    /// graphed can patch it.
    pub(super) sites: Vec<Site>,
    pub(super) nodes: Vec<Option<PatchNode>>,
}

impl Holdings {
    fn add_buffer(&mut self, block: &Arc<Block>) {
        self.buffers.entry(block.id).or_insert_with(|| block.clone());
    }

    fn add_op(&mut self, op: &Op<'_>) {
        match op {
            Op::Kernel { args, .. } | Op::Gemm { args, .. } | Op::Sdpa { args, .. } => {
                for arg in args.iter() {
                    if let Arg::Buf(b) = arg {
                        self.add_buffer(b.block);
                    }
                }
            }
            Op::Copy { src, dst, .. } => {
                self.add_buffer(src);
                self.add_buffer(dst);
            }
            Op::Memset { dst, .. } => self.add_buffer(dst),
            Op::Collective { comm, parts, .. } => {
                for p in parts.iter() {
                    self.add_buffer(p.src.0);
                    self.add_buffer(p.dst.0);
                }
                if let crate::device::backend::Repr::Cuda(c) = comm {
                    if !self.comms.iter().any(|held| Arc::ptr_eq(held, c.inner())) {
                        self.comms.push(c.inner().clone());
                    }
                }
            }
        }
    }

    /// The rank of a held communicator that was aborted, if any (see
    /// [`aborted_among`](super::nccl::aborted_among)).
    pub(super) fn aborted_comm(&self) -> Option<usize> {
        super::nccl::aborted_among(&self.comms)
    }

    /// The id of a held event, by its driver handle (as graph nodes report it).
    pub(super) fn event_id(&self, raw: sys::CUevent) -> Option<EventId> {
        self.events.values().find(|e| e.raw.cu_event() == raw).map(|e| e.id)
    }
}

/// Who began a capture, for error sites and for ending it if its stream is dropped.
#[derive(Clone, Copy)]
struct Began {
    origin: StreamId,
    mode: CaptureMode,
    thread: ThreadId,
}

struct Live {
    id: u64,
    /// `None` for a capture graphed did not begin but whose streams it was asked to use; its
    /// holdings then live as long as the process, since graphed cannot see it end.
    began: Option<Began>,
    held: Holdings,
}

struct State {
    captures: Vec<Live>,
    deferred: Vec<Alloc>,
}

struct Registry {
    /// Captures begun and not yet ended; read without the lock by every enqueue.
    active: AtomicUsize,
    state: Mutex<State>,
}

static REGISTRY: Registry =
    Registry { active: AtomicUsize::new(0), state: Mutex::new(State { captures: Vec::new(), deferred: Vec::new() }) };

fn lock() -> MutexGuard<'static, State> {
    // The state stays consistent across a panic in another thread (each update is one push or
    // remove), so keep using it.
    REGISTRY.state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether any capture graphed began is still active, on any thread: synchronous calls (an
/// allocation, an event wait) could then invalidate it.
fn any_active() -> bool {
    REGISTRY.active.load(Ordering::SeqCst) > 0
}

/// How many captures graphed has begun and not yet seen end.
#[cfg(test)]
pub(super) fn active_count() -> usize {
    REGISTRY.active.load(Ordering::SeqCst)
}

/// The id of the active capture `stream` takes part in, if any. Costs one driver query, and only
/// while some capture is active; otherwise nothing.
pub(super) fn active_id(stream: &CudaStream) -> Result<Option<u64>, DriverError> {
    if !any_active() {
        return Ok(None);
    }
    let info = ffi::capture_info(stream)?;
    Ok((info.status == CAPTURE_ACTIVE).then_some(info.id))
}

/// Runs `f` with this thread in relaxed capture-interaction mode (`cuThreadExchangeStreamCaptureMode`),
/// then restores the previous mode: synchronous calls in `f` neither fail nor invalidate a capture.
pub(super) fn relaxed<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    const OP: &str = "relaxed capture mode";
    let previous = ffi::exchange_capture_mode(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .map_err(|e| err::driver(OP, None, e))?;
    let out = f();
    ffi::exchange_capture_mode(previous).map_err(|e| err::driver(OP, None, e))?;
    out
}

/// Whether a captured operation's node can be patched.
pub(super) enum Patchable {
    /// At this node.
    At(PatchNode),
    /// Not by graphed's design: its site says why a rebind of what it names is refused.
    Never,
    /// It should be, but its node was not found: every use counts as opaque.
    Unknown,
}

/// Holds everything `op` names for as long as capture `id`'s graph lives, and notes how its
/// node names buffers and where it can be patched.
pub(super) fn hold_op(id: u64, op: &Op<'_>, patchable: Patchable) {
    let (site, node) = match patchable {
        Patchable::At(node) => (Site::of(op), Some(node)),
        Patchable::Never => (Site::of(op), None),
        Patchable::Unknown => (Site::of(op).opaque(), None),
    };
    with_holdings(id, |h| {
        h.add_op(op);
        h.sites.push(site);
        h.nodes.push(node);
    });
}

/// Holds an event recorded or waited on with the external flag (it is named by a node).
pub(super) fn hold_event(id: u64, event: &Arc<EventInner>) {
    with_holdings(id, |h| {
        h.events.entry(event.id).or_insert_with(|| event.clone());
    });
}

fn with_holdings(id: u64, add: impl FnOnce(&mut Holdings)) {
    let mut st = lock();
    let pos = match st.captures.iter().position(|c| c.id == id) {
        Some(pos) => pos,
        None => {
            st.captures.push(Live { id, began: None, held: Holdings::default() });
            st.captures.len() - 1
        }
    };
    add(&mut st.captures[pos].held);
}

fn cu_mode(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    match mode {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

/// `cuStreamBeginCapture_v2`, registering the capture.
pub(super) fn begin(stream: &CuStream, mode: CaptureMode) -> Result<()> {
    const OP: &str = "begin_capture";
    let on = CaptureSite::Stream(stream.id);
    let mut st = lock();
    stream.raw.begin_capture(cu_mode(mode)).map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_ILLEGAL_STATE => {
            Error::Capture { op: OP, on, kind: CaptureErrorKind::AlreadyCapturing }
        }
        _ => err::at(OP, on, e),
    })?;
    let info = match ffi::capture_info(&stream.raw) {
        Ok(info) => info,
        Err(e) => {
            // An unregistered capture would hold nothing; end it rather than let it run.
            drop(ffi::end_capture(&stream.raw, stream.raw.context(), &stream.errors));
            return Err(err::at(OP, on, e));
        }
    };
    let began = Began { origin: stream.id, mode, thread: std::thread::current().id() };
    st.captures.push(Live { id: info.id, began: Some(began), held: Holdings::default() });
    REGISTRY.active.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// `cuStreamEndCapture`: the graph and what it must keep alive.
///
/// A failed end may or may not end the capture (on CUDA 13.0 an invalidated or unjoined capture
/// ends, and so does one ended from the wrong thread); the driver is asked, and the holdings are
/// released only once the capture is over.
pub(super) fn end(stream: &CuStream) -> Result<(OwnedGraph, Holdings)> {
    const OP: &str = "end_capture";
    let on = CaptureSite::Stream(stream.id);
    let info = ffi::capture_info(&stream.raw).map_err(|e| err::at(OP, on, e))?;
    if info.status == CAPTURE_NONE {
        return Err(Error::Capture { op: OP, on, kind: CaptureErrorKind::Unmatched });
    }
    let ended = ffi::end_capture(&stream.raw, stream.raw.context(), &stream.errors);
    // If the capture cannot be queried after a failed end, keep its holdings: a leak is safe, a
    // graph whose buffers were freed is not.
    let over = ended.is_ok()
        || ffi::capture_info(&stream.raw).is_ok_and(|now| now.status == CAPTURE_NONE || now.id != info.id);
    let held = if over { finish(info.id) } else { Holdings::default() };
    match ended {
        Ok(graph) => Ok((graph, held)),
        Err(e) => Err(err::at(OP, on, e)),
    }
}

/// Forgets an ended capture and returns its holdings (dropped by the caller, outside the lock);
/// if it was the last active capture, runs the frees it deferred.
fn finish(id: u64) -> Holdings {
    let mut st = lock();
    let Some(pos) = st.captures.iter().position(|c| c.id == id) else {
        return Holdings::default();
    };
    let live = st.captures.swap_remove(pos);
    if live.began.is_some() {
        REGISTRY.active.fetch_sub(1, Ordering::SeqCst);
    }
    free_deferred(&mut st);
    live.held
}

/// Ends the capture that `stream` began, if it is still capturing when the stream is dropped, so
/// that the registry never waits for a capture no one can end. Errors are kept for the device's
/// next call.
pub(super) fn abandon(stream: &CuStream) {
    if !any_active() {
        return;
    }
    let Ok(info) = ffi::capture_info(&stream.raw) else { return };
    let began_here = info.status != CAPTURE_NONE
        && lock().captures.iter().any(|c| c.id == info.id && c.began.is_some_and(|b| b.origin == stream.id));
    if began_here {
        const DURING: &str = "a capturing stream";
        let ctx = stream.raw.context();
        if let Err(e) = ctx.bind_to_thread() {
            stream.errors.record(DURING, err::driver("cuCtxSetCurrent", None, e));
        }
        match ffi::end_capture(&stream.raw, ctx, &stream.errors) {
            // The graph is discarded, so a capture rule it broke concerns no one.
            Err(e) if err::capture_kind(e.0).is_none() => {
                stream.errors.record(DURING, err::at("end_capture", CaptureSite::Stream(stream.id), e));
            }
            _ => {}
        }
        drop(finish(info.id));
    }
}

/// The state of `stream`'s capture.
pub(super) fn status(stream: &CuStream) -> Result<CaptureStatus> {
    const OP: &str = "capture_status";
    let info = ffi::capture_info(&stream.raw).map_err(|e| err::at(OP, CaptureSite::Stream(stream.id), e))?;
    match info.status {
        CAPTURE_NONE => Ok(CaptureStatus::None),
        CAPTURE_ACTIVE => Ok(CaptureStatus::Active),
        CAPTURE_INVALIDATED => Ok(CaptureStatus::Invalidated),
        other => Err(Error::Cuda {
            op: OP,
            message: format!("the driver reported capture status {other}, unknown to graphed"),
        }),
    }
}

/// Where to report a synchronous call (allocation, device synchronize, blocking copy) that a
/// capture refused: the origin stream of a capture that forbids it on this thread, else of any
/// capture graphed began.
pub(super) fn forbidding_site() -> Option<CaptureSite> {
    let me = std::thread::current().id();
    let st = lock();
    let began = || st.captures.iter().filter_map(|c| c.began);
    began()
        .find(|b| match b.mode {
            CaptureMode::Global => true,
            CaptureMode::ThreadLocal => b.thread == me,
            CaptureMode::Relaxed => false,
        })
        .or_else(|| began().next())
        .map(|b| CaptureSite::Stream(b.origin))
}

/// Frees `alloc` now, or when the last active capture ends.
pub(super) fn free_or_defer(alloc: Alloc) {
    let mut st = lock();
    if any_active() {
        st.deferred.push(alloc);
    } else {
        alloc.free();
    }
}

/// Runs the deferred frees if no capture is active (at allocation and device synchronize).
pub(super) fn flush_deferred() {
    free_deferred(&mut lock());
}

fn free_deferred(st: &mut State) {
    if !any_active() {
        for alloc in st.deferred.drain(..) {
            alloc.free();
        }
    }
}
