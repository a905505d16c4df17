//! Parameters: slices of one flat buffer, with gradients in a second buffer of the same layout.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// One parameter: its value and its gradient, views into the store's two flat buffers.
#[derive(Clone, Debug)]
pub struct Param {
    /// Name, for reports and checkpoints.
    pub name: String,
    /// The value.
    pub value: Tensor,
    /// The gradient (accumulated by backward passes).
    pub grad: Tensor,
}

/// All parameters of a model in one flat buffer (and their gradients in another), so that the
/// optimizer touches every parameter in one launch. Values and gradients are f32 ([`new`]) or
/// bf16 ([`with_dtype`]: mixed precision, where an optimizer keeps f32 master weights).
///
/// Parameters are added through a shared reference (the layout sits behind a lock), so that a
/// [`Builder`](super::Builder) and its prefixed copies (`vb.pp("h0")`) can all add to one store.
///
/// [`new`]: ParamStore::new
/// [`with_dtype`]: ParamStore::with_dtype
pub struct ParamStore {
    alloc: CachingAllocator,
    values: Tensor,
    grads: Tensor,
    layout: Mutex<Layout>,
}

/// Where the parameters added so far lie in the flat buffers.
#[derive(Default)]
struct Layout {
    /// Elements taken.
    used: usize,
    /// Each parameter's name, offset and shape, in the order added.
    entries: Vec<(String, usize, Vec<usize>)>,
}

impl ParamStore {
    /// Room for `capacity` f32 parameters (elements), zeroed, with zeroed gradients. Each module
    /// says how many it adds (`TransformerLayer::parameter_count(dim)`, ...): sum those.
    pub fn new(alloc: &CachingAllocator, stream: &Stream, capacity: usize) -> Result<ParamStore> {
        ParamStore::with_dtype(alloc, stream, capacity, DType::F32)
    }

