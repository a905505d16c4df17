//! A chunk's save hook: the protocol of `offload.md` §3 on our streams, eagerly and inside
//! captures.
//!
//! Eagerly, a group's copy out starts at its commit on the copy-out stream D (`D ⇐ M`), each
//! host buffer first waiting for its last copy back (H8); the device memory is released for the
//! compute stream M once the copy's event completes (H7). The backward's first take of a unit's
//! tensors prefetches the previous unit's on the copy-back stream H (`H ⇐ M`, then H waits for
//! the copy out: H9), into memory allocated on M (H10); a take waits for its group's copy back.
//!
//! Inside a capture, a group's copy out is issued when the next unit's capture begins, on D
//! forked from the capture stream: the copy then overlaps the next unit's compute in its graph,
//! where a copy issued at the commit would overlap only the rest of its own unit and hold the
//! next graph back (graphs replay one after another on one stream). The first take of a unit's
//! tensors prefetches the previous unit's on H forked the same way; the copies are joined back
//! in [`SaveHook::end_pass`], after the graph's sync event (H3), so they form the graph's tail.
//! Waits stay inside the capture (H4): a copy back and its use in the same capture are joined by
//! a capture-local event (H5); across graphs, the pool's replay order on one stream orders them.

use std::sync::Arc;

use super::error::OffloadErrorKind;
use super::host::HostBuffer;
use super::policy::{GroupLayout, TensorLayout};
use super::shared::Inner;
use super::state::{Baked, BakedRef, ChunkState, Fault, HostRef, Mark, PassTiming, Phase, State};
use crate::device::{BufferId, DType, Stream};
use crate::nn::{Chunk, Restore, SaveHook, SavedTensor};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The save hook of one chunk (a microbatch of a pipeline stage): pass it to the chunk's eager
/// forward, or let [`OffloadManager::graph_options`](super::OffloadManager::graph_options)
/// give it to the graphs.
#[derive(Clone)]
pub struct ChunkHook {
    pub(crate) inner: Arc<Inner>,
    pub(crate) chunk: Chunk,
    /// The host buffers of its graphs (`None`: for eager use only).
    pub(crate) baked: BakedRef,
}

fn schedule(chunk: Chunk, expected: String, found: String) -> Error {
    Error::Offload(OffloadErrorKind::Schedule { chunk, expected, found })
}

impl ChunkHook {
    /// Holds `t` in slot `s` of group `g` and hands the module a ticket for it.
    fn ticket(&self, c: &mut ChunkState, g: usize, s: usize, t: Tensor) -> SavedTensor {
        c.run[g].slots[s].device = Some(t);
        SavedTensor::away(Box::new(Ticket { hook: self.clone(), group: g, slot: s, iteration: c.iteration }))
    }

    /// Runs `f` on the chunk's state, unless offloading is off (a capture's warmup).
    fn with<T>(&self, off: T, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        let mut st = self.inner.lock();
        if !st.enabled {
            return Ok(off);
        }
        f(&mut st)
    }
}

/// Starts a new iteration of chunk `chunk` (unit 0), refusing while the last one still holds
/// tensors.
fn start_iteration(c: &mut ChunkState, chunk: Chunk, timed: bool) -> Result<usize> {
    if c.pending() > 0 {
        let what = format!("{} groups of {chunk} not taken back", c.pending());
        return Err(Error::Offload(OffloadErrorKind::Pending { what }));
    }
    c.restart();
    c.timing = timed.then(PassTiming::default);
    c.phase = Phase::Forward { pass: 0 };
    Ok(0)
}

fn chunk_mut(st: &mut State, chunk: Chunk) -> Result<&mut ChunkState> {
    if st.frozen && !st.chunks.contains_key(&chunk) {
        return Err(schedule(chunk, "nothing (the chunk was not in it)".into(), "a forward".into()));
    }
    Ok(st.chunks.entry(chunk).or_insert_with(ChunkState::new))
}

