//! Layer 2, the stream-safety checker: happens-before over the declared accesses of every
//! operation, with vector clocks per stream, per capture lane and per graph launch, event
//! snapshots, and the host as a lane of its own. Uses only [`device`](crate::device).
//!
//! Always on for the simulator; on CUDA opt in with [`Device::cuda_checked`](crate::device::Device::cuda_checked)
//! or `GRAPHED_CHECK=1` (`=strict` for strict mode). Find a device's checker with
//! [`Checker::of`].
//!
//! The rules:
//! - an operation happens after everything earlier on its stream, after what the host had seen
//!   when it was issued, and after the record that each of its stream's waits bound to;
//! - inside a graph launch, a node happens after the launch's entry and its graph ancestors;
//!   an external event recorded inside the graph covers only the record node's ancestors, so
//!   work after it (the tail) stays unordered for a caller that waits on it;
//! - two accesses of overlapping memory of which one writes must be ordered; so must a host
//!   access and the device work on the same memory;
//! - a wait on a never-recorded event is reported; so is resetting a graph whose last launch the
//!   host has not seen finish.

mod clock;
mod report;
mod summary;

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub use report::{Hazard, HazardKind, OpRef, Site};
pub use summary::{SyncPoint, TailAccess};

use self::clock::{Clock, Lane};
use self::summary::{GraphSummary, Node};
use crate::device::observe::{HostSync, Observer};
use crate::device::{Access, AccessMode, BufferId, Device, EventId, GraphId, StreamId};
use crate::{Error, Result};

/// At most this many access records are kept per allocation, after older records covered by
/// newer ones of the same lane were dropped; past it the oldest go (a missed report is possible
/// then, a false one is not).
const RECORDS_PER_MEMORY: usize = 256;

/// The checker of a device: its reports, and strict mode.
#[derive(Clone)]
pub struct Checker {
    inner: Arc<Inner>,
}

struct Inner {
    strict: AtomicBool,
    /// Whether only captures are watched (a CUDA device without `GRAPHED_CHECK`): graph summaries
    /// for capture-time verification, no cost on eager work or replays.
    captures_only: bool,
    /// Captures in progress, so that eager work skips the checker while there are none.
    active: AtomicUsize,
    state: Mutex<State>,
}

/// What a wait on an event binds to.
#[derive(Clone)]
enum Snapshot {
    At(Clock),
    /// Recorded by an external record node of `launch` of `graph` on `stream`.
    Launched {
        clock: Clock,
        launch: u64,
        graph: GraphId,
        stream: StreamId,
    },
    Captured {
        capture: u64,
        clock: Clock,
    },
}

impl Snapshot {
    /// The clock a wait joins, for records outside captures.
    fn at(&self) -> Option<&Clock> {
        match self {
            Snapshot::At(c) | Snapshot::Launched { clock: c, .. } => Some(c),
            Snapshot::Captured { .. } => None,
        }
    }
}

/// One access that may still conflict with later ones.
enum Record {
    Op {
        lane: Lane,
        pos: u64,
        op: &'static str,
        site: Site,
        access: Box<Access>,
    },
    /// Every access of a graph launch to this allocation (see [`GraphSummary::footprint`]).
    Launch {
        launch: u64,
    },
}

struct Capture {
    streams: HashMap<StreamId, Clock>,
    nodes: Vec<Node>,
    records: Vec<(EventId, Clock)>,
    waits: Vec<EventId>,
}

struct Launch {
    graph: GraphId,
    stream: StreamId,
    summary: Arc<GraphSummary>,
}

/// What an executable changed of its graph: its rebound ranges, and which of its `sites`
/// captured operations it turned off.
#[derive(Default)]
struct ExecPatch {
    remaps: Vec<crate::device::patch::Remap>,
    sites: usize,
    disabled: Vec<usize>,
    /// Changed since its summary was last rebuilt: the next launch rebuilds it, once for any
    /// number of changes (a switch of offloading changes many nodes of one executable).
    stale: bool,
}

