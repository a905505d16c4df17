//! Captured graphs and their executables: ownership, introspection and the DOT dump.

use std::collections::{BinaryHeap, HashMap};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys::CUgraphNodeType;

use super::capture::Holdings;
use super::error as err;
use super::ffi::{Function, MemcpyParams, Node, OwnedExec, OwnedGraph, RawNode};
use super::launch::Kernels;
use crate::device::patch::{Site, SiteChange, Slot};
use crate::device::{LaunchDims, NodeInfo, NodeKind};
use crate::{Error, Result};

/// Where graphed can patch a captured node, and what it was launched with.
pub(crate) struct PatchNode {
    pub(super) node: RawNode,
    pub(super) template: Template,
}

/// What a patchable node does, to rebuild its parameters from.
pub(super) enum Template {
    /// A kernel: its function, dimensions and parameter slots as launched.
    Kernel { func: Function, dims: LaunchDims, values: Vec<u64> },
    /// A device-to-host (`device_dst` false) or device-to-device copy, and its parameters as
    /// captured, read at its first rebind.
    Copy { device_dst: bool, captured: OnceLock<Box<MemcpyParams>> },
    /// A copy from pinned memory or a memset: turned off and on, never rebound.
    Fixed,
}

/// A captured graph and everything its nodes use.
pub(crate) struct CuGraph {
    graph: Arc<Mutex<OwnedGraph>>,
    held: Arc<Holdings>,
    sites: Arc<[Site]>,
}

/// An executable graph. Field order matters: the executable is destroyed before its holdings are
/// released. It keeps its graph, whose node handles a patch names.
pub(crate) struct CuExec {
    exec: Mutex<OwnedExec>,
    held: Arc<Holdings>,
    graph: Arc<Mutex<OwnedGraph>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A graph handle cannot be left half-updated by a panic: keep using it.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CuGraph {
    pub(super) fn new(graph: OwnedGraph, mut held: Holdings) -> CuGraph {
        let sites = std::mem::take(&mut held.sites).into();
        CuGraph { graph: Arc::new(Mutex::new(graph)), held: Arc::new(held), sites }
    }

    pub(super) fn sites(&self) -> Arc<[Site]> {
        self.sites.clone()
    }

    /// Instantiates the graph. The device's context must be bound.
    pub(super) fn instantiate(&self) -> Result<CuExec> {
        let exec = lock(&self.graph).instantiate().map_err(|e| err::driver("Graph::instantiate", None, e))?;
        Ok(CuExec { exec: Mutex::new(exec), held: self.held.clone(), graph: self.graph.clone() })
    }

    /// The graph's nodes in a topological order, with dependencies as indices into the list.
    pub(super) fn nodes(&self, kernels: &Kernels) -> Result<Vec<NodeInfo>> {
        const OP: &str = "Graph::nodes";
        let fail = |e| err::driver(OP, None, e);
        let graph = lock(&self.graph);
        let nodes = graph.nodes().map_err(fail)?;
        let index: HashMap<Node<'_>, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let mut deps = vec![Vec::new(); nodes.len()];
        for (from, to) in graph.edges().map_err(fail)? {
            if let (Some(&f), Some(&t)) = (index.get(&from), index.get(&to)) {
                deps[t].push(f);
            }
        }
        let order = topological(&deps)
            .ok_or_else(|| Error::Cuda { op: OP, message: "the driver reported a graph with a cycle".into() })?;
        let mut position = vec![0; nodes.len()];
        for (at, &i) in order.iter().enumerate() {
            position[i] = at;
        }
        order
            .iter()
            .map(|&i| {
                let mut d: Vec<usize> = deps[i].iter().map(|&j| position[j]).collect();
                d.sort_unstable();
                d.dedup();
                self.describe(nodes[i], kernels, d).map_err(fail)
            })
            .collect()
    }

    fn describe(
        &self,
        node: Node<'_>,
        kernels: &Kernels,
        deps: Vec<usize>,
    ) -> Result<NodeInfo, cudarc::driver::DriverError> {
        let kind = node_kind(node.kind()?);
        let event = match kind {
            NodeKind::EventRecord => self.held.event_id(node.recorded_event()?),
            NodeKind::EventWait => self.held.event_id(node.waited_event()?),
            _ => None,
        };
        let shown = || event.map_or_else(|| "an event graphed did not create".to_string(), |e| e.to_string());
        let name = match kind {
            NodeKind::Kernel => match node.kernel_function()? {
                Some(f) => kernels.name_of(f.key).map(str::to_string).or(f.name).unwrap_or_else(|| "kernel".into()),
                None => "kernel".into(),
            },
            NodeKind::EventRecord => format!("record {}", shown()),
            NodeKind::EventWait => format!("wait {}", shown()),
            NodeKind::Memcpy => "memcpy".into(),
            NodeKind::Memset => "memset".into(),
            NodeKind::Empty => "empty".into(),
            NodeKind::Host => "host function".into(),
            NodeKind::ChildGraph => "child graph".into(),
            NodeKind::MemAlloc => "mem_alloc".into(),
            NodeKind::MemFree => "mem_free".into(),
            NodeKind::Other(n) => format!("node type {n}"),
        };
        Ok(NodeInfo { kind, name, deps, event })
    }

    /// The driver's verbose DOT dump, through a temporary file.
    pub(super) fn dot(&self) -> Result<String> {
        const OP: &str = "Graph::dot";
        let io = |what: &str, path: &std::path::Path, e: std::io::Error| Error::Cuda {
            op: OP,
            message: format!("{what} the DOT dump at {}: {e}", path.display()),
        };
        let path = create_temp_file().map_err(|e| io("creating", &std::env::temp_dir(), e))?;
        let c_path = path.to_str().and_then(|p| CString::new(p).ok()).ok_or_else(|| Error::Cuda {
            op: OP,
            message: format!("the temporary path {} is not a C string", path.display()),
        });
        let dumped = c_path.and_then(|c| lock(&self.graph).debug_dot(&c).map_err(|e| err::driver(OP, None, e)));
        let text = dumped.and_then(|()| std::fs::read_to_string(&path).map_err(|e| io("reading", &path, e)));
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!("graphed: could not remove {}: {e}", path.display());
        }
        text
    }
}

