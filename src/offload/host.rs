//! Pinned host buffers for offloaded tensors, pooled by size and element type. Each buffer
//! carries the events of its last copy out (device to host) and back (host to device), so that
//! it is never reused before its last copy ended (H8) and never read before its copy out landed
//! (H9).

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, OnceLock};

use super::table::CopyTable;
use crate::device::{with_dtype, BufferId, DType, Device, DeviceBuffer, Event, PinnedBuffer, Rebind, Stream};
use crate::ops::copy;
use crate::tensor::Tensor;
use crate::Result;

/// The device buffers that a switchable graph's device copies name at capture, one for the
/// copies out and one for the copies back, each as long as the largest offloaded tensor: every
/// tensor's copies name aliases of them (their own ids), turned off until a switch points them
/// at memory of the tensor's own. Two, so that a copy back never reads what a copy out of the
/// same capture writes on another stream.
pub(crate) struct Scratch {
    out: DeviceBuffer<f32>,
    back: DeviceBuffer<f32>,
}

impl Scratch {
    /// Scratch for tensors of up to `bytes`, from `alloc` on `stream`.
    pub(crate) fn new(alloc: &crate::memory::CachingAllocator, stream: &Stream, bytes: usize) -> Result<Scratch> {
        let len = bytes.div_ceil(DType::F32.size());
        Ok(Scratch { out: alloc.alloc(stream, len)?, back: alloc.alloc(stream, len)? })
    }

    /// The largest tensor it serves, in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.out.len() * DType::F32.size()
    }
}

/// A switchable graph's device copies of one tensor: aliases of a [`Scratch`], each a
/// `DeviceBuffer<T>` with `T::DTYPE` the tensor's, the scratch they alias, held as long as they
/// are, and the table entries the copies read their addresses from.
struct Twins {
    out: Arc<dyn Any + Send + Sync>,
    back: Arc<dyn Any + Send + Sync>,
    /// What they name, out and back.
    ids: [BufferId; 2],
    _scratch: Arc<Scratch>,
    table: Arc<CopyTable>,
    /// The copy out's entry and the copy back's.
    entries: [usize; 2],
}

/// One pinned host buffer and the events of its last copies.
pub(crate) struct HostBuffer {
    /// A `PinnedBuffer<T>` with `T::DTYPE == dtype`.
    buf: Arc<dyn Any + Send + Sync>,
    /// For a switchable graph's buffer, the buffers its device copies name: set after the
    /// capture's warmup ([`alias_twins`](HostBuffer::alias_twins)).
    twins: OnceLock<Twins>,
    dtype: DType,
    len: usize,
    memory: BufferId,
    /// What the host copies' graph nodes name, kept (a switch looks it up in every executable).
    id: BufferId,
    /// Recorded after its last copy out (on the copy-out stream).
    pub(crate) last_out: Option<Event>,
    /// Recorded after its last copy back (on the copy-back stream).
    pub(crate) last_in: Option<Event>,
}

impl HostBuffer {
    /// A new buffer of `len` elements of `dtype`.
    pub(crate) fn new(dev: &Device, dtype: DType, len: usize) -> Result<HostBuffer> {
        with_dtype!(dtype, T => {
            let b = dev.alloc_pinned::<T>(len)?;
            let (memory, id) = (b.memory_id(), b.id());
            Ok(HostBuffer { buf: Arc::new(b), twins: OnceLock::new(), dtype, len, memory, id, last_out: None, last_in: None })
        })
    }

    /// For a switchable graph's buffer: the buffers its device copies will name, aliases of
    /// `scratch` (nothing if it has them already). Called after the capture's warmup has given
    /// its memory back, so that the scratch does not pin the warmup's peak in the cache
    /// (docs/offload.md).
    /// Its copies read entries `first` and `first + 1` of `table`.
    pub(crate) fn alias_twins(&self, scratch: &Arc<Scratch>, table: &Arc<CopyTable>, first: usize) -> Result<()> {
        if self.twins.get().is_some() {
            return Ok(());
        }
        with_dtype!(self.dtype, T => {
            let (out, back) = (scratch.out.aliased_as::<T>(self.len)?, scratch.back.aliased_as::<T>(self.len)?);
            let ids = [out.id(), back.id()];
            let twins = Twins {
                out: Arc::new(out),
                back: Arc::new(back),
                ids,
                _scratch: scratch.clone(),
                table: table.clone(),
                entries: [first, first + 1],
            };
            // Under the manager's lock: nothing sets them in between.
            let _ = self.twins.set(twins);
            Ok(())
        })
    }

    /// The buffer's identity: what the host copies' graph nodes name.
    pub(crate) fn id(&self) -> BufferId {
        self.id
    }

    /// The allocations its copies touch in a graph's tail: its own, and where it has device
    /// copies, the scratch's and their table's (for graph verification).
    pub(crate) fn tail_memories(&self) -> Vec<BufferId> {
        let twins = with_dtype!(self.dtype, T => self.twins::<T>()
            .map(|(t, o, b)| [o.memory_id(), b.memory_id(), t.table.memory_id()]));
        std::iter::once(self.memory).chain(twins.into_iter().flatten()).collect()
    }

    /// What its device copies name, out and back, where it has them.
    pub(crate) fn twin_ids(&self) -> Option<[BufferId; 2]> {
        self.twins.get().map(|t| t.ids)
    }

