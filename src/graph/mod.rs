//! Layer 6, graphed callables: the Rust counterpart of TransformerEngine's
//! `make_graphed_callables`, with side-stream replay synced by an event recorded inside the graph.
//!
//! [`make_graphed_callables`] warms each [`Callable`] up, captures its forward and backward (and
//! split weight-gradient pass) into graphs of one [`GraphPool`](crate::memory::GraphPool), and
//! returns [`GraphedCallable`]s that replay them over static buffers under the replay contract
//! of `DESIGN.md`:
//!
//! - R1: the replay stream waits for the caller's stream (copies into static inputs included);
//! - R2: with [`Replay::ResumeAt`] the caller waits only for the sync event, which capture
//!   verified is recorded once, after every write the caller can observe;
//! - R3: the work after the event (the tail) touches only pool memory outside the static
//!   surfaces, verified at capture from the checker's access summary;
//! - R4: the [`Tail`] joins the tail, explicitly or on drop; `reset` waits for the device;
//! - R5: replays follow the pool's capture order, checked at every launch;
//! - R6: the caller's wait is issued right after the launch that records the event;
//! - R7: a graph with external waits cannot be replayed with a sync event;
//! - R8: the backward replays as its forward did, unless told otherwise;
//! - R9: graphs are pure in the step counter, so warmup and capture leave the RNG as it was;
//! - outputs are [`StaticTensor`]s that refuse to be read after a later replay overwrote them.

mod callable;
mod capture;
mod error;
mod graphed;
mod options;
mod replay;
mod verify;

pub use callable::{Callable, Input, Inputs, Saved};
pub use capture::make_graphed_callables;
pub use error::GraphedErrorKind;
pub use graphed::{CallableReport, GraphReport, GraphedCallable, Pass};
pub use options::{GraphOptions, Mode, Phase};
pub use replay::{Replay, StaticTensor, Tail, Tails};
