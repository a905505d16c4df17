//! Capture-time verification of a graph's sync event from the checker's access summary: the
//! event is recorded once (R2), every write the caller can observe comes before it (R2), the
//! tail touches only pool memory outside the static surfaces the caller may use meanwhile, and
//! the memory the save hook declares as its tail's (host buffers of offload copies) and the
//! gradients lent to the pool that the graph may use (R3), and the graph waits on no external
//! event (R7).
//!
//! Pool memory is reused across the pool's graphs: a block that one graph uses internally can
//! be another graph's output. The tail may touch such a block when a graph between the owner and
//! this one in the pool's cyclic order (this one included) writes it: the owner's output is then
//! stale whenever this graph runs, a [`StaticTensor`](super::StaticTensor) of it refuses to be
//! read, and the owner rewrites it only after this graph and its tail (R5).

use super::GraphedErrorKind;
use crate::check::Checker;
use crate::device::{Access, AccessMode, BufferId, Event, EventId, Graph, GraphId};
use crate::memory::{CachingAllocator, GraphPool};
use crate::tensor::Tensor;

/// A static surface: what it is, its tensor, and the graph that produces it (`None` for memory
/// the caller writes: static inputs and output gradients, parameters and their gradients).
pub(crate) struct Surface<'a> {
    pub(crate) what: String,
    pub(crate) tensor: &'a Tensor,
    pub(crate) owner: Option<GraphId>,
    /// A parameter's gradient: no surface where the graph may use it as lent pool memory.
    pub(crate) gradient: bool,
}

/// Memory outside the pool's segments that a graph's tail may touch: the save hook's (host
/// buffers of offload copies), and gradients lent to the pool that the graph may allocate from
/// (Note [Lent gradients] in `lend.rs`), each an allocation and a byte range there.
#[derive(Clone, Copy)]
pub(crate) struct TailMemory<'a> {
    pub(crate) hook: &'a [BufferId],
    pub(crate) lent: &'a [(BufferId, std::ops::Range<usize>)],
}

impl TailMemory<'_> {
    /// Whether `a` lies inside lent memory.
    fn lent(&self, a: &Access) -> bool {
        let (start, end) = a.byte_hull();
        self.lent.iter().any(|(memory, r)| *memory == a.memory && r.start <= start && end <= r.end)
    }
}

pub(crate) fn verify_sync_point(
    alloc: &CachingAllocator,
    pool: &GraphPool,
    graph: &Graph,
    event: &Event,
    surfaces: &[Surface<'_>],
    tail_memory: TailMemory<'_>,
    edge_events: &[EventId],
) -> Result<(), GraphedErrorKind> {
    let checker = Checker::of(graph.device()).ok_or(GraphedErrorKind::Unverifiable)?;
    let point = checker.sync_point(graph.id(), event.id()).ok_or(GraphedErrorKind::Unverifiable)?;
    let contract = |rule, detail| GraphedErrorKind::SyncContract { graph: graph.id(), rule, detail };
    if point.records != 1 {
        let detail = format!("event {} is recorded {} times inside the graph, not once", event.id(), point.records);
        return Err(contract("R2", detail));
    }
    // A typed edge's wait is exempt: its producer is launched before it (checked at every
    // replay), so its record is enqueued before the caller resumes.
    if point.external_waits.iter().any(|e| !edge_events.contains(e)) {
        let detail =
            "the graph waits on an external event, which the caller may only signal after resuming at the sync event"
                .into();
        return Err(contract("R7", detail));
    }
    // The surfaces the tail must not touch: all but another graph's outputs that are stale
    // whenever this graph runs (see the module docs).
    let order = pool.order();
    let mut guarded = Vec::with_capacity(surfaces.len());
    for s in surfaces {
        let Ok(at) = s.tensor.access(AccessMode::Read) else { continue };
        let stale =
            s.owner.is_some_and(|o| o != graph.id() && overwritten_before(&checker, &order, o, graph.id(), &at));
        if !stale {
            guarded.push((s, at));
        }
    }
    let pool_memory = alloc.pool_segments(pool);
    for t in &point.tail {
        let a = &t.access;
        let lent = tail_memory.lent(a);
        let hit = guarded.iter().find(|(s, at)| at.overlaps(a) && !(lent && s.gradient)).map(|(s, _)| s);
        match hit {
            Some(s) if a.mode.writes() => {
                return Err(contract("R2", format!("{} writes {} after the event", t.op, s.what)));
            }
            Some(s) => {
                return Err(contract(
                    "R3",
                    format!("{} reads {} after the event, while the caller may overwrite it", t.op, s.what),
                ));
            }
            None if !pool_memory.contains(&a.memory) && !tail_memory.hook.contains(&a.memory) && !lent => {
                return Err(contract(
                    "R3",
                    format!(
                        "{} touches memory outside the graph's pool and the save hook's tail memory after the event \
                         (the caller's buffers)",
                        t.op
                    ),
                ));
            }
            None => {}
        }
    }
    Ok(())
}

/// Whether a graph of the pool's cyclic `order` after `owner` and up to `graph` (included) writes
/// `at`: then `owner`'s output there is stale whenever `graph` runs, and nobody may read it
/// until `owner` runs again, after `graph` and its tail.
fn overwritten_before(checker: &Checker, order: &[GraphId], owner: GraphId, graph: GraphId, at: &Access) -> bool {
    let (Some(o), Some(g)) = (order.iter().position(|x| *x == owner), order.iter().position(|x| *x == graph)) else {
        return checker.graph_writes(graph, at).unwrap_or(false);
    };
    let n = order.len();
    let between = (1..=(g + n - o) % n).map(|k| order[(o + k) % n]);
    between.into_iter().any(|w| checker.graph_writes(w, at).unwrap_or(false))
}
