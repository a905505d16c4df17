//! What a module keeps for its backward: a tensor still on the device, or one its save hook took
//! away (an offloader copied it to host memory) and gives back when the backward asks.

use crate::device::Stream;
use crate::tensor::Tensor;
use crate::Result;

/// Gives a saved tensor back to the backward: a save hook's handle to a tensor it moved.
pub trait Restore: Send {
    /// The tensor, on the device, ready for work enqueued on `stream` after this call.
    ///
    /// # Errors
    /// The hook's own (a reload that cannot be issued, a handle used out of order).
    fn restore(self: Box<Self>, stream: &Stream) -> Result<Tensor>;
}

/// A tensor a module saved for its backward, as its [`SaveHook`](super::SaveHook) handed it
/// back: kept on the device, or away until [`take`](SavedTensor::take).
///
/// ```
/// use graphed::device::{DType, Device};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::SavedTensor;
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let saved = SavedTensor::kept(Tensor::zeros(&alloc, &s, &[4], DType::F32)?);
/// assert!(saved.is_kept());
/// assert_eq!(saved.take(&s)?.shape(), &[4]);
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct SavedTensor(Holder);

enum Holder {
    Kept(Tensor),
    Away(Box<dyn Restore>),
    /// A reload that failed in [`SavedTensor::peek`].
    Gone,
}

impl SavedTensor {
    /// A tensor that stays on the device.
    pub fn kept(t: Tensor) -> SavedTensor {
        SavedTensor(Holder::Kept(t))
    }

    /// A tensor a hook took away; `restore` gives it back.
    pub fn away(restore: Box<dyn Restore>) -> SavedTensor {
        SavedTensor(Holder::Away(restore))
    }

    /// Whether it stayed on the device.
    pub fn is_kept(&self) -> bool {
        matches!(self.0, Holder::Kept(_))
    }

    /// The tensor, for work enqueued on `stream` (the backward's stream).
    ///
    /// # Errors
    /// The hook's, for a tensor that was away.
    pub fn take(self, stream: &Stream) -> Result<Tensor> {
        match self.0 {
            Holder::Kept(t) => Ok(t),
            Holder::Away(r) => r.restore(stream),
            Holder::Gone => Err(gone()),
        }
    }

    /// The tensor, for work enqueued on `stream`, read before the backward that
    /// [`take`](SavedTensor::take)s it (a recomputation from it): a tensor that was away comes
    /// back once and is kept from then on.
    ///
    /// # Errors
    /// The hook's, for a tensor that was away; the tensor is then gone.
    pub fn peek(&mut self, stream: &Stream) -> Result<Tensor> {
        if let Holder::Kept(t) = &self.0 {
            return Ok(t.clone());
        }
        let Holder::Away(r) = std::mem::replace(&mut self.0, Holder::Gone) else { return Err(gone()) };
        let t = r.restore(stream)?;
        self.0 = Holder::Kept(t.clone());
        Ok(t)
    }
}

/// A backward's input: the tensor its forward saved, else `given` (the caller's recomputation
/// of it, for a forward that did not save it).
///
/// # Errors
/// [`Error::Unsupported`](crate::Error::Unsupported) naming `op` when neither is there; the save
/// hook's, for a saved tensor that was away.
pub(crate) fn saved_or_given(
    saved: Option<SavedTensor>,
    given: Option<&Tensor>,
    op: &'static str,
    stream: &Stream,
) -> Result<Tensor> {
    match (saved, given) {
        (Some(saved), _) => saved.take(stream),
        (None, Some(t)) => Ok(t.clone()),
        (None, None) => Err(crate::Error::Unsupported {
            op,
            backend: "any",
            why: "the forward did not save its input (its layer recomputes it): run the backward through that layer",
        }),
    }
}

/// What reading a saved tensor whose reload failed in [`SavedTensor::peek`] gives.
fn gone() -> crate::Error {
    crate::Error::Unsupported {
        op: "SavedTensor::take",
        backend: "any",
        why: "its reload failed before (see that error); the saved tensor is gone",
    }
}

impl std::fmt::Debug for SavedTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Holder::Kept(t) => write!(f, "SavedTensor::kept({:?})", t.shape()),
            Holder::Away(_) => write!(f, "SavedTensor::away"),
            Holder::Gone => write!(f, "SavedTensor::gone"),
        }
    }
}
