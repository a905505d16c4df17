//! Layer 4, tensors: a strided window onto device memory from the caching allocator, with its
//! element type known at run time.
//!
//! A [`Tensor`] is a buffer (shared by its views), its [`DType`], an element offset, a shape and
//! strides in elements. The element type is a value, as in candle and PyTorch, so that one model
//! runs in f32 or bf16 by a flag; ops check it and take typed [`View`]s of their operands, so the
//! accesses a kernel declares are exactly the tensor's elements, and an operand of the wrong type
//! is a typed error ([`Error::DTypeMismatch`], [`Error::UnsupportedDType`]) before anything runs.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let t = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
//! assert_eq!(t.dtype(), graphed::device::DType::F32);
//! assert_eq!(t.narrow(1, 1, 2)?.to_vec::<f32>(&s)?, vec![2.0, 3.0, 5.0, 6.0]);
//! assert_eq!(t.transpose(0, 1)?.to_vec::<f32>(&s)?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
//! assert!(t.to_vec::<half::bf16>(&s).is_err(), "a typed read of another type is refused");
//! # Ok::<(), graphed::Error>(())
//! ```

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::device::{
    with_dtype, Access, AccessMode, BufferId, DType, DeviceBuffer, DeviceId, Elem, Float, Float8, Rebind, Stream, View,
};
use crate::memory::CachingAllocator;
use crate::{Error, Result};

/// The floating-point element types (for [`Error::UnsupportedDType`]).
const FLOATING: &str = "f32, bf16, f16, f8e4m3 or f8e5m2";

/// A strided tensor in device memory, of an element type chosen at run time. Cloning makes
/// another handle to the same memory.
#[derive(Clone)]
pub struct Tensor {
    /// A `DeviceBuffer<T>` with `T::DTYPE == dtype`: one handle, shared by every view, so the
    /// memory goes back to the allocator once, when the last view is dropped.
    buf: Arc<dyn Any + Send + Sync>,
    dtype: DType,
    id: BufferId,
    device: DeviceId,
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

fn shape_error(op: &'static str, expected: String, found: &[usize]) -> Error {
    Error::Shape { op, expected, found: found.to_vec() }
}

impl Tensor {
    fn of_buffer<T: Elem>(buf: DeviceBuffer<T>, shape: &[usize]) -> Tensor {
        Tensor {
            dtype: T::DTYPE,
            id: buf.id(),
            device: buf.device_id(),
            buf: Arc::new(buf),
            offset: 0,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        }
    }

    /// A contiguous tensor of `shape` and `dtype` from `alloc`, its contents unspecified (NaN
    /// bytes with a poisoning allocator). For work on `stream`.
    pub fn uninit(alloc: &CachingAllocator, stream: &Stream, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let n = shape.iter().product();
        with_dtype!(dtype, T => Ok(Tensor::of_buffer(alloc.alloc::<T>(stream, n)?, shape)))
    }

    /// A contiguous tensor of each of `shapes`, all of `dtype`, their contents unspecified,
    /// packed into one allocation (each at an [`ALIGN`](crate::memory::arena::ALIGN)ed byte): one
    /// placement in the allocator instead of one per tensor, and the memory goes back whole, once
    /// the last of them is dropped. For tensors that live and die together (an offload switch's
    /// resident tensors).
    ///
    /// ```
    /// # use graphed::{device::{DType, Device}, memory::CachingAllocator, tensor::Tensor};
    /// let dev = Device::sim();
    /// let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
    /// let ts = Tensor::uninit_packed(&alloc, &s, &[&[3, 5], &[7]], DType::F32)?;
    /// assert_eq!((ts[0].id(), ts[1].shape()), (ts[1].id(), &[7][..])); // one allocation
    /// assert_eq!(ts[1].offset() * 4 % graphed::memory::arena::ALIGN, 0);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`uninit`](Tensor::uninit).
    pub fn uninit_packed(
        alloc: &CachingAllocator,
        stream: &Stream,
        shapes: &[&[usize]],
        dtype: DType,
    ) -> Result<Vec<Tensor>> {
        let step = (crate::memory::arena::ALIGN / dtype.size()).max(1);
        let mut starts = Vec::with_capacity(shapes.len());
        let mut len = 0;
        for shape in shapes {
            starts.push(len);
            len += shape.iter().product::<usize>().div_ceil(step) * step;
        }
        let whole = Tensor::uninit(alloc, stream, &[len], dtype)?;
        let at = |offset, shape: &[usize]| Tensor {
            buf: whole.buf.clone(),
            dtype,
            id: whole.id,
            device: whole.device,
            offset,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        };
        Ok(shapes.iter().zip(starts).map(|(shape, start)| at(start, shape)).collect())
    }

