//! Layer 4, tensors: a typed, strided window onto device memory from the caching allocator.
//!
//! A [`Tensor`] is a buffer (shared by its views), an element offset, a shape and strides in
//! elements. Ops take tensors and launch kernels on their [`View`]s, so the accesses a kernel
//! declares are exactly the tensor's elements.
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
//! assert_eq!(t.narrow(1, 1, 2)?.to_vec(&s)?, vec![2.0, 3.0, 5.0, 6.0]);
//! assert_eq!(t.transpose(0, 1)?.to_vec(&s)?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
//! # Ok::<(), graphed::Error>(())
//! ```

use std::fmt;
use std::sync::Arc;

use crate::device::{DeviceBuffer, Elem, Stream, View};
use crate::memory::CachingAllocator;
use crate::{Error, Result};

/// A strided tensor of `T` in device memory. Cloning makes another handle to the same memory.
#[derive(Clone)]
pub struct Tensor<T: Elem> {
    buf: Arc<DeviceBuffer<T>>,
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

impl<T: Elem> Tensor<T> {
    /// A contiguous tensor of `shape` from `alloc`, its contents unspecified (NaN bytes with a
    /// poisoning allocator). For work on `stream`.
    pub fn uninit(alloc: &CachingAllocator, stream: &Stream, shape: &[usize]) -> Result<Tensor<T>> {
        let buf = alloc.alloc::<T>(stream, shape.iter().product())?;
        Ok(Tensor { buf: Arc::new(buf), offset: 0, shape: shape.to_vec(), strides: contiguous_strides(shape) })
    }

    /// A contiguous tensor of zeros.
    pub fn zeros(alloc: &CachingAllocator, stream: &Stream, shape: &[usize]) -> Result<Tensor<T>> {
        let t = Tensor::uninit(alloc, stream, shape)?;
        stream.memset(&*t.buf, 0)?;
        Ok(t)
    }

    /// A contiguous tensor holding `data` (row-major), written after the work queued on `stream`
    /// (a blocking copy: not inside a capture).
    pub fn from_host(alloc: &CachingAllocator, stream: &Stream, data: &[T], shape: &[usize]) -> Result<Tensor<T>> {
        if data.len() != shape.iter().product::<usize>() {
            return Err(shape_error("Tensor::from_host", format!("{} elements", data.len()), shape));
        }
        let t = Tensor::uninit(alloc, stream, shape)?;
        t.buf.write_from(stream, data)?;
        Ok(t)
    }

    /// The elements in row-major order, read after the work queued on `stream` (blocking).
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        let all = self.buf.to_vec(stream)?;
        Ok(self.indices().map(|i| all[i]).collect())
    }

    /// Whether `other` is this very view: the same memory, offset, shape and strides (a graphed
    /// call skips the copy into a static input when it is given the static input itself).
    pub fn is_same_view(&self, other: &Tensor<T>) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
            && self.offset == other.offset
            && self.shape == other.shape
            && self.strides == other.strides
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

    /// The buffer the tensor lives in.
    pub fn buffer(&self) -> &DeviceBuffer<T> {
        &self.buf
    }

    /// Whether the elements are consecutive in row-major order.
    pub fn is_contiguous(&self) -> bool {
        self.strides == contiguous_strides(&self.shape) || self.numel() <= 1
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

    /// The same elements with another shape (contiguous tensors only).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor<T>> {
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
        Ok(Tensor {
            buf: self.buf.clone(),
            offset: self.offset,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        })
    }

    /// Elements `start..start + len` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor<T>> {
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
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor<T>> {
        if a >= self.shape.len() || b >= self.shape.len() {
            return Err(shape_error("Tensor::transpose", format!("dims {a} and {b}"), &self.shape));
        }
        let mut t = self.clone();
        t.shape.swap(a, b);
        t.strides.swap(a, b);
        Ok(t)
    }

    /// The tensor as a device view for kernel arguments: dimensions of size 1 dropped, adjacent
    /// dimensions that are contiguous with each other merged, at most three left.
    pub fn view(&self) -> Result<View<'_, T>> {
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
        self.buf.strided(self.offset, &dims).ok_or(Error::Unsupported {
            op: "Tensor::view",
            backend: "any",
            why: "kernels take views of at most 3 strided dimensions; make the tensor contiguous first",
        })
    }

    /// Fails unless the shape is `expected`.
    pub fn expect_shape(&self, op: &'static str, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(shape_error(op, format!("{expected:?}"), &self.shape));
        }
        Ok(())
    }
}

impl<T: Elem> fmt::Debug for Tensor<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor<{}>{:?} in {} at +{}", T::DTYPE, self.shape, self.buf.id(), self.offset)
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
        let t = Tensor::<f32>::zeros(&alloc, &s, &[2, 3, 4, 5]).unwrap();
        assert!(t.view().unwrap().region().is_contiguous());
        let head = t.narrow(3, 1, 2).unwrap();
        assert_eq!(head.view().unwrap().region().dims().len(), 2, "(2*3*4 rows, 2 columns) with stride 5");
        assert!(t.reshape(&[7]).is_err());
        assert!(matches!(t.narrow(4, 0, 1), Err(Error::Shape { .. })));
        assert_eq!(t.transpose(0, 3).unwrap().shape(), &[5, 3, 4, 2]);
    }

    #[test]
    fn host_roundtrip_of_a_strided_view() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let t = Tensor::from_host(&alloc, &s, &data, &[4, 6]).unwrap();
        let col = t.narrow(1, 2, 1).unwrap();
        assert_eq!(col.to_vec(&s).unwrap(), vec![2.0, 8.0, 14.0, 20.0]);
        assert!(Tensor::from_host(&alloc, &s, &data, &[5, 5]).is_err());
    }
}
