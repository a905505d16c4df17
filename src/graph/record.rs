//! The capture: every forward in order, every backward in reverse (the stack traversal of
//! `nn::forward_pass` and `nn::backward_pass`), then every split weight-gradient pass in reverse,
//! each into a graph of its callable's pool, with the sync event recorded at the end of each.

use super::callable::Saved;
use super::graphed::Pass;
use super::options::{GraphOptions, Phase};
use super::plan::Plan;
use crate::memory::{GraphPool, PoolGraph};
use crate::nn::{backward_pass, forward_pass, Inputs, Traverse};
use crate::tensor::Tensor;
use crate::Result;

/// What the capture made, per callable.
pub(crate) struct Recorded {
    /// Its graphs, in capture order.
    pub(crate) graphs: Vec<Vec<(Pass, PoolGraph)>>,
    /// The inputs its forward was captured with (static buffers, or the previous outputs).
    pub(crate) inputs: Vec<Inputs>,
    pub(crate) outputs: Vec<Vec<Tensor>>,
    /// Its output gradients: static buffers outside the pool, or the next callable's input
    /// gradients when it feeds that callable.
    pub(crate) grad_outputs: Vec<Vec<Tensor>>,
    /// Its input gradients (`None` for constant or unused inputs).
    pub(crate) grad_inputs: Vec<Vec<Option<Tensor>>>,
}

/// Captures every pass of the plan's callables, callable `i`'s into `pools[i]`.
pub(crate) fn record(plan: &Plan<'_>, pools: &[GraphPool], options: &mut GraphOptions) -> Result<Recorded> {
    let n = plan.len();
    let recorded = Recorded {
        graphs: (0..n).map(|_| Vec::new()).collect(),
        inputs: Vec::with_capacity(n),
        outputs: Vec::with_capacity(n),
        grad_outputs: vec![Vec::new(); n],
        grad_inputs: vec![Vec::new(); n],
    };
    let mut pass = Record { plan, pools, options, recorded };
    let (_, saved) = forward_pass(&mut pass, n, Vec::new())?;
    if plan.training {
        // Static output gradients live outside the pools, allocated before any backward capture.
        for i in (0..n).filter(|i| !plan.feeds_next(*i)) {
            let zeros = |y: &Tensor| Tensor::zeros(plan.alloc, plan.stream, y.shape(), y.dtype());
            pass.recorded.grad_outputs[i] = pass.recorded.outputs[i].iter().map(zeros).collect::<Result<_>>()?;
        }
        backward_pass(&mut pass, saved, Vec::new())?;
        for i in (0..n).rev().filter(|i| plan.callables[*i].splits_dw_dyn()) {
            let g = pass.capture(i, &mut || plan.callables[i].backward_dw_dyn(plan.stream))?;
            pass.recorded.graphs[i].push((Pass::BackwardDw, g));
        }
    }
    Ok(pass.recorded)
}

struct Record<'p, 'o> {
    plan: &'p Plan<'p>,
    pools: &'p [GraphPool],
    options: &'o mut GraphOptions,
    recorded: Recorded,
}

impl Record<'_, '_> {
    /// Captures what `f` enqueues on the plan's stream into a graph of callable `i`'s pool,
    /// ending with the sync event and the save hook's join of the tail.
    fn capture(&self, i: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<PoolGraph> {
        let (stream, options) = (self.plan.stream, &*self.options);
        let cap = self.plan.alloc.capture(stream, options.capture_mode, &self.pools[i])?;
        f()?;
        if let Some(e) = &options.sync_event {
            stream.record_external(e)?;
        }
        options.save_hook.end_pass(stream)?;
        cap.finish()
    }
}

impl Traverse for Record<'_, '_> {
    type Act = Vec<Tensor>;
    type Grad = Vec<Option<Tensor>>;
    type Saved = Saved;

    fn forward(&mut self, i: usize, previous: Vec<Tensor>) -> Result<(Vec<Tensor>, Saved)> {
        let (plan, stream) = (self.plan, self.plan.stream);
        let inputs = plan.inputs(i, &previous);
        self.options.run_pass_hook(i, Phase::ForwardPre, stream)?;
        let mut result = None;
        let hook = self.options.save_hook.clone();
        let g = self.capture(i, &mut || {
            hook.begin_forward(stream)?;
            result = Some(plan.callables[i].forward_dyn(&inputs, hook.as_ref(), stream)?);
            Ok(())
        })?;
        self.options.run_pass_hook(i, Phase::Forward, stream)?;
        let (outputs, saved) = result.expect("the capture ran the forward");
        self.recorded.graphs[i].push((Pass::Forward, g));
        self.recorded.inputs.push(inputs);
        self.recorded.outputs.push(outputs.clone());
        Ok((outputs, saved))
    }

    fn backward(&mut self, i: usize, saved: Saved, next: Self::Grad) -> Result<Self::Grad> {
        let (plan, stream) = (self.plan, self.plan.stream);
        let dys = match plan.feeds_next(i) {
            true => plan.chained_grads(i, next)?,
            false => self.recorded.grad_outputs[i].clone(),
        };
        self.options.run_pass_hook(i, Phase::BackwardPre, stream)?;
        let (mut saved, mut result) = (Some(saved), None);
        let g = self.capture(i, &mut || {
            let s = saved.take().expect("captured once");
            result = Some(plan.callables[i].backward_dyn(s, &dys.iter().collect::<Vec<_>>(), stream)?);
            Ok(())
        })?;
        self.options.run_pass_hook(i, Phase::Backward, stream)?;
        let grads = result.expect("the capture ran the backward");
        let inputs = &self.recorded.inputs[i];
        plan.check_grads(i, inputs, &grads)?;
        let grads: Vec<Option<Tensor>> =
            grads.into_iter().zip(inputs.iter()).map(|(g, x)| g.filter(|_| x.differentiable)).collect();
        self.recorded.graphs[i].push((Pass::Backward, g));
        self.recorded.grad_inputs[i] = grads.clone();
        self.recorded.grad_outputs[i] = dys;
        Ok(grads)
    }
}
