//! AdamW (PyTorch's `torch.optim.AdamW`: decoupled weight decay) over all parameters in one
//! launch: parameters, gradients and both moments each live in one flat buffer, as in llm.c. The
//! master weights and moments are f32; the gradients have the model's type, f32 or bf16, and for
//! a bf16 model the launch also writes its bf16 weights from the updated master weights (mixed
//! precision). One CUDA template in `adamw.cu`, one generic CPU path here.
//!
//! The learning rate and the step count t are read from device memory, not passed as scalars
//! (which a captured graph would freeze): write the `lr` tensor (e.g. with
//! [`elementwise::fill`](super::elementwise::fill)) before each step to follow a schedule, and
//! advance `t` with [`rng::step_add`] before each step (captured with the
//! step, it advances on every replay). The other hyperparameters are launch scalars: changing
//! them needs a new capture.
//!
//! Note [Non-finite guard]: a step first reads every gradient once (`nonfinite_scan`, as PyTorch's
//! GradScaler finds infs) and records a non-finite one in the *guard*, four `u64` on the device
//! ([`nonfinite_guard`]): the last and the first step t that had one, the flat index of the first
//! non-finite gradient of that first step, and the number of skipped updates. The update launch
//! reads the guard and, when it says so ([`NonFinite`]), writes nothing: parameters, moments and
//! bf16 weights keep their values. No host sync is needed, so the step stays capturable; the host
//! reads the guard when it chooses ([`read_guard`]). The scan costs one more read of the
//! gradients per step (4 bytes a parameter in f32, 2 in bf16, beside the update's 28) and
//! one launch.
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
//! elementwise::fill(lr.view::<f32>()?, 0.1, &s)?;
//! rng::step_add(&t, 1, &s)?;
//! let hyper = adamw::AdamWHyper { weight_decay: 0.0, ..adamw::AdamWHyper::default() };
//! let guard = adamw::nonfinite_guard(&alloc, &s)?;
//! adamw::adamw_step(&params, None, &grads, &m, &v, &lr, &t, &guard, &hyper, &s)?;
//! let p = params.to_vec::<f32>(&s)?; // the first step moves each parameter by about lr against its gradient
//! assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] + 0.9).abs() < 1e-6);
//! # Ok::<(), graphed::Error>(())
//! ```

use std::cell::RefMut;

use half::bf16;

use super::rng;
use super::{dense, lanes, stride_dims};
use crate::device::{args, CpuArgs, DType, Float, In, InOut, Kernel, Out, Stream, View};
use crate::memory::CachingAllocator;
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("adamw.cu"));

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
    /// What a step does when a gradient is not finite (see Note [Non-finite guard]).
    pub nonfinite: NonFinite,
}

impl Default for AdamWHyper {
    /// PyTorch's defaults, and [`NonFinite::Stop`].
    fn default() -> AdamWHyper {
        AdamWHyper { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, nonfinite: NonFinite::Stop }
    }
}

/// What an AdamW step does when one of its gradients is infinite or NaN (Note [Non-finite
/// guard]). Either way the step counter, and with it the learning-rate schedule, advances, so
/// step numbers stay those of the training loop (unlike PyTorch's GradScaler, which does not call
/// the optimizer's step at all, a skipped step counts in later bias corrections).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonFinite {
    /// Skip this update and every later one: the guard is sticky, so parameters and moments stay
    /// those of the last good step until the host reads the guard and stops the run.
    #[default]
    Stop,
    /// Skip this update only, count it, and update again at the next step whose gradients are
    /// all finite.
    Skip,
}

/// The guard's slots, as `adamw.cu`'s `GUARD_*`: the last and the first step with a non-finite
/// gradient (0 for none), the flat index of the first step's first non-finite gradient
/// (`u64::MAX` for none), and the skipped updates.
const GUARD_LAST: usize = 0;
const GUARD_FIRST: usize = 1;
const GUARD_INDEX: usize = 2;
const GUARD_SKIPPED: usize = 3;
const GUARD_LEN: usize = 4;