impl SaveHook for ChunkHook {
    fn begin_forward(&self, stream: &Stream) -> Result<()> {
        self.with((), |st| {
            let capture = stream.capture_id()?;
            if capture.is_some() && self.baked.is_none() && st.frozen {
                return Err(Error::Offload(OffloadErrorKind::NotForGraphs));
            }
            let (frozen, timed) = (st.frozen, st.times_eagerly() && self.inner.timed());
            let unit_by_unit = st.warmup_recording;
            let c = chunk_mut(st, self.chunk)?;
            let next = match c.phase {
                Phase::Forward { pass } => pass + 1,
                Phase::Backward { pass } if unit_by_unit => pass + 1,
                Phase::Idle | Phase::Backward { .. } => start_iteration(c, self.chunk, timed)?,
            };
            // Once frozen, a unit is the one its groups were recorded in (see `open_group`).
            if !frozen || c.phase == Phase::Idle {
                c.phase = Phase::Forward { pass: next };
            }
            if let Some(t) = &mut c.timing {
                let e = stream.device().timing_event()?;
                stream.record(&e)?;
                t.marks.push((Mark::Forward(next), e));
            }
            match (capture, &self.baked) {
                (Some(_), Some(baked)) => copy_out_captured(&self.inner, st, self.chunk, baked.get(), stream),
                _ => Ok(()),
            }
        })
    }

    fn open_group(&self, site: &str) -> Result<()> {
        self.with((), |st| {
            let (frozen, timed) = (st.frozen, st.times_eagerly() && self.inner.timed());
            let c = chunk_mut(st, self.chunk)?;
            // A module called by itself (no unit began): a new iteration, in one unit.
            let pass = match c.phase {
                Phase::Forward { pass } => pass,
                Phase::Idle | Phase::Backward { .. } => start_iteration(c, self.chunk, timed)?,
            };
            let g = if frozen {
                // The next recorded group of this site: groups of graphed units, which run no
                // code at replay, are skipped by eager units of the same chunk (and the other
                // way round), as in Megatron.
                let found = (c.cursor..c.layout.len()).find(|g| c.layout[*g].site == site);
                let expected =
                    c.layout.get(c.cursor).map_or("no more groups".into(), |l| format!("group `{}`", l.site));
                let g = found.ok_or_else(|| schedule(self.chunk, expected, format!("group `{site}`")))?;
                c.phase = Phase::Forward { pass: c.layout[g].pass };
                g
            } else {
                c.layout.push(GroupLayout { site: site.to_string(), pass, tensors: Vec::new() });
                c.cursor
            };
            if c.run.len() <= g {
                c.run.resize_with(g + 1, Default::default);
            }
            c.cursor = g + 1;
            c.open = Some(g);
            Ok(())
        })
    }

    fn save(&self, name: &str, t: Tensor, _stream: &Stream) -> Result<SavedTensor> {
        let mut st = self.inner.lock();
        if !st.enabled {
            return Ok(SavedTensor::kept(t));
        }
        let frozen = st.frozen;
        let c = chunk_mut(&mut st, self.chunk)?;
        let Some(g) = c.open else {
            return Err(schedule(self.chunk, "`open_group` first".into(), format!("tensor `{name}`")));
        };
        let s = c.run[g].slots.len();
        if !frozen {
            let copyable = t.is_contiguous()
                && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16 | DType::F8E4M3 | DType::F8E5M2);
            let layout = TensorLayout {
                name: name.into(),
                shape: t.shape().to_vec(),
                dtype: t.dtype(),
                copyable,
                offload: false,
            };
            c.layout[g].tensors.push(layout);
            c.run[g].slots.push(Default::default());
            if c.timing.is_none() {
                c.run[g].slots[s].taken = true;
                return Ok(SavedTensor::kept(t));
            }
            // Timed: the backward's takes mark where each unit's backward begins.
            return Ok(self.ticket(c, g, s, t));
        }
        let l = c.layout[g].tensors.get(s);
        if !l.is_some_and(|l| l.name == name && l.shape == t.shape() && l.dtype == t.dtype()) {
            let want = l.map_or("no more tensors".into(), |l| format!("`{}` {:?} {}", l.name, l.shape, l.dtype));
            let site = &c.layout[g].site;
            return Err(schedule(
                self.chunk,
                format!("{want} in `{site}`"),
                format!("`{name}` {:?} {}", t.shape(), t.dtype()),
            ));
        }
        c.run[g].slots.push(Default::default());
        if !c.offloads {
            c.run[g].slots[s].taken = true;
            return Ok(SavedTensor::kept(t));
        }
        c.run[g].slots[s].offload = c.layout[g].tensors[s].offload;
        Ok(self.ticket(c, g, s, t))
    }

    fn commit_group(&self, site: &str, stream: &Stream) -> Result<()> {
        self.with((), |st| {
            let frozen = st.frozen;
            let delay = self.inner.config.delay_eager_commits;
            let c = chunk_mut(st, self.chunk)?;
            let Some(g) = c.open.take() else {
                return Err(schedule(self.chunk, "`open_group` first".into(), format!("commit of `{site}`")));
            };
            if !frozen || c.layout[g].offloaded_bytes() == 0 {
                return Ok(());
            }
            if stream.capture_id()?.is_some() {
                c.queued.push(g);
                return Ok(());
            }
            if delay {
                st.delayed.push((self.chunk, g));
                return Ok(());
            }
            copy_out_eager(&self.inner, st, self.chunk, g, stream)
        })
    }

    fn end_pass(&self, stream: &Stream) -> Result<()> {
        self.with((), |st| {
            let (out, back) = std::mem::take(&mut st.forked);
            if st.fault == Some(Fault::SkipJoin) {
                return Ok(());
            }
            for (forked, side) in [(out, &self.inner.d2h), (back, &self.inner.h2d)] {
                if forked {
                    stream.wait_stream(side)?;
                }
            }
            Ok(())
        })
    }

    fn replayed(&self, stream: &Stream) -> Result<()> {
        self.with((), |st| {
            for (chunk, g) in std::mem::take(&mut st.delayed) {
                copy_out_eager(&self.inner, st, chunk, g, stream)?;
            }
            Ok(())
        })
    }

    fn tail_memory(&self) -> Vec<BufferId> {
        let baked = self.baked.as_ref().and_then(|b| b.get());
        let mut memories: Vec<BufferId> =
            baked.map_or_else(Vec::new, |b| b.buffers.values().flat_map(HostBuffer::tail_memories).collect());
        memories.sort_unstable();
        memories.dedup();
        memories
    }
}