    /// Its device copies' buffers, out and back, typed, with the rest of what they hold.
    fn twins<T: crate::device::Elem>(&self) -> Option<(&Twins, &DeviceBuffer<T>, &DeviceBuffer<T>)> {
        fn typed<T: crate::device::Elem>(a: &Arc<dyn Any + Send + Sync>) -> &DeviceBuffer<T> {
            a.downcast_ref().expect("a twin's type is its tensor's dtype's")
        }
        self.twins.get().map(|t| (t, typed(&t.out), typed(&t.back)))
    }

    /// Where it has device copies: captures a device copy of `src` beside the copy out, which
    /// copies nothing until a switch points it at device memory ([`Self::point_twins`]). A copy
    /// kernel that reads its addresses from the table, so that a switch updates no graph node.
    pub(crate) fn capture_twin_out(&self, src: &Tensor, stream: &Stream) -> Result<()> {
        with_dtype!(self.dtype, T => match self.twins::<T>() {
            Some((t, out, _)) => {
                let src = src.view::<T>()?;
                t.table.set(t.entries[0], out.view().device_address()?, src.device_address()?, 0);
                copy::bytes_via(out.view(), src, t.table.entry(t.entries[0]), stream)
            }
            None => Ok(()),
        })
    }

    /// Where it has device copies: captures a device copy into `dst` beside the copy back,
    /// which copies nothing until a switch points it at device memory.
    pub(crate) fn capture_twin_back(&self, dst: &Tensor, stream: &Stream) -> Result<()> {
        with_dtype!(self.dtype, T => match self.twins::<T>() {
            Some((t, _, back)) => {
                let dst = dst.view::<T>()?;
                t.table.set(t.entries[1], dst.device_address()?, back.view().device_address()?, 0);
                copy::bytes_via(dst, back.view(), t.table.entry(t.entries[1]), stream)
            }
            None => Ok(()),
        })
    }

    /// Points its device copies' table entries at `to` (the copy out's destination and the
    /// copy back's source, all of its bytes), or back at the scratch, copying nothing (`None`),
    /// as a switch points their bindings; the table's next upload writes them.
    /// Returns the table, or `None` where it has no device copies.
    pub(crate) fn point_twins(&self, to: Option<&Tensor>) -> Result<Option<&Arc<CopyTable>>> {
        with_dtype!(self.dtype, T => {
            let Some((t, out, back)) = self.twins::<T>() else { return Ok(None) };
            match to {
                Some(r) => {
                    let at = r.device_address()?;
                    t.table.point_pair(t.entries, [at, at], self.bytes() as u64);
                }
                None => {
                    let scratch = [out.view().device_address()?, back.view().device_address()?];
                    t.table.point_pair(t.entries, scratch, 0);
                }
            }
            Ok(Some(&t.table))
        })
    }

    /// Rebinds of its device copies whose buffers are in `named` (those an executable's nodes
    /// name) to themselves, moving writes: what a switch's plan resolves in that executable
    /// ([`PoolExec::resolve`](crate::memory::PoolExec::resolve)), to point them at the memory a
    /// switch keeps the tensor in, or back where they were captured. None without device copies.
    pub(crate) fn twin_identities(&self, named: &[BufferId]) -> Result<Vec<Rebind<'_>>> {
        with_dtype!(self.dtype, T => {
            let Some((_, out, back)) = self.twins::<T>() else { return Ok(Vec::new()) };
            let named = [out, back].into_iter().filter(|t| named.contains(&t.id()));
            named.map(|t| Ok(Rebind::new(t.view(), t.view())?.moving_writes())).collect()
        })
    }

    pub(crate) fn key(&self) -> (usize, DType) {
        (self.len, self.dtype)
    }

    pub(crate) fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    fn pinned<T: crate::device::Elem>(&self) -> &PinnedBuffer<T> {
        self.buf.downcast_ref().expect("the buffer's type is its dtype's")
    }

    /// Copies `src` (contiguous, of this buffer's size and type) into this buffer on `stream`.
    pub(crate) fn copy_out(&self, src: &Tensor, stream: &Stream) -> Result<()> {
        src.expect_dtype("offload copy out", self.dtype)?;
        with_dtype!(self.dtype, T => stream.copy_d2h(src.view::<T>()?, self.pinned::<T>().view()))
    }

    /// Copies this buffer into `dst` (contiguous, of this buffer's size and type) on `stream`.
    pub(crate) fn copy_in(&self, dst: &Tensor, stream: &Stream) -> Result<()> {
        dst.expect_dtype("offload copy back", self.dtype)?;
        with_dtype!(self.dtype, T => stream.copy_h2d(self.pinned::<T>().view(), dst.view::<T>()?))
    }
}

/// Free host buffers by (elements, element type), oldest first; grows on demand and keeps what it
/// allocated until dropped.
#[derive(Default)]
pub(crate) struct HostPool {
    free: HashMap<(usize, DType), VecDeque<HostBuffer>>,
    /// Bytes allocated in all.
    pub(crate) bytes: usize,
}

impl HostPool {
    /// A buffer for `len` elements of `dtype`: the oldest free one, or a new one.
    pub(crate) fn take(&mut self, dev: &Device, dtype: DType, len: usize) -> Result<HostBuffer> {
        if let Some(b) = self.free.get_mut(&(len, dtype)).and_then(VecDeque::pop_front) {
            return Ok(b);
        }
        let b = HostBuffer::new(dev, dtype, len)?;
        self.bytes += b.bytes();
        Ok(b)
    }

    /// Gives `b` back; its events order its next use (H8).
    pub(crate) fn give_back(&mut self, b: HostBuffer) {
        self.free.entry(b.key()).or_default().push_back(b);
    }
}
