//! The parts of [`OffloadManager::keep_resident`](super::OffloadManager::keep_resident): where
//! each switchable tensor's copies are (found once per list of executables), and the switch of
//! one executable's nodes.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::host::HostBuffer;
use super::state::{Baked, ResidentKey};
use crate::device::{BufferId, DType, GraphId};
use crate::memory::PoolExec;
use crate::nn::Chunk;
use crate::tensor::Tensor;
use crate::Result;

/// One offloaded tensor of the executables a switch is given.
pub(super) struct Planned {
    pub(super) key: ResidentKey,
    pub(super) chunk: Chunk,
    /// Its slot in [`SwitchPlan::slots`].
    pub(super) slot: usize,
    /// Its shape and type, for the memory it gets when kept resident.
    pub(super) shape: Vec<usize>,
    pub(super) dtype: DType,
    /// What its device copies name (out, back); `None` for a capture without the setting.
    pub(super) twins: Option<[BufferId; 2]>,
    /// The nodes found naming its host buffer or its device copies: two copies each way when
    /// the executables hold all of its graphs.
    pub(super) found: usize,
    /// Each executable (by position in the list) whose nodes name its host buffer, with which
    /// of its copies' buffers (the host buffer, the device copies) they name. A device copy is
    /// captured beside its host copy, on the same stream: no other executable holds one.
    pub(super) holding: Vec<(usize, Vec<BufferId>)>,
}

/// Every offloaded tensor of a list of executables, and where its copies are. A function of the
/// executables' graphs alone (their nodes never change, and each capture bakes host buffers of
/// its own), so the manager keeps it for the next switch over the same graphs: finding the
/// copies costs a lookup per tensor and executable, a switch's largest part at M (24 tensors,
/// 16 executables).
pub(crate) struct SwitchPlan {
    /// The executables' graphs, in the order the switch was given them.
    graphs: Vec<GraphId>,
    /// The chunks' baked buffers that the executables' nodes name.
    slots: Vec<Weak<OnceLock<Baked>>>,
    pub(super) tensors: Vec<Planned>,
}

impl SwitchPlan {
    /// The plan of `execs`, among the live baked buffers `baked`, with each chunk's `layout`.
    pub(super) fn new(
        execs: &[&PoolExec],
        baked: &[(Chunk, Weak<OnceLock<Baked>>)],
        layout: impl Fn(Chunk, usize, usize) -> Option<(Vec<usize>, DType)>,
    ) -> SwitchPlan {
        let graphs = execs.iter().map(|e| e.id()).collect();
        // Those of the graphs given (another capture's of the same chunk aside).
        let named = |b: &Baked| b.buffers.values().any(|h| execs.iter().any(|e| e.names(h.id())));
        let (mut slots, mut tensors) = (Vec::new(), Vec::new());
        for (chunk, weak) in baked {
            let Some(slot) = weak.upgrade() else { continue };
            let Some(b) = slot.get().filter(|b| named(b)) else { continue };
            let k = slots.len();
            slots.push(weak.clone());
            for (&(group, s), host) in &b.buffers {
                let Some((shape, dtype)) = layout(*chunk, group, s) else { continue };
                let key = ResidentKey { baked: Arc::as_ptr(&slot) as usize, group, slot: s };
                let twins = host.twin_ids();
                let (mut found, mut holding) = (0, Vec::new());
                for (e, exec) in execs.iter().enumerate() {
                    let here = exec.naming(host.id());
                    if here == 0 {
                        continue;
                    }
                    found += here;
                    let mut named = vec![host.id()];
                    for b in twins.into_iter().flatten() {
                        let here = exec.naming(b);
                        if here > 0 {
                            found += here;
                            named.push(b);
                        }
                    }
                    holding.push((e, named));
                }
                tensors.push(Planned { key, chunk: *chunk, slot: k, shape, dtype, twins, found, holding });
            }
        }
        SwitchPlan { graphs, slots, tensors }
    }

    /// Whether it is the plan of `execs`.
    pub(super) fn is_of(&self, execs: &[&PoolExec]) -> bool {
        self.graphs.len() == execs.len() && self.graphs.iter().zip(execs).all(|(g, e)| *g == e.id())
    }

    /// Its slots' baked buffers, or `None` if one is gone (its graphs were dropped: the plan
    /// is stale).
    pub(super) fn upgrade(&self) -> Option<Vec<Arc<OnceLock<Baked>>>> {
        self.slots.iter().map(Weak::upgrade).collect()
    }
}

/// One tensor's switch in one executable: its host buffer, the memory it is kept in (`None`:
/// offloaded again), and which of its copies' buffers (the host buffer, the two device copies)
/// the executable's nodes name.
pub(super) type Switch<'a> = (&'a HostBuffer, Option<&'a Tensor>, &'a [BufferId]);

/// Switches the copies in `exec` of each tensor of `switches`: kept resident (`Some`), its
/// device copies are bound to that memory and its host copies off; offloaded again (`None`), its
/// device copies are bound back where they were captured and its host copies on. The device
/// copies read their addresses from the tables ([`HostBuffer::point_twins`]): their rebind
/// changes no node on CUDA. One rebind and one call each way for the whole executable, as each
/// costs a walk of its bindings.
pub(super) fn switch_nodes(exec: &PoolExec, switches: &[Switch<'_>], times: &mut SwitchTimes) -> Result<()> {
    let start = Instant::now();
    let (mut rebinds, mut on, mut off) = (Vec::new(), Vec::new(), Vec::new());
    for &(host, resident, named) in switches {
        host.twin_rebinds(named, resident, &mut rebinds)?;
        if named.contains(&host.id()) {
            match resident {
                Some(_) => off.push(host.id()),
                None => on.push(host.id()),
            }
        }
    }
    let planned = Instant::now();
    if !rebinds.is_empty() {
        exec.rebind(&rebinds)?;
    }
    let rebound = Instant::now();
    for (buffers, enabled) in [(off, false), (on, true)] {
        if !buffers.is_empty() {
            exec.set_enabled(&buffers, enabled)?;
        }
    }
    times.nodes += planned - start;
    times.rebind += rebound - planned;
    times.toggle += rebound.elapsed();
    Ok(())
}

/// Where a switch's host time goes, logged at `debug` (`GRAPHED_LOG=graphed::offload=debug`):
/// the checks and lookups before anything changes, the resident tensors' allocations, the
/// nodes' new bindings and which to turn off (`nodes`), the executables' rebinds (bookkeeping:
/// the device copies read the tables) and their host copies turned off or on (a driver call per
/// node on CUDA), the tables' entries and upload, and the memory given back.
#[derive(Debug, Default)]
pub(super) struct SwitchTimes {
    pub(super) plan: Duration,
    pub(super) alloc: Duration,
    pub(super) nodes: Duration,
    pub(super) rebind: Duration,
    pub(super) toggle: Duration,
    pub(super) table: Duration,
    pub(super) release: Duration,
}