    /// Its block and its first byte in it, for a contiguous tensor: where a rebind points a
    /// graph's uses of another tensor at this one.
    ///
    /// # Errors
    /// [`Error::NotContiguous`] for a strided view.
    pub(crate) fn placement(&self) -> Result<(&Arc<crate::device::memory::Block>, usize)> {
        const OP: &str = "Tensor::placement";
        let block = with_dtype!(self.dtype, T => &self.buffer::<T>(OP)?.block);
        if !self.is_contiguous() {
            return Err(Error::NotContiguous { op: OP, buffer: self.id });
        }
        Ok((block, self.offset * self.dtype.size()))
    }

    /// The device address of its first element, for a contiguous tensor: what a table of
    /// addresses that a kernel reads holds for it.
    ///
    /// # Errors
    /// As [`placement`](Tensor::placement).
    pub(crate) fn device_address(&self) -> Result<u64> {
        let (block, start) = self.placement()?;
        crate::device::memory::device_address(block, start)
    }

    /// A contiguous tensor of zeros.
    pub fn zeros(alloc: &CachingAllocator, stream: &Stream, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let t = Tensor::uninit(alloc, stream, shape, dtype)?;
        t.zero(stream)?;
        Ok(t)
    }

    /// A contiguous tensor holding `data` (row-major), of `data`'s element type, written after
    /// the work queued on `stream` (a blocking copy: not inside a capture).
    pub fn from_host<T: Elem>(
        alloc: &CachingAllocator,
        stream: &Stream,
        data: &[T],
        shape: &[usize],
    ) -> Result<Tensor> {
        if data.len() != shape.iter().product::<usize>() {
            return Err(shape_error("Tensor::from_host", format!("{} elements", data.len()), shape));
        }
        let t = Tensor::uninit(alloc, stream, shape, T::DTYPE)?;
        t.buffer::<T>("Tensor::from_host")?.write_from(stream, data)?;
        Ok(t)
    }

    /// A contiguous tensor of `dtype` (f32, bf16, f16 or FP8) holding `data` rounded to it (to
    /// nearest, ties to even, as the GPU rounds; FP8 saturates, as [`Float8`] does), written as
    /// [`Tensor::from_host`] writes.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] for an integer type.
    pub fn from_f32(
        alloc: &CachingAllocator,
        stream: &Stream,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        fn rounded<T: Float>(data: &[f32]) -> Vec<T> {
            data.iter().map(|v| T::from_f32(*v)).collect()
        }
        fn saturated<T: Float8>(data: &[f32]) -> Vec<T> {
            data.iter().map(|v| T::from_f32(*v)).collect()
        }
        match dtype {
            DType::F32 => Tensor::from_host(alloc, stream, data, shape),
            DType::BF16 => Tensor::from_host(alloc, stream, &rounded::<half::bf16>(data), shape),
            DType::F16 => Tensor::from_host(alloc, stream, &rounded::<half::f16>(data), shape),
            DType::F8E4M3 => Tensor::from_host(alloc, stream, &saturated::<float8::F8E4M3>(data), shape),
            DType::F8E5M2 => Tensor::from_host(alloc, stream, &saturated::<float8::F8E5M2>(data), shape),
            dtype => Err(Error::UnsupportedDType { op: "Tensor::from_f32", dtype, supported: FLOATING }),
        }
    }

