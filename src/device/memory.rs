//! Device buffers, pinned host buffers, and views of them.
//!
//! Buffers are owned handles; an enqueued operation or a captured graph keeps the allocation
//! alive through its own reference, so dropping a buffer never frees memory that queued work or a
//! graph still uses.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, Mutex, PoisonError};

use super::backend::MemRepr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use super::{Access, AccessMode, AccessRole, BufferId, DType, DeviceId, Elem, Event, Region, StreamId};

/// Where an allocation lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// Device memory.
    Device,
    /// Page-locked host memory, reachable by async copies.
    Pinned,
}

/// An allocation of the device, untyped: a whole buffer, or a segment that an allocator splits
/// into blocks. Shared by the blocks in it, queued work and graphs.
pub(crate) struct RawBuffer {
    /// Identity of the allocation (blocks of one segment share it).
    pub(crate) id: BufferId,
    pub(crate) device: DeviceId,
    pub(crate) bytes: usize,
    pub(crate) kind: MemKind,
    pub(crate) mem: MemRepr,
    /// The device's checker, for host accesses of pinned memory.
    pub(crate) observer: Option<Arc<dyn super::observe::Observer>>,
}

impl RawBuffer {
    /// Bytes usable now: `bytes`, or for expandable memory its mapped prefix.
    pub(crate) fn mapped(&self) -> usize {
        super::backend::mapped(self)
    }
}

/// Where a block goes back when it is freed (an allocator), and when.
pub(crate) trait BlockOwner: Send + Sync {
    /// Whether the block returns when its handle is dropped (true, for graph-pool blocks whose
    /// reuse the pool's replay order makes safe) or when the last reference to it goes, queued
    /// work and graphs included (false).
    fn release_on_handle_drop(&self) -> bool;
    /// Takes the block back. `last_stream` is the stream that used it last, `streams_used` how
    /// many times the using stream changed, plus one; `fence`, if set, an event after which the
    /// block is free for its stream (see [`DeviceBuffer::release_after`]).
    fn release(&self, last_stream: Option<StreamId>, streams_used: u32, fence: Option<Fence>);
}

/// An event after which a block used on several streams is free for one of them.
pub(crate) struct Fence {
    pub(crate) event: Event,
    pub(crate) stream: StreamId,
}

/// The memory a buffer handle owns: a byte range of a [`RawBuffer`].
pub(crate) struct Block {
    pub(crate) id: BufferId,
    pub(crate) raw: Arc<RawBuffer>,
    /// Byte offset of the block in `raw`.
    pub(crate) base: usize,
    pub(crate) bytes: usize,
    owner: Option<Arc<dyn BlockOwner>>,
    /// The last stream that enqueued work on the block (0: none yet).
    last_stream: AtomicU64,
    /// How many times the using stream changed.
    stream_changes: AtomicU32,
    released: AtomicBool,
    fence: Mutex<Option<Fence>>,
}

impl Block {
    /// A block covering all of `raw`, owned by nobody (freed with `raw`).
    pub(crate) fn whole(raw: RawBuffer) -> Block {
        Block::new(Arc::new(raw), 0, None, BufferId(super::ids::next_id()), None)
    }

    /// A block of `bytes` at `base` in `raw`, returned to `owner` when freed.
    pub(crate) fn new(
        raw: Arc<RawBuffer>,
        base: usize,
        bytes: Option<usize>,
        id: BufferId,
        owner: Option<Arc<dyn BlockOwner>>,
    ) -> Block {
        let bytes = bytes.unwrap_or(raw.bytes - base);
        Block {
            id,
            raw,
            base,
            bytes,
            owner,
            last_stream: AtomicU64::new(0),
            stream_changes: AtomicU32::new(0),
            released: AtomicBool::new(false),
            fence: Mutex::new(None),
        }
    }

