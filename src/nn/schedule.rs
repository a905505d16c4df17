//! Pipeline schedules: the order in which a rank runs the forward, backward and split
//! weight-gradient passes of its model chunks (virtual pipeline stages) over the microbatches of
//! a step, and the one traversal that runs them ([`run_schedule`]), eagerly or graphed.
//! `graph::make_graphed_callables` captures one graph per (layer, microbatch) in this order, so
//! that the graphs share one pool and replay in the order they were captured (R5).
//!
//! TransformerEngine's `_order` encoding is accepted ([`Schedule::from_te_order`]): `+k` is the
//! forward of chunk k (1-based) for that chunk's next microbatch, `-k` its backward, `-(k + 0.5)`
//! its weight-gradient pass for the microbatch whose backward ran last without one.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;

use super::{Inputs, Module, SaveHook};
use crate::device::Stream;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// One entry of a schedule: a pass of a chunk (0-based) for the chunk's next microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// The forward of every layer of the chunk, in order.
    Forward(usize),
    /// The backward (data gradients, and weight gradients unless split) of every layer of the
    /// chunk, last layer first.
    Backward(usize),
    /// The split weight-gradient pass of the chunk, for its oldest backward without one.
    WeightGrad(usize),
}

impl Step {
    /// The chunk it runs.
    pub fn chunk(self) -> usize {
        match self {
            Step::Forward(k) | Step::Backward(k) | Step::WeightGrad(k) => k,
        }
    }

    /// `layers`, its chunk's, in the order it runs them: in order for a forward, last first
    /// otherwise. The traversal and the capture both follow it, so that replays meet the pool's
    /// capture order.
    pub(crate) fn layer_order(self, layers: Range<usize>) -> impl Iterator<Item = usize> {
        let (forward, start, end) = (matches!(self, Step::Forward(_)), layers.start, layers.end);
        layers.map(move |l| if forward { l } else { start + end - 1 - l })
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Forward(k) => write!(f, "F{k}"),
            Step::Backward(k) => write!(f, "B{k}"),
            Step::WeightGrad(k) => write!(f, "W{k}"),
        }
    }
}

