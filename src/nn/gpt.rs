//! A small GPT: token and position embedding, pre-LN transformer layers, a final LayerNorm and a
//! language-model head with cross-entropy. Parameters live in one [`ParamStore`], so one AdamW
//! launch updates them all. A pipeline stage builds its part of the model ([`GptPart`]), with
//! the whole model's names and initial values.

use super::{
    input_grad, AttentionBackend, AttentionKind, AttentionSpec, Builder, Embedding, Fp8Recipe, Fp8Training, GradHook,
    Inputs, KeepOnDevice, LayerNorm, LayerNormCtx, Layers, LmHead, LmHeadCtx, Module, NoGradHook, Param, ParamStore,
    Recompute, SaveHook, Stack, StackCtx, Stage, TransformerLayer,
};
use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The shape of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence.
    pub max_len: usize,
    /// Model width.
    pub dim: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Attention heads per layer.
    pub heads: usize,
    /// The form of the layers' attention (fused: head widths 32, 64 or 128, any length;
    /// unfused: any head width, at most `softmax::MAX_SEQ` positions).
    pub attention: AttentionKind,
    /// Which implementation runs the fused attention (cuDNN or graphed's kernels).
    pub attention_backend: AttentionBackend,
    /// Dropout probability (0: none), after each residual branch and on the attention
    /// probabilities.
    pub dropout: f32,
    /// Seed of the initialization and of dropout.
    pub seed: u64,
    /// Element type of the weights and activations (f32 or bf16); LayerNorm statistics, the
    /// loss and the optimizer's master weights are f32 whatever it is.
    pub dtype: DType,
    /// What the layers' backward recomputes instead of saving it (memory against time).
    pub recompute: Recompute,
}

/// What one [`GptConfig`] field (or the batch) is, when the kernels cannot run it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} = {value} is not supported: {why}")]
pub struct ConfigLimit {
    /// The field (`dim`, `heads`, `batch`, ...).
    pub field: &'static str,
    /// Its value.
    pub value: usize,
    /// What the kernels need, in a user's words.
    pub why: String,
}

impl GptConfig {
    /// Checks that the kernels can run this model, before anything is allocated: the width
    /// within LayerNorm's rows and a multiple of 2 (the MLP's 4·width rows are the aux matrix of
    /// a cuBLASLt epilogue, whose rows are a multiple of 8 elements), the heads dividing it, a
    /// head width the fused attention runs (fused) or a sequence within the causal softmax's rows
    /// (unfused), and every parameter addressable by the optimizer's kernel. [`Gpt::new`] calls
    /// it.
    ///
    /// ```
    /// use graphed::device::DType;
    /// use graphed::nn::{AttentionBackend, AttentionKind, GptConfig, Recompute};
    /// let config = GptConfig {
    ///     vocab: 16, max_len: 8, dim: 3, layers: 1, heads: 1, attention: AttentionKind::Fused,
    ///     attention_backend: AttentionBackend::Auto, dropout: 0.0, seed: 0, dtype: DType::F32,
    ///     recompute: Recompute::Nothing,
    /// };
    /// assert_eq!(config.validate().unwrap_err().field, "dim");
    /// // Heads of 16 features: only the unfused attention runs them.
    /// let narrow = GptConfig { dim: 32, heads: 2, ..config };
    /// assert!(narrow.validate().unwrap_err().why.contains("--attention unfused"));
    /// assert!(GptConfig { attention: AttentionKind::Unfused, ..narrow }.validate().is_ok());
    /// ```
    ///
    /// # Errors
    /// The first [`ConfigLimit`] the model hits.
    pub fn validate(&self) -> std::result::Result<(), ConfigLimit> {
        let limit = |field, value, why: String| Err(ConfigLimit { field, value, why });
        let max_dim = crate::ops::layernorm::MAX_FEATURES;
        let max_seq = crate::ops::softmax::MAX_SEQ;
        let aux = crate::device::AUX_LD_MULTIPLE;
        if self.dim == 0 || self.dim > max_dim {
            return limit(
                "dim",
                self.dim,
                format!("the width must be 1 to {max_dim} (LayerNorm keeps a row in registers)"),
            );
        }
        if !(4 * self.dim).is_multiple_of(aux) {
            let why = format!(
                "the width must be a multiple of {} (the MLP's 4·width columns are cuBLASLt's aux matrix, whose rows are a multiple of {aux} elements)",
                aux / 4
            );
            return limit("dim", self.dim, why);
        }
        if self.heads == 0 || !self.dim.is_multiple_of(self.heads) {
            return limit("heads", self.heads, format!("the heads must divide the width {}", self.dim));
        }
        let hd = self.dim / self.heads;
        if !self.attention.supports_head_dim(hd) {
            let dims = crate::ops::attention::HEAD_DIMS;
            let fits: Vec<String> =
                dims.iter().filter(|&&d| self.dim.is_multiple_of(d)).map(|&d| (self.dim / d).to_string()).collect();
            let counts = if fits.is_empty() { String::new() } else { format!(" ({} here)", fits.join(", ")) };
            return limit(
                "heads",
                self.heads,
                format!(
                    "{} heads of {hd} features: the fused attention runs heads of {dims:?} features; pick a head \
                     count that gives one of them{counts}, or `--attention unfused`",
                    self.heads
                ),
            );
        }
        if self.max_len == 0 {
            return limit("max_len", self.max_len, "sequences must have at least 1 position".into());
        }
        if self.attention == AttentionKind::Unfused && self.max_len > max_seq {
            return limit(
                "max_len",
                self.max_len,
                format!(
                    "the unfused attention runs sequences of 1 to {max_seq} positions (the causal softmax keeps a \
                     row in registers); use `--attention fused`"
                ),
            );
        }
        if self.vocab == 0 || self.layers == 0 {
            let (field, value) = if self.vocab == 0 { ("vocab", self.vocab) } else { ("layers", self.layers) };
            return limit(field, value, "must be at least 1".into());
        }
        if u32::try_from(self.parameter_count()).is_err() {
            return limit(
                "dim",
                self.dim,
                format!("{} parameters; the optimizer's kernel steps fewer than 2^32", self.parameter_count()),
            );
        }
        Ok(())
    }

