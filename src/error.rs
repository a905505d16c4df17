//! The one error type of graphed. Every variant says when it occurs; `Display` ends with the fix.

use crate::device::{BufferId, DeviceId, EventId, GraphId, StreamId};

/// Result alias used throughout graphed.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in graphed, grouped by layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- device ---------------------------------------------------------------------------------
    /// CUDA was asked for but the driver, a GPU or a library is missing.
    #[error("CUDA is not available: {reason}. Use Device::sim() (or Device::auto()) to run on the simulator")]
    CudaUnavailable {
        /// What was missing.
        reason: String,
    },

    /// A stream, event, buffer or graph of one device was passed to another device.
    /// A graphed call returns it wrapped, as
    /// [`GraphedErrorKind::Refused`](crate::graph::GraphedErrorKind::Refused).
    #[error("{op}: the {what} belongs to device {found} but the operation runs on device {expected}; create it from the same Device")]
    WrongDevice {
        /// The operation that was called.
        op: &'static str,
        /// Which argument was foreign ("stream", "event", "buffer", "graph").
        what: &'static str,
        /// The device the operation runs on.
        expected: DeviceId,
        /// The device the argument came from.
        found: DeviceId,
    },

    /// A drop failed (a `Drop` cannot return an error), and the device kept the error for its
    /// next fallible call, which returns it instead of doing its work. Returned once; also
    /// available earlier from [`Device::take_error`](crate::device::Device::take_error).
    #[error("dropping {during} failed: {error}{}; the device kept this error and returned it from its next call, which did nothing: handle it, then repeat that call", later_drops(*more))]
    Deferred {
        /// What was being dropped ("a graph executable", "a device buffer", ...).
        during: &'static str,
        /// The error of the drop.
        error: Box<Error>,
        /// How many more drops failed while this error was kept (only the first is kept).
        more: usize,
    },

    /// The backend cannot do this (or no backend can: a limit of the operation itself).
    #[error("{op} is not supported{}: {why}", on_backend(backend))]
    Unsupported {
        /// The operation that was called.
        op: &'static str,
        /// "cuda" or "sim", or "any" for a limit of every backend.
        backend: &'static str,
        /// Why, and what to do instead.
        why: &'static str,
    },

    /// A CUDA driver, NVRTC or library call failed with a code graphed has no better kind for.
    #[error("CUDA call {op} failed: {message}")]
    Cuda {
        /// The operation that was called.
        op: &'static str,
        /// The driver's name and description of the code.
        message: String,
    },

    /// A cuDNN call failed (fused attention on the cuDNN backend).
    #[error("{op}: cuDNN call {call} failed: {message}; run attention on graphed's own kernels (AttentionBackend::Kernels, `--attention-backend kernels`) and report the cuDNN version, the shape and this message")]
    Cudnn {
        /// The operation that was called.
        op: &'static str,
        /// The cuDNN function that failed.
        call: &'static str,
        /// cuDNN's status and its last error message.
        message: String,
    },

    /// The cuDNN attention backend was asked for (AttentionBackend::Cudnn) where it cannot run:
    /// the simulator, no cuDNN library, or a call cuDNN does not support. Refused before
    /// anything is enqueued.
    #[error("{op}: the cuDNN attention backend cannot run this call: {why}; use AttentionBackend::Auto (`--attention-backend auto`), which falls back to graphed's own kernels, or AttentionBackend::Kernels")]
    CudnnUnavailable {
        /// The operation that was called.
        op: &'static str,
        /// Why.
        why: String,
    },

    // ---- memory and graph pools -----------------------------------------------------------------
    /// The device has not enough free memory for an allocation (on CUDA, CUDA_ERROR_OUT_OF_MEMORY;
    /// on the simulator, its configured memory size or the host's memory).
    #[error("{op}: out of device memory: {requested} bytes asked for {what}, {} free of {}; reduce the batch, the sequence length, the width or the layers, or free cached memory (CachingAllocator::empty_cache)", bytes(*free), bytes(*total))]
    OutOfMemory {
        /// The operation that was called.
        op: &'static str,
        /// Bytes asked for.
        requested: usize,
        /// What the bytes were for.
        what: &'static str,
        /// Free bytes on the device when it failed, if known.
        free: Option<usize>,
        /// The device's memory, if known.
        total: Option<usize>,
    },

    /// An operation touched bytes of expandable device memory that are not mapped: the
    /// allocator gave them back to the device while work or a graph still used them (on CUDA,
    /// an illegal address; the simulator reports it).
    #[error("{op}: bytes [{start}, {end}) of an expandable allocation are not mapped (its first {mapped} are); memory was given back while something still used it: keep the buffers and the graphs that use a pool alive while they may run, and empty the cache only when they are done")]
    Unmapped {
        /// The operation that touched the memory.
        op: &'static str,
        /// First byte touched, from the start of the allocation.
        start: usize,
        /// One past the last byte touched.
        end: usize,
        /// Bytes mapped when it happened.
        mapped: usize,
    },

    /// A graph pool was used with an allocator other than the one that made it (pools of
    /// different allocators may even share an id).
    /// A graphed call returns it wrapped, as
    /// [`GraphedErrorKind::Refused`](crate::graph::GraphedErrorKind::Refused).
    #[error("{op}: {pool} was made by another CachingAllocator; capture with the allocator that made the pool, or make a pool with this allocator's new_pool()")]
    ForeignPool {
        /// The operation that was called.
        op: &'static str,
        /// The pool.
        pool: crate::memory::PoolId,
    },

    /// An allocation on a capturing stream whose capture was not begun by the allocator, so it
    /// has no pool to come from.
    #[error("{op}: stream {stream} is capturing, but not through CachingAllocator::capture; begin the capture with the allocator (and a pool) or allocate before it")]
    NoCapturePool {
        /// The operation that was called.
        op: &'static str,
        /// The capturing stream.
        stream: StreamId,
    },

    /// A graph of a shared pool was replayed out of the pool's capture order (replay contract
    /// R5): graphs that share a pool reuse each other's memory, so only that order is safe.
    /// A graphed call returns it wrapped, as
    /// [`GraphedErrorKind::Refused`](crate::graph::GraphedErrorKind::Refused).
    #[error("graph {} of {pool} replayed out of capture order: the next graph of the pool is {}; replay the pool's graphs in the order they were captured (cyclically)", named(*graph, graph_name), named(*expected, expected_name))]
    PoolOrder {
        /// The pool.
        pool: crate::memory::PoolId,
        /// The graph whose replay was refused.
        graph: GraphId,
        /// Its name in the pool (the graph layer names a graph by module and pass), if any.
        graph_name: Option<String>,
        /// The graph that must come next.
        expected: GraphId,
        /// Its name in the pool, if any.
        expected_name: Option<String>,
    },

    /// A graph of a shared pool was replayed on another stream than the pool's previous replay
    /// with no ordering between them that graphed has seen (R5: no concurrent replays).
    /// A graphed call returns it wrapped, as
    /// [`GraphedErrorKind::Refused`](crate::graph::GraphedErrorKind::Refused).
    #[error("graph {} of {pool} replayed on stream {stream} while {} of the same pool was last replayed on stream {previous_stream}; replay on {previous_stream}, or call GraphPool::join({stream}) first", named(*graph, graph_name), named(*previous, previous_name))]
    PoolConcurrent {
        /// The pool.
        pool: crate::memory::PoolId,
        /// The graph whose replay was refused.
        graph: GraphId,
        /// Its name in the pool, if any.
        graph_name: Option<String>,
        /// Its stream.
        stream: StreamId,
        /// The pool's previous replay.
        previous: GraphId,
        /// Its name in the pool, if any.
        previous_name: Option<String>,
        /// Its stream.
        previous_stream: StreamId,
    },

    // ---- capture and graphs ---------------------------------------------------------------------
    /// A stream-capture rule was broken; `kind` says which. The same kind is returned on CUDA and
    /// on the simulator.
    #[error("{op} on {on}: {kind}; {}", kind.fix())]
    Capture {
        /// The operation that was called.
        op: &'static str,
        /// The stream (or, for event queries, the event) the operation was called on.
        on: CaptureSite,
        /// Which rule.
        kind: CaptureErrorKind,
    },

    /// A graph executable was used after `reset()`.
    #[error("{op}: this graph was reset and holds no executable; capture a new graph")]
    GraphReset {
        /// The operation that was called.
        op: &'static str,
    },

    /// [`GraphExec::rebind`](crate::device::GraphExec::rebind) was refused, before anything
    /// changed; `kind` says why.
    #[error("rebinding graph {graph}: {kind}; {}", kind.fix())]
    Rebind {
        /// The graph.
        graph: crate::device::GraphId,
        /// Why.
        kind: crate::device::RebindErrorKind,
    },

    /// A captured graph contains stream-ordered allocation or free nodes (`cudaMallocAsync`
    /// inside the capture, by code other than graphed). graphed refuses such graphs: their memory
    /// lives in the driver's graph pool and binds replays to one stream.
    #[error("the captured graph has {count} memory allocation/free nodes; allocate with graphed's allocator (or before the capture) instead of stream-ordered allocation inside it")]
    MemoryNodes {
        /// How many such nodes.
        count: usize,
    },

    // ---- profiles -------------------------------------------------------------------------------
    /// [`Stream::profile`](crate::device::Stream::profile) was refused; `kind` says why.
    #[error("Stream::profile on stream {stream}: {kind}; {}", kind.fix())]
    Profile {
        /// The stream that was to be profiled.
        stream: StreamId,
        /// Why not.
        kind: ProfileErrorKind,
    },

    // ---- tensors and arguments ------------------------------------------------------------------
    /// An access reaches outside the buffer it names.
    #[error("{op}: region [{start}, {end}) elements is outside buffer {buffer} of {len} elements; use a smaller view")]
    OutOfBounds {
        /// The operation that was called.
        op: &'static str,
        /// The buffer.
        buffer: BufferId,
        /// First element touched.
        start: usize,
        /// One past the last element touched.
        end: usize,
        /// Length of the buffer in elements.
        len: usize,
    },

    /// A tensor has the wrong shape for the operation.
    #[error("{op}: expected {expected}, found shape {found:?}; pass a tensor of the expected shape")]
    Shape {
        /// The operation that was called.
        op: &'static str,
        /// What the operation needs.
        expected: String,
        /// The shape passed.
        found: Vec<usize>,
    },

    /// Tensors of different element types met where one type is needed (an operation's
    /// operands, a copy, a typed read).
    #[error(
        "{op}: expected a tensor of {expected}, found {found}; pass {expected} operands (ops::cast::cast converts)"
    )]
    DTypeMismatch {
        /// The operation that was called.
        op: &'static str,
        /// The element type the operation needs here.
        expected: crate::device::DType,
        /// The element type passed.
        found: crate::device::DType,
    },

    /// An operation (a kernel, a GEMM, a module) was called with an element type it has no
    /// implementation for.
    #[error("{op} does not support {dtype}: it takes {supported}; cast the tensor to one of those")]
    UnsupportedDType {
        /// The operation that was called.
        op: &'static str,
        /// The element type passed.
        dtype: crate::device::DType,
        /// The element types it supports, for the message ("f32 or bf16").
        supported: &'static str,
    },

    /// Two views that must have the same length do not.
    #[error("{op}: source has {src} elements but destination has {dst}; pass views of equal length")]
    LengthMismatch {
        /// The operation that was called.
        op: &'static str,
        /// Source length.
        src: usize,
        /// Destination length.
        dst: usize,
    },

    /// The operation needs a contiguous view.
    #[error("{op}: needs a contiguous view of buffer {buffer}; copy strided data with a kernel")]
    NotContiguous {
        /// The operation that was called.
        op: &'static str,
        /// The buffer.
        buffer: BufferId,
    },

    // ---- kernels --------------------------------------------------------------------------------
    /// A kernel's CPU path asked for an argument that its launch did not pass in that form.
    #[error("kernel {kernel}: argument `{param}` is {found}, but the CPU path reads it as {expected}; fix the launch's argument list")]
    KernelArg {
        /// Kernel name.
        kernel: &'static str,
        /// The parameter's name.
        param: String,
        /// What the CPU path expected.
        expected: String,
        /// What was passed.
        found: String,
    },

    /// A kernel's CPU path asked for a parameter that the kernel does not have.
    #[error("kernel {kernel}: the CPU path reads parameter `{param}`, but the kernel's parameters are {known:?}; fix the CPU path or `Kernel::params`")]
    UnknownKernelParam {
        /// Kernel name.
        kernel: &'static str,
        /// The name the CPU path asked for.
        param: String,
        /// The kernel's parameters.
        known: &'static [&'static str],
    },

    /// A launch passed a different number of arguments than the kernel has parameters; refused
    /// before anything is enqueued.
    #[error("kernel {kernel}: the launch passes {found} arguments for its {} parameters {params:?}", .params.len())]
    KernelArgCount {
        /// Kernel name.
        kernel: &'static str,
        /// The kernel's parameters.
        params: &'static [&'static str],
        /// The number of arguments passed.
        found: usize,
    },

    /// A kernel failed while running (on the simulator: its CPU path returned an error). Like a
    /// CUDA launch failure it is reported by the next call that synchronizes.
    #[error("kernel {kernel} failed while running: {message}")]
    KernelFailed {
        /// Kernel name.
        kernel: &'static str,
        /// What the kernel reported.
        message: String,
    },

    /// A kernel failed to compile; `log` is the compiler's log.
    #[error("kernel module {module} failed to compile for {arch}:\n{log}")]
    Compile {
        /// The module (first kernel name of the source).
        module: String,
        /// The target architecture.
        arch: String,
        /// NVRTC's log.
        log: String,
    },

    // ---- modules --------------------------------------------------------------------------------
    /// A model configuration the kernels cannot run ([`GptConfig::validate`](crate::nn::GptConfig::validate)).
    #[error("model configuration: {0}")]
    Config(crate::nn::ConfigLimit),

    /// A call on a pipeline stage's part of a model ([`Gpt::part`](crate::nn::Gpt::part)) that
    /// needs a module the part does not hold.
    #[error("{op}: this part of the model does not hold {module}; call it on the pipeline stage that does (the first holds the embedding, the last the final LayerNorm and the head)")]
    NotInPart {
        /// The call.
        op: &'static str,
        /// The module it needs.
        module: &'static str,
    },

    /// An FP8 scaling recipe was refused at construction; the kind says why.
    #[error("FP8 scaling configuration: {0}")]
    Scaling(crate::ops::fp8::ScalingConfigError),

    /// A module was called with inputs it does not take (counted as positional and named).
    #[error("{op}: takes {expected}, but was given {positional} positional and {named} named inputs; pass the inputs it takes")]
    InputArity {
        /// The module's operation.
        op: &'static str,
        /// What it takes.
        expected: &'static str,
        /// Positional inputs given.
        positional: usize,
        /// Named inputs given.
        named: usize,
    },

    /// A module needs a named input that the call did not pass.
    #[error("{op}: needs the named input `{name}`; pass it with Inputs::named or Inputs::constant")]
    MissingInput {
        /// The module's operation.
        op: &'static str,
        /// The missing name.
        name: String,
    },

    /// A module's backward gave no gradient where the caller needs one (a stack feeds each
    /// layer's input gradient to the layer before it).
    #[error("{op}: {what} has no gradient; a module in a stack must return its input's gradient")]
    MissingGradient {
        /// The operation that needed it.
        op: &'static str,
        /// Which gradient.
        what: String,
    },

    // ---- graphed callables ----------------------------------------------------------------------
    /// A graphed callable refused a call, or `make_graphed_callables` refused its arguments or a
    /// capture; `kind` says why and what to do. Where a layer below refused (a graph pool's
    /// order, a stream of another device), `kind` is
    /// [`GraphedErrorKind::Refused`](crate::graph::GraphedErrorKind::Refused) holding that error
    /// ([`Error::refused_by`]).
    #[error("graphed callable {callable}: {kind}")]
    Graphed {
        /// The callable (its name and index), or "make_graphed_callables" for the call as a whole.
        callable: String,
        /// What went wrong.
        kind: crate::graph::GraphedErrorKind,
    },

    // ---- schedules ------------------------------------------------------------------------------
    /// A pipeline schedule is inconsistent; `kind` says where and what to do.
    #[error("pipeline schedule: {0}")]
    Schedule(crate::nn::ScheduleErrorKind),

    // ---- offload --------------------------------------------------------------------------------
    /// The activation offload manager refused a call or a schedule; `kind` says why and what to
    /// do.
    #[error("activation offloading: {0}")]
    Offload(crate::offload::OffloadErrorKind),

    // ---- distributed ----------------------------------------------------------------------------
    /// A collective or a process group failed; `kind` says which rank and what.
    #[error("{op} on rank {rank}: {kind}")]
    Comm {
        /// The operation.
        op: &'static str,
        /// The rank that reports it.
        rank: usize,
        /// What went wrong.
        kind: crate::device::CommErrorKind,
    },

    // ---- checkpoints ----------------------------------------------------------------------------
    /// A checkpoint file could not be saved, read or used; `kind` says what and what to do.
    #[error("checkpoint {path}: {kind}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What is wrong.
        kind: crate::checkpoint::CheckpointErrorKind,
    },

    // ---- training -------------------------------------------------------------------------------
    /// An optimizer found a non-finite (infinite or NaN) gradient under
    /// [`NonFinite::Stop`](crate::optim::NonFinite::Stop): it updated nothing from that step on,
    /// so the parameters and its state are those after step `step − 1`.
    #[error("a non-finite gradient at optimizer step {step} (first in `{param}`); the update of that step and of the {} later step(s) was skipped, so the parameters are those after step {}: do not save them over a good checkpoint; lower the learning rate (or find the bad input) and resume from the last checkpoint, or build the optimizer with NonFinite::Skip to skip such steps", skipped.saturating_sub(1), step.saturating_sub(1))]
    NonFinite {
        /// The first step (the optimizer's 1-based step counter) with a non-finite gradient.
        step: u64,
        /// The parameter holding that step's first non-finite gradient (its name in the store),
        /// or `element N` of the flat buffer if no parameter holds it.
        param: String,
        /// Updates skipped so far: the step and every later one.
        skipped: u64,
    },

    // ---- checker --------------------------------------------------------------------------------
    /// In strict mode, the checker found a hazard in this call (its work was enqueued).
    #[error("hazard: {0}")]
    Hazard(Box<crate::check::Hazard>),
}

