//! cuDNN's backend descriptors as owned values: made, given typed attributes, finalized, read
//! back, destroyed once. Every status becomes an [`Error::Cudnn`](crate::Error::Cudnn) naming the
//! call and the attribute.

use std::ffi::c_void;
use std::ptr::null_mut;

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Ty, cudnnBackendDescriptorType_t as Kind,
};

use super::library::check;
use crate::{Error, Result};

/// One backend descriptor, destroyed on drop.
pub(super) struct Descriptor {
    raw: sys::cudnnBackendDescriptor_t,
}

// SAFETY: a descriptor is a host object; graphed uses it under the `Cudnn` lock.
unsafe impl Send for Descriptor {}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: made by `cudnnBackendCreateDescriptor`, destroyed once.
        let status = unsafe { sys::cudnnBackendDestroyDescriptor(self.raw) };
        if let Err(e) = check("cudnnBackendDestroyDescriptor", status) {
            tracing::warn!("graphed: {e}");
        }
    }
}

/// The error of setting or reading `attr`.
fn attr_error(call: &'static str, attr: Attr) -> impl Fn(Error) -> Error {
    move |e| match e {
        Error::Cudnn { op, message, .. } => Error::Cudnn { op, call, message: format!("{attr:?}: {message}") },
        e => e,
    }
}

