//! The per-graph access summary, computed once at the end of a capture: each node's accesses and
//! its position in the graph's partial order, so that a replay costs the checker work per
//! distinct region the graph touches, not per node, and the graph layer can verify the replay
//! contract at capture time (what is written after an external event, what the tail touches).

use std::collections::HashMap;

use super::clock::{Clock, Lane};
use super::report::{Hazard, OpRef, Site};
use super::{conflict, fix_for};
use crate::device::patch::Remap;
use crate::device::{Access, BufferId, EventId, GraphId};

/// A node as the capture saw it.
pub(crate) struct Node {
    pub(crate) op: &'static str,
    lane: Lane,
    pos: u64,
    clock: Clock,
    accesses: Vec<Access>,
}

impl Node {
    pub(crate) fn captured(op: &'static str, lane: Lane, pos: u64, clock: Clock, accesses: &[Access]) -> Node {
        Node { op, lane, pos, clock, accesses: accesses.to_vec() }
    }
}

/// An access of a graph's tail: work that is not ordered before an external event's record.
#[derive(Debug, Clone)]
pub struct TailAccess {
    /// The operation.
    pub op: &'static str,
    /// What it touches.
    pub access: Access,
}

/// Where an external event is recorded inside a graph, and what the graph does after it.
#[derive(Debug, Clone)]
pub struct SyncPoint {
    /// How many record nodes of the event the graph has (exactly one makes a well-defined point).
    pub records: usize,
    /// The external events the graph waits on (a replay that resumes the caller at the record
    /// could deadlock on one the caller signals later: replay contract R7).
    pub external_waits: Vec<EventId>,
    /// The accesses of the nodes that are not ancestors of the record (all of them if the event
    /// is never recorded).
    pub tail: Vec<TailAccess>,
}

/// A node of the summary: its lane (index among the capture's streams) and position there.
pub(crate) struct SummaryNode {
    pub(crate) op: &'static str,
    pub(crate) lane: u32,
    pub(crate) pos: u64,
}

/// What a graph reads and writes, node by node, and where its external events are recorded.
pub(crate) struct GraphSummary {
    nodes: Vec<SummaryNode>,
    by_memory: HashMap<BufferId, Vec<(usize, Access)>>,
    /// One (node, access) per distinct (memory, region, mode).
    footprint: Vec<(usize, Access)>,
    lane_end: Vec<u64>,
    records: Vec<(EventId, Vec<(u32, u64)>)>,
    pub(crate) waits: Vec<EventId>,
}

/// `a`, made of the buffer a remap moves its bytes to, if one does.
fn moved(a: &Access, remaps: &[Remap]) -> Access {
    let e = a.elem_bytes;
    let (start, end) = (a.region.offset() * e, a.region.end() * e);
    let hit = remaps.iter().find(|r| r.from == a.buffer && r.start <= start && end <= r.end && !a.region.is_empty());
    let Some(r) = hit else { return *a };
    let first = r.to_start + (start - r.start);
    if first % e != 0 || r.to_base % e != 0 {
        return *a;
    }
    Access {
        buffer: r.to,
        memory: r.to_memory,
        at: a.at.moved_to((r.to_base + first) / e),
        region: a.region.moved_to(first / e),
        ..*a
    }
}

fn rebase(clock: &Clock, lanes: &HashMap<Lane, u32>) -> Vec<(u32, u64)> {
    clock.lanes().filter_map(|(l, p)| lanes.get(l).map(|i| (*i, *p))).collect()
}

impl GraphSummary {
    /// Builds the summary and reports pairs of nodes that touch the same memory, one of them
    /// writing, with no graph path between them.
    pub(crate) fn build(
        graph: GraphId,
        nodes: Vec<Node>,
        records: Vec<(EventId, Clock)>,
        waits: Vec<EventId>,
    ) -> (GraphSummary, Vec<Hazard>) {
        let mut lanes: HashMap<Lane, u32> = HashMap::new();
        for n in &nodes {
            let next = lanes.len() as u32;
            lanes.entry(n.lane).or_insert(next);
        }
        let mut races = Vec::new();
        let site = Site::Captured { graph };
        for (i, a) in nodes.iter().enumerate() {
            for b in &nodes[i + 1..] {
                let ordered = b.clock.covers(a.lane, a.pos) || a.clock.covers(b.lane, b.pos);
                if ordered {
                    continue;
                }
                for x in &a.accesses {
                    for y in b.accesses.iter().filter(|y| y.overlaps(x)) {
                        if let Some(kind) = conflict(x.mode, y.mode) {
                            let earlier = OpRef { op: a.op.to_string(), site };
                            let later = OpRef { op: b.op.to_string(), site };
                            let fix = fix_for(&earlier, &later);
                            races.push(Hazard {
                                kind,
                                buffer: Some(y.buffer),
                                bytes: None,
                                event: None,
                                earlier: Some(earlier),
                                later,
                                at: None,
                                fix,
                            });
                        }
                    }
                }
            }
        }
        let mut lane_end = vec![0; lanes.len()];
        let mut by_memory: HashMap<BufferId, Vec<(usize, Access)>> = HashMap::new();
        let mut footprint: Vec<(usize, Access)> = Vec::new();
        let mut summary_nodes = Vec::with_capacity(nodes.len());
        for (i, n) in nodes.iter().enumerate() {
            let lane = lanes[&n.lane];
            lane_end[lane as usize] = lane_end[lane as usize].max(n.pos);
            for a in &n.accesses {
                by_memory.entry(a.memory).or_default().push((i, *a));
                if !footprint.iter().any(|(_, f)| f.memory == a.memory && f.at == a.at && f.mode == a.mode) {
                    footprint.push((i, *a));
                }
            }
            summary_nodes.push(SummaryNode { op: n.op, lane, pos: n.pos });
        }
        let records = records.iter().map(|(e, c)| (*e, rebase(c, &lanes))).collect();
        (GraphSummary { nodes: summary_nodes, by_memory, footprint, lane_end, records, waits }, races)
    }

