//! The offload manager: its copy streams, host buffers, chunks and policy.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::chunk::{bake, ChunkHook};
use super::config::{OffloadConfig, Policy};
use super::copy_probe::{fastest_of_three, CopyGraphs};
use super::error::OffloadErrorKind;
use super::host::{HostBuffer, Scratch};
use super::policy::{decide, mark_eligible, GroupLayout, Summary, TensorLayout, Timings, Windows};
use super::shared::Inner;
use super::state::{Baked, Fault, Mark, PassTiming, ResidentKey, State};
use super::switch::{switch_nodes, Slots, SwitchPlan, SwitchTimes};
use super::table::CopyTable;
use crate::device::{BufferId, DType, Stream};
use crate::graph::{GraphOptions, GraphedCallable, PassTimes, Probe, PROBE_REPLAYS};
use crate::memory::{CachingAllocator, PoolExec};
use crate::nn::{Chunk, SaveHook};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Activation offloading, eager and inside captured graphs (Megatron-LM's fine-grained
/// offloading): a copy-out and a copy-back stream, pinned host buffers, one save hook per chunk,
/// and a policy decided after a recording iteration and frozen before capture.
///
/// For graphs, the capture records: pass [`graph_options`](OffloadManager::graph_options) to
/// [`make_graphed_stack`](crate::graph::make_graphed_stack) (or `make_graphed_callables`), and
/// the first iteration of its warmup records what every module saves, the policy is frozen, and
/// the graphs get their host buffers. Eagerly, the first iteration through the chunk hooks
/// records, and [`end_iteration`](OffloadManager::end_iteration) freezes.
///
/// ```
/// use graphed::device::{DType, Device};
/// use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Layers, ParamStore, Stack, TransformerLayer};
/// use graphed::offload::{OffloadConfig, OffloadManager};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let (main, side, ready) = (dev.stream()?, dev.stream()?, dev.event()?);
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &main, 3 * TransformerLayer::parameter_count(32))?;
/// let vb = Builder::new(&store, &alloc, &main)?;
/// let stack = Stack::new(TransformerLayer::stack(&vb, (32, 1), &Layers::first(3))?);
/// let x = Tensor::zeros(&alloc, &main, &[2, 4, 32], DType::F32)?;
/// let dy = Tensor::zeros(&alloc, &main, &[2, 4, 32], DType::F32)?;
///
/// let offload = OffloadManager::new(&alloc, OffloadConfig::default().min_elements(64))?;
/// // The capture's warmup records and freezes the policy; the copies run in the graphs' tails.
/// let options = offload.graph_options(GraphOptions::default().sync_event(&ready));
/// let graphed = make_graphed_stack(&alloc, &stack, &x, options)?;
/// assert!(offload.summary().unwrap().offloaded_bytes() > 0);
/// graphed.forward(&main, &x, Replay::side(&side))?;
/// graphed.backward(&main, &dy)?;
/// graphed.join(&main)?;
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone)]
pub struct OffloadManager {
    inner: Arc<Inner>,
}

/// The refusal of a chunk that the recording iteration did not see, met by `found`.
fn schedule_error(chunk: Chunk, found: &str) -> Error {
    let (expected, found) = ("nothing (the chunk was not in it)".into(), found.into());
    Error::Offload(OffloadErrorKind::Schedule { chunk, expected, found })
}

/// A tensor that a switch changes: its place in the switch's plan, its host buffer, and whether
/// it is kept resident (else offloaded again).
struct Change<'a> {
    tensor: usize,
    host: &'a HostBuffer,
    keep: bool,
}

/// What [`OffloadManager::keep_resident`] left resident.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resident {
    /// Offloaded tensors kept on the device.
    pub tensors: usize,
    /// Their bytes, allocated for them.
    pub bytes: usize,
}

/// Each chunk's timing marks of an eager recording iteration (none where it was not timed).
type Marks = Vec<(Chunk, Option<PassTiming>)>;

/// The bytes a bandwidth probe copies each way.
const PROBE_BYTES: usize = 64 << 20;

impl OffloadManager {
    /// A manager on `alloc`'s device, with its own copy streams.
    ///
    /// # Errors
    /// [`OffloadErrorKind::BadSelector`] or [`OffloadErrorKind::Slack`] for an invalid
    /// configuration; device errors.
    pub fn new(alloc: &CachingAllocator, config: OffloadConfig) -> Result<OffloadManager> {
        config.validate()?;
        Ok(OffloadManager { inner: Arc::new(Inner::new(alloc, config)?) })
    }

