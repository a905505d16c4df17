//! Collectives between simulated devices of one process, one rank per thread.
//!
//! Each operation a rank issues gets a [`Key`] at the host call (its place in the group's order,
//! as NCCL matches them) and becomes two work items of the rank's queue: an arrival, which posts
//! the rank's input to the [`World`] once the stream reaches it, and a finish, runnable only once
//! the world holds every part it needs, which writes the result. A queue with nothing else to
//! run stalls on the world until another rank posts. The world turns what would hang on GPUs
//! into typed errors: operations that differ at one key, a rank that left, every rank stalled
//! on another (a deadlock), and a wait past the group's timeout.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::task::SimMem;
use crate::device::backend::Repr;
use crate::device::comm::{comm_error, Collective, Stuck};
use crate::device::memory::Block;
use crate::device::{CommErrorKind, DType, DeviceId};
use crate::{Error, Result};

/// One rank's membership of a simulated group; dropping it tells the others this rank left.
pub(crate) struct SimLink {
    pub(super) rank: Rank,
}

impl Drop for SimLink {
    fn drop(&mut self) {
        let world = &self.rank.world;
        world.lock().gone[self.rank.rank] = true;
        world.changed.notify_all();
    }
}

impl SimLink {
    /// The links of a new group, rank `r` on device `devices[r]`.
    pub(crate) fn group(devices: Vec<DeviceId>, timeout: Duration) -> Vec<SimLink> {
        let size = devices.len();
        let world = Arc::new(World {
            size,
            devices,
            timeout,
            state: Mutex::new(WorldState {
                issued: vec![0; size],
                p2p: HashMap::new(),
                slots: HashMap::new(),
                gone: vec![false; size],
                stalled: vec![None; size],
                broken: None,
                stuck: None,
                split_calls: vec![0; size],
                splits: HashMap::new(),
            }),
            changed: Condvar::new(),
        });
        (0..size).map(|rank| SimLink { rank: Rank { world: world.clone(), rank } }).collect()
    }

    /// Splits this rank's group (see [`Rank::split`]): the link in the new group, with its
    /// rank and size.
    pub(crate) fn split(
        &self,
        color: Option<u32>,
        key: usize,
        progress: &Progress<'_>,
    ) -> Result<Option<(SimLink, usize, usize)>, CommErrorKind> {
        Ok(self.rank.split(color, key, progress)?.map(|link| {
            let (rank, size) = (link.rank.rank, link.rank.world.size);
            (link, rank, size)
        }))
    }

    /// Collectives this rank issued so far: the place in the group's order of its next.
    pub(crate) fn issued(&self) -> u64 {
        self.rank.world.lock().issued[self.rank.rank]
    }

    /// Where the wait that broke the group by a timeout or a rank gone stood, if one did.
    pub(crate) fn stuck(&self) -> Option<Stuck> {
        let st = self.rank.world.lock();
        let (key, arrived, missing) = st.stuck.clone()?;
        let seq = match key {
            Key::Collective(seq) => Some(seq),
            Key::Message { .. } | Key::Split(_) => None,
        };
        Some(Stuck { seq, arrived, missing })
    }
}

/// Runs a rank's queued work that can run while its host waits (a GPU's progress); returns
/// the collectives left waiting on their groups.
pub(crate) type Progress<'a> = dyn Fn() -> Vec<Arc<Exchange>> + 'a;

/// A rank of a world, as queued work refers to it.
#[derive(Clone)]
pub(crate) struct Rank {
    world: Arc<World>,
    rank: usize,
}

/// Where an operation sits in its group's order: the `n`-th collective, or the `n`-th message
/// from one rank to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Key {
    Collective(u64),
    Message {
        src: usize,
        dst: usize,
        seq: u64,
    },
    /// The `n`-th split, which a rank waits in on the host.
    Split(u64),
}

/// What a rank issued at a key; ranks must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Signature {
    kind: Collective,
    count: usize,
    dtype: DType,
}

impl std::fmt::Display for Signature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} of {} × {}", self.kind.name(), self.count, self.dtype)
    }
}

struct Slot {
    signature: Signature,
    by: usize,
    /// Each rank's posted input (a receiver posts nothing).
    parts: Vec<Option<Arc<Vec<u8>>>>,
    /// Ranks that have not finished yet; the slot goes when none is left.
    pending: usize,
}

