//! Layer 6, graphed callables: the Rust counterpart of TransformerEngine's
//! `make_graphed_callables`, with side-stream replay synced by an event recorded inside the graph.
//!
//! [`make_graphed_stack`] captures the layers of an [`nn::Stack`](crate::nn::Stack) as one
//! [`GraphedStack`] whose layers feed each other through static buffers;
//! [`make_graphed_schedule`] captures layers under a pipeline schedule as one
//! [`GraphedSchedule`] (a graph per layer and microbatch, run in the schedule's order);
//! [`make_graphed_callables`] captures independent modules (the per-layer escape hatch, with
//! named inputs); [`make_graphed_fn`] captures any other work (the optimizer step). Each warms
//! its modules up, captures their forward and backward (and split weight-gradient pass) into
//! graphs of one [`GraphPool`](crate::memory::GraphPool), and replays them over static buffers
//! under the replay contract of `docs/design.md`:
//!
//! - R1: the replay stream waits for the caller's stream (copies into static inputs included);
//! - R2: with [`Replay::Side`] the caller waits only for the sync event, which capture
//!   verified is recorded once, after every write the caller can observe;
//! - R3: the work after the event (the tail) touches only pool memory outside the static
//!   surfaces, verified at capture from the checker's access summary;
//! - R4: the [`Tail`] joins the tail, explicitly or on drop; `release_static_state` waits for
//!   the device;
//! - R5: replays follow the pool's capture order, checked at every launch;
//! - R6: the caller's wait is issued right after the launch that records the event;
//! - R7: a graph with external waits cannot be replayed with a sync event;
//! - R8: the backward replays as its forward did, unless told otherwise;
//! - R9: graphs are pure in the step counter, so warmup and capture leave the RNG as it was;
//! - outputs are [`StaticTensor`]s that refuse to be read after a later replay overwrote them.

mod build;
mod callable;
mod capture;
mod edge;
mod error;
mod grad_sync;
mod graphed;
mod graphed_fn;
mod in_place;
mod lend;
mod options;
mod output;
mod plan;
mod probe;
mod record;
mod replay;
mod scheduled;
mod stack;
mod verify;
mod warmup;

pub use callable::{Callable, Saved};
pub use capture::{make_graphed_callables, make_graphed_stack};
pub use edge::{Edges, GraphEdge};
pub use error::GraphedErrorKind;
pub use grad_sync::GradSync;
pub use graphed::{static_bytes, CallableReport, CaptureTimes, GraphReport, GraphedCallable, Pass, TailOp};
pub use graphed_fn::{make_graphed_fn, make_graphed_fn_with_edges, GraphedFn};
pub use options::{GraphOptions, Mode, Phase};
pub(crate) use probe::{PassTimes, Probe, ProbeCopies, PROBE_REPLAYS};
pub use replay::{Replay, StaticTensor, Tail, Tails};
pub use scheduled::{make_graphed_schedule, GraphedPasses, GraphedSchedule};
pub use stack::GraphedStack;
