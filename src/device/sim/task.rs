//! What a queued operation does to simulated memory, and the memory itself.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::backend::{Op, Repr};
use crate::device::kernel::{Arg, CpuArgs, CpuSlot, Gathered, Kernel};
use crate::device::memory::{Block, RawBuffer};
use crate::device::patch::{Bound, Slot};
use crate::device::{AccessMode, DType, Region};
use crate::{Error, Result};

/// Simulated memory of one allocation (device or pinned): 8-byte aligned host bytes, counted
/// against the device's memory while they live. An expandable allocation starts with no bytes
/// and grows or shrinks at its end, as mapping and unmapping pages of a reserved address range
/// do on CUDA; touching bytes beyond its end is [`Error::Unmapped`] (an illegal address on CUDA).
pub(crate) struct SimMem {
    words: Mutex<Words>,
    used: Arc<AtomicUsize>,
}

/// The bytes and how many of them are usable (`data` holds them rounded up to words).
struct Words {
    data: Vec<u64>,
    bytes: usize,
}

impl Drop for SimMem {
    fn drop(&mut self) {
        let bytes = self.lock().bytes;
        self.used.fetch_sub(bytes, Ordering::SeqCst);
    }
}

/// Counts `bytes` more against the device's `capacity`, and makes room for them on the host.
fn charge(op: &'static str, words: &mut Vec<u64>, bytes: usize, used: &AtomicUsize, capacity: usize) -> Result<()> {
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
    if words.try_reserve_exact(bytes.div_ceil(8)).is_err() {
        used.fetch_sub(bytes, Ordering::SeqCst);
        return Err(out_of_memory(capacity.saturating_sub(taken)));
    }
    Ok(())
}

impl SimMem {
    /// `bytes` zeroed bytes, if the device's `capacity` (with `used` in use) and the host allow.
    pub(crate) fn zeroed(op: &'static str, bytes: usize, used: &Arc<AtomicUsize>, capacity: usize) -> Result<SimMem> {
        let mut data = Vec::new();
        charge(op, &mut data, bytes, used, capacity)?;
        data.resize(bytes.div_ceil(8), 0);
        Ok(SimMem { words: Mutex::new(Words { data, bytes }), used: used.clone() })
    }

    /// An expandable allocation with no usable bytes yet: reserving an address range costs no
    /// memory.
    pub(crate) fn reserved(used: &Arc<AtomicUsize>) -> SimMem {
        SimMem { words: Mutex::new(Words { data: Vec::new(), bytes: 0 }), used: used.clone() }
    }

    /// Makes the first `bytes` usable (new bytes are zero), if the device's memory allows.
    pub(crate) fn grow(&self, op: &'static str, bytes: usize, capacity: usize) -> Result<()> {
        let mut w = self.lock();
        if bytes <= w.bytes {
            return Ok(());
        }
        let more = bytes - w.bytes;
        charge(op, &mut w.data, more, &self.used, capacity)?;
        w.data.resize(bytes.div_ceil(8), 0);
        w.bytes = bytes;
        Ok(())
    }

    /// Gives back every byte after the first `bytes`: their contents are lost.
    pub(crate) fn shrink(&self, bytes: usize) {
        let mut w = self.lock();
        if bytes < w.bytes {
            self.used.fetch_sub(w.bytes - bytes, Ordering::SeqCst);
            w.bytes = bytes;
            w.data.truncate(bytes.div_ceil(8));
            w.data.shrink_to_fit();
        }
    }

