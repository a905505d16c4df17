//! The simulator backend: CUDA's stream, event, capture and graph semantics on host memory.
//!
//! Work is deferred into a queue (`schedule.rs`) and run by a seeded scheduler under one of three
//! [`Policy`]s. The rules reproduced here, each checked against CUDA by the conformance suite:
//! - a wait binds to the event's latest record at the time of the host call; a wait on a
//!   never-recorded event does nothing;
//! - launches of one graph executable run one after another, whatever their streams;
//! - capture isolation: a capturing stream waiting on an event recorded outside the capture
//!   invalidates the capture, and an invalidated capture stays invalid until it is ended;
//!   a stream that waits on an event recorded inside a capture joins that capture;
//! - a fork not joined back before `end_capture` fails it; `end_capture` on a stream that
//!   joined but did not begin the capture is refused and invalidates it; from another thread
//!   (global and thread-local modes) it is refused and ends the capture;
//! - querying an event recorded in a capture, a wait that would merge two captures, and a graph
//!   launch into a capturing stream are refused and invalidate the capture(s) involved (what
//!   CUDA 13.0 does on the H200);
//! - synchronizing or querying a capturing stream is forbidden in every mode; synchronous calls
//!   (synchronizing or querying any stream, event or the device, blocking copies, plain
//!   allocation) are forbidden on every thread in global mode and on the
//!   capturing thread in thread-local mode; both invalidate the capture.

mod capture;
mod comm;
mod graph;
mod schedule;
mod task;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

pub use schedule::Policy;

use self::capture::CaptureState;
pub(crate) use self::comm::SimLink;
use self::graph::{SimExec, SimGraph};
use self::schedule::{Action, Queue, WorkId};
pub(crate) use self::task::SimMem;
use self::task::Task;
use super::backend::{Backend, Op};
use super::memory::MemKind;
use super::{CaptureMode, CaptureStatus, EventId, NodeInfo, StreamId};
use crate::error::{CaptureErrorKind, CaptureSite};
use crate::{Error, Result};

/// How the simulator schedules deferred work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimConfig {
    /// The scheduling policy.
    pub policy: Policy,
    /// Seed of the random policy (and of any future randomness of the simulator).
    pub seed: u64,
    /// The device's memory in bytes: allocations beyond it fail with
    /// [`Error::OutOfMemory`], as on a GPU.
    pub memory: usize,
}

/// The simulator's device address of byte `byte` of allocation `memory`: the allocation's id
/// above bit 40 and the byte below, so that, as on CUDA, distinct bytes have distinct addresses
/// (what a table of addresses that kernels read holds on the simulator).
pub(crate) fn address(memory: super::BufferId, byte: usize) -> u64 {
    (memory.0 << 40) | byte as u64
}

/// The simulated device's memory unless configured: 16 GiB.
pub const DEFAULT_SIM_MEMORY: usize = 16 << 30;

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig { policy: Policy::Random, seed: 0, memory: DEFAULT_SIM_MEMORY }
    }
}

impl SimConfig {
    /// A configuration with this policy and seed 0.
    pub fn with_policy(policy: Policy) -> SimConfig {
        SimConfig { policy, ..SimConfig::default() }
    }
}

/// The simulator device.
pub(crate) struct SimDevice {
    config: SimConfig,
    state: Mutex<State>,
    /// Bytes of device and pinned memory allocated.
    used: Arc<std::sync::atomic::AtomicUsize>,
}

/// What a wait on an event binds to.
#[derive(Clone, Debug)]
pub(crate) enum Record {
    /// Never recorded: a wait does nothing.
    Never,
    /// Recorded outside any capture after this work item (`None`: after nothing).
    At(Option<WorkId>),
    /// Recorded inside a capture, after these nodes of the capture's graph.
    Captured { capture: u64, frontier: Vec<usize> },
}

pub(crate) struct StreamState {
    legacy: bool,
    /// The last item queued on the stream.
    last: Option<WorkId>,
    /// The capture the stream takes part in, if any.
    capture: Option<u64>,
    /// Inside a capture: the nodes the stream's next node depends on.
    frontier: Vec<usize>,
}