#[derive(Default)]
struct State {
    streams: HashMap<StreamId, Clock>,
    host: Clock,
    events: HashMap<EventId, Snapshot>,
    shadow: HashMap<BufferId, Vec<Record>>,
    captures: HashMap<u64, Capture>,
    graphs: HashMap<GraphId, Arc<GraphSummary>>,
    launches: HashMap<u64, Launch>,
    last_launch: HashMap<GraphId, u64>,
    /// Each stream's latest graph launch.
    stream_launch: HashMap<StreamId, (u64, GraphId)>,
    /// The clock after each executable's latest launch: the next launch of it runs after.
    exec_end: HashMap<u64, Clock>,
    /// For executables whose reads were rebound or whose nodes were turned off, their graph's
    /// summary through those changes.
    rebound: HashMap<u64, Arc<GraphSummary>>,
    /// By executable, its rebound ranges, and its captured operations with those turned off.
    patches: HashMap<u64, ExecPatch>,
    next_launch: u64,
    /// The reports kept, the first [`MAX_KEPT_HAZARDS`] found.
    hazards: Vec<Hazard>,
    /// Every report found, kept or not.
    found: u64,
}

/// How many reports a checker keeps (the first ones found: the later ones of a long run are
/// usually consequences); every report is still shown through `tracing` as it is found and
/// counted in [`Checker::found`].
pub const MAX_KEPT_HAZARDS: usize = 1024;

fn conflict(a: AccessMode, b: AccessMode) -> Option<HazardKind> {
    match (a.writes(), b.writes()) {
        (true, true) => Some(HazardKind::WriteAfterWrite),
        (true, false) => Some(HazardKind::ReadAfterWrite),
        (false, true) => Some(HazardKind::WriteAfterRead),
        (false, false) => None,
    }
}

fn site_lane_name(site: &Site) -> String {
    match site {
        Site::Stream(s) => format!("stream {s}"),
        Site::Host => "the host".into(),
        Site::Captured { graph } => format!("the capture of graph {graph}"),
        Site::Graph { graph, stream } => format!("stream {stream} (graph {graph})"),
    }
}

/// The ordering that fixes a race between `earlier` and `later`.
fn fix_for(earlier: &OpRef, later: &OpRef) -> String {
    match (&earlier.site, &later.site) {
        (_, Site::Host) => format!(
            "record an event on {} after {} and synchronize it before the host touches the memory",
            site_lane_name(&earlier.site),
            earlier.op
        ),
        (Site::Host, _) => {
            format!("enqueue {} only after the host's access, or have the host synchronize first", later.op)
        }
        (Site::Captured { .. }, Site::Captured { .. }) => {
            "inside the capture, record an event after the earlier node and make the later node's stream wait on it"
                .into()
        }
        _ => format!(
            "record an event E on {} after {}, and make {} wait on E before {}",
            site_lane_name(&earlier.site),
            earlier.op,
            site_lane_name(&later.site),
            later.op
        ),
    }
}

/// The bytes of `later`'s buffer that both accesses' hulls cover.
fn byte_range(later: &Access, prior: &Access) -> (usize, usize) {
    let base = (later.at.offset() - later.region.offset()) * later.elem_bytes;
    let ((a0, a1), (b0, b1)) = (later.byte_hull(), prior.byte_hull());
    let lo = a0.max(b0) - base;
    (lo, (a1.min(b1) - base).max(lo))
}

impl State {
    /// Executable `exec`'s summary of `graph` through its patch (none: the graph's own).
    fn repatch(&mut self, graph: GraphId, exec: u64) {
        if let Some(p) = self.patches.get_mut(&exec) {
            p.stale = false;
        }
        let patch = self.patches.get(&exec).filter(|p| !p.remaps.is_empty() || !p.disabled.is_empty());
        match (self.graphs.get(&graph), patch) {
            (Some(summary), Some(p)) => {
                let patched = Arc::new(summary.patched(&p.remaps, p.sites, &p.disabled));
                self.rebound.insert(exec, patched);
            }
            _ => {
                self.rebound.remove(&exec);
            }
        }
    }