    /// The save hook of `chunk`, for its eager forward. The first iteration through the chunk
    /// hooks records what is saved (and keeps it on the device); later ones offload.
    pub fn chunk(&self, chunk: Chunk) -> ChunkHook {
        ChunkHook { inner: self.inner.clone(), chunk, baked: None }
    }

    /// `options` with this manager as the graphs' save hook, one hook per captured chunk holding
    /// host buffers for its graphs (they live as long as the graphs).
    ///
    /// If the policy is not frozen yet, the capture's warmup records it: its first iteration,
    /// which runs each layer's backward right after its forward, goes through the hooks and
    /// ends as [`end_iteration`](OffloadManager::end_iteration) ends an eager one, deciding and
    /// freezing the listed policy. The automatic policy decides after the warmup, from the
    /// graphed step's windows ([`Windows::Graphs`]): the capture's window probe captures each
    /// layer's forward and backward without offloading into graphs of a pool of its own, times
    /// a few replays of each, and releases them and their memory before the real capture; the
    /// copy rate is that of one layer's candidates copied inside a graph. On the simulator the probe runs but cannot time: the capture is
    /// refused ([`OffloadErrorKind::NoClock`]). The host buffers are baked when the policy
    /// freezes, before the capture; a warmup or probe that fails first leaves the policy
    /// unrecorded. The rest of the warmup runs with offloading off, as does the whole warmup of a
    /// capture after the policy froze (`pre_warmup`/`post_warmup`, which this replaces: call
    /// [`disable`](OffloadManager::disable) and [`enable`](OffloadManager::enable) from your
    /// own hooks instead). Give the options a sync event, so that side-stream replays overlap
    /// the copies in each graph's tail.
    pub fn graph_options(&self, options: GraphOptions) -> GraphOptions {
        let (handler, pre, first, timer, post, abandoned) =
            (self.clone(), self.clone(), self.clone(), self.clone(), self.clone(), self.clone());
        options
            .init_chunk_handler(move |chunk| handler.graph_hook(chunk))
            .pre_warmup(move |_| {
                pre.begin_warmup();
                Ok(())
            })
            .after_first_iteration(move |stream, lent| first.end_recording(stream, lent))
            .window_probe(move |stream, probe| timer.time_windows(stream, probe))
            .post_warmup(move |stream| post.end_warmup(stream))
            .on_abandon(move || abandoned.forget_capture_recording())
    }

    /// The hook of `chunk` for its graphs, with host buffers baked for them now if the policy
    /// is frozen, else when it freezes.
    fn graph_hook(&self, chunk: Chunk) -> Result<Arc<dyn SaveHook>> {
        let mut st = self.inner.lock();
        let slot = match st.frozen {
            true => {
                let c = st.chunks.get(&chunk).ok_or_else(|| schedule_error(chunk, "a capture"))?;
                Arc::new(OnceLock::from(bake(self.inner.alloc.device(), &c.layout)?))
            }
            false => {
                let slot = Arc::new(OnceLock::new());
                st.unbaked.push((chunk, slot.clone()));
                slot
            }
        };
        st.baked.push((chunk, Arc::downgrade(&slot)));
        Ok(Arc::new(ChunkHook { inner: self.inner.clone(), chunk, baked: Some(slot) }))
    }

