//! FP8 scaling recipes as device state plus kernels: [`DelayedScaling`] (TransformerEngine's
//! default recipe: scales from an amax history, updated after the step's casts) and
//! [`CurrentScaling`] (scales from this step's amax, computed before the casts). Each owns the
//! f32 tensors of N tensors' recipe, allocated once; its `update` is one launch for all N and
//! the host reads nothing, so it belongs inside the captured step.
//!
//! Note [Scaling arithmetic]
//! As TransformerEngine's `delayed_scaling.cu` computes it, in f32: `scaled_max = fp8_max ·
//! 2^-margin` (exact: a power of two), then `scale = scaled_max / amax` (one division, rounded
//! once), which is `(fp8_max / amax) / 2^margin` wherever neither overflows; the previous scale
//! is kept when the amax is 0 or not finite (∞ or NaN); an infinite scale (an amax so small that
//! the division overflows) becomes `f32::MAX`; `scale_inv = 1 / scale`, rounded once. The
//! history's max is `fmaxf`'s, which skips NaNs, as TransformerEngine's (a NaN amax of an earlier
//! step does not freeze the scale for the whole window; under `MostRecent` it keeps the previous
//! scale for one step). Current scaling uses the same formula and guards on one amax.

use std::fmt;

use super::{Fp8Format, SOURCE};
use half::bf16;

use super::amax::input_amax_bits;
use crate::device::{args, Arg, CpuArgs, DType, Float, In, InOut, Kernel, LaunchDims, Out, Stream};
use crate::memory::CachingAllocator;
use crate::ops::cast::canonical;
use crate::ops::{count, dense, grid, lanes, stride_dims, unsupported_dtype};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Which amax of the history a delayed-scaling update computes the scale from
/// (TransformerEngine's `amax_compute_algo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmaxAlgo {
    /// The largest amax of the window (the default): robust to a step with small values.
    Max,
    /// The amax of the step just done.
    MostRecent,
}

/// The configuration of [`DelayedScaling`], TransformerEngine's `DelayedScaling` recipe for one
/// format (its `HYBRID` is two states: E4M3 for the forward's tensors, E5M2 for the gradients).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DelayedScalingConfig {
    /// The format the scales are for.
    pub format: Fp8Format,
    /// Steps of amax history per tensor (`amax_history_len`), at least 1.
    pub history_len: usize,
    /// How the history becomes the amax of the scale.
    pub algo: AmaxAlgo,
    /// The scaled amax lands at `fp8_max / 2^margin`: headroom for growing values, 0..=126.
    pub margin: i32,
}

impl Default for DelayedScalingConfig {
    /// TransformerEngine's defaults: E4M3, 1024 steps, max, margin 0.
    fn default() -> Self {
        DelayedScalingConfig { format: Fp8Format::E4M3, history_len: 1024, algo: AmaxAlgo::Max, margin: 0 }
    }
}

/// A scaling recipe refused at construction ([`Error::Scaling`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScalingConfigError {
    /// `history_len` was 0.
    #[error(
        "the amax history needs at least 1 step; set history_len to 1 or more (TransformerEngine's default is 1024)"
    )]
    NoHistory,
    /// The margin is negative or past 126 (where `2^-margin` stops being a normal f32).
    #[error(
        "margin {0} is outside 0..=126; a margin makes room above the amax, so it is a small non-negative integer"
    )]
    Margin(i32),
    /// A state for no tensors.
    #[error("a scaling state for 0 tensors; give it one slot per tensor that is cast to FP8")]
    NoTensors,
    /// The history has 2^32 elements or more.
    #[error("{tensors} tensors with {history_len} steps of history is 2^32 elements or more; use fewer steps")]
    TooLarge {
        /// Tensors asked for.
        tensors: usize,
        /// Steps asked for.
        history_len: usize,
    },
}

/// Delayed scaling for N tensors: an amax history `[history_len, N]`, row 0 being the slot this
/// step's casts accumulate into ([`DelayedScaling::amax`]), and a scale and its inverse per tensor
/// (1 at first). A step casts with `scale(i)` (set by the previous update), then [`update`]
/// computes every scale from the history and rolls it, so that row 0 is zero for the next step.
///
/// [`update`]: DelayedScaling::update
pub struct DelayedScaling {
    config: DelayedScalingConfig,
    tensors: usize,
    /// `[history_len, N]` f32; row 0 this step's amaxes, rows `history_len - 1, …, 1` the steps
    /// before it, most recent first.
    history: Tensor,
    /// `[N]` f32: row 0 of `history`, a view.
    amaxes: Tensor,
    /// `[N]` f32.
    scale: Tensor,
    /// `[N]` f32, `1 / scale`.
    scale_inv: Tensor,
}