struct World {
    size: usize,
    /// Each rank's device: the same device in two groups is one waiter, which is how a deadlock
    /// through several groups is seen.
    devices: Vec<DeviceId>,
    timeout: Duration,
    state: Mutex<WorldState>,
    changed: Condvar,
}

struct WorldState {
    /// Per rank, collectives issued.
    issued: Vec<u64>,
    /// Per (sender, receiver, whether the sender's side), messages issued.
    p2p: HashMap<(usize, usize, bool), u64>,
    slots: HashMap<Key, Slot>,
    gone: Vec<bool>,
    /// Per rank, the keys its queue waits on while it has nothing else to run.
    stalled: Vec<Option<Vec<Key>>>,
    /// The first failure: every later operation of the group fails with it.
    broken: Option<CommErrorKind>,
    /// Where the wait that broke the group stood, when it timed out or lost a rank: the key,
    /// the ranks that had arrived there and those that had not.
    stuck: Option<(Key, Vec<usize>, Vec<usize>)>,
    /// Per rank, splits called.
    split_calls: Vec<u64>,
    /// Splits in progress, by their number in every rank's order.
    splits: HashMap<u64, Split>,
}

/// One split of a group as its ranks arrive: each rank's color and key, then each rank's link
/// in its new group (`None`: no color, or taken).
struct Split {
    asks: Vec<Option<(Option<u32>, usize)>>,
    links: Vec<Option<SimLink>>,
    made: bool,
    taken: usize,
}

impl World {
    fn lock(&self) -> MutexGuard<'_, WorldState> {
        // The state is plain bookkeeping, consistent between statements.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn break_with(&self, st: &mut WorldState, kind: CommErrorKind) -> CommErrorKind {
        let kind = st.broken.get_or_insert(kind).clone();
        self.changed.notify_all();
        kind
    }
}

impl WorldState {
    /// The ranks whose part `key` still needs for `rank` to finish.
    fn missing(&self, key: Key, rank: usize) -> Vec<usize> {
        if let Key::Split(n) = key {
            let Some(split) = self.splits.get(&n).filter(|s| !s.made) else { return Vec::new() };
            return (0..split.asks.len()).filter(|r| split.asks[*r].is_none()).collect();
        }
        let Some(slot) = self.slots.get(&key) else { return Vec::new() };
        let needed: Vec<usize> = match key {
            Key::Collective(_) => (0..slot.parts.len()).collect(),
            // A receive needs the sender's data; a send needs the receiver to have arrived (NCCL's
            // sends wait for their receive beyond its small buffers, so the simulator always does).
            Key::Message { src, dst, .. } if dst == rank => vec![src],
            Key::Message { dst, .. } => vec![dst],
            Key::Split(_) => Vec::new(),
        };
        needed.into_iter().filter(|r| slot.parts[*r].is_none()).collect()
    }

    /// Records that the wait of `rank` on `key` broke the group: who had arrived, who had not.
    fn stick(&mut self, key: Key, rank: usize) {
        let missing = self.missing(key, rank);
        let arrived = match self.slots.get(&key) {
            Some(slot) => (0..slot.parts.len()).filter(|r| slot.parts[*r].is_some()).collect(),
            None => Vec::new(),
        };
        self.stuck.get_or_insert((key, arrived, missing));
    }

    /// What each rank waits for, when every rank waits on another (a deadlock).
    fn deadlock(&self) -> Option<String> {
        let size = self.gone.len();
        let all_stalled = (0..size).all(|r| self.gone[r] || self.stalled[r].is_some());
        let none_can_finish = (0..size).all(|r| match &self.stalled[r] {
            Some(ks) => ks.iter().all(|k| !self.missing(*k, r).is_empty()),
            None => true,
        });
        let waits = (0..size).filter_map(|r| self.stalled[r].as_ref().map(|ks| self.describe(ks[0], r)));
        (all_stalled && none_can_finish).then(|| waits.collect::<Vec<_>>().join("; "))
    }

