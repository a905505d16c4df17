//! [`Builder`]: everything a module's constructor needs, as one value (candle-nn's
//! `VarBuilder`): the parameter store, the allocator and stream, a dotted name prefix, the
//! initialization seed and the dropout a layer draws. A model hands each part a builder one level
//! down (`vb.pp("h0")`), and the part names its parameters below it, so that names (which
//! checkpoints keep) follow from the model's structure rather than from strings at call sites.
//!
//! Seeds are explicit, not derived from names: a module initializes from the builder's seed, and
//! a composite one gives its parts fixed offsets from it (`Mlp`: `fc1` from the seed, `fc2` from
//! seed + 1), so that a model's initial parameters are the same on every device and every run.

use super::{DropoutSpec, Fp8Training, Param, ParamStore};
use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::tensor::Tensor;
use crate::Result;

/// Which saved activations a layer's backward recomputes instead of keeping them from its
/// forward: memory against time (docs/design.md, "Where a step's memory goes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep every saved tensor.
    #[default]
    Nothing,
    /// The MLP's GELU output, 4 of the 16 activation-sized tensors a transformer layer saves: the
    /// backward runs GELU again on the saved pre-activation, one memory-bound pass, for FC2's
    /// weight gradient. The pre-activation is stored rounded to the model's type, so in bf16 the
    /// recomputed output can differ from the forward's in the last bit (in f32 on the simulator
    /// it is the same); graphed still equals eager bit for bit. Not with FP8, whose FC2 keeps
    /// its input quantized.
    Gelu,
    /// The two LayerNorm outputs (the attention's and the MLP's inputs), 2 of the 16: the
    /// backward runs each LayerNorm's forward again on its saved input, for the QKV and FC1
    /// weight gradients. The same kernel on the same bits gives the same bits, so the gradients
    /// are those of keeping them. Not with FP8, whose linears keep their inputs quantized.
    Norms,
    /// Both: 6 of the 16.
    GeluAndNorms,
}

impl Recompute {
    /// `none`, `gelu`, `norm` or `gelu-norm`, as `--recompute` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::Nothing => "none",
            Recompute::Gelu => "gelu",
            Recompute::Norms => "norm",
            Recompute::GeluAndNorms => "gelu-norm",
        }
    }

    /// Whether the MLP's GELU output is recomputed.
    pub fn gelu(self) -> bool {
        matches!(self, Recompute::Gelu | Recompute::GeluAndNorms)
    }

    /// Whether the LayerNorms' outputs are recomputed.
    pub fn norms(self) -> bool {
        matches!(self, Recompute::Norms | Recompute::GeluAndNorms)
    }
}

/// Where a module's constructor puts its parameters and what it initializes them from.
/// Cloning is cheap: clones share the store and the dropout's step counter.
///
/// ```
/// use graphed::device::Device;
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, LayerNorm, Linear, ParamStore};
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &s, Linear::parameter_count((4, 3)) + LayerNorm::parameter_count(3))?;
/// let vb = Builder::new(&store, &alloc, &s)?.with_seed(1);
/// let block = vb.pp("block");
/// let (_fc, _ln) = (Linear::new(&block.pp("fc"), (4, 3))?, LayerNorm::new(&block.pp("ln"), 3)?);
/// let names: Vec<String> = store.ranges().into_iter().map(|(name, _)| name).collect();
/// assert_eq!(names, ["block.fc.weight", "block.fc.bias", "block.ln.weight", "block.ln.bias"]);
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone)]
pub struct Builder<'a> {
    store: &'a ParamStore,
    alloc: CachingAllocator,
    stream: Stream,
    /// Dotted, empty at the root.
    prefix: String,
    seed: u64,
    /// What a dropout built here draws from; its site is the next dropout's.
    dropout: DropoutSpec,
    /// The FP8 state its Linear layers register with.
    fp8: Option<Fp8Training>,
    /// What its layers' backward recomputes.
    recompute: Recompute,
}

