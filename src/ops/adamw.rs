//! AdamW (PyTorch's `torch.optim.AdamW`: decoupled weight decay) over all parameters in one
//! launch: parameters, gradients and both moments each live in one flat f32 buffer, as in llm.c.
//! The CPU path sits beside the CUDA entry point in `adamw.cu`.
//!
//! The learning rate and the step count t are read from device memory, not passed as scalars
//! (which a captured graph would freeze): write the `lr` tensor (e.g. with
//! [`elementwise::fill`](super::elementwise::fill)) before each step to follow a schedule, and
//! advance `t` with [`rng::step_add`] before each step (captured with the
//! step, it advances on every replay). The other hyperparameters are launch scalars: changing
//! them needs a new capture.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::{adamw, elementwise, rng};
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let params = Tensor::from_host(&alloc, &s, &[1.0f32, -1.0], &[2])?;
//! let grads = Tensor::from_host(&alloc, &s, &[0.5f32, -0.5], &[2])?;
//! let (m, v) = (Tensor::zeros(&alloc, &s, &[2], graphed::device::DType::F32)?, Tensor::zeros(&alloc, &s, &[2], graphed::device::DType::F32)?);
//! let (lr, t) = (Tensor::zeros(&alloc, &s, &[1], graphed::device::DType::F32)?, Tensor::zeros(&alloc, &s, &[1], graphed::device::DType::U64)?);
//! elementwise::fill(lr.view()?, 0.1, &s)?;
//! rng::step_add(&t, 1, &s)?;
//! let hyper = adamw::AdamWHyper { weight_decay: 0.0, ..adamw::AdamWHyper::default() };
//! adamw::adamw_step(&params, &grads, &m, &v, &lr, &t, &hyper, &s)?;
//! let p = params.to_vec::<f32>(&s)?; // the first step moves each parameter by about lr against its gradient
//! assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] + 0.9).abs() < 1e-6);
//! # Ok::<(), graphed::Error>(())
//! ```

use super::dense;
use super::rng;
use crate::device::{args, CpuArgs, In, InOut, Kernel, LaunchDims, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = include_str!("adamw.cu");

/// AdamW's hyperparameters other than the learning rate (which lives on the device).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the bias-corrected second moment's square root.
    pub eps: f32,
    /// Decoupled weight decay: each step multiplies parameters by `1 − lr·weight_decay`.
    pub weight_decay: f32,
}

impl Default for AdamWHyper {
    /// PyTorch's defaults.
    fn default() -> AdamWHyper {
        AdamWHyper { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// One AdamW step of every parameter.
pub static ADAMW: Kernel = Kernel {
    name: "adamw_f32",
    source: SOURCE,
    params: &["params", "m", "v", "grads", "lr", "step", "beta1", "beta2", "eps", "weight_decay", "n"],
    cpu: adamw_cpu,
    strided: false,
};

fn adamw_cpu(a: &CpuArgs) -> Result<()> {
    let (grads, lr, step) = (a.input::<f32>("grads")?, a.input::<f32>("lr")?, rng::step_of(a, "step")?);
    let (beta1, beta2, eps, weight_decay) = (a.f32("beta1")?, a.f32("beta2")?, a.f32("eps")?, a.f32("weight_decay")?);
    let (mut params, mut m, mut v) = (a.output::<f32>("params")?, a.output::<f32>("m")?, a.output::<f32>("v")?);
    let rate = lr.first().copied().ok_or_else(|| Error::KernelArg {
        kernel: a.kernel.name,
        param: "lr".into(),
        expected: "an f32 buffer of 1 element".into(),
        found: "an empty buffer".into(),
    })?;
    let t = step as f32;
    let bias1 = 1.0 - beta1.powf(t);
    let bias2_sqrt = (1.0 - beta2.powf(t)).sqrt();
    let all = params.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(grads.iter());
    for (((p, m), v), &g) in all {
        *m += (1.0 - beta1) * (g - *m);
        *v = beta2 * *v + (1.0 - beta2) * g * g;
        let denom = v.sqrt() / bias2_sqrt + eps;
        *p = *p * (1.0 - rate * weight_decay) - (rate / bias1) * (*m / denom);
    }
    Ok(())
}

/// One AdamW step: updates `params`, `m` and `v` (moments, zero before the first step) from
/// `grads`, all contiguous with equal element counts; `lr` is a one-element f32 tensor and `t`
/// a one-element step counter holding this step's 1-based number (0 would divide by a zero bias
/// correction: advance it before the step).
///
/// # Errors
/// [`Error::Shape`] for unequal element counts or an `lr` or `t` that is not one element;
/// [`Error::NotContiguous`] for a strided tensor.
#[allow(clippy::too_many_arguments)] // llm.c's order: parameter buffers, device scalars, hyperparameters, stream
pub fn adamw_step(
    params: &Tensor,
    grads: &Tensor,
    m: &Tensor,
    v: &Tensor,
    lr: &Tensor,
    t: &Tensor,
    hyper: &AdamWHyper,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "adamw_step";
    let len = params.numel();
    for other in [grads, m, v] {
        if other.numel() != len {
            return Err(Error::Shape {
                op: OP,
                expected: format!("{len} elements, as params"),
                found: other.shape().to_vec(),
            });
        }
    }
    if lr.numel() != 1 {
        return Err(Error::Shape {
            op: OP,
            expected: "a learning rate of 1 element".into(),
            found: lr.shape().to_vec(),
        });
    }
    let n = u32::try_from(len).map_err(|_| Error::Unsupported {
        op: OP,
        backend: "any",
        why: "2^32 parameters or more are not supported by this kernel; step them in slices",
    })?;
    if len == 0 {
        return Ok(());
    }
    let AdamWHyper { beta1, beta2, eps, weight_decay } = *hyper;
    stream.launch(
        &ADAMW,
        LaunchDims::for_elems(len),
        &args![
            InOut(dense::<f32>(OP, params)?),
            InOut(dense::<f32>(OP, m)?),
            InOut(dense::<f32>(OP, v)?),
            In(dense::<f32>(OP, grads)?),
            In(dense::<f32>(OP, lr)?),
            In(rng::step_view(OP, t)?),
            beta1,
            beta2,
            eps,
            weight_decay,
            n
        ],
    )
}