/// " on the cuda device", or nothing for a limit of every backend (`"any"`).
fn on_backend(backend: &str) -> String {
    if backend == "any" {
        String::new()
    } else {
        format!(" on the {backend} device")
    }
}

/// The note on the drop errors that came after a kept one.
fn later_drops(more: usize) -> String {
    match more {
        0 => String::new(),
        1 => " (1 later drop failed too; its error was not kept)".into(),
        n => format!(" ({n} later drops failed too; their errors were not kept)"),
    }
}

/// A graph for messages: its id, and its name in its pool if it has one.
fn named(graph: GraphId, name: &Option<String>) -> String {
    match name {
        Some(n) => format!("{graph} ({n})"),
        None => graph.to_string(),
    }
}

/// A byte count for messages, `"unknown"` when there is none.
fn bytes(n: Option<usize>) -> String {
    match n {
        Some(n) => format!("{n} bytes ({:.2} GiB)", n as f64 / (1u64 << 30) as f64),
        None => "an unknown number of bytes".into(),
    }
}

/// The object a capture error was raised on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureSite {
    /// A stream.
    Stream(StreamId),
    /// An event.
    Event(EventId),
}

impl std::fmt::Display for CaptureSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CaptureSite::Stream(s) => write!(f, "stream {s}"),
            CaptureSite::Event(e) => write!(f, "event {e}"),
        }
    }
}

