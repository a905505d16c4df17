//! The capture: every forward in order, every backward in reverse (the stack traversal of
//! `nn::forward_pass` and `nn::backward_pass`), then every split weight-gradient pass in reverse;
//! or, with a pipeline schedule, each step's passes in the schedule's order. Each pass goes into
//! a graph of its callable's pool, with the sync event recorded at its end.

use super::callable::Saved;
use super::edge::End;
use super::grad_sync::CallableGrads;
use super::graphed::Pass;
use super::lend::{Learned, Lending};
use super::options::{GraphOptions, Phase};
use super::output::StaticOutput;
use super::plan::Plan;
use crate::memory::{GraphPool, PoolGraph};
use crate::nn::{backward_pass, forward_pass, GradHook, Inputs, NoGradHook, Schedule, Step, Traverse};
use crate::tensor::Tensor;
use crate::Result;
use std::collections::HashMap;

/// What the capture made, per callable.
pub(crate) struct Recorded {
    /// Its graphs, in capture order.
    pub(crate) graphs: Vec<Vec<(Pass, PoolGraph)>>,
    /// The inputs its forward was captured with (static buffers, or the previous outputs).
    pub(crate) inputs: Vec<Inputs>,
    pub(crate) outputs: Vec<Vec<StaticOutput>>,
    /// Its output gradients: static buffers outside the pool, or the next callable's input
    /// gradients when it feeds that callable.
    pub(crate) grad_outputs: Vec<Vec<Tensor>>,
    /// Its input gradients (`None` for constant or unused inputs).
    pub(crate) grad_inputs: Vec<Vec<Option<StaticOutput>>>,
}

/// Where each callable of a scheduled capture sits: callable `instance(k, j, l)` is layer `l`
/// of chunk `k` for microbatch `j`.
pub(crate) struct Layout {
    pub(crate) schedule: Schedule,
    pub(crate) layers: Vec<usize>,
    /// With buffer reuse, per callable, the set of static output gradients it shares.
    pub(crate) grad_sets: Option<Vec<usize>>,
    /// With buffer reuse, whether outputs and input gradients read only inside their chunk are
    /// shared with later graphs of the pool (Note [Shared static outputs]).
    pub(crate) share_outputs: bool,
}

impl Layout {
    /// Per callable, its layer (over every chunk's) and the schedule positions of its forward,
    /// backward and last use (its weight-gradient pass where the schedule splits one out, else
    /// its backward).
    fn uses(&self) -> Vec<Use> {
        let n: usize = self.layers.iter().sum::<usize>() * self.schedule.microbatches();
        let mut at = vec![Use::default(); n];
        for v in self.schedule.visits(&self.layers) {
            let u = &mut at[v.instance];
            u.layer = v.layer;
            match v.step {
                Step::Forward(_) => u.forward = v.position,
                Step::Backward(_) => (u.backward, u.last) = (v.position, v.position),
                Step::WeightGrad(_) => u.last = v.position,
            }
        }
        at
    }

    /// Per callable, its layer: the index of the callable given, of which it is a microbatch.
    fn layer_of(&self) -> Vec<usize> {
        self.uses().iter().map(|u| u.layer).collect()
    }

    /// Which callables share their static inputs and which their static output gradients
    /// (TransformerEngine's `_reuse_graph_input_output_buffers`): per callable, the index of its
    /// buffer set. Callables of one `signature` share a set when their uses of it do not overlap
    /// in the schedule: an input is used from the forward to the last use, an output gradient
    /// from the backward to the last use (a split weight-gradient pass reads both).
    pub(crate) fn sharing<S: PartialEq>(&self, signature: impl Fn(usize) -> S) -> (Vec<usize>, Vec<usize>) {
        let at = self.uses();
        let inputs = share(at.iter().map(|u| (u.forward, u.last)).collect(), &signature);
        // Output gradients are keyed by layer: a layer's outputs have one shape.
        let grads = share(at.iter().map(|u| (u.backward, u.last)).collect(), &|i| at[i].layer);
        (inputs, grads)
    }
}

/// Where a callable of a schedule is used: its layer and the schedule positions of its forward,
/// its backward and its last use.
#[derive(Clone, Copy, Default)]
struct Use {
    layer: usize,
    forward: usize,
    backward: usize,
    last: usize,
}

