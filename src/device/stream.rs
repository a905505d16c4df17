//! Streams: ordered queues of device work, and the verbs that enqueue on them.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use super::backend::{dispatch, CopyDir, Op, StreamRepr};
use super::capture::{Capture, CaptureMode, CaptureStatus};
use super::comm::GraphCollectives;
use super::gemm::{Fp8Gemm, Fp8Pair, Gemm, GemmElem, GemmSpec};
use super::kernel::{Arg, IntoView, Kernel, LaunchDims};
use super::memory::{access_of, Block};
use super::observe::{HostSync, Observer};
use super::profile::{declared_bytes, KernelTime, Pending, Profile};
use super::sdpa::{Sdpa, SdpaPlan, SdpaScratch, SdpaSpec};
use super::{AccessMode, Device, DeviceBuffer, Elem, Event, Float8, Graph, HostView, NodeKind, Region, StreamId};
use crate::{Error, ProfileErrorKind, Result};

/// Refuses an argument list that does not pass one argument per parameter: CUDA would read
/// past the list or misplace arguments, and the simulator's CPU path would read the wrong ones.
fn check_arity(kernel: &'static Kernel, args: &[Arg<'_>]) -> Result<()> {
    if args.len() != kernel.params.len() {
        return Err(Error::KernelArgCount { kernel: kernel.name, params: kernel.params, found: args.len() });
    }
    Ok(())
}

/// A non-blocking stream of one device. Cloning yields the same stream.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

struct StreamInner {
    dev: Device,
    id: StreamId,
    priority: i32,
    legacy: bool,
    repr: StreamRepr,
    /// The GEMM workspace of this stream, made at its first GEMM (cuBLASLt needs one per
    /// stream for reproducible results).
    workspace: OnceLock<DeviceBuffer<u8>>,
    /// The launches of the active kernel profile, if one is active (see [`Stream::profile`]).
    profile: Mutex<Option<Vec<Pending>>>,
}