    fn describe(&self, key: Key, rank: usize) -> String {
        let what = match (key, self.slots.get(&key)) {
            (Key::Collective(seq), Some(s)) => format!("{} #{seq}", s.signature),
            (Key::Collective(seq), None) => format!("collective #{seq}"),
            (Key::Message { src, dst, seq }, _) if dst == rank => format!("recv #{seq} from rank {src}"),
            (Key::Message { dst, seq, .. }, _) => format!("send #{seq} to rank {dst}"),
            (Key::Split(n), _) => format!("split #{n}"),
        };
        let missing: Vec<String> = self.missing(key, rank).iter().map(|r| r.to_string()).collect();
        format!("rank {rank} waits in {what} for rank {}", missing.join(", "))
    }
}

/// Where hosts wait now: each stalled rank's device, group and rank in it. It only locates
/// them; each group's `stalled` says whether the rank still waits, and both change under the
/// group's lock.
static WAITING: Mutex<Vec<(DeviceId, Arc<World>, usize)>> = Mutex::new(Vec::new());

/// How often a stalled rank looks for a deadlock through several groups.
const ACROSS_EVERY: Duration = Duration::from_millis(20);

/// Looks for a deadlock that runs through several groups, from the device `start` whose host
/// waits: every device its waits need (in any group) waits too, in groups where nothing it
/// waits on can finish. Breaks every group of the cycle with [`CommErrorKind::Deadlock`], which
/// their waiting ranks then see. The groups are only tried (one another thread holds is
/// changing, and a later check sees it), so that no order of locks can block.
fn deadlock_across(start: DeviceId) {
    let entries = WAITING.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let mut locked: Vec<(&Arc<World>, MutexGuard<'_, WorldState>)> = Vec::new();
    for (_, w, _) in &entries {
        if locked.iter().any(|(x, _)| Arc::ptr_eq(x, w)) {
            continue;
        }
        match w.state.try_lock() {
            Ok(st) => locked.push((w, st)),
            Err(TryLockError::Poisoned(p)) => locked.push((w, p.into_inner())),
            Err(TryLockError::WouldBlock) => return,
        }
    }
    let (mut seen, mut todo, mut waits, mut cycle) = (HashSet::new(), vec![start], Vec::new(), Vec::new());
    while let Some(device) = todo.pop() {
        if !seen.insert(device) {
            continue;
        }
        let mut waits_somewhere = false;
        for (_, w, r) in entries.iter().filter(|(d, ..)| *d == device) {
            let Some(i) = locked.iter().position(|(x, _)| Arc::ptr_eq(x, w)) else { return };
            let st = &locked[i].1;
            let Some(keys) = &st.stalled[*r] else { continue };
            waits_somewhere = true;
            for k in keys {
                let missing = st.missing(*k, *r);
                // One that can finish, or a rank gone (its own error): no deadlock.
                if missing.is_empty() || missing.iter().any(|m| st.gone[*m]) {
                    return;
                }
                todo.extend(missing.iter().map(|m| w.devices[*m]));
            }
            waits.push(format!("in a group of {}, {}", w.size, st.describe(keys[0], *r)));
            cycle.push(i);
        }
        if !waits_somewhere {
            return;
        }
    }
    let waits = waits.join("; ");
    cycle.sort_unstable();
    cycle.dedup();
    for i in cycle {
        let (w, st) = &mut locked[i];
        w.break_with(st, CommErrorKind::Deadlock { waits: waits.clone() });
    }
}

impl Rank {
    /// Gives the operation its key, or refuses it (and breaks the group: a peer already waits
    /// on a part that will never match) when another rank issued something else there.
    pub(super) fn register(&self, kind: Collective, count: usize, dtype: DType) -> Result<Key> {
        let world = &self.world;
        let mut st = world.lock();
        if let Some(broken) = &st.broken {
            return Err(comm_error(kind.name(), self.rank, broken.clone()));
        }
        let (key, counter) = match kind {
            Collective::Send(dst) => {
                let n = *st.p2p.get(&(self.rank, dst, true)).unwrap_or(&0);
                (Key::Message { src: self.rank, dst, seq: n }, Some((self.rank, dst, true)))
            }
            Collective::Recv(src) => {
                let n = *st.p2p.get(&(src, self.rank, false)).unwrap_or(&0);
                (Key::Message { src, dst: self.rank, seq: n }, Some((src, self.rank, false)))
            }
            _ => (Key::Collective(st.issued[self.rank]), None),
        };
        let signature = Signature { kind, count, dtype };
        let pending = match key {
            Key::Collective(_) | Key::Split(_) => world.size,
            Key::Message { .. } => 2,
        };
        let slot = st.slots.entry(key).or_insert_with(|| Slot {
            signature,
            by: self.rank,
            parts: vec![None; world.size],
            pending,
        });
        let agrees = match (slot.signature.kind, kind) {
            (Collective::Send(_), Collective::Recv(_)) | (Collective::Recv(_), Collective::Send(_)) => {
                (slot.signature.count, slot.signature.dtype) == (count, dtype)
            }
            _ => slot.signature == signature,
        };
        if !agrees {
            let seq = match key {
                Key::Collective(seq) | Key::Message { seq, .. } | Key::Split(seq) => seq,
            };
            let mismatch = CommErrorKind::Mismatch {
                seq,
                rank: self.rank,
                found: signature.to_string(),
                other: slot.by,
                expected: slot.signature.to_string(),
            };
            let kind = world.break_with(&mut st, mismatch);
            return Err(comm_error(signature.kind.name(), self.rank, kind));
        }
        match counter {
            Some(c) => *st.p2p.entry(c).or_insert(0) += 1,
            None => st.issued[self.rank] += 1,
        }
        Ok(key)
    }

    /// NCCL's `ncclCommSplit`: blocks until every rank of the group called its split of the
    /// same number, then returns this rank's link in the group of the ranks that gave the same
    /// `color`, ranked by `key` then by rank (`None` with no color). While it waits, the rank's
    /// queued work runs through `progress`, as a GPU's would: a collective queued before the
    /// split reaches the ranks that wait on it.
    pub(crate) fn split(
        &self,
        color: Option<u32>,
        key: usize,
        progress: &Progress<'_>,
    ) -> Result<Option<SimLink>, CommErrorKind> {
        let (world, size) = (&self.world, self.world.size);
        let n = {
            let mut st = world.lock();
            if let Some(kind) = &st.broken {
                return Err(kind.clone());
            }
            let n = st.split_calls[self.rank];
            st.split_calls[self.rank] += 1;
            let split = st.splits.entry(n).or_insert_with(|| Split {
                asks: vec![None; size],
                links: (0..size).map(|_| None).collect(),
                made: false,
                taken: 0,
            });
            split.asks[self.rank] = Some((color, key));
            world.changed.notify_all();
            n
        };
        // Every rank has asked once nothing is missing at this key.
        self.wait_for(&[Key::Split(n)], Some(progress))?;
        let mut st = world.lock();
        let split = st.splits.get_mut(&n).expect("a split stays until every rank took its link");
        if !split.made {
            let asks: Vec<(Option<u32>, usize)> = split.asks.iter().flatten().copied().collect();
            let mut colors: Vec<u32> = asks.iter().filter_map(|a| a.0).collect();
            colors.sort_unstable();
            colors.dedup();
            for c in colors {
                let mut members: Vec<usize> = (0..size).filter(|&r| asks[r].0 == Some(c)).collect();
                members.sort_by_key(|&r| (asks[r].1, r));
                let devices = members.iter().map(|&r| world.devices[r]).collect();
                let links = SimLink::group(devices, world.timeout);
                for (r, link) in members.into_iter().zip(links) {
                    split.links[r] = Some(link);
                }
            }
            split.made = true;
        }
        let link = split.links[self.rank].take();
        split.taken += 1;
        if split.taken == size {
            st.splits.remove(&n);
        }
        Ok(link)
    }

    /// Posts this rank's input at `key`.
    fn post(&self, key: Key, data: Vec<u8>) {
        let mut st = self.world.lock();
        if let Some(slot) = st.slots.get_mut(&key) {
            slot.parts[self.rank] = Some(Arc::new(data));
        }
        self.world.changed.notify_all();
    }

    /// Whether this rank can finish `key` now (a broken group finishes, with the error).
    pub(super) fn ready(&self, key: Key) -> bool {
        let st = self.world.lock();
        st.broken.is_some() || st.missing(key, self.rank).is_empty()
    }

    /// Blocks until one of `keys` can finish, or fails with the group's error: a rank that left,
    /// a deadlock, the timeout.
    pub(super) fn stall(&self, keys: &[Key]) -> Result<()> {
        self.wait_for(keys, None).map_err(|kind| comm_error("synchronize", self.rank, kind))
    }

    /// [`stall`](Rank::stall), failing with the error's kind; a split waits here too, running
    /// the rank's queued work through `progress` meanwhile. The collectives of this group that
    /// this work then waits on count among the rank's waits: it is stuck only if they are too.
    fn wait_for(&self, keys: &[Key], progress: Option<&Progress<'_>>) -> Result<(), CommErrorKind> {
        let world = &self.world;
        let deadline = Instant::now() + world.timeout;
        loop {
            // Outside the group's lock: the work posts to it.
            let queued = progress.map_or_else(Vec::new, |p| p());
            let mut st = world.lock();
            if let Some(settled) = self.settled(&mut st, keys) {
                return settled;
            }
            let mine = queued.iter().filter(|x| Arc::ptr_eq(&x.task.rank.world, world)).map(|x| x.key);
            let waits: Vec<Key> = keys.iter().copied().chain(mine).collect();
            if waits[keys.len()..].iter().any(|k| st.missing(*k, self.rank).is_empty()) {
                // Queued work can go on: run it.
                continue;
            }
            self.stall_on(&mut st, waits);
            if let Some(waits) = st.deadlock() {
                let kind = world.break_with(&mut st, CommErrorKind::Deadlock { waits });
                self.unstall(&mut st);
                return Err(kind);
            }
            // A cycle through other groups too, looked for without this group's lock (the check
            // takes every group's it needs); it breaks this group if it finds one.
            drop(st);
            deadlock_across(self.device());
            let mut st = world.lock();
            let ended = if let Some(settled) = self.settled(&mut st, keys) {
                Some(settled)
            } else if Instant::now() >= deadline {
                Some(Err(self.time_out(&mut st, keys[0])))
            } else {
                let left = deadline.saturating_duration_since(Instant::now()).min(ACROSS_EVERY);
                st = world.changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
                None
            };
            self.unstall(&mut st);
            if let Some(ended) = ended {
                return ended;
            }
        }
    }

    /// This rank's device: the waiter it is in every group.
    fn device(&self) -> DeviceId {
        self.world.devices[self.rank]
    }

    /// Marks this rank stalled on `keys` (`st` is its group's state, locked), where a check
    /// across groups finds it.
    fn stall_on(&self, st: &mut WorldState, keys: Vec<Key>) {
        st.stalled[self.rank] = Some(keys);
        let mut waiting = WAITING.lock().unwrap_or_else(PoisonError::into_inner);
        if !waiting.iter().any(|(_, w, r)| Arc::ptr_eq(w, &self.world) && *r == self.rank) {
            waiting.push((self.device(), self.world.clone(), self.rank));
        }
    }

    /// Undoes [`stall_on`](Rank::stall_on).
    fn unstall(&self, st: &mut WorldState) {
        st.stalled[self.rank] = None;
        let mut waiting = WAITING.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.retain(|(_, w, r)| !(Arc::ptr_eq(w, &self.world) && *r == self.rank));
    }

    /// How a wait on `keys` ends now, if it does: the group's error, one of them able to finish,
    /// or a rank it needs gone (which breaks the group).
    fn settled(&self, st: &mut WorldState, keys: &[Key]) -> Option<Result<(), CommErrorKind>> {
        if let Some(kind) = &st.broken {
            return Some(Err(kind.clone()));
        }
        if keys.iter().any(|k| st.missing(*k, self.rank).is_empty()) {
            return Some(Ok(()));
        }
        let gone = keys.iter().find_map(|k| Some((*k, st.missing(*k, self.rank).into_iter().find(|r| st.gone[*r])?)));
        gone.map(|(key, rank)| {
            if st.broken.is_none() {
                st.stick(key, self.rank);
            }
            Err(self.world.break_with(st, CommErrorKind::RankGone { rank }))
        })
    }

    /// Breaks the group: this rank waited on `key` past the timeout.
    fn time_out(&self, st: &mut WorldState, key: Key) -> CommErrorKind {
        let waiting = st.describe(key, self.rank);
        let secs = self.world.timeout.as_secs_f64();
        if st.broken.is_none() {
            st.stick(key, self.rank);
        }
        self.world.break_with(st, CommErrorKind::Timeout { waiting, secs })
    }

    /// Takes every rank's part of `key` (none for a rank that posts none) once this rank's
    /// result is made from them.
    fn finish(&self, key: Key) -> Result<Vec<Option<Arc<Vec<u8>>>>> {
        let mut st = self.world.lock();
        if let Some(kind) = &st.broken {
            return Err(comm_error("collective", self.rank, kind.clone()));
        }
        let slot = st.slots.get_mut(&key).expect("a registered key keeps its slot until every rank finished");
        let parts = slot.parts.clone();
        slot.pending -= 1;
        if slot.pending == 0 {
            st.slots.remove(&key);
        }
        Ok(parts)
    }
}

/// A collective as queued: the rank, what it does, where it reads and writes.
pub(crate) struct CollectiveTask {
    pub(super) rank: Rank,
    pub(super) kind: Collective,
    pub(super) src: (Arc<Block>, usize),
    pub(super) dst: (Arc<Block>, usize),
    pub(super) count: usize,
    pub(super) dtype: DType,
}

/// One issue of a collective task: the task and its key in the group's order.
pub(crate) struct Exchange {
    task: Arc<CollectiveTask>,
    pub(super) key: Key,
}

impl Exchange {
    /// Registers one issue of `task` in its group's order.
    pub(super) fn issue(task: &Arc<CollectiveTask>) -> Result<Arc<Exchange>> {
        let key = task.rank.register(task.kind, task.count, task.dtype)?;
        Ok(Arc::new(Exchange { task: task.clone(), key }))
    }

    pub(super) fn arrive(&self) -> Result<()> {
        self.task.arrive(self.key)
    }

    pub(super) fn ready(&self) -> bool {
        self.task.rank.ready(self.key)
    }

    pub(super) fn finish(&self) -> Result<()> {
        self.task.finish(self.key)
    }
}

/// Blocks until one of `waiting` can finish, or fails with a group's error. The collectives of
/// one group wait on its state, with its deadlock check. Those of several groups (a split next to
/// its world) are polled each in its own group: a key means nothing in another group's order. A
/// rank that waits on two groups may be freed by either, so neither group alone can call it
/// deadlocked: the check across groups ([`deadlock_across`]) does, when nothing it waits on in
/// any group can finish.
pub(super) fn stall(waiting: &[&Arc<Exchange>]) -> Result<()> {
    let Some(first) = waiting.first() else { return Ok(()) };
    let rank = &first.task.rank;
    if waiting.iter().all(|x| Arc::ptr_eq(&x.task.rank.world, &rank.world)) {
        let keys: Vec<Key> = waiting.iter().map(|x| x.key).collect();
        return rank.stall(&keys);
    }
    let deadline = Instant::now() + waiting.iter().map(|x| x.task.rank.world.timeout).min().unwrap_or_default();
    // Stalled in each of its groups, on that group's keys, for the check across groups (a key
    // that can finish makes no deadlock, so marking before the first look is safe).
    for x in waiting {
        let r = &x.task.rank;
        let keys = waiting.iter().filter(|y| Arc::ptr_eq(&y.task.rank.world, &r.world)).map(|y| y.key).collect();
        r.stall_on(&mut r.world.lock(), keys);
    }
    let mut checked = Instant::now();
    let ended = 'wait: loop {
        for x in waiting {
            let r = &x.task.rank;
            if let Some(settled) = r.settled(&mut r.world.lock(), &[x.key]) {
                break 'wait settled.map_err(|kind| comm_error("synchronize", r.rank, kind));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            let kind = rank.time_out(&mut rank.world.lock(), first.key);
            break Err(comm_error("synchronize", rank.rank, kind));
        }
        if now.duration_since(checked) >= ACROSS_EVERY {
            deadlock_across(rank.device());
            checked = now;
        }
        // Woken by the first group's changes; the others are looked at again soon.
        let st = rank.world.lock();
        let slice = (deadline - now).min(Duration::from_millis(1));
        drop(rank.world.changed.wait_timeout(st, slice).unwrap_or_else(|p| p.into_inner()));
    };
    for x in waiting {
        let r = &x.task.rank;
        r.unstall(&mut r.world.lock());
    }
    ended
}

impl CollectiveTask {
    /// One task per part of a collective operation.
    pub(crate) fn from_op(op: &crate::device::backend::Op<'_>) -> Result<Vec<Arc<CollectiveTask>>> {
        let crate::device::backend::Op::Collective { comm, parts, dtype } = *op else {
            unreachable!("called for collectives only")
        };
        let Repr::Sim(link) = comm else {
            return Err(Error::Unsupported {
                op: "collective",
                backend: "sim",
                why: "an NCCL communicator reached the simulator; use a communicator of Communicator::sim_group",
            });
        };
        Ok((parts.iter())
            .map(|p| {
                Arc::new(CollectiveTask {
                    rank: link.rank.clone(),
                    kind: p.kind,
                    src: (p.src.0.clone(), p.src.1),
                    dst: (p.dst.0.clone(), p.dst.1),
                    count: p.count,
                    dtype,
                })
            })
            .collect())
    }

    /// Bytes this rank posts.
    fn input_bytes(&self) -> usize {
        let n = match self.kind {
            Collective::ReduceScatter => self.count * self.rank.world.size,
            _ => self.count,
        };
        n * self.dtype.size()
    }

    /// The arrival: posts this rank's input (a receiver posts an empty part: that it is there).
    fn arrive(&self, key: Key) -> Result<()> {
        if let Collective::Recv(_) = self.kind {
            self.rank.post(key, Vec::new());
            return Ok(());
        }
        let mut data = vec![0u8; self.input_bytes()];
        mem(&self.src.0)?.read(self.kind.name(), self.src.1, &mut data)?;
        self.rank.post(key, data);
        Ok(())
    }

    /// The finish: writes this rank's result from every rank's part.
    fn finish(&self, key: Key) -> Result<()> {
        let parts = self.rank.finish(key)?;
        let posted: Vec<Arc<Vec<u8>>> = parts.iter().flatten().cloned().collect();
        let bytes = self.count * self.dtype.size();
        let out = match self.kind {
            Collective::Send(_) => return Ok(()),
            Collective::Recv(src) => match parts.get(src) {
                Some(Some(data)) => data.to_vec(),
                _ => return Err(comm_error("recv", self.rank.rank, CommErrorKind::RankGone { rank: src })),
            },
            Collective::AllGather => posted.iter().flat_map(|p| p.iter().copied()).collect(),
            Collective::AllReduce => sum(self.dtype, &posted),
            Collective::AllReduceAmax => max_bits(&posted),
            Collective::ReduceScatter => sum(self.dtype, &posted)[self.rank.rank * bytes..][..bytes].to_vec(),
        };
        mem(&self.dst.0)?.write(self.kind.name(), self.dst.1, &out)
    }
}

/// The element-wise sum of the parts, in rank order, rounded to the element type at each step
/// (as a ring does; for two ranks, one exact-to-order addition).
fn sum(dtype: DType, parts: &[Arc<Vec<u8>>]) -> Vec<u8> {
    fn add<T: bytemuck::Pod>(parts: &[Arc<Vec<u8>>], f: impl Fn(T, T) -> T) -> Vec<u8> {
        let values =
            |p: &[u8]| -> Vec<T> { p.chunks_exact(size_of::<T>()).map(bytemuck::pod_read_unaligned).collect() };
        let mut acc = values(&parts[0]);
        for p in &parts[1..] {
            for (a, b) in acc.iter_mut().zip(values(p)) {
                *a = f(*a, b);
            }
        }
        bytemuck::cast_slice(&acc).to_vec()
    }
    match dtype {
        DType::BF16 => add::<bf16>(parts, |a, b| bf16::from_f32(a.to_f32() + b.to_f32())),
        DType::F16 => add::<f16>(parts, |a, b| f16::from_f32(a.to_f32() + b.to_f32())),
        _ => add::<f32>(parts, |a, b| a + b),
    }
}

/// The element-wise max of the parts as `u32`s (FP8 amaxes compared as their bits).
fn max_bits(parts: &[Arc<Vec<u8>>]) -> Vec<u8> {
    let mut acc: Vec<u32> = parts[0].chunks_exact(4).map(bytemuck::pod_read_unaligned).collect();
    for p in &parts[1..] {
        for (a, b) in acc.iter_mut().zip(p.chunks_exact(4).map(bytemuck::pod_read_unaligned::<u32>)) {
            *a = (*a).max(b);
        }
    }
    bytemuck::cast_slice(&acc).to_vec()
}

fn mem(block: &Block) -> Result<&SimMem> {
    match &block.raw.mem {
        Repr::Sim(m) => Ok(m),
        Repr::Cuda(_) => Err(Error::Unsupported {
            op: "collective",
            backend: "sim",
            why: "a CUDA buffer reached the simulator; please report this as a bug",
        }),
    }
}
