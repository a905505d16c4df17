//! What the warmup and the capture share: the callables, their static inputs, and the rules for
//! feeding a callable from the one before it (in a stack) and its gradients from the one after.

use super::callable::Callable;
use super::graphed::Pass;
use super::options::{GraphOptions, Mode};
use super::GraphedErrorKind;
use crate::device::Stream;
use crate::memory::CachingAllocator;
use crate::nn::{Inputs, SaveHook};
use crate::tensor::Tensor;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// How profiler ranges name a callable: its layer and, under a schedule, its microbatch.
pub(crate) struct RangeLabel {
    /// The name its parameters start with (`h3`), else its type and index (`Linear#3`).
    pub(crate) layer: String,
    pub(crate) microbatch: Option<usize>,
}

impl RangeLabel {
    /// `"{verb} {layer}.{pass}"`, then ` mb{microbatch}` under a schedule: `replay h3.forward mb1`.
    pub(crate) fn name(&self, verb: &str, pass: Pass) -> String {
        let (layer, pass) = (&self.layer, pass.name());
        match self.microbatch {
            Some(j) => format!("{verb} {layer}.{pass} mb{j}"),
            None => format!("{verb} {layer}.{pass}"),
        }
    }
}

/// A callable's names: in errors and reports, and in profiler ranges.
pub(crate) struct Named {
    pub(crate) label: String,
    pub(crate) range: RangeLabel,
}

/// The validated arguments of one capture.
pub(crate) struct Plan<'a> {
    pub(crate) alloc: &'a CachingAllocator,
    pub(crate) stream: &'a Stream,
    pub(crate) callables: &'a [&'a dyn Callable],
    pub(crate) names: Vec<String>,
    /// Per callable, how its ranges are named.
    pub(crate) ranges: Vec<RangeLabel>,
    /// Per callable, its static inputs (copies of the samples); `None` for a callable fed by the
    /// previous one's outputs.
    pub(crate) statics: Vec<Option<Inputs>>,
    pub(crate) training: bool,
    pub(crate) allow_unused: bool,
    /// Per callable, the save hook of its chunk.
    pub(crate) hooks: Vec<Arc<dyn SaveHook>>,
}

impl<'a> Plan<'a> {
    /// Copies the samples into static input buffers on `stream`; callables with the same
    /// `input_sets` entry share one set of buffers (holding the first one's sample).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        alloc: &'a CachingAllocator,
        stream: &'a Stream,
        callables: &'a [&'a dyn Callable],
        names: Vec<Named>,
        samples: &[Option<Inputs>],
        input_sets: Option<&[usize]>,
        options: &GraphOptions,
        hooks: Vec<Arc<dyn SaveHook>>,
    ) -> Result<Plan<'a>> {
        let mut statics = Vec::with_capacity(samples.len());
        let mut sets: HashMap<usize, Vec<Tensor>> = HashMap::new();
        for (i, sample) in samples.iter().enumerate() {
            let Some(sample) = sample else {
                statics.push(None);
                continue;
            };
            let set = input_sets.map(|s| s[i]);
            let copies = match set.and_then(|s| sets.get(&s)) {
                Some(shared) => shared.clone(),
                None => {
                    let mut copies = Vec::with_capacity(sample.len());
                    for input in sample.iter() {
                        let t = Tensor::uninit(alloc, stream, input.tensor.shape(), input.tensor.dtype())?;
                        t.copy_from(&input.tensor, stream)?;
                        copies.push(t);
                    }
                    if let Some(s) = set {
                        sets.insert(s, copies.clone());
                    }
                    copies
                }
            };
            statics.push(Some(sample.with_tensors(copies)));
        }
        let (names, ranges) = names.into_iter().map(|n| (n.label, n.range)).unzip();
        Ok(Plan {
            alloc,
            stream,
            callables,
            names,
            ranges,
            statics,
            training: options.mode == Mode::Training,
            allow_unused: options.allow_unused_input,
            hooks,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.callables.len()
    }

    pub(crate) fn err(&self, i: usize, kind: GraphedErrorKind) -> Error {
        Error::Graphed { callable: self.names[i].clone(), kind }
    }

    /// Whether callable `i + 1` takes callable `i`'s outputs as its inputs.
    pub(crate) fn feeds_next(&self, i: usize) -> bool {
        self.statics.get(i + 1).is_some_and(Option::is_none)
    }

    /// Callable `i`'s inputs: its static inputs, or the previous callable's `outputs`.
    pub(crate) fn inputs(&self, i: usize, previous: &[Tensor]) -> Inputs {
        match &self.statics[i] {
            Some(statics) => statics.clone(),
            None => Inputs::args(&previous.iter().collect::<Vec<_>>()),
        }
    }

    /// Callable `i`'s output gradients when the next callable's input gradients feed them: each
    /// must exist.
    pub(crate) fn chained_grads(&self, i: usize, next: Vec<Option<Tensor>>) -> Result<Vec<Tensor>> {
        (next.into_iter().enumerate())
            .map(|(k, d)| {
                d.ok_or_else(|| self.err(i + 1, GraphedErrorKind::StackGradient { input: format!("input {k}") }))
            })
            .collect()
    }

    /// Checks a backward's gradients against the inputs: one per input, none missing for a
    /// differentiable input unless allowed (never for an input the previous callable fed).
    pub(crate) fn check_grads(&self, i: usize, inputs: &Inputs, grads: &[Option<Tensor>]) -> Result<()> {
        if grads.len() != inputs.len() {
            let (expected, found) = (inputs.len(), grads.len());
            let what = "input gradients from the backward";
            return Err(self.err(i, GraphedErrorKind::InputCount { what, expected, found }));
        }
        let fed = self.statics[i].is_none();
        for (k, (input, g)) in inputs.iter().zip(grads).enumerate() {
            if fed && g.is_none() {
                return Err(self.err(i, GraphedErrorKind::StackGradient { input: input.label(k) }));
            }
            if input.differentiable && g.is_none() && !self.allow_unused {
                return Err(self.err(i, GraphedErrorKind::UnusedInput { input: input.label(k) }));
            }
        }
        Ok(())
    }
}
