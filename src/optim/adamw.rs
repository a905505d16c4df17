//! AdamW over every parameter of a store, with its moments, step counter and learning rate on
//! the device, and for a bf16 store (mixed precision) its f32 master weights.

use std::ops::Range;

use crate::device::{DType, RangeName, Stream};
use crate::memory::CachingAllocator;
use crate::nn::{Fp8Training, ParamStore};
use crate::ops::adamw::{adamw_step, nonfinite_guard, read_guard, AdamWHyper, NonFinite};
use crate::ops::schedule::{lr_schedule_step, LrSchedule};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// AdamW (PyTorch's `torch.optim.AdamW`) over one [`ParamStore`]: its moments, step counter and
/// learning rate live on the device, so [`step`](AdamW::step) enqueues four launches and no
/// host work, and a graph of it (`graph::make_graphed_fn`) follows the schedule on every replay.
///
/// Over a bf16 store (mixed precision) it owns f32 master weights, which start from the store's
/// values widened on the device (as PyTorch's `param.float()` of a bf16 model: no host copy of a
/// model that may not fit in host memory), take every update in f32, and are rounded into the
/// store's bf16 values by the same launch; the gradients stay bf16. The moments are f32 either
/// way.
///
/// A step whose gradients are not all finite updates nothing (`ops::adamw`'s Note [Non-finite
/// guard]): under [`NonFinite::Stop`] (the default) neither does any later step, and
/// [`check_finite`](AdamW::check_finite) names the step; under [`NonFinite::Skip`] training goes
/// on and [`skipped_steps`](AdamW::skipped_steps) counts them. The check runs on the device
/// inside the step; only those two calls wait for it.
///
/// ```
/// use graphed::device::Device;
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::ParamStore;
/// use graphed::ops::elementwise;
/// use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &s, 2)?;
/// let p = store.add("p", &[2], &[1.0, -1.0], &s)?;
/// let hyper = AdamWHyper { weight_decay: 0.0, ..AdamWHyper::default() };
/// let opt = AdamW::new(&alloc, &store, hyper, LrSchedule::Constant(0.1), &s)?;
/// elementwise::fill(p.grad.view::<f32>()?, 0.5, &s)?;
/// opt.step(&s)?;
/// let v = p.value.to_vec::<f32>(&s)?; // the first step moves each parameter by about lr against its gradient
/// assert!((v[0] - 0.9).abs() < 1e-6 && (v[1] + 1.1).abs() < 1e-6);
/// assert_eq!((opt.steps(&s)?, p.grad.to_vec::<f32>(&s)?), (1, vec![0.0, 0.0]));
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct AdamW {
    /// The f32 weights it updates: the store's values, or its own master copy of a bf16 store's.
    params: Tensor,
    /// A bf16 store's values, rewritten from `params` by every step; `None` for an f32 store.
    weights: Option<Tensor>,
    grads: Tensor,
    m: Tensor,
    v: Tensor,
    lr: Tensor,
    step: Tensor,
    /// What the steps found of non-finite gradients (`ops::adamw::nonfinite_guard`).
    guard: Tensor,
    /// Each parameter's name and range in the flat buffers, to name a non-finite gradient.
    names: Vec<(String, Range<usize>)>,
    hyper: AdamWHyper,
    schedule: LrSchedule,
    /// The range of its steps (`optimizer step`), made once.
    range: RangeName,
    /// FP8 training's state, stepped after every update.
    fp8: Option<Fp8Training>,
}

impl AdamW {
    /// An optimizer of every parameter of `store`, with zero moments and no step taken; for a
    /// bf16 store, with f32 master weights widened from its values after the work queued on
    /// `stream`.
    ///
    /// # Errors
    /// As the allocations.
    pub fn new(
        alloc: &CachingAllocator,
        store: &ParamStore,
        hyper: AdamWHyper,
        schedule: LrSchedule,
        stream: &Stream,
    ) -> Result<AdamW> {
        let (values, grads) = (store.values()?, store.grads()?);
        let (params, weights) = match values.dtype() {
            DType::F32 => (values, None),
            DType::BF16 => {
                let master = Tensor::uninit(alloc, stream, values.shape(), DType::F32)?;
                crate::ops::cast::cast(&master, &values, stream)?;
                (master, Some(values))
            }
            dtype => return Err(crate::ops::unsupported_dtype("AdamW::new", dtype)),
        };
        let zeros = |shape: &[usize]| Tensor::zeros(alloc, stream, shape, DType::F32);
        let (m, v, lr) = (zeros(params.shape())?, zeros(params.shape())?, zeros(&[1])?);
        let step = Tensor::zeros(alloc, stream, &[1], DType::U64)?;
        let guard = nonfinite_guard(alloc, stream)?;
        let names = store.ranges();
        let range = RangeName::new("optimizer step");
        Ok(AdamW { params, weights, grads, m, v, lr, step, guard, names, hyper, schedule, range, fp8: None })
    }

