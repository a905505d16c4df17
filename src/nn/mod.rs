//! Layer 5, modules with explicit forward and backward: the unit that graph capture works on.
//!
//! The contract ([`Module`]), after llm.c and TransformerEngine:
//! - `forward` returns the outputs and a saved context for the backward;
//! - `backward` consumes that context and the output gradients, returns the input gradients
//!   (written, `=`) and accumulates the parameter gradients (`+=`), so that microbatches of one
//!   step sum without extra kernels;
//! - `backward_dw`, for modules that split it out, runs the weight-gradient part separately;
//! - saved activations go through a [`SaveHook`] at named sites, which does nothing by default,
//!   so that activation offloading can plug in without touching every module;
//! - `backward_hooked` tells a [`GradHook`] of parameter gradients final before the backward
//!   returns, so that the data-parallel reduction starts early.
//!
//! Parameters live in one flat buffer per model ([`ParamStore`]), with gradients in another of
//! the same layout, so that the optimizer updates every parameter in one launch. Modules are
//! built from a [`Builder`] over the store, which names and seeds their parameters.

mod attention;
mod builder;
mod dropout;
mod embedding;
mod fp8;
mod gpt;
mod grad_hook;
mod inputs;
mod layernorm;
mod linear;
mod lm_head;
mod mlp;
mod params;
mod saved;
mod schedule;
mod stack;
mod transformer;

pub use crate::ops::attention::AttentionBackend;
pub use attention::{AttentionCtx, AttentionKind, AttentionSpec, BackendsRan, CausalSelfAttention};
pub use builder::{Builder, Recompute};
pub use dropout::{Dropout, DropoutCtx, DropoutSpec};
pub use embedding::Embedding;
pub use fp8::{DelayedRecipe, Fp8Recipe, Fp8Scaling, Fp8Training};
pub use gpt::{ConfigLimit, Gpt, GptConfig, GptCtx, GptPart, HeadCtx};
pub use grad_hook::{GradHook, NoGradHook};
pub use inputs::{Input, Inputs};
pub use layernorm::{LayerNorm, LayerNormCtx};
pub use linear::{BiasGrad, Linear, LinearCtx, LinearForward, PreActGrad, QuantizedGrad};
pub use lm_head::{LmHead, LmHeadCtx};
pub use mlp::{Mlp, MlpCtx};
pub use params::{Param, ParamStore};
pub use saved::{Restore, SavedTensor};
pub use schedule::{
    run_pipeline_stage, run_schedule, EagerPasses, Handed, Schedule, ScheduleErrorKind, SchedulePasses, Stage,
    StageLinks, Step, Visit,
};
pub use stack::{backward_pass, forward_pass, Stack, StackCtx, Traverse};
pub use transformer::{Layers, TransformerCtx, TransformerLayer};

use crate::device::{BufferId, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Where saved activations pass on their way from forward to backward. The default does
/// nothing; an offload manager (`graphed::offload`) implements it to move them to host memory
/// and back, eagerly and inside captured graphs.
///
/// The calls, in order: [`begin_forward`](SaveHook::begin_forward) before each unit's (each
/// layer's) forward; per module, [`open_group`](SaveHook::open_group), a
/// [`save`](SaveHook::save) per tensor, [`commit_group`](SaveHook::commit_group); when the unit
/// is captured, [`end_pass`](SaveHook::end_pass) after the graph's sync event, also after each
/// captured backward. At replay, no module code runs: the graph layer calls
/// [`replayed`](SaveHook::replayed) after each launch.
pub trait SaveHook: Send + Sync {
    /// The forward of the next unit (a layer) begins on `stream`, inside its capture when
    /// captured: what the hook deferred until now (copies of the previous unit's activations)
    /// may start.
    fn begin_forward(&self, _stream: &Stream) -> Result<()> {
        Ok(())
    }
    /// A module starts saving for one forward (`site` names the module instance).
    fn open_group(&self, _site: &str) -> Result<()> {
        Ok(())
    }
    /// One saved tensor, by name, produced on `stream`; returns what the module keeps for its
    /// backward (the tensor itself by default).
    fn save(&self, _name: &str, t: Tensor, _stream: &Stream) -> Result<SavedTensor> {
        Ok(SavedTensor::kept(t))
    }
    /// The module finished saving; its tensors are complete on `stream`.
    fn commit_group(&self, _site: &str, _stream: &Stream) -> Result<()> {
        Ok(())
    }
    /// A captured pass is over and its sync event recorded: make `stream` wait for the streams
    /// forked for work that may finish after the caller resumes (the graph's tail, such as
    /// offload copies). Capture needs every forked stream joined before it ends.
    fn end_pass(&self, _stream: &Stream) -> Result<()> {
        Ok(())
    }
    /// A graph captured with this hook was launched on `stream` (work deferred to the next
    /// launch, such as delayed copies of eager modules, may be issued now).
    fn replayed(&self, _stream: &Stream) -> Result<()> {
        Ok(())
    }
    /// Memory outside the graph pool that a captured pass may touch after its sync event (the
    /// host buffers of offload copies), as [`Access::memory`](crate::device::Access::memory)
    /// ids: capture-time verification (R3) allows it in the tail, and nothing else.
    fn tail_memory(&self) -> Vec<BufferId> {
        Vec::new()
    }
}

/// One chunk of a training step: a microbatch of one (virtual) pipeline stage. A save hook that
/// keeps state across forward and backward keeps it per chunk (one handler per chunk, made by
/// [`GraphOptions::init_chunk_handler`](crate::graph::GraphOptions::init_chunk_handler) when
/// graphed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Chunk {
    /// The microbatch.
    pub microbatch: usize,
    /// The virtual pipeline stage.
    pub stage: usize,
}

