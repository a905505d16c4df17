//! Where a replay runs and how the caller resumes (replay contract R1–R4, R6, R8), the tail
//! handle, and outputs that know when a later replay overwrote them.

use std::sync::{Arc, Weak};

use super::error::refusal;
use super::output::StaticOutput;
use super::GraphedErrorKind;
use crate::device::{Event, GraphId, Stream};
use crate::memory::{CachingAllocator, GraphPool};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Where a graphed call replays its graphs, and how the caller's stream resumes.
#[derive(Clone, Copy, Debug)]
pub enum Replay<'a> {
    /// On the caller's stream.
    Caller,
    /// On another stream that waits for the caller's (R1); the caller waits for all of it.
    Joined(&'a Stream),
    /// On another stream that waits for the caller's (R1); the caller resumes at the sync event
    /// bound at capture ([`GraphOptions::sync_event`](super::GraphOptions::sync_event)), which the
    /// graphs record after every write the caller can observe (R2), while the graph's tail may
    /// still run (join it: R4).
    Side(&'a Stream),
}

impl<'a> Replay<'a> {
    /// On the caller's stream.
    pub fn caller() -> Replay<'a> {
        Replay::Caller
    }

    /// On `stream`, joined as a whole.
    pub fn joined(stream: &'a Stream) -> Replay<'a> {
        Replay::Joined(stream)
    }

    /// On `stream`, the caller resuming at the sync event the graphs record.
    pub fn side(stream: &'a Stream) -> Replay<'a> {
        Replay::Side(stream)
    }
}

/// A replay choice, owned, kept from a forward for its backward (R8).
#[derive(Clone, Debug)]
pub(crate) enum Route {
    Caller,
    Joined(Stream),
    Side(Stream),
}

impl Route {
    /// The stream the graphs run on.
    pub(crate) fn stream<'a>(&'a self, caller: &'a Stream) -> &'a Stream {
        match self {
            Route::Caller => caller,
            Route::Joined(s) | Route::Side(s) => s,
        }
    }
}

/// Work of a side-stream replay that may still run after the caller resumed (the graph's tail).
/// Join it before anything reads what the tail wrote (R4); dropping it joins it into the
/// caller's stream. Keep it alive (`let (y, tail) = ...`) for the caller to overlap the tail.
/// A refused join (a stream of another device) enqueues nothing; the tail then joins the
/// caller's stream when dropped, as any dropped tail does.
///
/// Joining waits for everything queued on the replay stream when the join is issued (an event
/// recorded then, not at the replay: the replay itself costs one driver call less, and a later
/// replay's work on that stream is waited for too, which is safe).
#[must_use = "dropping the tail joins it at once, which gives up the overlap"]
pub struct Tail {
    pending: Option<Pending>,
}

struct Pending {
    /// The callable whose replay it is, for refusals.
    callable: Arc<str>,
    done: Event,
    replay: Stream,
    caller: Stream,
    pool: GraphPool,
}

impl Tail {
    pub(crate) fn none() -> Tail {
        Tail { pending: None }
    }

    pub(crate) fn pending(
        callable: &Arc<str>,
        done: Event,
        replay: &Stream,
        caller: &Stream,
        pool: &GraphPool,
    ) -> Tail {
        let (callable, replay, caller, pool) = (callable.clone(), replay.clone(), caller.clone(), pool.clone());
        Tail { pending: Some(Pending { callable, done, replay, caller, pool }) }
    }

    /// Whether there is nothing to join (the replay was joined as a whole).
    pub fn is_empty(&self) -> bool {
        self.pending.is_none()
    }

    /// Makes `stream` wait for the whole replay, tail included.
    ///
    /// # Errors
    /// [`GraphedErrorKind::Refused`] ([`Error::WrongDevice`]) for a stream of another device than
    /// the replay's, before anything is enqueued.
    pub fn join(mut self, stream: &Stream) -> Result<()> {
        self.join_pending(stream)
    }

    /// Joins the tail into `stream`; it stays pending if that fails.
    fn join_pending(&mut self, stream: &Stream) -> Result<()> {
        if let Some(p) = &self.pending {
            p.join(stream)?;
            self.pending = None;
        }
        Ok(())
    }
}

/// The tails of one caller's replays, joined together: a tail replaces an earlier one of the same
/// replay stream (launches on one stream run in order, so the later tail's end covers the earlier
/// one's), and joining waits once per replay stream instead of once per replay.
///
/// ```
/// use graphed::device::Device;
/// use graphed::graph::{make_graphed_callables, Callable, GraphOptions, Replay, Tails};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Inputs, Linear, ParamStore};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let (main, side, event) = (dev.stream()?, dev.stream()?, dev.event()?);
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &main, 64)?;
/// let fc = Linear::new(&Builder::new(&store, &alloc, &main)?.with_seed(1).pp("fc"), (4, 3))?;
/// let x = Tensor::from_host(&alloc, &main, &[0.5f32; 8], &[2, 4])?;
/// let dy = Tensor::from_host(&alloc, &main, &[1.0f32; 6], &[2, 3])?;
/// let options = GraphOptions::default().sync_event(&event);
/// let g = make_graphed_callables(&alloc, &[&fc as &dyn Callable], &[Inputs::one(&x)], options)?;
/// let mut tails = Tails::new();
/// let (_y, tail) = g[0].forward(&main, &Inputs::one(&x), Replay::side(&side))?;
/// tails.push(tail);
/// let (_dx, tail) = g[0].backward(&main, &[&dy])?; // on the side stream, as the forward
/// tails.push(tail);
/// assert_eq!(tails.len(), 1); // one replay stream: the later tail covers the earlier one
/// tails.join(&main)?; // before the optimizer, or anything else that reads what the tails wrote
/// assert!(tails.is_empty());
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Default, Debug)]
#[must_use = "dropping the tails joins them at once"]
pub struct Tails {
    latest: Vec<Tail>,
}