    /// Notes that `stream` enqueues work on the block: stream-ordered reuse needs to know.
    pub(crate) fn note_use(&self, stream: StreamId) {
        let before = self.last_stream.swap(stream.0, Ordering::Relaxed);
        if before != 0 && before != stream.0 {
            self.stream_changes.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn release(&self) {
        if let Some(owner) = &self.owner {
            if !self.released.swap(true, Ordering::AcqRel) {
                let last = self.last_stream.load(Ordering::Relaxed);
                let streams = self.stream_changes.load(Ordering::Relaxed) + u32::from(last != 0);
                let fence = self.fence.lock().unwrap_or_else(PoisonError::into_inner).take();
                owner.release((last != 0).then_some(StreamId(last)), streams, fence);
            }
        }
    }

    fn release_on_handle_drop(&self) -> bool {
        self.owner.as_ref().is_some_and(|o| o.release_on_handle_drop())
    }

    /// The same memory (same identity, so accesses through it are the block's own) owned by
    /// nobody: dropping it gives nothing back. Its holder must know from elsewhere when the
    /// memory is someone else's (a graph pool's shared static outputs).
    fn alias(&self) -> Block {
        Block::new(self.raw.clone(), self.base, Some(self.bytes), self.id, None)
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        self.release();
    }
}

/// Device memory holding `len` elements of `T`.
///
/// ```
/// use graphed::device::Device;
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let x = dev.alloc_from(&s, &[1.0f32, 2.0, 3.0])?;
/// assert_eq!(x.to_vec(&s)?, vec![1.0, 2.0, 3.0]);
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct DeviceBuffer<T: Elem> {
    pub(crate) block: Arc<Block>,
    len: usize,
    _t: PhantomData<T>,
}

/// Page-locked host memory holding `len` elements of `T`: the source and destination of async
/// copies. The host reads and writes it with [`PinnedBuffer::read`] and [`PinnedBuffer::write`];
/// ordering those against queued copies is the caller's job (synchronize an event first).
pub struct PinnedBuffer<T: Elem> {
    pub(crate) block: Arc<Block>,
    len: usize,
    _t: PhantomData<T>,
}

/// A region of a [`DeviceBuffer`], typed. Made by [`DeviceBuffer::view`], `slice` or `strided`.
#[derive(Clone, Copy)]
pub struct View<'a, T: Elem> {
    pub(crate) block: &'a Arc<Block>,
    /// Relative to the block.
    pub(crate) region: Region,
    pub(crate) buffer_len: usize,
    _t: PhantomData<T>,
}

/// A contiguous range of a [`PinnedBuffer`].
#[derive(Clone, Copy)]
pub struct HostView<'a, T: Elem> {
    pub(crate) block: &'a Arc<Block>,
    /// Relative to the block.
    pub(crate) region: Region,
    pub(crate) buffer_len: usize,
    _t: PhantomData<T>,
}

fn range_of(len: usize, range: impl RangeBounds<usize>) -> (usize, usize) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e + 1,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    (start, end.saturating_sub(start))
}

macro_rules! buffer_common {
    ($name:ident, $view:ident) => {
        impl<T: Elem> $name<T> {
            pub(crate) fn from_block(block: Block) -> Self {
                let len = block.bytes / T::DTYPE.size();
                $name { block: Arc::new(block), len, _t: PhantomData }
            }

            /// Number of elements.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether the buffer has no elements.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// The buffer's identity (used in reports and errors).
            pub fn id(&self) -> BufferId {
                self.block.id
            }

            /// The allocation its accesses name ([`Access::memory`]), shared with its aliases:
            /// how graph verification recognizes memory that a graph's tail may touch.
            pub fn memory_id(&self) -> BufferId {
                self.block.raw.id
            }

            /// The device whose memory it is.
            pub fn device_id(&self) -> DeviceId {
                self.block.raw.device
            }

            /// The element type.
            pub fn dtype(&self) -> DType {
                T::DTYPE
            }

            /// The whole buffer.
            pub fn view(&self) -> $view<'_, T> {
                self.slice(..)
            }

            /// A contiguous range of elements. Bounds are checked when the view is used.
            pub fn slice(&self, range: impl RangeBounds<usize>) -> $view<'_, T> {
                let (start, len) = range_of(self.len, range);
                $view {
                    block: &self.block,
                    region: Region::contiguous(start, len),
                    buffer_len: self.len,
                    _t: PhantomData,
                }
            }
        }

        impl<'a, T: Elem> $view<'a, T> {
            /// Number of elements in the view.
            pub fn len(&self) -> usize {
                self.region.len()
            }

            /// Whether the view has no elements.
            pub fn is_empty(&self) -> bool {
                self.region.is_empty()
            }

            /// The region of the buffer this view covers.
            pub fn region(&self) -> Region {
                self.region
            }

            /// The region in elements from the start of the underlying allocation.
            pub(crate) fn absolute(&self) -> Region {
                self.region.shifted(self.block.base / T::DTYPE.size())
            }

            pub(crate) fn check_bounds(&self, op: &'static str) -> crate::Result<()> {
                if self.region.end() > self.buffer_len {
                    return Err(crate::Error::OutOfBounds {
                        op,
                        buffer: self.block.id,
                        start: self.region.offset(),
                        end: self.region.end(),
                        len: self.buffer_len,
                    });
                }
                Ok(())
            }
        }

        impl<T: Elem> std::fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}<{}>({} x {})", stringify!($name), T::DTYPE, self.block.id, self.len)
            }
        }
    };
}

buffer_common!(DeviceBuffer, View);
buffer_common!(PinnedBuffer, HostView);

impl<T: Elem> DeviceBuffer<T> {
    /// Another buffer of `len` elements of `U` over the start of this one's memory: its own
    /// [`id`](DeviceBuffer::id), so that a graph's nodes naming it are told apart from those
    /// naming this buffer or its other aliases, while the checker orders their accesses as the
    /// same memory. It does not own the block: keep this buffer while the alias is used, or its
    /// memory goes back to its allocator.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`](crate::Error::LengthMismatch) when `len` elements of `U` do not
    /// fit in this buffer.
    pub fn aliased_as<U: Elem>(&self, len: usize) -> crate::Result<DeviceBuffer<U>> {
        let bytes = len * U::DTYPE.size();
        if bytes > self.block.bytes {
            return Err(crate::Error::LengthMismatch {
                op: "DeviceBuffer::aliased_as",
                src: bytes,
                dst: self.block.bytes,
            });
        }
        let id = BufferId(super::ids::next_id());
        Ok(DeviceBuffer::from_block(Block::new(self.block.raw.clone(), self.block.base, Some(bytes), id, None)))
    }

