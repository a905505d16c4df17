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
    attention_dropout_site, input_grad, AttentionSpec, BiasGrad, CausalSelfAttention, Dropout, DropoutSpec, GradHook,
    Inputs, LayerNorm, Mlp, Module, NoGradHook, Param, ParamStore, SaveHook,
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
    /// `(dim, heads)` pair gives the fused form); parameters `{name}.ln1`, `{name}.attn.qkv`,
    /// `{name}.attn.proj`, `{name}.ln2`, `{name}.mlp.fc1`, `{name}.mlp.fc2`, the linear ones from
    /// `seed`..`seed + 3`. Its residual dropouts draw at sites `dropout.site` and
    /// `dropout.site + 1`, so give consecutive layers sites two apart; its attention dropout (same
    /// `p`) at [`attention_dropout_site`]`(dropout.site)`, in a range of its own.
    ///
    /// # Errors
    /// As [`CausalSelfAttention::new`] and [`Dropout::new`]; [`Error::Shape`] if the store is full;
    /// [`Error::Unsupported`] for a site of `2^31` or more.
    pub fn new(
        store: &mut ParamStore,
        alloc: &CachingAllocator,
        name: &str,
        attention: impl Into<AttentionSpec>,
        dropout: &DropoutSpec,
        seed: u64,
        stream: &Stream,
    ) -> Result<TransformerLayer> {
        let second_site = dropout.site.checked_add(1).ok_or(Error::Unsupported {
            op: "TransformerLayer::new",
            backend: "any",
            why: "the dropout site must leave room for a second site",
        })?;
        let attention = attention.into();
        let dim = attention.dim;
        let attn_site = attention_dropout_site(dropout.site).ok_or(Error::Unsupported {
            op: "TransformerLayer::new",
            backend: "any",
            why: "the dropout site must be below 2^31 (the sites from 2^31 up are the attention dropouts')",
        })?;
        let ln1 = LayerNorm::new(store, alloc, &format!("{name}.ln1"), dim, stream)?;
        let attn = CausalSelfAttention::new(store, alloc, &format!("{name}.attn"), attention, seed, stream)?
            .with_dropout(&DropoutSpec { site: attn_site, ..dropout.clone() })?;
        Ok(TransformerLayer {
            alloc: alloc.clone(),
            ln1,
            attn,
            ln2: LayerNorm::new(store, alloc, &format!("{name}.ln2"), dim, stream)?,
            mlp: Mlp::new(store, alloc, &format!("{name}.mlp"), dim, seed.wrapping_add(2), stream)?,
            drop1: Dropout::new(alloc, dropout)?,
            drop2: Dropout::new(alloc, &DropoutSpec { site: second_site, ..dropout.clone() })?,
        })
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
        let fused = ctx.drop2.is_identity();
        let dm = input_grad(OP, self.drop2.backward(ctx.drop2, &[dy], stream)?)?;
        let dm = self.mlp.backward_with(ctx.mlp, &dm, bias_grad(fused), stream)?;
        let colsum = fused.then_some(&self.mlp.fc2.bias.grad);
        let dh = self.ln2.backward_with(ctx.ln2, &dm, Some(ResidualGrad { grad: dy, colsum }), stream)?;
        if !self.mlp.splits_dw() {
            hook.grads_final(&[self.ln2.parameters(), self.mlp.parameters()].concat(), stream)?;
        }
        let fused = ctx.drop1.is_identity();
        let da = input_grad(OP, self.drop1.backward(ctx.drop1, &[&dh], stream)?)?;
        let da = self.attn.backward_with(ctx.attn, &da, bias_grad(fused), stream)?;
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

    fn set_training(&mut self, training: bool) {
        self.attn.set_training(training);
        self.drop1.set_training(training);
        self.drop2.set_training(training);
    }
}