    /// Bytes usable now.
    pub(crate) fn len(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> MutexGuard<'_, Words> {
        // A panic while holding this lock can only come from a bug in a CPU kernel path; the
        // bytes are still plain data, so keep using them.
        self.words.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The usable bytes, if `[start, end)` lies within them.
    fn usable<'w>(op: &'static str, w: &'w mut Words, start: usize, end: usize) -> Result<&'w mut [u8]> {
        if end > w.bytes {
            return Err(Error::Unmapped { op, start, end, mapped: w.bytes });
        }
        Ok(&mut bytemuck::cast_slice_mut::<u64, u8>(&mut w.data)[..w.bytes])
    }

    pub(crate) fn read(&self, op: &'static str, offset: usize, out: &mut [u8]) -> Result<()> {
        let mut w = self.lock();
        let src = Self::usable(op, &mut w, offset, offset + out.len())?;
        out.copy_from_slice(&src[offset..offset + out.len()]);
        Ok(())
    }

    pub(crate) fn write(&self, op: &'static str, offset: usize, data: &[u8]) -> Result<()> {
        let mut w = self.lock();
        Self::usable(op, &mut w, offset, offset + data.len())?[offset..offset + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn gather(&self, op: &'static str, region: &Region, elem: usize) -> Result<Gathered> {
        let mut g = Gathered::zeroed(region.len() * elem);
        let mut w = self.lock();
        let src = Self::usable(op, &mut w, region.offset() * elem, region.end() * elem)?;
        let dst = g.as_bytes_mut();
        let mut at = 0;
        region.for_each_run(|start, n| {
            dst[at..at + n * elem].copy_from_slice(&src[start * elem..(start + n) * elem]);
            at += n * elem;
        });
        Ok(g)
    }

    fn scatter(&self, op: &'static str, region: &Region, elem: usize, g: &Gathered) -> Result<()> {
        let mut w = self.lock();
        let dst = Self::usable(op, &mut w, region.offset() * elem, region.end() * elem)?;
        let src = g.as_bytes();
        let mut at = 0;
        region.for_each_run(|start, n| {
            dst[start * elem..(start + n) * elem].copy_from_slice(&src[at..at + n * elem]);
            at += n * elem;
        });
        Ok(())
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
#[derive(Clone)]
pub(crate) struct OwnedBuf {
    block: Arc<Block>,
    region: Region,
    dtype: DType,
    mode: AccessMode,
}

#[derive(Clone)]
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
            Op::Kernel { kernel, args, .. } | Op::Gemm { kernel, args, .. } | Op::Sdpa { kernel, args, .. } => {
                Task::Kernel {
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
                }
            }
            Op::Copy { src, src_offset, dst, dst_offset, bytes, .. } => {
                Task::Copy { name: op.name(), src: src.clone(), src_offset, dst: dst.clone(), dst_offset, bytes }
            }
            Op::Memset { dst, offset, bytes, value } => Task::Memset { dst: dst.clone(), offset, bytes, value },
            Op::Collective { .. } => Task::Collective(super::comm::CollectiveTask::from_op(op)?),
        })
    }

    /// The same operation with the uses in `bound` pointed elsewhere: a kernel parameter or a
    /// copy's source or destination (what [`patch::plan`](crate::device::patch::plan) moves).
    pub(crate) fn rebound(&self, bound: &[(Slot, &Bound)]) -> Result<Task> {
        let bug = |why| Error::Unsupported { op: "GraphExec::rebind", backend: "sim", why };
        match self {
            Task::Kernel { kernel, args } => {
                let mut args = args.clone();
                for (slot, b) in bound {
                    let (Slot::Param(i) | Slot::Indirect(i)) = slot else {
                        return Err(bug("a kernel use that is no parameter"));
                    };
                    let Some(OwnedArg::Buf(arg)) = args.get_mut(*i) else {
                        return Err(bug("no such buffer parameter"));
                    };
                    let first = b.block.base + b.start;
                    if first % arg.dtype.size() != 0 {
                        return Err(bug("a rebound view not aligned to its element"));
                    }
                    arg.region = arg.region.moved_to(first / arg.dtype.size());
                    arg.block = b.block.clone();
                }
                Ok(Task::Kernel { kernel, args })
            }
            Task::Copy { name, src, src_offset, dst, dst_offset, bytes } => {
                let (mut src, mut src_offset) = (src.clone(), *src_offset);
                let (mut dst, mut dst_offset) = (dst.clone(), *dst_offset);
                for (slot, b) in bound {
                    match slot {
                        Slot::CopySrc => (src, src_offset) = (b.block.clone(), b.block.base + b.start),
                        Slot::CopyDst => (dst, dst_offset) = (b.block.clone(), b.block.base + b.start),
                        _ => return Err(bug("a copy use that is neither its source nor its destination")),
                    }
                }
                Ok(Task::Copy { name, src, src_offset, dst, dst_offset, bytes: *bytes })
            }
            Task::Memset { .. } | Task::Collective(_) => Err(bug("a memset or collective rebound")),
        }
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
            Task::Copy { name, src, src_offset, dst, dst_offset, bytes } => {
                let mut tmp = vec![0u8; *bytes];
                sim_mem(&src.raw)?.read(name, *src_offset, &mut tmp)?;
                sim_mem(&dst.raw)?.write(name, *dst_offset, &tmp)
            }
            Task::Memset { dst, offset, bytes, value } => {
                sim_mem(&dst.raw)?.write("memset", *offset, &vec![*value; *bytes])
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
                data: RefCell::new(sim_mem(&b.block.raw)?.gather(kernel.name, &b.region, b.dtype.size())?),
                address: super::address(b.block.raw.id, b.region.offset() * b.dtype.size()),
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
                sim_mem(&b.block.raw)?.scatter(kernel.name, &b.region, b.dtype.size(), &data.borrow())?;
            }
        }
    }
    Ok(())
}
