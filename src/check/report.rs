//! Hazard reports: what raced with what, where, and the ordering that fixes it.

use std::fmt;

use serde::Serialize;

use crate::device::{BufferId, EventId, GraphId, StreamId};

/// The rule a hazard breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum HazardKind {
    /// A read not ordered after the write it may see.
    ReadAfterWrite,
    /// A write not ordered after a read of the same memory.
    WriteAfterRead,
    /// Two writes of the same memory with no order between them.
    WriteAfterWrite,
    /// A wait on an event that was never recorded: it does nothing (the upstream bug of
    /// TransformerEngine PR #2435's first revision).
    WaitNeverRecorded,
    /// A graph was reset while work of its last launch may still run (R4).
    TailNotJoined,
    /// A wait bound to an event's record by an earlier graph launch, while the stream that
    /// launched it has a later launch the wait does not cover (R6).
    StaleRecord,
}

/// Where an operation ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Site {
    /// On a stream.
    Stream(StreamId),
    /// On the host.
    Host,
    /// A node of a graph, found at the end of its capture.
    Captured {
        /// The graph.
        graph: GraphId,
    },
    /// A node of a graph launched on a stream.
    Graph {
        /// The graph.
        graph: GraphId,
        /// The stream it was launched on.
        stream: StreamId,
    },
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Site::Stream(s) => write!(f, "stream {s}"),
            Site::Host => f.write_str("the host"),
            Site::Captured { graph } => write!(f, "graph {graph} (as captured)"),
            Site::Graph { graph, stream } => write!(f, "graph {graph} launched on stream {stream}"),
        }
    }
}

/// An operation named in a report: the name given at launch, and where it ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OpRef {
    /// Kernel or copy name.
    pub op: String,
    /// Where it ran.
    pub site: Site,
}

impl fmt::Display for OpRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on {}", self.op, self.site)
    }
}

/// One hazard found by the checker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hazard {
    /// Which rule.
    pub kind: HazardKind,
    /// The buffer touched by the later operation, if memory is involved.
    pub buffer: Option<BufferId>,
    /// The overlapping byte range, relative to `buffer`'s start.
    pub bytes: Option<(usize, usize)>,
    /// The event involved, for event rules.
    pub event: Option<EventId>,
    /// The earlier operation.
    pub earlier: Option<OpRef>,
    /// The later operation, which the report is raised at.
    pub later: OpRef,
    /// Where in the caller's source the later operation was issued, when known (waits).
    pub at: Option<String>,
    /// The ordering that would fix it.
    pub fix: String,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.later)?;
        if let (Some(b), Some((lo, hi))) = (self.buffer, self.bytes) {
            write!(f, " touches buffer {b} bytes [{lo}, {hi})")?;
        }
        if let Some(e) = self.event {
            write!(f, " (event {e})")?;
        }
        if let Some(at) = &self.at {
            write!(f, " at {at}")?;
        }
        if let Some(earlier) = &self.earlier {
            let relation = if self.kind == HazardKind::StaleRecord { "not covering" } else { "unordered with" };
            write!(f, " {relation} {earlier}")?;
        }
        write!(f, "; fix: {}", self.fix)
    }
}