pub(crate) struct State {
    queue: Queue,
    streams: HashMap<StreamId, StreamState>,
    events: HashMap<EventId, Record>,
    captures: HashMap<u64, CaptureState>,
    next_capture: u64,
    /// For each executable, the end marker of its latest launch.
    exec_last: HashMap<u64, WorkId>,
}

/// A simulated stream: its state lives in the device.
pub(crate) struct SimStream {
    id: StreamId,
}

/// A simulated event: its latest record lives in the device.
pub(crate) struct SimEvent {
    id: EventId,
}

impl SimDevice {
    /// Runs the queued work that can run now (see [`Queue::run_ready`]): what a GPU does while
    /// its host waits in a split.
    pub(crate) fn progress(&self) -> Vec<Arc<comm::Exchange>> {
        self.lock().queue.run_ready()
    }

    pub(crate) fn new(config: SimConfig) -> SimDevice {
        let state = State {
            queue: Queue::new(config.policy, config.seed),
            streams: HashMap::new(),
            events: HashMap::new(),
            captures: HashMap::new(),
            next_capture: 1,
            exec_last: HashMap::new(),
        };
        SimDevice { config, state: Mutex::new(state), used: Arc::default() }
    }

    pub(crate) fn describe(&self) -> String {
        format!("simulator ({:?}, seed {})", self.config.policy, self.config.seed)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // State is only mutated by code that cannot panic half-way except on a bug; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    fn stream(&mut self, id: StreamId) -> &mut StreamState {
        self.streams.get_mut(&id).expect("streams are registered at creation and never removed")
    }

    /// Queues `action` on a stream that is not capturing, after its previous work and `extra`.
    fn push_on(&mut self, stream: StreamId, extra: Option<WorkId>, action: Action) -> WorkId {
        let last = self.stream(stream).last;
        let id = self.queue.push([last, extra], action);
        self.stream(stream).last = Some(id);
        id
    }

    fn enqueue(&mut self, op: &Op<'_>, stream: StreamId) -> Result<()> {
        let task = Arc::new(Task::from_op(op)?);
        if let Some(cap) = self.active_capture_of(op.name(), stream)? {
            let kind = task.node_kind();
            let name = task.name();
            let node = self.add_node(cap, stream, kind, name, graph::NodeTask::Run(task));
            self.add_site(cap, node, crate::device::patch::Site::of(op));
            return Ok(());
        }
        let last = self.stream(stream).last;
        let end = self.push_task([last, None], &task)?;
        self.stream(stream).last = Some(end);
        Ok(())
    }

    /// Queues `task` after `deps`: one work item, or a collective's arrivals and finishes
    /// (issued in its group's order now). Returns the last item.
    fn push_task(&mut self, deps: impl IntoIterator<Item = Option<WorkId>>, task: &Arc<Task>) -> Result<WorkId> {
        let Task::Collective(parts) = &**task else {
            return Ok(self.queue.push(deps, Action::Run(task.clone())));
        };
        let exchanges = parts.iter().map(comm::Exchange::issue).collect::<Result<Vec<_>>>()?;
        let deps: Vec<Option<WorkId>> = deps.into_iter().collect();
        let arrivals: Vec<Option<WorkId>> =
            exchanges.iter().map(|x| Some(self.queue.push(deps.iter().copied(), Action::Arrive(x.clone())))).collect();
        let finishes: Vec<Option<WorkId>> = (exchanges.into_iter())
            .map(|x| Some(self.queue.push(arrivals.iter().copied(), Action::Finish(x))))
            .collect();
        Ok(match finishes[..] {
            [Some(one)] => one,
            _ => self.queue.push(finishes, Action::Nop),
        })
    }