impl Tails {
    /// No tails.
    pub fn new() -> Tails {
        Tails::default()
    }

    /// Adds `tail`, issued after every tail already here.
    pub fn push(&mut self, mut tail: Tail) {
        let Some(p) = &tail.pending else { return };
        let stream = p.replay.id();
        let same = self.latest.iter_mut().find(|t| t.pending.as_ref().is_some_and(|q| q.replay.id() == stream));
        match same {
            // Covered by the new one: let it go without a wait.
            Some(old) => {
                old.pending = tail.pending.take();
            }
            None => self.latest.push(tail),
        }
    }

    /// Adds every tail of `other`, issued after the tails already here.
    pub fn append(&mut self, other: Tails) {
        other.latest.into_iter().for_each(|t| self.push(t));
    }

    /// How many tails are pending: one per replay stream, at most.
    pub fn len(&self) -> usize {
        self.latest.len()
    }

    /// Whether no tail is pending.
    pub fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }

    /// Makes `stream` wait for every tail; the tails joined are no longer pending.
    ///
    /// # Errors
    /// [`GraphedErrorKind::Refused`] ([`Error::WrongDevice`]) for a stream of another device than a
    /// tail's replay, decided before anything is enqueued: every tail stays pending then.
    pub fn join(&mut self, stream: &Stream) -> Result<()> {
        self.latest.iter().filter_map(|t| t.pending.as_ref()).try_for_each(|p| p.check(stream))?;
        let joined = self.latest.iter_mut().try_for_each(|t| t.join_pending(stream));
        self.latest.retain(|t| !t.is_empty());
        joined
    }
}

impl Pending {
    /// Refuses a join into a stream of another device.
    fn check(&self, stream: &Stream) -> Result<()> {
        let dev = self.caller.device();
        dev.check_same("tail join", "stream", stream.device().id()).map_err(|e| refusal(&self.callable, e))
    }

    fn join(&self, stream: &Stream) -> Result<()> {
        self.check(stream)?;
        // The record covers every launch on the replay stream so far, the pool's last included.
        self.pool.join_from(&self.replay, stream, &self.done)
    }
}

impl Drop for Tail {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            if let Err(e) = p.join(&p.caller) {
                p.caller.device().record_drop_err("a graph tail (its join)", e);
            }
        }
    }
}

impl std::fmt::Debug for Tail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tail({})", if self.is_empty() { "joined" } else { "pending" })
    }
}

/// What a static output is, and the graphs of its pool that write its memory; computed once at
/// capture so that a replay only clones it.
pub(crate) struct Origin {
    /// The callable that returns it, for refusals.
    pub(crate) callable: Arc<str>,
    /// Which of its outputs it is ("output 0", "gradient of input 0").
    pub(crate) what: Arc<str>,
    pub(crate) writers: Arc<[GraphId]>,
    /// For memory shared with the pool's later graphs, the graphs of the pool when `writers`
    /// was computed: any graph captured into the pool after them may have been given the memory,
    /// so it counts as a writer too.
    pub(crate) known: Option<Arc<[GraphId]>>,
}

