//! What the manager keeps per chunk: the layout the recording iteration recorded (fixed
//! afterwards), and the state of the current iteration's groups.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use super::host::{HostBuffer, HostPool};
use super::policy::{GroupLayout, Summary};
use crate::device::{Device, Event};
use crate::nn::Chunk;
use crate::tensor::Tensor;
use crate::Result;

/// Where a chunk's current iteration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// No iteration running (or the last one's backward began; a forward starts a new one).
    Idle,
    /// In the forward of unit `pass`.
    Forward { pass: usize },
    /// In the backward, at unit `pass` (the latest whose saved tensors were taken).
    Backward { pass: usize },
}

/// The host buffer of an offloaded tensor: from the manager's pool (eager), or baked into graphs
/// (an index into the chunk hook's buffers).
pub(crate) enum HostRef {
    Pooled(HostBuffer),
    Baked,
}

/// One saved tensor in the current iteration.
#[derive(Default)]
pub(crate) struct Slot {
    /// Whether the policy offloads it (else it stays on the device, handed out through a
    /// ticket so that the backward's takes mark where each unit's backward begins).
    pub(crate) offload: bool,
    /// On the device, until its copy out was issued (or for good, when kept).
    pub(crate) device: Option<Tensor>,
    /// Its host copy, once issued.
    pub(crate) host: Option<HostRef>,
    /// Its copy back, once issued; handed to the backward.
    pub(crate) back: Option<Tensor>,
    /// Handed to the backward.
    pub(crate) taken: bool,
}

/// One group in the current iteration.
#[derive(Default)]
pub(crate) struct GroupRun {
    pub(crate) slots: Vec<Slot>,
    /// Eager events, made once and recorded again every iteration: a fork point on the compute
    /// stream, the end of the copy out, the end of the copy back.
    pub(crate) events: Option<[Event; 3]>,
    /// The capture whose graph copies it out, if captured.
    pub(crate) out_capture: Option<u64>,
    /// The capture whose graph copies it back, and the capture-local event after the copy.
    pub(crate) in_capture: Option<(u64, Event)>,
    /// Its copy back was issued.
    pub(crate) back_issued: bool,
    /// The backward's stream waits for its copy back.
    pub(crate) waited: bool,
}

impl GroupRun {
    pub(crate) fn events(&mut self, dev: &Device) -> Result<&[Event; 3]> {
        if self.events.is_none() {
            self.events = Some([dev.event()?, dev.event()?, dev.event()?]);
        }
        Ok(self.events.as_ref().expect("made above"))
    }

    /// Forgets the iteration, keeping the events.
    pub(crate) fn clear(&mut self) {
        *self = GroupRun { events: self.events.take(), ..GroupRun::default() };
    }

    /// Whether every tensor it handed out as away was taken back.
    pub(crate) fn consumed(&self) -> bool {
        self.slots.iter().all(|s| s.taken || (s.device.is_none() && s.host.is_none() && s.back.is_none()))
    }
}

/// Where a timing event of the recording iteration was recorded: when a unit's forward began, or
/// when its backward took its first saved tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    Forward(usize),
    Backward(usize),
}

/// Timing events of the recording iteration (devices with a clock, automatic policy), in the
/// order they were recorded: each mark's window ends at the next one, whatever the order of the
/// passes (a whole stack's forwards then backwards, or a capture's warmup, unit by unit).
#[derive(Default)]
pub(crate) struct PassTiming {
    pub(crate) marks: Vec<(Mark, Event)>,
}

/// One chunk: its recorded layout and its current iteration.
pub(crate) struct ChunkState {
    pub(crate) layout: Vec<GroupLayout>,
    pub(crate) run: Vec<GroupRun>,
    pub(crate) phase: Phase,
    /// The next group of the forward.
    pub(crate) cursor: usize,
    /// The group being saved, between open and commit.
    pub(crate) open: Option<usize>,
    /// Groups committed inside a capture, whose copies the next captured unit issues.
    pub(crate) queued: Vec<usize>,
    /// Counts iterations, so that a saved tensor of an earlier one is refused.
    pub(crate) iteration: u64,
    /// Whether the frozen policy offloads anything of it (else its tensors are kept plainly).
    pub(crate) offloads: bool,
    pub(crate) timing: Option<PassTiming>,
}

impl ChunkState {
    pub(crate) fn new() -> ChunkState {
        ChunkState {
            layout: Vec::new(),
            run: Vec::new(),
            phase: Phase::Idle,
            cursor: 0,
            open: None,
            queued: Vec::new(),
            iteration: 0,
            offloads: false,
            timing: None,
        }
    }

    /// Groups still holding tensors of the current iteration.
    pub(crate) fn pending(&self) -> usize {
        self.run.iter().filter(|g| !g.consumed()).count()
    }

    /// Starts a new iteration.
    pub(crate) fn restart(&mut self) {
        self.run.iter_mut().for_each(GroupRun::clear);
        self.phase = Phase::Idle;
        self.cursor = 0;
        self.open = None;
        self.queued.clear();
        self.iteration += 1;
    }
}