/// An offloaded tensor's handle, which the module keeps in its saved context.
struct Ticket {
    hook: ChunkHook,
    group: usize,
    slot: usize,
    iteration: u64,
}

impl Restore for Ticket {
    fn restore(self: Box<Self>, stream: &Stream) -> Result<Tensor> {
        let hook = &self.hook;
        let mut st = hook.inner.lock();
        let chunk = hook.chunk;
        let c = chunk_mut(&mut st, chunk)?;
        if c.iteration != self.iteration {
            return Err(Error::Offload(OffloadErrorKind::Stale { chunk }));
        }
        let pass = c.layout[self.group].pass;
        let capture = stream.capture_id()?;
        if c.phase != (Phase::Backward { pass }) {
            begin_backward_unit(hook, &mut st, pass, stream, capture)?;
        }
        take(hook, &mut st, self.group, self.slot, stream, capture)
    }
}

/// The backward reaches unit `pass`: on the chunk's first take, copies still delayed or queued
/// are dropped from their queues (their tensors never left the device, and a later flush must
/// not act on consumed groups: H11); in the recording iteration it is timed; the previous
/// unit's tensors are prefetched.
fn begin_backward_unit(
    hook: &ChunkHook,
    st: &mut State,
    pass: usize,
    stream: &Stream,
    capture: Option<u64>,
) -> Result<()> {
    let chunk = hook.chunk;
    st.delayed.retain(|(ch, _)| *ch != chunk);
    let c = chunk_mut(st, chunk)?;
    c.phase = Phase::Backward { pass };
    c.queued.clear();
    if let Some(t) = &mut c.timing {
        let e = stream.device().timing_event()?;
        stream.record(&e)?;
        t.marks.push((Mark::Backward(pass), e));
    }
    let previous: Vec<usize> = (0..c.run.len())
        .filter(|g| pass.checked_sub(1) == Some(c.layout[*g].pass) && !c.run[*g].back_issued && has_host(c, *g))
        .collect();
    for g in previous {
        copy_back(hook, st, g, stream, capture)?;
    }
    Ok(())
}

fn has_host(c: &ChunkState, g: usize) -> bool {
    c.run[g].slots.iter().any(|s| s.host.is_some())
}

