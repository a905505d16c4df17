//! FP8 training of the [`Linear`](super::Linear) layers: TransformerEngine's delayed scaling
//! (E4M3 in the forward, E5M2 for gradients unless the recipe says E4M3, bf16 everywhere else),
//! with every amax, history and scale on the device and no global state.
//!
//! One [`Fp8Training`] value belongs to one model: the layers built with it
//! ([`Builder::with_fp8`](super::Builder::with_fp8)) register their weights and get their slots
//! in its two recipes, and [`Fp8Training::start`] makes the state once the model is built.
//! Per step:
//!
//! - the forward quantizes each input with its scale and records its amax
//!   ([`ops::fp8::cast_transpose`]), and multiplies it with the FP8 weight (fast accumulation, as
//!   TransformerEngine's forward);
//! - the backward quantizes each output gradient to the recipe's gradient format likewise, and
//!   runs the data gradient (`dy·W`, against the weight's FP8 transpose) and the weight gradient
//!   (`dyᵀ·x`, both operands quantized transposed) as FP8 GEMMs; the bias gradient is a bf16
//!   column sum, as cuBLASLt has no FP8 bias-gradient epilogue;
//! - [`Fp8Training::step`], which the optimizer runs right after it rewrites the bf16 weights
//!   ([`AdamW::with_fp8`](crate::optim::AdamW::with_fp8)), updates the scales from the amax
//!   histories and quantizes every weight and its transpose once, with the new scales, so every
//!   microbatch of the next step reads the same FP8 weights.
//!
//! With data parallelism ([`Fp8Training::reduce_amaxes_over`]), the step first takes each amax
//! slot's max across the ranks, so that every rank computes the same scales and quantizes as one
//! rank running the whole batch would.
//!
//! Nothing of this is process-wide: a second model, or a capture after an FP8 capture, sees none
//! of it. Graph replays read the scales in memory when they run, so the graphs of a step are
//! captured once and follow the recipe.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::device::{Communicator, DType, Stream};
use crate::memory::CachingAllocator;
use crate::ops::fp8::{cast_transpose, AmaxAlgo, CurrentScaling, DelayedScaling, DelayedScalingConfig, Fp8Format};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// How an [`Fp8Training`] runs: TransformerEngine's recipe, the scaling of its tensors and the
/// format of its gradients. The default is TransformerEngine's: delayed scaling, E4M3 in the
/// forward and E5M2 for the gradients (its `Format.HYBRID`).
///
/// ```
/// use graphed::nn::{Fp8Recipe, Fp8Scaling};
/// use graphed::ops::fp8::Fp8Format;
/// // Current scaling, and the gradients in E4M3 as the forward's tensors (`Format.E4M3`).
/// let recipe = Fp8Recipe { scaling: Fp8Scaling::Current, gradients: Fp8Format::E4M3 };
/// assert_eq!(recipe.to_string(), "current scaling, E4M3 gradients");
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Recipe {
    /// Where the scales come from.
    pub scaling: Fp8Scaling,
    /// The output gradients' format: E5M2 (more range) or E4M3 (one more bit of precision).
    pub gradients: Fp8Format,
}

impl Default for Fp8Recipe {
    fn default() -> Fp8Recipe {
        Fp8Recipe { scaling: Fp8Scaling::default(), gradients: Fp8Format::E5M2 }
    }
}

impl std::fmt::Display for Fp8Recipe {
    /// `delayed scaling, E5M2 gradients`, as reports name it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, {} gradients", self.scaling, self.gradients.name().to_uppercase())
    }
}

/// How an [`Fp8Training`] scales its tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fp8Scaling {
    /// TransformerEngine's `DelayedScaling` (the default): each tensor's scale comes from the
    /// amaxes its casts recorded over the last steps, updated once per step by the optimizer.
    Delayed(DelayedRecipe),
    /// TransformerEngine's `Float8CurrentScaling`: each tensor's scale comes from its own amax,
    /// taken just before its cast (one more read of it, and one small launch), so a spike is
    /// never clipped by an older scale. No history to keep, reduce or checkpoint.
    Current,
}

impl Default for Fp8Scaling {
    fn default() -> Fp8Scaling {
        Fp8Scaling::Delayed(DelayedRecipe::default())
    }
}

impl Fp8Scaling {
    /// `delayed` or `current`, as the command line spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Fp8Scaling::Delayed(_) => "delayed",
            Fp8Scaling::Current => "current",
        }
    }
}