impl Stream {
    pub(crate) fn new(dev: Device, id: StreamId, priority: i32, legacy: bool, repr: StreamRepr) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                dev,
                id,
                priority,
                legacy,
                repr,
                workspace: OnceLock::new(),
                profile: Mutex::new(None),
            }),
        }
    }

    /// The stream's identity.
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> &Device {
        &self.inner.dev
    }

    /// The priority it was created with.
    pub fn priority(&self) -> i32 {
        self.inner.priority
    }

    /// Whether this is the legacy default stream.
    pub fn is_legacy(&self) -> bool {
        self.inner.legacy
    }

    pub(crate) fn repr(&self) -> &StreamRepr {
        &self.inner.repr
    }

    fn check_buf(&self, op: &'static str, dev: super::DeviceId) -> Result<()> {
        self.inner.dev.check_same(op, "buffer", dev)
    }

    fn enqueue(&self, op: &Op<'_>) -> Result<()> {
        dispatch!(self.inner.dev.backend(), |b, pick| b.enqueue(pick!(self.inner.repr), op))
    }

    /// Enqueues an operation checked by its caller (a collective), after the device's kept
    /// errors.
    pub(crate) fn enqueue_op(&self, op: &Op<'_>) -> Result<()> {
        self.inner.dev.check_err()?;
        self.enqueue(op)
    }

    /// After an operation was enqueued: note the stream on the blocks it touches (stream-ordered
    /// reuse needs to know) and report its accesses to the checker.
    pub(crate) fn enqueued_on(
        &self,
        name: &'static str,
        blocks: &[&Arc<Block>],
        accesses: &[super::Access],
    ) -> Result<()> {
        for b in blocks {
            b.note_use(self.inner.id);
        }
        self.observe(|o, cap| o.enqueue(self.inner.id, cap, name, accesses))
    }

    /// Reports to the device's checker, if it has one, with the stream's capture.
    fn observe(&self, f: impl FnOnce(&dyn Observer, Option<u64>) -> Result<()>) -> Result<()> {
        match self.inner.dev.observer() {
            Some(o) if o.watching() => f(o.as_ref(), self.capture_id()?),
            _ => Ok(()),
        }
    }

    /// Runs `f`, whose operations this thread captures start turned off in every executable of
    /// the graph ([`GraphExec::set_enabled`](super::GraphExec::set_enabled) turns them on): work
    /// kept ready in a graph for when it is wanted, such as copies a replay may switch to.
    ///
    /// # Errors
    /// [`Error::Capture`] when this stream is not capturing; `f`'s own.
    pub fn capture_off<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.capture_id()?.is_none() {
            return Err(Error::Capture {
                op: "Stream::capture_off",
                on: crate::error::CaptureSite::Stream(self.inner.id),
                kind: crate::CaptureErrorKind::OffOutsideCapture,
            });
        }
        super::patch::capturing_off(f)
    }

    /// Enqueues a kernel. Its declared accesses are derived from `args` (see [`Kernel`]).
    ///
    /// # Errors
    /// [`Error::KernelArgCount`] unless `args` has one argument per [`Kernel::params`], a buffer
    /// of another device, a view outside its buffer, or a capture error.
    pub fn launch(&self, kernel: &'static Kernel, dims: LaunchDims, args: &[Arg<'_>]) -> Result<()> {
        self.launch_with_flops(kernel, dims, args, None)
    }

    /// As [`launch`](Stream::launch), declaring the floating-point operations the kernel
    /// executes, which a profile ([`Stream::profile`]) reports as its
    /// [`KernelTime::flops`](super::KernelTime::flops) for a TFLOP/s rate (GEMMs declare theirs
    /// themselves).
    ///
    /// # Errors
    /// As [`launch`](Stream::launch).
    pub fn launch_counting(
        &self,
        kernel: &'static Kernel,
        dims: LaunchDims,
        args: &[Arg<'_>],
        flops: u64,
    ) -> Result<()> {
        self.launch_with_flops(kernel, dims, args, Some(flops))
    }

    fn launch_with_flops(
        &self,
        kernel: &'static Kernel,
        dims: LaunchDims,
        args: &[Arg<'_>],
        flops: Option<u64>,
    ) -> Result<()> {
        self.inner.dev.check_err()?;
        self.check_args(kernel, args)?;
        self.enqueue_timed(&Op::Kernel { kernel, dims, args }, kernel.name, args, flops)?;
        self.enqueued(kernel.name, args)
    }

    /// Refuses, before anything is enqueued, arguments that do not fit `kernel`: the wrong count,
    /// a buffer of another device, a view outside its buffer, or a strided view for a kernel that
    /// reads contiguous ones.
    fn check_args(&self, kernel: &'static Kernel, args: &[Arg<'_>]) -> Result<()> {
        check_arity(kernel, args)?;
        for a in args {
            if let Arg::Buf(b) = a {
                self.check_buf(kernel.name, b.raw.device)?;
                if b.view.end() > b.buffer_len {
                    return Err(Error::OutOfBounds {
                        op: kernel.name,
                        buffer: b.block.id,
                        start: b.view.offset(),
                        end: b.view.end(),
                        len: b.buffer_len,
                    });
                }
                if !kernel.strided {
                    b.view.expect_contiguous(kernel.name, b.block.id)?;
                }
            }
        }
        Ok(())
    }

    /// Enqueues a kernel or GEMM; on a profiled stream that is not capturing, between two timing
    /// events, remembered with what it declares (see [`Stream::profile`]). The profile stays
    /// locked meanwhile, so that another thread's launch on this stream cannot fall in between.
    fn enqueue_timed(&self, op: &Op<'_>, name: &'static str, args: &[Arg<'_>], flops: Option<u64>) -> Result<()> {
        let mut profile = self.inner.profile.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(pending) = profile.as_mut() else { return self.enqueue(op) };
        if self.capture_id()?.is_some() {
            return self.enqueue(op);
        }
        let (start, end) = (self.inner.dev.timing_event()?, self.inner.dev.timing_event()?);
        self.record_unobserved(&start)?;
        self.enqueue(op)?;
        self.record_unobserved(&end)?;
        let time = KernelTime { name, bytes: declared_bytes(args), flops, elapsed_us: None };
        pending.push(Pending { time, start, end });
        Ok(())
    }

    /// Records one of the profile's own events, which no stream waits on: the checker need not
    /// hear of it.
    fn record_unobserved(&self, event: &Event) -> Result<()> {
        dispatch!(self.inner.dev.backend(), |b, pick| b.record(pick!(self.inner.repr), pick!(event.repr()), false))
    }

    /// Starts a kernel profile of this stream: until the returned guard finishes or is dropped,
    /// each [`Stream::launch`] and [`Stream::gemm`] enqueued on it is bracketed by two timing
    /// events and remembered with its kernel name, declared bytes and FLOPs (see
    /// [`KernelTime`]), so that a benchmark can say where its time goes. Launches made while
    /// the stream takes part in a capture are not profiled: they run only when the graph is
    /// launched. Events cost a little GPU time between launches, none inside them.
    ///
    /// # Errors
    /// [`Error::Profile`] with [`ProfileErrorKind::Capturing`] when the stream takes part in a
    /// capture, [`ProfileErrorKind::Active`] when it is already profiled.
    pub fn profile(&self) -> Result<Profile<'_>> {
        let mut profile = self.inner.profile.lock().unwrap_or_else(PoisonError::into_inner);
        let refuse = |kind| Err(Error::Profile { stream: self.inner.id, kind });
        if self.capture_id()?.is_some() {
            return refuse(ProfileErrorKind::Capturing);
        }
        if profile.is_some() {
            return refuse(ProfileErrorKind::Active);
        }
        *profile = Some(Vec::new());
        Ok(Profile::new(self))
    }

    /// Ends the active profile and returns its launches (none if no profile is active).
    pub(super) fn end_profile(&self) -> Vec<Pending> {
        self.inner.profile.lock().unwrap_or_else(PoisonError::into_inner).take().unwrap_or_default()
    }

    /// After a kernel or library call was enqueued: note the streams of the blocks it touches,
    /// and report it to the checker.
    fn enqueued(&self, name: &'static str, args: &[Arg<'_>]) -> Result<()> {
        let blocks: Vec<&Arc<Block>> =
            args.iter().filter_map(|a| if let Arg::Buf(b) = a { Some(b.block) } else { None }).collect();
        self.enqueued_on(name, &blocks, &super::kernel::accesses(args))
    }

    /// Enqueues a GEMM (cuBLASLt on CUDA; see [`Gemm`]).
    ///
    /// Everything is checked before anything is enqueued.
    ///
    /// # Errors
    /// [`Error::Shape`] when a view is not the matrix or vector the dimensions and the epilogue
    /// say (an aux matrix's row stride must be a multiple of 8 elements), a buffer of another
    /// device, a view outside its buffer, or a capture error.
    pub fn gemm<T: GemmElem>(&self, g: Gemm<'_, T>) -> Result<()> {
        const OP: &str = "Stream::gemm";
        self.inner.dev.check_err()?;
        for v in g.views() {
            self.check_buf(OP, v.block.raw.device)?;
            v.check_bounds(OP)?;
        }
        let spec = g.spec()?;
        let workspace = self.workspace()?;
        let args = g.args(&spec, workspace.view());
        self.enqueue_gemm(g.kernel(), &args, spec, (g.alpha, g.beta))
    }

    /// Enqueues an FP8 GEMM (cuBLASLt's FP8 matmul on CUDA; see [`Fp8Gemm`]).
    ///
    /// Everything is checked before anything is enqueued.
    ///
    /// # Errors
    /// As [`Stream::gemm`], and [`Error::Shape`] when a scale or the amax is not one f32, or a
    /// matrix is not aligned as FP8 GEMMs need.
    pub fn fp8_gemm<A: Float8, B: Float8>(&self, g: Fp8Gemm<'_, A, B>) -> Result<()>
    where
        (A, B): Fp8Pair,
    {
        self.inner.dev.check_err()?;
        let spec = g.spec()?;
        let workspace = self.workspace()?;
        let args = g.args(&spec, workspace.view());
        let kernel = g.kernel();
        self.check_args(kernel, &args)?;
        self.enqueue_gemm(kernel, &args, spec, (g.alpha, g.beta))
    }

    /// Enqueues a checked GEMM of either kind, and reports it.
    fn enqueue_gemm(
        &self,
        kernel: &'static Kernel,
        args: &[Arg<'_>],
        spec: GemmSpec,
        (alpha, beta): (f32, f32),
    ) -> Result<()> {
        check_arity(kernel, args)?;
        let flops = 2 * (spec.m * spec.n * spec.k * spec.batch) as u64;
        let op = Op::Gemm { kernel, args, spec, alpha, beta };
        self.enqueue_timed(&op, kernel.name, args, Some(flops))?;
        self.enqueued(kernel.name, args)
    }

    /// Plans cuDNN's fused attention for `spec` (once per spec; later calls look it up): what
    /// scratch [`Stream::sdpa`] needs, or why cuDNN cannot run it here.
    pub(crate) fn sdpa_plan(&self, spec: &SdpaSpec) -> Result<SdpaPlan> {
        self.inner.dev.check_err()?;
        dispatch!(self.inner.dev.backend(), |b, _pick| b.sdpa_plan(spec))
    }

    /// Enqueues cuDNN's fused attention, planned by [`Stream::sdpa_plan`] with `scratch` as its
    /// plan asks.
    ///
    /// # Errors
    /// A buffer of another device, a view outside its buffer, a cuDNN failure or a capture error.
    pub(crate) fn sdpa(&self, call: &Sdpa<'_>, spec: SdpaSpec, scratch: &SdpaScratch<'_>, scale: f32) -> Result<()> {
        let kernel = call.kernel();
        self.inner.dev.check_err()?;
        let args = call.args(scratch, scale);
        self.check_args(kernel, &args)?;
        let op = Op::Sdpa { kernel, args: &args, spec };
        self.enqueue_timed(&op, kernel.name, &args, Some(spec.flops()))?;
        self.enqueued(kernel.name, &args)
    }

    fn workspace(&self) -> Result<&DeviceBuffer<u8>> {
        if let Some(w) = self.inner.workspace.get() {
            return Ok(w);
        }
        let dev = &self.inner.dev;
        let bytes = dispatch!(dev.backend(), |b, _pick| b.gemm_workspace_bytes());
        // In relaxed mode: a stream's first GEMM may be inside a capture.
        let raw = dev.alloc_raw(bytes, super::MemKind::Device, true)?;
        Ok(self.inner.workspace.get_or_init(|| DeviceBuffer::from_block(Block::whole(raw))))
    }

    /// Copies pinned host memory to device memory, asynchronously.
    pub fn copy_h2d<'d, T: Elem>(&self, src: HostView<'_, T>, dst: impl IntoView<'d, Elem = T>) -> Result<()> {
        let dst = dst.into_view();
        const OP: &str = "copy_h2d";
        self.inner.dev.check_err()?;
        src.check_bounds(OP)?;
        dst.check_bounds(OP)?;
        self.copy(
            OP,
            CopyDir::HostToDevice,
            (src.block, src.absolute(), src.region),
            (dst.block, dst.absolute(), dst.region),
            T::DTYPE.size(),
        )
    }

    /// Copies device memory to pinned host memory, asynchronously. Read the host buffer only
    /// after an event recorded after this copy has completed.
    pub fn copy_d2h<'s, T: Elem>(&self, src: impl IntoView<'s, Elem = T>, dst: HostView<'_, T>) -> Result<()> {
        let src = src.into_view();
        const OP: &str = "copy_d2h";
        self.inner.dev.check_err()?;
        src.check_bounds(OP)?;
        dst.check_bounds(OP)?;
        self.copy(
            OP,
            CopyDir::DeviceToHost,
            (src.block, src.absolute(), src.region),
            (dst.block, dst.absolute(), dst.region),
            T::DTYPE.size(),
        )
    }

    /// Copies device memory to device memory, asynchronously.
    pub fn copy_d2d<'s, 'd, T: Elem>(
        &self,
        src: impl IntoView<'s, Elem = T>,
        dst: impl IntoView<'d, Elem = T>,
    ) -> Result<()> {
        let (src, dst) = (src.into_view(), dst.into_view());
        const OP: &str = "copy_d2d";
        self.inner.dev.check_err()?;
        src.check_bounds(OP)?;
        dst.check_bounds(OP)?;
        self.copy(
            OP,
            CopyDir::DeviceToDevice,
            (src.block, src.absolute(), src.region),
            (dst.block, dst.absolute(), dst.region),
            T::DTYPE.size(),
        )
    }

    fn copy(
        &self,
        op: &'static str,
        dir: CopyDir,
        (src, src_region, src_rel): (&Arc<Block>, Region, Region),
        (dst, dst_region, dst_rel): (&Arc<Block>, Region, Region),
        elem: usize,
    ) -> Result<()> {
        self.check_buf(op, src.raw.device)?;
        self.check_buf(op, dst.raw.device)?;
        if src_region.len() != dst_region.len() {
            return Err(Error::LengthMismatch { op, src: src_region.len(), dst: dst_region.len() });
        }
        for (buf, r) in [(src, src_region), (dst, dst_region)] {
            r.expect_contiguous(op, buf.id)?;
        }
        self.enqueue(&Op::Copy {
            dir,
            src,
            src_offset: src_region.offset() * elem,
            dst,
            dst_offset: dst_region.offset() * elem,
            bytes: src_region.len() * elem,
        })?;
        let accesses =
            [access_of(src, src_rel, elem, AccessMode::Read, 0), access_of(dst, dst_rel, elem, AccessMode::Write, 1)];
        self.enqueued_on(op, &[src, dst], &accesses)
    }

    /// Sets every byte of a contiguous device view to `value`, asynchronously.
    pub fn memset<'d>(&self, dst: impl IntoView<'d>, value: u8) -> Result<()> {
        let dst = dst.into_view();
        const OP: &str = "memset";
        self.inner.dev.check_err()?;
        dst.check_bounds(OP)?;
        self.check_buf(OP, dst.block.raw.device)?;
        dst.region.expect_contiguous(OP, dst.block.id)?;
        let elem = dst.dtype_size();
        let region = dst.absolute();
        self.enqueue(&Op::Memset {
            dst: dst.block,
            offset: region.offset() * elem,
            bytes: region.len() * elem,
            value,
        })?;
        self.enqueued_on(OP, &[dst.block], &[access_of(dst.block, dst.region, elem, AccessMode::Write, 0)])
    }

    /// Records `event` after the work queued so far. Inside a capture this adds no node: it
    /// marks a point that other streams can wait on (a fork or a join).
    pub fn record(&self, event: &Event) -> Result<()> {
        self.event_op("record", event, EventVerb::Record(false))
    }

    /// Records `event` as an *external* event: inside a capture this adds an event-record node,
    /// so that every launch of the graph records the event when the node runs. Outside a
    /// capture it is a plain record.
    pub fn record_external(&self, event: &Event) -> Result<()> {
        self.event_op("record_external", event, EventVerb::Record(true))
    }

    /// Makes later work on this stream wait for the latest record of `event` at the time of
    /// this call. A wait on a never-recorded event does nothing (as on CUDA).
    #[track_caller]
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.event_op("wait", event, EventVerb::Wait(false))
    }

    /// Waits with the external flag: inside a capture this adds an event-wait node that binds
    /// to the event's latest record at each launch, instead of a capture edge.
    #[track_caller]
    pub fn wait_external(&self, event: &Event) -> Result<()> {
        self.event_op("wait_external", event, EventVerb::Wait(true))
    }

    /// Makes later work on this stream wait for everything queued on `other` so far, through a
    /// new event (PyTorch's `wait_stream`): inside a capture, a fork from `other` into it or a
    /// join of `other` back into it.
    #[track_caller]
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        let e = self.inner.dev.event()?;
        other.record(&e)?;
        self.wait(&e)
    }

    #[track_caller]
    fn event_op(&self, op: &'static str, event: &Event, verb: EventVerb) -> Result<()> {
        // The caller's source location, for reports of waits (`#[track_caller]` up to the verb).
        let at = std::panic::Location::caller();
        self.inner.dev.check_err()?;
        self.inner.dev.check_same(op, "event", event.device().id())?;
        dispatch!(self.inner.dev.backend(), |b, pick| match verb {
            EventVerb::Record(external) => b.record(pick!(self.inner.repr), pick!(event.repr()), external),
            EventVerb::Wait(external) => b.wait(pick!(self.inner.repr), pick!(event.repr()), external),
        })?;
        self.observe(|o, cap| match verb {
            EventVerb::Record(external) => o.record(self.inner.id, cap, event.id(), external),
            EventVerb::Wait(external) => o.wait(self.inner.id, cap, event.id(), external, Some(&at.to_string())),
        })
    }

    /// Blocks the host until all work queued on this stream has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.dev.check_err()?;
        dispatch!(self.inner.dev.backend(), |b, pick| b.stream_synchronize(pick!(self.inner.repr)))?;
        self.host_saw_all();
        Ok(())
    }

    /// Whether all work queued on this stream has completed.
    pub fn query(&self) -> Result<bool> {
        let done = dispatch!(self.inner.dev.backend(), |b, pick| b.stream_query(pick!(self.inner.repr)))?;
        if done {
            self.host_saw_all();
        }
        Ok(done)
    }

    fn host_saw_all(&self) {
        if let Some(o) = self.inner.dev.observer() {
            o.host_sync(HostSync::Stream(self.inner.id));
        }
    }

    /// Starts capturing this stream: work enqueued from now on (and on streams that join the
    /// capture through events) is recorded into a graph instead of running. Prefer
    /// [`Stream::capture`], whose guard ends the capture on error.
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        dispatch!(self.inner.dev.backend(), |b, pick| b.begin_capture(pick!(self.inner.repr), mode))?;
        if let (Some(o), Some(id)) = (self.inner.dev.observer(), self.capture_id()?) {
            o.begin_capture(self.inner.id, id);
        }
        Ok(())
    }

    /// Ends the capture begun on this stream and returns the captured graph.
    ///
    /// # Errors
    /// [`Error::Capture`] with `Unmatched` on a stream that did not begin a capture, `Unjoined`
    /// if a forked stream was not joined back, `Invalidated` if the capture was invalidated.
    pub fn end_capture(&self) -> Result<Graph> {
        let capture = self.capture_id()?;
        let observed = self.inner.dev.observer().and_then(|o| capture.map(|id| (o, id)));
        let ended = dispatch!(self.inner.dev.backend(), |b, pick| b
            .end_capture(pick!(self.inner.repr))
            .map(|g| b.wrap_graph(g)));
        // The collectives the capture recorded, taken whether it gave a graph or not.
        let collectives = GraphCollectives::take(self.inner.dev.id(), capture);
        let graph = match ended {
            Ok(repr) => Graph::new(self.inner.dev.clone(), repr, collectives)?,
            Err(e) => {
                if let Some((o, id)) = observed {
                    o.end_capture(id, None)?;
                }
                return Err(e);
            }
        };
        if let Some((o, id)) = observed {
            o.end_capture(id, Some(graph.id()))?;
        }
        // graphed allocates only outside graphs; a memory node means foreign code allocated
        // stream-ordered memory during the capture, which ties the graph to one replay stream.
        let counts = graph.node_counts()?;
        let memory_nodes = [NodeKind::MemAlloc, NodeKind::MemFree].iter().filter_map(|k| counts.get(k)).sum::<usize>();
        if memory_nodes > 0 {
            return Err(Error::MemoryNodes { count: memory_nodes });
        }
        Ok(graph)
    }

    /// The identity of the active capture this stream takes part in (begun on it, or joined
    /// through an event), if any. Allocators route allocations of a capture by it.
    pub fn capture_id(&self) -> Result<Option<u64>> {
        dispatch!(self.inner.dev.backend(), |b, pick| b.capture_id(pick!(self.inner.repr)))
    }

    /// Whether the stream is capturing, and whether that capture is still valid.
    pub fn capture_status(&self) -> Result<CaptureStatus> {
        dispatch!(self.inner.dev.backend(), |b, pick| b.capture_status(pick!(self.inner.repr)))
    }

    /// Begins a capture and returns a guard; [`Capture::finish`] ends it and returns the graph,
    /// and dropping the guard (for example on `?`) ends the capture and discards the graph.
    ///
    /// ```
    /// use graphed::device::{CaptureMode, Device};
    /// let dev = Device::sim();
    /// let s = dev.stream()?;
    /// let x = dev.alloc::<f32>(4)?;
    /// let cap = s.capture(CaptureMode::ThreadLocal)?;
    /// s.memset(&x, 0)?;
    /// let graph = cap.finish()?;
    /// assert_eq!(graph.nodes()?.len(), 1);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    pub fn capture(&self, mode: CaptureMode) -> Result<Capture<'_>> {
        self.begin_capture(mode)?;
        Ok(Capture::new(self))
    }
}

