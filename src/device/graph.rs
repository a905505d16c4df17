//! Captured graphs and their executables.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use std::sync::{Arc, Mutex, PoisonError};

use super::backend::{dispatch, ExecRepr, GraphRepr};
use super::comm::{CapturedCollective, GraphCollectives};
use super::memory::Block;
use super::patch::{self, Bound, Rebind, Remap, Site};
use super::{ids, Device, EventId, GraphId, Stream};
use crate::{Error, Result};

/// The kind of a graph node (CUDA's `CUgraphNodeType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeKind {
    /// A kernel launch (also what library calls such as cuBLAS capture as).
    Kernel,
    /// A memory copy.
    Memcpy,
    /// A memset.
    Memset,
    /// An external event record.
    EventRecord,
    /// An external event wait.
    EventWait,
    /// A node with no work.
    Empty,
    /// A host function.
    Host,
    /// A child graph.
    ChildGraph,
    /// A stream-ordered allocation (graphed never captures these).
    MemAlloc,
    /// A stream-ordered free (graphed never captures these).
    MemFree,
    /// A node type graphed does not know, by its CUDA number.
    Other(u32),
}

/// One node of a captured graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its kind.
    pub kind: NodeKind,
    /// The kernel name for kernel nodes, else a short description.
    pub name: String,
    /// Indices (into the node list) of the nodes it depends on.
    pub deps: Vec<usize>,
    /// For event-record and event-wait nodes, the event.
    pub event: Option<EventId>,
}

/// A captured graph (CUDA's `CUgraph`): inspect it, then [`instantiate`](Graph::instantiate) it.
/// It keeps alive every buffer and event its nodes use, and knows, from its capture, the
/// collectives it holds: a wait on their group that fails names the launch, the graph and the
/// collective (see [`Communicator::wait`](super::Communicator::wait)).
pub struct Graph {
    dev: Device,
    id: GraphId,
    repr: GraphRepr,
    info: Arc<GraphCollectives>,
    /// How each captured operation's node names buffers (see [`Rebind`]), and where each block
    /// is named.
    sites: Arc<[Site]>,
    index: Arc<patch::UseIndex>,
}

impl Graph {
    pub(crate) fn new(dev: Device, repr: GraphRepr, info: GraphCollectives) -> Result<Graph> {
        let sites = dispatch!(dev.backend(), |b, pick| b.graph_sites(pick!(repr)));
        let index = Arc::new(patch::UseIndex::of(&sites));
        Ok(Graph { dev, id: GraphId(ids::next_id()), repr, info: Arc::new(info), sites, index })
    }

    /// Whether a node names `block`.
    pub(crate) fn names(&self, block: super::BufferId) -> bool {
        self.index.names(block)
    }

