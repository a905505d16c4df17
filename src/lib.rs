//! # graphed
//!
//! Capture neural-network training steps, forward and backward of each layer, into CUDA graphs
//! and replay them, with a CPU simulator of CUDA's stream, event and graph semantics so that
//! everything runs and is tested without a GPU.
//!
//! The crate is built in layers (see `docs/design.md`); each uses only the ones before it:
//!
//! 1. [`device`]: devices (CUDA or simulator), streams, events, memory, kernels, capture, graphs,
//!    and named profiler ranges (NVTX on CUDA, a log on both) that the layers above open.
//! 2. [`check`]: the stream-safety checker, happens-before over declared accesses.
//! 3. [`memory`]: a caching allocator with stream-ordered reuse and graph pools.
//! 4. [`tensor`] and [`ops`]: kernels with a CPU path and a CUDA path side by side.
//! 5. [`nn`]: modules with explicit forward and backward (the unit of graph capture), stacks of
//!    them and their one traversal; [`optim`]: optimizers with their state on the device.
//! 6. [`graph`]: `make_graphed_stack` and `make_graphed_callables`, replay on any stream under the
//!    replay contract.
//! 7. [`offload`]: activation offloading, eagerly and captured inside the graphs; [`dist`] beside
//!    it: process groups, data parallelism and pipeline links over the device's collectives;
//!    [`checkpoint`]: a training run's state saved and resumed, every tensor checksummed.
//!
//! From a model to a graphed training step, on the simulator (the same code runs on a GPU with
//! `Device::cuda(0)`):
//!
//! ```
//! use graphed::device::Device;
//! use graphed::graph::{make_graphed_fn, make_graphed_stack, GraphOptions, Replay};
//! use graphed::memory::CachingAllocator;
//! use graphed::nn::{Builder, Layers, ParamStore, Stack, TransformerLayer};
//! use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let (main, side, ready) = (dev.stream()?, dev.stream()?, dev.event()?);
//! let alloc = CachingAllocator::new(&dev);
//! // Two transformer layers of width 32 (one head of 32 features, which the default fused
//! // attention runs) over one flat parameter store.
//! let store = ParamStore::new(&alloc, &main, 2 * TransformerLayer::parameter_count(32))?;
//! let vb = Builder::new(&store, &alloc, &main)?.with_dropout(0.1, 7); // names, seeds, dropout
//! let layers = TransformerLayer::stack(&vb, (32, 1), &Layers::first(2))?; // h0, h1
//! let stack = Stack::new(layers).with_rng_step(vb.step()); // new dropout masks every forward
//! let x = Tensor::zeros(&alloc, &main, &[2, 4, 32], graphed::device::DType::F32)?;
//!
//! // Capture: warmup, then every layer's forward and backward into graphs of one pool, each
//! // recording `ready` once its outputs are written (verified at capture).
//! let graphed = make_graphed_stack(&alloc, &stack, &x, GraphOptions::default().sync_event(&ready))?;
//! let opt = AdamW::new(&alloc, &store, AdamWHyper::default(), LrSchedule::Constant(1e-3), &main)?;
//! let opt_step = make_graphed_fn(&alloc, |s| opt.step(s))?;
//!
//! // A step: replays on the side stream, the main stream resuming at `ready` after each.
//! let y = graphed.forward(&main, &x, Replay::side(&side))?;
//! let dy = Tensor::from_host(&alloc, &main, &[1.0f32; 256], &[2, 4, 32])?;
//! let dx = graphed.backward(&main, &dy)?;
//! graphed.join(&main)?; // the tails, before the optimizer reads the gradients
//! opt_step.replay(&main)?;
//! assert_eq!((y.shape(), dx.map(|d| d.shape().to_vec())), (&[2, 4, 32][..], Some(vec![2, 4, 32])));
//! assert_eq!(opt.steps(&main)?, 1);
//! # Ok::<(), graphed::Error>(())
//! ```
//!
//! The device layer underneath, by itself:
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
pub mod checkpoint;
pub mod device;
pub mod dist;
mod error;
pub mod graph;
pub mod memory;
pub mod nn;
pub mod offload;
pub mod ops;
pub mod optim;
pub mod tensor;

pub use error::{CaptureErrorKind, CaptureSite, Error, ProfileErrorKind, Result};