/// The manager's state behind its lock.
pub(crate) struct State {
    /// Off during a graph capture's warmup once the policy is frozen (the warmup hooks).
    pub(crate) enabled: bool,
    /// The iteration being recorded is a capture's warmup, which runs each unit's backward right
    /// after its forward: a forward after a backward is the next unit, not a new iteration.
    pub(crate) warmup_recording: bool,
    /// The warmup's recording iteration ended and the automatic policy waits for the window
    /// probe after the warmup (forgotten when the warmup ends without it).
    pub(crate) awaiting_windows: bool,
    /// The policy was frozen by the warmup of the capture under way (forgotten if it fails).
    pub(crate) capture_recorded: bool,
    /// Host-buffer slots of graph hooks made before the policy froze, filled when it freezes.
    pub(crate) unbaked: Vec<(Chunk, Arc<OnceLock<Baked>>)>,
    /// Whether the recording iteration ended and the policy is fixed.
    pub(crate) frozen: bool,
    pub(crate) chunks: BTreeMap<Chunk, ChunkState>,
    pub(crate) host: HostPool,
    /// Eager groups whose copies wait for the next graph launch (delayed commits).
    pub(crate) delayed: Vec<(Chunk, usize)>,
    /// Streams forked into the capture in progress: (copy out, copy back).
    pub(crate) forked: (bool, bool),
    pub(crate) summary: Option<Summary>,
    /// What each layer of the capture under way lends its pool (empty: no lending), for the
    /// policy's expected saving (Note [Offloading lent memory] in `offload/saving.rs`).
    pub(crate) lent: Vec<usize>,
    /// Bytes copied out since the manager was made, eagerly and in captures.
    pub(crate) copied_out: usize,
    /// Every chunk's baked buffers, for switches (those of dropped graphs are gone).
    pub(crate) baked: Vec<(Chunk, std::sync::Weak<OnceLock<Baked>>)>,
    /// What a switchable capture's device copies name (`None` until one needs it).
    pub(crate) scratch: Option<Arc<super::host::Scratch>>,
    /// The device buffers of the offloaded tensors kept resident.
    pub(crate) resident: foldhash::HashMap<ResidentKey, Tensor>,
    /// The last switch's plan, for the next switch over the same executables.
    pub(crate) switch_plan: Option<Arc<super::switch::SwitchPlan>>,
    /// A step of the protocol left out on purpose (tests of the hazards).
    pub(crate) fault: Option<Fault>,
}

/// A step of the protocol that [`OffloadManager::inject`](super::OffloadManager::inject) leaves
/// out, so that a test shows what catches the hazard it guards against (`notes/offload.md`
/// §3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// H3: the copy streams forked into a capture are not joined back.
    SkipJoin,
    /// H4: inside a capture, the copy back waits on an eager event of its group.
    WaitOutsideCapture,
    /// H5: a copy back and its use in the same capture are not joined.
    SkipCaptureLocalWait,
    /// H7: the device memory of a copied-out tensor is released for reuse before its copy out.
    ReleaseBeforeCopy,
    /// H8: a host buffer's next copy out does not wait for its last copy back.
    SkipHostBufferWait,
    /// H9: a copy back does not wait for its copy out.
    SkipCopyOutWait,
    /// H9: the backward does not wait for a copy back before using it.
    SkipCopyBackWait,
}

impl State {
    /// Whether an iteration starting now records eagerly, so that the automatic policy times
    /// it: not once frozen, and not in a capture's warmup, whose windows come from the probe
    /// of the layers' graphs after it.
    pub(crate) fn times_eagerly(&self) -> bool {
        !self.frozen && !self.warmup_recording
    }

    pub(crate) fn new() -> State {
        State {
            enabled: true,
            warmup_recording: false,
            awaiting_windows: false,
            capture_recorded: false,
            unbaked: Vec::new(),
            frozen: false,
            chunks: BTreeMap::new(),
            host: HostPool::default(),
            delayed: Vec::new(),
            forked: (false, false),
            summary: None,
            lent: Vec::new(),
            copied_out: 0,
            baked: Vec::new(),
            scratch: None,
            resident: foldhash::HashMap::default(),
            switch_plan: None,
            fault: None,
        }
    }
}

/// Host buffers baked into one chunk's graphs, per (group, tensor): they live as long as the
/// graphs, which keep the chunk hook holding them.
pub(crate) struct Baked {
    pub(crate) buffers: BTreeMap<(usize, usize), HostBuffer>,
}

impl Baked {
    pub(crate) fn get(&self, group: usize, slot: usize) -> Option<&HostBuffer> {
        self.buffers.get(&(group, slot))
    }
}

/// A chunk's baked buffers, if its hook was made for graphs: set when the policy freezes (at once
/// for a hook made after that).
pub(crate) type BakedRef = Option<Arc<OnceLock<Baked>>>;

/// Which offloaded tensor is kept resident: its chunk's baked buffers (by the address of their
/// shared slot, which lives as long as a graph of that capture does), its group and its slot.
/// A new capture of the same chunk bakes new buffers, so its tensors have keys of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ResidentKey {
    pub(crate) baked: usize,
    pub(crate) group: usize,
    pub(crate) slot: usize,
}