    /// As [`new`](ParamStore::new), with values and gradients of `dtype`, f32 or bf16.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] for another element type.
    pub fn with_dtype(alloc: &CachingAllocator, stream: &Stream, capacity: usize, dtype: DType) -> Result<ParamStore> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(crate::ops::unsupported_dtype("ParamStore::with_dtype", dtype));
        }
        let (values, grads) =
            (Tensor::zeros(alloc, stream, &[capacity], dtype)?, Tensor::zeros(alloc, stream, &[capacity], dtype)?);
        Ok(ParamStore { alloc: alloc.clone(), values, grads, layout: Mutex::default() })
    }

    /// The layout, whatever a panicking holder left (each add updates it at its very end).
    fn layout(&self) -> MutexGuard<'_, Layout> {
        self.layout.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The element type of values and gradients.
    pub fn dtype(&self) -> DType {
        self.values.dtype()
    }

    /// A new parameter of `shape`, set to `init` (row-major; rounded to nearest even in a bf16
    /// store) after the work queued on `stream`. Modules add theirs through a
    /// [`Builder`](super::Builder), which prefixes the names.
    pub fn add(&self, name: &str, shape: &[usize], init: &[f32], stream: &Stream) -> Result<Param> {
        let n: usize = shape.iter().product();
        if init.len() != n {
            return Err(Error::Shape {
                op: "ParamStore::add",
                expected: format!("{} initial values", init.len()),
                found: shape.to_vec(),
            });
        }
        let mut layout = self.layout();
        if layout.used + n > self.values.numel() {
            return Err(Error::Shape {
                op: "ParamStore::add",
                expected: format!(
                    "at most {} more elements; size the store with the parameter_count of the modules it holds",
                    self.values.numel() - layout.used
                ),
                found: shape.to_vec(),
            });
        }
        let value = self.values.narrow(0, layout.used, n)?.reshape(shape)?;
        let grad = self.grads.narrow(0, layout.used, n)?.reshape(shape)?;
        let staging = Tensor::from_host(&self.alloc, stream, init, &[n])?;
        crate::ops::cast::cast(&value.reshape(&[n])?, &staging, stream)?;
        let offset = layout.used;
        layout.entries.push((name.to_string(), offset, shape.to_vec()));
        layout.used += n;
        Ok(Param { name: name.to_string(), value, grad })
    }

    /// Every parameter value, as one flat tensor (the used part).
    pub fn values(&self) -> Result<Tensor> {
        self.values.narrow(0, 0, self.layout().used)
    }

    /// Every parameter's value by name, in the order added (views of the flat buffer): what a
    /// checkpoint keeps, under the names the modules gave them (`h0.attn.qkv.weight`).
    pub fn named_values(&self) -> Result<Vec<(String, Tensor)>> {
        (self.layout().entries.iter())
            .map(|(name, offset, shape)| {
                let n = shape.iter().product();
                Ok((name.clone(), self.values.narrow(0, *offset, n)?.reshape(shape)?))
            })
            .collect()
    }

    /// Each parameter's name and where it lies in the flat buffers of values and gradients (in
    /// elements), in the order added.
    pub fn ranges(&self) -> Vec<(String, std::ops::Range<usize>)> {
        (self.layout().entries.iter())
            .map(|(name, offset, shape)| (name.clone(), *offset..*offset + shape.iter().product::<usize>()))
            .collect()
    }

    /// Every gradient, as one flat tensor (the used part).
    pub fn grads(&self) -> Result<Tensor> {
        self.grads.narrow(0, 0, self.layout().used)
    }

    /// The gradients of every parameter not in `params`, as few flat tensors as the layout
    /// allows (each a run of parameters added one after another): what a data-parallel step
    /// reduces eagerly besides the buckets of its graphed layers (the embedding and the head).
    pub fn grads_outside(&self, params: &[&Param]) -> Result<Vec<Tensor>> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (name, offset, shape) in &self.layout().entries {
            if params.iter().any(|p| p.name == *name) {
                continue;
            }
            let n: usize = shape.iter().product();
            match runs.last_mut() {
                Some((start, len)) if *start + *len == *offset => *len += n,
                _ => runs.push((*offset, n)),
            }
        }
        runs.into_iter().map(|(start, n)| self.grads.narrow(0, start, n)).collect()
    }

    /// The gradients of `params` (a module's, added one after another) as one flat tensor: a
    /// bucket for the data-parallel reduction.
    ///
    /// # Errors
    /// [`Error::Shape`] when a parameter is not of this store, or the parameters' gradients are
    /// not one contiguous range.
    pub fn grads_of(&self, params: &[&Param]) -> Result<Tensor> {
        let mut ranges = params.iter().map(|p| self.grad_range(p)).collect::<Result<Vec<_>>>()?;
        ranges.sort_unstable_by_key(|r| r.start);
        let start = ranges.first().map_or(0, |r| r.start);
        let mut end = start;
        for r in ranges {
            if r.start != end {
                return Err(Error::Shape {
                    op: "ParamStore::grads_of",
                    expected: "parameters added one after another (one contiguous range of gradients)".into(),
                    found: vec![end, r.start],
                });
            }
            end = r.end;
        }
        self.grads.narrow(0, start, end - start)
    }

    /// Where `p`'s gradient lies in the store's flat gradient buffer, in elements.
    ///
    /// # Errors
    /// [`Error::Shape`] when `p` is not a parameter of this store.
    pub fn grad_range(&self, p: &Param) -> Result<std::ops::Range<usize>> {
        match self.ranges().into_iter().find(|(name, _)| *name == p.name) {
            Some((_, range)) => Ok(range),
            None => Err(Error::Shape {
                op: "ParamStore::grad_range",
                expected: format!("a parameter of this store, not `{}`", p.name),
                found: p.value.shape().to_vec(),
            }),
        }
    }
}

/// `n` values uniform in ±`bound` from `seed` (a 64-bit LCG): parameter initialization that is the
/// same on every device and every run.
pub(crate) fn init_uniform(n: usize, bound: f32, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * bound
        })
        .collect()
}