    /// The elements in row-major order, read after the work queued on `stream` (blocking).
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] unless `T` is the tensor's element type.
    pub fn to_vec<T: Elem>(&self, stream: &Stream) -> Result<Vec<T>> {
        let buf = self.buffer::<T>("Tensor::to_vec")?;
        if self.numel() == 0 {
            return Ok(Vec::new());
        }
        // Only the span the view covers: a parameter's view of a model's one gradient buffer
        // reads its own elements, not the whole buffer.
        let span = 1 + self.shape.iter().zip(&self.strides).map(|(d, s)| (d - 1) * s).sum::<usize>();
        let part = buf.range_to_vec(stream, self.offset..self.offset + span)?;
        if self.is_contiguous() {
            return Ok(part);
        }
        Ok(self.indices().map(|i| part[i - self.offset]).collect())
    }

    /// The elements widened to f32 (exactly; FP8 NaNs as the canonical NaN), for a tensor of any
    /// floating-point type.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] for an integer tensor.
    pub fn to_f32_vec(&self, stream: &Stream) -> Result<Vec<f32>> {
        match self.dtype {
            DType::F32 => self.to_vec(stream),
            DType::BF16 => Ok(self.to_vec::<half::bf16>(stream)?.into_iter().map(Float::to_f32).collect()),
            DType::F16 => Ok(self.to_vec::<half::f16>(stream)?.into_iter().map(Float::to_f32).collect()),
            DType::F8E4M3 => Ok(self.to_vec::<float8::F8E4M3>(stream)?.into_iter().map(Float8::to_f32).collect()),
            DType::F8E5M2 => Ok(self.to_vec::<float8::F8E5M2>(stream)?.into_iter().map(Float8::to_f32).collect()),
            dtype => Err(Error::UnsupportedDType { op: "Tensor::to_f32_vec", dtype, supported: FLOATING }),
        }
    }

    /// Whether `other` is this very view: the same memory, offset, shape and strides (a graphed
    /// call skips the copy into a static input when it is given the static input itself).
    pub fn is_same_view(&self, other: &Tensor) -> bool {
        self.id == other.id && self.offset == other.offset && self.shape == other.shape && self.strides == other.strides
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size of the elements in bytes.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// The identity of the buffer the tensor lives in (shared by its views).
    pub fn id(&self) -> BufferId {
        self.id
    }

    /// The device whose memory it is.
    pub fn device_id(&self) -> DeviceId {
        self.device
    }

    /// The buffer, typed.
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] (naming `op`) unless `T` is the tensor's element type.
    pub fn buffer<T: Elem>(&self, op: &'static str) -> Result<&DeviceBuffer<T>> {
        self.buf.downcast_ref().ok_or(Error::DTypeMismatch { op, expected: T::DTYPE, found: self.dtype })
    }

    /// Fails unless the element type is `dtype`.
    pub fn expect_dtype(&self, op: &'static str, dtype: DType) -> Result<()> {
        if self.dtype != dtype {
            return Err(Error::DTypeMismatch { op, expected: dtype, found: self.dtype });
        }
        Ok(())
    }

    /// Whether the elements are consecutive in row-major order. A dimension of size 1 is never
    /// stepped, so its stride does not matter: a narrowed `(1, g, T)` slice of a dense
    /// `(B, H, T)` tensor is contiguous.
    pub fn is_contiguous(&self) -> bool {
        let mut dense = 1;
        let steps_densely = self.shape.iter().zip(&self.strides).rev().all(|(&n, &s)| {
            let ok = n == 1 || s == dense;
            dense *= n;
            ok
        });
        steps_densely || self.numel() <= 1
    }