/// Unit scales for `n` tensors.
fn ones(alloc: &CachingAllocator, stream: &Stream, n: usize) -> Result<Tensor> {
    Tensor::from_host(alloc, stream, &vec![1.0f32; n], &[n])
}

/// f32s from one tensor's `1 / scale` to the next's, so that each is as aligned as the FP8 GEMMs
/// need their scales ([`FP8_SCALE_ALIGN_BYTES`](crate::device::FP8_SCALE_ALIGN_BYTES)).
pub const SCALE_INV_STRIDE: usize = crate::device::FP8_SCALE_ALIGN_BYTES / 4;

/// The `1 / scale` slots of `tensors` tensors, all 1, [`SCALE_INV_STRIDE`] apart.
fn inverse_ones(alloc: &CachingAllocator, stream: &Stream, tensors: usize) -> Result<Tensor> {
    let n = tensors.checked_mul(SCALE_INV_STRIDE).ok_or(Error::Scaling(ScalingConfigError::NoTensors))?;
    ones(alloc, stream, n)
}

/// `fp8_max · 2^-margin` (Note [Scaling arithmetic]).
fn scaled_max(format: Fp8Format, margin: i32) -> f32 {
    format.max() * 2f32.powi(-margin)
}

impl DelayedScaling {
    /// A state for `tensors` tensors: empty history, scales 1.
    ///
    /// # Errors
    /// [`Error::Scaling`] for a configuration it refuses; allocation errors.
    pub fn new(
        alloc: &CachingAllocator,
        stream: &Stream,
        config: DelayedScalingConfig,
        tensors: usize,
    ) -> Result<DelayedScaling> {
        let refuse = |e| Err(Error::Scaling(e));
        if config.history_len == 0 {
            return refuse(ScalingConfigError::NoHistory);
        }
        if !(0..=126).contains(&config.margin) {
            return refuse(ScalingConfigError::Margin(config.margin));
        }
        if tensors == 0 {
            return refuse(ScalingConfigError::NoTensors);
        }
        let too_large = ScalingConfigError::TooLarge { tensors, history_len: config.history_len };
        match tensors.checked_mul(config.history_len) {
            Some(n) if u32::try_from(n).is_ok() => {}
            _ => return refuse(too_large),
        }
        let history = Tensor::zeros(alloc, stream, &[config.history_len, tensors], DType::F32)?;
        let (scale, scale_inv) = (ones(alloc, stream, tensors)?, inverse_ones(alloc, stream, tensors)?);
        let amaxes = history.select(0, 0)?;
        Ok(DelayedScaling { config, tensors, history, amaxes, scale, scale_inv })
    }

    /// Enqueues the update of every tensor's scale (Note [Scaling arithmetic]) and the roll of
    /// the history: one launch, after the step's casts.
    ///
    /// # Errors
    /// Device errors.
    pub fn update(&self, stream: &Stream) -> Result<()> {
        const OP: &str = "DelayedScaling::update";
        let (len, n) = (count(OP, self.config.history_len)?, count(OP, self.tensors)?);
        let most_recent = u32::from(self.config.algo == AmaxAlgo::MostRecent);
        let scaled_max = scaled_max(self.config.format, self.config.margin);
        let list = args![
            InOut(self.history.view::<f32>()?),
            InOut(self.scale.view::<f32>()?),
            Out(self.scale_inv.view::<f32>()?),
            len,
            n,
            most_recent,
            scaled_max,
            SCALE_INV_STRIDE as u32
        ];
        stream.launch(&DELAYED_SCALING_UPDATE, grid(OP, self.tensors, 256)?, &list)
    }

    /// Tensor `i`'s amax slot of this step (row 0 of the history), for the casts to accumulate
    /// into.
    ///
    /// # Errors
    /// [`Error::Shape`] for `i` past the tensors.
    pub fn amax(&self, i: usize) -> Result<Tensor> {
        self.amaxes.narrow(0, i, 1)
    }

