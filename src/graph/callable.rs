//! What can be graphed: a [`Callable`] (every [`Module`] is one) and the [`Inputs`] it takes.

use std::any::Any;

use super::GraphedErrorKind;
use crate::device::Stream;
use crate::nn::{Module, Param, SaveHook};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// What a forward saves for its backward, type-erased so that callables of different types can
/// be graphed together.
pub type Saved = Box<dyn Any + Send>;

/// A unit of graph capture: an explicit forward and backward over [`Inputs`].
///
/// Every [`Module`] is a callable taking positional inputs. Implement this trait directly for a
/// callable that takes named inputs (the kwargs of PyTorch's API, such as an attention mask).
/// With both traits in scope, name the one meant: `Module::forward(&layer, ...)`.
pub trait Callable: Sync {
    /// A name for errors and reports.
    fn name(&self) -> String {
        std::any::type_name::<Self>().rsplit("::").next().unwrap_or("callable").to_string()
    }

    /// The outputs of `inputs`, enqueued on `stream`, and what the backward needs.
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor<f32>>, Saved)>;

    /// One gradient per input, in [`Inputs::iter`] order (`None`: no gradient), written (`=`);
    /// parameter gradients accumulated (`+=`) into their [`Param::grad`].
    fn backward(
        &self,
        saved: Saved,
        grad_outputs: &[&Tensor<f32>],
        stream: &Stream,
    ) -> Result<Vec<Option<Tensor<f32>>>>;

    /// The weight-gradient work `backward` left for later (see [`Module::backward_dw`]).
    fn backward_dw(&self, _stream: &Stream) -> Result<()> {
        Ok(())
    }

    /// Whether `backward` leaves weight gradients to [`Callable::backward_dw`].
    fn splits_dw(&self) -> bool {
        false
    }

    /// The parameters whose gradients the backward accumulates.
    fn parameters(&self) -> Vec<&Param>;
}

impl<M> Callable for M
where
    M: Module + Sync,
    M::Ctx: Send + 'static,
{
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor<f32>>, Saved)> {
        if !inputs.named.is_empty() {
            return Err(Error::Graphed {
                callable: Callable::name(self),
                kind: GraphedErrorKind::NamedInputsUnsupported,
            });
        }
        let args: Vec<&Tensor<f32>> = inputs.positional().collect();
        let (outputs, ctx) = Module::forward(self, &args, hook, stream)?;
        Ok((outputs, Box::new(ctx)))
    }

    fn backward(
        &self,
        saved: Saved,
        grad_outputs: &[&Tensor<f32>],
        stream: &Stream,
    ) -> Result<Vec<Option<Tensor<f32>>>> {
        let ctx = saved.downcast::<M::Ctx>().map_err(|_| Error::Unsupported {
            op: "Callable::backward",
            backend: "any",
            why: "the saved context comes from another callable's forward",
        })?;
        Ok(Module::backward(self, *ctx, grad_outputs, stream)?.into_iter().map(Some).collect())
    }

    fn backward_dw(&self, stream: &Stream) -> Result<()> {
        Module::backward_dw(self, stream)
    }

    fn splits_dw(&self) -> bool {
        Module::splits_dw(self)
    }

    fn parameters(&self) -> Vec<&Param> {
        Module::parameters(self)
    }
}

/// One input: its name (none for positional ones), the tensor, and whether it is differentiable.
#[derive(Clone)]
pub struct Input {
    /// `None` for a positional input.
    pub name: Option<String>,
    /// The tensor.
    pub tensor: Tensor<f32>,
    /// Whether the backward must produce its gradient.
    pub differentiable: bool,
}

impl Input {
    /// "input 0" or "input `mask`", for messages.
    pub fn label(&self, position: usize) -> String {
        match &self.name {
            Some(n) => format!("input `{n}`"),
            None => format!("input {position}"),
        }
    }
}

/// The inputs of one call: positional ones first, then named ones in the order given.
///
/// ```
/// # use graphed::{device::Device, memory::CachingAllocator, tensor::Tensor, graph::Inputs};
/// # let dev = Device::sim(); let s = dev.stream()?; let alloc = CachingAllocator::new(&dev);
/// let x = Tensor::<f32>::zeros(&alloc, &s, &[2, 8])?;
/// let mask = Tensor::<f32>::zeros(&alloc, &s, &[2, 8])?;
/// let inputs = Inputs::new().arg(&x).constant("mask", &mask);
/// assert_eq!(inputs.len(), 2);
/// assert!(inputs.get("mask").is_some());
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone, Default)]
pub struct Inputs {
    positional: Vec<Input>,
    named: Vec<Input>,
}

impl Inputs {
    /// No inputs.
    pub fn new() -> Inputs {
        Inputs::default()
    }

    /// Positional inputs, all differentiable: the usual case of a layer's activations.
    pub fn args(tensors: &[&Tensor<f32>]) -> Inputs {
        tensors.iter().fold(Inputs::new(), |i, t| i.arg(t))
    }

    /// Adds a differentiable positional input.
    pub fn arg(mut self, t: &Tensor<f32>) -> Inputs {
        self.positional.push(Input { name: None, tensor: t.clone(), differentiable: true });
        self
    }

    /// Adds a differentiable named input.
    pub fn named(mut self, name: &str, t: &Tensor<f32>) -> Inputs {
        self.named.push(Input { name: Some(name.to_string()), tensor: t.clone(), differentiable: true });
        self
    }

    /// Adds a named input that gets no gradient (a mask, a scale).
    pub fn constant(mut self, name: &str, t: &Tensor<f32>) -> Inputs {
        self.named.push(Input { name: Some(name.to_string()), tensor: t.clone(), differentiable: false });
        self
    }

    /// The positional tensors, in order.
    pub fn positional(&self) -> impl Iterator<Item = &Tensor<f32>> {
        self.positional.iter().map(|i| &i.tensor)
    }

    /// The named input `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor<f32>> {
        self.named.iter().find(|i| i.name.as_deref() == Some(name)).map(|i| &i.tensor)
    }

    /// Every input: positional ones, then named ones.
    pub fn iter(&self) -> impl Iterator<Item = &Input> {
        self.positional.iter().chain(&self.named)
    }

    /// How many inputs.
    pub fn len(&self) -> usize {
        self.positional.len() + self.named.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn named_inputs(&self) -> &[Input] {
        &self.named
    }

    pub(crate) fn positional_inputs(&self) -> &[Input] {
        &self.positional
    }

    /// The same structure with other tensors (the static buffers).
    pub(crate) fn with_tensors(&self, tensors: Vec<Tensor<f32>>) -> Inputs {
        let mut t = tensors.into_iter();
        let mut swap = |i: &Input| Input { tensor: t.next().unwrap_or_else(|| i.tensor.clone()), ..i.clone() };
        let positional = self.positional.iter().map(&mut swap).collect();
        let named = self.named.iter().map(&mut swap).collect();
        Inputs { positional, named }
    }
}