impl std::fmt::Display for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "microbatch {} of stage {}", self.microbatch, self.stage)
    }
}

/// The hook that keeps everything on the device.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeepOnDevice;

impl SaveHook for KeepOnDevice {}

/// A module with an explicit forward and backward (see the module docs for the conventions).
///
/// The one contract of the crate for a unit of computation: eager code calls it, [`Stack`] chains
/// it, and graph capture (`graph::make_graphed_callables`, `graph::make_graphed_stack`) captures
/// it. Inputs are [`Inputs`] (positional tensors, then named ones such as a mask); gradients come
/// back one per input, in [`Inputs::iter`] order, `None` for a constant or unused input.
///
/// ```
/// use graphed::device::Device;
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Inputs, KeepOnDevice, Linear, Module, ParamStore};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &s, 15)?;
/// let fc = Linear::new(&Builder::new(&store, &alloc, &s)?.pp("fc"), (4, 3))?;
/// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
/// let (y, ctx) = fc.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
/// let dy = Tensor::from_host(&alloc, &s, &[1.0f32; 6], &[2, 3])?;
/// let dx = fc.backward(ctx, &[&dy], &s)?;
/// assert_eq!((y[0].shape(), dx[0].as_ref().map(|d| d.shape())), (&[2, 3][..], Some(&[2, 4][..])));
/// # Ok::<(), graphed::Error>(())
/// ```
pub trait Module: Send + Sync {
    /// What the forward saves for the backward.
    type Ctx: Send + 'static;

    /// Computes the outputs of `inputs`, enqueued on `stream`.
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, Self::Ctx)>;

    /// One gradient per input, in [`Inputs::iter`] order (`None`: a constant or unused input),
    /// written (`=`); parameter gradients accumulated (`+=`) into their [`Param::grad`].
    fn backward(&self, ctx: Self::Ctx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>>;

    /// As [`backward`](Module::backward), telling `hook` of parameters whose gradients are final
    /// before it returns, so that their data-parallel reduction overlaps the rest of a long
    /// backward (a transformer layer's MLP half while its attention half runs; a stack's layers
    /// one by one). The default tells nothing early.
    fn backward_hooked(
        &self,
        ctx: Self::Ctx,
        grad_outputs: &[&Tensor],
        hook: &dyn GradHook,
        stream: &Stream,
    ) -> Result<Vec<Option<Tensor>>> {
        let _ = hook;
        self.backward(ctx, grad_outputs, stream)
    }

    /// Runs the weight-gradient work that `backward` left for later, for modules that split it
    /// out (TransformerEngine's `backward_dw`, which pipeline schedules use to fill bubbles).
    /// The default does nothing: such a module's `backward` accumulated its weight gradients.
    fn backward_dw(&self, _stream: &Stream) -> Result<()> {
        Ok(())
    }

    /// Whether `backward` leaves weight gradients to [`Module::backward_dw`].
    fn splits_dw(&self) -> bool {
        false
    }

    /// The step counter its forward draws random numbers from in training (its dropouts'), which
    /// whoever runs it must advance between forwards for new masks; `None` for a module that
    /// draws nothing, or that advances the counter itself (a [`Stack`] made
    /// [`with_rng_step`](Stack::with_rng_step)). Graphed callables advance it
    /// (`graph::make_graphed_callables`). The default draws nothing.
    fn draws_from(&self) -> Option<&Tensor> {
        None
    }

    /// The module's parameters.
    fn parameters(&self) -> Vec<&Param>;

    /// Device state besides its parameters' gradients that its passes write: the amax slots of
    /// FP8 training ([`Fp8Training`]). A capture's warmup leaves it as it found it, as it does
    /// the gradients (TransformerEngine saves and restores its FP8 metadata around its warmup
    /// likewise). The default writes none.
    fn pass_state(&self) -> Vec<Tensor> {
        Vec::new()
    }

    /// Turns training behaviour (dropout) on or off.
    fn set_training(&mut self, training: bool);
}

/// The first dropout site of the attention dropouts: a [`TransformerLayer`] whose residual
/// dropouts draw at sites `s` and `s + 1` (below this) draws its attention dropout at
/// `ATTENTION_DROPOUT_SITES + s`, so that no attention dropout shares a site, and so its numbers,
/// with a residual dropout (Note [Graph-safe RNG] in `ops/rng.rs`).
pub const ATTENTION_DROPOUT_SITES: u32 = 1 << 31;

/// The attention dropout's site of a layer whose residual dropouts start at `site`
/// ([`ATTENTION_DROPOUT_SITES`]` + site`); `None` when `site` is in the attention range.
pub fn attention_dropout_site(site: u32) -> Option<u32> {
    (site < ATTENTION_DROPOUT_SITES).then_some(ATTENTION_DROPOUT_SITES + site)
}

/// The gradient of a module's one input, from its `backward`'s result.
///
/// # Errors
/// [`Error::MissingGradient`] when the backward returned none for it.
pub fn input_grad(op: &'static str, grads: Vec<Option<Tensor>>) -> Result<Tensor> {
    grads.into_iter().next().flatten().ok_or_else(|| Error::MissingGradient { op, what: "input 0".into() })
}