impl std::fmt::Display for Fp8Scaling {
    /// `delayed scaling` or `current scaling`, as reports name it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} scaling", self.name())
    }
}

/// The options of delayed scaling: TransformerEngine's `DelayedScaling`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DelayedRecipe {
    /// Steps of amax history per tensor (TransformerEngine: `amax_history_len`).
    pub history_len: usize,
    /// How a history becomes an amax.
    pub algo: AmaxAlgo,
    /// The scale leaves `2^margin` of headroom.
    pub margin: i32,
}

impl Default for DelayedRecipe {
    /// TransformerEngine's defaults: 1024 steps, the max of the window, no margin.
    fn default() -> DelayedRecipe {
        DelayedRecipe { history_len: 1024, algo: AmaxAlgo::Max, margin: 0 }
    }
}

/// The two recipes' state (forward: slots `2i` the input of layer `i`, `2i + 1` its weight;
/// backward: slot `i` layer `i`'s output gradient).
enum Scalings {
    Delayed(Box<DelayedScaling>, Box<DelayedScaling>),
    Current(Box<CurrentScaling>, Box<CurrentScaling>),
}

/// FP8 training state of one model (see the module doc). Clones share it.
#[derive(Clone)]
pub struct Fp8Training {
    inner: Arc<Inner>,
}

struct Inner {
    alloc: CachingAllocator,
    recipe: Fp8Recipe,
    /// Each registered layer's bf16 weight and its FP8 copies, in registration order.
    weights: Mutex<Vec<Fp8Weight>>,
    /// Made by `start`.
    state: OnceLock<Scalings>,
    /// The data-parallel ranks whose amaxes each step reduces, if any.
    group: OnceLock<Communicator>,
    /// Whether a step was enqueued after `start`'s own: the group can no longer be set.
    stepped: AtomicBool,
}

/// A weight and its FP8 forms, written by [`Fp8Training::step`].
#[derive(Clone)]
struct Fp8Weight {
    /// bf16, `(out, in)`.
    value: Tensor,
    /// E4M3, `(out, in)`: the forward's B.
    fp8: Tensor,
    /// E4M3, `(in, out)`: the data gradient's B.
    fp8_t: Tensor,
}

/// One layer's handle on its model's FP8 state.
#[derive(Clone)]
pub(crate) struct Fp8Linear {
    training: Fp8Training,
    index: usize,
    weight: Fp8Weight,
}

/// The tensors of one quantized operand: its scale (to quantize), inverse scale (for the GEMM) and
/// amax slot, and its recipe's format; under current scaling, the state and slot that set the
/// scale from the amax.
pub(crate) struct Scaled {
    pub(crate) scale: Tensor,
    pub(crate) scale_inv: Tensor,
    pub(crate) amax: Tensor,
    /// E4M3 in the forward's recipe, the gradients' format in the backward's.
    dtype: DType,
    current: Option<(CurrentScaling, usize)>,
}

impl Scaled {
    /// The element type of what it quantizes: E4M3, or the gradients' format.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// `x` (`(n, c)`, bf16) quantized row-major `(n, c)` into a tensor of `alloc` (the layer's,
    /// which a capture allocates from); its amax recorded.
    pub(crate) fn quantize(&self, alloc: &CachingAllocator, x: &Tensor, stream: &Stream) -> Result<Tensor> {
        let (n, c) = rows_of(x)?;
        let q = Tensor::uninit(alloc, stream, &[n, c], self.dtype)?;
        self.cast(Some(&q), None, x, stream)?;
        Ok(q)
    }

    /// As [`quantize`](Scaled::quantize), transposed: `(c, n)`.
    pub(crate) fn quantize_transposed(&self, alloc: &CachingAllocator, x: &Tensor, stream: &Stream) -> Result<Tensor> {
        let (n, c) = rows_of(x)?;
        let q_t = Tensor::uninit(alloc, stream, &[c, n], self.dtype)?;
        self.cast(None, Some(&q_t), x, stream)?;
        Ok(q_t)
    }

    /// Both layouts of [`quantize`](Scaled::quantize), from one read of `x`: `((n, c), (c, n))`.
    pub(crate) fn quantize_both(
        &self,
        alloc: &CachingAllocator,
        x: &Tensor,
        stream: &Stream,
    ) -> Result<(Tensor, Tensor)> {
        let (n, c) = rows_of(x)?;
        let q = Tensor::uninit(alloc, stream, &[n, c], self.dtype)?;
        let q_t = Tensor::uninit(alloc, stream, &[c, n], self.dtype)?;
        self.cast(Some(&q), Some(&q_t), x, stream)?;
        Ok((q, q_t))
    }