/// An output or input gradient of a graphed call: a view of a static buffer in the graph pool.
/// The next replay of any graph of the pool that writes that memory (its own graph, or another
/// whose internals reuse it, as the next layer's graphs do with an output shared under a
/// schedule) overwrites it, and the tensor then refuses to be read instead of giving stale data;
/// copy it with [`to_owned`](StaticTensor::to_owned) to keep it. A tensor taken out of it
/// ([`get`](StaticTensor::get)) is a plain handle that nothing checks: read it before the next
/// replay.
#[derive(Clone)]
pub struct StaticTensor {
    tensor: Tensor,
    /// For memory that the pool shares with later graphs, which the callable does not own: alive
    /// while the callable's static state is (Note [Shared static outputs]).
    lent: Option<Weak<()>>,
    pool: GraphPool,
    /// The graphs that write its memory, and their launch counts when it was made.
    writers: Arc<[GraphId]>,
    made_at: Vec<u64>,
    /// For shared memory, the graphs of the pool when its writers were computed: the others
    /// (captured into the pool later, and not among `writers`) count as writers never launched
    /// when it was made.
    known: Option<Arc<[GraphId]>>,
    /// The callable that returned it.
    callable: Arc<str>,
    /// Which of its outputs it is.
    what: Arc<str>,
}

impl StaticTensor {
    pub(crate) fn new(output: &StaticOutput, pool: &GraphPool, origin: &Origin) -> StaticTensor {
        let mut writers = origin.writers.clone();
        if let Some(known) = &origin.known {
            // Graphs captured into the pool since its writers were computed: writers too.
            let later: Vec<GraphId> = pool.order().into_iter().filter(|g| !known.contains(g)).collect();
            if !later.is_empty() {
                writers = writers.iter().copied().chain(later.into_iter().filter(|g| !writers.contains(g))).collect();
            }
        }
        let made_at = pool.launch_counts(&writers);
        let (callable, what) = (origin.callable.clone(), origin.what.clone());
        let (tensor, lent, known) = (output.tensor().clone(), output.lent(), origin.known.clone());
        StaticTensor { tensor, lent, pool: pool.clone(), writers, made_at, known, callable, what }
    }

    /// The first writer launched since this tensor was made, with its launch count then and now;
    /// for shared memory, else the first graph captured into the pool since that was launched.
    fn overwritten(&self) -> Option<(GraphId, u64, u64)> {
        let now = self.pool.launch_counts(&self.writers);
        let known_writer = (self.writers.iter().zip(self.made_at.iter().zip(now)))
            .find(|(_, (a, b))| **a != *b)
            .map(|(g, (a, b))| (*g, *a, b));
        let Some(known) = &self.known else { return known_writer };
        known_writer.or_else(|| {
            let later: Vec<GraphId> =
                self.pool.order().into_iter().filter(|g| !known.contains(g) && !self.writers.contains(g)).collect();
            let counts = self.pool.launch_counts(&later);
            later.into_iter().zip(counts).find(|(_, n)| *n > 0).map(|(g, n)| (g, 0, n))
        })
    }

    /// Whether it is memory shared with later graphs of the pool whose callable was released.
    fn released(&self) -> bool {
        self.lent.as_ref().is_some_and(|l| l.strong_count() == 0)
    }

    /// The tensor, if no later replay has overwritten it.
    ///
    /// # Errors
    /// [`GraphedErrorKind::StaleOutput`] after a later replay of a graph that writes its memory;
    /// [`GraphedErrorKind::OutputReleased`] for memory shared with the pool's later graphs once
    /// its callable was released.
    pub fn get(&self) -> Result<&Tensor> {
        let err = |kind| Err(Error::Graphed { callable: self.callable.to_string(), kind });
        if self.released() {
            return err(GraphedErrorKind::OutputReleased { what: self.what.to_string() });
        }
        match self.overwritten() {
            None => Ok(&self.tensor),
            Some((graph, made_by, now)) => {
                let (what, graph_name) = (self.what.to_string(), self.pool.graph_name(graph));
                err(GraphedErrorKind::StaleOutput { what, graph, graph_name, made_by, now })
            }
        }
    }

    /// Whether no later replay has overwritten it (and its memory is still its callable's to
    /// read).
    pub fn is_fresh(&self) -> bool {
        !self.released() && self.overwritten().is_none()
    }

    /// A copy in fresh memory from `alloc`, made on `stream` (after the replay, on the caller's
    /// stream or after joining the replay).
    pub fn to_owned(&self, alloc: &CachingAllocator, stream: &Stream) -> Result<Tensor> {
        let t = self.get()?;
        let out = Tensor::uninit(alloc, stream, t.shape(), t.dtype())?;
        out.copy_from(t, stream)?;
        Ok(out)
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        self.tensor.shape()
    }

    /// Its element type.
    pub fn dtype(&self) -> crate::device::DType {
        self.tensor.dtype()
    }
}

impl std::fmt::Debug for StaticTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StaticTensor({}: {}, {:?})", self.callable, self.what, self.tensor.shape())
    }
}
