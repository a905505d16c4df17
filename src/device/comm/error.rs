//! Why a collective or a process group fails.

use crate::device::DType;
use crate::Error;

/// Why a collective or a process group failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CommErrorKind {
    // ---- ranks that disagree, stall or leave ----------------------------------------------------
    /// Ranks issued different operations at the same place in their order.
    #[error("rank {rank} issued {found} as operation #{seq} of the communicator, but rank {other} issued {expected}; every rank must issue the same collectives in the same order (NCCL would hang or corrupt data here)")]
    Mismatch {
        /// The operation's place in the communicator's order.
        seq: u64,
        /// The rank that issued it second.
        rank: usize,
        /// What it issued.
        found: String,
        /// The rank that issued it first.
        other: usize,
        /// What that rank issued.
        expected: String,
    },
    /// Every rank waits for another: the ranks issued operations in orders that cannot meet.
    #[error("deadlock: {waits}; issue collectives and sends/receives in an order every rank can meet (NCCL would hang here)")]
    Deadlock {
        /// What each rank waits for.
        waits: String,
    },
    /// A rank waited longer than [`CommOptions::timeout`](super::CommOptions::timeout).
    #[error(
        "waited {secs:.1} s for {waiting}; a rank is slow, stuck or dead: check every rank's log, or raise the timeout"
    )]
    Timeout {
        /// What it waited for.
        waiting: String,
        /// How long.
        secs: f64,
    },
    /// A rank left (its communicator was dropped, or its process died) while others waited on it.
    #[error("rank {rank} left the group while others waited on it (its process ended, or it failed and dropped its communicator); see that rank's log")]
    RankGone {
        /// The rank that left.
        rank: usize,
    },
    /// A rank's thread panicked (ranks run as threads of one process: `dist::on_ranks`); the
    /// other ranks see it leave ([`CommErrorKind::RankGone`]).
    #[error("rank {rank} panicked: {message}; this is a bug in the code the rank ran, fix it there")]
    Panicked {
        /// The rank whose thread panicked.
        rank: usize,
        /// The panic's message (its `&str` or `String` payload), or a note that it had none.
        message: String,
    },

    /// A collective did not complete, inside a graph's launch or outside graphs: it waited past
    /// the timeout, or on a rank that died ([`Communicator::wait`](super::Communicator::wait)
    /// reports it so, naming the graph and what its capture recorded; see `docs/several-gpus.md`).
    #[error("{0}")]
    Stalled(Box<Stalled>),

    // ---- arguments of a collective --------------------------------------------------------------
    /// A rank number outside the group.
    #[error("peer {peer} is not a rank of this group of {size}; pass a rank below {size} other than your own")]
    BadPeer {
        /// The peer asked for.
        peer: usize,
        /// The group's size.
        size: usize,
    },
    /// Lengths that do not fit the operation.
    #[error("{what}; pass views of the lengths the operation takes")]
    Length {
        /// What was wrong.
        what: String,
    },
    /// Buffers of one operation (or group) that overlap where one of them is written: NCCL's
    /// result would be undefined.
    #[error("{what}; give the operation's buffers distinct memory")]
    Overlap {
        /// Which buffers overlap.
        what: String,
    },
    /// A reduction of an element type that has no sum here.
    #[error("cannot sum {dtype}; reduce f32, bf16 or f16")]
    DType {
        /// The element type.
        dtype: DType,
    },

    // ---- gradient buckets of data parallelism ---------------------------------------------------
    /// Gradient buckets of two graphed callables that overlap
    /// ([`DataParallel::new`](crate::dist::DataParallel::new)): a gradient in both would be
    /// summed twice, the second sum doubling the first.
    #[error(
        "the gradient buckets of graphed callables {first} and {second} overlap (a parameter they share would be \
         reduced twice); give each gradient to one bucket"
    )]
    BucketOverlap {
        /// The earlier callable.
        first: usize,
        /// The later callable.
        second: usize,
    },
    /// A graphed callable whose index has no gradient bucket in the
    /// [`DataParallel`](crate::dist::DataParallel) it reduces through.
    #[error("graphed callable {callable} has no gradient bucket; pass one per callable")]
    NoBucket {
        /// The callable's index.
        callable: usize,
    },
    /// A parameter a module told final in its backward that is not in its callable's gradient
    /// bucket.
    #[error(
        "parameter `{param}` was told final in graphed callable {callable}'s backward but is not in its gradient \
         bucket; make the DataParallel from the callables' own parameters (DataParallel::for_callables or \
         for_stack)"
    )]
    NotInBucket {
        /// The parameter's name.
        param: String,
        /// The callable's index.
        callable: usize,
    },

    /// A [`DataParallel`](crate::dist::DataParallel) given to
    /// [`ReductionGraphs`](crate::dist::ReductionGraphs) while something else holds it: a
    /// capture's `grad_sync` would reduce the same gradients a second time.
    #[error(
        "the DataParallel is held in {holders} other place(s), such as a capture's grad_sync, which would reduce its \
         gradients a second time; reduce them one way: give ReductionGraphs::capture a DataParallel nothing else holds"
    )]
    ReducedTwice {
        /// How many other handles to it there are.
        holders: usize,
    },

    // ---- NCCL, the rendezvous and the launch ----------------------------------------------------
    /// NCCL returned an error.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// NCCL reported that another rank failed (`ncclRemoteError`: it died or aborted) and no
    /// watch of the group named it within [`PEER_NAMING_GRACE`](super::PEER_NAMING_GRACE).
    #[error("NCCL: {call} failed because another rank failed (ncclRemoteError); see the other ranks' logs for which and why")]
    PeerFailed {
        /// The NCCL call, or the work, that failed.
        call: String,
    },
    /// The rendezvous of a process group failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// Ranks disagree on what they train.
    #[error(
        "rank {rank} builds {theirs}, but rank 0 builds {ours}; launch every rank with the same model and arguments"
    )]
    ModelMismatch {
        /// The disagreeing rank.
        rank: usize,
        /// What rank 0 builds.
        ours: String,
        /// What that rank builds.
        theirs: String,
    },
    /// A world that does not split into a grid of that many pipeline stages
    /// ([`Grid`](crate::dist::Grid)): every stage needs as many replicas.
    #[error("a world of {world} ranks does not split into {stages} pipeline stages of equal replicas; start a multiple of the stages, or pass a number of stages that divides the ranks")]
    GridShape {
        /// The world's ranks.
        world: usize,
        /// The stages asked for.
        stages: usize,
    },
    /// The launcher's environment is missing or wrong.
    #[error("environment variable {var}: {why}; launch with `graphed launch` or torchrun, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