impl CuExec {
    /// `cuGraphLaunch` on `stream`. The device's context must be bound.
    pub(super) fn launch(&self, stream: &cudarc::driver::CudaStream) -> Result<(), cudarc::driver::DriverError> {
        lock(&self.exec).launch(stream)
    }

    /// The rank of an aborted communicator whose collectives the graph holds, if any.
    pub(super) fn aborted_comm(&self) -> Option<usize> {
        self.held.aborted_comm()
    }

    /// Points the listed sites' uses at their bound buffers (the others as captured). The
    /// device's context must be bound.
    pub(super) fn rebind(&self, sites: &[Site], changes: &[SiteChange]) -> Result<()> {
        const OP: &str = "GraphExec::rebind";
        let bug = |why: &str| Error::Cuda { op: OP, message: format!("{why}; please report this as a bug") };
        let _graph = lock(&self.graph);
        let exec = lock(&self.exec);
        // Scratch for every kernel node's parameters, reused across nodes.
        let (mut values, mut params) = (Vec::new(), Vec::new());
        for &(site, bound, node) in changes {
            if !node {
                // Only addresses the kernel reads from the caller's table moved.
                continue;
            }
            let Some(Some(patch)) = self.held.nodes.get(site) else {
                return Err(bug("a site with no patchable node"));
            };
            let address = |block: &Arc<crate::device::memory::Block>, start: usize| {
                super::memory::kernel_arg(OP, &block.raw, block.base + start)
            };
            match &patch.template {
                Template::Kernel { func, dims, values: launched } => {
                    let uses = &sites[site].uses;
                    values.clear();
                    values.extend_from_slice(launched);
                    for ((_, u), b) in bound {
                        match uses[*u].slot {
                            Slot::Param(i) => values[i] = address(&b.block, b.start)?,
                            Slot::Indirect(_) => {}
                            _ => return Err(bug("a kernel use that is no parameter")),
                        }
                    }
                    // SAFETY: the node is a kernel node of this executable's graph, kept alive
                    // by `self.graph`; the function stays loaded in `Kernels`; the values are the
                    // launch's own with pointer slots replaced by addresses of blocks that the
                    // public executable holds while they are bound.
                    unsafe { exec.set_kernel_params(patch.node, *func, dims, &mut values, &mut params) }
                        .map_err(|e| err::driver(OP, None, e))?;
                }
                Template::Copy { device_dst, captured } => {
                    let uses = &sites[site].uses;
                    // Where a side points now: where it is bound, else where it was captured.
                    let side = |slot: Slot| -> Result<u64> {
                        let u =
                            uses.iter().position(|u| u.slot == slot).ok_or_else(|| bug("a copy with no such side"))?;
                        match bound.iter().find(|((_, x), _)| *x == u) {
                            Some((_, b)) => address(&b.block, b.start),
                            None => address(&uses[u].block, uses[u].start),
                        }
                    };
                    // A device-to-host copy's destination is never moved (only device views
                    // are rebound, and the driver refuses a change of memory type).
                    let (src, dst) = (side(Slot::CopySrc)?, device_dst.then(|| side(Slot::CopyDst)).transpose()?);
                    let captured = match captured.get() {
                        Some(p) => **p,
                        None => {
                            // SAFETY: the node is a memcpy node of this executable's graph,
                            // kept alive by `self.graph`.
                            let p = unsafe { MemcpyParams::of(patch.node) }.map_err(|e| err::driver(OP, None, e))?;
                            **captured.get_or_init(|| Box::new(p))
                        }
                    };
                    // SAFETY: the node is a device-source memcpy node of this executable's
                    // graph, kept alive by `self.graph`, and `captured` its parameters; `src`
                    // and `dst` address held device blocks' bytes, `dst` only where the copy's
                    // destination is device memory.
                    unsafe { exec.set_memcpy(patch.node, &captured, src, dst) }
                        .map_err(|e| err::driver(OP, None, e))?;
                }
                Template::Fixed => return Err(bug("a rebind of a node whose uses are writes or host memory")),
            }
        }
        Ok(())
    }

