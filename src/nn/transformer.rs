//! One pre-LayerNorm GPT layer (the benchmark layer):
//! `h = x + Drop(Attn(LN1(x)))`, `y = h + Drop(MLP(LN2(h)))`, with dropout on the attention
//! probabilities too (nanoGPT's `attn_dropout`), all three of one probability.
//! When a dropout is the identity (p = 0 or evaluation), its residual add rides in the branch's
//! last GEMM as its C. The backward adds the gradient that reaches each residual stream through
//! its branch to the one that skips it: `dh = dy + dLN2(h)`, `dx = dh + dLN1(x)`.

use super::attention::AttentionCtx;
use super::dropout::DropoutCtx;
use super::layernorm::{single_input, LayerNormCtx};
use super::mlp::MlpCtx;
use super::{
    attention_dropout_site, input_grad, AttentionSpec, BiasGrad, Builder, CausalSelfAttention, Dropout, GradHook,
    Inputs, LayerNorm, Mlp, Module, NoGradHook, Param, SaveHook,
};
use crate::device::Stream;
use crate::memory::CachingAllocator;
use crate::ops::cast::residual_add;
use crate::ops::layernorm::ResidualGrad;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// A transformer layer over `(B, T, C)` inputs.
pub struct TransformerLayer {
    alloc: CachingAllocator,
    /// Before attention.
    pub ln1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// Before the MLP.
    pub ln2: LayerNorm,
    /// The feed-forward block.
    pub mlp: Mlp,
    /// After the attention projection, before the first residual add.
    pub drop1: Dropout,
    /// After the MLP, before the second residual add.
    pub drop2: Dropout,
    /// Whether the backward recomputes the LayerNorms' outputs ([`Recompute::norms`](super::Recompute::norms)).
    norms: bool,
}

/// Which of a model's layers [`TransformerLayer::stack`] builds, and how it names and seeds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layers {
    indices: Vec<usize>,
    name: String,
    seed_stride: u64,
}

impl Layers {
    /// Layers `0..n` of a model.
    pub fn first(n: usize) -> Layers {
        Layers::of(0..n)
    }

    /// The model's layers `indices` (a pipeline stage's part), named `h{l}`, their seeds one
    /// apart (as a layer seeds its linears from its seed to seed + 3, neighbours share three of
    /// them unless [`seed_stride`](Layers::seed_stride) says 4).
    pub fn of(indices: impl IntoIterator<Item = usize>) -> Layers {
        Layers { indices: indices.into_iter().collect(), name: "h".into(), seed_stride: 1 }
    }

    /// Layer `l` named `{name}{l}`.
    pub fn named(self, name: &str) -> Layers {
        Layers { name: name.into(), ..self }
    }

    /// Layer `l` seeded `seed + l·stride`.
    pub fn seed_stride(self, stride: u64) -> Layers {
        Layers { seed_stride: stride, ..self }
    }
}

/// What the forward saves: the sub-modules' contexts.
pub struct TransformerCtx {
    ln1: LayerNormCtx,
    attn: AttentionCtx,
    drop1: DropoutCtx,
    ln2: LayerNormCtx,
    mlp: MlpCtx,
    drop2: DropoutCtx,
}

impl TransformerLayer {
    /// The parameters a layer on `dim` features adds to its store.
    pub fn parameter_count(dim: usize) -> usize {
        2 * LayerNorm::parameter_count(dim) + CausalSelfAttention::parameter_count(dim) + Mlp::parameter_count(dim)
    }

