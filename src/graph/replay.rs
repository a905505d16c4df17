//! Where a replay runs and how the caller resumes (replay contract R1–R4, R6, R8), the tail
//! handle, and outputs that know when a later replay overwrote them.

use std::sync::Arc;

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

/// Work of a side-stream replay that may still run after the caller resumed (the graph's tail).
/// Join it before anything reads what the tail wrote (R4); dropping it joins it into the
/// caller's stream. Keep it alive (`let (y, tail) = ...`) for the caller to overlap the tail.
///
/// Joining waits for everything queued on the replay stream when the join is issued (an event
/// recorded then, not at the replay: the replay itself costs one driver call less, and a later
/// replay's work on that stream is waited for too, which is safe).
#[must_use = "dropping the tail joins it at once, which gives up the overlap"]
pub struct Tail {
    pending: Option<Pending>,
}

struct Pending {
    done: Event,
    replay: Stream,
    caller: Stream,
    pool: GraphPool,
}

impl Tail {
    pub(crate) fn none() -> Tail {
        Tail { pending: None }
    }

    pub(crate) fn pending(done: Event, replay: &Stream, caller: &Stream, pool: &GraphPool) -> Tail {
        let p = Pending { done, replay: replay.clone(), caller: caller.clone(), pool: pool.clone() };
        Tail { pending: Some(p) }
    }

    /// Whether there is nothing to join (the replay was joined as a whole).
    pub fn is_empty(&self) -> bool {
        self.pending.is_none()
    }

    /// Makes `stream` wait for the whole replay, tail included.
    pub fn join(mut self, stream: &Stream) -> Result<()> {
        match self.pending.take() {
            Some(p) => p.join(stream),
            None => Ok(()),
        }
    }
}

/// The tails of one caller's replays, joined together: a tail replaces an earlier one of the same
/// replay stream (launches on one stream run in order, so the later tail's end covers the earlier
/// one's), and joining waits once per replay stream instead of once per replay.
///
/// ```no_run
/// # use graphed::graph::{Tails, Tail};
/// # fn step(replays: Vec<Tail>, main: &graphed::device::Stream) -> graphed::Result<()> {
/// let mut tails = Tails::new();
/// for tail in replays {
///     tails.push(tail);
/// }
/// tails.join(main)?; // before the optimizer, or anything else that reads what the tails wrote
/// # Ok(()) }
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

    /// Makes `stream` wait for every tail.
    pub fn join(self, stream: &Stream) -> Result<()> {
        self.latest.into_iter().try_for_each(|t| t.join(stream))
    }
}

impl Pending {
    fn join(self, stream: &Stream) -> Result<()> {
        self.replay.record(&self.done)?;
        stream.wait(&self.done)?;
        // The record covers every launch on the replay stream so far, the pool's last included.
        self.pool.ordered_after(None, &self.replay, stream);
        Ok(())
    }
}

impl Drop for Tail {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            let caller = p.caller.clone();
            if let Err(e) = p.join(&caller) {
                caller.device().record_drop_err("a graph tail (its join)", e);
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
    pub(crate) what: Arc<str>,
    pub(crate) writers: Arc<[GraphId]>,
}

/// An output or input gradient of a graphed call: a view of a static buffer in the graph pool.
/// The next replay of any graph of the pool that writes that memory (its own graph, or another
/// whose internals reuse it) overwrites it, and the tensor then refuses to be read instead of
/// giving stale data; copy it with [`to_owned`](StaticTensor::to_owned) to keep it.
#[derive(Clone)]
pub struct StaticTensor {
    tensor: Tensor,
    pool: GraphPool,
    /// The graphs that write its memory, and their launch counts when it was made.
    writers: Arc<[GraphId]>,
    made_at: Vec<u64>,
    what: Arc<str>,
}

impl StaticTensor {
    pub(crate) fn new(tensor: &Tensor, pool: &GraphPool, origin: &Origin) -> StaticTensor {
        let made_at = pool.launch_counts(&origin.writers);
        let (pool, writers, what) = (pool.clone(), origin.writers.clone(), origin.what.clone());
        StaticTensor { tensor: tensor.clone(), pool, writers, made_at, what }
    }

    /// The first writer launched since this tensor was made, with its launch count then and now.
    fn overwritten(&self) -> Option<(GraphId, u64, u64)> {
        let now = self.pool.launch_counts(&self.writers);
        self.writers
            .iter()
            .zip(self.made_at.iter().zip(now))
            .find(|(_, (a, b))| **a != *b)
            .map(|(g, (a, b))| (*g, *a, b))
    }

    /// The tensor, if no later replay has overwritten it.
    ///
    /// # Errors
    /// [`GraphedErrorKind::StaleOutput`] after a later replay of a graph that writes its memory.
    pub fn get(&self) -> Result<&Tensor> {
        match self.overwritten() {
            None => Ok(&self.tensor),
            Some((graph, made_by, now)) => Err(Error::Graphed {
                callable: self.what.split(':').next().unwrap_or_default().to_string(),
                kind: GraphedErrorKind::StaleOutput { what: self.what.to_string(), graph, made_by, now },
            }),
        }
    }

    /// Whether no later replay has overwritten it.
    pub fn is_fresh(&self) -> bool {
        self.overwritten().is_none()
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
        write!(f, "StaticTensor({}, {:?})", self.what, self.tensor.shape())
    }
}