/// Hands slot `s` of group `g` to the backward on `stream`: copied back (now, if no prefetch
/// did), with `stream` waiting for the copy.
fn take(hook: &ChunkHook, st: &mut State, g: usize, s: usize, stream: &Stream, capture: Option<u64>) -> Result<Tensor> {
    let c = chunk_mut(st, hook.chunk)?;
    if let Some(t) = c.run[g].slots[s].device.take() {
        // Its copy out was never issued.
        c.run[g].slots[s].taken = true;
        return Ok(t);
    }
    if !c.run[g].back_issued {
        copy_back(hook, st, g, stream, capture)?;
    }
    let fault = st.fault;
    let c = chunk_mut(st, hook.chunk)?;
    let run = &mut c.run[g];
    if !run.waited {
        match (&run.in_capture, capture) {
            // Copied back earlier in this capture: a capture-local join (H5).
            (Some((cap, e)), Some(now)) if *cap == now && fault != Some(Fault::SkipCaptureLocalWait) => {
                stream.wait(e)?;
            }
            // Copied back by an earlier graph, which the pool's order replays before this one.
            (Some(_), _) => {}
            (None, _) if fault == Some(Fault::SkipCopyBackWait) => {}
            (None, _) => stream.wait(&run.events(stream.device())?[2])?,
        }
        run.waited = true;
    }
    let slot = &mut run.slots[s];
    slot.taken = true;
    slot.back.take().ok_or_else(|| schedule(hook.chunk, "a tensor to take".into(), "one taken twice".into()))
}

/// Issues the copy out of eager group `g`: on D after `D ⇐ stream`, each host buffer after its
/// last copy back (H8); the device memory returns to `stream` once the copy is done (H7).
fn copy_out_eager(inner: &Inner, st: &mut State, chunk: Chunk, g: usize, stream: &Stream) -> Result<()> {
    let dev = stream.device();
    let State { chunks, host, copied_out, fault, .. } = st;
    let c = chunks.get_mut(&chunk).expect("a committed group's chunk exists");
    let _range = dev.range_with(|| range_name("offload", &c.layout[g], chunk));
    let run = &mut c.run[g];
    let [fork, out, _] = run.events(dev)?.clone();
    stream.record(&fork)?;
    inner.d2h.wait(&fork)?;
    for slot in run.slots.iter_mut().filter(|s| s.offload && s.device.is_some()) {
        let t = slot.device.as_ref().expect("filtered");
        let mut b = host.take(dev, t.dtype(), t.numel())?;
        if let Some(e) = b.last_in.as_ref().filter(|_| *fault != Some(Fault::SkipHostBufferWait)) {
            inner.d2h.wait(e)?;
        }
        b.copy_out(t, &inner.d2h)?;
        b.last_out = Some(out.clone());
        *copied_out += b.bytes();
        slot.host = Some(HostRef::Pooled(b));
    }
    inner.d2h.record(&out)?;
    let released_after = if *fault == Some(Fault::ReleaseBeforeCopy) { &fork } else { &out };
    for slot in run.slots.iter_mut().filter(|s| s.offload) {
        if let Some(t) = slot.device.take() {
            t.release_after(released_after, stream)?;
        }
    }
    Ok(())
}

/// Issues, inside the capture on `stream`, the copies out of the groups that the chunk's previous
/// unit committed, on D forked from the capture.
fn copy_out_captured(
    inner: &Inner,
    st: &mut State,
    chunk: Chunk,
    baked: Option<&Baked>,
    stream: &Stream,
) -> Result<()> {
    let c = chunk_mut(st, chunk)?;
    if c.queued.is_empty() {
        return Ok(());
    }
    let capture = stream.capture_id()?;
    inner.d2h.wait_stream(stream)?;
    let mut bytes = 0;
    for g in std::mem::take(&mut c.queued) {
        let _range = stream.device().range_with(|| range_name("offload", &c.layout[g], chunk));
        for (s, slot) in c.run[g].slots.iter_mut().enumerate().filter(|(_, s)| s.offload) {
            let Some(t) = slot.device.take() else { continue };
            let b = baked
                .and_then(|b| b.get(g, s))
                .ok_or_else(|| schedule(chunk, "a baked host buffer".into(), "none".into()))?;
            b.copy_out(&t, &inner.d2h)?;
            b.capture_twin_out(&t, &inner.d2h)?;
            bytes += b.bytes();
            slot.host = Some(HostRef::Baked);
        }
        c.run[g].out_capture = capture;
    }
    st.copied_out += bytes;
    st.forked.0 = true;
    Ok(())
}