    fn stream_clock(&mut self, stream: StreamId) -> &mut Clock {
        self.streams.entry(stream).or_default()
    }

    /// Checks `access` by an operation whose clock is `clock` against everything recorded on the
    /// same memory.
    fn check(&mut self, clock: &Clock, later: &OpRef, access: &Access) {
        check(&self.shadow, &self.launches, &mut self.hazards, clock, later, access);
    }
    fn remember(&mut self, memory: BufferId, rec: Record) {
        let recs = self.shadow.entry(memory).or_default();
        if let Record::Op { lane, access: new, .. } = &rec {
            // An older record of the same lane that the new one covers can go: whatever is not
            // ordered after the older one is not ordered after the newer one either (clocks are
            // per lane), and conflicts with it conflicts with the newer one, unless the older one
            // writes and the newer one only reads.
            recs.retain(|old| match old {
                Record::Op { lane: l, access: o, .. } => {
                    !(l == lane && covers(&new.at, &o.at) && (new.mode.writes() || !o.mode.writes()))
                }
                Record::Launch { .. } => true,
            });
        }
        if recs.len() >= RECORDS_PER_MEMORY {
            recs.remove(0);
        }
        recs.push(rec);
    }

    /// Forgets what the host has seen finish: every later operation is issued after the host's
    /// knowledge, so records it covers can no longer race, and the lanes of launches whose
    /// records are gone need not be tracked (clocks would otherwise grow with every launch).
    fn collect_garbage(&mut self) {
        let host = &self.host;
        let launches = &self.launches;
        let done =
            |l: &u64| launches.get(l).is_none_or(|x| x.summary.lanes_end(*l).all(|(lane, pos)| host.covers(lane, pos)));
        for recs in self.shadow.values_mut() {
            recs.retain(|r| match r {
                Record::Op { lane, pos, .. } => !host.covers(*lane, *pos),
                Record::Launch { launch } => !done(launch),
            });
        }
        self.shadow.retain(|_, recs| !recs.is_empty());
        let finished: Vec<u64> = self.launches.keys().copied().filter(|l| done(l)).collect();
        for l in &finished {
            self.launches.remove(l);
        }
        self.last_launch.retain(|_, l| !finished.contains(l));
        let gone = |lane: &Lane| match lane {
            Lane::Launch(l, _) => finished.contains(l),
            _ => false,
        };
        for c in self.streams.values_mut().chain(self.exec_end.values_mut()).chain(std::iter::once(&mut self.host)) {
            c.forget(gone);
        }
        for snap in self.events.values_mut() {
            if let Snapshot::At(c) | Snapshot::Launched { clock: c, .. } = snap {
                c.forget(gone);
            }
        }
    }
}

/// Whether region `a` holds every element of `b` (exact for equal or contiguous regions; false
/// otherwise, which only keeps a record longer).
fn covers(a: &crate::device::Region, b: &crate::device::Region) -> bool {
    a == b || (a.is_contiguous() && b.is_contiguous() && a.offset() <= b.offset() && b.end() <= a.end())
}