/// A new guard (Note [Non-finite guard]): no non-finite gradient seen, no update skipped. It is
/// optimizer state, to be kept in a checkpoint with the moments.
///
/// # Errors
/// As the allocation.
pub fn nonfinite_guard(alloc: &CachingAllocator, stream: &Stream) -> Result<Tensor> {
    let mut fresh = [0u64; GUARD_LEN];
    fresh[GUARD_INDEX] = u64::MAX;
    Tensor::from_host(alloc, stream, &fresh, &[GUARD_LEN])
}

/// What a guard has recorded, read on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuardRecord {
    /// The first step with a non-finite gradient (the value of the step counter t at that
    /// step, 1-based) and the flat index of its first non-finite gradient; `None` while every
    /// gradient was finite.
    pub first: Option<(u64, u64)>,
    /// Updates skipped: under [`NonFinite::Stop`] every step from the first non-finite one on,
    /// under [`NonFinite::Skip`] the steps that had one.
    pub skipped: u64,
}

/// Reads `guard` after the work queued on `stream` (a host sync).
///
/// # Errors
/// [`Error::Shape`] unless `guard` is a guard ([`nonfinite_guard`]); device errors.
pub fn read_guard(guard: &Tensor, stream: &Stream) -> Result<GuardRecord> {
    guard_view("read_guard", guard)?;
    let g = guard.to_vec::<u64>(stream)?;
    let first = (g[GUARD_FIRST] != 0).then_some((g[GUARD_FIRST], g[GUARD_INDEX]));
    Ok(GuardRecord { first, skipped: g[GUARD_SKIPPED] })
}

/// The dense u64 view of a guard, refused unless it has the guard's length.
fn guard_view<'t>(op: &'static str, guard: &'t Tensor) -> Result<View<'t, u64>> {
    if guard.numel() != GUARD_LEN {
        return Err(Error::Shape {
            op,
            expected: format!("a non-finite guard of {GUARD_LEN} u64 (adamw::nonfinite_guard)"),
            found: guard.shape().to_vec(),
        });
    }
    dense::<u64>(op, guard)
}

/// The guard a CPU path received.
fn guard_of(a: &CpuArgs) -> Result<RefMut<'_, [u64]>> {
    let guard = a.output::<u64>("guard")?;
    if guard.len() != GUARD_LEN {
        return Err(Error::KernelArg {
            kernel: a.kernel.name,
            param: "guard".into(),
            expected: format!("a u64 buffer of {GUARD_LEN} elements"),
            found: format!("{} elements", guard.len()),
        });
    }
    Ok(guard)
}

const SCAN_PARAMS: [&str; 4] = ["guard", "grads", "step", "n"];

/// Records a non-finite f32 gradient in the guard (Note [Non-finite guard]).
pub static NONFINITE_SCAN: Kernel = Kernel {
    name: "nonfinite_scan_f32",
    source: SOURCE,
    params: &SCAN_PARAMS,
    cpu: nonfinite_scan_cpu::<f32>,
    strided: false,
};

/// Records a non-finite bf16 gradient in the guard (Note [Non-finite guard]).
pub static NONFINITE_SCAN_BF16: Kernel = Kernel {
    name: "nonfinite_scan_bf16",
    source: SOURCE,
    params: &SCAN_PARAMS,
    cpu: nonfinite_scan_cpu::<bf16>,
    strided: false,
};

/// The lowest index of a non-finite gradient, recorded as `adamw.cu` records it.
fn nonfinite_scan_cpu<M: Float>(a: &CpuArgs) -> Result<()> {
    let t = rng::step_of(a, "step")?;
    let Some(bad) = a.input::<M>("grads")?.iter().position(|g| !g.to_f32().is_finite()) else {
        return Ok(());
    };
    let mut guard = guard_of(a)?;
    guard[GUARD_LAST] = t;
    if guard[GUARD_FIRST] == 0 || guard[GUARD_FIRST] == t {
        guard[GUARD_FIRST] = t;
        guard[GUARD_INDEX] = guard[GUARD_INDEX].min(bad as u64);
    }
    Ok(())
}

