//! Opening a GPU without ever panicking: every missing piece is a typed error.
//!
//! cudarc loads libcuda and libnvrtc lazily and panics when one is missing, so their presence is
//! checked before the first driver call; then the device count, then the context.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::error as err;
use crate::{Error, Result};

/// The oldest compute capability graphed supports.
const MIN_CC: (i32, i32) = (7, 0);

/// A GPU's context, ready for graphed: cudarc's event tracking is off.
pub(super) struct Opened {
    pub(super) ctx: Arc<CudaContext>,
    /// Compute capability, `(major, minor)`.
    pub(super) cc: (i32, i32),
    pub(super) name: String,
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::CudaUnavailable { reason: reason.into() }
}

/// Opens GPU `ordinal`.
pub(super) fn open(ordinal: usize) -> Result<Opened> {
    // SAFETY: only tries to load the driver library under its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable("the CUDA driver library (libcuda.so) was not found"));
    }
    // SAFETY: only tries to load NVRTC under its usual names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(unavailable(
            "NVRTC (libnvrtc.so), which compiles graphed's kernels, was not found; install the CUDA toolkit's NVRTC or add it to LD_LIBRARY_PATH",
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| unavailable(format!("the CUDA driver failed to start ({})", err::describe(e))))?;
    let count = usize::try_from(count).unwrap_or(0);
    if count == 0 {
        return Err(unavailable("no CUDA GPU is visible"));
    }
    if ordinal >= count {
        return Err(unavailable(format!("GPU {ordinal} was asked for but only {count} GPU(s) are visible")));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| unavailable(format!("GPU {ordinal} could not be opened ({})", err::describe(e))))?;
    // SAFETY: cudarc's event tracking makes every use of a CudaSlice wait on events recorded
    // before, which breaks stream capture (CUDA_ERROR_STREAM_CAPTURE_ISOLATION). With it off, the
    // ordering of work across streams is the caller's, which is graphed's contract: it orders all
    // cross-stream work with its own events.
    unsafe { ctx.disable_event_tracking() };
    let name =
        ctx.name().map_err(|e| unavailable(format!("GPU {ordinal} could not be queried ({})", err::describe(e))))?;
    let cc = ctx
        .compute_capability()
        .map_err(|e| unavailable(format!("GPU {ordinal} could not be queried ({})", err::describe(e))))?;
    if cc < MIN_CC {
        return Err(unavailable(format!(
            "GPU {ordinal} ({name}) has compute capability {}.{}; graphed needs {}.{} or newer",
            cc.0, cc.1, MIN_CC.0, MIN_CC.1
        )));
    }
    Ok(Opened { ctx, cc, name })
}
