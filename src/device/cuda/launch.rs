//! Kernels: each source compiled once for the GPU's architecture (see [`nvrtc`](super::nvrtc)),
//! loaded once per device, and launched with arguments marshalled on the stack.
//!
//! The hot path of a launch is one lock and one pointer-keyed lookup (two for a grid-stride
//! launch, whose grid is trimmed to one wave); the source text is hashed only the first time a
//! kernel is launched.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{sys, CudaContext, CudaModule};
use cudarc::nvrtc::Ptx;

use super::error as err;
use super::ffi::{self, Function};
use super::memory;
use super::nvrtc::Compiler;
use super::stream::CuStream;
use crate::device::kernel::{Arg, Kernel, LaunchDims};
use crate::error::CaptureSite;
use crate::{Error, Result};

/// Launches with at most this many arguments marshal them without allocating.
const INLINE_ARGS: usize = 16;

/// The kernels loaded on one device.
pub(super) struct Kernels {
    ctx: Arc<CudaContext>,
    compiler: Compiler,
    /// The device's multiprocessors, for one wave of a grid-stride launch.
    sms: u32,
    loaded: Mutex<Loaded>,
}

#[derive(Default)]
struct Loaded {
    /// By the address of the `&'static Kernel`.
    functions: HashMap<usize, Function>,
    /// By source text; keeps every function above loaded for the device's lifetime.
    modules: HashMap<&'static str, Arc<CudaModule>>,
    /// Kernel names by [`Function::key`], for graph introspection.
    names: HashMap<usize, &'static str>,
    /// The dynamic shared memory each function has been allowed (opted into), by
    /// [`Function::key`].
    shared: HashMap<usize, u32>,
    /// Blocks per SM at once (`cuOccupancyMaxActiveBlocksPerMultiprocessor`), by function key,
    /// threads per block and dynamic shared memory: asked once, for grid-stride launches.
    resident: HashMap<(usize, u32, u32), u32>,
}

impl Kernels {
    pub(super) fn new(ctx: Arc<CudaContext>, compiler: Compiler) -> Result<Kernels> {
        let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let sms = ctx.attribute(attribute).map_err(|e| err::driver("Device::cuda", None, e))?;
        let sms = u32::try_from(sms).unwrap_or(1).max(1);
        Ok(Kernels { ctx, compiler, sms, loaded: Mutex::new(Loaded::default()) })
    }

    /// The name of a kernel loaded here, by its function's key.
    pub(super) fn name_of(&self, key: usize) -> Option<&'static str> {
        self.lock().names.get(&key).copied()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Loaded> {
        // Every update is a completed insert, so the maps stay consistent across a panic.
        self.loaded.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Loads the kernel's module now (see `Device::load_kernel`).
    pub(super) fn load(&self, kernel: &'static Kernel, on: CaptureSite) -> Result<()> {
        self.function(&mut self.lock(), kernel, on).map(|_| ())
    }

    /// The kernel's function, its dynamic shared memory allowed ([`Kernels::allow_shared`]), and
    /// the dims it launches `dims` with: one wave of a grid-stride launch
    /// ([`LaunchDims::one_wave`]) at the function's occupancy, which the driver is asked once.
    /// One lock for all three.
    fn launchable(
        &self,
        kernel: &'static Kernel,
        dims: &LaunchDims,
        on: CaptureSite,
    ) -> Result<(Function, LaunchDims)> {
        let mut loaded = self.lock();
        let func = self.function(&mut loaded, kernel, on)?;
        if dims.shared_mem_bytes > 0 {
            Self::allow_shared(&mut loaded, func, kernel.name, dims.shared_mem_bytes, on)?;
        }
        if !dims.grid_stride {
            return Ok((func, *dims));
        }
        let threads = dims.block.0.saturating_mul(dims.block.1).saturating_mul(dims.block.2);
        let at = (func.key(), threads, dims.shared_mem_bytes);
        let resident = match loaded.resident.get(&at) {
            Some(&r) => r,
            None => {
                // SAFETY: the function's module stays loaded in `Kernels`.
                let r = unsafe { func.resident_blocks(threads, dims.shared_mem_bytes) }
                    .map_err(|e| err::at(kernel.name, on, e))?;
                loaded.resident.insert(at, r);
                r
            }
        };
        Ok((func, dims.one_wave(self.sms, resident)))
    }

    /// The kernel's function, compiling and loading its source on first use. The caller holds
    /// the lock throughout, so concurrent first launches compile a source once.
    fn function(&self, loaded: &mut Loaded, kernel: &'static Kernel, on: CaptureSite) -> Result<Function> {
        let key = ptr::from_ref(kernel) as usize;
        if let Some(f) = loaded.functions.get(&key) {
            return Ok(*f);
        }
        let module = match loaded.modules.get(kernel.source) {
            Some(m) => m.clone(),
            None => {
                let cubin = self.compiler.cubin(kernel.name, kernel.source)?;
                // CUDA 13.0 allows this during captures (the conformance suite checks every mode).
                let m = self.ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| err::at(kernel.name, on, e))?;
                loaded.modules.insert(kernel.source, m.clone());
                m
            }
        };
        if kernel.name.contains('\0') {
            return Err(Error::Cuda { op: kernel.name, message: "the kernel name contains a NUL byte".into() });
        }
        let f = module.load_function(kernel.name).map_err(|e| Error::Cuda {
            op: kernel.name,
            message: format!(
                "loading the function from its compiled source: {}; is it an extern \"C\" __global__ function of Kernel::source?",
                err::describe(e)
            ),
        })?;
        let f = Function::of(&f);
        loaded.functions.insert(key, f);
        loaded.names.insert(f.key(), kernel.name);
        Ok(f)
    }

