//! Device buffers, pinned host buffers, and views of them.
//!
//! Buffers are owned handles; an enqueued operation or a captured graph keeps the allocation
//! alive through its own reference, so dropping a buffer never frees memory that queued work or a
//! graph still uses.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use super::backend::MemRepr;
use super::{BufferId, DType, DeviceId, Elem, Region};

/// Where an allocation lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// Device memory.
    Device,
    /// Page-locked host memory, reachable by async copies.
    Pinned,
}

/// An allocation, untyped; shared by the typed handle and by queued work and graphs.
pub(crate) struct RawBuffer {
    pub(crate) id: BufferId,
    pub(crate) device: DeviceId,
    pub(crate) bytes: usize,
    pub(crate) kind: MemKind,
    pub(crate) mem: MemRepr,
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
    pub(crate) raw: Arc<RawBuffer>,
    len: usize,
    _t: PhantomData<T>,
}

/// Page-locked host memory holding `len` elements of `T`: the source and destination of async
/// copies. The host reads and writes it with [`PinnedBuffer::read`] and [`PinnedBuffer::write`];
/// ordering those against queued copies is the caller's job (synchronize an event first).
pub struct PinnedBuffer<T: Elem> {
    pub(crate) raw: Arc<RawBuffer>,
    len: usize,
    _t: PhantomData<T>,
}

/// A region of a [`DeviceBuffer`], typed. Made by [`DeviceBuffer::view`], `slice` or `strided`.
#[derive(Clone, Copy)]
pub struct View<'a, T: Elem> {
    pub(crate) raw: &'a Arc<RawBuffer>,
    pub(crate) region: Region,
    pub(crate) buffer_len: usize,
    _t: PhantomData<T>,
}

/// A contiguous range of a [`PinnedBuffer`].
#[derive(Clone, Copy)]
pub struct HostView<'a, T: Elem> {
    pub(crate) raw: &'a Arc<RawBuffer>,
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
            pub(crate) fn from_raw(raw: RawBuffer) -> Self {
                let len = raw.bytes / T::DTYPE.size();
                $name { raw: Arc::new(raw), len, _t: PhantomData }
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
                self.raw.id
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
                $view { raw: &self.raw, region: Region::contiguous(start, len), buffer_len: self.len, _t: PhantomData }
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

            pub(crate) fn check_bounds(&self, op: &'static str) -> crate::Result<()> {
                if self.region.end() > self.buffer_len {
                    return Err(crate::Error::OutOfBounds {
                        op,
                        buffer: self.raw.id,
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
                write!(f, "{}<{}>({} x {})", stringify!($name), T::DTYPE, self.raw.id, self.len)
            }
        }
    };
}

buffer_common!(DeviceBuffer, View);
buffer_common!(PinnedBuffer, HostView);

impl<T: Elem> DeviceBuffer<T> {
    /// A strided view: `dims` are `(count, stride)` pairs in elements, outermost first, at most
    /// three. Returns `None` for more than three dimensions; bounds are checked when it is used.
    pub fn strided(&self, offset: usize, dims: &[(usize, usize)]) -> Option<View<'_, T>> {
        Some(View { raw: &self.raw, region: Region::strided(offset, dims)?, buffer_len: self.len, _t: PhantomData })
    }
}

impl<T: Elem> View<'_, T> {
    /// Size of one element in bytes.
    pub(crate) fn dtype_size(&self) -> usize {
        T::DTYPE.size()
    }
}

impl<T: Elem> PinnedBuffer<T> {
    /// Copies the buffer's contents to a `Vec` on the host, now. Not ordered against queued
    /// copies: synchronize the copy's event or stream first.
    pub fn read(&self) -> crate::Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        super::backend::read_pinned(&self.raw, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Writes `data` into the buffer from the host, now. Not ordered against queued copies that
    /// still read the buffer: synchronize them first.
    pub fn write(&self, data: &[T]) -> crate::Result<()> {
        if data.len() != self.len {
            return Err(crate::Error::LengthMismatch { op: "PinnedBuffer::write", src: data.len(), dst: self.len });
        }
        super::backend::write_pinned(&self.raw, bytemuck::cast_slice(data))
    }
}
