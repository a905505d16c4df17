//! Capture-time verification of a graph's sync event from the checker's access summary: the
//! event is recorded once (R2), every write the caller can observe comes before it (R2), the
//! tail touches only the graph's own pool memory outside the static surfaces (R3), and the graph
//! waits on no external event (R7).

use super::GraphedErrorKind;
use crate::check::Checker;
use crate::device::{AccessMode, Event, Graph};
use crate::memory::{CachingAllocator, GraphPool};
use crate::tensor::Tensor;

pub(crate) fn verify_sync_point(
    alloc: &CachingAllocator,
    pool: &GraphPool,
    graph: &Graph,
    event: &Event,
    surfaces: &[(String, &Tensor<f32>)],
) -> Result<(), GraphedErrorKind> {
    let point = Checker::of(graph.device())
        .and_then(|c| c.sync_point(graph.id(), event.id()))
        .ok_or(GraphedErrorKind::Unverifiable)?;
    let contract = |rule, detail| GraphedErrorKind::SyncContract { graph: graph.id(), rule, detail };
    if point.records != 1 {
        let detail = format!("event {} is recorded {} times inside the graph, not once", event.id(), point.records);
        return Err(contract("R2", detail));
    }
    if point.waits_external {
        let detail =
            "the graph waits on an external event, which the caller may only signal after resuming at the sync event"
                .into();
        return Err(contract("R7", detail));
    }
    for t in &point.tail {
        let a = &t.access;
        let hit = surfaces.iter().find(|(_, s)| {
            s.view().is_ok_and(|v| {
                let s = v.access(AccessMode::Read);
                s.memory == a.memory && s.at.overlaps(&a.at)
            })
        });
        match hit {
            Some((what, _)) if a.mode.writes() => {
                return Err(contract("R2", format!("{} writes {what} after the event", t.op)));
            }
            Some((what, _)) => {
                return Err(contract(
                    "R3",
                    format!("{} reads {what} after the event, while the caller may overwrite it", t.op),
                ));
            }
            None if !alloc.pool_holds(pool, a.memory) => {
                return Err(contract(
                    "R3",
                    format!("{} touches memory outside the graph's pool after the event (the caller's buffers)", t.op),
                ));
            }
            None => {}
        }
    }
    Ok(())
}
