//! Stream capture on the simulator: CUDA's capture rules over the device state.

use std::collections::BTreeSet;
use std::thread::ThreadId;

use super::graph::{NodeTask, SimGraph, SimNode};
use super::{Record, State};
use crate::device::patch::Site;
use crate::device::{CaptureMode, CaptureStatus, NodeKind, StreamId};
use crate::error::CaptureErrorKind;
use crate::Result;

pub(crate) struct CaptureState {
    origin: StreamId,
    mode: CaptureMode,
    thread: ThreadId,
    invalid: bool,
    nodes: Vec<SimNode>,
    /// How each node of an enqueued operation names buffers, with the node.
    sites: Vec<(usize, Site)>,
    /// Every stream that joined, the origin included.
    members: Vec<StreamId>,
}

use super::graph::capture_error as err;

impl State {
    /// The capture `stream` takes part in, if any; an error if that capture was invalidated.
    pub(super) fn active_capture_of(&mut self, op: &'static str, stream: StreamId) -> Result<Option<u64>> {
        let capture = self.stream(stream).capture;
        match capture {
            None => Ok(None),
            Some(cap) if self.captures[&cap].invalid => Err(err(op, stream, CaptureErrorKind::Invalidated)),
            Some(cap) => Ok(Some(cap)),
        }
    }

    pub(super) fn invalidate(&mut self, cap: u64) {
        if let Some(c) = self.captures.get_mut(&cap) {
            c.invalid = true;
        }
    }

    /// Adds a node after the stream's frontier; it becomes the new frontier.
    pub(super) fn add_node(
        &mut self,
        cap: u64,
        stream: StreamId,
        kind: NodeKind,
        name: String,
        task: NodeTask,
    ) -> usize {
        let deps = std::mem::take(&mut self.stream(stream).frontier);
        let nodes = &mut self.captures.get_mut(&cap).expect("active capture exists").nodes;
        nodes.push(SimNode { kind, name, deps, task, disabled: false });
        let id = nodes.len() - 1;
        self.stream(stream).frontier = vec![id];
        id
    }

    /// Notes how node `node` of capture `cap` names buffers, for patched replays.
    pub(super) fn add_site(&mut self, cap: u64, node: usize, site: Site) {
        self.captures.get_mut(&cap).expect("active capture exists").sites.push((node, site));
    }

    /// A plain wait by a capturing stream.
    pub(super) fn capture_wait(&mut self, op: &'static str, cap: u64, stream: StreamId, rec: Record) -> Result<()> {
        match rec {
            Record::Never => Ok(()),
            Record::At(_) => {
                self.invalidate(cap);
                Err(err(op, stream, CaptureErrorKind::Isolation))
            }
            Record::Captured { capture, frontier } if capture == cap => {
                let st = self.stream(stream);
                let merged: BTreeSet<usize> = st.frontier.iter().chain(&frontier).copied().collect();
                st.frontier = merged.into_iter().collect();
                Ok(())
            }
            Record::Captured { capture: other, .. } if !self.captures.contains_key(&other) => {
                self.invalidate(cap);
                Err(err(op, stream, CaptureErrorKind::RecordOfEndedCapture))
            }
            Record::Captured { capture: other, .. } => {
                // CUDA invalidates both captures.
                self.invalidate(cap);
                self.invalidate(other);
                Err(err(op, stream, CaptureErrorKind::Merge))
            }
        }
    }

    /// A stream outside any capture waits on an event recorded inside one: it joins (a fork).
    pub(super) fn join_capture(
        &mut self,
        op: &'static str,
        stream: StreamId,
        cap: u64,
        frontier: Vec<usize>,
    ) -> Result<()> {
        match self.captures.get_mut(&cap) {
            None => Err(err(op, stream, CaptureErrorKind::RecordOfEndedCapture)),
            Some(c) if c.invalid => Err(err(op, stream, CaptureErrorKind::Invalidated)),
            Some(c) => {
                c.members.push(stream);
                let st = self.stream(stream);
                st.capture = Some(cap);
                st.frontier = frontier;
                Ok(())
            }
        }
    }

