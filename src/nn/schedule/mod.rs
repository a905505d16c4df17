//! Pipeline schedules: the order in which a rank runs the forward, backward and split
//! weight-gradient passes of its model chunks (virtual pipeline stages) over the microbatches of
//! a step, and the one traversal that runs them ([`run_schedule`]), eagerly or graphed.
//! `graph::make_graphed_callables` captures one graph per (layer, microbatch) in this order, so
//! that the graphs share one pool and replay in the order they were captured (R5).
//!
//! TransformerEngine's `_order` encoding is accepted ([`Schedule::from_te_order`]): `+k` is the
//! forward of chunk k (1-based) for that chunk's next microbatch, `-k` its backward, `-(k + 0.5)`
//! its weight-gradient pass for the microbatch whose backward ran last without one.

mod eager;
mod error;
mod order;
mod stage;
mod step;
#[cfg(test)]
mod tests;
mod walk;

pub use eager::EagerPasses;
pub use error::ScheduleErrorKind;
pub use order::{Schedule, Visit};
pub use stage::{Stage, StageLinks};
pub use step::Step;
pub use walk::{run_pipeline_stage, run_schedule, Handed, SchedulePasses};