    /// Whether its executables would accept `rebinds` ([`GraphExec::rebind`]), changing nothing.
    ///
    /// # Errors
    /// [`Error::Rebind`] with the reason one would be refused.
    pub fn check_rebind(&self, rebinds: &[Rebind<'_>]) -> Result<()> {
        patch::plan(self.id, &self.sites, &self.index, rebinds)
            .map(|_| ())
            .map_err(|kind| Error::Rebind { graph: self.id, kind })
    }

    /// The uses that `rebind` moves in its executables, found and checked once, for
    /// [`GraphExec::rebind_resolved`].
    ///
    /// # Errors
    /// As [`check_rebind`](Graph::check_rebind).
    pub(crate) fn resolve(&self, rebind: &Rebind<'_>) -> Result<patch::Resolved> {
        patch::resolve(self.id, &self.sites, &self.index, rebind).map_err(|kind| Error::Rebind { graph: self.id, kind })
    }

    /// The graph's identity (shared by its executables).
    pub fn id(&self) -> GraphId {
        self.id
    }

    /// The collectives it holds, in capture order, as its capture recorded them.
    ///
    /// ```
    /// use graphed::device::{CaptureMode, CommOptions, Communicator, Device};
    /// let comm = Communicator::sim_group(&[Device::sim()], CommOptions::default())?.remove(0);
    /// let s = comm.device().stream()?;
    /// let x = comm.device().alloc::<f32>(8)?;
    /// let cap = s.capture(CaptureMode::ThreadLocal)?;
    /// comm.all_reduce(&s, &x)?;
    /// let graph = cap.finish()?;
    /// assert_eq!(graph.collectives()[0].to_string(),
    ///            "all_reduce of 8 × f32 (collective 1 of 1 in the graph, rank 0 of a group of 1)");
    /// # Ok::<(), graphed::Error>(())
    /// ```
    pub fn collectives(&self) -> &[CapturedCollective] {
        self.info.collectives()
    }

    /// Names the graph (for its executables too) in the reports of the collectives it holds;
    /// the graph layer names its graphs by module and pass.
    pub fn set_name(&self, name: &str) {
        self.info.set_name(name);
    }

    /// The name given with [`set_name`](Graph::set_name), if any.
    pub fn name(&self) -> Option<String> {
        self.info.name().map(|n| n.to_string())
    }

    /// The device it was captured on.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Its nodes, in a topological order.
    pub fn nodes(&self) -> Result<Vec<NodeInfo>> {
        dispatch!(self.dev.backend(), |b, pick| b.graph_nodes(pick!(self.repr)))
    }

    /// How many nodes of each kind.
    pub fn node_counts(&self) -> Result<BTreeMap<NodeKind, usize>> {
        let mut counts = BTreeMap::new();
        for n in self.nodes()? {
            *counts.entry(n.kind).or_insert(0) += 1;
        }
        Ok(counts)
    }

    /// The events that the graph's external event-record nodes record, in node order.
    pub fn external_record_events(&self) -> Result<Vec<EventId>> {
        Ok(self.nodes()?.into_iter().filter(|n| n.kind == NodeKind::EventRecord).filter_map(|n| n.event).collect())
    }

    /// The graph in Graphviz DOT (on CUDA, the driver's verbose dump).
    pub fn dot(&self) -> Result<String> {
        dispatch!(self.dev.backend(), |b, pick| b.graph_dot(pick!(self.repr)))
    }

    /// Instantiates an executable graph, with the nodes captured inside
    /// [`Stream::capture_off`](super::Stream::capture_off) turned off.
    pub fn instantiate(&self) -> Result<GraphExec> {
        let repr = dispatch!(self.dev.backend(), |b, pick| b.wrap_exec(b.instantiate(pick!(self.repr))?));
        let off: Vec<usize> = self.sites.iter().enumerate().filter(|(_, s)| s.off).map(|(i, _)| i).collect();
        if !off.is_empty() {
            dispatch!(self.dev.backend(), |b, pick| b.set_enabled(pick!(repr), &off, false))?;
        }
        let (info, sites, index) = (self.info.clone(), self.sites.clone(), self.index.clone());
        let exec = GraphExec {
            dev: self.dev.clone(),
            id: self.id,
            exec: ids::next_id(),
            repr: Some(repr),
            info,
            sites,
            index,
            rebound: Mutex::new(Rebound { disabled: off.clone(), ..Rebound::default() }),
        };
        if let (Some(o), false) = (self.dev.observer(), off.is_empty()) {
            o.set_enabled(exec.id, exec.exec, exec.sites.len(), &off)?;
        }
        Ok(exec)
    }
}

/// Where an executable's rebound uses point now.
#[derive(Default)]
struct Rebound {
    /// The uses that point elsewhere than where they were captured, and where.
    bound: patch::Bindings,
    /// The blocks they point at, once each: every launch notes its stream on them, so that
    /// memory freed while a launch reads it is reused in stream order.
    blocks: Vec<Arc<Block>>,
    /// Whether a failed rebind left some nodes moved and others not.
    broken: bool,
    /// The sites whose nodes are turned off ([`GraphExec::set_enabled`]), in order.
    disabled: Vec<usize>,
}

/// An executable graph (CUDA's `CUgraphExec`): launch it on any stream of its device. Launches
/// of one executable run one after another, whatever streams they are launched on.
pub struct GraphExec {
    dev: Device,
    id: GraphId,
    /// This executable's own identity (a graph may be instantiated more than once).
    exec: u64,
    repr: Option<ExecRepr>,
    info: Arc<GraphCollectives>,
    sites: Arc<[Site]>,
    index: Arc<patch::UseIndex>,
    rebound: Mutex<Rebound>,
}

impl GraphExec {
    /// The identity of the graph it was instantiated from.
    pub fn id(&self) -> GraphId {
        self.id
    }