const F32_PARAMS: [&str; 13] =
    ["params", "m", "v", "grads", "lr", "step", "guard", "beta1", "beta2", "eps", "weight_decay", "stop", "n"];

/// One AdamW step of every parameter of an f32 model (its weights are the master weights).
pub static ADAMW: Kernel =
    Kernel { name: "adamw_f32", source: SOURCE, params: &F32_PARAMS, cpu: adamw_cpu::<f32>, strided: false };

/// One AdamW step of every parameter of a bf16 model: the f32 master weights updated from bf16
/// gradients, and the model's bf16 weights rewritten as the rounding of the new master weights.
pub static ADAMW_BF16: Kernel = Kernel {
    name: "adamw_bf16",
    source: SOURCE,
    params: &[
        "params",
        "weights",
        "m",
        "v",
        "grads",
        "lr",
        "step",
        "guard",
        "beta1",
        "beta2",
        "eps",
        "weight_decay",
        "stop",
        "n",
    ],
    cpu: adamw_cpu::<bf16>,
    strided: false,
};

/// The update of the model type `M`'s weights: f32 (no copy to write) or bf16; none when the
/// guard says to skip it.
fn adamw_cpu<M: Float>(a: &CpuArgs) -> Result<()> {
    let step = rng::step_of(a, "step")?;
    {
        let mut guard = guard_of(a)?;
        let skip = if a.u32("stop")? != 0 { guard[GUARD_FIRST] != 0 } else { guard[GUARD_LAST] == step };
        if skip {
            guard[GUARD_SKIPPED] = guard[GUARD_SKIPPED].wrapping_add(1);
            return Ok(());
        }
    }
    let (grads, lr) = (a.input::<M>("grads")?, a.input::<f32>("lr")?);
    let (beta1, beta2, eps, weight_decay) = (a.f32("beta1")?, a.f32("beta2")?, a.f32("eps")?, a.f32("weight_decay")?);
    let (mut params, mut m, mut v) = (a.output::<f32>("params")?, a.output::<f32>("m")?, a.output::<f32>("v")?);
    let mut weights = if M::DTYPE == DType::F32 { None } else { Some(a.output::<M>("weights")?) };
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
    for (i, (((p, m), v), g)) in all.enumerate() {
        let g = g.to_f32();
        *m += (1.0 - beta1) * (g - *m);
        *v = beta2 * *v + (1.0 - beta2) * g * g;
        let denom = v.sqrt() / bias2_sqrt + eps;
        *p = *p * (1.0 - rate * weight_decay) - (rate / bias1) * (*m / denom);
        if let Some(w) = weights.as_mut() {
            w[i] = M::from_f32(*p);
        }
    }
    Ok(())
}

/// [`adamw_step`]'s name in its errors.
const OP: &str = "adamw_step";

