//! What a queued operation does to simulated memory, and the memory itself.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::backend::{Op, Repr};
use crate::device::kernel::{Arg, CpuArgs, CpuSlot, Gathered, Kernel};
use crate::device::memory::{Block, RawBuffer};
use crate::device::{AccessMode, DType, Region};
use crate::{Error, Result};

/// Simulated memory of one allocation (device or pinned): 8-byte aligned host bytes, counted
/// against the device's memory while they live.
pub(crate) struct SimMem {
    bytes: usize,
    words: Mutex<Vec<u64>>,
    used: Arc<AtomicUsize>,
}

impl Drop for SimMem {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

impl SimMem {
    /// `bytes` zeroed bytes, if the device's `capacity` (with `used` in use) and the host allow.
    pub(crate) fn zeroed(op: &'static str, bytes: usize, used: &Arc<AtomicUsize>, capacity: usize) -> Result<SimMem> {
        let out_of_memory = |free: usize| Error::OutOfMemory {
            op,
            requested: bytes,
            what: "a device allocation",
            free: Some(free),
            total: Some(capacity),
        };
        let taken = used.fetch_add(bytes, Ordering::SeqCst);
        if taken.checked_add(bytes).is_none_or(|total| total > capacity) {
            used.fetch_sub(bytes, Ordering::SeqCst);
            return Err(out_of_memory(capacity.saturating_sub(taken)));
        }
        let mut words = Vec::new();
        if words.try_reserve_exact(bytes.div_ceil(8)).is_err() {
            used.fetch_sub(bytes, Ordering::SeqCst);
            return Err(out_of_memory(capacity.saturating_sub(taken)));
        }
        words.resize(bytes.div_ceil(8), 0);
        Ok(SimMem { bytes, words: Mutex::new(words), used: used.clone() })
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u64>> {
        // A panic while holding this lock can only come from a bug in a CPU kernel path; the
        // bytes are still plain data, so keep using them.
        self.words.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn read(&self, offset: usize, out: &mut [u8]) {
        let w = self.lock();
        out.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(&w)[offset..offset + out.len()]);
    }

    pub(crate) fn write(&self, offset: usize, data: &[u8]) {
        let mut w = self.lock();
        bytemuck::cast_slice_mut::<u64, u8>(&mut w)[offset..offset + data.len()].copy_from_slice(data);
    }

    fn gather(&self, region: &Region, elem: usize) -> Gathered {
        let mut g = Gathered::zeroed(region.len() * elem);
        let w = self.lock();
        let src = &bytemuck::cast_slice::<u64, u8>(&w)[..self.bytes];
        let dst = g.as_bytes_mut();
        let mut at = 0;
        region.for_each_run(|start, n| {
            dst[at..at + n * elem].copy_from_slice(&src[start * elem..(start + n) * elem]);
            at += n * elem;
        });
        g
    }

    fn scatter(&self, region: &Region, elem: usize, g: &Gathered) {
        let mut w = self.lock();
        let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut w)[..self.bytes];
        let src = g.as_bytes();
        let mut at = 0;
        region.for_each_run(|start, n| {
            dst[start * elem..(start + n) * elem].copy_from_slice(&src[at..at + n * elem]);
            at += n * elem;
        });
    }
}

fn sim_mem(raw: &RawBuffer) -> Result<&SimMem> {
    match &raw.mem {
        Repr::Sim(m) => Ok(m),
        Repr::Cuda(_) => Err(Error::Unsupported {
            op: "simulate",
            backend: "sim",
            why: "a CUDA buffer reached the simulator; please report this as a bug",
        }),
    }
}

/// A buffer argument, owned: the queue keeps the allocation alive until the task has run.
pub(crate) struct OwnedBuf {
    block: Arc<Block>,
    region: Region,
    dtype: DType,
    mode: AccessMode,
}

pub(crate) enum OwnedArg {
    Buf(OwnedBuf),
    Scalar(crate::device::Scalar),
}

/// A queued operation with everything it needs, frozen at enqueue.
pub(crate) enum Task {
    Kernel {
        kernel: &'static Kernel,
        args: Vec<OwnedArg>,
    },
    Copy {
        name: &'static str,
        src: Arc<Block>,
        src_offset: usize,
        dst: Arc<Block>,
        dst_offset: usize,
        bytes: usize,
    },
    Memset {
        dst: Arc<Block>,
        offset: usize,
        bytes: usize,
        value: u8,
    },
    /// A collective, or a group of sends and receives: each part runs as two work items, an
    /// arrival and a finish, every finish after every arrival (see `comm.rs`).
    Collective(Vec<Arc<super::comm::CollectiveTask>>),
}

impl Task {
    pub(crate) fn from_op(op: &Op<'_>) -> Result<Task> {
        Ok(match *op {
            Op::Kernel { kernel, args, .. } | Op::Gemm { kernel, args, .. } => Task::Kernel {
                kernel,
                args: args
                    .iter()
                    .map(|a| match a {
                        Arg::Buf(b) => OwnedArg::Buf(OwnedBuf {
                            block: b.block.clone(),
                            region: b.region,
                            dtype: b.dtype,
                            mode: b.mode,
                        }),
                        Arg::Scalar(s) => OwnedArg::Scalar(*s),
                    })
                    .collect(),
            },
            Op::Copy { src, src_offset, dst, dst_offset, bytes, .. } => {
                Task::Copy { name: op.name(), src: src.clone(), src_offset, dst: dst.clone(), dst_offset, bytes }
            }
            Op::Memset { dst, offset, bytes, value } => Task::Memset { dst: dst.clone(), offset, bytes, value },
            Op::Collective { .. } => Task::Collective(super::comm::CollectiveTask::from_op(op)?),
        })
    }