    /// Checks that a batch of `batch` sequences of `max_len` fits the kernels' sizes (every
    /// tensor under 2^32 elements: the unfused attention's scores `batch·heads·max_len²`, the
    /// MLP's activations, the logits), after [`validate`](GptConfig::validate).
    ///
    /// # Errors
    /// [`ConfigLimit`] on `batch`.
    pub fn validate_batch(&self, batch: usize) -> std::result::Result<(), ConfigLimit> {
        self.validate()?;
        let rows = batch.checked_mul(self.max_len);
        let scores = match self.attention {
            AttentionKind::Unfused => self.heads * self.max_len,
            AttentionKind::Fused => 0,
        };
        let tensors = [
            ("the attention scores", scores, format!("batch·{}·{}²", self.heads, self.max_len)),
            ("the MLP's activations", 4 * self.dim, format!("batch·{}·{}", self.max_len, 4 * self.dim)),
            ("the logits", self.vocab, format!("batch·{}·{}", self.max_len, self.vocab)),
        ];
        // The fused attention has no scores (a width of 0 per row: skipped).
        let too_big = tensors.into_iter().filter(|(_, per_row, _)| *per_row > 0).find(|(_, per_row, _)| {
            rows.and_then(|r| r.checked_mul(*per_row)).is_none_or(|n| u32::try_from(n).is_err())
        });
        let why = match (batch, too_big) {
            (0, _) => "the batch must be at least 1".to_string(),
            (_, Some((what, _, size))) => {
                let fused = if what == "the attention scores" { " or `--attention fused`" } else { "" };
                format!(
                    "{what} would have {size} elements, and every tensor must stay under 2^32; use a smaller batch{fused}"
                )
            }
            (_, None) => return Ok(()),
        };
        Err(ConfigLimit { field: "batch", value: batch, why })
    }

    /// Number of parameters: what its modules add to the store.
    pub fn parameter_count(&self) -> usize {
        let (v, t, c) = (self.vocab, self.max_len, self.dim);
        Embedding::parameter_count((v, t, c))
            + self.layers * TransformerLayer::parameter_count(c)
            + LayerNorm::parameter_count(c)
            + LmHead::parameter_count((c, v))
    }
}

/// Which modules of a [`Gpt`] one process builds: the whole model, or a pipeline stage's part of
/// it (Megatron-LM's split: the embedding on the first stage, the final LayerNorm and the head on
/// the last, and the stage's layers). A part's modules keep the whole model's names and seeds, so
/// the parts of every stage together hold the whole model's initial parameters, and its
/// checkpoints' names are the whole model's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GptPart {
    /// The model's layers it holds, in the order the stage runs them (its chunks' order).
    layers: Vec<usize>,
    /// Whether it holds the embedding (the first stage).
    embedding: bool,
    /// Whether it holds the final LayerNorm and the head (the last stage).
    head: bool,
}