/// Record or wait, and whether with the external flag.
#[derive(Clone, Copy)]
enum EventVerb {
    Record(bool),
    Wait(bool),
}

impl<T: Elem> DeviceBuffer<T> {
    /// Copies the buffer to a new `Vec` after the work queued on `stream`, blocking the host.
    /// A blocking copy: capture modes forbid it like CUDA does.
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        self.range_to_vec(stream, 0..self.len())
    }

    /// Elements `range` of the buffer, copied as [`to_vec`](DeviceBuffer::to_vec) copies all of
    /// them: a view's elements without the rest of a large buffer.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`](crate::Error::OutOfBounds) for a range past the buffer's end, and
    /// as [`to_vec`](DeviceBuffer::to_vec).
    pub fn range_to_vec(&self, stream: &Stream, range: std::ops::Range<usize>) -> Result<Vec<T>> {
        const OP: &str = "to_vec";
        stream.inner.dev.check_same(OP, "buffer", self.block.raw.device)?;
        let region = Region::contiguous(range.start, range.len());
        self.slice(range.clone()).check_bounds(OP)?;
        let mut out = vec![T::zeroed(); range.len()];
        dispatch!(stream.inner.dev.backend(), |b, pick| b.read_blocking(
            pick!(stream.inner.repr),
            pick!(self.block.raw.mem),
            self.block.base + range.start * T::DTYPE.size(),
            bytemuck::cast_slice_mut(&mut out)
        ))?;
        self.observe_host(stream, OP, AccessMode::Read, region)?;
        Ok(out)
    }

    fn observe_host(&self, stream: &Stream, op: &'static str, mode: AccessMode, region: Region) -> Result<()> {
        match stream.inner.dev.observer() {
            Some(o) => {
                let a = access_of(&self.block, region, T::DTYPE.size(), mode, 0);
                o.host_access(op, Some(stream.id()), &[a])
            }
            None => Ok(()),
        }
    }

    /// Overwrites the buffer with `data` after the work queued on `stream`, blocking the host.
    pub fn write_from(&self, stream: &Stream, data: &[T]) -> Result<()> {
        stream.inner.dev.check_same("write_from", "buffer", self.block.raw.device)?;
        if data.len() != self.len() {
            return Err(Error::LengthMismatch { op: "write_from", src: data.len(), dst: self.len() });
        }
        dispatch!(stream.inner.dev.backend(), |b, pick| b.write_blocking(
            pick!(stream.inner.repr),
            pick!(self.block.raw.mem),
            self.block.base,
            bytemuck::cast_slice(data)
        ))?;
        self.observe_host(stream, "write_from", AccessMode::Write, Region::contiguous(0, self.len()))
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({})", self.inner.id)
    }
}
