//! Why a schedule, or a walk of one, was refused.

use crate::{Error, Result};

use super::Step;
#[cfg(doc)]
use super::{EagerPasses, SchedulePasses, Stage};

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

pub(super) fn refuse<T>(kind: ScheduleErrorKind) -> Result<T> {
    Err(Error::Schedule(kind))
}
