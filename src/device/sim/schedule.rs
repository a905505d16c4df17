//! The deferred work queue and its seeded scheduler.
//!
//! Nothing runs when it is enqueued. Work runs when the host must observe it (a synchronize, a
//! blocking copy, a query), and then in an order chosen by the [`Policy`] among the items whose
//! dependencies have completed. So a missing wait between two streams can really reorder their
//! work, and corrupt data, in a test.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::comm::Exchange;
use super::task::Task;
use crate::{Error, Result};

/// How the simulator orders work that is free to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Oldest runnable item first: the host's issue order, which hides most races.
    InOrder,
    /// A runnable item chosen at random (seeded).
    Random,
    /// The newest runnable item among those the host waits for: work that is not needed yet stays
    /// queued, and a later-issued item runs before an earlier one it is not ordered after, so a
    /// consumer that forgot to wait often runs before its producer and a writer that forgot to
    /// wait before an earlier reader. Not every race shows this way; the random policy with
    /// several seeds covers the rest, and the checker reports races whatever the schedule.
    Adversarial,
}

impl Policy {
    /// All three policies, for tests that run under each.
    pub const ALL: [Policy; 3] = [Policy::InOrder, Policy::Random, Policy::Adversarial];
}

/// Identity of one queued item.
pub(crate) type WorkId = u64;

pub(crate) enum Action {
    /// A marker: a wait, a graph launch's end.
    Nop,
    Run(Arc<Task>),
    /// A collective's arrival: the rank's input is posted to its group.
    Arrive(Arc<Exchange>),
    /// A collective's finish: runnable once the group holds every part it needs.
    Finish(Arc<Exchange>),
}

pub(crate) struct Work {
    pub(crate) deps: Vec<WorkId>,
    pub(crate) action: Action,
}

pub(crate) struct Queue {
    policy: Policy,
    rng: SmallRng,
    pending: BTreeMap<WorkId, Work>,
    next: WorkId,
    /// The first failure of a task, reported by the next synchronizing call (like CUDA's
    /// sticky launch errors).
    failure: Option<Error>,
}

impl Queue {
    pub(crate) fn new(policy: Policy, seed: u64) -> Queue {
        Queue { policy, rng: SmallRng::seed_from_u64(seed), pending: BTreeMap::new(), next: 0, failure: None }
    }

    pub(crate) fn push(&mut self, deps: impl IntoIterator<Item = Option<WorkId>>, action: Action) -> WorkId {
        let id = self.next;
        self.next += 1;
        let deps = deps.into_iter().flatten().filter(|d| self.pending.contains_key(d)).collect();
        self.pending.insert(id, Work { deps, action });
        id
    }

    pub(crate) fn is_done(&self, id: WorkId) -> bool {
        id < self.next && !self.pending.contains_key(&id)
    }

    fn deps_done(&self, w: &Work) -> bool {
        w.deps.iter().all(|d| !self.pending.contains_key(d))
    }

    fn is_ready(&self, w: &Work) -> bool {
        self.deps_done(w)
            && match &w.action {
                Action::Finish(x) => x.ready(),
                _ => true,
            }
    }

    /// Everything still pending that `targets` need, themselves included.
    fn closure(&self, targets: &[WorkId]) -> BTreeSet<WorkId> {
        let mut need = BTreeSet::new();
        let mut stack: Vec<WorkId> = targets.iter().copied().filter(|t| self.pending.contains_key(t)).collect();
        while let Some(id) = stack.pop() {
            if need.insert(id) {
                stack.extend(self.pending[&id].deps.iter().copied().filter(|d| self.pending.contains_key(d)));
            }
        }
        need
    }

    fn pick(&mut self, need: &BTreeSet<WorkId>) -> Option<WorkId> {
        match self.policy {
            Policy::InOrder => self.pending.iter().find(|(_, w)| self.is_ready(w)).map(|(id, _)| *id),
            Policy::Random => {
                let ready: Vec<WorkId> =
                    self.pending.iter().filter(|(_, w)| self.is_ready(w)).map(|(id, _)| *id).collect();
                (!ready.is_empty()).then(|| ready[self.rng.random_range(0..ready.len())])
            }
            Policy::Adversarial => need.iter().rev().copied().find(|id| self.is_ready(&self.pending[id])),
        }
    }

    /// A runnable item of the whole queue, needed or not.
    fn pick_any(&mut self) -> Option<WorkId> {
        let all: BTreeSet<WorkId> = self.pending.keys().copied().collect();
        self.pick(&all)
    }

    fn run_one(&mut self, id: WorkId) {
        let work = self.pending.remove(&id).expect("picked work is pending");
        let ran = match work.action {
            Action::Nop => Ok(()),
            Action::Run(task) => task.run(),
            Action::Arrive(x) => x.arrive(),
            Action::Finish(x) => x.finish(),
        };
        if let Err(e) = ran {
            self.failure.get_or_insert(e);
        }
    }

    /// With nothing runnable among `need`: the collectives in it that wait on their group, if
    /// any, block the host until one can finish (another rank's thread posts its part), or fail
    /// with the group's error.
    fn stall(&mut self, need: &BTreeSet<WorkId>) -> Result<bool> {
        let waiting: Vec<&Arc<Exchange>> = (need.iter())
            .filter_map(|id| self.pending.get(id))
            .filter_map(|w| match &w.action {
                Action::Finish(x) if self.deps_done(w) => Some(x),
                _ => None,
            })
            .collect();
        if waiting.is_empty() {
            return Ok(false);
        }
        super::comm::stall(&waiting)?;
        Ok(true)
    }

    /// Runs work until every target has completed.
    pub(crate) fn run_until(&mut self, targets: &[WorkId]) -> Result<()> {
        let mut need = self.closure(targets);
        while targets.iter().any(|t| !self.is_done(*t)) {
            // Before the host blocks on other ranks, the rest of the queue runs what it can, as
            // a GPU would: a collective's arrival that another rank waits for may be among it.
            // (What it picks may be needed after all: a collective's finish turns ready when a
            // peer posts.)
            let Some(id) = self.pick(&need).or_else(|| self.pick_any()) else {
                if self.stall(&need)? {
                    continue;
                }
                return Err(Error::Unsupported {
                    op: "synchronize",
                    backend: "sim",
                    why: "no queued work can run: the waits form a cycle, which would hang on a GPU too",
                });
            };
            need.remove(&id);
            self.run_one(id);
        }
        self.take_failure()
    }

    /// Runs at most one item that `target` needs, so that polling makes progress.
    pub(crate) fn step_towards(&mut self, target: WorkId) -> Result<()> {
        let need = self.closure(&[target]);
        if !need.is_empty() {
            if let Some(id) = self.pick(&need) {
                self.run_one(id);
            }
        }
        self.take_failure()
    }

    /// Runs every item that can run now, as a GPU runs its queue while its host waits on
    /// something else; returns the collectives left waiting on their groups. A task's failure
    /// is kept for the next synchronizing call.
    pub(crate) fn run_ready(&mut self) -> Vec<Arc<Exchange>> {
        while let Some(id) = self.pick_any() {
            self.run_one(id);
        }
        (self.pending.values())
            .filter_map(|w| match &w.action {
                Action::Finish(x) if self.deps_done(w) => Some(x.clone()),
                _ => None,
            })
            .collect()
    }

    /// Runs everything.
    pub(crate) fn run_all(&mut self) -> Result<()> {
        let all: Vec<WorkId> = self.pending.keys().copied().collect();
        self.run_until(&all)
    }

    fn take_failure(&mut self) -> Result<()> {
        match self.failure.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
