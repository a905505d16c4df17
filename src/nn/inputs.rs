//! The inputs of one call of a module: positional tensors, then named ones (the kwargs of
//! PyTorch's API, such as an attention mask), each differentiable or constant.

use crate::tensor::Tensor;
use crate::{Error, Result};

/// One input: its name (none for positional ones), the tensor, and whether it is differentiable.
#[derive(Clone, Debug)]
pub struct Input {
    /// `None` for a positional input.
    pub name: Option<String>,
    /// The tensor.
    pub tensor: Tensor,
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
/// # use graphed::{device::Device, memory::CachingAllocator, tensor::Tensor, nn::Inputs};
/// # let dev = Device::sim(); let s = dev.stream()?; let alloc = CachingAllocator::new(&dev);
/// let x = Tensor::zeros(&alloc, &s, &[2, 8], graphed::device::DType::F32)?;
/// let mask = Tensor::zeros(&alloc, &s, &[2, 8], graphed::device::DType::F32)?;
/// let inputs = Inputs::new().arg(&x).constant("mask", &mask);
/// assert_eq!(inputs.len(), 2);
/// assert!(inputs.get("mask").is_some());
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone, Default, Debug)]
pub struct Inputs {
    positional: Vec<Input>,
    named: Vec<Input>,
}

impl Inputs {
    /// No inputs.
    pub fn new() -> Inputs {
        Inputs::default()
    }

    /// One differentiable positional input: the usual case of a layer's activation.
    pub fn one(t: &Tensor) -> Inputs {
        Inputs::new().arg(t)
    }

    /// Positional inputs, all differentiable.
    pub fn args(tensors: &[&Tensor]) -> Inputs {
        tensors.iter().fold(Inputs::new(), |i, t| i.arg(t))
    }

    /// Adds a differentiable positional input.
    pub fn arg(mut self, t: &Tensor) -> Inputs {
        self.positional.push(Input { name: None, tensor: t.clone(), differentiable: true });
        self
    }

    /// Adds a differentiable named input.
    pub fn named(mut self, name: &str, t: &Tensor) -> Inputs {
        self.named.push(Input { name: Some(name.to_string()), tensor: t.clone(), differentiable: true });
        self
    }

    /// Adds a named input that gets no gradient (a mask, a scale).
    pub fn constant(mut self, name: &str, t: &Tensor) -> Inputs {
        self.named.push(Input { name: Some(name.to_string()), tensor: t.clone(), differentiable: false });
        self
    }

    /// The positional tensors, in order.
    pub fn positional(&self) -> impl Iterator<Item = &Tensor> {
        self.positional.iter().map(|i| &i.tensor)
    }

    /// The named input `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.named.iter().find(|i| i.name.as_deref() == Some(name)).map(|i| &i.tensor)
    }

    /// The named input `name`, or an error naming `op` and the missing input.
    ///
    /// # Errors
    /// [`Error::MissingInput`] when there is no input of that name.
    pub fn require(&self, op: &'static str, name: &str) -> Result<&Tensor> {
        self.get(name).ok_or_else(|| Error::MissingInput { op, name: name.to_string() })
    }

    /// The one positional input of a module that takes exactly one and no named inputs.
    ///
    /// # Errors
    /// [`Error::InputArity`] otherwise.
    pub fn only(&self, op: &'static str) -> Result<&Tensor> {
        match (self.positional.as_slice(), self.named.is_empty()) {
            ([x], true) => Ok(&x.tensor),
            _ => Err(Error::InputArity {
                op,
                expected: "exactly one positional input and no named ones",
                positional: self.positional.len(),
                named: self.named.len(),
            }),
        }
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

    /// The named inputs, in the order given.
    pub fn named_inputs(&self) -> &[Input] {
        &self.named
    }

    /// The positional inputs, in order.
    pub fn positional_inputs(&self) -> &[Input] {
        &self.positional
    }

    /// The same structure with other tensors, in [`Inputs::iter`] order (the static buffers of a
    /// graphed call); inputs beyond `tensors` keep theirs.
    pub(crate) fn with_tensors(&self, tensors: Vec<Tensor>) -> Inputs {
        let mut t = tensors.into_iter();
        let mut swap = |i: &Input| Input { tensor: t.next().unwrap_or_else(|| i.tensor.clone()), ..i.clone() };
        let positional = self.positional.iter().map(&mut swap).collect();
        let named = self.named.iter().map(&mut swap).collect();
        Inputs { positional, named }
    }
}
