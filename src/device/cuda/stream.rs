//! Streams and events, and the verbs between them: record, wait, query, synchronize.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};

use super::capture;
use super::error as err;
use super::ffi;
use crate::device::{ErrorSlot, EventId, StreamId};
use crate::error::CaptureSite;
use crate::{Error, Result};

/// A stream: a non-blocking stream with a priority, or the legacy NULL stream.
pub(crate) struct CuStream {
    pub(super) id: StreamId,
    pub(super) raw: Arc<CudaStream>,
    /// The device's error slot, for what its drop and the graphs captured on it fail to destroy.
    pub(super) errors: Arc<ErrorSlot>,
}

impl CuStream {
    fn site(&self) -> CaptureSite {
        CaptureSite::Stream(self.id)
    }
}

impl Drop for CuStream {
    fn drop(&mut self) {
        capture::abandon(self);
    }
}

/// An event. Shared, so that a graph whose node records or waits on it can keep it alive.
pub(crate) struct CuEvent(pub(super) Arc<EventInner>);

pub(super) struct EventInner {
    pub(super) id: EventId,
    pub(super) raw: CudaEvent,
}

impl CuEvent {
    fn site(&self) -> CaptureSite {
        CaptureSite::Event(self.0.id)
    }
}

/// A new non-blocking stream; the driver clamps `priority` into the device's range.
pub(super) fn create(ctx: &Arc<CudaContext>, errors: &Arc<ErrorSlot>, id: StreamId, priority: i32) -> Result<CuStream> {
    let raw = ctx.new_stream_with_priority(priority).map_err(|e| err::driver("create_stream", None, e))?;
    Ok(CuStream { id, raw, errors: errors.clone() })
}

/// The legacy NULL stream, which CUDA refuses to capture.
pub(super) fn legacy(ctx: &Arc<CudaContext>, errors: &Arc<ErrorSlot>, id: StreamId) -> CuStream {
    CuStream { id, raw: ctx.default_stream(), errors: errors.clone() }
}

/// A new event; only `timing` events can measure elapsed time (the others record faster).
pub(super) fn create_event(ctx: &Arc<CudaContext>, id: EventId, timing: bool) -> Result<CuEvent> {
    let flags = if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
    let raw = ctx.new_event(Some(flags)).map_err(|e| err::driver("create_event", None, e))?;
    Ok(CuEvent(Arc::new(EventInner { id, raw })))
}

/// Records `event` on `stream`; an external record inside a capture becomes a node that holds the
/// event. The device's context must be bound.
pub(super) fn record(stream: &CuStream, event: &CuEvent, external: bool) -> Result<()> {
    if !external {
        return event.0.raw.record(&stream.raw).map_err(|e| err::at("record", stream.site(), e));
    }
    const OP: &str = "record_external";
    let capture = capture::active_id(&stream.raw).map_err(|e| err::at(OP, stream.site(), e))?;
    ffi::record_external(&event.0.raw, &stream.raw).map_err(|e| external_error(OP, stream, capture, e))?;
    if let Some(id) = capture {
        capture::hold_event(id, &event.0);
    }
    Ok(())
}

/// Makes `stream` wait on `event`'s latest record; an external wait inside a capture becomes a
/// node that holds the event. The device's context must be bound.
pub(super) fn wait(stream: &CuStream, event: &CuEvent, external: bool) -> Result<()> {
    let op = if external { "wait_external" } else { "wait" };
    // Only an external wait adds a node that names the event; a plain wait adds edges.
    let capture =
        if external { capture::active_id(&stream.raw).map_err(|e| err::at(op, stream.site(), e))? } else { None };
    ffi::wait(&stream.raw, &event.0.raw, external).map_err(|e| match external {
        true => external_error(op, stream, capture, e),
        false => ended_capture_error(op, stream.site(), e),
    })?;
    if let Some(id) = capture {
        capture::hold_event(id, &event.0);
    }
    Ok(())
}

/// The driver's refusal of an external record or wait: outside a capture the flag itself is
/// refused (CUDA_ERROR_ILLEGAL_STATE on the H200), which is the simulator's
/// [`CaptureErrorKind::ExternalOutsideCapture`](crate::CaptureErrorKind::ExternalOutsideCapture).
fn external_error(op: &'static str, stream: &CuStream, capture: Option<u64>, e: DriverError) -> Error {
    match capture {
        None => Error::Capture { op, on: stream.site(), kind: crate::CaptureErrorKind::ExternalOutsideCapture },
        Some(_) => err::at(op, stream.site(), e),
    }
}

/// The driver's error for a wait on, or a query or synchronize of, an event. Its handles are
/// valid and of one context (the device layer checks), so CUDA_ERROR_INVALID_VALUE means the
/// event's last record was made inside a capture that has ended (measured on the H200): the
/// simulator's [`CaptureErrorKind::RecordOfEndedCapture`](crate::CaptureErrorKind::RecordOfEndedCapture).
/// Telling it apart at record time would cost a driver call per record.
fn ended_capture_error(op: &'static str, on: CaptureSite, e: DriverError) -> Error {
    match e.0 == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
        true => Error::Capture { op, on, kind: crate::CaptureErrorKind::RecordOfEndedCapture },
        false => err::at(op, on, e),
    }
}

/// `cuStreamSynchronize`: refused on a capturing stream, in every capture mode.
pub(super) fn synchronize(op: &'static str, stream: &CuStream) -> Result<()> {
    stream.raw.synchronize().map_err(|e| err::at(op, stream.site(), e))
}

/// `cuStreamQuery`. The device's context must be bound.
pub(super) fn query(stream: &CuStream) -> Result<bool> {
    ffi::stream_query(&stream.raw).map_err(|e| err::at("Stream::query", stream.site(), e))
}

/// `cuEventQuery`: `Ok(false)` while the work before the latest record is pending.
pub(super) fn event_query(event: &CuEvent) -> Result<bool> {
    event.0.raw.try_is_complete().map_err(|e| ended_capture_error("Event::query", event.site(), e))
}

/// `cuEventSynchronize`.
pub(super) fn event_synchronize(event: &CuEvent) -> Result<()> {
    event.0.raw.synchronize().map_err(|e| ended_capture_error("Event::synchronize", event.site(), e))
}

/// `cuEventElapsedTime_v2` between two completed records. The device's context must be bound.
pub(super) fn elapsed_ms(start: &CuEvent, end: &CuEvent) -> Result<f32> {
    ffi::elapsed_ms(&start.0.raw, &end.0.raw).map_err(|e| err::at("Event::elapsed_ms", start.site(), e))
}
