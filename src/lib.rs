//! # graphed
//!
//! Capture neural-network training steps, forward and backward of each layer, into CUDA graphs
//! and replay them, with a CPU simulator of CUDA's stream, event and graph semantics so that
//! everything runs and is tested without a GPU.
//!
//! The crate is built in layers (see `DESIGN.md`); each uses only the ones before it:
//!
//! 1. [`device`]: devices (CUDA or simulator), streams, events, memory, kernels, capture, graphs.
//! 2. [`check`]: the stream-safety checker, happens-before over declared accesses.
//! 3. [`memory`]: a caching allocator with stream-ordered reuse and graph pools.
//! 4. [`tensor`] and [`ops`]: kernels with a CPU path and a CUDA path side by side.
//! 5. [`nn`]: modules with explicit forward and backward (the unit of graph capture), stacks of
//!    them and their one traversal; [`optim`]: optimizers with their state on the device.
//! 6. [`graph`]: `make_graphed_stack` and `make_graphed_callables`, replay on any stream under the
//!    replay contract.
//!
//! ```
//! use graphed::device::{CaptureMode, Device};
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let x = dev.alloc_from(&s, &[1.0f32; 4])?;
//! let cap = s.capture(CaptureMode::ThreadLocal)?;
//! s.memset(&x, 0)?;                       // recorded, not run
//! let exec = cap.finish()?.instantiate()?;
//! assert_eq!(x.to_vec(&s)?, vec![1.0; 4]);
//! exec.launch(&s)?;                       // replayed
//! assert_eq!(x.to_vec(&s)?, vec![0.0; 4]);
//! # Ok::<(), graphed::Error>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod check;
pub mod device;
mod error;
pub mod graph;
pub mod memory;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod tensor;

pub use error::{CaptureErrorKind, CaptureSite, Error, Result};