/// Issues the copy back of group `g` into memory allocated on `stream`, on H after `H ⇐ stream`:
/// eagerly after the group's copy out (H9), each pooled host buffer returned with the copy's
/// event (H8); in a capture, on H forked from it, joined to a copy out of the same capture.
fn copy_back(hook: &ChunkHook, st: &mut State, g: usize, stream: &Stream, capture: Option<u64>) -> Result<()> {
    let (inner, dev) = (&hook.inner, stream.device());
    let State { chunks, host, forked, fault, .. } = st;
    let c = chunks.get_mut(&hook.chunk).expect("a taken group's chunk exists");
    let layout = &c.layout[g];
    let _range = dev.range_with(|| range_name("reload", layout, hook.chunk));
    let run = &mut c.run[g];
    // Allocations the warmup (offloading off) never made, outliving this pass: outside what
    // the capture expects of it (Note [Pass-local blocks] in `memory`).
    let dsts = inner.alloc.outside_expectation(stream, || -> Result<Vec<Option<Tensor>>> {
        let mut dsts = Vec::with_capacity(run.slots.len());
        for (s, slot) in run.slots.iter().enumerate() {
            let t = &layout.tensors[s];
            let dst = match slot.host {
                Some(_) => Some(Tensor::uninit(&inner.alloc, stream, &t.shape, t.dtype)?),
                None => None,
            };
            dsts.push(dst);
        }
        Ok(dsts)
    })?;
    match capture {
        Some(cap) => {
            let baked = hook.baked.as_ref().ok_or(Error::Offload(OffloadErrorKind::NotForGraphs))?.get();
            inner.h2d.wait_stream(stream)?;
            if run.out_capture == Some(cap) {
                inner.h2d.wait_stream(&inner.d2h)?;
            }
            if *fault == Some(Fault::WaitOutsideCapture) {
                inner.h2d.wait(&run.events(dev)?[1])?;
            }
            for (s, dst) in dsts.into_iter().enumerate() {
                let Some(dst) = dst else { continue };
                let b = baked
                    .and_then(|b| b.get(g, s))
                    .ok_or_else(|| schedule(hook.chunk, "a baked host buffer".into(), "none".into()))?;
                b.copy_in(&dst, &inner.h2d)?;
                b.capture_twin_back(&dst, &inner.h2d)?;
                run.slots[s].back = Some(dst);
            }
            let done = dev.event()?;
            inner.h2d.record(&done)?;
            run.in_capture = Some((cap, done));
            forked.1 = true;
        }
        None => {
            let [fork, out, back] = run.events(dev)?.clone();
            stream.record(&fork)?;
            inner.h2d.wait(&fork)?;
            if *fault != Some(Fault::SkipCopyOutWait) {
                inner.h2d.wait(&out)?;
            }
            let mut returned = Vec::new();
            for (s, dst) in dsts.into_iter().enumerate() {
                let Some(dst) = dst else { continue };
                let Some(HostRef::Pooled(b)) = run.slots[s].host.take() else {
                    return Err(schedule(hook.chunk, "an eager copy out".into(), "a graph's".into()));
                };
                b.copy_in(&dst, &inner.h2d)?;
                returned.push(b);
                run.slots[s].back = Some(dst);
            }
            inner.h2d.record(&back)?;
            for mut b in returned {
                b.last_in = Some(back.clone());
                host.give_back(b);
            }
            for dst in run.slots.iter().filter_map(|s| s.back.as_ref()) {
                dst.release_after(&back, stream)?;
            }
        }
    }
    run.back_issued = true;
    Ok(())
}

/// A group's profiler range: `offload h3.attn` (its site: the module that saved it), with
/// ` mb{j}` for a microbatch after the first.
fn range_name(verb: &str, group: &GroupLayout, chunk: Chunk) -> String {
    match chunk.microbatch {
        0 => format!("{verb} {}", group.site),
        j => format!("{verb} {} mb{j}", group.site),
    }
}

/// Host buffers for every offloaded tensor of `layout`, for one chunk's graphs (a switchable
/// graph's device copies are aliased after the warmup, `HostBuffer::alias_twins`).
pub(crate) fn bake(dev: &crate::device::Device, layout: &[GroupLayout]) -> Result<Baked> {
    let mut buffers = std::collections::BTreeMap::new();
    for (g, group) in layout.iter().enumerate() {
        for (s, t) in group.tensors.iter().enumerate().filter(|(_, t)| t.offload) {
            buffers.insert((g, s), HostBuffer::new(dev, t.dtype, t.shape.iter().product())?);
        }
    }
    Ok(Baked { buffers })
}