/// Why a schedule was refused. Each message ends with what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleErrorKind {
    // ---- the schedule's steps -------------------------------------------------------------------
    /// The schedule has no forward.
    #[error("the schedule has no forward; give each chunk's forwards and backwards")]
    Empty,
    /// A TransformerEngine entry that is not `±k` or `-(k + 0.5)` with `k ≥ 1`.
    #[error("entry {index} ({value}) is not +k, -k or -(k+0.5) with k a chunk from 1; fix the order")]
    BadEntry {
        /// Its position.
        index: usize,
        /// Its value.
        value: f64,
    },
    /// A chunk does not appear, or chunks have different microbatch counts.
    #[error(
        "chunk {chunk} has {forwards} forwards and {backwards} backwards, but every chunk needs {microbatches} of \
         each (the forwards over the chunks must divide evenly); give every chunk every microbatch"
    )]
    Counts {
        /// The chunk (0-based).
        chunk: usize,
        /// Its forwards.
        forwards: usize,
        /// Its backwards.
        backwards: usize,
        /// What every chunk needs.
        microbatches: usize,
    },
    /// A pass runs before one it depends on: a backward before its forward, a chunk's forward
    /// before the previous chunk's forward of the same microbatch, a chunk's backward before the
    /// next chunk's backward of the same microbatch.
    #[error("entry {index} ({step}, microbatch {microbatch}) runs before {needs}; reorder the schedule")]
    Dependency {
        /// Its position.
        index: usize,
        /// The step.
        step: Step,
        /// The microbatch it runs.
        microbatch: usize,
        /// What must come first.
        needs: String,
    },
    /// A weight-gradient entry with no backward of its chunk left to follow, or a chunk whose
    /// weight-gradient entries do not match its backwards.
    #[error("chunk {chunk} has {wgrads} weight-gradient entries for {backwards} backwards; give one after each backward or none")]
    WeightGrads {
        /// The chunk.
        chunk: usize,
        /// Its weight-gradient entries.
        wgrads: usize,
        /// Its backwards.
        backwards: usize,
    },
    /// A layer that splits its weight gradients out, in a chunk without weight-gradient steps:
    /// nothing would run them.
    #[error(
        "layer {layer} splits its weight gradients out, but its chunk {chunk} has no weight-gradient steps to run \
         them; use a schedule with them (Schedule::zero_bubble) or layers that do not split"
    )]
    UnrunWeightGrads {
        /// The layer (over every chunk's).
        layer: usize,
        /// Its chunk.
        chunk: usize,
    },
    /// Weight-gradient steps for a chunk none of whose layers splits its weight gradients out.
    #[error(
        "chunk {chunk} has weight-gradient steps, but none of its layers splits its weight gradients out; split them \
         (Linear::set_split_dw) or use a schedule without"
    )]
    NothingToSplit {
        /// The chunk.
        chunk: usize,
    },

    // ---- builders' arguments --------------------------------------------------------------------
    /// A size given to a builder (chunks, microbatches, stages, virtual stages) is 0.
    #[error("{name} is 0; pass at least 1")]
    Zero {
        /// Which size.
        name: &'static str,
    },
    /// A pipeline rank that is not one of the stages.
    #[error("rank {rank} is not one of the {stages} stages; pass a rank below {stages}")]
    RankOutsideStages {
        /// The rank given.
        rank: usize,
        /// The stages.
        stages: usize,
    },
    /// An interleaved schedule (several chunks per rank) whose microbatches are not a multiple of
    /// the stages: microbatches go through the chunks in groups of `stages`.
    #[error(
        "{microbatches} microbatches are not a multiple of the {stages} stages, which interleaving needs; pass a \
         multiple"
    )]
    NotMultipleOfStages {
        /// The microbatches given.
        microbatches: usize,
        /// The stages.
        stages: usize,
    },
    /// A [`Stage`] index outside the stages (or no stages at all).
    #[error("stage {index} of {count} does not exist; pass an index below the count, which is at least 1")]
    NoSuchStage {
        /// The index given.
        index: usize,
        /// The stages given.
        count: usize,
    },

    // ---- running a schedule ---------------------------------------------------------------------
    /// Layers per chunk or inputs that do not fit the schedule and the stage: one count per chunk,
    /// none of them 0, and one input per microbatch on the first stage, none on the others.
    #[error(
        "{layers_per_chunk:?} layers per chunk and {inputs} inputs for a schedule of {chunks} chunks and \
         {microbatches} microbatches on stage {stage} of {stages}; pass one list of at least one layer per chunk, \
         and the microbatches' inputs on the first stage only"
    )]
    LayersAndInputs {
        /// The layers per chunk given.
        layers_per_chunk: Vec<usize>,
        /// The inputs given.
        inputs: usize,
        /// The schedule's chunks.
        chunks: usize,
        /// The schedule's microbatches.
        microbatches: usize,
        /// The stage's index.
        stage: usize,
        /// The pipeline's stages.
        stages: usize,
    },
    /// A layer the passes do not have ([`SchedulePasses::splits_weight_grads`]).
    #[error("there is no layer {layer} among the {layers} layers given; give every chunk's layers")]
    NoSuchLayer {
        /// The layer asked for (over every chunk's).
        layer: usize,
        /// The layers the passes have.
        layers: usize,
    },
    /// No graphed callable for a (layer, microbatch) instance of the schedule
    /// ([`GraphedPasses`](crate::graph::GraphedPasses)).
    #[error("no graphed callable for layer {layer}, microbatch {microbatch}; give the schedule's callables")]
    NoCallable {
        /// The layer (over every chunk's).
        layer: usize,
        /// The microbatch.
        microbatch: usize,
    },
    /// An eager backward of a (layer, microbatch) whose forward has not run, so no context is kept
    /// for it ([`EagerPasses`]).
    #[error(
        "the backward of layer {layer}, microbatch {microbatch}, runs before its forward; run each forward before \
         its backward, as a checked Schedule does"
    )]
    BackwardBeforeForward {
        /// The layer (over every chunk's).
        layer: usize,
        /// The microbatch.
        microbatch: usize,
    },
    /// A step whose input (forward) or gradient (backward) nothing gave: on a pipeline stage, the
    /// links' exchange returned fewer tensors than the receives it was asked for.
    #[error(
        "{step} of microbatch {microbatch} has no {what}; a StageLinks::exchange must return one tensor per \
         receive it is asked for"
    )]
    NotReceived {
        /// The step.
        step: Step,
        /// The microbatch.
        microbatch: usize,
        /// "input" or "gradient".
        what: &'static str,
    },

    // ---- pipeline links -------------------------------------------------------------------------
    /// An exchange that sends a tensor other than the stages' boundary (another element count or
    /// element type, or not contiguous): the peer would receive another count, and NCCL would
    /// hang or corrupt memory.
    #[error(
        "exchange {index} sends a {dtype} tensor of shape {shape:?} to stage {peer}, but the stages' boundary is a \
         contiguous {boundary_dtype} tensor of shape {boundary:?}; give the links the boundary's shape"
    )]
    Boundary {
        /// The exchange.
        index: usize,
        /// The stage it sends to.
        peer: usize,
        /// The element type sent.
        dtype: crate::device::DType,
        /// The shape sent.
        shape: Vec<usize>,
        /// The boundary's element type.
        boundary_dtype: crate::device::DType,
        /// The boundary's shape.
        boundary: Vec<usize>,
    },
    /// An exchange of graphed links that sends or receives other buffers or stages than its
    /// graph captured.
    #[error(
        "exchange {index} sends or receives other buffers or stages than its graph captured; graphed links need \
         the static outputs of graphed passes and the same schedule at every step (use eager links with eager \
         passes)"
    )]
    NotAsCaptured {
        /// The exchange.
        index: usize,
    },
    /// An exchange of graphed links past the exchanges captured (and not the next one to
    /// capture).
    #[error("exchange {index} of a step after {captured} captured ones; run the same schedule at every step")]
    BeyondCaptured {
        /// The exchange.
        index: usize,
        /// The exchanges captured.
        captured: usize,
    },
    /// A wait for an exchange that this step has not run: its event would be an earlier step's.
    #[error(
        "a pass waits for exchange {index}, which this step has not run; wait only for exchanges of the current \
         step, after they are issued"
    )]
    ExchangeNotRun {
        /// The exchange.
        index: usize,
    },
}

fn refuse<T>(kind: ScheduleErrorKind) -> Result<T> {
    Err(Error::Schedule(kind))
}

/// A validated schedule: its steps, chunks and microbatches.
///
/// ```
/// use graphed::nn::{Schedule, Step};
/// // TransformerEngine's test order: 2 chunks, 3 microbatches.
/// let s = Schedule::from_te_order(&[1.0, 2.0, 1.0, 2.0, -2.0, -1.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0])?;
/// assert_eq!((s.chunks(), s.microbatches()), (2, 3));
/// assert_eq!(s.steps()[4], Step::Backward(1));
/// assert_eq!(Schedule::interleaved_1f1b(1, 0, 2, 4)?.microbatches(), 4);
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    steps: Vec<Step>,
    chunks: usize,
    microbatches: usize,
}