/// Which stream-capture rule was broken. Mirrors CUDA's capture error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureErrorKind {
    /// The call is not permitted while a capture is active (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED):
    /// synchronizing a capturing stream, or a synchronous call (synchronize or query, blocking
    /// copy, plain allocation) that the capture mode forbids. It invalidates the capture.
    #[error("operation not permitted while capturing")]
    Unsupported,
    /// The capture was invalidated by an earlier error (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED).
    #[error("the capture was invalidated by an earlier error")]
    Invalidated,
    /// A capturing stream waited on an event recorded outside the capture
    /// (CUDA_ERROR_STREAM_CAPTURE_ISOLATION). It invalidates the capture.
    #[error("wait on an event recorded outside the capture")]
    Isolation,
    /// A stream forked into the capture was not joined back before `end_capture`
    /// (CUDA_ERROR_STREAM_CAPTURE_UNJOINED).
    #[error("a stream forked into the capture was not joined back")]
    Unjoined,
    /// `end_capture` on a stream that did not begin the capture (CUDA_ERROR_STREAM_CAPTURE_UNMATCHED).
    #[error("this stream did not begin the capture")]
    Unmatched,
    /// A wait would merge two separate captures (CUDA_ERROR_STREAM_CAPTURE_MERGE).
    #[error("the wait would merge two captures")]
    Merge,
    /// `end_capture` from another thread than `begin_capture` in global or thread-local mode
    /// (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD).
    #[error("the capture was begun on another thread")]
    WrongThread,
    /// Query or synchronize of an event last recorded inside a capture (CUDA_ERROR_CAPTURED_EVENT).
    #[error("the event was last recorded inside a capture")]
    CapturedEvent,
    /// `begin_capture` on a stream that is already capturing (CUDA_ERROR_ILLEGAL_STATE).
    #[error("the stream is already capturing")]
    AlreadyCapturing,
    /// `record_external` or `wait_external` on a stream that is not capturing: the external flag
    /// is only defined during capture, where it makes an event node (measured on the H200:
    /// CUDA_ERROR_ILLEGAL_STATE).
    #[error("an external event record or wait outside a capture")]
    ExternalOutsideCapture,
    /// A wait, query or synchronize of an event last recorded (plainly) inside a capture that has
    /// ended: the record stands for no work anyone can wait for (measured on the H200:
    /// CUDA_ERROR_INVALID_VALUE, and a capturing stream's wait invalidates its capture).
    #[error("the event was last recorded inside a capture that has ended")]
    RecordOfEndedCapture,
    /// `Stream::capture_off` on a stream that is not capturing: only captured work can start
    /// turned off.
    #[error("work to capture turned off, on a stream that is not capturing")]
    OffOutsideCapture,
}