impl<'a> Builder<'a> {
    /// A builder at the root of `store`'s names, seed 0, dropout off (p = 0) at site 0, with a new
    /// dropout step counter ([`step`](Builder::step)) that every clone shares.
    ///
    /// # Errors
    /// Device errors allocating the step counter.
    pub fn new(store: &'a ParamStore, alloc: &CachingAllocator, stream: &Stream) -> Result<Builder<'a>> {
        let step = Tensor::zeros(alloc, stream, &[1], DType::U64)?;
        Ok(Builder {
            store,
            alloc: alloc.clone(),
            stream: stream.clone(),
            prefix: String::new(),
            seed: 0,
            dropout: DropoutSpec { p: 0.0, seed: 0, site: 0, step },
            fp8: None,
            recompute: Recompute::Nothing,
        })
    }

    /// The builder one level down: parameters named `{prefix}.{name}.…`.
    pub fn pp(&self, name: &str) -> Builder<'a> {
        Builder { prefix: self.name(name), ..self.clone() }
    }

    /// The same builder, initializing from `seed`.
    pub fn with_seed(self, seed: u64) -> Builder<'a> {
        Builder { seed, ..self }
    }

    /// The same builder, its dropouts dropping with probability `p` (checked, `0 ≤ p < 1`, by the
    /// modules that draw) from the model's RNG `seed`.
    pub fn with_dropout(self, p: f32, seed: u32) -> Builder<'a> {
        Builder { dropout: DropoutSpec { p, seed, ..self.dropout }, ..self }
    }

    /// The same builder, its next dropout drawing at `site` (distinct per dropout, so that
    /// dropouts draw independent masks: Note [Graph-safe RNG] in `ops/rng.rs`).
    pub fn with_site(self, site: u32) -> Builder<'a> {
        Builder { dropout: DropoutSpec { site, ..self.dropout }, ..self }
    }

    /// The same builder, the [`Linear`](super::Linear) layers built from it running their GEMMs
    /// in FP8 with `fp8`'s recipe (a bf16 store's weights only; call [`Fp8Training::start`] once
    /// the model is built).
    pub fn with_fp8(self, fp8: &Fp8Training) -> Builder<'a> {
        Builder { fp8: Some(fp8.clone()), ..self }
    }

    /// The same builder, its layers' backward recomputing what `recompute` names.
    pub fn with_recompute(self, recompute: Recompute) -> Builder<'a> {
        Builder { recompute, ..self }
    }

    /// What the layers built here recompute in their backward.
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// The FP8 state the layers built here register with, if any.
    pub fn fp8(&self) -> Option<&Fp8Training> {
        self.fp8.as_ref()
    }

    /// The full name of `leaf` below the prefix.
    pub fn name(&self, leaf: &str) -> String {
        match self.prefix.is_empty() {
            true => leaf.to_string(),
            false => format!("{}.{leaf}", self.prefix),
        }
    }

    /// The dotted prefix, which names the module built here.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The seed a module built here initializes from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// What a dropout built here draws from.
    pub fn dropout(&self) -> &DropoutSpec {
        &self.dropout
    }

    /// The dropout step counter, shared by every module built from this builder and its clones:
    /// give it to [`Stack::with_rng_step`](super::Stack::with_rng_step) to draw new masks every
    /// forward.
    pub fn step(&self) -> &Tensor {
        &self.dropout.step
    }

    /// The allocator modules keep for their activations.
    pub fn alloc(&self) -> &CachingAllocator {
        &self.alloc
    }

    /// The stream the initial values are written on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// A new parameter `{prefix}.{leaf}` of `shape`, set to `init` (row-major).
    ///
    /// # Errors
    /// As [`ParamStore::add`]: [`Error::Shape`](crate::Error::Shape) when `init` does not fill
    /// `shape` or the store is full.
    pub fn add(&self, leaf: &str, shape: &[usize], init: &[f32]) -> Result<Param> {
        self.store.add(&self.name(leaf), shape, init, &self.stream)
    }
}