impl Schedule {
    /// Validates `steps`: every chunk from 0 has the same number of forwards and backwards (the
    /// microbatch count), each backward follows its forward, chunk k + 1's forward of a
    /// microbatch follows chunk k's and chunk k's backward follows chunk k + 1's, and a chunk's
    /// weight-gradient entries, if any, follow its backwards one for one.
    ///
    /// # Errors
    /// [`Error::Schedule`] naming the first inconsistency.
    pub fn new(steps: Vec<Step>) -> Result<Schedule> {
        let chunk_of = |s: &Step| s.chunk();
        let chunks = steps.iter().filter(|s| !matches!(s, Step::WeightGrad(_))).map(|s| chunk_of(s) + 1).max();
        let Some(chunks) = chunks else { return refuse(ScheduleErrorKind::Empty) };
        let count = |f: &dyn Fn(&Step) -> bool| -> Vec<usize> {
            let mut n = vec![0; chunks];
            for s in steps.iter().filter(|s| f(s)) {
                if let Some(c) = n.get_mut(chunk_of(s)) {
                    *c += 1;
                }
            }
            n
        };
        let (fwd, bwd, wgrad) = (
            count(&|s| matches!(s, Step::Forward(_))),
            count(&|s| matches!(s, Step::Backward(_))),
            count(&|s| matches!(s, Step::WeightGrad(_))),
        );
        let microbatches = fwd[0];
        for k in 0..chunks {
            if fwd[k] != microbatches || bwd[k] != microbatches || microbatches == 0 {
                let (forwards, backwards) = (fwd[k], bwd[k]);
                return refuse(ScheduleErrorKind::Counts { chunk: k, forwards, backwards, microbatches });
            }
        }
        for (k, &w) in wgrad.iter().enumerate() {
            if w != 0 && w != bwd[k] {
                return refuse(ScheduleErrorKind::WeightGrads { chunk: k, wgrads: w, backwards: bwd[k] });
            }
        }
        if let Some(chunk) = steps.iter().map(chunk_of).find(|k| *k >= chunks) {
            let wgrads = steps.iter().filter(|s| chunk_of(s) == chunk).count();
            return refuse(ScheduleErrorKind::WeightGrads { chunk, wgrads, backwards: 0 });
        }
        let (mut f, mut b, mut w) = (vec![0usize; chunks], vec![0usize; chunks], vec![0usize; chunks]);
        for (index, &step) in steps.iter().enumerate() {
            let dep = |microbatch: usize, needs: String| {
                refuse(ScheduleErrorKind::Dependency { index, step, microbatch, needs })
            };
            match step {
                Step::Forward(k) => {
                    if k > 0 && f[k - 1] <= f[k] {
                        return dep(f[k], format!("F{} of that microbatch", k - 1));
                    }
                    f[k] += 1;
                }
                Step::Backward(k) => {
                    if f[k] <= b[k] {
                        return dep(b[k], format!("F{k} of that microbatch"));
                    }
                    if k + 1 < chunks && b[k + 1] <= b[k] {
                        return dep(b[k], format!("B{} of that microbatch", k + 1));
                    }
                    b[k] += 1;
                }
                Step::WeightGrad(k) => {
                    if b[k] <= w[k] {
                        return refuse(ScheduleErrorKind::WeightGrads { chunk: k, wgrads: w[k] + 1, backwards: b[k] });
                    }
                    w[k] += 1;
                }
            }
        }
        Ok(Schedule { steps, chunks, microbatches })
    }

    /// A schedule in TransformerEngine's `_order` encoding (chunks from 1).
    ///
    /// # Errors
    /// [`ScheduleErrorKind::BadEntry`] for an entry that is not `±k` or `-(k + 0.5)`; then as
    /// [`Schedule::new`].
    pub fn from_te_order(order: &[f64]) -> Result<Schedule> {
        let mut steps = Vec::with_capacity(order.len());
        for (index, &value) in order.iter().enumerate() {
            let bad = || refuse(ScheduleErrorKind::BadEntry { index, value });
            let (magnitude, half) = (value.abs().floor(), value.abs().fract());
            if !value.is_finite() || !(1.0..=1e6).contains(&magnitude) {
                return bad();
            }
            let k = magnitude as usize - 1;
            let (whole, halved) = (half == 0.0, half == 0.5);
            steps.push(match (value > 0.0, whole, halved) {
                (true, true, _) => Step::Forward(k),
                (false, true, _) => Step::Backward(k),
                (false, _, true) => Step::WeightGrad(k),
                _ => return bad(),
            });
        }
        Schedule::new(steps)
    }

    /// Every forward (each microbatch through every chunk), then every backward in reverse.
    ///
    /// # Errors
    /// [`ScheduleErrorKind::Zero`] for zero chunks or microbatches.
    pub fn all_forward_then_backward(chunks: usize, microbatches: usize) -> Result<Schedule> {
        positive(&[("chunks", chunks), ("microbatches", microbatches)])?;
        let fwd = (0..microbatches).flat_map(|_| (0..chunks).map(Step::Forward));
        let bwd = (0..microbatches).flat_map(|_| (0..chunks).rev().map(Step::Backward));
        Schedule::new(fwd.chain(bwd).collect())
    }

    /// The order that pipeline rank `rank` of `stages` runs under interleaved 1F1B with
    /// `virtual_stages` chunks per rank (Megatron-LM's schedule; 1F1B when `virtual_stages` is 1):
    /// microbatches go through the chunks in groups of `stages`, a warmup of forwards, then one
    /// forward and one backward in turn, then the remaining backwards.
    ///
    /// # Errors
    /// [`ScheduleErrorKind::Zero`] for zero sizes, [`ScheduleErrorKind::RankOutsideStages`] for a
    /// rank outside the stages, [`ScheduleErrorKind::NotMultipleOfStages`] for (with several
    /// chunks) microbatches that are not a multiple of the stages.
    pub fn interleaved_1f1b(
        stages: usize,
        rank: usize,
        virtual_stages: usize,
        microbatches: usize,
    ) -> Result<Schedule> {
        positive(&[("stages", stages), ("virtual stages", virtual_stages), ("microbatches", microbatches)])?;
        if rank >= stages {
            return refuse(ScheduleErrorKind::RankOutsideStages { rank, stages });
        }
        if virtual_stages > 1 && !microbatches.is_multiple_of(stages) {
            return refuse(ScheduleErrorKind::NotMultipleOfStages { microbatches, stages });
        }
        let total = microbatches * virtual_stages;
        // The k-th forward (or backward) of the rank is of this chunk: groups of `stages`
        // microbatches go through every chunk (backwards through the chunks in reverse).
        let chunk = |k: usize, forward: bool| {
            let c = (k / stages) % virtual_stages;
            if forward {
                c
            } else {
                virtual_stages - 1 - c
            }
        };
        let warmup = match virtual_stages {
            1 => (stages - rank - 1).min(total),
            _ => ((stages - rank - 1) * 2 + (virtual_stages - 1) * stages).min(total),
        };
        let mut steps = Vec::with_capacity(2 * total);
        steps.extend((0..warmup).map(|k| Step::Forward(chunk(k, true))));
        for k in warmup..total {
            steps.push(Step::Forward(chunk(k, true)));
            steps.push(Step::Backward(chunk(k - warmup, false)));
        }
        steps.extend((total - warmup..total).map(|k| Step::Backward(chunk(k, false))));
        Schedule::new(steps)
    }

