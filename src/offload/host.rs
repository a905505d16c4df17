//! Pinned host buffers for offloaded tensors, pooled by size and element type. Each buffer
//! carries the events of its last copy out (device to host) and back (host to device), so that
//! it is never reused before its last copy ended (H8) and never read before its copy out landed
//! (H9).

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::device::{with_dtype, BufferId, DType, Device, DeviceBuffer, Event, PinnedBuffer, Rebind, Stream};
use crate::tensor::Tensor;
use crate::Result;

/// One pinned host buffer and the events of its last copies.
pub(crate) struct HostBuffer {
    /// A `PinnedBuffer<T>` with `T::DTYPE == dtype`.
    buf: Arc<dyn Any + Send + Sync>,
    /// For a switchable graph's buffer, its device alias: a `DeviceBuffer<T>` of the same memory
    /// (`PinnedBuffer::device_alias`), which the copies a switch turns on name.
    alias: Option<Arc<dyn Any + Send + Sync>>,
    dtype: DType,
    len: usize,
    memory: BufferId,
    /// Recorded after its last copy out (on the copy-out stream).
    pub(crate) last_out: Option<Event>,
    /// Recorded after its last copy back (on the copy-back stream).
    pub(crate) last_in: Option<Event>,
}

impl HostBuffer {
    /// A new buffer of `len` elements of `dtype`, with a device alias where `switchable`.
    pub(crate) fn new(dev: &Device, dtype: DType, len: usize, switchable: bool) -> Result<HostBuffer> {
        with_dtype!(dtype, T => {
            let b = dev.alloc_pinned::<T>(len)?;
            let memory = b.memory_id();
            let alias = switchable.then(|| Arc::new(b.device_alias()) as Arc<dyn Any + Send + Sync>);
            Ok(HostBuffer { buf: Arc::new(b), alias, dtype, len, memory, last_out: None, last_in: None })
        })
    }

    /// The buffer's identity: what the host copies' graph nodes name.
    pub(crate) fn id(&self) -> BufferId {
        with_dtype!(self.dtype, T => self.pinned::<T>().id())
    }

    /// Its device alias's identity, where it has one: what the copies a switch turns on name.
    pub(crate) fn alias_id(&self) -> Option<BufferId> {
        with_dtype!(self.dtype, T => self.alias::<T>().map(DeviceBuffer::id))
    }

    fn alias<T: crate::device::Elem>(&self) -> Option<&DeviceBuffer<T>> {
        self.alias.as_ref().map(|a| a.downcast_ref().expect("the alias's type is its dtype's"))
    }

    /// Where it has a device alias: captures, turned off, a device copy of `src` into the alias
    /// beside the copy out, which a switch points at device memory ([`Self::rebind_alias`]).
    pub(crate) fn capture_alias_out(&self, src: &Tensor, stream: &Stream) -> Result<()> {
        with_dtype!(self.dtype, T => match self.alias::<T>() {
            Some(alias) => stream.capture_off(|| stream.copy_d2d(src.view::<T>()?, alias.view())),
            None => Ok(()),
        })
    }

    /// Where it has a device alias: captures, turned off, a device copy of the alias into `dst`
    /// beside the copy back.
    pub(crate) fn capture_alias_in(&self, dst: &Tensor, stream: &Stream) -> Result<()> {
        with_dtype!(self.dtype, T => match self.alias::<T>() {
            Some(alias) => stream.capture_off(|| stream.copy_d2d(alias.view(), dst.view::<T>()?)),
            None => Ok(()),
        })
    }

    /// Points the nodes naming its alias in `exec` at `to` (writes too), or back at the alias
    /// (`None`).
    pub(crate) fn rebind_alias(&self, exec: &crate::memory::PoolExec, to: Option<&Tensor>) -> Result<usize> {
        with_dtype!(self.dtype, T => {
            let Some(alias) = self.alias::<T>() else { return Ok(0) };
            let to = match to {
                Some(t) => t.view::<T>()?,
                None => alias.view(),
            };
            exec.rebind(&[Rebind::new(alias.view(), to)?.moving_writes()])
        })
    }

    pub(crate) fn key(&self) -> (usize, DType) {
        (self.len, self.dtype)
    }

    pub(crate) fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The allocation its copies name, for graph verification.
    pub(crate) fn memory(&self) -> BufferId {
        self.memory
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
        let b = HostBuffer::new(dev, dtype, len, false)?;
        self.bytes += b.bytes();
        Ok(b)
    }

    /// Gives `b` back; its events order its next use (H8).
    pub(crate) fn give_back(&mut self, b: HostBuffer) {
        self.free.entry(b.key()).or_default().push_back(b);
    }
}