/// Why a kernel profile could not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProfileErrorKind {
    /// The stream takes part in a capture: captured work runs only when its graph is launched,
    /// so there is nothing to time, and timing events recorded in a capture cannot be read.
    #[error("the stream is capturing")]
    Capturing,
    /// The stream is profiled already.
    #[error("the stream is already profiled")]
    Active,
}

impl ProfileErrorKind {
    /// What the caller should do about it.
    pub fn fix(self) -> &'static str {
        match self {
            Self::Capturing => "profile the eager work outside the capture, and time a graph's launch as a whole",
            Self::Active => "finish the active profile (or drop its guard) first",
        }
    }
}

impl CaptureErrorKind {
    /// What the caller should do about it.
    pub fn fix(self) -> &'static str {
        match self {
            Self::Unsupported => "do synchronous work (synchronize, query, blocking copies, allocation) before begin_capture or after end_capture, or capture in relaxed mode; legacy default streams cannot be captured, use Device::stream()",
            Self::Invalidated => "end the capture, fix the earlier error, and capture again",
            Self::Isolation => "make the stream wait on that event before begin_capture, or wait with wait_external to add an event-wait node",
            Self::Unjoined => "make the capture's origin stream wait on an event recorded on every forked stream after its last captured work",
            Self::Unmatched => "end the capture on the stream that began it",
            Self::Merge => "do not wait on an event recorded in another capture",
            Self::WrongThread => "end the capture on the thread that began it, or begin it in relaxed mode",
            Self::CapturedEvent => "query or synchronize the event only after end_capture and a launch of the graph",
            Self::AlreadyCapturing => "end the current capture first",
            Self::RecordOfEndedCapture => "record the event again outside a capture (or in a live one) before waiting on it; to wait for a graph's work, record after its launch or use an external record node",
            Self::ExternalOutsideCapture => "record or wait with Stream::record or Stream::wait outside a capture; inside graphed capture, the sync event is recorded by GraphOptions::sync_event, not by the module",
            Self::OffOutsideCapture => "call Stream::capture_off inside the capture whose graph should hold the work",
        }
    }
}

