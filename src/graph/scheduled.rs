//! A pipeline schedule's graphed layers: one graph per (layer, microbatch), captured in the
//! schedule's order and run as its passes by the schedule's one walk (`nn::run_schedule`).

use super::capture::chunk_layers;
use super::graphed::Pass;
use super::{make_graphed_callables, Callable, GraphOptions, GraphedCallable, Replay, StaticTensor};
use crate::device::Stream;
use crate::memory::CachingAllocator;
use crate::nn::{
    run_pipeline_stage, run_schedule, Handed, Inputs, Schedule, ScheduleErrorKind, SchedulePasses, Stage, StageLinks,
};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The graphed layers of a [`Schedule`], with the schedule and the layers of each chunk they were
/// captured for: one step is [`run`](GraphedSchedule::run) (or
/// [`run_stage`](GraphedSchedule::run_stage) on a pipeline rank), as a stack's are
/// [`GraphedStack::forward`](super::GraphedStack::forward) and its backward. Replays follow the
/// capture order (R5) because the step walks the schedule it was captured with.
///
/// Each pass hands on its static output (or input gradient) as a [`StaticTensor`]: the next pass
/// copies it into its own static buffer, and what reaches the caller (the head's input, the
/// step's input gradients) refuses to be read once the next step's replay overwrote it, as a
/// stack's outputs do; copy it ([`StaticTensor::to_owned`]) to keep it. Without buffer reuse no
/// graph of the pool writes a callable's outputs but its own. With
/// [`GraphOptions::reuse_buffers`], an output that only the next layer of its chunk reads (and an
/// input gradient that only the previous layer reads) is memory the pool shares with the graphs
/// captured after that read, so it is valid only until the next graph of the step: the pool's
/// peak drops by those buffers (Note [Shared static outputs] in `graph/output.rs`).
///
/// ```
/// use graphed::device::Device;
/// use graphed::graph::{make_graphed_schedule, Callable, GraphOptions};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Inputs, Linear, ParamStore, Schedule};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &s, 64)?;
/// let vb = Builder::new(&store, &alloc, &s)?.with_seed(1);
/// let (a, b) = (Linear::new(&vb.pp("a"), (4, 4))?, Linear::new(&vb.pp("b"), (4, 4))?);
/// // Two chunks of one layer each, two microbatches, one-forward-one-backward.
/// let schedule = Schedule::interleaved_1f1b(1, 0, 2, 2)?;
/// let x = Tensor::from_host(&alloc, &s, &[0.5f32; 8], &[2, 4])?;
/// let samples = vec![Inputs::one(&x); 4];
/// let layers = [&a as &dyn Callable, &b as &dyn Callable];
/// let g = make_graphed_schedule(&alloc, &layers, &schedule, &samples, GraphOptions::default())?;
/// let dy = Tensor::from_host(&alloc, &s, &[1.0f32; 8], &[2, 4])?;
/// let dxs = g.run(&s, &[x.clone(), x.clone()], None, &mut |_, _y| Ok(dy.clone()))?;
/// assert_eq!(dxs[1].get()?.shape(), &[2, 4]);
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct GraphedSchedule {
    schedule: Schedule,
    layers_per_chunk: Vec<usize>,
    callables: Vec<GraphedCallable>,
}

/// Captures `layers` (every chunk's, chunk by chunk; each chunk `layers / chunks` of them unless
/// [`GraphOptions::layers_per_chunk`] says otherwise) for `schedule`: one graph per (layer,
/// microbatch) from `samples`, one per pair, chunk by chunk, microbatch by microbatch, layer by
/// layer (as TransformerEngine orders them), captured in the schedule's order into one pool.
///
/// # Errors
/// As [`make_graphed_callables`] with [`GraphOptions::schedule`].
pub fn make_graphed_schedule(
    alloc: &CachingAllocator,
    layers: &[&dyn Callable],
    schedule: &Schedule,
    samples: &[Inputs],
    options: GraphOptions,
) -> Result<GraphedSchedule> {
    let options = options.schedule(schedule);
    let layers_per_chunk = chunk_layers(&options, schedule, layers.len())?;
    let callables = make_graphed_callables(alloc, layers, samples, options)?;
    Ok(GraphedSchedule { schedule: schedule.clone(), layers_per_chunk, callables })
}