/// Interval colouring: per `(first, last)` use, a set index shared with earlier users of the same
/// signature whose last use came before this first one (the set freed longest ago first).
fn share<S: PartialEq>(uses: Vec<(usize, usize)>, signature: &dyn Fn(usize) -> S) -> Vec<usize> {
    let mut order: Vec<usize> = (0..uses.len()).collect();
    order.sort_by_key(|&i| uses[i].0);
    let mut sets: Vec<(S, usize)> = Vec::new();
    let mut out = vec![0; uses.len()];
    for i in order {
        let (first, last) = uses[i];
        let sig = signature(i);
        let free = (0..sets.len()).filter(|&s| sets[s].0 == sig && sets[s].1 < first).min_by_key(|&s| sets[s].1);
        out[i] = match free {
            Some(s) => {
                sets[s].1 = last;
                s
            }
            None => {
                sets.push((sig, last));
                sets.len() - 1
            }
        };
    }
    out
}

/// Captures every pass of the plan's callables, callable `i`'s into `pools[i]`, in the stack's
/// order or in `layout`'s schedule; with `lending`, each pass may allocate from the gradients
/// lent to it, and each backward begins by zeroing its layer's (Note [Lent gradients]).
pub(crate) fn record(
    plan: &Plan<'_>,
    pools: &[GraphPool],
    options: &mut GraphOptions,
    layout: Option<&Layout>,
    lending: Option<&Lending>,
    learned: &Learned,
) -> Result<Recorded> {
    let n = plan.len();
    let recorded = Recorded {
        graphs: (0..n).map(|_| Vec::new()).collect(),
        inputs: Vec::with_capacity(n),
        outputs: (0..n).map(|_| Vec::new()).collect(),
        grad_outputs: vec![Vec::new(); n],
        grad_inputs: (0..n).map(|_| Vec::new()).collect(),
    };
    let grad_sets = layout.and_then(|l| l.grad_sets.clone());
    let mut pass = Record {
        plan,
        pools,
        options,
        recorded,
        inputs: (0..n).map(|_| None).collect(),
        grad_sets,
        grad_buffers: HashMap::new(),
        grad_passes: GradPasses::new(plan, layout),
        lending,
        learned,
    };
    match layout {
        None => {
            let (_, saved) = forward_pass(&mut pass, n, Vec::new())?;
            if plan.training {
                backward_pass(&mut pass, saved, Vec::new())?;
                for i in (0..n).rev() {
                    pass.weight_grad(i)?;
                }
            }
        }
        Some(layout) => pass.scheduled(layout)?,
    }
    let Record { mut recorded, inputs, .. } = pass;
    recorded.inputs = inputs.into_iter().map(|x| x.expect("every callable's forward was captured")).collect();
    Ok(recorded)
}

struct Record<'p, 'o> {
    plan: &'p Plan<'p>,
    pools: &'p [GraphPool],
    options: &'o mut GraphOptions,
    recorded: Recorded,
    /// Per callable, the inputs of its captured forward.
    inputs: Vec<Option<Inputs>>,
    /// With buffer reuse, per callable, its set of static output gradients, and the sets made.
    grad_sets: Option<Vec<usize>>,
    grad_buffers: HashMap<usize, Vec<Tensor>>,
    grad_passes: GradPasses,
    lending: Option<&'p Lending>,
    /// What the warmup learned of each pass's allocations (Note [Pass-local blocks]).
    learned: &'p Learned,
}

/// The passes that accumulate parameter gradients (backward, and split weight-gradient passes),
/// counted as they are captured: the gradient work is told a callable's gradients are complete
/// in its last such pass (under a schedule, of its last microbatch), and finishes in the
/// capture's last.
struct GradPasses {
    /// Per callable, its index among the callables given (a schedule's microbatches of a layer
    /// share the layer's).
    given: Vec<usize>,
    /// Per callable given, its gradient passes not yet captured.
    left: Vec<usize>,
    /// Every gradient pass not yet captured.
    total: usize,
}

impl GradPasses {
    fn new(plan: &Plan<'_>, layout: Option<&Layout>) -> GradPasses {
        let given = layout.map_or_else(|| (0..plan.len()).collect(), Layout::layer_of);
        let mut left = vec![0; given.iter().max().map_or(0, |m| m + 1)];
        for (i, &g) in given.iter().enumerate() {
            left[g] += 1 + usize::from(plan.callables[i].splits_dw_dyn());
        }
        let total = left.iter().sum();
        GradPasses { given, left, total }
    }

    /// Counts a gradient pass of callable `i`: the callable given whose gradients it completes,
    /// if it does, and whether it is the capture's last.
    fn count(&mut self, i: usize) -> (Option<usize>, bool) {
        let g = self.given[i];
        self.left[g] -= 1;
        self.total -= 1;
        ((self.left[g] == 0).then_some(g), self.total == 0)
    }
}