    /// A layer on `dim` features in `heads` heads, its attention in `attention`'s form (a
    /// `(dim, heads)` pair gives the fused form); parameters `ln1`, `attn.qkv`, `attn.proj`,
    /// `ln2`, `mlp.fc1`, `mlp.fc2` below `vb`'s prefix, the linear ones from `vb`'s seed to
    /// seed + 3. Its residual dropouts draw at `vb`'s dropout site `s` and `s + 1`, so give
    /// consecutive layers sites two apart ([`TransformerLayer::stack`] does); its attention
    /// dropout (same `p`) at [`attention_dropout_site`]`(s)`, in a range of its own.
    ///
    /// # Errors
    /// As [`CausalSelfAttention::new`] and [`Dropout::new`]; [`Error::Shape`] if the store is full;
    /// [`Error::Unsupported`] for a site of `2^31` or more.
    pub fn new(vb: &Builder, attention: impl Into<AttentionSpec>) -> Result<TransformerLayer> {
        let site = vb.dropout().site;
        let second_site = site.checked_add(1).ok_or(Error::Unsupported {
            op: "TransformerLayer::new",
            backend: "any",
            why: "the dropout site must leave room for a second site",
        })?;
        let attention = attention.into();
        let dim = attention.dim;
        let attn_site = attention_dropout_site(site).ok_or(Error::Unsupported {
            op: "TransformerLayer::new",
            backend: "any",
            why: "the dropout site must be below 2^31 (the sites from 2^31 up are the attention dropouts')",
        })?;
        let norms = vb.recompute().norms();
        if norms && vb.fp8().is_some() {
            return Err(Error::Unsupported {
                op: "TransformerLayer::new",
                backend: "any",
                why: "recomputing the LayerNorm outputs is not supported with FP8, whose linears keep their inputs \
                      quantized; drop the recompute setting (--recompute none) or train in bf16",
            });
        }
        let ln1 = LayerNorm::new(&vb.pp("ln1"), dim)?;
        let mut attn = CausalSelfAttention::new(&vb.pp("attn").with_site(attn_site), attention)?;
        let ln2 = LayerNorm::new(&vb.pp("ln2"), dim)?;
        let mut mlp = Mlp::new(&vb.pp("mlp").with_seed(vb.seed().wrapping_add(2)), dim)?;
        if norms {
            attn.forget_input();
            mlp.forget_input();
        }
        Ok(TransformerLayer {
            alloc: vb.alloc().clone(),
            ln1,
            attn,
            ln2,
            mlp,
            drop1: Dropout::new(vb)?,
            drop2: Dropout::new(&vb.clone().with_site(second_site))?,
            norms,
        })
    }

    /// The layers of a model that `layers` lists, in its order (for [`Stack::new`](super::Stack::new)),
    /// each as [`TransformerLayer::new`] builds it from `vb` one level down: layer `l` is
    /// `{name}{l}`, seeded `seed + l·stride` from `vb`'s seed, its residual dropouts at sites
    /// `s + 2l` and `s + 2l + 1` from `vb`'s site `s`. So a pipeline stage that builds some of
    /// the layers builds them as the whole model does.
    ///
    /// # Errors
    /// As [`TransformerLayer::new`]; [`Error::Unsupported`] when a layer's sites pass `2^31`.
    pub fn stack(vb: &Builder, attention: impl Into<AttentionSpec>, layers: &Layers) -> Result<Vec<TransformerLayer>> {
        let attention = attention.into();
        (layers.indices.iter())
            .map(|&l| {
                let site = (u32::try_from(l).ok())
                    .and_then(|l| l.checked_mul(2)?.checked_add(vb.dropout().site))
                    .ok_or(Error::Unsupported {
                        op: "TransformerLayer::stack",
                        backend: "any",
                        why: "layer l draws at dropout sites 2l and 2l + 1, which must stay below 2^31: give lower layer indices",
                    })?;
                let seed = vb.seed().wrapping_add((l as u64).wrapping_mul(layers.seed_stride));
                let layer = vb.pp(&format!("{}{l}", layers.name)).with_seed(seed).with_site(site);
                TransformerLayer::new(&layer, attention)
            })
            .collect()
    }

    fn add(&self, a: &Tensor, b: &Tensor, stream: &Stream) -> Result<Tensor> {
        let out = Tensor::uninit(&self.alloc, stream, a.shape(), a.dtype())?;
        residual_add(&out, a, b, stream)?;
        Ok(out)
    }

    /// `x + drop(branch(..))`: `branch` adds `x` in its last GEMM when `drop` is the identity;
    /// else the dropout runs on its output and a kernel adds `x`.
    fn residual_branch<C>(
        &self,
        x: &Tensor,
        drop: &Dropout,
        hook: &dyn SaveHook,
        stream: &Stream,
        branch: impl FnOnce(Option<&Tensor>) -> Result<(Tensor, C)>,
    ) -> Result<(Tensor, C, DropoutCtx)> {
        if !drop.is_active() {
            let (h, ctx) = branch(Some(x))?;
            return Ok((h, ctx, DropoutCtx::identity()));
        }
        let (t, ctx) = branch(None)?;
        let (t, drop_ctx) = only(drop.forward(&Inputs::one(&t), hook, stream)?);
        Ok((self.add(x, &t, stream)?, ctx, drop_ctx))
    }
}

/// Who adds a branch's output projection bias gradient: the LayerNorm backward that reads the
/// same gradient as its residual when the branch's dropout was the identity, else the projection.
fn bias_grad(summed_by_layernorm: bool) -> BiasGrad {
    if summed_by_layernorm {
        BiasGrad::Elsewhere
    } else {
        BiasGrad::Compute
    }
}