impl GraphedSchedule {
    /// The schedule it was captured for.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The layers of each chunk.
    pub fn layers_per_chunk(&self) -> &[usize] {
        &self.layers_per_chunk
    }

    /// The graphed callables, one per (layer, microbatch), in the samples' order.
    pub fn callables(&self) -> &[GraphedCallable] {
        &self.callables
    }

    /// One step on `caller`: the schedule's passes replayed in its order, microbatch j's
    /// `inputs[j]` into the first chunk, the last chunk's output to `head(j, y)`, which returns its
    /// upstream gradient, and `rng_step` (the layers' dropout counter, if any) advanced as
    /// [`run_schedule`] does. Returns each microbatch's input gradient.
    ///
    /// # Errors
    /// As [`run_schedule`]; the replays' refusals.
    pub fn run(
        &self,
        caller: &Stream,
        inputs: &[Tensor],
        rng_step: Option<&Tensor>,
        head: &mut dyn FnMut(usize, StaticTensor) -> Result<Tensor>,
    ) -> Result<Vec<StaticTensor>> {
        run_schedule(&mut self.passes(caller), &self.schedule, &self.layers_per_chunk, inputs, rng_step, head)
    }

    /// [`run`](GraphedSchedule::run) as pipeline stage `stage`, its tensors crossing to the
    /// neighbouring stages through `links` (see [`run_pipeline_stage`]).
    ///
    /// # Errors
    /// As [`run_pipeline_stage`]; the replays' refusals.
    pub fn run_stage(
        &self,
        caller: &Stream,
        inputs: &[Tensor],
        rng_step: Option<&Tensor>,
        head: &mut dyn FnMut(usize, StaticTensor) -> Result<Tensor>,
        (stage, links): (Stage, &mut dyn StageLinks),
    ) -> Result<Vec<StaticTensor>> {
        let run = (&self.layers_per_chunk[..], inputs);
        run_pipeline_stage(&mut self.passes(caller), &self.schedule, run, rng_step, head, stage, links)
    }

    /// Releases every callable's static state
    /// ([`GraphedCallable::release_static_state`]): replaying it afterwards is refused.
    ///
    /// # Errors
    /// As [`GraphedCallable::release_static_state`], for the first callable that fails; the
    /// callables before it were released.
    pub fn release_static_state(&mut self) -> Result<()> {
        self.callables.iter_mut().try_for_each(GraphedCallable::release_static_state)
    }

    /// Its passes replayed on `caller`, for code that drives a schedule's walk itself (and runs
    /// eager passes through the same code): give them to [`run_schedule`] with
    /// [`schedule`](GraphedSchedule::schedule) and
    /// [`layers_per_chunk`](GraphedSchedule::layers_per_chunk).
    pub fn passes<'a>(&'a self, caller: &'a Stream) -> GraphedPasses<'a> {
        GraphedPasses { graphed: self, caller }
    }
}

/// A [`GraphedSchedule`]'s passes replayed on one stream ([`GraphedSchedule::passes`]).
pub struct GraphedPasses<'a> {
    graphed: &'a GraphedSchedule,
    caller: &'a Stream,
}

impl GraphedPasses<'_> {
    fn callable(&self, layer: usize, microbatch: usize) -> Result<&GraphedCallable> {
        let g = self.graphed;
        let i = g.schedule.instance(&g.layers_per_chunk, layer, microbatch);
        (g.callables.get(i)).ok_or(Error::Schedule(ScheduleErrorKind::NoCallable { layer, microbatch }))
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
        let last = self.graphed.schedule.microbatches() - 1;
        self.callable(layer, last)?.has_pass(Pass::BackwardDw)
    }
}