impl Record<'_, '_> {
    /// Captures what `f` enqueues on the plan's stream into a graph of callable `i`'s pool for
    /// `pass`, ending with the sync event and the save hook's join of the tail.
    fn capture(&self, i: usize, pass: Pass, f: &mut dyn FnMut() -> Result<()>) -> Result<PoolGraph> {
        self.capture_pass(i, pass, false, f)
    }

    /// As [`capture`](Self::capture); `last_grad_pass` makes the gradient work join before the
    /// sync event.
    fn capture_pass(
        &self,
        i: usize,
        pass: Pass,
        last_grad_pass: bool,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<PoolGraph> {
        let _range = self.plan.stream.device().range_with(|| self.plan.ranges[i].name("capture", pass));
        let (stream, options) = (self.plan.stream, &*self.options);
        let cap = self.plan.alloc.capture(stream, options.capture_mode, &self.pools[i])?;
        if let Some(lending) = self.lending {
            lending.open_for(&cap, i, pass);
        }
        for e in options.edges_of(i, pass).filter(|e| e.end == End::Consumer) {
            stream.wait_external(e.edge.event())?;
        }
        f()?;
        if let (Some(sync), true) = (&options.grad_sync, last_grad_pass) {
            sync.finish(stream)?;
        }
        if let Some(e) = &options.sync_event {
            stream.record_external(e)?;
        }
        self.plan.hooks[i].end_pass(stream)?;
        if let Some(sync) = &options.grad_sync {
            sync.end_pass(stream)?;
        }
        // Last, after the tail joined: a consumer sees everything the pass wrote.
        for e in options.edges_of(i, pass).filter(|e| e.end == End::Producer) {
            stream.record_external(e.edge.event())?;
        }
        cap.finish()
    }

    /// As [`capture`](Self::capture), for a pass of callable `i` that accumulates gradients:
    /// the gradient work begins before `work`, which is given the hook that tells it of
    /// parameters final early, and is told the callable's gradients complete after it, when
    /// this pass completes them ([`GradPasses`]).
    fn capture_grad_pass(
        &mut self,
        i: usize,
        pass: Pass,
        work: &mut dyn FnMut(&dyn GradHook) -> Result<()>,
    ) -> Result<PoolGraph> {
        let (completes, last) = self.grad_passes.count(i);
        let (sync, stream, lending) = (self.options.grad_sync.clone(), self.plan.stream, self.lending);
        self.capture_pass(i, pass, last, &mut || {
            if let (Some(lending), Pass::Backward) = (lending, pass) {
                lending.zero(i, stream)?;
            }
            if let Some(sync) = &sync {
                sync.begin_grad_pass(stream)?;
            }
            let told =
                sync.as_ref().zip(completes).map(|(sync, callable)| CallableGrads { sync: sync.as_ref(), callable });
            let hook: &dyn GradHook = match &told {
                Some(t) => t,
                None => &NoGradHook,
            };
            work(hook)?;
            match &told {
                Some(t) => t.sync.grads_complete(t.callable, stream),
                None => Ok(()),
            }
        })
    }

    /// Captures callable `i`'s split weight-gradient pass, if it has one.
    fn weight_grad(&mut self, i: usize) -> Result<()> {
        let (plan, stream) = (self.plan, self.plan.stream);
        if !plan.callables[i].splits_dw_dyn() {
            return Ok(());
        }
        let g = self.capture_grad_pass(i, Pass::BackwardDw, &mut |_| plan.callables[i].backward_dw_dyn(stream))?;
        self.recorded.graphs[i].push((Pass::BackwardDw, g));
        Ok(())
    }

    /// Every step of the schedule, each chunk's layers in order (forward) or in reverse; split
    /// weight gradients in the weight-gradient steps, which the capture's checks made sure
    /// their chunks have. With shared outputs, the output (input gradient) that the step's
    /// previous layer handed to this one goes back to the pool before this one's graph is
    /// captured (Note [Shared static outputs]).
    fn scheduled(&mut self, layout: &Layout) -> Result<()> {
        let n = self.plan.len();
        let mut saved: Vec<Option<Saved>> = (0..n).map(|_| None).collect();
        let (schedule, layers) = (&layout.schedule, &layout.layers[..]);
        for v in schedule.visits(layers) {
            let i = v.instance;
            // The pass before in this step: the chunk's previous layer (forward) or next one
            // (backward), whose output this pass's replay copies in just before its graph.
            let handed_by = match v.step {
                Step::Forward(_) => v.in_chunk.checked_sub(1).map(|_| v.layer - 1),
                Step::Backward(k) => (v.in_chunk + 1 < layers[k]).then_some(v.layer + 1),
                Step::WeightGrad(_) => None,
            };
            if let Some(layer) = handed_by.filter(|_| layout.share_outputs) {
                self.share(schedule.instance(layers, layer, v.microbatch), v.step)?;
            }
            match v.step {
                Step::Forward(_) => saved[i] = Some(self.forward(i, Vec::new())?.1),
                Step::Backward(_) => {
                    let s = saved[i].take().expect("a validated schedule runs a backward after its forward");
                    self.backward(i, s, Vec::new())?;
                }
                Step::WeightGrad(_) => self.weight_grad(i)?,
            }
        }
        Ok(())
    }

    /// Shares callable `i`'s outputs (before a forward `step`) or input gradients (before a
    /// backward) with the graphs captured from now on.
    fn share(&mut self, i: usize, step: Step) -> Result<()> {
        let (alloc, pool) = (self.plan.alloc, &self.pools[i]);
        if let Step::Forward(_) = step {
            let outputs = std::mem::take(&mut self.recorded.outputs[i]);
            self.recorded.outputs[i] = outputs.into_iter().map(|y| y.share(alloc, pool)).collect::<Result<_>>()?;
        } else {
            let grads = std::mem::take(&mut self.recorded.grad_inputs[i]);
            self.recorded.grad_inputs[i] =
                grads.into_iter().map(|d| d.map(|d| d.share(alloc, pool)).transpose()).collect::<Result<_>>()?;
        }
        Ok(())
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
        let hook = plan.hooks[i].clone();
        let (lending, learned, pool) = (self.lending, self.learned, &self.pools[i]);
        let g = self.capture(i, Pass::Forward, &mut || {
            hook.begin_forward(stream)?;
            let forward = || plan.callables[i].forward_dyn(&inputs, hook.as_ref(), stream);
            result = Some(learned.expect(lending, (pool, stream), (i, Pass::Forward), forward)?);
            Ok(())
        })?;
        self.options.run_pass_hook(i, Phase::Forward, stream)?;
        let (outputs, saved) = result.expect("the capture ran the forward");
        self.recorded.graphs[i].push((Pass::Forward, g));
        // Static output gradients live outside the pools, allocated outside any capture.
        if plan.training && !plan.feeds_next(i) {
            let zeros = |y: &Tensor| Tensor::zeros(plan.alloc, stream, y.shape(), y.dtype());
            let set = self.grad_sets.as_ref().map(|s| s[i]);
            self.recorded.grad_outputs[i] = match set.and_then(|s| self.grad_buffers.get(&s)) {
                Some(shared) => shared.clone(),
                None => outputs.iter().map(zeros).collect::<Result<_>>()?,
            };
            if let Some(s) = set {
                self.grad_buffers.entry(s).or_insert_with(|| self.recorded.grad_outputs[i].clone());
            }
        }
        self.inputs[i] = Some(inputs);
        self.recorded.outputs[i] = outputs.iter().cloned().map(StaticOutput::Owned).collect();
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
        let (lending, learned, pools) = (self.lending, self.learned, self.pools);
        let g = self.capture_grad_pass(i, Pass::Backward, &mut |hook| {
            let s = saved.take().expect("captured once");
            let backward = || plan.callables[i].backward_dyn(s, &dys.iter().collect::<Vec<_>>(), hook, stream);
            result = Some(learned.expect(lending, (&pools[i], stream), (i, Pass::Backward), backward)?);
            Ok(())
        })?;
        self.options.run_pass_hook(i, Phase::Backward, stream)?;
        let grads = result.expect("the capture ran the backward");
        let inputs = self.inputs[i].as_ref().expect("the forward was captured before the backward");
        plan.check_grads(i, inputs, &grads)?;
        let grads: Vec<Option<Tensor>> =
            grads.into_iter().zip(inputs.iter()).map(|(g, x)| g.filter(|_| x.differentiable)).collect();
        self.recorded.graphs[i].push((Pass::Backward, g));
        self.recorded.grad_inputs[i] = grads.iter().map(|d| d.clone().map(StaticOutput::Owned)).collect();
        self.recorded.grad_outputs[i] = dys;
        Ok(grads)
    }
}