    fn record(&mut self, stream: StreamId, event: EventId, external: bool) -> Result<()> {
        let op = if external { "record_external" } else { "record" };
        let rec = match self.active_capture_of(op, stream)? {
            Some(cap) if external => {
                // An external record is a node for the graph's launches to execute; during the
                // capture it leaves the event as it was for plain waits, as on the H200 (a wait
                // after it binds to the event's earlier record, or to none).
                self.add_node(
                    cap,
                    stream,
                    super::NodeKind::EventRecord,
                    format!("record {event}"),
                    graph::NodeTask::Record(event),
                );
                return Ok(());
            }
            Some(cap) => Record::Captured { capture: cap, frontier: self.stream(stream).frontier.clone() },
            None if external => return Err(outside_capture(op, stream)),
            None => Record::At(self.stream(stream).last),
        };
        self.events.insert(event, rec);
        Ok(())
    }

    fn wait(&mut self, stream: StreamId, event: EventId, external: bool) -> Result<()> {
        let op = if external { "wait_external" } else { "wait" };
        let rec = self.events.get(&event).cloned().unwrap_or(Record::Never);
        match self.active_capture_of(op, stream)? {
            Some(cap) if external => {
                self.add_node(
                    cap,
                    stream,
                    super::NodeKind::EventWait,
                    format!("wait {event}"),
                    graph::NodeTask::Wait(event),
                );
                Ok(())
            }
            Some(cap) => self.capture_wait(op, cap, stream, rec),
            None if external => Err(outside_capture(op, stream)),
            None => match rec {
                Record::Never | Record::At(None) => Ok(()),
                Record::At(Some(w)) => {
                    self.push_on(stream, Some(w), Action::Nop);
                    Ok(())
                }
                Record::Captured { capture, frontier } => self.join_capture(op, stream, capture, frontier),
            },
        }
    }

    fn synchronize_stream(&mut self, stream: StreamId, op: &'static str) -> Result<()> {
        self.forbid_on_capturing(op, stream)?;
        self.forbid_sync_call(op)?;
        let last: Vec<WorkId> = self.stream(stream).last.into_iter().collect();
        self.queue.run_until(&last)
    }

    fn event_target(&mut self, op: &'static str, event: EventId) -> Result<Option<WorkId>> {
        match self.events.get(&event) {
            None | Some(Record::Never) | Some(Record::At(None)) => Ok(None),
            Some(Record::At(Some(w))) => Ok(Some(*w)),
            Some(Record::Captured { capture, .. }) if !self.captures.contains_key(capture) => {
                Err(Error::Capture { op, on: CaptureSite::Event(event), kind: CaptureErrorKind::RecordOfEndedCapture })
            }
            Some(Record::Captured { capture, .. }) => {
                // CUDA refuses and invalidates the capture the event was recorded in.
                let capture = *capture;
                self.invalidate(capture);
                Err(Error::Capture { op, on: CaptureSite::Event(event), kind: CaptureErrorKind::CapturedEvent })
            }
        }
    }
}

impl Backend for SimDevice {
    type Stream = SimStream;
    type Event = SimEvent;
    type Mem = SimMem;
    type Graph = SimGraph;
    type Exec = SimExec;

    fn create_stream(&self, id: StreamId, _priority: i32) -> Result<SimStream> {
        self.lock().streams.insert(id, StreamState { legacy: false, last: None, capture: None, frontier: vec![] });
        Ok(SimStream { id })
    }

    fn legacy_stream(&self, id: StreamId) -> Result<SimStream> {
        self.lock().streams.insert(id, StreamState { legacy: true, last: None, capture: None, frontier: vec![] });
        Ok(SimStream { id })
    }

    fn priority_range(&self) -> Result<(i32, i32)> {
        Ok((0, -5))
    }

    fn create_event(&self, id: EventId, _timing: bool) -> Result<SimEvent> {
        self.lock().events.insert(id, Record::Never);
        Ok(SimEvent { id })
    }

    fn elapsed_ms(&self, _start: &SimEvent, _end: &SimEvent) -> Result<f32> {
        Err(Error::Unsupported {
            op: "Event::elapsed_ms",
            backend: "sim",
            why: "the simulator has no clock; time host work with std::time::Instant, or run on CUDA",
        })
    }