    /// Quantizes `x` into `out` and/or `out_t` (at least one): under current scaling, first its
    /// amax and its scale from that.
    fn cast(&self, out: Option<&Tensor>, out_t: Option<&Tensor>, x: &Tensor, stream: &Stream) -> Result<()> {
        if let Some((scaling, slot)) = &self.current {
            scaling.measure(*slot, x, stream)?;
        }
        cast_transpose(out, out_t, &self.amax, x, &self.scale, stream)
    }
}

impl Fp8Training {
    /// FP8 state for a model to be built, with `recipe`.
    pub fn new(alloc: &CachingAllocator, recipe: Fp8Recipe) -> Fp8Training {
        let inner = Inner {
            alloc: alloc.clone(),
            recipe,
            weights: Mutex::default(),
            state: OnceLock::new(),
            group: OnceLock::new(),
            stepped: AtomicBool::new(false),
        };
        Fp8Training { inner: Arc::new(inner) }
    }

    /// Registers a layer's bf16 weight `(out, in)`; the layer quantizes through the handle.
    pub(crate) fn register(&self, value: &Tensor, stream: &Stream) -> Result<Fp8Linear> {
        const OP: &str = "Fp8Training::register";
        value.expect_dtype(OP, DType::BF16)?;
        if self.inner.state.get().is_some() {
            return Err(Error::Unsupported {
                op: OP,
                backend: "any",
                why: "the FP8 state was started before this layer was built; build every layer, then call Fp8Training::start",
            });
        }
        let &[out, inp] = value.shape() else {
            return Err(Error::Shape { op: OP, expected: "a (out, in) weight".into(), found: value.shape().to_vec() });
        };
        let alloc = &self.inner.alloc;
        let weight = Fp8Weight {
            value: value.clone(),
            fp8: Tensor::zeros(alloc, stream, &[out, inp], DType::F8E4M3)?,
            fp8_t: Tensor::zeros(alloc, stream, &[inp, out], DType::F8E4M3)?,
        };
        let mut weights = self.inner.weights.lock().unwrap_or_else(PoisonError::into_inner);
        weights.push(weight.clone());
        Ok(Fp8Linear { training: self.clone(), index: weights.len() - 1, weight })
    }

    /// Makes the recipes' state for the layers registered so far, and quantizes their weights
    /// (delayed scaling: first to learn their amaxes, then with the scales those give). Inputs
    /// and gradients start with scale 1, as in TransformerEngine.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when called twice or before any layer registered; as the
    /// allocations and launches.
    pub fn start(&self, stream: &Stream) -> Result<()> {
        let layers = self.layers();
        if layers == 0 || self.inner.state.get().is_some() {
            return Err(Error::Unsupported {
                op: "Fp8Training::start",
                backend: "any",
                why: "start the FP8 state once, after building a model with Builder::with_fp8",
            });
        }
        let alloc = &self.inner.alloc;
        let gradients = self.inner.recipe.gradients;
        let scalings = match self.inner.recipe.scaling {
            Fp8Scaling::Delayed(r) => {
                let config = |format| DelayedScalingConfig {
                    format,
                    history_len: r.history_len,
                    algo: r.algo,
                    margin: r.margin,
                };
                let forward = DelayedScaling::new(alloc, stream, config(Fp8Format::E4M3), 2 * layers)?;
                let backward = DelayedScaling::new(alloc, stream, config(gradients), layers)?;
                Scalings::Delayed(Box::new(forward), Box::new(backward))
            }
            Fp8Scaling::Current => Scalings::Current(
                Box::new(CurrentScaling::new(alloc, stream, Fp8Format::E4M3, 2 * layers)?),
                Box::new(CurrentScaling::new(alloc, stream, gradients, layers)?),
            ),
        };
        // `set` cannot fail: `state` was empty above and `start` takes no other path to it.
        let _ = self.inner.state.set(scalings);
        if let Fp8Scaling::Delayed(_) = self.inner.recipe.scaling {
            self.quantize_weights(stream)?;
        }
        self.update_and_quantize(stream)
    }

