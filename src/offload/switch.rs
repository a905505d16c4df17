//! The parts of [`OffloadManager::keep_resident`](super::OffloadManager::keep_resident): where
//! each switchable tensor's copies are (found once per list of executables), and the switch of
//! one executable's nodes.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::state::{Baked, ResidentKey};
use crate::device::patch::Resolved;
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
    /// The executables whose nodes name its host buffer. A device copy is captured beside its
    /// host copy, on the same stream: no other executable holds one.
    pub(super) holding: Vec<Holding>,
}

/// Where one executable's nodes name a planned tensor's copies, found once.
pub(super) struct Holding {
    /// Its position in the list of executables.
    pub(super) exec: usize,
    /// The host copies' sites: turned off while the tensor is kept resident.
    pub(super) host_sites: Vec<usize>,
    /// The device copies' uses: pointed at the memory the tensor is kept in, or back.
    pub(super) twin_uses: Vec<Resolved>,
}

/// The baked buffers of a plan's slots, held while a switch applies it.
pub(super) type Slots = Vec<Arc<OnceLock<Baked>>>;

/// Every offloaded tensor of a list of executables, and where its copies are. A function of the
/// executables' graphs alone (their nodes never change, and each capture bakes host buffers of
/// its own), so the manager keeps it for the next switch over the same graphs: a switch then
/// applies what it found (the sites to turn off or on, the uses to move) with no lookup.
pub(crate) struct SwitchPlan {
    /// The executables' graphs, in the order the switch was given them.
    graphs: Vec<GraphId>,
    /// The chunks' baked buffers that the executables' nodes name.
    slots: Vec<Weak<OnceLock<Baked>>>,
    pub(super) tensors: Vec<Planned>,
    /// For each executable, the (tensor, holding) pairs of [`tensors`](SwitchPlan::tensors)
    /// whose copies it holds.
    pub(super) by_exec: Vec<Vec<(usize, usize)>>,
}

impl SwitchPlan {
    /// The plan of `execs`, among the live baked buffers `baked`, with each chunk's `layout`.
    ///
    /// # Errors
    /// An executable that refuses to move a device copy's uses or turn a host copy off
    /// ([`Error::Rebind`](crate::Error::Rebind)): not the nodes an offload capture makes.
    pub(super) fn new(
        execs: &[&PoolExec],
        baked: &[(Chunk, Weak<OnceLock<Baked>>)],
        layout: impl Fn(Chunk, usize, usize) -> Option<(Vec<usize>, DType)>,
    ) -> Result<SwitchPlan> {
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
                    let named: Vec<BufferId> = twins.into_iter().flatten().filter(|&b| exec.names(b)).collect();
                    found += named.iter().map(|&b| exec.naming(b)).sum::<usize>();
                    let twin_uses =
                        host.twin_identities(&named)?.iter().map(|r| exec.resolve(r)).collect::<Result<_>>()?;
                    holding.push(Holding { exec: e, host_sites: exec.sites_naming(&[host.id()])?, twin_uses });
                }
                tensors.push(Planned { key, chunk: *chunk, slot: k, shape, dtype, twins, found, holding });
            }
        }
        let mut by_exec = vec![Vec::new(); execs.len()];
        for (t, planned) in tensors.iter().enumerate() {
            for (h, holding) in planned.holding.iter().enumerate() {
                by_exec[holding.exec].push((t, h));
            }
        }
        Ok(SwitchPlan { graphs, slots, tensors, by_exec })
    }

    /// Whether it is the plan of `execs`.
    pub(super) fn is_of(&self, execs: &[&PoolExec]) -> bool {
        self.graphs.len() == execs.len() && self.graphs.iter().zip(execs).all(|(g, e)| *g == e.id())
    }

    /// Its slots' baked buffers, or `None` if one is gone (its graphs were dropped: the plan
    /// is stale).
    pub(super) fn upgrade(&self) -> Option<Slots> {
        self.slots.iter().map(Weak::upgrade).collect()
    }
}

/// Switches the copies in `exec` of each tensor of `switches`, where the executable's nodes name
/// them, to the memory it is kept in (`Some`: its device copies point there and its host
/// copies are off) or back to offloading (`None`: its device copies point where they were
/// captured and its host copies are on). The device copies read their addresses from the tables
/// ([`HostBuffer::point_twins`](super::host::HostBuffer::point_twins)): their rebind changes no
/// node on CUDA. One rebind and one toggle each way for the whole executable.
pub(super) fn switch_nodes(
    exec: &PoolExec,
    switches: &[(&Holding, Option<&Tensor>)],
    times: &mut SwitchTimes,
) -> Result<()> {
    let start = Instant::now();
    let (mut rebinds, mut on, mut off) = (Vec::new(), Vec::new(), Vec::new());
    for &(holding, kept) in switches {
        let to = kept.map(Tensor::placement).transpose()?;
        rebinds.extend(holding.twin_uses.iter().map(|r| (r, to)));
        match to {
            Some(_) => off.extend_from_slice(&holding.host_sites),
            None => on.extend_from_slice(&holding.host_sites),
        }
    }
    let planned = Instant::now();
    if !rebinds.is_empty() {
        exec.rebind_resolved(&rebinds)?;
    }
    let rebound = Instant::now();
    for (mut sites, enabled) in [(off, false), (on, true)] {
        if !sites.is_empty() {
            sites.sort_unstable();
            exec.set_sites_enabled(&sites, enabled)?;
        }
    }
    times.nodes += planned - start;
    times.rebind += rebound - planned;
    times.toggle += rebound.elapsed();
    Ok(())
}

/// Where a switch's host time goes, logged at `debug` (`GRAPHED_LOG=graphed::offload=debug`):
/// the checks before anything changes, the resident tensors' allocation, what each executable
/// changes (`nodes`), the executables' rebinds (bookkeeping: the device copies read the
/// tables) and their host copies turned off or on (a driver call per node on CUDA), the tables'
/// entries and upload, and the memory given back.
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
