//! The watchdog of collectives, inside graphs and out. A capture records, on the host, every
//! collective it captures ([`CapturedCollective`]); a launch of a graph that holds some is noted
//! by each communicator involved, with an event recorded after it, and so is every collective
//! enqueued outside a capture; a wait on the group that fails (its timeout, a rank gone) is
//! reported as the launch or collective that did not complete, the collective it waits in and
//! the ranks that reached it ([`CommErrorKind::Stalled`]).
//!
//! On the simulator the group's order is known: the failed wait says which collective of the
//! group's order it waited in and which ranks had arrived, and each launch noted where its
//! collectives start in that order. On GPUs NCCL says neither: the launch is the first one (a
//! graph's, or a collective's outside graphs) whose event has not completed, its collective is
//! named when it holds one of the group's (each is listed otherwise), and the ranks are known
//! only when the group's watch saw one die. `docs/several-gpus.md` says why nothing more is
//! exchanged.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use super::{CommErrorKind, CommInner, Communicator, Stalled, StalledLaunch};
use crate::device::backend::Repr;
use crate::device::{DType, DeviceId, Event, GraphId, Stream};
use crate::{Error, Result};

/// A collective as a capture recorded it: what the host side of a graph knows of the
/// collectives the graph holds ([`Graph::collectives`](crate::device::Graph::collectives)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapturedCollective {
    /// The operation: `all_reduce`, `all_reduce_amax`, `reduce_scatter`, `all_gather`,
    /// `send to rank r`, `recv from rank r`, or a group of sends and receives.
    pub op: String,
    /// Elements it moves (of every transfer, for a group).
    pub elements: usize,
    /// Their element type.
    pub dtype: DType,
    /// Its communicator's rank.
    pub rank: usize,
    /// Its communicator's size.
    pub size: usize,
    /// Its place among the graph's collectives, from 0, in capture order.
    pub index: usize,
    /// How many collectives the graph holds.
    pub of: usize,
    /// Whether it takes a place in the group's order of collectives (sends and receives are
    /// ordered per pair of ranks instead).
    ordered: bool,
}

impl std::fmt::Display for CapturedCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} × {} (collective {} of {} in the graph, rank {} of a group of {})",
            self.op,
            self.elements,
            self.dtype,
            self.index + 1,
            self.of,
            self.rank,
            self.size
        )
    }
}

impl CapturedCollective {
    /// The collective in a report's words when it was enqueued outside graphs.
    fn outside_graphs(&self) -> String {
        let CapturedCollective { op, elements, dtype, rank, size, .. } = self;
        format!("{op} of {elements} × {dtype} outside graphs (rank {rank} of a group of {size})")
    }
}

/// What a graph's host side knows beyond its nodes: its name, and the collectives it holds with
/// their communicators. Shared by the graph and its executables.
#[derive(Default)]
pub(crate) struct GraphCollectives {
    name: Mutex<Option<Arc<str>>>,
    collectives: Vec<CapturedCollective>,
    /// Per collective, its communicator (held weakly: a graph does not keep a rank in its group).
    comms: Vec<Weak<CommInner>>,
    /// Launches so far.
    launches: AtomicU64,
}

/// The collectives captured so far, per capture of a device (the simulator numbers captures
/// per device, CUDA per process): handed to the graph when its capture ends.
type Log = HashMap<(DeviceId, u64), Vec<(CapturedCollective, Weak<CommInner>)>>;
static CAPTURING: Mutex<Option<Log>> = Mutex::new(None);

impl GraphCollectives {
    /// What capture `capture` of `dev` recorded (nothing for a capture without collectives);
    /// the record is gone from the log, whether the capture gave a graph or failed.
    pub(crate) fn take(dev: DeviceId, capture: Option<u64>) -> GraphCollectives {
        let taken = capture.and_then(|c| {
            CAPTURING.lock().unwrap_or_else(PoisonError::into_inner).as_mut().and_then(|log| log.remove(&(dev, c)))
        });
        let (mut collectives, comms): (Vec<_>, Vec<_>) = taken.unwrap_or_default().into_iter().unzip();
        let of = collectives.len();
        collectives.iter_mut().for_each(|c: &mut CapturedCollective| c.of = of);
        GraphCollectives { collectives, comms, ..GraphCollectives::default() }
    }

    /// The collectives, in capture order.
    pub(crate) fn collectives(&self) -> &[CapturedCollective] {
        &self.collectives
    }

    /// The graph's name, if one was given.
    pub(crate) fn name(&self) -> Option<Arc<str>> {
        self.name.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) fn set_name(&self, name: &str) {
        *self.name.lock().unwrap_or_else(PoisonError::into_inner) = Some(name.into());
    }