    /// The name shown in graph nodes.
    pub(crate) fn name(&self) -> String {
        match self {
            Task::Kernel { kernel, .. } => kernel.name.to_string(),
            Task::Copy { name, src, dst, .. } => format!("{name} {} -> {}", src.id, dst.id),
            Task::Memset { dst, .. } => format!("memset {}", dst.id),
            Task::Collective(parts) => parts.iter().map(|c| c.kind.name()).collect::<Vec<_>>().join("+"),
        }
    }

    pub(crate) fn node_kind(&self) -> crate::device::NodeKind {
        use crate::device::NodeKind;
        match self {
            // NCCL's operations are kernels in a captured graph.
            Task::Kernel { .. } | Task::Collective(_) => NodeKind::Kernel,
            Task::Copy { .. } => NodeKind::Memcpy,
            Task::Memset { .. } => NodeKind::Memset,
        }
    }

    /// Runs the operation on simulated memory.
    pub(crate) fn run(&self) -> Result<()> {
        match self {
            Task::Kernel { kernel, args } => run_kernel(kernel, args),
            Task::Copy { src, src_offset, dst, dst_offset, bytes, .. } => {
                let mut tmp = vec![0u8; *bytes];
                sim_mem(&src.raw)?.read(*src_offset, &mut tmp);
                sim_mem(&dst.raw)?.write(*dst_offset, &tmp);
                Ok(())
            }
            Task::Memset { dst, offset, bytes, value } => {
                sim_mem(&dst.raw)?.write(*offset, &vec![*value; *bytes]);
                Ok(())
            }
            Task::Collective(_) => Err(Error::Unsupported {
                op: "collective",
                backend: "sim",
                why: "a collective ran as one work item; please report this as a bug",
            }),
        }
    }
}

fn run_kernel(kernel: &'static Kernel, args: &[OwnedArg]) -> Result<()> {
    let mut slots = Vec::with_capacity(args.len());
    for a in args {
        slots.push(match a {
            OwnedArg::Buf(b) => CpuSlot::Buf {
                dtype: b.dtype,
                mode: b.mode,
                data: RefCell::new(sim_mem(&b.block.raw)?.gather(&b.region, b.dtype.size())),
            },
            OwnedArg::Scalar(s) => CpuSlot::Scalar(*s),
        });
    }
    let cpu = CpuArgs { kernel, slots };
    (kernel.cpu)(&cpu).map_err(|e| match e {
        // A CPU path that reports a runtime failure itself keeps its own message.
        e @ Error::KernelFailed { .. } => e,
        e => Error::KernelFailed { kernel: kernel.name, message: e.to_string() },
    })?;
    for (a, slot) in args.iter().zip(&cpu.slots) {
        if let (OwnedArg::Buf(b), CpuSlot::Buf { data, .. }) = (a, slot) {
            if b.mode.writes() {
                sim_mem(&b.block.raw)?.scatter(&b.region, b.dtype.size(), &data.borrow());
            }
        }
    }
    Ok(())
}