/// Checks `access` by an operation whose clock is `clock` against everything `shadow` recorded
/// on the same memory, and reports each conflict not ordered before it.
fn check(
    shadow: &HashMap<BufferId, Vec<Record>>,
    launches: &HashMap<u64, Launch>,
    hazards: &mut Vec<Hazard>,
    clock: &Clock,
    later: &OpRef,
    access: &Access,
) {
    let Some(records) = shadow.get(&access.memory) else { return };
    // Newest first, one report per earlier site: ordering after the newest conflicting
    // operation of a stream orders after all its earlier ones too.
    let mut found: Vec<(HazardKind, OpRef, Access)> = Vec::new();
    for rec in records.iter().rev() {
        match rec {
            Record::Op { lane, pos, op, site, access: prior } => {
                if clock.covers(*lane, *pos) || !prior.overlaps(access) {
                    continue;
                }
                if let Some(kind) = conflict(prior.mode, access.mode) {
                    found.push((kind, OpRef { op: op.to_string(), site: *site }, **prior));
                }
            }
            Record::Launch { launch } => {
                let Some(l) = launches.get(launch) else { continue };
                for (node, prior) in l.summary.accesses_of(access.memory) {
                    if clock.covers(Lane::Launch(*launch, node.lane), node.pos) || !prior.overlaps(access) {
                        continue;
                    }
                    if let Some(kind) = conflict(prior.mode, access.mode) {
                        let site = Site::Graph { graph: l.graph, stream: l.stream };
                        found.push((kind, OpRef { op: node.op.to_string(), site }, *prior));
                        break;
                    }
                }
            }
        }
    }
    let mut seen = Vec::new();
    found.retain(|(_, earlier, _)| {
        let first = !seen.contains(&earlier.site);
        seen.push(earlier.site);
        first
    });
    for (kind, earlier, prior) in found {
        let fix = fix_for(&earlier, later);
        let bytes = Some(byte_range(access, &prior));
        hazards.push(Hazard {
            kind,
            buffer: Some(access.buffer),
            bytes,
            event: None,
            earlier: Some(earlier),
            later: later.clone(),
            at: None,
            fix,
        });
    }
}

impl Checker {
    /// A new checker, not attached to any device (see [`Device::sim`] and
    /// [`Device::cuda_checked`](crate::device::Device::cuda_checked)).
    pub(crate) fn new_observer(strict: bool) -> Arc<dyn Observer> {
        Checker::build(strict, false)
    }

    /// A checker that watches captures only: it builds every graph's access summary (for the
    /// graph layer's capture-time verification, see [`Checker::sync_point`]) and reports races
    /// inside captures, and costs eager work and replays one atomic load.
    pub(crate) fn new_capture_observer() -> Arc<dyn Observer> {
        Checker::build(false, true)
    }

    fn build(strict: bool, captures_only: bool) -> Arc<dyn Observer> {
        let inner = Inner {
            strict: AtomicBool::new(strict),
            captures_only,
            active: AtomicUsize::new(0),
            state: Mutex::default(),
        };
        Arc::new(Checker { inner: Arc::new(inner) })
    }

    /// Whether `graph` writes memory that `access` touches; `None` if this checker did not see
    /// its capture.
    pub fn graph_writes(&self, graph: GraphId, access: &Access) -> Option<bool> {
        self.lock().graphs.get(&graph).map(|g| g.writes_overlapping(access))
    }

    /// Where `event` is recorded inside `graph` and what the graph does after it (the tail), from
    /// the access summary of its capture; `None` if this checker did not see the capture.
    pub fn sync_point(&self, graph: GraphId, event: EventId) -> Option<SyncPoint> {
        self.lock().graphs.get(&graph).map(|g| g.sync_point(event))
    }