impl Error {
    /// What a graphed callable refused, if this is a graphed-callable error.
    pub fn graphed_kind(&self) -> Option<&crate::graph::GraphedErrorKind> {
        match self {
            Error::Graphed { kind, .. } => Some(kind),
            _ => None,
        }
    }

    /// The lower layer's error that a graphed call refused for
    /// ([`GraphedErrorKind::Refused`](crate::graph::GraphedErrorKind::Refused)), if this is such a
    /// refusal: a [`PoolOrder`](Error::PoolOrder), [`PoolConcurrent`](Error::PoolConcurrent),
    /// [`WrongDevice`](Error::WrongDevice) or [`ForeignPool`](Error::ForeignPool) error.
    pub fn refused_by(&self) -> Option<&Error> {
        match self.graphed_kind() {
            Some(crate::graph::GraphedErrorKind::Refused(e)) => Some(e),
            _ => None,
        }
    }

    /// What the offload manager refused, if this is an offload error.
    pub fn offload_kind(&self) -> Option<&crate::offload::OffloadErrorKind> {
        match self {
            Error::Offload(kind) => Some(kind),
            _ => None,
        }
    }

    /// The capture rule this error reports, if it is a capture error.
    pub fn capture_kind(&self) -> Option<CaptureErrorKind> {
        match self {
            Error::Capture { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsupported_operation_names_its_backend_unless_every_backend_refuses() {
        let on_cuda = Error::Unsupported { op: "op", backend: "cuda", why: "because" };
        assert_eq!(on_cuda.to_string(), "op is not supported on the cuda device: because");
        let anywhere = Error::Unsupported { op: "op", backend: "any", why: "because" };
        assert_eq!(anywhere.to_string(), "op is not supported: because");
    }
}
