//! The optimizer's step counter and learning-rate schedule on the device: one kernel advances
//! the counter and writes the learning rate of the new step, so a captured optimizer step
//! follows the schedule on every replay with no host work. The CPU path beside it computes the
//! same formula in the same (double) precision.

use super::rng::{step_of, step_view};
use crate::device::{args, CpuArgs, InOut, Kernel, LaunchDims, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = include_str!("schedule.cu");

/// How the learning rate moves with the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    /// The same rate at every step.
    Constant(f32),
    /// Linear warmup to `peak` over `warmup` steps, then cosine decay to `floor · peak` at step
    /// `total` (and `floor · peak` after it).
    WarmupCosine {
        /// The rate at the end of the warmup.
        peak: f32,
        /// Steps of linear warmup (at least 1).
        warmup: u64,
        /// The step at which the decay ends.
        total: u64,
        /// The final rate as a fraction of `peak`.
        floor: f32,
    },
}

impl LrSchedule {
    /// The rate of step `s` (0-based), as the kernel computes it.
    pub fn rate(&self, s: u64) -> f32 {
        match *self {
            LrSchedule::Constant(rate) => rate,
            LrSchedule::WarmupCosine { peak, warmup, total, floor } => warmup_cosine(peak, warmup, total, floor, s),
        }
    }
}

fn warmup_cosine(peak: f32, warmup: u64, total: u64, floor: f32, s: u64) -> f32 {
    let peak = f64::from(peak);
    if s < warmup {
        return (peak * (s + 1) as f64 / warmup as f64) as f32;
    }
    let span = if total > warmup { total - warmup } else { 1 };
    let progress = ((s - warmup) as f64 / span as f64).min(1.0);
    let f = f64::from(floor);
    (peak * (f + (1.0 - f) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))) as f32
}

/// Advances the step counter and writes the new step's learning rate.
pub static LR_SCHEDULE_STEP: Kernel = Kernel {
    name: "lr_schedule_step",
    source: SOURCE,
    params: &["step", "lr", "kind", "peak", "warmup", "total", "floor_frac"],
    cpu: lr_schedule_step_cpu,
    strided: false,
};

fn lr_schedule_step_cpu(a: &CpuArgs) -> Result<()> {
    let t = step_of(a, "step")? + 1;
    let (kind, peak, warmup, total, floor) =
        (a.u32("kind")?, a.f32("peak")?, a.u64("warmup")?, a.u64("total")?, a.f32("floor_frac")?);
    let schedule = match kind {
        1 => LrSchedule::WarmupCosine { peak, warmup, total, floor },
        _ => LrSchedule::Constant(peak),
    };
    let rate = schedule.rate(t - 1);
    a.output::<u64>("step")?[0] = t;
    match a.output::<f32>("lr")?.first_mut() {
        Some(lr) => *lr = rate,
        None => {
            return Err(Error::KernelArg {
                kernel: a.kernel.name,
                param: "lr".into(),
                expected: "an f32 buffer of 1 element".into(),
                found: "an empty buffer".into(),
            })
        }
    }
    Ok(())
}

const ONE_THREAD: LaunchDims =
    LaunchDims { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0, grid_stride: false };

/// Advances `step` by one and writes the learning rate of that step into `lr` (one element).
///
/// # Errors
/// [`Error::Shape`] unless `step` and `lr` have one element each; [`Error::Unsupported`] for a
/// warmup of 0 steps.
pub fn lr_schedule_step(step: &Tensor, lr: &Tensor, schedule: &LrSchedule, stream: &Stream) -> Result<()> {
    const OP: &str = "lr_schedule_step";
    if lr.numel() != 1 {
        return Err(Error::Shape {
            op: OP,
            expected: "a learning rate of 1 element".into(),
            found: lr.shape().to_vec(),
        });
    }
    let (kind, peak, warmup, total, floor) = match *schedule {
        LrSchedule::Constant(rate) => (0u32, rate, 1u64, 1u64, 1.0f32),
        LrSchedule::WarmupCosine { warmup: 0, .. } => {
            return Err(Error::Unsupported { op: OP, backend: "any", why: "a warmup of 0 steps; use at least 1" })
        }
        LrSchedule::WarmupCosine { peak, warmup, total, floor } => (1, peak, warmup, total, floor),
    };
    stream.launch(
        &LR_SCHEDULE_STEP,
        ONE_THREAD,
        &args![InOut(step_view(OP, step)?), Out(super::dense::<f32>(OP, lr)?), kind, peak, warmup, total, floor],
    )
}
