//! Typed edges between graphs: a producer graph records an event inside its capture that a
//! consumer graph waits on inside its own, so the consumer may be replayed on another stream with
//! no host-side wait (Megatron-LM wires such events by hand; R7 refuses untyped external waits
//! of graphs replayed with a sync event).
//!
//! An edge is declared at capture ([`make_graphed_fn_with_edges`](super::make_graphed_fn_with_edges)):
//! the producer's record is its graph's last node, after every write of its capture stream and of
//! every stream joined into it (a capture cannot end with a stream unjoined), so the consumer
//! sees all of it. At launch the consumer is refused unless its producer was replayed since the
//! consumer's own last replay, so a consumer launched alone never waits on a stale record. Each
//! graph holds the edge, so its event lives as long as either graph.

use std::sync::{Arc, Mutex, PoisonError};

use super::error::GraphedErrorKind;
use crate::device::{Device, Event};
use crate::{Error, Result};

/// An edge from one producer graph to one consumer graph. Clones share it.
///
/// ```
/// use graphed::device::Device;
/// use graphed::graph::{make_graphed_fn_with_edges, Edges, GraphEdge};
/// use graphed::memory::CachingAllocator;
/// use graphed::ops::elementwise;
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let (a, b) = (dev.stream()?, dev.stream()?);
/// let alloc = CachingAllocator::new(&dev);
/// let x = Tensor::from_host(&alloc, &a, &[1.0f32, 2.0], &[2])?;
/// let y = Tensor::from_host(&alloc, &a, &[0.0f32, 0.0], &[2])?;
/// a.synchronize()?;
/// let edge = GraphEdge::new(&dev, "doubled")?;
/// let produce = Edges { signals: &[&edge], ..Edges::default() };
/// let double = make_graphed_fn_with_edges(&alloc, produce, |s| elementwise::scale(x.view::<f32>()?, x.view()?, 2.0, s))?;
/// let consume = Edges { waits_on: &[&edge], ..Edges::default() };
/// let copy = make_graphed_fn_with_edges(&alloc, consume, |s| elementwise::scale(y.view::<f32>()?, x.view()?, 1.0, s))?;
/// double.replay(&a)?;
/// copy.replay(&b)?; // on another stream: the edge orders it after `double`
/// assert_eq!(y.to_vec::<f32>(&b)?, vec![2.0, 4.0]);
/// assert!(copy.replay(&b).is_err()); // no new producer replay: refused
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone)]
pub struct GraphEdge {
    inner: Arc<EdgeInner>,
}

struct EdgeInner {
    name: String,
    event: Event,
    state: Mutex<EdgeState>,
}

#[derive(Default)]
struct EdgeState {
    /// Whether a graph records it, and one waits on it.
    producer: bool,
    consumer: bool,
    /// Producer replays so far, and how many of them the consumer's replays have seen.
    produced: u64,
    consumed: u64,
}

/// Which end of an edge a graph holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum End {
    Producer,
    Consumer,
}

impl GraphEdge {
    /// A new edge on `dev`, named for errors and reports.
    ///
    /// # Errors
    /// Device errors (making its event).
    pub fn new(dev: &Device, name: &str) -> Result<GraphEdge> {
        let inner = EdgeInner { name: name.to_string(), event: dev.event()?, state: Mutex::default() };
        Ok(GraphEdge { inner: Arc::new(inner) })
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub(crate) fn event(&self) -> &Event {
        &self.inner.event
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EdgeState> {
        self.inner.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn taken(&self, why: &'static str) -> GraphedErrorKind {
        GraphedErrorKind::EdgeTaken { edge: self.inner.name.clone(), why }
    }

    /// Refuses `end` where another graph holds it.
    pub(crate) fn check_free(&self, end: End) -> std::result::Result<(), GraphedErrorKind> {
        let st = self.lock();
        match end {
            End::Producer if st.producer => Err(self.taken("has a producer already; make one edge per producer")),
            End::Consumer if st.consumer => Err(self.taken("has a consumer already; make one edge per consumer")),
            _ => Ok(()),
        }
    }

    /// Takes `end` for a graph whose capture succeeded.
    pub(crate) fn claim(&self, end: End) {
        let mut st = self.lock();
        match end {
            End::Producer => st.producer = true,
            End::Consumer => st.consumer = true,
        }
    }

    /// Refuses a consumer's replay unless the producer replayed since its last one.
    pub(crate) fn check_produced(&self) -> std::result::Result<(), GraphedErrorKind> {
        let st = self.lock();
        if st.produced > st.consumed {
            Ok(())
        } else {
            Err(GraphedErrorKind::EdgeNotProduced { edge: self.inner.name.clone() })
        }
    }

    /// Counts a launched replay of the graph holding `end`.
    pub(crate) fn launched(&self, end: End) {
        let mut st = self.lock();
        match end {
            End::Producer => st.produced += 1,
            End::Consumer => st.consumed = st.produced,
        }
    }

    /// Whether `self` and `other` are one edge.
    pub(crate) fn same(&self, other: &GraphEdge) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// `Error::Graphed` for `graph`, of `kind`.
    pub(crate) fn error(graph: &str, kind: GraphedErrorKind) -> Error {
        Error::Graphed { callable: graph.to_string(), kind }
    }
}

impl std::fmt::Debug for GraphEdge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphEdge({})", self.inner.name)
    }
}

/// The edges a graph's capture takes part in: those it waits on at its start (it consumes them)
/// and those it records at its end (it produces them).
#[derive(Default, Clone, Copy)]
pub struct Edges<'a> {
    /// Edges whose producers' work this graph reads.
    pub waits_on: &'a [&'a GraphEdge],
    /// Edges whose consumers read this graph's work.
    pub signals: &'a [&'a GraphEdge],
}