impl GptPart {
    /// Every module of a model of `layers` layers.
    pub fn whole(layers: usize) -> GptPart {
        GptPart { layers: (0..layers).collect(), embedding: true, head: true }
    }

    /// Pipeline stage `stage`'s part of a model of `layers` layers split into `chunks` chunks per
    /// stage of equal layers: chunk k of the stage is the model's chunk `k·stages + stage`
    /// ([`Stage::model_layers`]).
    ///
    /// # Errors
    /// [`Error::Config`] (field `layers`) when the layers do not split into the stages' chunks.
    pub fn stage(layers: usize, stage: Stage, chunks: usize) -> Result<GptPart> {
        let split = stage.count() * chunks;
        if chunks == 0 || !layers.is_multiple_of(split) {
            let why = format!("must split into {} stages × {chunks} chunks of equal layers", stage.count());
            return Err(Error::Config(ConfigLimit { field: "layers", value: layers, why }));
        }
        Ok(GptPart {
            layers: stage.model_layers(chunks, layers / split),
            embedding: stage.index() == 0,
            head: stage.index() + 1 == stage.count(),
        })
    }

    /// The model's layers it holds, in the stage's order.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Its parameters, as its modules add them to the store.
    fn parameter_count(&self, config: &GptConfig) -> usize {
        let (v, t, c) = (config.vocab, config.max_len, config.dim);
        let embedding = if self.embedding { Embedding::parameter_count((v, t, c)) } else { 0 };
        let head = if self.head { LayerNorm::parameter_count(c) + LmHead::parameter_count((c, v)) } else { 0 };
        embedding + self.layers.len() * TransformerLayer::parameter_count(c) + head
    }
}

/// The model, or a pipeline stage's part of it ([`Gpt::part`]).
pub struct Gpt {
    config: GptConfig,
    alloc: CachingAllocator,
    store: ParamStore,
    /// `None` on a part without it (not the first stage).
    embedding: Option<Embedding>,
    layers: Stack<TransformerLayer>,
    /// The final LayerNorm and the head; `None` on a part without them (not the last stage).
    head: Option<(LayerNorm, LmHead)>,
    step: Tensor,
    /// With FP8 training, the state of the transformer layers' Linear layers.
    fp8: Option<Fp8Training>,
}

/// What a forward saves for the backward.
pub struct GptCtx {
    tokens: Tensor,
    layers: StackCtx<<TransformerLayer as Module>::Ctx>,
    head: HeadCtx,
}

/// What [`Gpt::head`] saves for [`Gpt::head_backward`].
pub struct HeadCtx {
    /// Batch and sequence length.
    b: usize,
    t: usize,
    ln_f: LayerNormCtx,
    head: LmHeadCtx,
}

impl Gpt {
    /// A model with parameters initialized from `config.seed`.
    ///
    /// # Errors
    /// [`Error::Config`] when [`GptConfig::validate`] refuses the configuration, before
    /// anything is allocated; device errors.
    pub fn new(alloc: &CachingAllocator, config: GptConfig, stream: &Stream) -> Result<Gpt> {
        Gpt::build(alloc, config, &GptPart::whole(config.layers), None, stream)
    }

    /// The modules of `part` of the model [`Gpt::new`] builds from `config`, with the same names
    /// and initial parameters: a pipeline stage's. Calls that need a module the part does not hold
    /// ([`embed`](Gpt::embed) off the first stage, [`head`](Gpt::head) off the last) fail.
    ///
    /// # Errors
    /// As [`Gpt::new`].
    pub fn part(alloc: &CachingAllocator, config: GptConfig, part: &GptPart, stream: &Stream) -> Result<Gpt> {
        Gpt::build(alloc, config, part, None, stream)
    }