    /// The distinct communicators still alive, with where each one's ordered collectives start
    /// in its group's order now (the simulator's count; `None` on GPUs): taken before a launch.
    pub(crate) fn before_launch(&self) -> Vec<(Communicator, Option<u64>)> {
        let mut out: Vec<(Communicator, Option<u64>)> = Vec::new();
        for c in self.comms.iter().filter_map(Weak::upgrade) {
            if !out.iter().any(|(o, _)| Arc::ptr_eq(&o.inner, &c)) {
                let comm = Communicator { inner: c };
                let first = comm.issued();
                out.push((comm, first));
            }
        }
        out
    }

    /// After a launch of graph `id` on `stream`: each communicator notes it.
    pub(crate) fn launched(
        self: &Arc<Self>,
        id: GraphId,
        stream: &Stream,
        comms: Vec<(Communicator, Option<u64>)>,
    ) -> Result<()> {
        let number = self.launches.fetch_add(1, Ordering::Relaxed) + 1;
        comms.into_iter().try_for_each(|(c, first)| c.note_launch(self, id, number, first, stream))
    }
}

/// How many launches each communicator remembers: far more than are in flight in a training
/// step, few enough that the events they take stay a handful.
const KEPT: usize = 64;

/// A communicator's launches of graphs that hold its collectives, newest last.
#[derive(Default)]
pub(crate) struct Ledger {
    launches: VecDeque<Launch>,
    /// Events recorded after the launches, reused round-robin as launches are forgotten.
    events: Vec<Event>,
    noted: usize,
    /// Set at the group's abort, which ends every launch: the serial of the first launch that
    /// had not completed then (`None`: all had).
    at_abort: Option<Option<usize>>,
}

struct Launch {
    /// Its place among the communicator's noted launches.
    serial: usize,
    what: Launched,
    /// Where its ordered collectives start in the group's order (the simulator's).
    first: Option<u64>,
    done: Event,
}

/// What a noted launch was.
enum Launched {
    /// Launch `number` of graph `id`, which holds collectives of the communicator.
    Graph { graph: Arc<GraphCollectives>, id: GraphId, number: u64 },
    /// One collective enqueued outside any capture.
    Eager(CapturedCollective),
}

impl Launch {
    /// Its collectives of `comm`: the graph's, or the one collective.
    fn of<'g>(&'g self, comm: &Communicator) -> Box<dyn Iterator<Item = &'g CapturedCollective> + 'g> {
        match &self.what {
            Launched::Graph { graph, .. } => {
                let inner = Arc::as_ptr(&comm.inner);
                Box::new(
                    (graph.collectives.iter().zip(&graph.comms))
                        .filter(move |(_, c)| c.as_ptr() == inner)
                        .map(|(x, _)| x),
                )
            }
            Launched::Eager(c) => Box::new(std::iter::once(c)),
        }
    }
}

impl Ledger {
    /// The first launch that has not completed (at the group's abort, if it was aborted).
    fn first_pending(&self) -> Option<&Launch> {
        match self.at_abort {
            Some(serial) => self.launches.iter().find(|l| Some(l.serial) == serial),
            None => self.launches.iter().find(|l| !l.done.completed().unwrap_or(false)),
        }
    }
}

/// Where a simulated group's failed wait stood: the collective's place in the group's order
/// (`None` for a send or receive), and the ranks that had reached it and those that had not.
pub(crate) struct Stuck {
    pub(crate) seq: Option<u64>,
    pub(crate) arrived: Vec<usize>,
    pub(crate) missing: Vec<usize>,
}

impl Communicator {
    /// Notes a collective of this communicator just enqueued on `stream`: in a capture, as one
    /// the graph holds; outside, as a launch of its own, with an event recorded after it, so that
    /// a wait that fails behind it names it too. `first` is where it stands in the group's order
    /// (the simulator's count before it was enqueued).
    pub(crate) fn note_collective(
        &self,
        stream: &Stream,
        (op, elements, dtype): (String, usize, DType),
        ordered: bool,
        first: Option<u64>,
    ) -> Result<()> {
        let (rank, size) = (self.rank(), self.size());
        let Some(capture) = stream.capture_id()? else {
            let collective = CapturedCollective { op, elements, dtype, rank, size, index: 0, of: 0, ordered };
            return self.note(Launched::Eager(collective), first, stream);
        };
        let mut log = CAPTURING.lock().unwrap_or_else(PoisonError::into_inner);
        let held = log.get_or_insert_with(HashMap::new).entry((stream.device().id(), capture)).or_default();
        let collective = CapturedCollective { op, elements, dtype, rank, size, index: held.len(), of: 0, ordered };
        held.push((collective, Arc::downgrade(&self.inner)));
        Ok(())
    }