impl Descriptor {
    pub(super) fn new(kind: Kind) -> Result<Descriptor> {
        let mut raw = null_mut();
        // SAFETY: `raw` receives the new descriptor.
        let status = unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) };
        check("cudnnBackendCreateDescriptor", status).map_err(|e| match e {
            Error::Cudnn { op, call, message } => Error::Cudnn { op, call, message: format!("{kind:?}: {message}") },
            e => e,
        })?;
        Ok(Descriptor { raw })
    }

    pub(super) fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.raw
    }

    /// Sets `attr` to `values`, each of the C type `ty` names.
    ///
    /// # Safety
    /// `T` must be the C type of `ty` (an enum as its `u32`/`i32`, a boolean as `bool`).
    unsafe fn set<T>(&mut self, attr: Attr, ty: Ty, values: &[T]) -> Result<()> {
        // SAFETY: `values` holds `len` elements of `ty`'s type (the caller's promise).
        let status = unsafe {
            sys::cudnnBackendSetAttribute(self.raw, attr, ty, values.len() as i64, values.as_ptr().cast::<c_void>())
        };
        check("cudnnBackendSetAttribute", status).map_err(attr_error("cudnnBackendSetAttribute", attr))
    }

    pub(super) fn set_i64s(&mut self, attr: Attr, values: &[i64]) -> Result<()> {
        // SAFETY: INT64 is int64_t.
        unsafe { self.set(attr, Ty::CUDNN_TYPE_INT64, values) }
    }

    pub(super) fn set_f32(&mut self, attr: Attr, value: f32) -> Result<()> {
        // SAFETY: FLOAT is float.
        unsafe { self.set(attr, Ty::CUDNN_TYPE_FLOAT, &[value]) }
    }

    pub(super) fn set_bool(&mut self, attr: Attr, value: bool) -> Result<()> {
        // SAFETY: BOOLEAN is C's bool, one byte like Rust's.
        unsafe { self.set(attr, Ty::CUDNN_TYPE_BOOLEAN, &[value]) }
    }

    pub(super) fn set_data_type(&mut self, attr: Attr, value: sys::cudnnDataType_t) -> Result<()> {
        // SAFETY: DATA_TYPE is the enum cudnnDataType_t, which the binding declares repr(u32).
        unsafe { self.set(attr, Ty::CUDNN_TYPE_DATA_TYPE, &[value]) }
    }

    pub(super) fn set_pointwise_mode(&mut self, attr: Attr, value: sys::cudnnPointwiseMode_t) -> Result<()> {
        // SAFETY: POINTWISE_MODE is the enum cudnnPointwiseMode_t (repr(u32)).
        unsafe { self.set(attr, Ty::CUDNN_TYPE_POINTWISE_MODE, &[value]) }
    }

    pub(super) fn set_reduction(&mut self, attr: Attr, value: sys::cudnnReduceTensorOp_t) -> Result<()> {
        // SAFETY: REDUCTION_OPERATOR_TYPE is the enum cudnnReduceTensorOp_t (repr(u32)).
        unsafe { self.set(attr, Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &[value]) }
    }

    pub(super) fn set_heur_mode(&mut self, attr: Attr, value: sys::cudnnBackendHeurMode_t) -> Result<()> {
        // SAFETY: HEUR_MODE is the enum cudnnBackendHeurMode_t (repr(u32)).
        unsafe { self.set(attr, Ty::CUDNN_TYPE_HEUR_MODE, &[value]) }
    }

    pub(super) fn set_handle(&mut self, attr: Attr, handle: sys::cudnnHandle_t) -> Result<()> {
        // SAFETY: HANDLE is cudnnHandle_t.
        unsafe { self.set(attr, Ty::CUDNN_TYPE_HANDLE, &[handle]) }
    }

    pub(super) fn set_descriptors(&mut self, attr: Attr, values: &[&Descriptor]) -> Result<()> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = values.iter().map(|d| d.raw).collect();
        // SAFETY: BACKEND_DESCRIPTOR is cudnnBackendDescriptor_t; the descriptors are live.
        unsafe { self.set(attr, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw) }
    }

    /// Sets `attr` to addresses (device memory, or host memory of by-value scalars).
    pub(super) fn set_pointers(&mut self, attr: Attr, values: &[*mut c_void]) -> Result<()> {
        // SAFETY: VOID_PTR is void*.
        unsafe { self.set(attr, Ty::CUDNN_TYPE_VOID_PTR, values) }
    }

    pub(super) fn finalize(&mut self) -> Result<()> {
        // SAFETY: the descriptor is live.
        check("cudnnBackendFinalize", unsafe { sys::cudnnBackendFinalize(self.raw) })
    }

    /// Reads up to `out.len()` elements of `attr`; how many there were.
    ///
    /// # Safety
    /// `T` must be the C type of `ty`.
    unsafe fn get<T>(&self, attr: Attr, ty: Ty, out: &mut [T]) -> Result<usize> {
        let mut count = 0i64;
        // SAFETY: `out` has room for `len` elements of `ty`'s type (the caller's promise).
        let status = unsafe {
            sys::cudnnBackendGetAttribute(self.raw, attr, ty, out.len() as i64, &mut count, out.as_mut_ptr().cast())
        };
        check("cudnnBackendGetAttribute", status).map_err(attr_error("cudnnBackendGetAttribute", attr))?;
        Ok(count.max(0) as usize)
    }

    pub(super) fn get_i64(&self, attr: Attr) -> Result<i64> {
        let mut v = [0i64];
        // SAFETY: INT64 is int64_t.
        unsafe { self.get(attr, Ty::CUDNN_TYPE_INT64, &mut v) }?;
        Ok(v[0])
    }

    /// An attribute that is a list of enum values (numerical or behaviour notes), read as the
    /// integers they are: cuDNN may report values this binding's enums do not have.
    pub(super) fn get_enums(&self, attr: Attr, ty: Ty) -> Result<Vec<i32>> {
        let mut v = [0i32; 32];
        // SAFETY: the notes are C enums, int-sized.
        let n = unsafe { self.get(attr, ty, &mut v) }?;
        Ok(v[..n.min(v.len())].to_vec())
    }

    /// How many descriptors `attr` holds.
    pub(super) fn count_descriptors(&self, attr: Attr) -> Result<usize> {
        let mut count = 0i64;
        // SAFETY: a query of the count only (no elements requested).
        let status = unsafe {
            sys::cudnnBackendGetAttribute(self.raw, attr, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &mut count, null_mut())
        };
        check("cudnnBackendGetAttribute", status).map_err(attr_error("cudnnBackendGetAttribute", attr))?;
        Ok(count.max(0) as usize)
    }

    /// The first `count` descriptors of `attr`, into new descriptors of `kind` (cuDNN fills
    /// descriptors the caller made).
    pub(super) fn get_descriptors(&self, attr: Attr, kind: Kind, count: usize) -> Result<Vec<Descriptor>> {
        let out = (0..count).map(|_| Descriptor::new(kind)).collect::<Result<Vec<_>>>()?;
        let mut raw: Vec<sys::cudnnBackendDescriptor_t> = out.iter().map(|d| d.raw).collect();
        // SAFETY: BACKEND_DESCRIPTOR elements are cudnnBackendDescriptor_t, each made above.
        let n = unsafe { self.get(attr, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &mut raw) }?;
        Ok(out.into_iter().take(n).collect())
    }
}