    /// Raises `func`'s dynamic shared memory limit to `bytes` unless an earlier launch did. Every
    /// launch with dynamic shared memory opts in, not only those above the 48 KiB a launch gets
    /// without: that limit counts the kernel's static shared memory too, so 48 KiB of dynamic
    /// memory beside a few bytes of static is already beyond it.
    fn allow_shared(
        loaded: &mut Loaded,
        func: Function,
        name: &'static str,
        bytes: u32,
        on: CaptureSite,
    ) -> Result<()> {
        if loaded.shared.get(&func.key()).is_some_and(|&allowed| allowed >= bytes) {
            return Ok(());
        }
        // SAFETY: the function's module stays loaded in `Kernels`.
        unsafe { func.allow_dynamic_shared(bytes) }.map_err(|e| err::at(name, on, e))?;
        loaded.shared.insert(func.key(), bytes);
        Ok(())
    }

    /// Enqueues `kernel` on `stream`. The device's context must be bound.
    pub(super) fn launch(
        &self,
        stream: &CuStream,
        kernel: &'static Kernel,
        dims: &LaunchDims,
        args: &[Arg<'_>],
    ) -> Result<()> {
        let on = CaptureSite::Stream(stream.id);
        let (func, dims) = self.launchable(kernel, dims, on)?;
        let n = args.len();
        if n <= INLINE_ARGS {
            let mut values = [0u64; INLINE_ARGS];
            let mut params = [ptr::null_mut(); INLINE_ARGS];
            launch_with(func, stream, kernel.name, &dims, args, &mut values[..n], &mut params[..n])
        } else {
            launch_with(func, stream, kernel.name, &dims, args, &mut vec![0; n], &mut vec![ptr::null_mut(); n])
        }
    }
}

impl Kernels {
    /// The function, dims and parameter slots a launch of `kernel` with `dims` and `args`
    /// passes (kept by a capture, so that a patched node is rebuilt from them as launched).
    pub(super) fn template(
        &self,
        stream: &CuStream,
        kernel: &'static Kernel,
        dims: &LaunchDims,
        args: &[Arg<'_>],
    ) -> Result<(Function, LaunchDims, Vec<u64>)> {
        let (func, dims) = self.launchable(kernel, dims, CaptureSite::Stream(stream.id))?;
        let mut values = vec![0; args.len()];
        marshal(kernel.name, args, &mut values)?;
        Ok((func, dims, values))
    }
}

/// Writes each argument into its 8-byte slot: a buffer as the device address of its view's first
/// element; a scalar with [`Scalar::bytes`](crate::device::Scalar), so its slot begins with the
/// value in its own type and size (4 bytes for `f32`, `u32`, `i32`), which is what the driver
/// copies for a parameter of that type.
fn marshal(name: &'static str, args: &[Arg<'_>], values: &mut [u64]) -> Result<()> {
    for (value, arg) in values.iter_mut().zip(args) {
        *value = match arg {
            Arg::Buf(b) => memory::kernel_arg(name, b.raw, b.region.offset() * b.dtype.size())?,
            Arg::Scalar(s) => u64::from_ne_bytes(s.bytes()),
        };
    }
    Ok(())
}

/// Marshals `args` into `values` (one 8-byte slot each) and `params` (a pointer to each slot),
/// and launches.
///
/// See [`marshal`] for the slots.
fn launch_with(
    func: Function,
    stream: &CuStream,
    name: &'static str,
    dims: &LaunchDims,
    args: &[Arg<'_>],
    values: &mut [u64],
    params: &mut [*mut c_void],
) -> Result<()> {
    marshal(name, args, values)?;
    for (param, value) in params.iter_mut().zip(values.iter_mut()) {
        *param = ptr::from_mut(value).cast();
    }
    // SAFETY: the function's module stays loaded in `Kernels`; `params` has one pointer per
    // argument, each to an 8-byte slot that outlives the call and begins with the argument's
    // value. That the list matches the kernel's signature is the contract of `Kernel`, as for any
    // CUDA launch. Buffers outlive the launch as explained in `memory::copy`.
    unsafe { ffi::launch(func, dims, &stream.raw, params) }
        .map_err(|e| err::at(name, CaptureSite::Stream(stream.id), e))
}