    /// Keeps which launch had not completed when the group is aborted (its first abort only).
    pub(crate) fn freeze_ledger(&self) {
        let mut ledger = self.inner.ledger.lock().unwrap_or_else(PoisonError::into_inner);
        if ledger.at_abort.is_none() {
            ledger.at_abort = Some(ledger.first_pending().map(|l| l.serial));
        }
    }

    /// Collectives this rank issued so far in its group's order (the simulator counts them;
    /// NCCL's count is not the host's to read).
    pub(crate) fn issued(&self) -> Option<u64> {
        match &self.inner.repr {
            Repr::Sim(link) => Some(link.issued()),
            Repr::Cuda(_) => None,
        }
    }

    /// Notes launch `number` of graph `id` on `stream`.
    fn note_launch(
        &self,
        graph: &Arc<GraphCollectives>,
        id: GraphId,
        number: u64,
        first: Option<u64>,
        stream: &Stream,
    ) -> Result<()> {
        self.note(Launched::Graph { graph: graph.clone(), id, number }, first, stream)
    }

    /// Notes `what`, just enqueued on `stream`, with an event recorded after it.
    fn note(&self, what: Launched, first: Option<u64>, stream: &Stream) -> Result<()> {
        let mut ledger = self.inner.ledger.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = ledger.noted % KEPT;
        if ledger.events.len() <= slot {
            ledger.events.push(stream.device().event()?);
        }
        let done = ledger.events[slot].clone();
        stream.record(&done)?;
        if ledger.launches.len() == KEPT {
            ledger.launches.pop_front();
        }
        let serial = ledger.noted;
        ledger.launches.push_back(Launch { serial, what, first, done });
        ledger.noted += 1;
        Ok(())
    }

    /// `e` as the report of the launch it stopped, when it is a wait on this group that failed
    /// for the group (its timeout, a rank gone) and a noted launch (a graph holding this group's
    /// collectives, or one of its collectives outside graphs) explains it.
    pub(crate) fn explained(&self, e: Error) -> Error {
        match e {
            Error::Comm { op, rank, kind } => Error::Comm { op, rank, kind: self.explain(kind) },
            other => other,
        }
    }

    /// `cause` as [`CommErrorKind::Stalled`] where a launch explains it (see
    /// [`explained`](Communicator::explained)).
    pub(crate) fn explain(&self, cause: CommErrorKind) -> CommErrorKind {
        if !matches!(cause, CommErrorKind::Timeout { .. } | CommErrorKind::RankGone { .. }) {
            return cause;
        }
        let stuck = match &self.inner.repr {
            Repr::Sim(link) => link.stuck(),
            Repr::Cuda(_) => None,
        };
        let ledger = self.inner.ledger.lock().unwrap_or_else(PoisonError::into_inner);
        let found = match stuck.as_ref().and_then(|s| s.seq) {
            // The launch whose ordered collectives cover the one the group waited in.
            Some(seq) => ledger.launches.iter().rev().find_map(|l| {
                let at = seq.checked_sub(l.first?)?;
                let at = usize::try_from(at).ok()?;
                l.of(self).filter(|c| c.ordered).nth(at).map(|c| (l, vec![c.clone()]))
            }),
            // The first launch not done; its collectives of this group, or those that are not
            // ordered when a send or receive waited.
            None => ledger.first_pending().map(|l| {
                let mine: Vec<CapturedCollective> = l.of(self).cloned().collect();
                let p2p: Vec<CapturedCollective> = mine.iter().filter(|c| !c.ordered).cloned().collect();
                (l, if stuck.is_some() && !p2p.is_empty() { p2p } else { mine })
            }),
        };
        let Some((launch, collectives)) = found else { return cause };
        let (graph, collective) = match &launch.what {
            Launched::Graph { graph, id, number } => {
                let name = graph.name().map_or_else(|| format!("{id} (unnamed)"), |n| n.to_string());
                let collective = match &collectives[..] {
                    [one] => one.to_string(),
                    many => format!("one of {}", many.iter().map(|c| c.to_string()).collect::<Vec<_>>().join("; ")),
                };
                (Some(StalledLaunch { graph: name, launch: *number }), collective)
            }
            Launched::Eager(c) => (None, c.outside_graphs()),
        };
        let (arrived, missing) = match (stuck, &cause) {
            (Some(s), _) => (Some(s.arrived), Some(s.missing)),
            (None, CommErrorKind::RankGone { rank }) => (None, Some(vec![*rank])),
            (None, _) => (None, None),
        };
        CommErrorKind::Stalled(Box::new(Stalled { graph, collective, arrived, missing, cause }))
    }
}