/// What [`CommErrorKind::Stalled`] reports: the graph launch that did not complete (if the
/// collective was in one), the collective it waits in, the ranks, and what ended the wait.
#[derive(Debug, Clone, PartialEq)]
pub struct Stalled {
    /// The graph launch that did not complete; `None` for a collective enqueued outside graphs.
    pub graph: Option<StalledLaunch>,
    /// The collective it waits in: as its capture recorded it (op, elements, its place in the
    /// graph, the rank and size of its communicator), on GPUs, when the graph holds several
    /// collectives of the group, each of them; or as it was enqueued outside graphs.
    pub collective: String,
    /// The ranks that reached the collective, where known (the simulator knows).
    pub arrived: Option<Vec<usize>>,
    /// The ranks that did not, where known (the simulator; on GPUs, a rank the group's watch saw
    /// die).
    pub missing: Option<Vec<usize>>,
    /// What ended the wait: the timeout, or the rank gone.
    pub cause: CommErrorKind,
}

/// The graph launch of a [`Stalled`] report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StalledLaunch {
    /// The graph's name (the graph layer's: module and pass, or a graphed function's name).
    pub graph: String,
    /// Which launch of it, counted from 1.
    pub launch: u64,
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranks = ranks_line(self.arrived.as_deref(), self.missing.as_deref());
        match &self.graph {
            Some(StalledLaunch { graph, launch }) => write!(
                f,
                "graph `{graph}` (launch {launch} of it) did not complete: it waits in {}; {ranks}; {}",
                self.collective, self.cause
            ),
            None => write!(f, "a collective did not complete: {}; {ranks}; {}", self.collective, self.cause),
        }
    }
}

/// The ranks of a [`Stalled`] report in words.
fn ranks_line(arrived: Option<&[usize]>, missing: Option<&[usize]>) -> String {
    let list = |r: &[usize]| match r {
        [] => "none".to_string(),
        r => r.iter().map(usize::to_string).collect::<Vec<_>>().join(", "),
    };
    match (arrived, missing) {
        (Some(a), Some(m)) => format!("ranks arrived: {}; ranks missing: {}", list(a), list(m)),
        (None, Some(m)) => format!("ranks missing: {} (the others' progress is not known on GPUs)", list(m)),
        (Some(a), None) => format!("ranks arrived: {}", list(a)),
        (None, None) => "which ranks arrived is not known on GPUs: look for the rank whose log stops first".into(),
    }
}

/// The error of operation `op` on `rank`.
pub(crate) fn comm_error(op: &'static str, rank: usize, kind: CommErrorKind) -> Error {
    Error::Comm { op, rank, kind }
}
