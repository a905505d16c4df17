//! Transformer layers stepped under a pipeline schedule, eagerly or through one graph per (layer,
//! microbatch): what `train --schedule` and `bench schedule` share.

use graphed::device::Stream;
use graphed::graph::{make_graphed_schedule, Callable, GraphOptions, GraphedSchedule};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    run_pipeline_stage, run_schedule, EagerPasses, Handed, Inputs, KeepOnDevice, Schedule, SchedulePasses, Stage,
    StageLinks, TransformerLayer,
};
use graphed::tensor::Tensor;

/// A schedule over layers split into `per_chunk`, and its graphed layers when captured.
pub struct ScheduledLayers {
    pub schedule: Schedule,
    pub per_chunk: Vec<usize>,
    /// `None`: the layers run eagerly.
    pub graphed: Option<GraphedSchedule>,
}

impl ScheduledLayers {
    /// Eager when `capture` is `None`; else `layers` captured in `schedule`'s order from
    /// `sample` (a microbatch's input) with those options (the schedule added).
    pub fn new(
        alloc: &CachingAllocator,
        layers: &[TransformerLayer],
        (schedule, per_chunk): (Schedule, Vec<usize>),
        sample: &Tensor,
        capture: Option<GraphOptions>,
    ) -> graphed::Result<ScheduledLayers> {
        let graphed = match capture {
            None => None,
            Some(options) => {
                let callables: Vec<&dyn Callable> = layers.iter().map(|l| l as &dyn Callable).collect();
                let samples: Vec<Inputs> =
                    (0..layers.len() * schedule.microbatches()).map(|_| Inputs::one(sample)).collect();
                let options = options.layers_per_chunk(&per_chunk);
                Some(make_graphed_schedule(alloc, &callables, &schedule, &samples, options)?)
            }
        };
        Ok(ScheduledLayers { schedule, per_chunk, graphed })
    }

    /// One step of `layers` under the schedule on `stream` (see `nn::run_schedule`), or as
    /// pipeline stage `pipeline` (see `nn::run_pipeline_stage`); returns each microbatch's input
    /// gradient.
    pub fn run(
        &self,
        layers: &[TransformerLayer],
        stream: &Stream,
        inputs: &[Tensor],
        rng_step: Option<&Tensor>,
        head: &mut dyn FnMut(usize, Tensor) -> graphed::Result<Tensor>,
        pipeline: Option<(Stage, &mut dyn StageLinks)>,
    ) -> graphed::Result<Vec<Tensor>> {
        match &self.graphed {
            None => self.step(&mut EagerPasses::new(layers, &KeepOnDevice, stream), inputs, rng_step, head, pipeline),
            Some(g) => self.step(&mut g.passes(stream), inputs, rng_step, head, pipeline),
        }
    }

    /// `run` through `passes`, whose outputs are read at once (by `head`, and by the caller of
    /// `run` for the input gradients it returns).
    fn step<P: SchedulePasses>(
        &self,
        passes: &mut P,
        inputs: &[Tensor],
        rng_step: Option<&Tensor>,
        head: &mut dyn FnMut(usize, Tensor) -> graphed::Result<Tensor>,
        pipeline: Option<(Stage, &mut dyn StageLinks)>,
    ) -> graphed::Result<Vec<Tensor>> {
        let mut head = |j: usize, y: P::Out| head(j, y.tensor()?.clone());
        let dxs = match pipeline {
            None => run_schedule(passes, &self.schedule, &self.per_chunk, inputs, rng_step, &mut head)?,
            Some((stage, links)) => {
                let run = (&self.per_chunk[..], inputs);
                run_pipeline_stage(passes, &self.schedule, run, rng_step, &mut head, stage, links)?
            }
        };
        dxs.iter().map(|d| d.tensor().cloned()).collect()
    }
}