    fn alloc(&self, bytes: usize, kind: MemKind, relaxed: bool) -> Result<SimMem> {
        let op = match kind {
            MemKind::Device => "alloc",
            MemKind::Pinned => "alloc_pinned",
        };
        if !relaxed {
            self.lock().forbid_sync_call(op)?;
        }
        SimMem::zeroed(op, bytes, &self.used, self.config.memory)
    }

    fn vm_granularity(&self) -> Result<Option<usize>> {
        // As an H200 reports: expandable memory comes in 2 MiB pages.
        Ok(Some(2 << 20))
    }

    fn reserve(&self, _capacity: usize, _chunk: usize, relaxed: bool) -> Result<SimMem> {
        if !relaxed {
            self.lock().forbid_sync_call("reserve device addresses")?;
        }
        // Only address space: nothing is counted until mapped, and the range's size bounds
        // nothing the simulator needs to check (the allocator never grows past it).
        Ok(SimMem::reserved(&self.used))
    }

    fn map_to(&self, mem: &SimMem, bytes: usize, relaxed: bool) -> Result<()> {
        const OP: &str = "map device memory";
        if !relaxed {
            self.lock().forbid_sync_call(OP)?;
        }
        mem.grow(OP, bytes, self.config.memory)
    }

    fn unmap_from(&self, mem: &SimMem, bytes: usize) -> Result<()> {
        // Unmapping waits for the device, as the CUDA path does before it unmaps.
        self.synchronize()?;
        mem.shrink(bytes);
        Ok(())
    }

    fn mapped(mem: &SimMem) -> usize {
        mem.len()
    }

    fn memory_info(&self) -> Result<(usize, usize)> {
        let used = self.used.load(std::sync::atomic::Ordering::Relaxed);
        let free = self.config.memory.saturating_sub(used);
        Ok((host_available().map_or(free, |host| free.min(host)), self.config.memory))
    }

    fn capture_id(&self, stream: &SimStream) -> Result<Option<u64>> {
        let mut st = self.lock();
        Ok(st.active_capture_of("Stream::capture_id", stream.id).ok().flatten())
    }

    fn load_kernel(&self, _kernel: &'static crate::device::Kernel) -> Result<()> {
        // CUDA 13.0 loads modules during captures of every mode; the simulator has nothing to load.
        Ok(())
    }

    fn gemm_workspace_bytes(&self) -> usize {
        // The simulator needs none; a small one keeps the declared accesses the same as on CUDA.
        256
    }

    fn sdpa_plan(&self, _spec: &crate::device::sdpa::SdpaSpec) -> Result<crate::device::sdpa::SdpaPlan> {
        Ok(crate::device::sdpa::SdpaPlan::Unavailable(crate::device::sdpa::SIM_WHY.into()))
    }

    fn enqueue(&self, stream: &SimStream, op: &Op<'_>) -> Result<()> {
        self.lock().enqueue(op, stream.id)
    }

    fn record(&self, stream: &SimStream, event: &SimEvent, external: bool) -> Result<()> {
        self.lock().record(stream.id, event.id, external)
    }

    fn wait(&self, stream: &SimStream, event: &SimEvent, external: bool) -> Result<()> {
        self.lock().wait(stream.id, event.id, external)
    }

    fn stream_synchronize(&self, stream: &SimStream) -> Result<()> {
        self.lock().synchronize_stream(stream.id, "Stream::synchronize")
    }

    fn stream_query(&self, stream: &SimStream) -> Result<bool> {
        let mut st = self.lock();
        st.forbid_on_capturing("Stream::query", stream.id)?;
        st.forbid_sync_call("Stream::query")?;
        match st.stream(stream.id).last {
            None => Ok(true),
            Some(w) => {
                st.queue.step_towards(w)?;
                Ok(st.queue.is_done(w))
            }
        }
    }