    /// This step's amax slots of every tensor, `[N]` (contiguous: one all-reduce of the max
    /// across data-parallel ranks covers them).
    pub fn amaxes(&self) -> &Tensor {
        &self.amaxes
    }

    /// Tensor `i`'s scale, one f32, for [`quantize`](crate::ops::cast::quantize) and the casts.
    ///
    /// # Errors
    /// [`Error::Shape`] for `i` past the tensors.
    pub fn scale(&self, i: usize) -> Result<Tensor> {
        self.scale.narrow(0, i, 1)
    }

    /// Tensor `i`'s `1 / scale`, one f32, for dequantization and the FP8 GEMMs.
    ///
    /// # Errors
    /// [`Error::Shape`] for `i` past the tensors.
    pub fn scale_inv(&self, i: usize) -> Result<Tensor> {
        self.scale_inv.narrow(0, i.saturating_mul(SCALE_INV_STRIDE), 1)
    }

    /// The history, `[history_len, N]` (state for a checkpoint).
    pub fn history(&self) -> &Tensor {
        &self.history
    }

    /// Every scale, `[N]`.
    pub fn scales(&self) -> &Tensor {
        &self.scale
    }

    /// Every `1 / scale`, tensor `i`'s at `i ·` [`SCALE_INV_STRIDE`] of `[N · SCALE_INV_STRIDE]`
    /// (the rest ones).
    pub fn scale_invs(&self) -> &Tensor {
        &self.scale_inv
    }

    /// The configuration.
    pub fn config(&self) -> DelayedScalingConfig {
        self.config
    }
}

impl fmt::Debug for DelayedScaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DelayedScaling {{ {:?}, tensors: {} }}", self.config, self.tensors)
    }
}

/// Current scaling for N tensors: an amax slot, a scale and its inverse per tensor (scales 1 at
/// first). Before tensor i's cast, [`measure`](CurrentScaling::measure) writes its amax and its
/// scale in one launch; then the cast uses `scale(i)`: two reads of each tensor, the scale of this
/// step's values. (Or write the amaxes with [`amax`](super::amax()) and
/// [`Amax::Overwrite`](super::Amax::Overwrite) and call [`update`](CurrentScaling::update) for
/// all of them at once.) Clones share the state.
///
/// ```
/// use graphed::device::Device;
/// use graphed::memory::CachingAllocator;
/// use graphed::ops::fp8::{CurrentScaling, Fp8Format};
/// use graphed::tensor::Tensor;
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let recipe = CurrentScaling::new(&alloc, &s, Fp8Format::E4M3, 1)?;
/// let x = Tensor::from_host(&alloc, &s, &[1.0f32, -8.0, 3.0], &[3])?;
/// recipe.measure(0, &x, &s)?;
/// assert_eq!(recipe.amax(0)?.to_vec::<f32>(&s)?, vec![8.0]);
/// assert_eq!(recipe.scale(0)?.to_vec::<f32>(&s)?, vec![56.0]); // 448 / 8
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone)]
pub struct CurrentScaling {
    format: Fp8Format,
    /// `[N]` f32.
    amax: Tensor,
    /// `[2N]` u32, 0 between launches: [`measure`](CurrentScaling::measure)'s partial amax and
    /// count of blocks done for each tensor (`scaling.cu`).
    work: Tensor,
    /// `[N]` f32.
    scale: Tensor,
    /// `[N]` f32, `1 / scale`.
    scale_inv: Tensor,
}

impl CurrentScaling {
    /// A state for `tensors` tensors of `format`: amaxes 0, scales 1.
    ///
    /// # Errors
    /// [`Error::Scaling`] for no tensors; allocation errors.
    pub fn new(alloc: &CachingAllocator, stream: &Stream, format: Fp8Format, tensors: usize) -> Result<CurrentScaling> {
        if tensors == 0 {
            return Err(Error::Scaling(ScalingConfigError::NoTensors));
        }
        count("CurrentScaling::new", tensors)?;
        let amax = Tensor::zeros(alloc, stream, &[tensors], DType::F32)?;
        let work = Tensor::zeros(alloc, stream, &[2 * tensors], DType::U32)?;
        let (scale, scale_inv) = (ones(alloc, stream, tensors)?, inverse_ones(alloc, stream, tensors)?);
        Ok(CurrentScaling { format, amax, work, scale, scale_inv })
    }