    /// Keeps on the device, from the next step of `graphs` on, the offloaded tensors of the
    /// groups `keep` chooses, and offloads the others again, without a new capture: the tensors
    /// that `graphs` copy out and back, graphed callables captured with this manager and
    /// [`OffloadConfig::switchable`] (a stack's [`layers`](crate::graph::GraphedStack::layers),
    /// a schedule's [`callables`](crate::graph::GraphedSchedule::callables); a layer's tensors
    /// are copied by the graphs of the layer above it). Between steps only: every pool's next
    /// graph is its first, and `stream` is the one the steps join on
    /// ([`GraphedStack::join`](crate::graph::GraphedStack::join)), after the last step's join.
    ///
    /// A tensor kept resident gets device memory (from the allocator, now, for `stream`; the
    /// tensors a switch keeps share one allocation, and one that stays resident beside one
    /// offloaded again moves with them, so that allocations go back whole: between steps their
    /// contents are dead), and its graphs' copies to and from the host are turned off; the device copies
    /// captured beside them, into and out of that memory, are turned on. Why not only turn the
    /// host copies off: the memory the tensor had in the graph pool is handed to later
    /// allocations of the step, and the backward reads the copy back's destination
    /// (docs/offload.md). Offloaded again, its memory is given back to the allocator for
    /// `stream` after the work enqueued there so far, so that the next switch can reuse it (as
    /// it is at the next switch after its graphs are dropped, or with the manager). Returns the
    /// tensors and bytes now resident.
    ///
    /// # Errors
    /// [`OffloadErrorKind::NotSwitchable`], [`OffloadErrorKind::SwitchMidStep`] and
    /// [`OffloadErrorKind::SwitchGraphs`], decided before anything changes; allocation and
    /// device errors.
    pub fn keep_resident(
        &self,
        graphs: &[GraphedCallable],
        stream: &Stream,
        keep: impl Fn(Chunk, &GroupLayout) -> bool,
    ) -> Result<Resident> {
        let (start, mut times) = (Instant::now(), SwitchTimes::default());
        let execs: Vec<&PoolExec> = graphs.iter().flat_map(GraphedCallable::executables).collect();
        // Between runs is a pool's state: asked once per pool (a stack's graphs share one).
        let mut pools = Vec::new();
        for e in &execs {
            if pools.contains(&e.pool_id()) {
                continue;
            }
            pools.push(e.pool_id());
            if !e.between_runs() {
                let graph = e.name().unwrap_or_else(|| e.id().to_string());
                return Err(Error::Offload(OffloadErrorKind::SwitchMidStep { graph }));
            }
        }
        self.inner.alloc.device().check_same("OffloadManager::keep_resident", "stream", stream.device().id())?;
        let mut st = self.inner.lock();
        // Graphs dropped since: their baked buffers are gone, and their tensors' memory goes too
        // (below, once the switch is not refused).
        st.baked.retain(|(_, w)| w.strong_count() > 0);
        let alive: Vec<usize> = st.baked.iter().map(|(_, w)| w.as_ptr() as usize).collect();
        let gone: Vec<ResidentKey> = st.resident.keys().filter(|k| !alive.contains(&k.baked)).copied().collect();
        let (plan, slots) = self.switch_plan(&mut st, &execs)?;
        // What changes, each checked before anything does.
        let mut changes: Vec<Change<'_>> = Vec::with_capacity(plan.tensors.len());
        // Those that stay resident, each asked once (`keep` may count its calls).
        let mut staying: Vec<Change<'_>> = Vec::new();
        for (tensor, t) in plan.tensors.iter().enumerate() {
            let (Some(b), Some(c)) = (slots[t.slot].get(), st.chunks.get(&t.chunk)) else { continue };
            let want = keep(t.chunk, &c.layout[t.key.group]);
            let host = b.get(t.key.group, t.key.slot).expect("a planned tensor's buffer is baked");
            if want == st.resident.contains_key(&t.key) {
                if want {
                    staying.push(Change { tensor, host, keep: want });
                }
                continue;
            }
            if t.twins.is_none() {
                return Err(Error::Offload(OffloadErrorKind::NotSwitchable));
            }
            if t.found != 4 {
                return Err(Error::Offload(OffloadErrorKind::SwitchGraphs { found: t.found }));
            }
            changes.push(Change { tensor, host, keep: want });
        }
        // The tensors a switch keeps share one allocation, given back whole: those that stay
        // resident beside one offloaded again (or one whose graphs were dropped) move with this
        // switch's (between steps their contents are dead, so nothing is copied), and its
        // memory goes back.
        let key = |c: &Change<'_>| plan.tensors[c.tensor].key;
        let leaving = changes.iter().filter(|c| !c.keep).map(key).chain(gone.iter().copied());
        let freed: Vec<BufferId> = leaving.filter_map(|k| st.resident.get(&k)).map(Tensor::id).collect();
        for c in staying {
            if st.resident.get(&key(&c)).is_some_and(|now| freed.contains(&now.id())) {
                changes.push(c);
            }
        }
        let planned = Instant::now();
        times.plan = planned - start;
        let kept = self.allocate_kept(stream, &plan, &changes)?;
        times.alloc = planned.elapsed();
        // Each executable's switches, in one rebind and one toggle each way.
        let mut change_of = vec![None; plan.tensors.len()];
        for (k, c) in changes.iter().enumerate() {
            change_of[c.tensor] = Some(k);
        }
        let mut switches = Vec::new();
        for (exec, held) in execs.iter().zip(&plan.by_exec) {
            switches.clear();
            for &(t, h) in held {
                if let Some(k) = change_of[t] {
                    switches.push((&plan.tensors[t].holding[h], kept[k].as_ref()));
                }
            }
            if !switches.is_empty() {
                switch_nodes(exec, &switches, &mut times)?;
            }
        }
        drop(switches);
        // The device copies' addresses, written on `stream` before the launches that read them
        // (after the last step's, which `stream` joined), once per table.
        let pointed = Instant::now();
        let mut tables: Vec<&Arc<CopyTable>> = Vec::new();
        for (c, t) in changes.iter().zip(&kept) {
            if let Some(table) = c.host.point_twins(t.as_ref())? {
                if !tables.iter().any(|k| Arc::ptr_eq(k, table)) {
                    tables.push(table);
                }
            }
        }
        tables.iter().try_for_each(|t| t.upload(stream))?;
        let uploads = tables.len();
        let switched = Instant::now();
        times.table = switched - pointed;
        let mut released: Vec<Tensor> = gone.iter().filter_map(|k| st.resident.remove(k)).collect();
        for (c, kept) in changes.iter().zip(kept) {
            match kept {
                Some(kept) => released.extend(st.resident.insert(key(c), kept)),
                None => released.extend(st.resident.remove(&key(c))),
            }
        }
        // Their last reads and writes were graph launches on `stream` or joined into it: given
        // back after them, the memory serves `stream` at once and the other streams after the
        // event (freed without it, memory that several streams used waits for a synchronize of
        // the device, and every switch would reserve more).
        if !released.is_empty() {
            stream.record(&self.inner.released)?;
            // Once per allocation: a switch's tensors share theirs.
            released.sort_unstable_by_key(Tensor::id);
            released.dedup_by_key(|t| t.id());
            for t in &released {
                t.release_after(&self.inner.released, stream)?;
            }
        }
        times.release = switched.elapsed();
        let kept = changes.iter().filter(|c| c.keep).count();
        tracing::debug!(
            tensors = changes.len(),
            kept,
            executables = execs.len(),
            uploads,
            ?times,
            "graphed: offload switch"
        );
        let mine = |k: &ResidentKey| slots.iter().any(|s| Arc::as_ptr(s) as usize == k.baked);
        let resident: Vec<&Tensor> = st.resident.iter().filter(|(k, _)| mine(k)).map(|(_, t)| t).collect();
        Ok(Resident { tensors: resident.len(), bytes: resident.iter().map(|t| t.bytes()).sum() })
    }