    /// Makes every [`step`](Fp8Training::step) take the max of each amax slot across `comm`'s
    /// ranks (data parallelism) before it updates the scales, as TransformerEngine's
    /// `amax_reduction_group`: every rank then holds the same scales, the ones one rank running
    /// all their microbatches would compute. One collective per recipe (`2 × layers` and
    /// `layers` floats), enqueued inside the optimizer's step, so inside its graph when the step
    /// is graphed; nothing reaches the host. Current scaling scales each microbatch's tensors by
    /// their own amaxes, as one rank does, so its steps reduce nothing.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when a group was set already, or after a step ran or was captured
    /// (its graph would not reduce); [`Error::WrongDevice`] for a communicator of another
    /// device.
    pub fn reduce_amaxes_over(&self, comm: &Communicator) -> Result<()> {
        const OP: &str = "Fp8Training::reduce_amaxes_over";
        comm.device().check_same(OP, "FP8 state", self.inner.alloc.device().id())?;
        if self.inner.stepped.load(Ordering::Acquire) || self.inner.group.set(comm.clone()).is_err() {
            return Err(Error::Unsupported {
                op: OP,
                backend: "any",
                why: "set the amax group once, before the optimizer's first step runs or is captured",
            });
        }
        Ok(())
    }

    /// Quantizes every weight again with its current scale, without a step: after the weights
    /// and the recipes' state were restored from a checkpoint.
    ///
    /// # Errors
    /// [`Error::Unsupported`] before [`Fp8Training::start`]; as the launches.
    pub fn refresh_weights(&self, stream: &Stream) -> Result<()> {
        self.quantize_weights(stream)
    }

    /// The recipes' tensors a checkpoint keeps, by name: under delayed scaling each history,
    /// scale and inverse scale; under current scaling none (every scale comes from its tensor).
    ///
    /// # Errors
    /// [`Error::Unsupported`] before [`Fp8Training::start`].
    pub fn named_state(&self) -> Result<Vec<(String, Tensor)>> {
        let Scalings::Delayed(forward, backward) = self.scalings()? else {
            return Ok(Vec::new());
        };
        let mut named = Vec::new();
        for (recipe, r) in [("forward", forward), ("backward", backward)] {
            for (part, t) in [("history", r.history()), ("scale", r.scales()), ("scale_inv", r.scale_invs())] {
                named.push((format!("{recipe}.{part}"), t.clone()));
            }
        }
        Ok(named)
    }

    /// Once per step, after the optimizer rewrote the bf16 weights: under delayed scaling the
    /// amaxes reduced across the group if there is one and the scales from the amax histories
    /// (the history then moves on a step); then every weight quantized with its new scale (under
    /// current scaling, its scale from its own amax first).
    ///
    /// # Errors
    /// [`Error::Unsupported`] before [`Fp8Training::start`]; as the launches.
    pub fn step(&self, stream: &Stream) -> Result<()> {
        let scalings = self.scalings()?;
        self.inner.stepped.store(true, Ordering::Release);
        if let (Some(comm), Scalings::Delayed(forward, backward)) = (self.inner.group.get(), scalings) {
            comm.all_reduce_amax(stream, forward.amaxes().view::<f32>()?)?;
            comm.all_reduce_amax(stream, backward.amaxes().view::<f32>()?)?;
        }
        self.update_and_quantize(stream)
    }

    /// The scales from the histories (delayed scaling), then the weights quantized with them.
    fn update_and_quantize(&self, stream: &Stream) -> Result<()> {
        if let Scalings::Delayed(forward, backward) = self.scalings()? {
            forward.update(stream)?;
            backward.update(stream)?;
        }
        self.quantize_weights(stream)
    }