    /// The same graph with the reads that `remaps` move made of the buffers they move to, and
    /// without the accesses of the nodes in `disabled` (sorted), which a launch runs as nothing.
    /// A node is an operation of the capture, numbered as its sites are: where the capture had
    /// another number of operations than `sites`, every node is kept (the checker then sees
    /// more than runs, never less).
    pub(crate) fn patched(&self, remaps: &[Remap], sites: usize, disabled: &[usize]) -> GraphSummary {
        let off = |n: &usize| self.nodes.len() == sites && disabled.binary_search(n).is_ok();
        let mut by_memory: HashMap<BufferId, Vec<(usize, Access)>> = HashMap::new();
        let mut footprint: Vec<(usize, Access)> = Vec::new();
        for (n, a) in self.by_memory.values().flatten().filter(|(n, _)| !off(n)) {
            let a = moved(a, remaps);
            by_memory.entry(a.memory).or_default().push((*n, a));
        }
        for list in by_memory.values_mut() {
            list.sort_by_key(|(n, _)| *n);
        }
        let mut all: Vec<&(usize, Access)> = by_memory.values().flatten().collect();
        all.sort_by_key(|(n, _)| *n);
        for (n, a) in all {
            if !footprint.iter().any(|(_, f)| f.memory == a.memory && f.at == a.at && f.mode == a.mode) {
                footprint.push((*n, *a));
            }
        }
        let nodes = self.nodes.iter().map(|n| SummaryNode { op: n.op, lane: n.lane, pos: n.pos }).collect();
        GraphSummary {
            nodes,
            by_memory,
            footprint,
            lane_end: self.lane_end.clone(),
            records: self.records.clone(),
            waits: self.waits.clone(),
        }
    }

    /// The record of `event` in this graph and the accesses after it (see [`SyncPoint`]).
    pub(crate) fn sync_point(&self, event: EventId) -> SyncPoint {
        let records: Vec<&Vec<(u32, u64)>> = self.records.iter().filter(|(e, _)| *e == event).map(|(_, a)| a).collect();
        let before = |n: &SummaryNode| {
            records.first().is_some_and(|after| after.iter().any(|(lane, pos)| *lane == n.lane && n.pos <= *pos))
        };
        let tail = self
            .by_memory
            .values()
            .flatten()
            .filter(|(n, _)| !before(&self.nodes[*n]))
            .map(|(n, a)| TailAccess { op: self.nodes[*n].op, access: *a })
            .collect();
        SyncPoint { records: records.len(), external_waits: self.waits.clone(), tail }
    }

    /// Whether some node writes memory that `a` touches.
    pub(crate) fn writes_overlapping(&self, a: &Access) -> bool {
        self.by_memory.get(&a.memory).into_iter().flatten().any(|(_, w)| w.mode.writes() && w.overlaps(a))
    }

    /// The accesses of `memory`, with their nodes.
    pub(crate) fn accesses_of(&self, memory: BufferId) -> impl Iterator<Item = (&SummaryNode, &Access)> {
        self.by_memory.get(&memory).into_iter().flatten().map(|(n, a)| (&self.nodes[*n], a))
    }

    /// One access per distinct (memory, region, mode), with a node that makes it.
    pub(crate) fn footprint(&self) -> impl Iterator<Item = (&SummaryNode, &Access)> {
        self.footprint.iter().map(|(n, a)| (&self.nodes[*n], a))
    }

    /// Every allocation the graph touches.
    pub(crate) fn memories(&self) -> impl Iterator<Item = BufferId> + '_ {
        self.by_memory.keys().copied()
    }

    /// For each external event, the clock its record has in `launch`: the entry, plus the
    /// record node's ancestors (not the tail after it).
    pub(crate) fn records_at(&self, launch: u64, entry: &Clock) -> Vec<(EventId, Clock)> {
        self.records
            .iter()
            .map(|(e, after)| {
                let mut c = entry.clone();
                for (lane, pos) in after {
                    c.raise(Lane::Launch(launch, *lane), *pos);
                }
                (*e, c)
            })
            .collect()
    }

    /// The end of every lane of `launch`.
    pub(crate) fn lanes_end(&self, launch: u64) -> impl Iterator<Item = (Lane, u64)> + '_ {
        self.lane_end.iter().enumerate().map(move |(i, p)| (Lane::Launch(launch, i as u32), *p))
    }

    /// The clock after the whole of `launch`.
    pub(crate) fn end_clock(&self, launch: u64, entry: &Clock) -> Clock {
        let mut c = entry.clone();
        for (lane, pos) in self.lanes_end(launch) {
            c.raise(lane, pos);
        }
        c
    }
}