    /// The plan of a switch over `execs` ([`SwitchPlan`]): the last switch's if it was over the
    /// same executables and their baked buffers live, else a new one, kept for the next; with
    /// the baked buffers of its slots.
    fn switch_plan(&self, st: &mut State, execs: &[&PoolExec]) -> Result<(Arc<SwitchPlan>, Slots)> {
        if let Some(plan) = st.switch_plan.as_ref().filter(|p| p.is_of(execs)) {
            if let Some(slots) = plan.upgrade() {
                return Ok((plan.clone(), slots));
            }
        }
        let chunks = &st.chunks;
        let layout = |chunk: Chunk, g: usize, s: usize| {
            let t = chunks.get(&chunk)?.layout.get(g)?.tensors.get(s)?;
            Some((t.shape.clone(), t.dtype))
        };
        let plan = Arc::new(SwitchPlan::new(execs, &st.baked, layout)?);
        let slots = plan.upgrade().expect("the graphs given hold the baked buffers their nodes name");
        st.switch_plan = Some(plan.clone());
        Ok((plan, slots))
    }

    /// Device memory for each change that keeps its tensor resident (`None` for the others),
    /// for `stream`: one allocation per element type, shared by them
    /// ([`Tensor::uninit_packed`]).
    fn allocate_kept(&self, stream: &Stream, plan: &SwitchPlan, changes: &[Change<'_>]) -> Result<Vec<Option<Tensor>>> {
        let mut kept: Vec<Option<Tensor>> = changes.iter().map(|_| None).collect();
        let mut dtypes: Vec<DType> = Vec::new();
        for c in changes.iter().filter(|c| c.keep) {
            let dtype = plan.tensors[c.tensor].dtype;
            if !dtypes.contains(&dtype) {
                dtypes.push(dtype);
            }
        }
        for dtype in dtypes {
            let of = |c: &&Change<'_>| c.keep && plan.tensors[c.tensor].dtype == dtype;
            let shapes: Vec<&[usize]> =
                changes.iter().filter(of).map(|c| plan.tensors[c.tensor].shape.as_slice()).collect();
            let mut made = Tensor::uninit_packed(&self.inner.alloc, stream, &shapes, dtype)?.into_iter();
            for (k, _) in changes.iter().enumerate().filter(|(_, c)| of(c)) {
                kept[k] = made.next();
            }
        }
        Ok(kept)
    }

    /// Before a capture's warmup: its first iteration records if the policy is not frozen,
    /// else offloading is off for the whole warmup.
    fn begin_warmup(&self) {
        let mut st = self.inner.lock();
        st.capture_recorded = false;
        match st.frozen {
            true => st.enabled = false,
            false => st.warmup_recording = true,
        }
    }

    /// After the warmup's first iteration: ends the recording iteration, if it was one (the
    /// automatic policy then waits for the window probe), deciding with what each layer lends
    /// the pool (`lent`); then offloading is off for the rest of the warmup.
    fn end_recording(&self, stream: &Stream, lent: &[usize]) -> Result<()> {
        let recording = {
            let mut st = self.inner.lock();
            if st.warmup_recording {
                st.lent = lent.to_vec();
            }
            std::mem::replace(&mut st.warmup_recording, false)
        };
        if recording && self.inner.config.policy == Policy::Auto {
            let mut st = self.inner.lock();
            st.awaiting_windows = self.close_iteration(&mut st)?.is_some();
        } else if recording {
            self.end_iteration(stream)?;
            self.inner.lock().capture_recorded = true;
        }
        self.disable();
        Ok(())
    }

    /// After the warmup, if the automatic policy waits for windows: captures one unit's
    /// candidate copies in graphs, runs the window `probe` with them (beside each pass, and a
    /// small one in each pass's tail), times the copies alone, decides and freezes. Nothing
    /// changes when it fails (the warmup's end then forgets the recording).
    fn time_windows(&self, stream: &Stream, probe: &mut Probe<'_>) -> Result<()> {
        if !self.inner.lock().awaiting_windows {
            return Ok(());
        }
        let copies = CopyGraphs::new(&self.inner, stream, &self.candidate_sizes())?;
        // Not under the lock: the probe runs the modules, whose hooks take it.
        let timings = self.graph_timings(stream, &probe(Some(&copies))?, &copies)?;
        let mut st = self.inner.lock();
        st.awaiting_windows = false;
        self.freeze(&mut st, Some(&timings))?;
        st.capture_recorded = true;
        Ok(())
    }

    /// After a capture failed: the policy its warmup recorded, if it did, is forgotten, so that
    /// a refused capture leaves the manager as it was.
    fn forget_capture_recording(&self) {
        let mut st = self.inner.lock();
        if std::mem::take(&mut st.capture_recorded) {
            st.frozen = false;
            st.summary = None;
            st.chunks.clear();
            st.lent.clear();
        }
    }

    /// After a capture's warmup, also a failed one (H17): offloading on again, what a recording
    /// that did not end recorded forgotten, so that the next iteration records anew, and a
    /// switchable capture's device copies aliased.
    fn end_warmup(&self, stream: &Stream) -> Result<()> {
        let mut st = self.inner.lock();
        st.warmup_recording = false;
        st.awaiting_windows = false;
        if !st.frozen {
            st.chunks.clear();
            st.unbaked.clear();
            st.lent.clear();
        }
        st.enabled = true;
        self.alias_twins(&mut st, stream)
    }

    /// Turns offloading off: every hook keeps tensors on the device and its state stays as it
    /// is (for a graph capture's warmup, which runs the modules in its own order).
    pub fn disable(&self) {
        self.inner.lock().enabled = false;
    }

    /// Turns offloading on again.
    pub fn enable(&self) {
        self.inner.lock().enabled = true;
    }

    /// Leaves a step of the protocol out from now on, so that a test can show what catches the
    /// hazard it guards against (like
    /// [`GraphPool::disable_order_check`](crate::memory::GraphPool::disable_order_check)); never
    /// for training.
    pub fn inject(&self, fault: Fault) {
        self.inner.lock().fault = Some(fault);
    }

    /// Ends an eager iteration (every chunk's forward and backward), on the compute `stream`.
    /// After the first, the recording iteration, decides and freezes the policy (the automatic
    /// policy from that iteration's unit times and eager copies: [`Windows::Eager`]) and bakes
    /// the host buffers of graph hooks made before. A capture's warmup calls it itself when it
    /// records (see [`graph_options`](OffloadManager::graph_options)).
    ///
    /// # Errors
    /// [`OffloadErrorKind::Pending`] when saved tensors were not taken back or delayed copies
    /// are queued (the manager releases them; the policy is not frozen on that iteration);
    /// [`OffloadErrorKind::NoClock`] for the automatic policy on the simulator.
    pub fn end_iteration(&self, stream: &Stream) -> Result<()> {
        let mut st = self.inner.lock();
        let Some(marks) = self.close_iteration(&mut st)? else { return Ok(()) };
        let timings = match self.inner.config.policy {
            Policy::Listed => None,
            Policy::Auto if !self.inner.alloc.device().has_clock() => {
                st.chunks.clear();
                return Err(Error::Offload(OffloadErrorKind::NoClock));
            }
            Policy::Auto => Some(self.measure(stream, marks)?),
        };
        self.freeze(&mut st, timings.as_ref())
    }

    /// Ends every chunk's iteration; after the recording iteration, its timing marks, once it is
    /// checked (none once frozen).
    ///
    /// # Errors
    /// As [`end_iteration`](OffloadManager::end_iteration), which then forgets the recording.
    fn close_iteration(&self, st: &mut State) -> Result<Option<Marks>> {
        let pending: usize = st.chunks.values().map(|c| c.pending()).sum();
        let delayed = std::mem::take(&mut st.delayed).len();
        let marks: Marks = st.chunks.iter_mut().map(|(k, c)| (*k, c.timing.take())).collect();
        for c in st.chunks.values_mut() {
            c.restart();
        }
        if pending + delayed > 0 {
            if !st.frozen {
                st.chunks.clear();
            }
            let what = format!("{pending} groups not taken back and {delayed} delayed copies");
            return Err(Error::Offload(OffloadErrorKind::Pending { what }));
        }
        if st.frozen {
            return Ok(None);
        }
        let config = &self.inner.config;
        let saved = st
            .chunks
            .values()
            .flat_map(|c| c.layout.iter())
            .flat_map(|g| g.tensors.iter().map(move |t| (g.site.as_str(), t.name.as_str())));
        if let Some(e) = config.unmatched(saved) {
            st.chunks.clear();
            return Err(e);
        }
        Ok(Some(marks))
    }

    /// Decides every chunk's layout from `timings`, bakes the host buffers of graph hooks made
    /// before, and freezes the policy; a failed bake forgets the recording.
    fn freeze(&self, st: &mut State, timings: Option<&Timings>) -> Result<()> {
        let config = &self.inner.config;
        for c in st.chunks.values_mut() {
            decide(config, &mut c.layout, timings, &st.lent);
            c.offloads = c.layout.iter().any(|g| g.offloaded_bytes() > 0);
        }
        let baked = match self.bake_unbaked(st) {
            Ok(baked) => baked,
            Err(e) => {
                st.chunks.clear();
                st.unbaked.clear();
                return Err(e);
            }
        };
        for (slot, buffers) in baked {
            // Each slot waits in `unbaked` only until this, its one setting.
            let _ = slot.set(buffers);
        }
        let layouts: Vec<(Chunk, &[GroupLayout])> = st.chunks.iter().map(|(k, c)| (*k, c.layout.as_slice())).collect();
        let summary = Summary::from_layouts(&layouts, timings, config, &st.lent);
        st.summary = Some(summary.in_pages(self.inner.alloc.page_bytes()));
        st.frozen = true;
        Ok(())
    }

    /// Host buffers for the graph hooks made before the policy froze, from `st`'s decided
    /// layouts.
    fn bake_unbaked(&self, st: &mut State) -> Result<Vec<(Arc<OnceLock<Baked>>, Baked)>> {
        let dev = self.inner.alloc.device();
        (st.unbaked.iter())
            .map(|(chunk, slot)| {
                let c = st.chunks.get(chunk).ok_or_else(|| schedule_error(*chunk, "a capture"))?;
                Ok((slot.clone(), bake(dev, &c.layout)?))
            })
            .collect()
    }

    /// For a switchable capture, after its warmup on `stream`: aliases of the manager's scratch
    /// for the device copies of every baked host buffer that has none yet, the scratch made now
    /// for `stream` (or made larger: the buffers aliased before hold the old one). Now and for
    /// that stream, not when the policy freezes: the warmup's memory, free for that stream, then
    /// takes it, instead of the scratch growing the cache above that memory and pinning it
    /// there (the cache gives back only the free end of a segment).
    fn alias_twins(&self, st: &mut State, stream: &Stream) -> Result<()> {
        if !self.inner.config.switchable {
            return Ok(());
        }
        let slots: Vec<Arc<OnceLock<Baked>>> = st.baked.iter().filter_map(|(_, w)| w.upgrade()).collect();
        let buffers = || slots.iter().filter_map(|s| s.get()).flat_map(|b| b.buffers.values());
        let Some(largest) = buffers().filter(|h| h.twin_ids().is_none()).map(HostBuffer::bytes).max() else {
            return Ok(());
        };
        let scratch = match &st.scratch {
            Some(s) if s.bytes() >= largest => s.clone(),
            _ => {
                let s = Arc::new(Scratch::new(&self.inner.alloc, stream, largest)?);
                st.scratch = Some(s.clone());
                s
            }
        };
        // One table for the buffers aliased now, two entries each (out and back).
        let new: Vec<&HostBuffer> = buffers().filter(|h| h.twin_ids().is_none()).collect();
        let table = Arc::new(CopyTable::new(&self.inner.alloc, stream, 2 * new.len())?);
        new.iter().enumerate().try_for_each(|(i, h)| h.alias_twins(&scratch, &table, 2 * i))
    }

    /// The eager recording iteration's unit times (the slowest chunk's, per unit; each mark's
    /// window ends at the next mark) and the eager copy bandwidths.
    fn measure(&self, stream: &Stream, timings: Marks) -> Result<Timings> {
        let end = stream.device().timing_event()?;
        stream.record(&end)?;
        end.synchronize()?;
        let (mut forward_ms, mut backward_ms) = (Vec::<f64>::new(), Vec::<f64>::new());
        for (_, t) in timings {
            let Some(t) = t else { continue };
            for (k, (mark, e)) in t.marks.iter().enumerate() {
                let ms = f64::from(e.elapsed_ms(t.marks.get(k + 1).map_or(&end, |(_, next)| next))?);
                match *mark {
                    Mark::Forward(p) => keep_slowest(&mut forward_ms, p, ms),
                    Mark::Backward(p) => keep_slowest(&mut backward_ms, p, ms),
                }
            }
        }
        Ok(Timings::new(forward_ms, backward_ms, self.pinned_copy_rates(stream)?, Windows::Eager))
    }

    /// The window probe's graph times per unit (the slowest chunk's), the rate of `copies`
    /// (one unit's candidate tensors, [`candidate_sizes`](OffloadManager::candidate_sizes))
    /// alone, what they cost each pass they ran beside in the probe (the pass's extra time per
    /// millisecond of copy it overlapped), and what each pass's graph lost with a small copy in
    /// its tail (the largest of the chunks').
    ///
    /// # Errors
    /// [`OffloadErrorKind::NoClock`] for a probe without times (on the simulator, whose probe
    /// runs the graphs but cannot time them); those of the copy probe.
    fn graph_timings(&self, stream: &Stream, probed: &[PassTimes], copies: &CopyGraphs) -> Result<Timings> {
        if probed.iter().any(|p| p.forward_ms.is_none()) {
            return Err(Error::Offload(OffloadErrorKind::NoClock));
        }
        let (out, back) = copies.rates(stream)?;
        let copy_ms = |rate: f64| copies.bytes() as f64 / rate;
        // The pass's extra time over the part of the copy that it overlapped.
        let share = |alone: f64, beside: Option<f64>, copy: f64| {
            beside.map_or(0.0, |with| (with - alone).max(0.0) / copy.min(with).max(1e-6))
        };
        let (mut forward_ms, mut backward_ms) = (Vec::<f64>::new(), Vec::<f64>::new());
        let carrying = |alone: f64, tailed: Option<f64>| tailed.map_or(0.0, |with| (with - alone).max(0.0));
        let (mut forward_interference, mut backward_interference) = (Vec::<f64>::new(), Vec::<f64>::new());
        let (mut forward_tail_ms, mut backward_tail_ms) = (Vec::<f64>::new(), Vec::<f64>::new());
        for p in probed {
            let (forward, backward) = (p.forward_ms.unwrap_or(0.0), p.backward_ms.unwrap_or(0.0));
            keep_slowest(&mut forward_ms, p.unit, forward);
            keep_slowest(&mut backward_ms, p.unit, backward);
            keep_slowest(&mut forward_interference, p.unit, share(forward, p.forward_beside_ms, copy_ms(out)));
            keep_slowest(&mut backward_interference, p.unit, share(backward, p.backward_beside_ms, copy_ms(back)));
            keep_slowest(&mut forward_tail_ms, p.unit, carrying(forward, p.forward_tail_ms));
            keep_slowest(&mut backward_tail_ms, p.unit, carrying(backward, p.backward_tail_ms));
        }
        let windows = Windows::Graphs { replays: PROBE_REPLAYS };
        Ok(Timings {
            forward_interference,
            backward_interference,
            forward_tail_ms,
            backward_tail_ms,
            ..Timings::new(forward_ms, backward_ms, (out, back), windows)
        })
    }

    /// The bytes of each eligible tensor of the unit with the most eligible bytes, among the
    /// recorded chunks (one 64 MiB copy when none is eligible): what one graph's tail copies
    /// at most.
    fn candidate_sizes(&self) -> Vec<usize> {
        let st = self.inner.lock();
        let mut largest: Vec<usize> = Vec::new();
        for c in st.chunks.values() {
            let mut layout = c.layout.clone();
            for p in 0..mark_eligible(&self.inner.config, &mut layout) {
                let unit = layout.iter().filter(|g| g.pass == p);
                let sizes: Vec<usize> =
                    unit.flat_map(|g| g.tensors.iter().filter(|t| t.offload).map(TensorLayout::bytes)).collect();
                if sizes.iter().sum::<usize>() > largest.iter().sum() {
                    largest = sizes;
                }
            }
        }
        if largest.is_empty() {
            largest.push(PROBE_BYTES);
        }
        largest
    }

    /// Bytes per millisecond of a pinned copy of 64 MiB each way on the manager's copy streams,
    /// after `stream`'s work (the best of three): the rate an eagerly recorded policy plans with.
    ///
    /// # Errors
    /// Allocation, host-buffer, copy and timing errors.
    pub fn pinned_copy_rates(&self, stream: &Stream) -> Result<(f64, f64)> {
        let dev = stream.device();
        let len = PROBE_BYTES / 2;
        let host = HostBuffer::new(dev, DType::BF16, len)?;
        let t = Tensor::zeros(&self.inner.alloc, stream, &[len], DType::BF16)?;
        stream.synchronize()?;
        let time = |s: &Stream, copy: &dyn Fn(&Stream) -> Result<()>| -> Result<f64> {
            Ok(PROBE_BYTES as f64 / fastest_of_three(s, &|| copy(s))?)
        };
        let out = time(&self.inner.d2h, &|s| host.copy_out(&t, s))?;
        let back = time(&self.inner.h2d, &|s| host.copy_in(&t, s))?;
        Ok((out, back))
    }

    /// Bytes per millisecond each way of copies of `sizes` bytes each (bf16 tensors), captured in
    /// one graph on the manager's copy streams as the offload graphs' tails run them, with
    /// nothing else running (the best of three replays): the rate a policy timed in graphs plans
    /// with.
    ///
    /// # Errors
    /// Allocation, host-buffer, capture and timing errors.
    pub fn graph_copy_rates(&self, stream: &Stream, sizes: &[usize]) -> Result<(f64, f64)> {
        CopyGraphs::new(&self.inner, stream, sizes)?.rates(stream)
    }

    /// The frozen policy's summary (`None` before the recording iteration ended).
    pub fn summary(&self) -> Option<Summary> {
        self.inner.lock().summary.clone()
    }

    /// The recorded groups of `chunk`, with the policy's decisions once frozen.
    pub fn layout(&self, chunk: Chunk) -> Vec<GroupLayout> {
        self.inner.lock().chunks.get(&chunk).map(|c| c.layout.clone()).unwrap_or_default()
    }

    /// Bytes copied to host memory since the manager was made (eager copies and captures, not
    /// replays) and bytes of pinned host memory in its pool.
    pub fn stats(&self) -> OffloadStats {
        let st = self.inner.lock();
        OffloadStats { copied_out: st.copied_out, host_pool_bytes: st.host.bytes }
    }
}

/// Sets unit `p`'s entry of `v` (grown with zeros) to `ms` if that is larger: the slowest chunk's
/// time.
fn keep_slowest(v: &mut Vec<f64>, p: usize, ms: f64) {
    if v.len() <= p {
        v.resize(p + 1, 0.0);
    }
    v[p] = v[p].max(ms);
}

/// Byte counts of an [`OffloadManager`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadStats {
    /// Bytes copied to host memory by eager iterations and captures.
    pub copied_out: usize,
    /// Pinned bytes in the eager pool.
    pub host_pool_bytes: usize,
}

impl std::fmt::Debug for OffloadManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadManager").field("config", &self.inner.config).finish_non_exhaustive()
    }
}