    /// The layers registered.
    pub fn layers(&self) -> usize {
        self.inner.weights.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// The recipes' state, for checkpoints and reports: the forward's (E4M3: layer `i`'s input in
    /// slot `2i`, its weight in `2i + 1`) and the backward's (the gradients' format: layer `i`'s
    /// output gradient).
    ///
    /// # Errors
    /// [`Error::Unsupported`] before [`Fp8Training::start`].
    ///
    /// # Errors
    /// [`Error::Unsupported`] before [`Fp8Training::start`] and under current scaling, which
    /// keeps no history.
    pub fn state(&self) -> Result<(&DelayedScaling, &DelayedScaling)> {
        match self.scalings()? {
            Scalings::Delayed(forward, backward) => Ok((forward.as_ref(), backward.as_ref())),
            Scalings::Current(..) => Err(Error::Unsupported {
                op: "Fp8Training::state",
                backend: "any",
                why: "current scaling keeps no history: read the scales with Fp8Training::scales",
            }),
        }
    }

    /// The scales of both recipes, `[2 × layers]` (forward) and `[layers]` (backward), as the
    /// last casts left them.
    ///
    /// # Errors
    /// [`Error::Unsupported`] before [`Fp8Training::start`].
    pub fn scales(&self) -> Result<(&Tensor, &Tensor)> {
        Ok(match self.scalings()? {
            Scalings::Delayed(forward, backward) => (forward.scales(), backward.scales()),
            Scalings::Current(forward, backward) => (forward.scales(), backward.scales()),
        })
    }

    /// The recipe.
    pub fn recipe(&self) -> Fp8Recipe {
        self.inner.recipe
    }

    fn scalings(&self) -> Result<&Scalings> {
        self.inner.state.get().ok_or(Error::Unsupported {
            op: "Fp8Training",
            backend: "any",
            why: "the FP8 state is not started: call Fp8Training::start after building the model",
        })
    }

    /// The scale, inverse scale and amax slot of `slot` of the forward's (`recipe` 0) or the
    /// backward's recipe.
    fn scaled(&self, recipe: usize, slot: usize) -> Result<Scaled> {
        let dtype = if recipe == 0 { DType::F8E4M3 } else { self.inner.recipe.gradients.dtype() };
        let (scale, scale_inv, amax, current) = match self.scalings()? {
            Scalings::Delayed(forward, backward) => {
                let r = if recipe == 0 { forward } else { backward };
                (r.scale(slot)?, r.scale_inv(slot)?, r.amax(slot)?, None)
            }
            Scalings::Current(forward, backward) => {
                let r = if recipe == 0 { forward } else { backward };
                (r.scale(slot)?, r.scale_inv(slot)?, r.amax(slot)?, Some((CurrentScaling::clone(r), slot)))
            }
        };
        Ok(Scaled { scale, scale_inv, amax, dtype, current })
    }

    fn quantize_weights(&self, stream: &Stream) -> Result<()> {
        let weights = self.inner.weights.lock().unwrap_or_else(PoisonError::into_inner).clone();
        for (i, w) in weights.iter().enumerate() {
            self.scaled(0, 2 * i + 1)?.cast(Some(&w.fp8), Some(&w.fp8_t), &w.value, stream)?;
        }
        Ok(())
    }
}

impl Fp8Linear {
    /// The layer's input: E4M3, slot `2i` of the forward's recipe.
    pub(crate) fn input(&self) -> Result<Scaled> {
        self.training.scaled(0, 2 * self.index)
    }

    /// The layer's weight: E4M3, slot `2i + 1`.
    pub(crate) fn weight_scale(&self) -> Result<Scaled> {
        self.training.scaled(0, 2 * self.index + 1)
    }

    /// The layer's output gradient: in the gradients' format, slot `i` of the backward's recipe.
    pub(crate) fn grad(&self) -> Result<Scaled> {
        self.training.scaled(1, self.index)
    }

    /// The amax slots the layer's passes write (its input's and its output gradient's), once the
    /// state is started.
    pub(crate) fn amaxes(&self) -> Vec<Tensor> {
        [self.input(), self.grad()].into_iter().filter_map(|s| s.ok()).map(|s| s.amax).collect()
    }

    /// Whether a tensor quantized now may be read later in the step: its scale holds until the
    /// next optimizer step under delayed scaling, while under current scaling the next cast into
    /// its slot (another microbatch's) rewrites it.
    pub(crate) fn scales_hold_for_the_step(&self) -> bool {
        matches!(self.training.inner.recipe.scaling, Fp8Scaling::Delayed(_))
    }

    /// Whether `other` is this handle: the same layer of the same model's FP8 state.
    pub(crate) fn is_slot_of(&self, other: &Fp8Linear) -> bool {
        Arc::ptr_eq(&self.training.inner, &other.training.inner) && self.index == other.index
    }

    /// The weight in E4M3, `(out, in)`, and its transpose.
    pub(crate) fn weights(&self) -> (&Tensor, &Tensor) {
        (&self.weight.fp8, &self.weight.fp8_t)
    }
}

/// The `(n, features)` of an FP8 operand.
fn rows_of(x: &Tensor) -> Result<(usize, usize)> {
    match *x.shape() {
        [n, c] => Ok((n, c)),
        _ => Err(Error::Shape { op: "Linear (FP8)", expected: "(n, features)".into(), found: x.shape().to_vec() }),
    }
}