    fn repr(&self, op: &'static str) -> Result<&ExecRepr> {
        self.repr.as_ref().ok_or(Error::GraphReset { op })
    }

    fn check_stream(&self, op: &'static str, stream: &Stream) -> Result<()> {
        self.dev.check_same(op, "stream", stream.device().id())
    }

    /// Uploads the executable's work descriptors to the device ahead of the first launch.
    pub fn upload(&self, stream: &Stream) -> Result<()> {
        const OP: &str = "GraphExec::upload";
        self.dev.check_err()?;
        self.check_stream(OP, stream)?;
        let repr = self.repr(OP)?;
        dispatch!(self.dev.backend(), |b, pick| b.upload(pick!(repr), pick!(stream.repr())))
    }

    /// The collectives its graph holds (see [`Graph::collectives`]).
    pub fn collectives(&self) -> &[CapturedCollective] {
        self.info.collectives()
    }

    /// Launches the graph on `stream` (any stream of the device, not only the capture stream).
    /// A graph that holds collectives is noted by their communicators, with an event recorded
    /// after the launch, for the report of a wait on them that fails. An executable that a failed
    /// [`rebind`](GraphExec::rebind) left half moved is refused ([`Error::Rebind`]).
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        const OP: &str = "GraphExec::launch";
        self.dev.check_err()?;
        self.check_stream(OP, stream)?;
        let repr = self.repr(OP)?;
        if self.rebound().broken {
            return Err(Error::Rebind { graph: self.id, kind: patch::RebindErrorKind::Broken });
        }
        let comms = match self.info.collectives() {
            [] => Vec::new(),
            _ => self.info.before_launch(),
        };
        dispatch!(self.dev.backend(), |b, pick| b.launch(pick!(repr), pick!(stream.repr())))?;
        for block in &self.rebound().blocks {
            block.note_use(stream.id());
        }
        if let Some(o) = self.dev.observer() {
            o.launch(self.id, self.exec, stream.id())?;
        }
        if comms.is_empty() {
            return Ok(());
        }
        self.info.launched(self.id, stream, comms)
    }

