//! AdamW over every parameter of a store, with its moments, step counter and learning rate on
//! the device.

use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::nn::ParamStore;
use crate::ops::adamw::{adamw_step, AdamWHyper};
use crate::ops::schedule::{lr_schedule_step, LrSchedule};
use crate::tensor::Tensor;
use crate::Result;

/// AdamW (PyTorch's `torch.optim.AdamW`) over one [`ParamStore`]: its moments, step counter and
/// learning rate live on the device, so [`step`](AdamW::step) enqueues three launches and no
/// host work, and a graph of it (`graph::make_graphed_fn`) follows the schedule on every replay.
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
/// let mut store = ParamStore::new(&alloc, &s, 2)?;
/// let p = store.add("p", &[2], &[1.0, -1.0], &s)?;
/// let hyper = AdamWHyper { weight_decay: 0.0, ..AdamWHyper::default() };
/// let opt = AdamW::new(&alloc, &store, hyper, LrSchedule::Constant(0.1), &s)?;
/// elementwise::fill(p.grad.view()?, 0.5, &s)?;
/// opt.step(&s)?;
/// let v = p.value.to_vec::<f32>(&s)?; // the first step moves each parameter by about lr against its gradient
/// assert!((v[0] - 0.9).abs() < 1e-6 && (v[1] + 1.1).abs() < 1e-6);
/// assert_eq!((opt.steps(&s)?, p.grad.to_vec::<f32>(&s)?), (1, vec![0.0, 0.0]));
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct AdamW {
    params: Tensor,
    grads: Tensor,
    m: Tensor,
    v: Tensor,
    lr: Tensor,
    step: Tensor,
    hyper: AdamWHyper,
    schedule: LrSchedule,
}

impl AdamW {
    /// An optimizer of every parameter of `store`, with zero moments and no step taken.
    pub fn new(
        alloc: &CachingAllocator,
        store: &ParamStore,
        hyper: AdamWHyper,
        schedule: LrSchedule,
        stream: &Stream,
    ) -> Result<AdamW> {
        let (params, grads) = (store.values()?, store.grads()?);
        let zeros = |shape: &[usize]| Tensor::zeros(alloc, stream, shape, DType::F32);
        let (m, v, lr) = (zeros(params.shape())?, zeros(params.shape())?, zeros(&[1])?);
        let step = Tensor::zeros(alloc, stream, &[1], DType::U64)?;
        Ok(AdamW { params, grads, m, v, lr, step, hyper, schedule })
    }

    /// One step, enqueued on `stream`: the step counter advances, the learning rate of the new
    /// step is written, every parameter is updated from its gradient, and the gradients are
    /// zeroed for the next accumulation.
    pub fn step(&self, stream: &Stream) -> Result<()> {
        lr_schedule_step(&self.step, &self.lr, &self.schedule, stream)?;
        adamw_step(&self.params, &self.grads, &self.m, &self.v, &self.lr, &self.step, &self.hyper, stream)?;
        self.grads.zero(stream)
    }

    /// Steps taken (read from the device after the work queued on `stream`).
    pub fn steps(&self, stream: &Stream) -> Result<u64> {
        Ok(self.step.to_vec(stream)?[0])
    }

    /// The learning rate of the last step (read from the device after the work on `stream`).
    pub fn learning_rate(&self, stream: &Stream) -> Result<f32> {
        Ok(self.lr.to_vec(stream)?[0])
    }

    /// The first and second moments, flat, in the store's layout.
    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.m, &self.v)
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
