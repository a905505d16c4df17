//! The warmup: eager iterations of every forward in order and every backward in reverse, on the
//! capture stream, with the capture-time hooks around each pass (the stack traversal of
//! `nn::forward_pass` and `nn::backward_pass`).

use super::callable::Saved;
use super::graphed::Pass;
use super::options::{GraphOptions, Phase};
use super::plan::Plan;
use crate::nn::{backward_pass, forward_pass, Inputs, NoGradHook, Traverse};
use crate::tensor::Tensor;
use crate::Result;

/// Runs `options.warmup_iters` iterations, then waits for the stream.
pub(crate) fn warmup(plan: &Plan<'_>, options: &mut GraphOptions) -> Result<()> {
    let _range = plan.stream.device().range_with(|| "warmup".into());
    let mut pass = Warmup { plan, options };
    for _ in 0..pass.options.warmup_iters {
        let (_, saved) = forward_pass(&mut pass, plan.len(), Vec::new())?;
        if plan.training {
            backward_pass(&mut pass, saved, Vec::new())?;
        }
        plan.stream.synchronize()?;
    }
    Ok(())
}

struct Warmup<'p, 'o> {
    plan: &'p Plan<'p>,
    options: &'o mut GraphOptions,
}

/// A warmup forward's results, kept for its backward.
pub(crate) struct WarmForward {
    inputs: Inputs,
    outputs: Vec<Tensor>,
    saved: Saved,
}

impl Traverse for Warmup<'_, '_> {
    type Act = Vec<Tensor>;
    type Grad = Vec<Option<Tensor>>;
    type Saved = WarmForward;

    fn forward(&mut self, i: usize, previous: Vec<Tensor>) -> Result<(Vec<Tensor>, WarmForward)> {
        let (plan, stream) = (self.plan, self.plan.stream);
        let _range = stream.device().range_with(|| plan.ranges[i].name("warmup", Pass::Forward));
        self.options.run_pass_hook(i, Phase::ForwardPre, stream)?;
        let inputs = plan.inputs(i, &previous);
        plan.hooks[i].begin_forward(stream)?;
        let (outputs, saved) = plan.callables[i].forward_dyn(&inputs, plan.hooks[i].as_ref(), stream)?;
        self.options.run_pass_hook(i, Phase::Forward, stream)?;
        Ok((outputs.clone(), WarmForward { inputs, outputs, saved }))
    }

    fn backward(&mut self, i: usize, f: WarmForward, next: Self::Grad) -> Result<Self::Grad> {
        let (plan, stream) = (self.plan, self.plan.stream);
        let _range = stream.device().range_with(|| plan.ranges[i].name("warmup", Pass::Backward));
        self.options.run_pass_hook(i, Phase::BackwardPre, stream)?;
        let dys = match plan.feeds_next(i) {
            true => plan.chained_grads(i, next)?,
            false => f
                .outputs
                .iter()
                .map(|y| Tensor::zeros(plan.alloc, stream, y.shape(), y.dtype()))
                .collect::<Result<_>>()?,
        };
        let callable = plan.callables[i];
        let grads = callable.backward_dyn(f.saved, &dys.iter().collect::<Vec<_>>(), &NoGradHook, stream)?;
        plan.check_grads(i, &f.inputs, &grads)?;
        if callable.splits_dw_dyn() {
            callable.backward_dw_dyn(stream)?;
        }
        self.options.run_pass_hook(i, Phase::Backward, stream)?;
        Ok(grads)
    }
}
