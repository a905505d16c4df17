//! Loading cuDNN and its handle: the library is probed before any call (cudarc panics on a
//! missing library or symbol), its version checked, and one handle made per device, bound to the
//! stream of each call.

use std::ffi::{c_char, CStr};
use std::ptr::null_mut;

use cudarc::cudnn::sys;

use crate::{Error, Result};

/// The oldest cuDNN whose engines we use: from 9.6 cuDNN zeroes the backward's dQ accumulator
/// itself, and 9.10.0/9.10.1 disabled fused attention (notes/attention.md §2.9).
const MIN_VERSION: usize = 90600;

/// The operation named in cuDNN errors.
pub(super) const OP: &str = "attention (cuDNN)";

/// Whether `libcudnn` can be loaded, and its version is one we use; the reason if not.
pub(super) fn probe() -> std::result::Result<usize, String> {
    // SAFETY: only asks whether the library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcudnn.so.9 could not be loaded; install cuDNN 9 or add it to LD_LIBRARY_PATH".into());
    }
    // SAFETY: the library is present; cudnnGetVersion takes no arguments.
    let version = unsafe { sys::cudnnGetVersion() };
    if version < MIN_VERSION || (91000..=91001).contains(&version) {
        return Err(format!(
            "cuDNN {version} is loaded; fused attention needs cuDNN 9.6 or newer, not 9.10.0 or 9.10.1"
        ));
    }
    Ok(version)
}

/// `Ok` for success, else [`Error::Cudnn`] naming `call`, with cuDNN's status and last message.
pub(super) fn check(call: &'static str, status: sys::cudnnStatus_t) -> Result<()> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    Err(Error::Cudnn { op: OP, call, message: format!("{status:?}{}", last_error()) })
}

/// cuDNN's last error message on this thread, as ": message", or nothing.
fn last_error() -> String {
    let mut buf = [0 as c_char; 512];
    // SAFETY: the buffer holds `buf.len()` bytes; cuDNN writes a NUL-terminated string into it.
    unsafe { sys::cudnnGetLastErrorString(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated above (the buffer starts zeroed, and cuDNN terminates what it writes).
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    if text.is_empty() {
        String::new()
    } else {
        format!(": {text}")
    }
}

/// A cuDNN handle, made on the device's context, destroyed with the device.
pub(super) struct Handle(pub(super) sys::cudnnHandle_t);

// SAFETY: a cuDNN handle may be used from any thread, one at a time; graphed serializes its use
// with the `Cudnn` lock.
unsafe impl Send for Handle {}

impl Handle {
    /// A handle on the current context (the caller bound it); the library was probed.
    pub(super) fn new() -> Result<Handle> {
        let mut raw = null_mut();
        // SAFETY: `raw` receives the new handle.
        check("cudnnCreate", unsafe { sys::cudnnCreate(&mut raw) })?;
        Ok(Handle(raw))
    }

    /// Makes the handle's work go to `stream`.
    pub(super) fn bind(&self, stream: sys::cudaStream_t) -> Result<()> {
        // SAFETY: the handle is live; the stream is live for the call that follows.
        check("cudnnSetStream", unsafe { sys::cudnnSetStream(self.0, stream) })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle was made by `cudnnCreate` and is destroyed once.
        if let Err(e) = check("cudnnDestroy", unsafe { sys::cudnnDestroy(self.0) }) {
            // Dropped with its device: no call of the device remains to return the error.
            tracing::warn!("graphed: destroying the cuDNN handle failed: {e}");
        }
    }
}