    fn rebound(&self) -> std::sync::MutexGuard<'_, Rebound> {
        // Updated only after the backend accepted a rebind: consistent after a panic.
        self.rebound.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Points the executable's captured reads of each rebind's `from` at its `to`, for every
    /// later launch (launches already queued read what they were launched with): a replay then
    /// reads the caller's buffers in place, with nothing copied in. Reads rebound by an earlier
    /// call and not named here stay rebound. The executable holds the buffers it reads until they
    /// are rebound again, and the checker sees the launches read them. Returns how many nodes
    /// changed (none when every use already points there, so a rebind per replay with the same
    /// buffers costs no driver call). A node whose moved addresses its kernel reads from a table
    /// (the offload switch's device copies) counts, though on CUDA only the table changes.
    ///
    /// The buffers are read while a launch runs, not when it is enqueued: keep their contents
    /// until the launches that read them are done, as for any operand of queued work.
    ///
    /// # Errors
    /// [`Error::Rebind`] when a node that names the bytes writes them, reads them through a
    /// library call graphed does not lay out (a GEMM, attention, a collective), or reads bytes
    /// partly outside them, or when no node reads them; [`Error::WrongDevice`] for a buffer of
    /// another device; [`Error::GraphReset`] after [`reset`](GraphExec::reset). A refused call
    /// changes nothing.
    pub fn rebind(&self, rebinds: &[Rebind<'_>]) -> Result<usize> {
        const OP: &str = "GraphExec::rebind";
        self.dev.check_err()?;
        for r in rebinds {
            self.dev.check_same(OP, "buffer", r.from.raw.device)?;
            self.dev.check_same(OP, "buffer", r.to.raw.device)?;
        }
        let repr = self.repr(OP)?;
        if self.rebound().broken {
            return Err(Error::Rebind { graph: self.id, kind: patch::RebindErrorKind::Broken });
        }
        let identity = |r: &Rebind<'_>| r.from.id == r.to.id && r.from_start == r.to_start;
        if rebinds.iter().all(identity) && self.rebound().blocks.is_empty() {
            // Everything already reads where it was captured (a copy-in replay's check).
            return Ok(0);
        }
        let planned = patch::plan(self.id, &self.sites, &self.index, rebinds)
            .map_err(|kind| Error::Rebind { graph: self.id, kind })?;
        let moved = rebinds
            .iter()
            .zip(&planned)
            .flat_map(|(r, p)| p.moves.iter().map(|&(s, u, off)| (s, u, r.to, r.to_start + off)));
        self.apply(repr, &moved.collect::<Vec<_>>())
    }

    /// The uses that `rebind` moves, found and checked once, for
    /// [`rebind_resolved`](GraphExec::rebind_resolved).
    ///
    /// # Errors
    /// As [`rebind`](GraphExec::rebind) refuses it.
    pub(crate) fn resolve(&self, rebind: &Rebind<'_>) -> Result<patch::Resolved> {
        patch::resolve(self.id, &self.sites, &self.index, rebind).map_err(|kind| Error::Rebind { graph: self.id, kind })
    }

    /// Points the uses of each [`resolve`](GraphExec::resolve)d rebind at the block and byte
    /// given (back where they were captured for `None`), as [`rebind`](GraphExec::rebind) does
    /// but without finding them again: what an offload switch calls for the same uses at every
    /// switch.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] for a destination with fewer bytes from there than the rebind
    /// moves; [`Error::WrongDevice`]; as [`rebind`](GraphExec::rebind). A refused call changes
    /// nothing.
    pub(crate) fn rebind_resolved(&self, rebinds: &[patch::ResolvedRebind<'_>]) -> Result<usize> {
        const OP: &str = "GraphExec::rebind";
        self.dev.check_err()?;
        let mut moved = Vec::new();
        for &(resolved, to) in rebinds {
            if resolved.graph != self.id {
                let why = "a rebind resolved in an executable of another graph; please report this as a bug";
                return Err(Error::Unsupported { op: OP, backend: "any", why });
            }
            match to {
                Some((block, start)) => {
                    self.dev.check_same(OP, "buffer", block.raw.device)?;
                    let room = block.bytes.saturating_sub(start);
                    if room < resolved.bytes {
                        return Err(Error::LengthMismatch { op: OP, src: resolved.bytes, dst: room });
                    }
                    moved.extend(resolved.moves.iter().map(|&(s, u, off)| (s, u, block, start + off)));
                }
                None => moved.extend(resolved.moves.iter().map(|&(s, u, _)| {
                    let captured = &self.sites[s].uses[u];
                    (s, u, &captured.block, captured.start)
                })),
            }
        }
        let repr = self.repr(OP)?;
        self.apply(repr, &moved)
    }

    /// Points each use of `moved` (site, use, block, first byte) where it says, for later
    /// launches; the one path of [`rebind`](GraphExec::rebind) and
    /// [`rebind_resolved`](GraphExec::rebind_resolved). The bindings are changed in place, with
    /// an undo list for a refused backend call, rather than copied whole at every call (a count
    /// taken and dropped on a block per binding, most of them unchanged).
    fn apply(&self, repr: &ExecRepr, moved: &[(usize, usize, &Arc<Block>, usize)]) -> Result<usize> {
        let mut st = self.rebound();
        if st.broken {
            return Err(Error::Rebind { graph: self.id, kind: patch::RebindErrorKind::Broken });
        }
        let key = |e: &((usize, usize), Bound)| e.0;
        // Where use `u` of site `s` was captured: its block and first byte.
        let captured = |s: usize, u: usize| {
            let x = &self.sites[s].uses[u];
            (x.block.id, x.start)
        };
        if st.bound.is_empty() && moved.iter().all(|&(s, u, block, start)| captured(s, u) == (block.id, start)) {
            // A copy-in replay's check: everything reads where it was captured.
            return Ok(0);
        }
        // The last move of each use wins (two rebinds of one call may name the same bytes), in
        // (site, use) order: a stable sort keeps a use's moves in call order.
        let mut moves: Vec<&(usize, usize, &Arc<Block>, usize)> = moved.iter().collect();
        moves.sort_by_key(|m| (m.0, m.1));
        moves.dedup_by(|later, kept| {
            let same = (later.0, later.1) == (kept.0, kept.1);
            if same {
                *kept = *later;
            }
            same
        });
        // Per use moved, where it pointed before (`None`: where it was captured), to undo.
        let mut undo: Vec<((usize, usize), Option<Bound>)> = Vec::with_capacity(moves.len());
        let mut added = Vec::new();
        let mut back = false;
        let mut changed = Vec::with_capacity(moves.len());
        for &&(s, u, block, start) in &moves {
            let (there, at_capture) = ((block.id, start), captured(s, u));
            let at = st.bound.binary_search_by_key(&(s, u), key);
            let now = at.map_or(at_capture, |i| (st.bound[i].1.block.id, st.bound[i].1.start));
            if now == there {
                continue;
            }
            changed.push((s, !matches!(self.sites[s].uses[u].slot, patch::Slot::Indirect(_))));
            let to = Bound { block: block.clone(), start };
            match at {
                Ok(i) => {
                    // A use moved back where it was captured keeps its entry until the end.
                    back |= there == at_capture;
                    undo.push(((s, u), Some(std::mem::replace(&mut st.bound[i].1, to))));
                }
                Err(_) => {
                    undo.push(((s, u), None));
                    added.push(((s, u), to));
                }
            }
        }
        if changed.is_empty() {
            return Ok(0);
        }
        if !added.is_empty() {
            // Both runs are sorted: the sort merges them.
            st.bound.append(&mut added);
            st.bound.sort_by_key(key);
        }
        if back {
            st.bound.retain(|((s, u), b)| (b.block.id, b.start) != captured(*s, *u));
        }
        // One entry per site (in site order, as the moves), its node changed if any of its
        // moved uses is the node's own.
        changed.dedup_by(|later, kept| {
            later.0 == kept.0 && {
                kept.1 |= later.1;
                true
            }
        });
        let applied = dispatch!(self.dev.backend(), |b, pick| {
            b.rebind(pick!(repr), &self.sites, &patch::changes(&changed, &st.bound))
        });
        if let Err(e) = applied {
            // Some sites may have moved: put them back, or refuse every later launch of a
            // half-moved executable.
            for ((s, u), before) in undo.into_iter().rev() {
                match (st.bound.binary_search_by_key(&(s, u), key), before) {
                    (Ok(i), Some(b)) => st.bound[i].1 = b,
                    (Ok(i), None) => {
                        st.bound.remove(i);
                    }
                    (Err(i), Some(b)) => st.bound.insert(i, ((s, u), b)),
                    (Err(_), None) => {}
                }
            }
            let undone = dispatch!(self.dev.backend(), |b, pick| {
                b.rebind(pick!(repr), &self.sites, &patch::changes(&changed, &st.bound))
            });
            st.broken |= undone.is_err();
            return Err(e);
        }
        let mut blocks: Vec<Arc<Block>> = Vec::new();
        for (_, b) in &st.bound {
            if !blocks.iter().any(|k| k.id == b.block.id) {
                blocks.push(b.block.clone());
            }
        }
        st.blocks = blocks;
        let observed = self.dev.observer().filter(|o| o.watching()).map(|o| {
            let remaps = st.bound.iter().map(|((s, u), b)| Remap::of(&self.sites[*s].uses[*u], b)).collect::<Vec<_>>();
            (o, remaps)
        });
        drop(st);
        if let Some((o, remaps)) = observed {
            o.rebind(self.id, self.exec, &remaps)?;
        }
        Ok(changed.len())
    }

    /// The operations of the nodes turned off now ([`set_enabled`](GraphExec::set_enabled) and
    /// [`Stream::capture_off`](super::Stream::capture_off)), in capture order: `memcpy_d2h` and
    /// `memcpy_h2d` where offloaded tensors are kept resident, say.
    pub fn disabled_ops(&self) -> Vec<&'static str> {
        self.rebound().disabled.iter().map(|&s| self.sites[s].op).collect()
    }

    /// How many captured nodes name `buffer`.
    pub(crate) fn naming(&self, buffer: super::BufferId) -> usize {
        self.index.sites_naming(buffer).count()
    }

    /// Whether a captured node names `buffer`.
    pub(crate) fn names(&self, buffer: super::BufferId) -> bool {
        self.index.names(buffer)
    }

    /// Turns off (`enabled == false`) or on again every node that names one of `buffers` (any
    /// of its bytes), for later launches: a node turned off does nothing, and what waited on it still
    /// waits on what it waited on (CUDA's `cuGraphNodeSetEnabled`, which keeps a disabled node's
    /// edges; HIP's drops them). Only kernels, copies and memsets can be turned off. The checker
    /// sees the launches without what the nodes turned off read and write. Returns how many nodes
    /// changed.
    ///
    /// ```
    /// use graphed::device::{CaptureMode, Device};
    /// use graphed::ops::elementwise;
    ///
    /// let dev = Device::sim();
    /// let s = dev.stream()?;
    /// let (x, y) = (dev.alloc_from(&s, &[1.0f32, 2.0])?, dev.alloc_from(&s, &[0.0f32; 2])?);
    /// let cap = s.capture(CaptureMode::ThreadLocal)?;
    /// elementwise::add_scalar(x.view(), 1.0, &s)?;
    /// elementwise::scale(y.view(), x.view(), 10.0, &s)?;
    /// let exec = cap.finish()?.instantiate()?;
    /// assert_eq!(exec.set_enabled(&[y.id()], false)?, 1); // the scale is off
    /// exec.launch(&s)?;
    /// assert_eq!((x.to_vec(&s)?, y.to_vec(&s)?), (vec![2.0, 3.0], vec![0.0, 0.0]));
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Rebind`] when no node names one of `buffers` or a library call or collective
    /// does (its nodes are the library's); [`Error::GraphReset`] after
    /// [`reset`](GraphExec::reset). A refused call changes nothing.
    pub fn set_enabled(&self, buffers: &[super::BufferId], enabled: bool) -> Result<usize> {
        let named = self.sites_naming(buffers)?;
        self.set_sites_enabled(&named, enabled)
    }

    /// The sites of the nodes that name `buffers`, sorted, found and checked once for
    /// [`set_sites_enabled`](GraphExec::set_sites_enabled).
    ///
    /// # Errors
    /// As [`set_enabled`](GraphExec::set_enabled) refuses them.
    pub(crate) fn sites_naming(&self, buffers: &[super::BufferId]) -> Result<Vec<usize>> {
        let mut named = Vec::new();
        for &buffer in buffers {
            let sites = patch::naming(&self.sites, &self.index, buffer);
            named.extend(sites.map_err(|kind| Error::Rebind { graph: self.id, kind })?);
        }
        named.sort_unstable();
        named.dedup();
        Ok(named)
    }

    /// Turns the nodes of `sites` (sorted, from [`sites_naming`](GraphExec::sites_naming)) off
    /// or on, as [`set_enabled`](GraphExec::set_enabled) does without finding them again.
    pub(crate) fn set_sites_enabled(&self, sites: &[usize], enabled: bool) -> Result<usize> {
        const OP: &str = "GraphExec::set_enabled";
        self.dev.check_err()?;
        let repr = self.repr(OP)?;
        let mut st = self.rebound();
        if st.broken {
            return Err(Error::Rebind { graph: self.id, kind: patch::RebindErrorKind::Broken });
        }
        let changed: Vec<usize> =
            sites.iter().copied().filter(|s| st.disabled.binary_search(s).is_ok() == enabled).collect();
        if changed.is_empty() {
            return Ok(0);
        }
        let applied = dispatch!(self.dev.backend(), |b, pick| b.set_enabled(pick!(repr), &changed, enabled));
        if let Err(e) = applied {
            // Some nodes may have changed: put them back, or refuse every later launch.
            let undone = dispatch!(self.dev.backend(), |b, pick| b.set_enabled(pick!(repr), &changed, !enabled));
            st.broken |= undone.is_err();
            return Err(e);
        }
        for s in &changed {
            match (st.disabled.binary_search(s), enabled) {
                (Ok(i), true) => {
                    st.disabled.remove(i);
                }
                (Err(i), false) => st.disabled.insert(i, *s),
                _ => {}
            }
        }
        let disabled = self.dev.observer().filter(|o| o.watching()).map(|o| (o, st.disabled.clone()));
        drop(st);
        if let Some((o, disabled)) = disabled {
            o.set_enabled(self.id, self.exec, self.sites.len(), &disabled)?;
        }
        Ok(changed.len())
    }

    /// Destroys the executable now; later launches return [`Error::GraphReset`]. Launches
    /// already queued complete normally. Join the last launch first (replay contract R4): the
    /// checker reports a reset the host has not seen the last launch finish before.
    ///
    /// # Errors
    /// Only in the checker's strict mode, [`Error::Hazard`] for that report.
    pub fn reset(&mut self) -> Result<()> {
        if self.repr.take().is_some() {
            if let Some(o) = self.dev.observer() {
                return o.reset(self.id, self.exec);
            }
        }
        Ok(())
    }

    /// Whether [`reset`](GraphExec::reset) was called.
    pub fn is_reset(&self) -> bool {
        self.repr.is_none()
    }
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graph({})", self.id)
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // Strict mode's report of a launch not joined (R4) is kept for the device's next call.
        if let Err(e) = self.reset() {
            self.dev.record_drop_err("a graph executable", e);
        }
    }
}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphExec({}{})", self.id, if self.is_reset() { ", reset" } else { "" })
    }
}

/// Graphviz DOT of a node list (the simulator's dump).
pub(crate) fn dot_of(nodes: &[NodeInfo]) -> String {
    let mut out = String::from("digraph graphed {\n  rankdir=TB;\n");
    for (i, n) in nodes.iter().enumerate() {
        let event = n.event.map(|e| format!("\\n{e}")).unwrap_or_default();
        let _ = writeln!(out, "  n{i} [shape=box,label=\"{i}: {:?}\\n{}{event}\"];", n.kind, n.name.replace('"', "'"));
    }
    for (i, n) in nodes.iter().enumerate() {
        for d in &n.deps {
            let _ = writeln!(out, "  n{d} -> n{i};");
        }
    }
    out.push_str("}\n");
    out
}