    /// As [`Gpt::new`] (with a bf16 `config.dtype`), the transformer layers' Linear layers
    /// running their GEMMs in FP8 with `recipe`, the state started (see [`Fp8Training`]); the
    /// embedding and the head stay bf16. Step the state with the optimizer
    /// ([`AdamW::with_fp8`](crate::optim::AdamW::with_fp8) of [`Gpt::fp8`]).
    ///
    /// # Errors
    /// As [`Gpt::new`], and [`Error::DTypeMismatch`] unless `config.dtype` is bf16.
    pub fn with_fp8(alloc: &CachingAllocator, config: GptConfig, recipe: Fp8Recipe, stream: &Stream) -> Result<Gpt> {
        let whole = GptPart::whole(config.layers);
        let gpt = Gpt::build(alloc, config, &whole, Some(Fp8Training::new(alloc, recipe)), stream)?;
        if let Some(fp8) = &gpt.fp8 {
            fp8.start(stream)?;
        }
        Ok(gpt)
    }

    /// The FP8 state of the layers, with [`Gpt::with_fp8`].
    pub fn fp8(&self) -> Option<&Fp8Training> {
        self.fp8.as_ref()
    }

    fn build(
        alloc: &CachingAllocator,
        config: GptConfig,
        part: &GptPart,
        fp8: Option<Fp8Training>,
        stream: &Stream,
    ) -> Result<Gpt> {
        config.validate().map_err(Error::Config)?;
        let store = ParamStore::with_dtype(alloc, stream, part.parameter_count(&config), config.dtype)?;
        let (c, seed) = (config.dim, config.seed);
        let vb = (Builder::new(&store, alloc, stream)?.with_seed(seed))
            .with_dropout(config.dropout, seed as u32)
            .with_recompute(config.recompute);
        let embedding =
            part.embedding.then(|| Embedding::new(&vb.pp("emb"), (config.vocab, config.max_len, c))).transpose()?;
        let attention = AttentionSpec::new(c, config.heads).kind(config.attention).backend(config.attention_backend);
        // Layer l seeded `seed + 1000·(l + 1)`.
        let layers_vb = vb.clone().with_seed(seed.wrapping_add(1000));
        let layers_vb = match &fp8 {
            Some(f) => layers_vb.with_fp8(f),
            None => layers_vb,
        };
        let which = Layers::of(part.layers.iter().copied()).seed_stride(1000);
        let layers = TransformerLayer::stack(&layers_vb, attention, &which)?;
        let head = part
            .head
            .then(|| -> Result<_> {
                let ln_f = LayerNorm::new(&vb.pp("ln_f"), c)?;
                Ok((ln_f, LmHead::new(&vb.pp("head").with_seed(seed.wrapping_add(7)), (c, config.vocab))?))
            })
            .transpose()?;
        let step = vb.step().clone();
        Ok(Gpt {
            config,
            alloc: alloc.clone(),
            store,
            embedding,
            layers: Stack::new(layers).with_rng_step(&step),
            head,
            step,
            fp8,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Every parameter and gradient, as two flat buffers.
    pub fn parameters(&self) -> &ParamStore {
        &self.store
    }

    /// The dropout step counter, which the layers' stack advances at the start of every forward
    /// (eager or graphed), so that each microbatch draws new masks.
    pub fn dropout_step(&self) -> &Tensor {
        &self.step
    }

    /// Turns dropout on or off.
    pub fn set_training(&mut self, training: bool) {
        self.layers.set_training(training);
    }

    /// The transformer layers, for callers that run them themselves (graphed).
    pub fn layers(&self) -> &Stack<TransformerLayer> {
        &self.layers
    }

    /// The `(B, T, dim)` embeddings of `(B, T)` tokens: the first layer's input.
    ///
    /// # Errors
    /// [`Error::NotInPart`] on a part without the embedding; device errors.
    pub fn embed(&self, tokens: &Tensor, stream: &Stream) -> Result<Tensor> {
        self.embedding("Gpt::embed")?.forward(tokens, stream)
    }

    /// Accumulates the embedding tables' gradients from the first layer's input gradient.
    ///
    /// # Errors
    /// As [`embed`](Gpt::embed).
    pub fn embed_backward(&self, tokens: &Tensor, dx: &Tensor, stream: &Stream) -> Result<()> {
        self.embedding("Gpt::embed_backward")?.backward(tokens, dx, stream)
    }

    /// Whether this model (or part) holds the embedding: the whole model's, or the first stage's.
    pub fn has_embedding(&self) -> bool {
        self.embedding.is_some()
    }

    /// Whether this model (or part) holds the final LayerNorm and the head, which compute the
    /// loss: the whole model's, or the last stage's.
    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    fn embedding(&self, op: &'static str) -> Result<&Embedding> {
        self.embedding.as_ref().ok_or(Error::NotInPart { op, module: "the embedding" })
    }

    fn ln_f_and_head(&self, op: &'static str) -> Result<&(LayerNorm, LmHead)> {
        self.head.as_ref().ok_or(Error::NotInPart { op, module: "the final LayerNorm and the head" })
    }

    /// The final LayerNorm and the head: per-position losses `(B·T)` of the last layer's output
    /// `x` `(B, T, dim)` against next-token `targets` `(B·T)`.
    pub fn head(&self, x: &Tensor, targets: &Tensor, stream: &Stream) -> Result<(Tensor, HeadCtx)> {
        let [b, t, c] = *x.shape() else {
            return Err(Error::Shape { op: "Gpt::head", expected: "(B, T, dim)".into(), found: x.shape().to_vec() });
        };
        let (ln, lm) = self.ln_f_and_head("Gpt::head")?;
        let (mut normed, ln_f) = ln.forward(&Inputs::one(&x.reshape(&[b * t, c])?), &KeepOnDevice, stream)?;
        let (losses, head) = lm.forward(&normed.remove(0), targets, stream)?;
        Ok((losses, HeadCtx { b, t, ln_f, head }))
    }

    /// The gradient `(B, T, dim)` of `Σ dlosses ⊙ losses` with respect to the last layer's
    /// output; accumulates the head's and final LayerNorm's parameter gradients.
    pub fn head_backward(&self, ctx: HeadCtx, dlosses: &Tensor, stream: &Stream) -> Result<Tensor> {
        let (ln, lm) = self.ln_f_and_head("Gpt::head_backward")?;
        let dnormed = lm.backward(ctx.head, dlosses, stream)?;
        input_grad("Gpt::head_backward", ln.backward(ctx.ln_f, &[&dnormed], stream)?)?.reshape(&[
            ctx.b,
            ctx.t,
            self.config.dim,
        ])
    }

    /// Per-position losses `(B·T)` of `tokens` `(B, T)` against next-token `targets` `(B·T)`.
    pub fn forward(&self, tokens: &Tensor, targets: &Tensor, stream: &Stream) -> Result<(Tensor, GptCtx)> {
        self.forward_with(tokens, targets, &KeepOnDevice, stream)
    }

    /// [`forward`](Gpt::forward) with the transformer layers' saved activations through `hook`
    /// (an offload manager's chunk hook, say).
    pub fn forward_with(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        hook: &dyn SaveHook,
        stream: &Stream,
    ) -> Result<(Tensor, GptCtx)> {
        let x = self.embed(tokens, stream)?;
        let (mut y, layers) = self.layers.forward(&Inputs::one(&x), hook, stream)?;
        let (losses, head) = self.head(&y.remove(0), targets, stream)?;
        Ok((losses, GptCtx { tokens: tokens.clone(), layers, head }))
    }

    /// Accumulates every parameter's gradient of `Σ dlosses ⊙ losses`.
    pub fn backward(&self, ctx: GptCtx, dlosses: &Tensor, stream: &Stream) -> Result<()> {
        self.backward_telling(ctx, dlosses, &NoGradHook, stream)
    }

    /// [`backward`](Gpt::backward), telling `hook` of each part's parameters as their gradients
    /// become final: the head's and final LayerNorm's first, the layers' one by one, the
    /// embedding's last.
    fn backward_telling(&self, ctx: GptCtx, dlosses: &Tensor, hook: &dyn GradHook, stream: &Stream) -> Result<()> {
        let dy = self.head_backward(ctx.head, dlosses, stream)?;
        let (ln, lm) = self.ln_f_and_head("Gpt::backward")?;
        hook.grads_final(&[ln.parameters(), lm.parameters()].concat(), stream)?;
        let dx = self.layers.backward_hooked(ctx.layers, &[&dy], hook, stream)?;
        let dx = input_grad("Gpt::backward", dx)?;
        self.embed_backward(&ctx.tokens, &dx, stream)
    }

    /// The softmax of the next-token logits `(B·T, vocab)`, for decoding.
    pub fn probabilities(&self, tokens: &Tensor, stream: &Stream) -> Result<Tensor> {
        let targets = Tensor::zeros(&self.alloc, stream, &[tokens.numel()], DType::U32)?;
        let (_, ctx) = self.forward(tokens, &targets, stream)?;
        Ok(ctx.head.head.probs)
    }
}

/// The whole model as one module, for capturing a training step whole
/// ([`make_graphed_callables`](crate::graph::make_graphed_callables) of `[&gpt]`: one forward
/// graph and one backward graph): constant inputs `tokens` `(B, T)` and `targets` `(B·T)`, one
/// output, the per-position losses `(B·T)`, whose gradient (the loss weights) the backward takes.
/// The inputs get no gradient; the backward tells a data-parallel reduction of each part's
/// parameters as they become final.
impl Module for Gpt {
    type Ctx = GptCtx;

    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, GptCtx)> {
        let input = |name: &str| {
            inputs.get(name).ok_or(Error::Shape {
                op: "Gpt::forward",
                expected: "the constant inputs `tokens` (B, T) and `targets` (B·T)".into(),
                found: Vec::new(),
            })
        };
        let (losses, ctx) = self.forward_with(input("tokens")?, input("targets")?, hook, stream)?;
        Ok((vec![losses], ctx))
    }

    fn backward(&self, ctx: GptCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        self.backward_hooked(ctx, grad_outputs, &NoGradHook, stream)
    }

    fn backward_hooked(
        &self,
        ctx: GptCtx,
        grad_outputs: &[&Tensor],
        hook: &dyn GradHook,
        stream: &Stream,
    ) -> Result<Vec<Option<Tensor>>> {
        let [dlosses] = grad_outputs else {
            return Err(Error::MissingGradient { op: "Gpt::backward", what: "the losses".into() });
        };
        self.backward_telling(ctx, dlosses, hook, stream)?;
        Ok(vec![None, None])
    }

    fn parameters(&self) -> Vec<&Param> {
        let mut params = self.embedding.as_ref().map_or_else(Vec::new, Embedding::parameters);
        params.extend(self.layers.parameters());
        if let Some((ln, lm)) = &self.head {
            params.extend(ln.parameters());
            params.extend(lm.parameters());
        }
        params
    }

    /// The layers' (FP8 amaxes) and the dropout step counter, which the layers' stack advances
    /// in every forward: a capture's warmup leaves both as it found them.
    fn pass_state(&self) -> Vec<Tensor> {
        let mut state = self.layers.pass_state();
        state.push(self.step.clone());
        state
    }

    fn set_training(&mut self, training: bool) {
        Gpt::set_training(self, training);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::device::Device;

    fn config(layers: usize) -> GptConfig {
        GptConfig {
            vocab: 7,
            max_len: 4,
            dim: 32,
            layers,
            heads: 1,
            attention: AttentionKind::Fused,
            attention_backend: AttentionBackend::Auto,
            dropout: 0.0,
            seed: 3,
            dtype: DType::F32,
            recompute: Recompute::Nothing,
        }
    }

    /// Every parameter of `gpt` by name, its bits.
    fn named(gpt: &Gpt, s: &Stream) -> Result<BTreeMap<String, Vec<u32>>> {
        (gpt.parameters().named_values()?.into_iter())
            .map(|(name, t)| Ok((name, t.to_vec::<f32>(s)?.into_iter().map(f32::to_bits).collect())))
            .collect()
    }

    #[test]
    fn the_stages_parts_hold_the_whole_models_parameters_and_refuse_what_they_do_not_hold() -> Result<()> {
        let dev = Device::sim();
        let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
        let whole = named(&Gpt::new(&alloc, config(4), &s)?, &s)?;
        let mut parts = BTreeMap::new();
        let mut last = None;
        for (index, layers) in [(0, [0, 2]), (1, [1, 3])] {
            let part = GptPart::stage(4, Stage::new(index, 2)?, 2)?;
            assert_eq!(part.layers(), layers, "stage {index}: chunk k is the model's chunk 2k + {index}");
            let gpt = Gpt::part(&alloc, config(4), &part, &s)?;
            assert_eq!((gpt.has_embedding(), gpt.has_head()), (index == 0, index == 1));
            parts.extend(named(&gpt, &s)?);
            last = Some(gpt);
        }
        assert!(parts == whole, "the parts' parameters are the whole model's, names and initial values");
        let tokens = Tensor::zeros(&alloc, &s, &[1, 4], DType::U32)?;
        let refused = last.map(|gpt| gpt.embed(&tokens, &s).err());
        assert!(matches!(refused, Some(Some(Error::NotInPart { op: "Gpt::embed", .. }))), "{refused:?}");
        let unsplit = GptPart::stage(3, Stage::new(0, 2)?, 1);
        assert!(matches!(unsplit, Err(Error::Config(ConfigLimit { field: "layers", value: 3, .. }))), "{unsplit:?}");
        Ok(())
    }
}