    fn event_query(&self, event: &SimEvent) -> Result<bool> {
        let mut st = self.lock();
        let target = st.event_target("Event::query", event.id)?;
        st.forbid_sync_call("Event::query")?;
        match target {
            None => Ok(true),
            Some(w) => {
                st.queue.step_towards(w)?;
                Ok(st.queue.is_done(w))
            }
        }
    }

    fn event_synchronize(&self, event: &SimEvent) -> Result<()> {
        let mut st = self.lock();
        let target: Vec<WorkId> = st.event_target("Event::synchronize", event.id)?.into_iter().collect();
        st.forbid_sync_call("Event::synchronize")?;
        st.queue.run_until(&target)
    }

    fn synchronize(&self) -> Result<()> {
        let mut st = self.lock();
        st.forbid_sync_call("Device::synchronize")?;
        st.queue.run_all()
    }

    fn read_blocking(&self, stream: &SimStream, mem: &SimMem, offset: usize, out: &mut [u8]) -> Result<()> {
        let mut st = self.lock();
        st.synchronize_stream(stream.id, "to_vec")?;
        mem.read("to_vec", offset, out)
    }

    fn write_blocking(&self, stream: &SimStream, mem: &SimMem, offset: usize, data: &[u8]) -> Result<()> {
        let mut st = self.lock();
        st.synchronize_stream(stream.id, "write_from")?;
        mem.write("write_from", offset, data)
    }

    fn read_pinned(mem: &SimMem, offset: usize, out: &mut [u8]) -> Result<()> {
        mem.read("PinnedBuffer::read", offset, out)
    }

    fn write_pinned(mem: &SimMem, offset: usize, data: &[u8]) -> Result<()> {
        mem.write("PinnedBuffer::write", offset, data)
    }

    fn begin_capture(&self, stream: &SimStream, mode: CaptureMode) -> Result<()> {
        self.lock().begin_capture(stream.id, mode)
    }

    fn end_capture(&self, stream: &SimStream) -> Result<SimGraph> {
        self.lock().end_capture(stream.id)
    }

    fn capture_status(&self, stream: &SimStream) -> Result<CaptureStatus> {
        Ok(self.lock().capture_status(stream.id))
    }

    fn graph_nodes(&self, graph: &SimGraph) -> Result<Vec<NodeInfo>> {
        Ok(graph.node_infos())
    }

    fn graph_dot(&self, graph: &SimGraph) -> Result<String> {
        Ok(super::graph::dot_of(&graph.node_infos()))
    }

    fn graph_sites(&self, graph: &SimGraph) -> Arc<[crate::device::patch::Site]> {
        graph.sites()
    }

    fn instantiate(&self, graph: &SimGraph) -> Result<SimExec> {
        Ok(SimExec::new(graph))
    }

    fn rebind(
        &self,
        exec: &SimExec,
        sites: &[crate::device::patch::Site],
        changes: &[crate::device::patch::SiteChange],
    ) -> Result<()> {
        exec.rebind(sites, changes)
    }

    fn set_enabled(&self, exec: &SimExec, sites: &[usize], enabled: bool) -> Result<()> {
        exec.set_enabled(sites, enabled);
        Ok(())
    }

    fn upload(&self, _exec: &SimExec, stream: &SimStream) -> Result<()> {
        self.lock().active_capture_of("GraphExec::upload", stream.id).map(|_| ())
    }

    fn launch(&self, exec: &SimExec, stream: &SimStream) -> Result<()> {
        self.lock().launch(exec, stream.id)
    }
}

/// An external record or wait on a stream that is not capturing: CUDA refuses the flag there.
fn outside_capture(op: &'static str, stream: StreamId) -> Error {
    Error::Capture {
        op,
        on: crate::error::CaptureSite::Stream(stream),
        kind: crate::CaptureErrorKind::ExternalOutsideCapture,
    }
}

/// The host's available memory (Linux's estimate of what new allocations can take without
/// swapping), if it says.
fn host_available() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?.trim().parse::<usize>().ok())?;
    Some(kib * 1024)
}