    /// The checker of `dev`, if it has one.
    pub fn of(dev: &Device) -> Option<Checker> {
        dev.observer().and_then(|o| o.as_any().downcast_ref::<Checker>()).cloned()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every hazard found so far.
    pub fn hazards(&self) -> Vec<Hazard> {
        self.lock().hazards.clone()
    }

    /// Returns the hazards found so far and forgets them.
    pub fn take_hazards(&self) -> Vec<Hazard> {
        std::mem::take(&mut self.lock().hazards)
    }

    /// The hazards as JSON, for tools.
    pub fn hazards_json(&self) -> String {
        serde_json::to_string_pretty(&self.hazards()).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// In strict mode a call that creates a hazard returns [`Error::Hazard`] instead of
    /// recording a report (the call's work was already enqueued).
    pub fn set_strict(&self, strict: bool) {
        self.inner.strict.store(strict, Ordering::Relaxed);
    }

    /// Shows each hazard found since `before` once, through `tracing` (a warning), and counts it;
    /// in strict mode raises the first as the call's error, else keeps the first
    /// [`MAX_KEPT_HAZARDS`].
    fn finish(&self, st: &mut State, before: usize) -> Result<()> {
        for h in &st.hazards[before..] {
            tracing::warn!("stream-safety checker: {h}");
        }
        st.found += (st.hazards.len() - before) as u64;
        if self.inner.strict.load(Ordering::Relaxed) && st.hazards.len() > before {
            let h = st.hazards.remove(before);
            st.hazards.truncate(before);
            return Err(Error::Hazard(Box::new(h)));
        }
        st.hazards.truncate(MAX_KEPT_HAZARDS);
        Ok(())
    }

    /// How many hazards were found since the checker began, including those not kept and those
    /// taken with [`take_hazards`](Checker::take_hazards).
    pub fn found(&self) -> u64 {
        self.lock().found
    }

    /// Whether it checks every operation (the simulator, or CUDA with `GRAPHED_CHECK`), not only
    /// captures.
    pub fn checks_everything(&self) -> bool {
        !self.inner.captures_only
    }
}

impl Observer for Checker {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn watching(&self) -> bool {
        !self.inner.captures_only || self.inner.active.load(Ordering::Relaxed) > 0
    }

    fn enqueue(&self, stream: StreamId, capture: Option<u64>, op: &'static str, accesses: &[Access]) -> Result<()> {
        if capture.is_none() && self.inner.captures_only {
            return Ok(());
        }
        let mut st = self.lock();
        if let Some(cap) = capture.and_then(|id| st.captures.get_mut(&id).map(|c| (id, c))) {
            let (id, c) = cap;
            let clock = c.streams.entry(stream).or_default();
            let lane = Lane::Capture(id, stream.raw());
            let pos = clock.tick(lane);
            c.nodes.push(Node::captured(op, lane, pos, clock.clone(), accesses));
            return Ok(());
        }
        let before = st.hazards.len();
        let State { streams, host, shadow, launches, hazards, .. } = &mut *st;
        let clock = streams.entry(stream).or_default();
        clock.join(host);
        let lane = Lane::Stream(stream.raw());
        let pos = clock.tick(lane);
        let later = OpRef { op: op.to_string(), site: Site::Stream(stream) };
        for a in accesses {
            check(shadow, launches, hazards, clock, &later, a);
        }
        for a in accesses {
            let rec = Record::Op { lane, pos, op, site: Site::Stream(stream), access: Box::new(*a) };
            st.remember(a.memory, rec);
        }
        self.finish(&mut st, before)
    }

    fn record(&self, stream: StreamId, capture: Option<u64>, event: EventId, external: bool) -> Result<()> {
        if capture.is_none() && self.inner.captures_only {
            return Ok(());
        }
        let mut st = self.lock();
        let snap = match capture.and_then(|id| st.captures.get_mut(&id).map(|c| (id, c))) {
            Some((id, c)) => {
                let clock = c.streams.entry(stream).or_default().clone();
                if external {
                    c.records.push((event, clock.clone()));
                }
                Snapshot::Captured { capture: id, clock }
            }
            None => Snapshot::At(st.stream_clock(stream).clone()),
        };
        st.events.insert(event, snap);
        Ok(())
    }

    fn wait(
        &self,
        stream: StreamId,
        capture: Option<u64>,
        event: EventId,
        external: bool,
        at: Option<&str>,
    ) -> Result<()> {
        if self.inner.captures_only && (capture.is_none() || external) {
            return Ok(());
        }
        let mut st = self.lock();
        let before = st.hazards.len();
        let snap = st.events.get(&event).cloned();
        match (capture, snap) {
            (Some(id), _) if external => {
                if let Some(c) = st.captures.get_mut(&id) {
                    c.waits.push(event);
                }
            }
            (_, None) if !self.inner.captures_only => {
                let later = OpRef { op: "wait".into(), site: Site::Stream(stream) };
                st.hazards.push(Hazard {
                    kind: HazardKind::WaitNeverRecorded,
                    buffer: None,
                    bytes: None,
                    event: Some(event),
                    earlier: None,
                    later,
                    at: at.map(str::to_string),
                    fix: format!("record {event} (inside the graph, with record_external, if a graph is to signal it) before waiting on it; this wait orders nothing"),
                });
            }
            (_, None) => {}
            (_, Some(Snapshot::At(clock))) => st.stream_clock(stream).join(&clock),
            (_, Some(Snapshot::Launched { clock, launch, graph, stream: on })) => {
                st.stream_clock(stream).join(&clock);
                if let Some(&(_, newer_graph)) = st.stream_launch.get(&on).filter(|(l, _)| *l != launch) {
                    st.hazards.push(Hazard {
                        kind: HazardKind::StaleRecord,
                        buffer: None,
                        bytes: None,
                        event: Some(event),
                        earlier: Some(OpRef { op: format!("launch of {newer_graph}"), site: Site::Graph { graph: newer_graph, stream: on } }),
                        later: OpRef { op: "wait".into(), site: Site::Stream(stream) },
                        at: at.map(str::to_string),
                        fix: format!("this wait binds to {event} as recorded by the earlier launch of {graph}, not to the later launch of {newer_graph} on stream {on}; wait right after the launch you depend on, or give each graph its own event"),
                    });
                }
            }
            (_, Some(Snapshot::Captured { capture: cap, clock })) => {
                if let Some(c) = st.captures.get_mut(&cap) {
                    c.streams.entry(stream).or_default().join(&clock);
                }
            }
        }
        self.finish(&mut st, before)
    }

    fn begin_capture(&self, stream: StreamId, capture: u64) {
        self.inner.active.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock();
        let mut streams = HashMap::new();
        streams.insert(stream, Clock::default());
        st.captures.insert(capture, Capture { streams, nodes: vec![], records: vec![], waits: vec![] });
    }

    fn end_capture(&self, capture: u64, graph: Option<GraphId>) -> Result<()> {
        let mut st = self.lock();
        let before = st.hazards.len();
        let Some(c) = st.captures.remove(&capture) else { return Ok(()) };
        self.inner.active.fetch_sub(1, Ordering::Relaxed);
        if let Some(graph) = graph {
            let (summary, races) = GraphSummary::build(graph, c.nodes, c.records, c.waits);
            st.hazards.extend(races);
            st.graphs.insert(graph, Arc::new(summary));
        }
        self.finish(&mut st, before)
    }

    fn launch(&self, graph: GraphId, exec: u64, stream: StreamId) -> Result<()> {
        if self.inner.captures_only {
            return Ok(());
        }
        let mut st = self.lock();
        let before = st.hazards.len();
        if st.patches.get(&exec).is_some_and(|p| p.stale) {
            st.repatch(graph, exec);
        }
        let Some(summary) = st.rebound.get(&exec).or_else(|| st.graphs.get(&graph)).cloned() else { return Ok(()) };
        st.next_launch += 1;
        let launch = st.next_launch;
        let host = st.host.clone();
        let mut entry = st.stream_clock(stream).clone();
        entry.join(&host);
        if let Some(previous) = st.exec_end.get(&exec) {
            entry.join(&previous.clone());
        }
        for e in &summary.waits {
            if let Some(c) = st.events.get(e).and_then(Snapshot::at) {
                entry.join(&c.clone());
            }
        }
        let later_site = Site::Graph { graph, stream };
        for (node, access) in summary.footprint() {
            let later = OpRef { op: node.op.to_string(), site: later_site };
            st.check(&entry, &later, access);
        }
        st.launches.insert(launch, Launch { graph, stream, summary: summary.clone() });
        for memory in summary.memories() {
            st.remember(memory, Record::Launch { launch });
        }
        for (event, clock) in summary.records_at(launch, &entry) {
            st.events.insert(event, Snapshot::Launched { clock, launch, graph, stream });
        }
        st.stream_launch.insert(stream, (launch, graph));
        let after = summary.end_clock(launch, &entry);
        st.exec_end.insert(exec, after.clone());
        let s = st.stream_clock(stream);
        s.join(&after);
        s.tick(Lane::Stream(stream.raw()));
        st.last_launch.insert(graph, launch);
        self.finish(&mut st, before)
    }

    fn reset(&self, graph: GraphId, exec: u64) -> Result<()> {
        let mut st = self.lock();
        st.rebound.remove(&exec);
        st.patches.remove(&exec);
        if self.inner.captures_only {
            return Ok(());
        }
        let before = st.hazards.len();
        if let Some(launch) = st.last_launch.remove(&graph) {
            if let Some(l) = st.launches.get(&launch) {
                if !l.summary.lanes_end(launch).all(|(lane, pos)| st.host.covers(lane, pos)) {
                    let stream = l.stream;
                    st.hazards.push(Hazard {
                        kind: HazardKind::TailNotJoined,
                        buffer: None,
                        bytes: None,
                        event: None,
                        earlier: Some(OpRef { op: format!("launch of {graph}"), site: Site::Graph { graph, stream } }),
                        later: OpRef { op: "GraphExec::reset".into(), site: Site::Host },
                        at: None,
                        fix: format!("synchronize stream {stream} (or an event recorded on it after the launch) before resetting the graph"),
                    });
                }
            }
        }
        self.finish(&mut st, before)
    }

    fn rebind(&self, _graph: GraphId, exec: u64, remaps: &[crate::device::patch::Remap]) -> Result<()> {
        if self.inner.captures_only {
            // Launches are not checked: their summaries are not needed.
            return Ok(());
        }
        let mut st = self.lock();
        let patch = st.patches.entry(exec).or_default();
        (patch.remaps, patch.stale) = (remaps.to_vec(), true);
        Ok(())
    }

    fn set_enabled(&self, _graph: GraphId, exec: u64, sites: usize, disabled: &[usize]) -> Result<()> {
        if self.inner.captures_only {
            return Ok(());
        }
        let mut st = self.lock();
        let patch = st.patches.entry(exec).or_default();
        (patch.sites, patch.disabled, patch.stale) = (sites, disabled.to_vec(), true);
        Ok(())
    }

    fn host_sync(&self, what: HostSync) {
        if self.inner.captures_only {
            return;
        }
        let mut st = self.lock();
        match what {
            HostSync::Stream(s) => {
                let c = st.stream_clock(s).clone();
                st.host.join(&c);
            }
            HostSync::Event(e) => {
                if let Some(c) = st.events.get(&e).and_then(Snapshot::at).cloned() {
                    st.host.join(&c);
                }
            }
            HostSync::Device => {
                let all: Vec<Clock> = st.streams.values().cloned().collect();
                for c in all {
                    st.host.join(&c);
                }
            }
        }
        st.collect_garbage();
    }

    fn host_access(&self, op: &'static str, after: Option<StreamId>, accesses: &[Access]) -> Result<()> {
        if self.inner.captures_only {
            return Ok(());
        }
        let mut st = self.lock();
        let before = st.hazards.len();
        if let Some(s) = after {
            let c = st.stream_clock(s).clone();
            st.host.join(&c);
            st.collect_garbage();
        }
        let pos = st.host.tick(Lane::Host);
        let clock = st.host.clone();
        let later = OpRef { op: op.to_string(), site: Site::Host };
        for a in accesses {
            st.check(&clock, &later, a);
        }
        for a in accesses {
            st.remember(a.memory, Record::Op { lane: Lane::Host, pos, op, site: Site::Host, access: Box::new(*a) });
        }
        self.finish(&mut st, before)
    }
}
