//! The graphed callables of a pipeline schedule, run as its passes by `nn::run_schedule`.

use super::graphed::Pass;
use super::{GraphedCallable, Replay, StaticTensor};
use crate::device::Stream;
use crate::nn::{Handed, Inputs, Schedule, ScheduleErrorKind, SchedulePasses};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The callables [`make_graphed_callables`](super::make_graphed_callables) made for a
/// [`Schedule`] ([`GraphOptions::schedule`](super::GraphOptions::schedule)), replayed on the
/// caller's stream as the schedule's passes: give it to [`nn::run_schedule`](crate::nn::run_schedule)
/// with the same schedule, so that the replays follow the capture order (R5).
///
/// Each pass hands on its static output (or input gradient) as a [`StaticTensor`]: the next pass
/// copies it into its own static buffer (no graph of the pool writes a callable's outputs but its
/// own), and what reaches the caller (the head's input, the step's input gradients) refuses to be
/// read once the next step's replay overwrote it, as a stack's outputs do; copy it
/// ([`StaticTensor::to_owned`]) to keep it.
pub struct GraphedPasses<'a> {
    callables: &'a [GraphedCallable],
    schedule: &'a Schedule,
    layers_per_chunk: &'a [usize],
    caller: &'a Stream,
}

impl<'a> GraphedPasses<'a> {
    /// The passes of `callables`, captured for `schedule` over chunks of `layers_per_chunk`
    /// layers, replayed on `caller`.
    pub fn new(
        callables: &'a [GraphedCallable],
        schedule: &'a Schedule,
        layers_per_chunk: &'a [usize],
        caller: &'a Stream,
    ) -> GraphedPasses<'a> {
        GraphedPasses { callables, schedule, layers_per_chunk, caller }
    }

    fn callable(&self, layer: usize, microbatch: usize) -> Result<&GraphedCallable> {
        let i = self.schedule.instance(self.layers_per_chunk, layer, microbatch);
        (self.callables.get(i)).ok_or(Error::Schedule(ScheduleErrorKind::NoCallable { layer, microbatch }))
    }
}

/// A replay's static output, readable until a later replay overwrites it.
impl Handed for StaticTensor {
    fn tensor(&self) -> Result<&Tensor> {
        self.get()
    }
}

impl SchedulePasses for GraphedPasses<'_> {
    type Out = StaticTensor;

    fn advance_rng(&mut self, step: &Tensor, by: u64) -> Result<()> {
        crate::ops::rng::step_add(step, by, self.caller)
    }

    fn forward(&mut self, layer: usize, microbatch: usize, x: &Tensor) -> Result<StaticTensor> {
        let (y, _tail) = self.callable(layer, microbatch)?.forward(self.caller, &Inputs::one(x), Replay::caller())?;
        y.into_iter().next().ok_or(Error::MissingGradient { op: "GraphedPasses", what: "an output".into() })
    }

    fn backward(&mut self, layer: usize, microbatch: usize, dy: &Tensor) -> Result<StaticTensor> {
        let (dx, _tail) = self.callable(layer, microbatch)?.backward(self.caller, &[dy])?;
        let dx = dx.into_iter().next().flatten();
        dx.ok_or(Error::MissingGradient { op: "GraphedPasses::backward", what: "input 0".into() })
    }

    fn weight_grad(&mut self, layer: usize, microbatch: usize) -> Result<()> {
        let c = self.callable(layer, microbatch)?;
        if !c.has_pass(Pass::BackwardDw)? {
            return Ok(());
        }
        c.backward_dw(self.caller)?.join(self.caller)
    }

    fn splits_weight_grads(&self, layer: usize) -> Result<bool> {
        // The layer's last microbatch: the callables given cover every instance before it.
        let last = self.schedule.microbatches() - 1;
        self.callable(layer, last)?.has_pass(Pass::BackwardDw)
    }
}