    /// 1F1B for `rank` of `stages` with each backward split into its data-gradient pass and a
    /// weight-gradient pass issued one backward later (after the last backward, the rest), the
    /// way zero-bubble schedules fill the pipeline's bubbles with weight gradients.
    ///
    /// # Errors
    /// As [`Schedule::interleaved_1f1b`] with one virtual stage.
    pub fn zero_bubble(stages: usize, rank: usize, microbatches: usize) -> Result<Schedule> {
        let base = Schedule::interleaved_1f1b(stages, rank, 1, microbatches)?;
        let mut steps = Vec::with_capacity(3 * microbatches);
        let mut pending = 0;
        for step in base.steps {
            steps.push(step);
            if let Step::Backward(k) = step {
                if pending > 0 {
                    steps.push(Step::WeightGrad(k));
                    pending -= 1;
                }
                pending += 1;
            }
        }
        steps.extend((0..pending).map(|_| Step::WeightGrad(0)));
        Schedule::new(steps)
    }

    /// The steps, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Whether weight-gradient steps run the layers that split theirs out, over chunks of
    /// `layers_per_chunk` layers, where `splits(layer)` says whether a layer (over every chunk's)
    /// does: a chunk has such steps if and only if one of its layers splits. Decided before
    /// anything runs, so that no split weight gradient is left unrun.
    pub(crate) fn check_weight_grads(
        &self,
        layers_per_chunk: &[usize],
        splits: &mut dyn FnMut(usize) -> Result<bool>,
    ) -> Result<()> {
        let mut first = 0;
        for (chunk, &n) in layers_per_chunk.iter().enumerate() {
            let mut splitting = None;
            for layer in first..first + n {
                if splits(layer)? {
                    splitting.get_or_insert(layer);
                }
            }
            match (self.steps.contains(&Step::WeightGrad(chunk)), splitting) {
                (false, Some(layer)) => return refuse(ScheduleErrorKind::UnrunWeightGrads { layer, chunk }),
                (true, None) => return refuse(ScheduleErrorKind::NothingToSplit { chunk }),
                _ => {}
            }
            first += n;
        }
        Ok(())
    }

    /// Model chunks (virtual pipeline stages) of the rank.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Microbatches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// Whether it splits weight gradients out of the backwards.
    pub fn splits_weight_grads(&self) -> bool {
        self.steps.iter().any(|s| matches!(s, Step::WeightGrad(_)))
    }

    /// Each step with the microbatch it runs (each chunk's passes take its microbatches in
    /// order; a weight-gradient pass takes the oldest backward without one).
    pub fn with_microbatches(&self) -> Vec<(Step, usize)> {
        let (mut f, mut b, mut w) = (vec![0; self.chunks], vec![0; self.chunks], vec![0; self.chunks]);
        let next = |v: &mut Vec<usize>, k: usize| {
            v[k] += 1;
            v[k] - 1
        };
        (self.steps.iter())
            .map(|&s| match s {
                Step::Forward(k) => (s, next(&mut f, k)),
                Step::Backward(k) => (s, next(&mut b, k)),
                Step::WeightGrad(k) => (s, next(&mut w, k)),
            })
            .collect()
    }

    /// Where layer `layer` (counted over every chunk's `layers_per_chunk` layers) for
    /// `microbatch` sits among one-per-(layer, microbatch) things ordered chunk by chunk,
    /// microbatch by microbatch, layer by layer, as TransformerEngine orders sample inputs and
    /// graphed callables.
    pub fn instance(&self, layers_per_chunk: &[usize], layer: usize, microbatch: usize) -> usize {
        let mut first = 0;
        for &n in layers_per_chunk {
            if layer < first + n {
                return first * self.microbatches + microbatch * n + (layer - first);
            }
            first += n;
        }
        first * self.microbatches + microbatch
    }

    /// In TransformerEngine's `_order` encoding.
    pub fn to_te_order(&self) -> Vec<f64> {
        (self.steps.iter())
            .map(|s| match *s {
                Step::Forward(k) => (k + 1) as f64,
                Step::Backward(k) => -((k + 1) as f64),
                Step::WeightGrad(k) => -((k + 1) as f64 + 0.5),
            })
            .collect()
    }
}

/// What a pass of a schedule hands on (an output, an input gradient): to the next pass, or to the
/// caller (the head's input, the step's input gradients).
pub trait Handed: Clone {
    /// The tensor.
    ///
    /// # Errors
    /// When it can no longer be read: graphed, once a later replay overwrote it
    /// (`graph::GraphedErrorKind::StaleOutput`).
    fn tensor(&self) -> Result<&Tensor>;
}

/// An eager pass's own tensor, readable as long as it lives.
impl Handed for Tensor {
    fn tensor(&self) -> Result<&Tensor> {
        Ok(self)
    }
}

