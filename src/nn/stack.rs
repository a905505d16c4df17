//! A stack of modules (candle's `Sequential`, llm.c's layer loop) and the one traversal that
//! every way of running a stack goes through: forwards in order, each fed the previous layer's
//! outputs, then backwards in reverse, each fed the next layer's input gradients.
//!
//! Eager stacks ([`Stack`]'s [`Module`] impl), graphed stacks (`graph::GraphedStack`) and the
//! capture of `graph::make_graphed_callables` implement [`Traverse`] and run [`forward_pass`]
//! and [`backward_pass`], so the order is written once. (The capture's warmup goes callable by
//! callable instead, so that it holds one callable's activations at a time.)

use super::{GradHook, Inputs, Module, NoGradHook, Param, SaveHook};
use crate::device::Stream;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// One way of running the layers of a stack: what a layer's forward and backward do, and what
/// flows between layers. [`forward_pass`] and [`backward_pass`] supply the order.
pub trait Traverse {
    /// What flows forward, from a layer to the next.
    type Act;
    /// What flows backward, from a layer to the one before it.
    type Grad;
    /// What a layer's forward keeps for its backward.
    type Saved;

    /// Layer `layer`'s forward of `x`: its output and what its backward needs.
    fn forward(&mut self, layer: usize, x: Self::Act) -> Result<(Self::Act, Self::Saved)>;

    /// Layer `layer`'s backward of `dy`: the gradient for the layer before it.
    fn backward(&mut self, layer: usize, saved: Self::Saved, dy: Self::Grad) -> Result<Self::Grad>;
}

/// Runs the forward of `layers` layers in order, feeding each the previous layer's output;
/// returns the last output and what each layer saved.
///
/// # Errors
/// The first error of a layer's forward; later layers do not run.
pub fn forward_pass<T: Traverse + ?Sized>(t: &mut T, layers: usize, x: T::Act) -> Result<(T::Act, Vec<T::Saved>)> {
    let mut saved = Vec::with_capacity(layers);
    let mut x = x;
    for layer in 0..layers {
        let (y, s) = t.forward(layer, x)?;
        saved.push(s);
        x = y;
    }
    Ok((x, saved))
}

/// Runs the backward of every layer that [`forward_pass`] saved, last layer first, feeding each
/// the gradient of the layer after it; returns the first layer's input gradient.
///
/// # Errors
/// The first error of a layer's backward; earlier layers do not run.
pub fn backward_pass<T: Traverse + ?Sized>(t: &mut T, saved: Vec<T::Saved>, dy: T::Grad) -> Result<T::Grad> {
    let mut d = dy;
    for (layer, s) in saved.into_iter().enumerate().rev() {
        d = t.backward(layer, s, d)?;
    }
    Ok(d)
}

/// Modules run one after another: the first takes the stack's inputs, each later one takes the
/// previous one's outputs as its positional inputs. A stack is itself a [`Module`].
///
/// ```
/// use graphed::device::Device;
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Inputs, KeepOnDevice, Linear, Module, ParamStore, Stack};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &s, 40)?;
/// let vb = Builder::new(&store, &alloc, &s)?;
/// let stack = Stack::new(vec![
///     Linear::new(&vb.pp("fc0").with_seed(1), (4, 4))?,
///     Linear::new(&vb.pp("fc1").with_seed(2), (4, 4))?,
/// ]);
/// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
/// let (y, ctx) = stack.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
/// let dx = stack.backward(ctx, &[&y[0]], &s)?;
/// assert_eq!(dx[0].as_ref().map(|d| d.shape()), Some(&[2, 4][..]));
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct Stack<M> {
    layers: Vec<M>,
    /// The random-number step counter its layers' dropouts read, advanced once per training
    /// forward.
    rng_step: Option<Tensor>,
    training: bool,
}

/// What a [`Stack`]'s forward saves: each layer's context, in order.
pub struct StackCtx<C> {
    layers: Vec<C>,
}

impl<C> StackCtx<C> {
    /// Each layer's context, in forward order, for a caller that runs the layers' backwards
    /// itself (a pipeline schedule interleaving chunks).
    pub fn into_layers(self) -> Vec<C> {
        self.layers
    }
}

impl<M: Module> Stack<M> {
    /// A stack of `layers`, run in order.
    pub fn new(layers: Vec<M>) -> Stack<M> {
        Stack { layers, rng_step: None, training: true }
    }

    /// The stack advances `step` (the counter its layers' dropouts draw from, see
    /// [`DropoutSpec`](super::DropoutSpec)) by one at the start of every forward in training
    /// mode, eager or graphed, so that each microbatch draws new masks without the caller's help;
    /// warmup and capture leave it as it was (R9).
    pub fn with_rng_step(mut self, step: &Tensor) -> Stack<M> {
        self.rng_step = Some(step.clone());
        self
    }