    /// Enqueues the scales of every tensor from its amax (Note [Scaling arithmetic], margin 0):
    /// one launch, after the amaxes and before the casts.
    ///
    /// # Errors
    /// Device errors.
    pub fn update(&self, stream: &Stream) -> Result<()> {
        const OP: &str = "CurrentScaling::update";
        let n = self.amax.numel();
        let list = args![
            InOut(self.scale.view::<f32>()?),
            Out(self.scale_inv.view::<f32>()?),
            In(self.amax.view::<f32>()?),
            count(OP, n)?,
            scaled_max(self.format, 0),
            SCALE_INV_STRIDE as u32
        ];
        stream.launch(&CURRENT_SCALING_UPDATE, LaunchDims::for_elems(n), &list)
    }

    /// Tensor `i`'s amax from `inp` (f32 or bf16, contiguous), and its scale from that amax (as
    /// [`update`](CurrentScaling::update) computes it), in one launch: what goes between a
    /// tensor's production and its cast, with nothing to reset before it.
    ///
    /// # Errors
    /// [`Error::Shape`] for `i` past the tensors, [`Error::UnsupportedDType`] for another input
    /// type, [`Error::NotContiguous`] for a strided input: all before anything is enqueued.
    pub fn measure(&self, i: usize, inp: &Tensor, stream: &Stream) -> Result<()> {
        const OP: &str = "CurrentScaling::measure";
        let (scale, scale_inv, amax) = (self.scale(i)?, self.scale_inv(i)?, self.amax(i)?);
        let work = self.work.narrow(0, 2 * i, 2)?;
        let scaled_max = scaled_max(self.format, 0);
        let launch = |kernel: &'static Kernel, n: usize, lanes: usize, inp: Arg<'_>| -> Result<()> {
            let list = args![
                InOut(work.view::<u32>()?),
                Out(amax.view::<f32>()?),
                InOut(scale.view::<f32>()?),
                Out(scale_inv.view::<f32>()?),
                inp,
                count(OP, n)?,
                scaled_max
            ];
            stream.launch(kernel, stride_dims(n.div_ceil(lanes)), &list)
        };
        match inp.dtype() {
            DType::F32 => launch(&AMAX_SCALE, inp.numel(), lanes::<f32>(), In(dense::<f32>(OP, inp)?).into()),
            DType::BF16 => launch(&AMAX_SCALE_BF16, inp.numel(), lanes::<bf16>(), In(dense::<bf16>(OP, inp)?).into()),
            dtype => Err(unsupported_dtype(OP, dtype)),
        }
    }

    /// Tensor `i`'s amax slot.
    ///
    /// # Errors
    /// [`Error::Shape`] for `i` past the tensors.
    pub fn amax(&self, i: usize) -> Result<Tensor> {
        self.amax.narrow(0, i, 1)
    }

    /// Tensor `i`'s scale.
    ///
    /// # Errors
    /// [`Error::Shape`] for `i` past the tensors.
    pub fn scale(&self, i: usize) -> Result<Tensor> {
        self.scale.narrow(0, i, 1)
    }

    /// Tensor `i`'s `1 / scale`.
    ///
    /// # Errors
    /// [`Error::Shape`] for `i` past the tensors.
    pub fn scale_inv(&self, i: usize) -> Result<Tensor> {
        self.scale_inv.narrow(0, i.saturating_mul(SCALE_INV_STRIDE), 1)
    }

    /// Every amax slot, `[N]`.
    pub fn amaxes(&self) -> &Tensor {
        &self.amax
    }

    /// Every scale, `[N]`.
    pub fn scales(&self) -> &Tensor {
        &self.scale
    }
}

impl fmt::Debug for CurrentScaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CurrentScaling {{ {:?}, tensors: {} }}", self.format, self.amax.numel())
    }
}

/// The delayed-scaling update, one block per tensor.
pub static DELAYED_SCALING_UPDATE: Kernel = Kernel {
    name: "delayed_scaling_update",
    source: SOURCE,
    params: &["history", "scale", "scale_inv", "len", "n", "most_recent", "scaled_max", "inv_stride"],
    cpu: delayed_cpu,
    strided: false,
};