/// One way of running the passes a schedule names: layer `layer` (counted over every chunk's
/// layers, chunk by chunk) for microbatch `microbatch`, eagerly ([`EagerPasses`]) or graphed
/// (`graph::GraphedPasses`).
pub trait SchedulePasses {
    /// What its passes hand on: a [`Tensor`] eagerly; graphed, a `graph::StaticTensor`, which
    /// refuses to be read once a later replay overwrote its static buffer.
    type Out: Handed;
    /// Adds `by` (wrapping: a step back is a wrapped add) to the dropout step counter `step`,
    /// on the passes' stream.
    fn advance_rng(&mut self, step: &Tensor, by: u64) -> Result<()>;
    /// The layer's forward of `x`.
    fn forward(&mut self, layer: usize, microbatch: usize, x: &Tensor) -> Result<Self::Out>;
    /// The layer's backward of `dy`: its input gradient.
    fn backward(&mut self, layer: usize, microbatch: usize, dy: &Tensor) -> Result<Self::Out>;
    /// The layer's split weight-gradient pass; nothing for a layer that does not split one out.
    fn weight_grad(&mut self, layer: usize, microbatch: usize) -> Result<()>;
    /// Whether the layer splits its weight gradients out, run by the schedule's weight-gradient
    /// steps.
    ///
    /// # Errors
    /// [`ScheduleErrorKind::NoSuchLayer`] when the passes have no such layer.
    fn splits_weight_grads(&self, layer: usize) -> Result<bool>;
}

/// Where a rank's chunks sit in a pipeline of ranks: with `count` stages, chunk k of stage s
/// is the model's chunk k·count + s (Megatron-LM's interleaved placement), so activations go
/// from stage s to s + 1 and from the last stage back to the first between a rank's chunks.
/// [`Stage::single`] holds the whole model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    index: usize,
    count: usize,
}

impl Stage {
    /// One stage that holds every chunk: nothing crosses ranks.
    pub fn single() -> Stage {
        Stage { index: 0, count: 1 }
    }

    /// Stage `index` of `count`.
    ///
    /// # Errors
    /// [`ScheduleErrorKind::NoSuchStage`] for no stages or an index outside them.
    pub fn new(index: usize, count: usize) -> Result<Stage> {
        if index >= count {
            return refuse(ScheduleErrorKind::NoSuchStage { index, count });
        }
        Ok(Stage { index, count })
    }

    /// Its index among the stages.
    pub fn index(self) -> usize {
        self.index
    }

    /// How many stages the pipeline has.
    pub fn count(self) -> usize {
        self.count
    }

    /// The model's chunk that the rank's chunk `chunk` is.
    pub fn model_chunk(self, chunk: usize) -> usize {
        chunk * self.count + self.index
    }

    /// The model's layers the stage holds, in its chunks' order, when every chunk has
    /// `per_chunk` layers and the stage `chunks` chunks: what it builds and graphs.
    pub fn model_layers(self, chunks: usize, per_chunk: usize) -> Vec<usize> {
        (0..chunks).flat_map(|k| (0..per_chunk).map(move |i| self.model_chunk(k) * per_chunk + i)).collect()
    }

    /// The stage activations come from.
    pub fn prev(self) -> usize {
        (self.index + self.count - 1) % self.count
    }

    /// The stage activations go to.
    pub fn next(self) -> usize {
        (self.index + 1) % self.count
    }
}

/// How activations and gradients cross between pipeline stages (`dist::P2pLinks` over a
/// communicator): between two steps of a schedule, the sends of the step before and the receive
/// of the step after, as one group, so that neighbours sending to each other meet.
///
/// Links may run their exchanges off the stage's stream, so that they overlap the passes that do
/// not read what they receive: the traversal calls [`wait`](StageLinks::wait) before a pass
/// reads a received tensor, and [`join`](StageLinks::join) when the step ends, failed or not.
pub trait StageLinks {
    /// Exchange number `index` of the rank's step (the same on every step, so that a graphed
    /// implementation replays what it captured): sends each `(stage, tensor)` of `sends` and
    /// receives one tensor of the boundary's shape from each stage of `recvs`, returned in order.
    fn exchange(&mut self, index: usize, sends: &[(usize, Tensor)], recvs: &[usize]) -> Result<Vec<Tensor>>;

    /// A pass on the stage's stream is about to read what exchange `index` of this step
    /// received: order the stream after it. Links that exchange on the stage's stream have
    /// nothing to do (the default).
    fn wait(&mut self, index: usize) -> Result<()> {
        let _ = index;
        Ok(())
    }