    /// A handle to the same memory that does not own it: dropping it never gives the block back
    /// to its allocator, and holding it does not keep the block from going back when this
    /// buffer is dropped. For static outputs that a graph pool shares between its graphs.
    pub(crate) fn alias(&self) -> DeviceBuffer<T> {
        DeviceBuffer { block: Arc::new(self.block.alias()), len: self.len, _t: PhantomData }
    }

    /// A strided view: `dims` are `(count, stride)` pairs in elements, outermost first, at most
    /// three. Returns `None` for more than three dimensions; bounds are checked when it is used.
    pub fn strided(&self, offset: usize, dims: &[(usize, usize)]) -> Option<View<'_, T>> {
        Some(View { block: &self.block, region: Region::strided(offset, dims)?, buffer_len: self.len, _t: PhantomData })
    }

    /// Lets an allocator reuse this memory for `stream` once `event` has completed, when it is
    /// freed. Without it, memory used on several streams is reused only after a device-wide
    /// synchronize, and memory used on one stream only by that stream; this is PyTorch's
    /// `record_stream`, the other way round. The caller promises
    /// that every use of the buffer on another stream than `stream` is enqueued before `event`'s
    /// latest record (a copy on a side stream, then the event on that stream).
    pub fn release_after(&self, event: &Event, stream: &super::Stream) {
        let fence = Fence { event: event.clone(), stream: stream.id() };
        *self.block.fence.lock().unwrap_or_else(PoisonError::into_inner) = Some(fence);
    }
}

impl<'a, T: Elem> View<'a, T> {
    /// No elements of the same buffer: an argument that declares no access, for a parameter a
    /// call does not use.
    pub(crate) fn nothing(&self) -> View<'a, T> {
        View { region: Region::contiguous(self.region.offset(), 0), ..*self }
    }
}

/// The access a view declares, for the checker.
pub(crate) fn access_of(block: &Block, region: Region, elem_bytes: usize, mode: AccessMode, index: usize) -> Access {
    Access {
        buffer: block.id,
        memory: block.raw.id,
        at: region.shifted(block.base / elem_bytes),
        elem_bytes,
        region,
        mode,
        role: AccessRole::Arg(index),
    }
}

impl<T: Elem> View<'_, T> {
    /// The access an operation that touches this view with `mode` declares.
    pub fn access(&self, mode: AccessMode) -> Access {
        access_of(self.block, self.region, T::DTYPE.size(), mode, 0)
    }

    /// Size of one element in bytes.
    pub(crate) fn dtype_size(&self) -> usize {
        T::DTYPE.size()
    }

    /// The device address of the view's first element: what a kernel is given for it, and what
    /// a table of addresses that a kernel reads must hold for it.
    pub(crate) fn device_address(&self) -> crate::Result<u64> {
        device_address(self.block, self.region.offset() * T::DTYPE.size())
    }
}

/// The device address of byte `start` of `block`: what a kernel is given for it.
pub(crate) fn device_address(block: &Block, start: usize) -> crate::Result<u64> {
    super::backend::device_address(&block.raw, block.base + start)
}

impl<T: Elem> PinnedBuffer<T> {
    /// Copies the buffer's contents to a `Vec` on the host, now. Not ordered against queued
    /// copies: synchronize the copy's event or stream first.
    pub fn read(&self) -> crate::Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        super::backend::read_pinned(&self.block, bytemuck::cast_slice_mut(&mut out))?;
        self.observe("PinnedBuffer::read", AccessMode::Read)?;
        Ok(out)
    }

    fn observe(&self, op: &'static str, mode: AccessMode) -> crate::Result<()> {
        match &self.block.raw.observer {
            Some(o) => {
                let a = access_of(&self.block, Region::contiguous(0, self.len), T::DTYPE.size(), mode, 0);
                o.host_access(op, None, &[a])
            }
            None => Ok(()),
        }
    }

    /// Writes `data` into the buffer from the host, now. Not ordered against queued copies that
    /// still read the buffer: synchronize them first.
    pub fn write(&self, data: &[T]) -> crate::Result<()> {
        if data.len() != self.len {
            return Err(crate::Error::LengthMismatch { op: "PinnedBuffer::write", src: data.len(), dst: self.len });
        }
        super::backend::write_pinned(&self.block, bytemuck::cast_slice(data))?;
        self.observe("PinnedBuffer::write", AccessMode::Write)
    }
}

macro_rules! handle_drop {
    ($name:ident) => {
        impl<T: Elem> Drop for $name<T> {
            fn drop(&mut self) {
                if self.block.release_on_handle_drop() {
                    self.block.release();
                }
            }
        }
    };
}
handle_drop!(DeviceBuffer);
handle_drop!(PinnedBuffer);