/// The current-scaling update, one thread per tensor.
pub static CURRENT_SCALING_UPDATE: Kernel = Kernel {
    name: "current_scaling_update",
    source: SOURCE,
    params: &["scale", "scale_inv", "amax", "n", "scaled_max", "inv_stride"],
    cpu: current_cpu,
    strided: false,
};

/// The parameters of [`AMAX_SCALE`] and [`AMAX_SCALE_BF16`].
const AMAX_SCALE_PARAMS: &[&str] = &["work", "amax", "scale", "scale_inv", "inp", "n", "scaled_max"];

/// [`CurrentScaling::measure`] over f32: one tensor's amax, then its scale in the last block.
pub static AMAX_SCALE: Kernel = Kernel {
    name: "amax_scale_f32",
    source: SOURCE,
    params: AMAX_SCALE_PARAMS,
    cpu: amax_scale_cpu::<f32>,
    strided: false,
};

/// [`CurrentScaling::measure`] over bf16.
pub static AMAX_SCALE_BF16: Kernel = Kernel {
    name: "amax_scale_bf16",
    source: SOURCE,
    params: AMAX_SCALE_PARAMS,
    cpu: amax_scale_cpu::<bf16>,
    strided: false,
};

/// The scale for `amax` (Note [Scaling arithmetic]).
fn scale_for(amax: f32, previous: f32, scaled_max: f32) -> f32 {
    let s = if amax.is_finite() && amax > 0.0 { scaled_max / amax } else { previous };
    if s.is_infinite() {
        f32::MAX
    } else {
        s
    }
}

/// A scale and its inverse, as `set_scale` in `scaling.cu` writes them.
fn set_scale(scale: &mut f32, scale_inv: &mut f32, s: f32) {
    *scale = s;
    *scale_inv = canonical(1.0 / s);
}

fn delayed_cpu(a: &CpuArgs) -> Result<()> {
    let (len, n) = (a.u32("len")? as usize, a.u32("n")? as usize);
    let (most_recent, scaled_max) = (a.u32("most_recent")? != 0, a.f32("scaled_max")?);
    let mut history = a.output::<f32>("history")?;
    let (mut scale, mut scale_inv) = (a.output::<f32>("scale")?, a.output::<f32>("scale_inv")?);
    for i in 0..n {
        let last = history[i];
        let mut amax = 0.0f32;
        for k in 0..len {
            let v = if k + 1 < len { history[(k + 1) * n + i] } else { last };
            amax = amax.max(v);
            history[k * n + i] = if k > 0 { v } else { 0.0 };
        }
        let s = scale_for(if most_recent { last } else { amax }, scale[i], scaled_max);
        set_scale(&mut scale[i], &mut scale_inv[i * SCALE_INV_STRIDE], s);
    }
    Ok(())
}

fn current_cpu(a: &CpuArgs) -> Result<()> {
    let (amax, scaled_max) = (a.input::<f32>("amax")?, a.f32("scaled_max")?);
    let (mut scale, mut scale_inv) = (a.output::<f32>("scale")?, a.output::<f32>("scale_inv")?);
    for ((s, inv), &m) in scale.iter_mut().zip(scale_inv.iter_mut().step_by(SCALE_INV_STRIDE)).zip(amax.iter()) {
        set_scale(s, inv, scale_for(m, *s, scaled_max));
    }
    Ok(())
}

/// The work slots stay 0: the CUDA kernel's last block leaves them so.
fn amax_scale_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let amax = f32::from_bits(input_amax_bits::<T>(a)?);
    let (mut slot, mut scale, mut scale_inv) =
        (a.output::<f32>("amax")?, a.output::<f32>("scale")?, a.output::<f32>("scale_inv")?);
    let (Some(slot), Some(scale), Some(inv)) = (slot.first_mut(), scale.first_mut(), scale_inv.first_mut()) else {
        return Err(Error::KernelArg {
            kernel: a.kernel.name,
            param: "amax".into(),
            expected: "one f32 each for the amax, the scale and its inverse".into(),
            found: "an empty buffer".into(),
        });
    };
    *slot = amax;
    set_scale(scale, inv, scale_for(amax, *scale, a.f32("scaled_max")?));
    Ok(())
}