    /// The step's last exchange is enqueued: order the stage's stream after every exchange of
    /// the step, sends included. The default has nothing to do.
    fn join(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Runs `schedule` over chunks of `layers_per_chunk` layers: microbatch j's `inputs[j]` through
/// chunk 0, each chunk's output into the next chunk's forward of the same microbatch, the last
/// chunk's output to `head(j, y)`, which returns its upstream gradient; each backward's input
/// gradient into the previous chunk's backward of the microbatch. Before every forward step of
/// microbatch j, `rng_step` (the layers' dropout step counter, if any) is moved to its value at
/// the step's start plus j + 1, as a stack's forward of microbatch j advances it, so that every
/// schedule (and every pipeline stage) draws the masks of the plain stack. Returns each
/// microbatch's input gradient. The one traversal of a schedule, as
/// [`forward_pass`](super::forward_pass) and [`backward_pass`](super::backward_pass) are a
/// stack's. What reaches `head` and what it returns are the passes' [`Handed`] values: graphed,
/// they refuse to be read after a later replay (the next step's) overwrote them.
///
/// # Errors
/// [`ScheduleErrorKind::LayersAndInputs`] when the layers or inputs do not fit the schedule; the
/// passes' own.
pub fn run_schedule<P: SchedulePasses + ?Sized>(
    passes: &mut P,
    schedule: &Schedule,
    layers_per_chunk: &[usize],
    inputs: &[Tensor],
    rng_step: Option<&Tensor>,
    head: &mut dyn FnMut(usize, P::Out) -> Result<Tensor>,
) -> Result<Vec<P::Out>> {
    traverse(passes, schedule, (layers_per_chunk, inputs), rng_step, head, None)
}

/// [`run_schedule`] for pipeline stage `stage`, whose chunks are the model's chunks
/// `k·stages + stage`: a chunk's input comes through `links` from the stage before unless it is
/// the model's first, its output goes to the stage after unless it is the model's last (then
/// to `head`), and gradients go the other way. `inputs` are the microbatches on the first stage
/// and empty on the others; only the first stage returns input gradients (the others an empty
/// list). Sends of one step and the receive of the next go as one exchange.
///
/// # Errors
/// As [`run_schedule`], and the links' own.
pub fn run_pipeline_stage<P: SchedulePasses + ?Sized>(
    passes: &mut P,
    schedule: &Schedule,
    (layers_per_chunk, inputs): (&[usize], &[Tensor]),
    rng_step: Option<&Tensor>,
    head: &mut dyn FnMut(usize, P::Out) -> Result<Tensor>,
    stage: Stage,
    links: &mut dyn StageLinks,
) -> Result<Vec<P::Out>> {
    let walked = traverse(passes, schedule, (layers_per_chunk, inputs), rng_step, head, Some((stage, &mut *links)));
    // Joined on every exit, a failed step's too, so that no exchange of this step is in flight
    // or waited for when the next one starts.
    let joined = links.join();
    let dxs = walked?;
    joined?;
    Ok(dxs)
}

/// A tensor between chunks: one the caller gave or a pass received, or one a pass made.
#[derive(Clone)]
enum Flow<O> {
    Given(Tensor),
    Made(O),
}

impl<O: Handed> Flow<O> {
    fn tensor(&self) -> Result<&Tensor> {
        match self {
            Flow::Given(t) => Ok(t),
            Flow::Made(o) => o.tensor(),
        }
    }
}

/// A tensor between chunks, and the exchange that received it (`None` when it never left the
/// rank).
type Arrived<O> = (Flow<O>, Option<usize>);

/// Runs `schedule`'s steps on `passes` for this rank's stage of `pipeline` (one stage without
/// it), its chunks of `layers_per_chunk` layers fed `inputs` (stage 0) or what the stage before
/// sends, exchanging with the neighbouring stages before the steps that need it, and `head` after
/// the model's last chunk; stage 0's input gradients per microbatch. Kept as one walk, over
/// 80 lines, until the planned redesign of schedule walks: its tensors in flight, exchanges and
/// random-number counter are one state that each step reads and advances.
fn traverse<P: SchedulePasses + ?Sized>(
    passes: &mut P,
    schedule: &Schedule,
    (layers_per_chunk, inputs): (&[usize], &[Tensor]),
    rng_step: Option<&Tensor>,
    head: &mut dyn FnMut(usize, P::Out) -> Result<Tensor>,
    mut pipeline: Option<(Stage, &mut dyn StageLinks)>,
) -> Result<Vec<P::Out>> {
    let stage = pipeline.as_ref().map_or(Stage::single(), |(s, _)| *s);
    let microbatches = schedule.microbatches();
    let expected_inputs = if stage.index == 0 { microbatches } else { 0 };
    let unfit = || {
        Error::Schedule(ScheduleErrorKind::LayersAndInputs {
            layers_per_chunk: layers_per_chunk.to_vec(),
            inputs: inputs.len(),
            chunks: schedule.chunks(),
            microbatches,
            stage: stage.index,
            stages: stage.count,
        })
    };
    let fits = layers_per_chunk.len() == schedule.chunks() && !layers_per_chunk.contains(&0);
    if !fits || inputs.len() != expected_inputs {
        return Err(unfit());
    }
    // Every layer exists, and split weight gradients have steps to run them.
    schedule.check_weight_grads(layers_per_chunk, &mut |l| passes.splits_weight_grads(l))?;
    let first: Vec<usize> = layers_per_chunk.iter().scan(0, |a, n| Some(std::mem::replace(a, *a + n))).collect();
    let layers = |k: usize| first[k]..first[k] + layers_per_chunk[k];
    let last = stage.count * schedule.chunks() - 1;
    let remote = stage.count > 1;
    // Between chunks, per microbatch: an activation forward, a gradient backward, each with the
    // exchange it came from when received (waited for before it is read).
    let mut flowing: Vec<Option<Arrived<P::Out>>> = vec![None; microbatches];
    for (f, x) in flowing.iter_mut().zip(inputs) {
        *f = Some((Flow::Given(x.clone()), None));
    }
    let mut grads: Vec<Option<Arrived<P::Out>>> = vec![None; microbatches];
    let mut outgoing: Vec<(usize, Tensor)> = Vec::new();
    let steps = schedule.with_microbatches();
    let recv_from = |step: Step| match step {
        Step::Forward(k) if remote && stage.model_chunk(k) != 0 => Some(stage.prev()),
        Step::Backward(k) if remote && stage.model_chunk(k) != last => Some(stage.next()),
        _ => None,
    };
    // Where exchanges go (Megatron-LM's grouping, which its schedules meet without deadlock):
    // before every step, but an interleaved schedule's steady state runs a backward that follows
    // a forward in the same segment, so that one exchange sends both passes' outputs and
    // receives what the next forward and backward need. A rank whose warmup holds every forward
    // has no steady state: its first backward's gradient is received only after its last
    // forward's output is sent, since the stage after needs that output to make the gradient.
    let all_warmup = steps.iter().rposition(|s| matches!(s.0, Step::Forward(_)))
        < steps.iter().position(|s| matches!(s.0, Step::Backward(_)));
    let interleaved = schedule.chunks() > 1 && !all_warmup;
    let joined = |i: usize| {
        interleaved && i > 0 && matches!((steps[i - 1].0, steps[i].0), (Step::Forward(_), Step::Backward(_)))
    };
    let (mut exchanges, mut rng_at) = (0, 0u64);
    for (i, &(step, j)) in steps.iter().enumerate() {
        if let Some((_, links)) = pipeline.as_mut().filter(|_| !joined(i)) {
            let segment = (i..steps.len()).take_while(|&n| n == i || joined(n));
            let wanted: Vec<(Step, usize, usize)> =
                segment.filter_map(|n| recv_from(steps[n].0).map(|from| (steps[n].0, steps[n].1, from))).collect();
            if !wanted.is_empty() || !outgoing.is_empty() {
                let recvs: Vec<usize> = wanted.iter().map(|w| w.2).collect();
                let got = links.exchange(exchanges, &std::mem::take(&mut outgoing), &recvs)?;
                for ((step, mb, _), t) in wanted.into_iter().zip(got) {
                    match step {
                        Step::Forward(_) => flowing[mb] = Some((Flow::Given(t), Some(exchanges))),
                        _ => grads[mb] = Some((Flow::Given(t), Some(exchanges))),
                    }
                }
                exchanges += 1;
            }
        }
        match step {
            Step::Forward(k) | Step::Backward(k) => {
                let forward = matches!(step, Step::Forward(_));
                if let Some(counter) = rng_step.filter(|_| forward) {
                    passes.advance_rng(counter, (j as u64 + 1).wrapping_sub(rng_at))?;
                    rng_at = j as u64 + 1;
                }
                let (slot, what) = if forward { (&mut flowing[j], "input") } else { (&mut grads[j], "gradient") };
                let not_received = || Error::Schedule(ScheduleErrorKind::NotReceived { step, microbatch: j, what });
                let (mut t, from) = slot.take().ok_or_else(not_received)?;
                if let (Some(e), Some((_, links))) = (from, pipeline.as_mut()) {
                    links.wait(e)?;
                }
                for l in step.layer_order(layers(k)) {
                    let x = t.tensor()?;
                    t = Flow::Made(if forward { passes.forward(l, j, x)? } else { passes.backward(l, j, x)? });
                }
                // Every chunk has a layer (checked above): its last pass made `t`.
                let Flow::Made(t) = t else { return Err(unfit()) };
                // The output goes to the head after the model's last chunk, to the neighbouring
                // stage across ranks, or to this rank's next step of the microbatch.
                let chunk = stage.model_chunk(k);
                match forward {
                    true if chunk == last => grads[j] = Some((Flow::Given(head(j, t)?), None)),
                    true if remote => outgoing.push((stage.next(), t.tensor()?.clone())),
                    true => flowing[j] = Some((Flow::Made(t), None)),
                    false if remote && chunk != 0 => outgoing.push((stage.prev(), t.tensor()?.clone())),
                    false => grads[j] = Some((Flow::Made(t), None)),
                }
            }
            Step::WeightGrad(k) => {
                for l in step.layer_order(layers(k)) {
                    passes.weight_grad(l, j)?;
                }
            }
        }
    }
    if let Some((_, links)) = pipeline.as_mut().filter(|_| !outgoing.is_empty()) {
        links.exchange(exchanges, &outgoing, &[])?;
    }
    // Every valid schedule ends its forwards with the last microbatch; this keeps the counter's
    // step-to-step advance at the microbatch count whatever the order.
    if let Some(counter) = rng_step.filter(|_| rng_at != microbatches as u64) {
        passes.advance_rng(counter, (microbatches as u64).wrapping_sub(rng_at))?;
    }
    if stage.index != 0 {
        return Ok(Vec::new());
    }
    (grads.into_iter())
        .map(|d| match d {
            Some((Flow::Made(dx), _)) => Ok(dx),
            _ => Err(Error::Schedule(ScheduleErrorKind::Empty)),
        })
        .collect()
}

/// The layers of a schedule run eagerly, each (layer, microbatch)'s context kept for its
/// backward.
pub struct EagerPasses<'a, M: Module> {
    layers: &'a [M],
    hook: &'a dyn SaveHook,
    stream: &'a Stream,
    saved: HashMap<(usize, usize), M::Ctx>,
}

impl<'a, M: Module> EagerPasses<'a, M> {
    /// `layers` (every chunk's, chunk by chunk), saving through `hook`, on `stream`.
    pub fn new(layers: &'a [M], hook: &'a dyn SaveHook, stream: &'a Stream) -> EagerPasses<'a, M> {
        EagerPasses { layers, hook, stream, saved: HashMap::new() }
    }
}

impl<M: Module> SchedulePasses for EagerPasses<'_, M> {
    type Out = Tensor;

