//! Stream capture: modes, status, and the guard that always ends a capture.

use super::{Graph, Stream};
use crate::{Error, Result};

/// Which synchronous calls a capture forbids (CUDA's `CUstreamCaptureMode`).
///
/// "Synchronous calls" are: synchronizing or querying the device, a stream or an event,
/// blocking copies, and plain allocation. Synchronizing or querying a capturing stream is
/// forbidden in every mode. (Module loading is allowed: CUDA 13.0 allows it.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CaptureMode {
    /// Forbidden on every thread while the capture is active.
    Global,
    /// Forbidden on the capturing thread (the default, as in PyTorch and graphed's captures).
    #[default]
    ThreadLocal,
    /// Not forbidden. Needed to grow a memory pool during capture.
    Relaxed,
}

/// The capture state of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureStatus {
    /// Not capturing.
    None,
    /// Capturing, valid so far.
    Active,
    /// Capturing, but invalidated by an error: `end_capture` will fail.
    Invalidated,
}

/// A capture in progress. [`Capture::finish`] returns the graph; dropping the guard without
/// finishing ends the capture and discards what was captured, so an error inside the captured
/// region never leaves a stream capturing.
#[must_use = "a capture ends when its guard is dropped; call finish() to keep the graph"]
pub struct Capture<'s> {
    stream: &'s Stream,
    done: bool,
}

impl<'s> Capture<'s> {
    pub(crate) fn new(stream: &'s Stream) -> Capture<'s> {
        Capture { stream, done: false }
    }

    /// The capturing stream.
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }

    /// Ends the capture and returns the graph.
    pub fn finish(mut self) -> Result<Graph> {
        self.done = true;
        self.stream.end_capture()
    }
}

impl Drop for Capture<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // The capture is abandoned, usually because of an error the caller is propagating. The
        // graph is discarded, and so are errors that only describe it: a capture rule it broke
        // (it is typically invalidated or unjoined), memory nodes, a race found in it. Anything
        // else, such as a driver failure, is kept for the device's next call.
        match self.stream.end_capture() {
            Ok(_) | Err(Error::Capture { .. } | Error::MemoryNodes { .. } | Error::Hazard(_)) => {}
            Err(e) => self.stream.device().record_drop_err("a capture guard", e),
        }
    }
}
