//! `train --schedule`: each batch split into microbatches and the layers into virtual stages,
//! stepped under interleaved 1F1B by `nn::run_schedule`, eagerly or through one graph per
//! (layer, microbatch) replayed in the schedule's order; the embedding, the head and the
//! optimizer around it as in the other modes. With `--pipeline`, this rank's stage of that
//! schedule (`nn::run_pipeline_stage`), its activations and gradients crossing to the stages
//! before and after it through `dist::P2pLinks` (captured into graphs unless `--eager`).

use std::sync::Arc;

use graphed::device::{Communicator, DType, Stream};
use graphed::dist::P2pLinks;
use graphed::graph::{GradSync, GraphOptions};
use graphed::memory::CachingAllocator;
use graphed::nn::{Gpt, Stage, StageLinks};
use graphed::tensor::Tensor;

use crate::cli::args::TrainArgs;
use crate::cli::scheduled::ScheduledLayers;

/// The model's layers (a stage's, with `--pipeline`) under the schedule, graphed unless `--eager`.
pub struct Scheduled {
    layers: ScheduledLayers,
    /// With `--pipeline`: this rank's stage and its links to its replica's other stages.
    pipeline: Option<(Stage, P2pLinks)>,
}

impl Scheduled {
    /// The schedule for `model`'s layers and a batch of `batch`, captured unless `--eager`
    /// (with `grad_sync` inside the backward graphs, when given); as stage `stage` of the
    /// pipeline whose ranks `pipeline` joins, when given (its rank `s` is stage `s`).
    pub fn new(
        model: &Gpt,
        (alloc, stream): (&CachingAllocator, &Stream),
        batch: usize,
        args: &TrainArgs,
        grad_sync: Option<Arc<dyn GradSync>>,
        pipeline: Option<&Communicator>,
    ) -> anyhow::Result<Scheduled> {
        let stage = pipeline.map_or(Ok(Stage::single()), |c| Stage::new(c.rank(), c.size()))?;
        let (schedule, per_chunk) = args.schedule_args.resolve(model.config().layers, stage)?;
        // The batch splits into the microbatches (refused before anything is built otherwise).
        let m = schedule.microbatches();
        let shape = [batch / m, model.config().max_len, model.config().dim];
        let dtype = model.config().dtype;
        let sample = Tensor::zeros(alloc, stream, &shape, dtype)?;
        let capture = (!args.eager).then(|| {
            let options = GraphOptions::default().reuse_buffers(true);
            match grad_sync {
                Some(sync) => options.grad_sync(sync),
                None => options,
            }
        });
        let layers = model.layers().layers();
        let layers = ScheduledLayers::new(alloc, layers, (schedule, per_chunk), &sample, capture)?;
        let pipeline = pipeline.map(|c| {
            let links = match args.eager {
                true => P2pLinks::eager(c, alloc, stream, &shape, dtype),
                false => P2pLinks::graphed(c, alloc, stream, &shape, dtype),
            };
            (stage, links)
        });
        Ok(Scheduled { layers, pipeline })
    }

    /// How it runs, for the banner.
    pub fn describe(&self) -> String {
        let how = match &self.layers.graphed {
            Some(g) => {
                format!("{} graphed callables (one per layer and microbatch), buffers reused", g.callables().len())
            }
            None => "eager".to_string(),
        };
        let stage = match &self.pipeline {
            Some((stage, _)) => format!(", stage {} of {} of a pipeline", stage.index(), stage.count()),
            None => String::new(),
        };
        format!("{} ({how}{stage})", self.layers.schedule)
    }

    /// Forward and backward of one batch under the schedule (the optimizer is the caller's);
    /// returns the per-position losses, on the stage that holds the head (`None` on the others).
    pub fn step(
        &mut self,
        model: &Gpt,
        alloc: &CachingAllocator,
        stream: &Stream,
        (tokens, targets, weights): (&Tensor, &Tensor, &Tensor),
    ) -> anyhow::Result<Option<Tensor>> {
        let m = self.layers.schedule.microbatches();
        let (rows, positions) = (tokens.shape()[0] / m, tokens.numel() / m);
        let losses =
            model.has_head().then(|| Tensor::uninit(alloc, stream, &[tokens.numel()], DType::F32)).transpose()?;
        let part = |t: &Tensor, j: usize, len: usize| t.narrow(0, j * len, len);
        // The microbatches enter on the stage with the embedding; the others receive them.
        let inputs = match model.has_embedding() {
            true => (0..m).map(|j| model.embed(&part(tokens, j, rows)?, stream)).collect::<graphed::Result<_>>()?,
            false => Vec::new(),
        };
        let mut head = |j: usize, y: Tensor| -> graphed::Result<Tensor> {
            let (l, ctx) = model.head(&y, &part(targets, j, positions)?, stream)?;
            if let Some(losses) = &losses {
                part(losses, j, positions)?.copy_from(&l, stream)?;
            }
            model.head_backward(ctx, &part(weights, j, positions)?, stream)
        };
        let step = Some(model.dropout_step());
        let pipeline = self.pipeline.as_mut().map(|(stage, links)| (*stage, links as &mut dyn StageLinks));
        let dxs = self.layers.run(model.layers().layers(), stream, &inputs, step, &mut head, pipeline)?;
        // Input gradients come back on the stage with the embedding only.
        for (j, dx) in dxs.iter().enumerate() {
            model.embed_backward(&part(tokens, j, rows)?, dx, stream)?;
        }
        Ok(losses)
    }
}
