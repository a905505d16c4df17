//! NVTX ranges (cudarc's `nvtx` bindings, loaded at run time like the driver), for
//! [`Device::range`](crate::device::Device::range).
//!
//! cudarc looks for `libnvToolsExt.so` (or `.so.1`, as PyTorch's `nvidia-nvtx` package ships it)
//! and panics when it or one of its symbols is missing, so the library and both symbols we call
//! are probed once per process first; without them, ranges skip NVTX.

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::nvtx::sys;

/// The symbols [`push`] and [`pop`] call, which cudarc resolves on first use.
const SYMBOLS: [&[u8]; 2] = [b"nvtxRangePushA", b"nvtxRangePop"];

/// Whether NVTX's library and the symbols we call can be loaded: probed on the first call.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // SAFETY: only tries to load the library under cudarc's names; no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            tracing::debug!("libnvToolsExt was not found: profiler ranges stay out of NVTX");
            return false;
        }
        // SAFETY: the probe above found the library, so cudarc's loader finds it too (it
        // panics only when it does not); looking symbols up calls nothing.
        let lib = unsafe { sys::culib() };
        // SAFETY: as above, a lookup; the type is the one cudarc casts the symbol to.
        SYMBOLS.iter().all(|s| unsafe { lib.get::<unsafe extern "C" fn()>(*s) }.is_ok())
    })
}

/// Pushes a range named `name` on this thread's NVTX stack. Only after [`available`].
pub(crate) fn push(name: &CStr) {
    // SAFETY: the library and symbol were found by `available`; `name` is NUL-terminated and
    // outlives the call (NVTX copies it). The returned depth is not needed.
    unsafe { sys::nvtxRangePushA(name.as_ptr()) };
}

/// Pops this thread's innermost NVTX range. Only after a [`push`] on this thread.
pub(crate) fn pop() {
    // SAFETY: the library and symbol were found by `available`. Popping an empty stack is
    // reported by NVTX's return value, not undefined.
    unsafe { sys::nvtxRangePop() };
}

#[cfg(test)]
mod tests {
    #[test]
    fn probing_never_panics_and_gives_one_answer() {
        // Without the library (CI) this is false, with it true; either way the same twice.
        assert_eq!(super::available(), super::available());
    }
}