    fn advance_rng(&mut self, step: &Tensor, by: u64) -> Result<()> {
        crate::ops::rng::step_add(step, by, self.stream)
    }

    fn forward(&mut self, layer: usize, microbatch: usize, x: &Tensor) -> Result<Tensor> {
        let (mut y, ctx) = self.layers[layer].forward(&Inputs::one(x), self.hook, self.stream)?;
        self.saved.insert((layer, microbatch), ctx);
        Ok(y.remove(0))
    }

    fn backward(&mut self, layer: usize, microbatch: usize, dy: &Tensor) -> Result<Tensor> {
        let ctx = (self.saved.remove(&(layer, microbatch)))
            .ok_or(Error::Schedule(ScheduleErrorKind::BackwardBeforeForward { layer, microbatch }))?;
        super::input_grad("EagerPasses::backward", self.layers[layer].backward(ctx, &[dy], self.stream)?)
    }

    fn weight_grad(&mut self, layer: usize, _microbatch: usize) -> Result<()> {
        self.layers[layer].backward_dw(self.stream)
    }

    fn splits_weight_grads(&self, layer: usize) -> Result<bool> {
        let Some(m) = self.layers.get(layer) else {
            return refuse(ScheduleErrorKind::NoSuchLayer { layer, layers: self.layers.len() });
        };
        Ok(m.splits_dw())
    }
}

fn positive(args: &[(&'static str, usize)]) -> Result<()> {
    match args.iter().find(|(_, v)| *v == 0) {
        Some(&(name, _)) => refuse(ScheduleErrorKind::Zero { name }),
        None => Ok(()),
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let steps: Vec<String> = self.steps.iter().map(ToString::to_string).collect();
        write!(f, "{} chunks × {} microbatches: {}", self.chunks, self.microbatches, steps.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(r: Result<Schedule>) -> ScheduleErrorKind {
        match r {
            Err(Error::Schedule(k)) => k,
            other => panic!("expected a schedule error, got {other:?}"),
        }
    }

    #[test]
    fn transformer_engine_orders_round_trip() {
        let order = [1.0, 2.0, 1.0, 2.0, -2.0, -1.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0];
        let s = Schedule::from_te_order(&order).unwrap();
        assert_eq!((s.chunks(), s.microbatches(), s.to_te_order()), (2, 3, order.to_vec()));
        let w = Schedule::from_te_order(&[1.0, -1.0, -1.5, 1.0, -1.0, -1.5]).unwrap();
        assert!(w.splits_weight_grads());
        assert_eq!(w.with_microbatches()[5], (Step::WeightGrad(0), 1));
    }

    #[test]
    fn every_inconsistency_is_refused() {
        assert!(matches!(kind(Schedule::from_te_order(&[])), ScheduleErrorKind::Empty));
        assert!(matches!(kind(Schedule::from_te_order(&[1.0, -1.25])), ScheduleErrorKind::BadEntry { index: 1, .. }));
        assert!(matches!(kind(Schedule::from_te_order(&[0.0])), ScheduleErrorKind::BadEntry { .. }));
        assert!(matches!(kind(Schedule::from_te_order(&[1.5])), ScheduleErrorKind::BadEntry { .. }));
        // Chunk 2 has one microbatch, chunk 1 two: the counts do not divide.
        let r = Schedule::from_te_order(&[1.0, 2.0, 1.0, -2.0, -1.0, -1.0]);
        assert!(matches!(kind(r), ScheduleErrorKind::Counts { chunk: 1, .. }));
        // A backward before its forward.
        assert!(matches!(kind(Schedule::from_te_order(&[-1.0, 1.0])), ScheduleErrorKind::Dependency { index: 0, .. }));
        // Chunk 2's forward before chunk 1's, and chunk 1's backward before chunk 2's.
        let r = Schedule::from_te_order(&[2.0, 1.0, -2.0, -1.0]);
        assert!(matches!(kind(r), ScheduleErrorKind::Dependency { index: 0, .. }));
        let r = Schedule::from_te_order(&[1.0, 2.0, -1.0, -2.0]);
        assert!(matches!(kind(r), ScheduleErrorKind::Dependency { index: 2, .. }));
        // Weight gradients that do not match the backwards, or come before them.
        let r = Schedule::from_te_order(&[1.0, 1.0, -1.0, -1.5, -1.0]);
        assert!(matches!(kind(r), ScheduleErrorKind::WeightGrads { chunk: 0, wgrads: 1, backwards: 2 }));
        let r = Schedule::from_te_order(&[1.0, -1.5, -1.0]);
        assert!(matches!(kind(r), ScheduleErrorKind::WeightGrads { .. }));
        let r = Schedule::from_te_order(&[1.0, -1.0, -2.5]);
        assert!(matches!(kind(r), ScheduleErrorKind::WeightGrads { chunk: 1, .. }));
        assert!(matches!(
            kind(Schedule::interleaved_1f1b(2, 2, 1, 4)),
            ScheduleErrorKind::RankOutsideStages { rank: 2, stages: 2 }
        ));
        assert!(matches!(
            kind(Schedule::interleaved_1f1b(2, 0, 2, 3)),
            ScheduleErrorKind::NotMultipleOfStages { microbatches: 3, stages: 2 }
        ));
        assert!(matches!(kind(Schedule::all_forward_then_backward(0, 2)), ScheduleErrorKind::Zero { name: "chunks" }));
        let stage = Stage::new(2, 2).err();
        assert!(matches!(stage, Some(Error::Schedule(ScheduleErrorKind::NoSuchStage { index: 2, count: 2 }))));
    }

    #[test]
    fn a_forward_runs_its_chunks_layers_in_order_and_the_other_passes_last_first() {
        let order = |step: Step| step.layer_order(3..6).collect::<Vec<_>>();
        assert_eq!(order(Step::Forward(1)), [3, 4, 5]);
        assert_eq!(order(Step::Backward(1)), [5, 4, 3]);
        assert_eq!(order(Step::WeightGrad(1)), [5, 4, 3]);
    }

    #[test]
    fn a_stage_holds_every_stages_th_chunk_of_the_model() {
        let stage = Stage::new(1, 2).unwrap();
        assert_eq!((stage.prev(), stage.next(), stage.model_chunk(1)), (0, 0, 3));
        assert_eq!(stage.model_layers(2, 2), vec![2, 3, 6, 7]);
        assert!(Stage::new(2, 2).is_err());
    }

    #[test]
    fn builders_make_valid_schedules_of_their_shape() {
        for (p, v, m) in [(1, 1, 3), (1, 2, 4), (2, 2, 4), (4, 2, 8), (4, 1, 8), (2, 3, 6)] {
            for rank in 0..p {
                let s = Schedule::interleaved_1f1b(p, rank, v, m).unwrap();
                assert_eq!((s.chunks(), s.microbatches(), s.steps().len()), (v, m, 2 * v * m), "{p} {rank} {v} {m}");
            }
        }
        // 1F1B on the last rank alternates from the start; on the first it warms up p - 1.
        let last = Schedule::interleaved_1f1b(4, 3, 1, 4).unwrap();
        assert_eq!(last.steps()[..2], [Step::Forward(0), Step::Backward(0)]);
        let first = Schedule::interleaved_1f1b(4, 0, 1, 4).unwrap();
        assert!(first.steps()[..4].iter().all(|s| *s == Step::Forward(0)));
        let zb = Schedule::zero_bubble(2, 0, 4).unwrap();
        assert_eq!(zb.steps().len(), 12);
        assert!(zb.splits_weight_grads());
        let all = Schedule::all_forward_then_backward(2, 2).unwrap();
        assert_eq!(all.to_te_order(), vec![1.0, 2.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0]);
    }
}