    /// Turns the listed sites' nodes off or on (`cuGraphNodeSetEnabled`). The device's context
    /// must be bound.
    pub(super) fn set_enabled(&self, sites: &[usize], enabled: bool) -> Result<()> {
        const OP: &str = "GraphExec::set_enabled";
        let _graph = lock(&self.graph);
        let exec = lock(&self.exec);
        for site in sites {
            let Some(Some(patch)) = self.held.nodes.get(*site) else {
                return Err(Error::Cuda {
                    op: OP,
                    message: "a site with no node held; please report this as a bug".into(),
                });
            };
            // SAFETY: the node is a node of this executable's graph, kept alive by `self.graph`.
            unsafe { exec.set_enabled(patch.node, enabled) }.map_err(|e| err::driver(OP, None, e))?;
        }
        Ok(())
    }

    /// `cuGraphUpload` on `stream`. The device's context must be bound.
    pub(super) fn upload(&self, stream: &cudarc::driver::CudaStream) -> Result<(), cudarc::driver::DriverError> {
        lock(&self.exec).upload(stream)
    }
}

/// A new empty file for the driver to write into, created exclusively so that nothing else can
/// have placed (or linked) a file at that path.
fn create_temp_file() -> std::io::Result<std::path::PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("graphed-graph-{}-{n}.dot", std::process::id()));
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(_) => return Ok(path),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

const KERNEL: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32;
const MEMCPY: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY as u32;
const MEMSET: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET as u32;
const HOST: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_HOST as u32;
const GRAPH: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_GRAPH as u32;
const EMPTY: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY as u32;
const WAIT_EVENT: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_WAIT_EVENT as u32;
const EVENT_RECORD: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EVENT_RECORD as u32;
const MEM_ALLOC: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC as u32;
const MEM_FREE: u32 = CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE as u32;

/// The kind of a node, from the driver's `CUgraphNodeType` number.
fn node_kind(raw: u32) -> NodeKind {
    match raw {
        KERNEL => NodeKind::Kernel,
        MEMCPY => NodeKind::Memcpy,
        MEMSET => NodeKind::Memset,
        HOST => NodeKind::Host,
        GRAPH => NodeKind::ChildGraph,
        EMPTY => NodeKind::Empty,
        WAIT_EVENT => NodeKind::EventWait,
        EVENT_RECORD => NodeKind::EventRecord,
        MEM_ALLOC => NodeKind::MemAlloc,
        MEM_FREE => NodeKind::MemFree,
        other => NodeKind::Other(other),
    }
}

/// A topological order of nodes given each node's dependencies (Kahn's algorithm, taking the
/// lowest ready index first, so an order that is already topological is kept). `None` on a cycle.
fn topological(deps: &[Vec<usize>]) -> Option<Vec<usize>> {
    let mut waiting: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut dependents = vec![Vec::new(); deps.len()];
    for (node, ds) in deps.iter().enumerate() {
        for &d in ds {
            dependents[d].push(node);
        }
    }
    let mut ready: BinaryHeap<std::cmp::Reverse<usize>> =
        waiting.iter().enumerate().filter(|(_, w)| **w == 0).map(|(i, _)| std::cmp::Reverse(i)).collect();
    let mut order = Vec::with_capacity(deps.len());
    while let Some(std::cmp::Reverse(node)) = ready.pop() {
        order.push(node);
        for &next in &dependents[node] {
            waiting[next] -= 1;
            if waiting[next] == 0 {
                ready.push(std::cmp::Reverse(next));
            }
        }
    }
    (order.len() == deps.len()).then_some(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_types_map_to_kinds_and_unknown_ones_are_kept() {
        let expected = [
            (0, NodeKind::Kernel),
            (1, NodeKind::Memcpy),
            (2, NodeKind::Memset),
            (3, NodeKind::Host),
            (4, NodeKind::ChildGraph),
            (5, NodeKind::Empty),
            (6, NodeKind::EventWait),
            (7, NodeKind::EventRecord),
            (10, NodeKind::MemAlloc),
            (11, NodeKind::MemFree),
            (13, NodeKind::Other(13)),
            (99, NodeKind::Other(99)),
        ];
        for (raw, kind) in expected {
            assert_eq!(node_kind(raw), kind, "type {raw}");
        }
    }

    #[test]
    fn topological_keeps_an_already_sorted_order() {
        assert_eq!(topological(&[vec![], vec![0], vec![0], vec![1, 2]]), Some(vec![0, 1, 2, 3]));
    }

    #[test]
    fn topological_sorts_and_detects_cycles() {
        // 0 depends on 2, 2 on 1: the order is 1, 2, 0 (3 is free and comes as soon as it can).
        assert_eq!(topological(&[vec![2], vec![], vec![1], vec![]]), Some(vec![1, 2, 0, 3]));
        assert_eq!(topological(&[vec![1], vec![0]]), None);
        assert_eq!(topological(&[]), Some(vec![]));
    }
}