    /// A synchronous call (device synchronize, blocking copy, allocation): forbidden by every
    /// global capture and by thread-local captures of this thread; it invalidates them.
    pub(super) fn forbid_sync_call(&mut self, op: &'static str) -> Result<()> {
        let me = std::thread::current().id();
        let mut hit = None;
        for (id, c) in self.captures.iter_mut() {
            let forbids = match c.mode {
                CaptureMode::Global => true,
                CaptureMode::ThreadLocal => c.thread == me,
                CaptureMode::Relaxed => false,
            };
            if forbids {
                c.invalid = true;
                hit.get_or_insert((*id, c.origin));
            }
        }
        match hit {
            Some((_, origin)) => Err(err(op, origin, CaptureErrorKind::Unsupported)),
            None => Ok(()),
        }
    }

    /// Synchronizing or querying a capturing stream: forbidden in every mode; invalidates.
    pub(super) fn forbid_on_capturing(&mut self, op: &'static str, stream: StreamId) -> Result<()> {
        if let Some(cap) = self.stream(stream).capture {
            self.invalidate(cap);
            return Err(err(op, stream, CaptureErrorKind::Unsupported));
        }
        Ok(())
    }

    pub(super) fn begin_capture(&mut self, stream: StreamId, mode: CaptureMode) -> Result<()> {
        const OP: &str = "begin_capture";
        let st = self.stream(stream);
        if st.legacy {
            return Err(err(OP, stream, CaptureErrorKind::Unsupported));
        }
        if st.capture.is_some() {
            return Err(err(OP, stream, CaptureErrorKind::AlreadyCapturing));
        }
        let cap = self.next_capture;
        self.next_capture += 1;
        let st = self.stream(stream);
        st.capture = Some(cap);
        st.frontier.clear();
        let thread = std::thread::current().id();
        self.captures.insert(
            cap,
            CaptureState {
                origin: stream,
                mode,
                thread,
                invalid: false,
                nodes: vec![],
                sites: vec![],
                members: vec![stream],
            },
        );
        Ok(())
    }

    pub(super) fn end_capture(&mut self, stream: StreamId) -> Result<SimGraph> {
        const OP: &str = "end_capture";
        let Some(cap) = self.stream(stream).capture else {
            return Err(err(OP, stream, CaptureErrorKind::Unmatched));
        };
        let c = &self.captures[&cap];
        if c.origin != stream {
            // CUDA refuses, and the capture cannot succeed any more.
            self.invalidate(cap);
            return Err(err(OP, stream, CaptureErrorKind::Unmatched));
        }
        let wrong_thread = c.mode != CaptureMode::Relaxed && c.thread != std::thread::current().id();
        let c = self.captures.remove(&cap).expect("checked above");
        let frontiers: Vec<(StreamId, Vec<usize>)> = c
            .members
            .iter()
            .map(|m| {
                let st = self.stream(*m);
                st.capture = None;
                (*m, std::mem::take(&mut st.frontier))
            })
            .collect();
        // CUDA ends the capture in both cases.
        if wrong_thread {
            return Err(err(OP, stream, CaptureErrorKind::WrongThread));
        }
        if c.invalid {
            return Err(err(OP, stream, CaptureErrorKind::Invalidated));
        }
        let graph = SimGraph::new(c.nodes, c.sites);
        let origin_frontier = &frontiers.iter().find(|(m, _)| *m == stream).expect("origin is a member").1;
        let joined = graph.ancestors_of(origin_frontier);
        for (m, f) in &frontiers {
            if *m != stream && f.iter().any(|n| !joined.contains(n)) {
                return Err(err(OP, stream, CaptureErrorKind::Unjoined));
            }
        }
        Ok(graph)
    }

    pub(super) fn capture_status(&mut self, stream: StreamId) -> CaptureStatus {
        let capture = self.stream(stream).capture;
        match capture {
            None => CaptureStatus::None,
            Some(cap) if self.captures[&cap].invalid => CaptureStatus::Invalidated,
            Some(_) => CaptureStatus::Active,
        }
    }
}