    /// Buffer indices of the elements, in row-major order.
    fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.numel();
        (0..n).map(move |mut flat| {
            let mut at = self.offset;
            for (dim, stride) in self.shape.iter().zip(&self.strides).rev() {
                at += (flat % dim) * stride;
                flat /= dim;
            }
            at
        })
    }

    /// Refuses a tensor that is not contiguous, for `op`, which needs one.
    pub(crate) fn expect_contiguous(&self, op: &'static str) -> Result<()> {
        match self.is_contiguous() {
            true => Ok(()),
            false => Err(Error::NotContiguous { op, buffer: self.id }),
        }
    }

    /// The same view through a handle that does not own the memory
    /// ([`DeviceBuffer::alias`]): the memory goes back to its allocator when the last owning
    /// handle drops, whatever aliases remain. For a graph pool's shared static outputs, whose
    /// holders check that the pool did not give the memory to another use before they read it.
    pub(crate) fn alias(&self) -> Result<Tensor> {
        let buf: Arc<dyn Any + Send + Sync> =
            with_dtype!(self.dtype, T => Arc::new(self.buffer::<T>("Tensor::alias")?.alias()));
        Ok(Tensor { buf, ..self.clone() })
    }

    /// The same elements with another shape (contiguous tensors only).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(shape_error("Tensor::reshape", format!("{} elements", self.numel()), shape));
        }
        if !self.is_contiguous() {
            return Err(Error::Unsupported {
                op: "Tensor::reshape",
                backend: "any",
                why: "the tensor is not contiguous; reshape before taking strided views",
            });
        }
        Ok(Tensor { shape: shape.to_vec(), strides: contiguous_strides(shape), ..self.clone() })
    }

    /// Elements `start..start + len` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        if dim >= self.shape.len() || start + len > self.shape[dim] {
            return Err(shape_error(
                "Tensor::narrow",
                format!("dim {dim} holding {start}..{}", start + len),
                &self.shape,
            ));
        }
        let mut t = self.clone();
        t.offset += start * self.strides[dim];
        t.shape[dim] = len;
        Ok(t)
    }

    /// Dimensions `a` and `b` swapped (a view, no copy).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        if a >= self.shape.len() || b >= self.shape.len() {
            return Err(shape_error("Tensor::transpose", format!("dims {a} and {b}"), &self.shape));
        }
        let mut t = self.clone();
        t.shape.swap(a, b);
        t.strides.swap(a, b);
        Ok(t)
    }

    /// Elements `range` of its buffer, as a flat contiguous view of the same memory (whatever
    /// this view's shape): a run of views of one buffer taken as one.
    pub(crate) fn flat(&self, range: std::ops::Range<usize>) -> Result<Tensor> {
        let len = with_dtype!(self.dtype, T => self.buffer::<T>("Tensor::flat")?.len());
        if range.start > range.end || range.end > len {
            return Err(shape_error("Tensor::flat", format!("elements {range:?} of a buffer of {len}"), &self.shape));
        }
        Ok(Tensor { offset: range.start, shape: vec![range.len()], strides: vec![1], ..self.clone() })
    }

    /// Its first element's position in its buffer, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Element `index` of dimension `dim`, that dimension dropped: a view of the same memory.
    ///
    /// ```
    /// # use graphed::{device::Device, memory::CachingAllocator, tensor::Tensor};
    /// # let dev = Device::sim();
    /// # let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
    /// // The k third of a (B·T, 3C) QKV matrix, as (B, T, C): rows 3C apart.
    /// let qkv = Tensor::from_host(&alloc, &s, &(0..12).map(|i| i as f32).collect::<Vec<_>>(), &[2, 3, 2])?;
    /// let k = qkv.select(1, 1)?;
    /// assert_eq!((k.shape(), k.to_vec::<f32>(&s)?), (&[2, 2][..], vec![2.0, 3.0, 8.0, 9.0]));
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Shape`] for a dimension or index out of range.
    pub fn select(&self, dim: usize, index: usize) -> Result<Tensor> {
        if dim >= self.shape.len() || index >= self.shape[dim] {
            return Err(shape_error("Tensor::select", format!("dim {dim}, index {index}"), &self.shape));
        }
        let mut t = self.clone();
        t.offset += index * t.strides[dim];
        t.shape.remove(dim);
        t.strides.remove(dim);
        Ok(t)
    }

    /// The tensor as a typed device view for kernel arguments: dimensions of size 1 dropped,
    /// adjacent dimensions that are contiguous with each other merged, at most four left.
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] unless `T` is the element type; [`Error::Unsupported`] for a
    /// view of more than four strided dimensions.
    pub fn view<T: Elem>(&self) -> Result<View<'_, T>> {
        let mut dims: Vec<(usize, usize)> = Vec::new();
        for (&count, &stride) in self.shape.iter().zip(&self.strides) {
            if count == 1 {
                continue;
            }
            match dims.last_mut() {
                Some(last) if last.1 == count * stride => *last = (last.0 * count, stride),
                _ => dims.push((count, stride)),
            }
        }
        if dims.is_empty() {
            dims.push((self.numel(), 1));
        }
        self.buffer::<T>("Tensor::view")?.strided(self.offset, &dims).ok_or(Error::Unsupported {
            op: "Tensor::view",
            backend: "any",
            why: "kernels take views of at most 4 strided dimensions; make the tensor contiguous first",
        })
    }

    /// Copies `src` into this tensor on `stream` (same element type and shape).
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] or [`Error::Shape`] before anything is enqueued.
    pub fn copy_from(&self, src: &Tensor, stream: &Stream) -> Result<()> {
        const OP: &str = "Tensor::copy_from";
        src.expect_dtype(OP, self.dtype)?;
        src.expect_shape(OP, &self.shape)?;
        with_dtype!(self.dtype, T => stream.copy_d2d(src.view::<T>()?, self.view::<T>()?))
    }

    /// A [`Rebind`] of a graph's captured reads of this tensor to `to` (this tensor itself moves
    /// them back to where they were captured), in this tensor's element type.
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] for `to` of another element type; as [`Rebind::new`].
    pub fn rebind_to<'a>(&'a self, to: &'a Tensor) -> Result<Rebind<'a>> {
        with_dtype!(self.dtype, T => Rebind::new(self.view::<T>()?, to.view::<T>()?))
    }

    /// The access an operation touching this tensor's elements with `mode` declares (for the
    /// checker's queries).
    pub fn access(&self, mode: AccessMode) -> Result<Access> {
        with_dtype!(self.dtype, T => Ok(self.view::<T>()?.access(mode)))
    }

    /// Lets the allocator reuse this tensor's memory for `stream` once `event` has completed,
    /// when its last view is dropped (see [`DeviceBuffer::release_after`]): for memory that a
    /// side stream read before `event` was recorded there.
    pub fn release_after(&self, event: &crate::device::Event, stream: &Stream) -> Result<()> {
        with_dtype!(self.dtype, T => {
            self.buffer::<T>("Tensor::release_after")?.release_after(event, stream);
            Ok(())
        })
    }

    /// Sets every element's bytes to zero on `stream` (0.0 for the float types).
    pub fn zero(&self, stream: &Stream) -> Result<()> {
        with_dtype!(self.dtype, T => stream.memset(self.view::<T>()?, 0))
    }

    /// Fails unless the shape is `expected`.
    pub fn expect_shape(&self, op: &'static str, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(shape_error(op, format!("{expected:?}"), &self.shape));
        }
        Ok(())
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor<{}>{:?} in {} at +{}", self.dtype, self.shape, self.id, self.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    #[test]
    fn views_merge_contiguous_dims_and_keep_strided_ones() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let t = Tensor::zeros(&alloc, &s, &[2, 3, 4, 5], DType::F32).unwrap();
        assert!(t.view::<f32>().unwrap().region().is_contiguous());
        assert!(matches!(
            t.view::<half::bf16>(),
            Err(Error::DTypeMismatch { expected: DType::BF16, found: DType::F32, .. })
        ));
        let head = t.narrow(3, 1, 2).unwrap();
        assert_eq!(head.view::<f32>().unwrap().region().dims().len(), 2, "(2*3*4 rows, 2 columns) with stride 5");
        assert!(t.reshape(&[7]).is_err());
        assert!(matches!(t.narrow(4, 0, 1), Err(Error::Shape { .. })));
        assert_eq!(t.transpose(0, 3).unwrap().shape(), &[5, 3, 4, 2]);
    }

    /// A size-1 dimension's stride is never stepped: a slice of one batch element and a range of
    /// heads of a dense `(B, H, T)` tensor is contiguous, one of a range of columns is not.
    #[test]
    fn contiguity_ignores_the_strides_of_dimensions_of_size_one() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let rows = Tensor::zeros(&alloc, &s, &[2, 8, 16], DType::F32).unwrap();
        let heads = rows.narrow(0, 1, 1).unwrap().narrow(1, 2, 4).unwrap();
        assert_eq!((heads.strides(), heads.offset()), (&[128, 16, 1][..], 160));
        assert!(heads.is_contiguous());
        assert_eq!(heads.reshape(&[64]).unwrap().offset(), 160);
        assert!(!rows.narrow(0, 1, 1).unwrap().narrow(2, 0, 8).unwrap().is_contiguous());
        assert!(!rows.narrow(1, 2, 4).unwrap().is_contiguous(), "two batch elements' head ranges are apart");
    }

    /// An alias reads the memory it views but never holds it: the pool block goes back when its
    /// owner drops, and dropping the alias gives nothing back a second time.
    #[test]
    fn an_alias_neither_holds_nor_frees_its_memory() -> Result<()> {
        let dev = Device::sim();
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(&dev);
        let pool = alloc.new_pool();
        let cap = alloc.capture(&s, crate::device::CaptureMode::ThreadLocal, &pool)?;
        let owner = Tensor::uninit(&alloc, &s, &[4, 8], DType::F32)?;
        owner.zero(&s)?;
        let graph = cap.finish()?;
        let alias = owner.alias()?;
        assert!(alias.is_same_view(&owner) && alias.access(AccessMode::Read)? == owner.access(AccessMode::Read)?);
        graph.instantiate()?.launch(&s)?;
        assert_eq!(alias.to_vec::<f32>(&s)?, vec![0.0; 32]);
        drop(owner);
        assert_eq!(pool.stats().allocated, 0, "the owner's drop gave the block back");
        let reused = alloc.capture(&s, crate::device::CaptureMode::ThreadLocal, &pool)?;
        let next = Tensor::uninit(&alloc, &s, &[4, 8], DType::F32)?;
        let place = |t: &Tensor| t.access(AccessMode::Write).map(|a| (a.memory, a.at));
        assert_eq!(place(&next)?, place(&alias)?, "a later capture reuses the block");
        let held = pool.stats().allocated;
        drop(alias);
        assert_eq!(pool.stats().allocated, held, "dropping the alias freed nothing");
        drop(next);
        reused.finish()?;
        Ok(())
    }

    #[test]
    fn host_roundtrip_of_a_strided_view() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let t = Tensor::from_host(&alloc, &s, &data, &[4, 6]).unwrap();
        let col = t.narrow(1, 2, 1).unwrap();
        assert_eq!(col.to_vec::<f32>(&s).unwrap(), vec![2.0, 8.0, 14.0, 20.0]);
        assert!(Tensor::from_host(&alloc, &s, &data, &[5, 5]).is_err());
    }
}
