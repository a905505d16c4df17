//! The hook through which the stream-safety checker (layer 2) sees what the device does.
//!
//! Every verb of the public API reports to the device's observer, if it has one, after the
//! backend accepted the call: enqueued operations with their declared accesses, event records
//! and waits, captures, graph launches, host synchronization and host accesses. An observer in
//! strict mode turns a hazard into the call's error.

use super::{Access, EventId, GraphId, StreamId};
use crate::Result;

/// What the host waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostSync {
    Stream(StreamId),
    Event(EventId),
    Device,
}

/// Receives the device's activity. `capture` is the id of the capture the stream takes part in.
pub(crate) trait Observer: Send + Sync {
    /// For `Checker::of`, which finds the checker behind a device.
    fn as_any(&self) -> &dyn std::any::Any;
    /// Whether enqueued work should be reported now (false lets eager work skip the capture
    /// query when only captures are watched and none is in progress).
    fn watching(&self) -> bool;
    fn enqueue(&self, stream: StreamId, capture: Option<u64>, op: &'static str, accesses: &[Access]) -> Result<()>;
    fn record(&self, stream: StreamId, capture: Option<u64>, event: EventId, external: bool) -> Result<()>;
    /// `at`: the caller's source location of the wait.
    fn wait(
        &self,
        stream: StreamId,
        capture: Option<u64>,
        event: EventId,
        external: bool,
        at: Option<&str>,
    ) -> Result<()>;
    fn begin_capture(&self, stream: StreamId, capture: u64);
    fn end_capture(&self, capture: u64, graph: Option<GraphId>) -> Result<()>;
    /// A launch of executable `exec` (launches of one executable run in order) of `graph`.
    fn launch(&self, graph: GraphId, exec: u64, stream: StreamId) -> Result<()>;
    /// Executable `exec` of `graph` was destroyed.
    fn reset(&self, graph: GraphId, exec: u64) -> Result<()>;
    /// Executable `exec` of `graph` now reads through `remaps` (all of its rebound ranges; none
    /// puts it back as captured).
    fn rebind(&self, graph: GraphId, exec: u64, remaps: &[super::patch::Remap]) -> Result<()>;
    /// Executable `exec` of `graph` (of `sites` captured operations) now runs without the nodes
    /// of the sites in `disabled` (all of them; none puts it back as captured).
    fn set_enabled(&self, graph: GraphId, exec: u64, sites: usize, disabled: &[usize]) -> Result<()>;
    fn host_sync(&self, what: HostSync);
    /// The host reads or writes memory now, after the work queued on `after` (blocking copies)
    /// or with no ordering (pinned host memory).
    fn host_access(&self, op: &'static str, after: Option<StreamId>, accesses: &[Access]) -> Result<()>;
}