    /// Whether it is in training mode ([`Module::set_training`]).
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// The step counter it advances per training forward, if any.
    pub fn rng_step(&self) -> Option<&Tensor> {
        self.rng_step.as_ref()
    }

    /// The layers, in forward order.
    pub fn layers(&self) -> &[M] {
        &self.layers
    }

    /// The layers, mutably (to switch training mode per layer, say).
    pub fn layers_mut(&mut self) -> &mut [M] {
        &mut self.layers
    }

    /// How many layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether it has no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

/// The eager traversal: each layer's own forward and backward on one stream, telling `grads`
/// of each layer's parameters once its backward is enqueued (unless it leaves weight gradients
/// to `backward_dw`).
struct Eager<'a, M> {
    layers: &'a [M],
    hook: &'a dyn SaveHook,
    grads: &'a dyn GradHook,
    stream: &'a Stream,
}

impl<M: Module> Traverse for Eager<'_, M> {
    type Act = Inputs;
    type Grad = Vec<Option<Tensor>>;
    type Saved = M::Ctx;

    fn forward(&mut self, layer: usize, x: Inputs) -> Result<(Inputs, M::Ctx)> {
        self.hook.begin_forward(self.stream)?;
        let (y, ctx) = self.layers[layer].forward(&x, self.hook, self.stream)?;
        Ok((Inputs::args(&y.iter().collect::<Vec<_>>()), ctx))
    }

    fn backward(&mut self, layer: usize, ctx: M::Ctx, dy: Self::Grad) -> Result<Self::Grad> {
        let dy = dy
            .into_iter()
            .enumerate()
            .map(|(k, d)| {
                d.ok_or_else(|| Error::MissingGradient {
                    op: "Stack::backward",
                    what: format!("layer {}'s input {k}, which is layer {layer}'s output {k},", layer + 1),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let l = &self.layers[layer];
        let dx = l.backward_hooked(ctx, &dy.iter().collect::<Vec<_>>(), self.grads, self.stream)?;
        if !l.splits_dw() {
            self.grads.grads_final(&l.parameters(), self.stream)?;
        }
        Ok(dx)
    }
}

impl<M: Module> Module for Stack<M> {
    type Ctx = StackCtx<M::Ctx>;

    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, Self::Ctx)> {
        let advanced = match (&self.rng_step, self.training) {
            (Some(step), true) => Some(step),
            _ => None,
        };
        if let Some(step) = advanced {
            crate::ops::rng::step_add(step, 1, stream)?;
        }
        let mut eager = Eager { layers: &self.layers, hook, grads: &NoGradHook, stream };
        match forward_pass(&mut eager, self.layers.len(), inputs.clone()) {
            Ok((y, layers)) => Ok((y.positional().cloned().collect(), StackCtx { layers })),
            Err(e) => {
                // A refused forward (a save hook's refusal, a bad input) leaves the counter as it
                // was, so that the next forward draws the masks it would have drawn without it
                // (the counter wraps: adding `u64::MAX` subtracts one).
                if let Some(step) = advanced {
                    crate::ops::rng::step_add(step, u64::MAX, stream)?;
                }
                Err(e)
            }
        }
    }

    fn backward(&self, ctx: Self::Ctx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        self.backward_hooked(ctx, grad_outputs, &NoGradHook, stream)
    }

    /// Tells `hook` of each layer's parameters after that layer's backward, and of what the
    /// layer tells earlier.
    fn backward_hooked(
        &self,
        ctx: Self::Ctx,
        grad_outputs: &[&Tensor],
        hook: &dyn GradHook,
        stream: &Stream,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut eager = Eager { layers: &self.layers, hook: &super::KeepOnDevice, grads: hook, stream };
        backward_pass(&mut eager, ctx.layers, grad_outputs.iter().map(|d| Some((*d).clone())).collect())
    }

    fn backward_dw(&self, stream: &Stream) -> Result<()> {
        self.layers.iter().rev().try_for_each(|l| l.backward_dw(stream))
    }

    fn splits_dw(&self) -> bool {
        self.layers.iter().any(Module::splits_dw)
    }

    /// The layers' counter, unless the stack advances one itself in training.
    fn draws_from(&self) -> Option<&Tensor> {
        match (&self.rng_step, self.training) {
            (Some(_), true) => None,
            _ => self.layers.iter().find_map(Module::draws_from),
        }
    }

    fn parameters(&self) -> Vec<&Param> {
        self.layers.iter().flat_map(Module::parameters).collect()
    }

    fn pass_state(&self) -> Vec<Tensor> {
        self.layers.iter().flat_map(Module::pass_state).collect()
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
        self.layers.iter_mut().for_each(|l| l.set_training(training));
    }
}