/// The one output of a sub-module.
fn only<C>((mut outputs, ctx): (Vec<Tensor>, C)) -> (Tensor, C) {
    (outputs.remove(0), ctx)
}

impl Module for TransformerLayer {
    type Ctx = TransformerCtx;

    /// One contiguous input `(B, T, C)`, one output `(B, T, C)`.
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, TransformerCtx)> {
        let x = inputs.only("TransformerLayer::forward")?;
        let (a, ln1) = only(self.ln1.forward(&Inputs::one(x), hook, stream)?);
        let (h, attn, drop1) =
            self.residual_branch(x, &self.drop1, hook, stream, |r| self.attn.forward_residual(&a, r, hook, stream))?;
        let (m, ln2) = only(self.ln2.forward(&Inputs::one(&h), hook, stream)?);
        let (y, mlp, drop2) =
            self.residual_branch(&h, &self.drop2, hook, stream, |r| self.mlp.forward_residual(&m, r, hook, stream))?;
        Ok((vec![y], TransformerCtx { ln1, attn, drop1, ln2, mlp, drop2 }))
    }

    fn backward(&self, ctx: TransformerCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        self.backward_hooked(ctx, grad_outputs, &NoGradHook, stream)
    }

    /// Tells `hook` of the MLP half's parameters (LN2's and the MLP's, two thirds of the layer's)
    /// once LN2's backward has summed the last of them, so that their reduction overlaps the
    /// attention half's backward (unless the MLP leaves its weight gradients to `backward_dw`).
    fn backward_hooked(
        &self,
        ctx: TransformerCtx,
        grad_outputs: &[&Tensor],
        hook: &dyn GradHook,
        stream: &Stream,
    ) -> Result<Vec<Option<Tensor>>> {
        const OP: &str = "TransformerLayer::backward";
        let dy = single_input(OP, grad_outputs)?;
        // Each LayerNorm backward adds the residual stream's gradient to its own; when the
        // branch's dropout was the identity, the branch's output gradient is that same tensor,
        // so the LayerNorm also sums its columns into the projection's bias gradient.
        let mut ctx = ctx;
        let fused = ctx.drop2.is_identity();
        let dm = input_grad(OP, self.drop2.backward(ctx.drop2, &[dy], stream)?)?;
        let m = self.norms.then(|| self.ln2.recompute(&mut ctx.ln2, stream)).transpose()?;
        let dm = self.mlp.backward_with(ctx.mlp, &dm, bias_grad(fused), m.as_ref(), stream)?;
        drop(m);
        let colsum = fused.then_some(&self.mlp.fc2.bias.grad);
        let dh = self.ln2.backward_with(ctx.ln2, &dm, Some(ResidualGrad { grad: dy, colsum }), stream)?;
        if !self.mlp.splits_dw() {
            hook.grads_final(&[self.ln2.parameters(), self.mlp.parameters()].concat(), stream)?;
        }
        let fused = ctx.drop1.is_identity();
        let da = input_grad(OP, self.drop1.backward(ctx.drop1, &[&dh], stream)?)?;
        let a = self.norms.then(|| self.ln1.recompute(&mut ctx.ln1, stream)).transpose()?;
        let da = self.attn.backward_with(ctx.attn, &da, bias_grad(fused), a.as_ref(), stream)?;
        drop(a);
        let colsum = fused.then_some(&self.attn.proj.bias.grad);
        let dx = self.ln1.backward_with(ctx.ln1, &da, Some(ResidualGrad { grad: &dh, colsum }), stream)?;
        Ok(vec![Some(dx)])
    }

    /// The weight gradients its MLP and attention left for later, if any linear splits them.
    fn backward_dw(&self, stream: &Stream) -> Result<()> {
        self.mlp.backward_dw(stream)?;
        self.attn.backward_dw(stream)
    }

    fn splits_dw(&self) -> bool {
        self.mlp.splits_dw() || self.attn.splits_dw()
    }

    fn draws_from(&self) -> Option<&Tensor> {
        self.drop1.draws_from().or_else(|| self.drop2.draws_from()).or_else(|| self.attn.draws_from())
    }

    fn parameters(&self) -> Vec<&Param> {
        [self.ln1.parameters(), self.attn.parameters(), self.ln2.parameters(), self.mlp.parameters()].concat()
    }

    fn pass_state(&self) -> Vec<Tensor> {
        [self.attn.pass_state(), self.mlp.pass_state()].concat()
    }

    fn set_training(&mut self, training: bool) {
        self.attn.set_training(training);
        self.drop1.set_training(training);
        self.drop2.set_training(training);
    }
}
