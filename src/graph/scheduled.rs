//! The graphed callables of a pipeline schedule, run as its passes by `nn::run_schedule`.

use super::graphed::Pass;
use super::{GraphedCallable, Replay};
use crate::device::Stream;
use crate::nn::{Inputs, Schedule, ScheduleErrorKind, SchedulePasses};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The callables [`make_graphed_callables`](super::make_graphed_callables) made for a
/// [`Schedule`] ([`GraphOptions::schedule`](super::GraphOptions::schedule)), replayed on the
/// caller's stream as the schedule's passes: give it to [`nn::run_schedule`](crate::nn::run_schedule)
/// with the same schedule, so that the replays follow the capture order (R5).
///
/// Each pass hands on the static output (or input gradient) itself: the next pass copies it into
/// its own static buffer, and no graph of the pool writes a callable's outputs but its own.
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
        self.callables.get(i).ok_or_else(|| {
            let what = format!(
                "no graphed callable for layer {layer}, microbatch {microbatch}; give the schedule's callables"
            );
            Error::Schedule(ScheduleErrorKind::Arguments { what })
        })
    }
}

impl SchedulePasses for GraphedPasses<'_> {
    fn advance_rng(&mut self, step: &Tensor, by: u64) -> Result<()> {
        crate::ops::rng::step_add(step, by, self.caller)
    }

    fn forward(&mut self, layer: usize, microbatch: usize, x: &Tensor) -> Result<Tensor> {
        let (y, _tail) = self.callable(layer, microbatch)?.forward(self.caller, &Inputs::one(x), Replay::caller())?;
        let y = y.into_iter().next().ok_or(Error::MissingGradient { op: "GraphedPasses", what: "an output".into() })?;
        Ok(y.get()?.clone())
    }

    fn backward(&mut self, layer: usize, microbatch: usize, dy: &Tensor) -> Result<Tensor> {
        let (dx, _tail) = self.callable(layer, microbatch)?.backward(self.caller, &[dy])?;
        let dx = dx.into_iter().next().flatten();
        let dx = dx.ok_or(Error::MissingGradient { op: "GraphedPasses::backward", what: "input 0".into() })?;
        Ok(dx.get()?.clone())
    }

    fn weight_grad(&mut self, layer: usize, microbatch: usize) -> Result<()> {
        let c = self.callable(layer, microbatch)?;
        if !c.has_pass(Pass::BackwardDw) {
            return Ok(());
        }
        c.backward_dw(self.caller)?.join(self.caller)
    }

    fn splits_weight_grads(&self, layer: usize) -> Result<bool> {
        // The layer's last microbatch: the callables given cover every instance before it.
        let last = self.schedule.microbatches() - 1;
        Ok(self.callable(layer, last)?.has_pass(Pass::BackwardDw))
    }
}
