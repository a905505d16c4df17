//! Events: markers in a stream that other streams and the host can wait on.

use std::sync::Arc;

use super::backend::{dispatch, EventRepr};
use super::{Device, EventId};
use crate::Result;

/// An event of one device. Cloning yields the same event.
///
/// A wait binds to the event's latest record *at the time of the wait call*; a later record does
/// not move an earlier wait. A wait on an event that was never recorded does nothing.
#[derive(Clone)]
pub struct Event {
    inner: Arc<EventInner>,
}

struct EventInner {
    dev: Device,
    id: EventId,
    repr: EventRepr,
}

impl Event {
    pub(crate) fn new(dev: Device, id: EventId, repr: EventRepr) -> Event {
        Event { inner: Arc::new(EventInner { dev, id, repr }) }
    }

    /// The event's identity (as reported by [`Graph::external_record_events`](super::Graph::external_record_events)).
    pub fn id(&self) -> EventId {
        self.inner.id
    }

    /// The device the event belongs to.
    pub fn device(&self) -> &Device {
        &self.inner.dev
    }

    pub(crate) fn repr(&self) -> &EventRepr {
        &self.inner.repr
    }

    /// Whether the work before the latest record has completed (true if never recorded).
    ///
    /// # Errors
    /// `CaptureErrorKind::CapturedEvent` if the latest record was made inside a capture.
    pub fn query(&self) -> Result<bool> {
        let done = dispatch!(self.inner.dev.backend(), |b, pick| b.event_query(pick!(self.inner.repr)))?;
        if done {
            self.host_saw();
        }
        Ok(done)
    }

    /// Whether the latest record has completed, without telling the checker that the host saw
    /// it: for the watchdog's report, which must not order anything the program did not.
    pub(crate) fn completed(&self) -> Result<bool> {
        dispatch!(self.inner.dev.backend(), |b, pick| b.event_query(pick!(self.inner.repr)))
    }

    fn host_saw(&self) {
        if let Some(o) = self.inner.dev.observer() {
            o.host_sync(super::observe::HostSync::Event(self.inner.id));
        }
    }

    /// GPU milliseconds from this event's latest record to `end`'s; both must be timing events
    /// ([`Device::timing_event`]) whose records have completed.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.inner.dev.check_same("Event::elapsed_ms", "event", end.device().id())?;
        dispatch!(self.inner.dev.backend(), |b, pick| b.elapsed_ms(pick!(self.inner.repr), pick!(end.repr())))
    }

    /// Blocks the host until the work before the latest record has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.dev.check_err()?;
        dispatch!(self.inner.dev.backend(), |b, pick| b.event_synchronize(pick!(self.inner.repr)))?;
        self.host_saw();
        Ok(())
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event({})", self.inner.id)
    }
}
