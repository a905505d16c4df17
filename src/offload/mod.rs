//! Layer 7, activation offloading: Megatron-LM's fine-grained offloading, eager and captured
//! inside the graphs of [`graph`](crate::graph), through the [`SaveHook`](crate::nn::SaveHook)
//! that modules call at named sites.
//!
//! - [`OffloadManager`] owns a copy-out and a copy-back stream, pinned host buffers pooled by
//!   size and type (each with the events of its last copies), and one [`ChunkHook`] per chunk
//!   (a microbatch of a pipeline stage).
//! - The first iteration through the chunk hooks records what every module saves, then the
//!   manager decides what to offload ([`Policy`], [`OffloadConfig`]) and freezes it
//!   ([`Summary`] prints it). For graphs that iteration is the first of the capture's warmup,
//!   layer by layer ([`OffloadManager::graph_options`]), and the automatic policy decides after
//!   the warmup from each layer's graphs replayed in a probe ([`Windows::Graphs`]); eagerly, it
//!   is the first one a caller runs, ended by [`OffloadManager::end_iteration`], which times it
//!   for the automatic policy ([`Windows::Eager`]).
//! - Eagerly, a group's copy out starts at its commit; inside graphs, when the next unit's
//!   capture begins, so that it overlaps the next layer's compute. The copies join the capture
//!   stream after the sync event: they are the graph's tail, which a side-stream replay lets
//!   the caller run ahead of ([`OffloadManager::graph_options`]). `chunk.rs` has the protocol
//!   and the hazards of `notes/offload.md` §3.6 it handles.

mod chunk;
mod config;
mod copy_probe;
mod error;
mod host;
mod manager;
mod policy;
mod saving;
mod shared;
mod state;
mod switch;
mod table;

pub use chunk::ChunkHook;
pub use config::{OffloadConfig, Policy, AUTO_CANDIDATES, DEFAULT_SITES};
pub use error::OffloadErrorKind;
pub use manager::{OffloadManager, OffloadStats, Resident};
pub use policy::{decide, GroupLayout, Summary, SummaryRow, TensorLayout, Timings, Windows};
pub use state::Fault;