    /// The same optimizer, each step followed by `fp8`'s ([`Fp8Training::step`]): the scales
    /// updated and the weights quantized once, right after the launch that rewrites them, so
    /// that a graph of the step covers both and every microbatch of the next step reads the same
    /// FP8 weights.
    pub fn with_fp8(self, fp8: &Fp8Training) -> AdamW {
        AdamW { fp8: Some(fp8.clone()), ..self }
    }

    /// One step, enqueued on `stream`: the step counter advances, the learning rate of the new
    /// step is written, the gradients are checked, every parameter is updated from its gradient
    /// (a bf16 store's values rewritten from the master weights in the same launch) unless a
    /// gradient is not finite (see [`NonFinite`]), and the gradients are zeroed for the next
    /// accumulation.
    /// Its profiler range is `optimizer step` (inside a graph's capture when graphed: name the
    /// replays with [`GraphedFn::with_name`](crate::graph::GraphedFn::with_name)).
    pub fn step(&self, stream: &Stream) -> Result<()> {
        let _range = stream.device().range(&self.range);
        lr_schedule_step(&self.step, &self.lr, &self.schedule, stream)?;
        let (p, w) = (&self.params, self.weights.as_ref());
        let (g, guard) = (&self.grads, &self.guard);
        adamw_step(p, w, g, &self.m, &self.v, &self.lr, &self.step, guard, &self.hyper, stream)?;
        if let Some(fp8) = &self.fp8 {
            fp8.step(stream)?;
        }
        self.grads.zero(stream)
    }

    /// The f32 weights it updates, flat in the store's layout: the store's values for an f32
    /// store, its master copy for a bf16 store (whose values are their rounding).
    pub fn master(&self) -> &Tensor {
        &self.params
    }

    /// Steps taken (read from the device after the work queued on `stream`).
    pub fn steps(&self, stream: &Stream) -> Result<u64> {
        Ok(self.step.to_vec(stream)?[0])
    }

    /// Whether training may go on: under [`NonFinite::Stop`], an error naming the first step that
    /// had a non-finite gradient, after which nothing was updated; under [`NonFinite::Skip`],
    /// always `Ok` (see [`skipped_steps`](AdamW::skipped_steps)). Reads the device after the
    /// work queued on `stream` (a host sync): call it when the loop reads the loss, and before
    /// saving a checkpoint.
    ///
    /// # Errors
    /// [`Error::NonFinite`] with the step, the parameter of its first non-finite gradient and
    /// the updates skipped; device errors.
    pub fn check_finite(&self, stream: &Stream) -> Result<()> {
        let record = read_guard(&self.guard, stream)?;
        match (self.hyper.nonfinite, record.first) {
            (NonFinite::Stop, Some((step, index))) => {
                let index = usize::try_from(index).unwrap_or(usize::MAX);
                let param = match self.names.iter().find(|(_, r)| r.contains(&index)) {
                    Some((name, _)) => name.clone(),
                    None => format!("element {index}"),
                };
                Err(Error::NonFinite { step, param, skipped: record.skipped })
            }
            _ => Ok(()),
        }
    }

    /// Updates skipped for a non-finite gradient: under [`NonFinite::Skip`] the steps that had
    /// one, under [`NonFinite::Stop`] every step from the first of those on (read from the
    /// device after the work queued on `stream`).
    pub fn skipped_steps(&self, stream: &Stream) -> Result<u64> {
        Ok(read_guard(&self.guard, stream)?.skipped)
    }

    /// The learning rate of the last step (read from the device after the work on `stream`).
    pub fn learning_rate(&self, stream: &Stream) -> Result<f32> {
        Ok(self.lr.to_vec(stream)?[0])
    }

    /// The first and second moments, flat, in the store's layout.
    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.m, &self.v)
    }

    /// Its state on the device, by name, for a checkpoint: the f32 master weights of a bf16
    /// store (`master`; an f32 store's are its values), the moments (`m`, `v`), the step
    /// counter (`step`), the learning rate of the last step (`lr`) and the non-finite guard
    /// (`nonfinite`: under [`NonFinite::Skip`] a resumed run goes on counting skipped steps;
    /// under [`NonFinite::Stop`] a checkpoint saved after [`check_finite`](AdamW::check_finite)
    /// passed holds a clean one). Restoring them and the store's values continues training bit
    /// for bit.
    pub fn state(&self) -> Vec<(&'static str, &Tensor)> {
        let master = self.weights.as_ref().map(|_| ("master", &self.params));
        let rest = [("m", &self.m), ("v", &self.v), ("step", &self.step), ("lr", &self.lr), ("nonfinite", &self.guard)];
        master.into_iter().chain(rest).collect()
    }

    /// The hyperparameters other than the learning rate.
    pub fn hyper(&self) -> &AdamWHyper {
        &self.hyper
    }

    /// The learning-rate schedule.
    pub fn schedule(&self) -> &LrSchedule {
        &self.schedule
    }
}
