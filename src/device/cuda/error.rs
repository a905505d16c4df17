//! The one place where driver result codes become graphed errors.
//!
//! Capture-rule codes become [`Error::Capture`] with the same [`CaptureErrorKind`] the simulator
//! reports, so code and tests can match on the rule whatever the backend. Every other code becomes
//! [`Error::Cuda`] with the driver's name and description. Like CUDA itself, a code may belong to
//! an earlier asynchronous call than the one that returns it; it is reported as is.

use cudarc::driver::{sys::CUresult, DriverError};
use cudarc::nvrtc::result::NvrtcError;

use crate::error::{CaptureErrorKind, CaptureSite};
use crate::Error;

/// The capture rule a driver code reports, if it is one.
///
/// `CUDA_ERROR_ILLEGAL_STATE` is not here: it means "already capturing" only as the answer to
/// `begin_capture`, which maps it itself.
pub(super) fn capture_kind(code: CUresult) -> Option<CaptureErrorKind> {
    Some(match code {
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => CaptureErrorKind::Unsupported,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => CaptureErrorKind::Invalidated,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE => CaptureErrorKind::Merge,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED => CaptureErrorKind::Unmatched,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED => CaptureErrorKind::Unjoined,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION => CaptureErrorKind::Isolation,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => CaptureErrorKind::WrongThread,
        CUresult::CUDA_ERROR_CAPTURED_EVENT => CaptureErrorKind::CapturedEvent,
        _ => return None,
    })
}

/// The error for a failed driver call of `op` made on `on`.
///
/// A capture code with no site to name (possible only for a capture graphed did not begin) falls
/// back to [`Error::Cuda`], which still carries the code's name.
pub(super) fn driver(op: &'static str, on: Option<CaptureSite>, e: DriverError) -> Error {
    match (capture_kind(e.0), on) {
        (Some(kind), Some(on)) => Error::Capture { op, on, kind },
        _ => Error::Cuda { op, message: describe(e) },
    }
}

/// [`driver`] for a call made on a stream or an event: the common case.
pub(super) fn at(op: &'static str, on: CaptureSite, e: DriverError) -> Error {
    driver(op, Some(on), e)
}

/// An NVRTC failure other than a compile error (which is [`Error::Compile`] with the log).
pub(super) fn nvrtc(op: &'static str, e: NvrtcError) -> Error {
    Error::Cuda { op, message: format!("NVRTC returned {:?}", e.0) }
}

/// "CUDA_ERROR_X: description", from the driver; the bare code if the driver cannot name it.
pub(super) fn describe(e: DriverError) -> String {
    match (e.error_name(), e.error_string()) {
        (Ok(name), Ok(text)) => format!("{}: {}", name.to_string_lossy(), text.to_string_lossy()),
        _ => format!("{:?}", e.0),
    }
}
