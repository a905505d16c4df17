//! Captured graphs on the simulator, and their launches as DAGs of queued work.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use super::schedule::{Action, WorkId};
use super::task::Task;
use super::{Record, State};
use crate::device::patch::{Site, SiteChange};
use crate::device::{ids, EventId, NodeInfo, NodeKind, StreamId};
use crate::error::{CaptureErrorKind, CaptureSite};
use crate::{Error, Result};

#[derive(Clone)]
pub(crate) enum NodeTask {
    Run(Arc<Task>),
    /// An external event record: every launch re-records the event when the node runs.
    Record(EventId),
    /// An external event wait: binds to the event's latest record at each launch.
    Wait(EventId),
}

#[derive(Clone)]
pub(crate) struct SimNode {
    pub(super) kind: NodeKind,
    pub(super) name: String,
    /// Earlier nodes this one depends on (nodes are in capture order, so topological).
    pub(super) deps: Vec<usize>,
    pub(super) task: NodeTask,
    /// Turned off by `GraphExec::set_enabled`: a launch runs it as nothing, its edges kept.
    pub(super) disabled: bool,
}

/// A captured graph: shared by the graph handle and its executables.
pub(crate) struct SimGraph {
    nodes: Arc<Vec<SimNode>>,
    /// How each operation's node names buffers, in capture order.
    sites: Arc<[Site]>,
    /// The node of each site.
    site_nodes: Arc<[usize]>,
}

impl SimGraph {
    pub(super) fn new(nodes: Vec<SimNode>, sites: Vec<(usize, Site)>) -> SimGraph {
        let (site_nodes, sites): (Vec<usize>, Vec<Site>) = sites.into_iter().unzip();
        SimGraph { nodes: Arc::new(nodes), sites: sites.into(), site_nodes: site_nodes.into() }
    }

    pub(crate) fn sites(&self) -> Arc<[Site]> {
        self.sites.clone()
    }

    /// The given nodes and all their ancestors.
    pub(super) fn ancestors_of(&self, nodes: &[usize]) -> BTreeSet<usize> {
        let mut seen = BTreeSet::new();
        let mut stack = nodes.to_vec();
        while let Some(n) = stack.pop() {
            if seen.insert(n) {
                stack.extend(&self.nodes[n].deps);
            }
        }
        seen
    }

    pub(crate) fn node_infos(&self) -> Vec<NodeInfo> {
        self.nodes
            .iter()
            .map(|n| NodeInfo {
                kind: n.kind,
                name: n.name.clone(),
                deps: n.deps.clone(),
                event: match n.task {
                    NodeTask::Record(e) | NodeTask::Wait(e) => Some(e),
                    NodeTask::Run(_) => None,
                },
            })
            .collect()
    }
}

/// An executable: the graph's nodes plus an identity that orders its launches.
pub(crate) struct SimExec {
    id: u64,
    /// The nodes as captured.
    captured: Arc<Vec<SimNode>>,
    /// The nodes its launches run: the captured ones, some rebound. A launch takes the list as it
    /// is then, so a later rebind changes later launches only, as on CUDA.
    nodes: Mutex<Arc<Vec<SimNode>>>,
    site_nodes: Arc<[usize]>,
}

impl SimExec {
    pub(super) fn new(graph: &SimGraph) -> SimExec {
        let (captured, site_nodes) = (graph.nodes.clone(), graph.site_nodes.clone());
        SimExec { id: ids::next_id(), nodes: Mutex::new(captured.clone()), captured, site_nodes }
    }

    fn nodes(&self) -> Arc<Vec<SimNode>> {
        self.nodes.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Points the listed sites' nodes at their bound uses (the other uses as captured); those
    /// whose addresses a kernel reads from a table too, as the task's arguments are what the
    /// simulator runs it on (and checks the table against).
    pub(super) fn rebind(&self, sites: &[Site], changes: &[SiteChange]) -> Result<()> {
        let mut nodes = self.nodes.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next: Vec<SimNode> = (**nodes).clone();
        for (site, bound, _) in changes {
            let n = self.site_nodes[*site];
            let NodeTask::Run(task) = &self.captured[n].task else {
                return Err(Error::Unsupported {
                    op: "GraphExec::rebind",
                    backend: "sim",
                    why: "a site names an event node; please report this as a bug",
                });
            };
            let uses: Vec<_> = bound.iter().map(|((_, u), b)| (sites[*site].uses[*u].slot, b)).collect();
            next[n].task = NodeTask::Run(Arc::new(task.rebound(&uses)?));
        }
        *nodes = Arc::new(next);
        Ok(())
    }

    /// Turns the listed sites' nodes off or on for later launches.
    pub(super) fn set_enabled(&self, sites: &[usize], enabled: bool) {
        let mut nodes = self.nodes.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next: Vec<SimNode> = (**nodes).clone();
        for s in sites {
            next[self.site_nodes[*s]].disabled = !enabled;
        }
        *nodes = Arc::new(next);
    }
}

impl State {
    /// Queues one launch: a work item per node, ordered after the stream's previous work and
    /// after the executable's previous launch (CUDA runs launches of one executable in order).
    pub(super) fn launch(&mut self, exec: &SimExec, stream: StreamId) -> Result<()> {
        const OP: &str = "GraphExec::launch";
        if let Some(cap) = self.active_capture_of(OP, stream)? {
            // CUDA 13.0 refuses a graph launch into a capturing stream and invalidates the capture.
            self.invalidate(cap);
            return Err(capture_error(OP, stream, CaptureErrorKind::Unsupported));
        }
        let before = [self.stream(stream).last, self.exec_last.get(&exec.id).copied()];
        let nodes = exec.nodes();
        let mut work: Vec<WorkId> = Vec::with_capacity(nodes.len());
        let mut has_dependent = vec![false; nodes.len()];
        let mut records: HashMap<EventId, WorkId> = HashMap::new();
        for node in nodes.iter() {
            let mut deps: Vec<Option<WorkId>> = node.deps.iter().map(|d| Some(work[*d])).collect();
            for d in &node.deps {
                has_dependent[*d] = true;
            }
            if node.deps.is_empty() {
                deps.extend(before);
            }
            let id = match &node.task {
                NodeTask::Run(_) if node.disabled => self.queue.push(deps, Action::Nop),
                NodeTask::Run(task) => self.push_task(deps, task)?,
                NodeTask::Record(e) => {
                    let id = self.queue.push(deps, Action::Nop);
                    records.insert(*e, id);
                    id
                }
                NodeTask::Wait(e) => {
                    if let Some(Record::At(Some(w))) = self.events.get(e) {
                        deps.push(Some(*w));
                    }
                    self.queue.push(deps, Action::Nop)
                }
            };
            work.push(id);
        }
        let sinks: Vec<Option<WorkId>> =
            work.iter().zip(&has_dependent).filter(|(_, d)| !**d).map(|(w, _)| Some(*w)).collect();
        let end =
            if sinks.is_empty() { self.queue.push(before, Action::Nop) } else { self.queue.push(sinks, Action::Nop) };
        self.stream(stream).last = Some(end);
        self.exec_last.insert(exec.id, end);
        for (e, w) in records {
            self.events.insert(e, Record::At(Some(w)));
        }
        Ok(())
    }
}

/// The error for a capture rule broken by a call on `stream` (used by the sibling modules).
pub(super) fn capture_error(op: &'static str, stream: StreamId, kind: CaptureErrorKind) -> Error {
    Error::Capture { op, on: CaptureSite::Stream(stream), kind }
}