/// One AdamW step: updates the f32 master weights `params` and the f32 moments `m` and `v`
/// (zero before the first step) from `grads`, all contiguous with equal element counts; `lr` is
/// a one-element f32 tensor and `t` a one-element step counter holding this step's 1-based
/// number (0 would divide by a zero bias correction: advance it before the step).
///
/// Two launches: the scan of the gradients into `guard` ([`nonfinite_guard`]), then the update,
/// which writes nothing when the guard and `hyper.nonfinite` say to skip it (Note [Non-finite
/// guard]).
///
/// The gradients have the model's element type. For an f32 model, pass `weights: None`: `params`
/// are its weights and `grads` are f32. For a bf16 model (mixed precision), `params` is its f32
/// master copy, `grads` are bf16, and `weights` its bf16 weights, which the same launch sets to
/// `bf16(params)` after the update (round to nearest even), so they always equal the rounded
/// master weights bitwise.
///
/// # Errors
/// [`Error::DTypeMismatch`] for `params`, `m`, `v` or `lr` not f32, or gradients not of the
/// weights' type (f32 without `weights`); [`Error::UnsupportedDType`] for `weights` not bf16 or
/// gradients neither f32 nor bf16; [`Error::Shape`] for unequal element counts or an `lr` or `t`
/// that is not one element or a `guard` that is not a guard; [`Error::NotContiguous`] for a
/// strided tensor; all before anything is enqueued.
#[allow(clippy::too_many_arguments)] // llm.c's order: parameter buffers, device scalars, hyperparameters, stream
pub fn adamw_step(
    params: &Tensor,
    weights: Option<&Tensor>,
    grads: &Tensor,
    m: &Tensor,
    v: &Tensor,
    lr: &Tensor,
    t: &Tensor,
    guard: &Tensor,
    hyper: &AdamWHyper,
    stream: &Stream,
) -> Result<()> {
    let n = check_step(params, weights, grads, (m, v), lr)?;
    let len = params.numel();
    let (p, mm, vv, rate, step, gv) = (
        dense::<f32>(OP, params)?,
        dense::<f32>(OP, m)?,
        dense::<f32>(OP, v)?,
        dense::<f32>(OP, lr)?,
        rng::step_view(OP, t)?,
        guard_view(OP, guard)?,
    );
    let AdamWHyper { beta1, beta2, eps, weight_decay, nonfinite } = *hyper;
    let stop = u32::from(nonfinite == NonFinite::Stop);
    match weights {
        None => {
            let g = dense::<f32>(OP, grads)?;
            if len == 0 {
                return Ok(());
            }
            let scan = args![InOut(gv), In(g), In(step), n];
            stream.launch(&NONFINITE_SCAN, stride_dims(len.div_ceil(lanes::<f32>())), &scan)?;
            let list = args![
                InOut(p),
                InOut(mm),
                InOut(vv),
                In(g),
                In(rate),
                In(step),
                InOut(gv),
                beta1,
                beta2,
                eps,
                weight_decay,
                stop,
                n
            ];
            stream.launch(&ADAMW, stride_dims(len), &list)
        }
        Some(w) => {
            let (w, g) = (dense::<bf16>(OP, w)?, dense::<bf16>(OP, grads)?);
            if len == 0 {
                return Ok(());
            }
            let scan = args![InOut(gv), In(g), In(step), n];
            stream.launch(&NONFINITE_SCAN_BF16, stride_dims(len.div_ceil(lanes::<bf16>())), &scan)?;
            let list = args![
                InOut(p),
                Out(w),
                InOut(mm),
                InOut(vv),
                In(g),
                In(rate),
                In(step),
                InOut(gv),
                beta1,
                beta2,
                eps,
                weight_decay,
                stop,
                n
            ];
            stream.launch(&ADAMW_BF16, stride_dims(len), &list)
        }
    }
}

/// [`adamw_step`]'s checks of its tensors' types and sizes, before anything is enqueued; the
/// element count as the kernels take it.
fn check_step(
    params: &Tensor,
    weights: Option<&Tensor>,
    grads: &Tensor,
    (m, v): (&Tensor, &Tensor),
    lr: &Tensor,
) -> Result<u32> {
    for f in [params, m, v, lr] {
        f.expect_dtype(OP, DType::F32)?;
    }
    let model = match weights {
        None => DType::F32,
        Some(w) if w.dtype() == DType::BF16 => DType::BF16,
        Some(w) => {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: w.dtype(),
                supported: "bf16 model weights (an f32 model's weights are the params themselves: pass None)",
            })
        }
    };
    if !matches!(grads.dtype(), DType::F32 | DType::BF16) {
        return Err(Error::UnsupportedDType { op: OP, dtype: grads.dtype(), supported: super::FLOATS });
    }
    grads.expect_dtype(OP, model)?;
    let len = params.numel();
    for other in [Some(grads), Some(m), Some(v), weights].into_iter().flatten() {
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
    u32::try_from(len).map_err(|_| Error::Unsupported {
        op: OP,
        backend: "any",
        why: "2^32 parameters or more are not supported by this kernel; step them in slices",
    })
}
