//! `train --schedule`: each batch split into microbatches and the layers into virtual stages,
//! stepped under interleaved 1F1B by `nn::run_schedule`, eagerly or through one graph per
//! (layer, microbatch) replayed in the schedule's order; the embedding, the head and the
//! optimizer around it as in the other modes.

use std::sync::Arc;

use graphed::device::{DType, Stream};
use graphed::graph::{GradSync, GraphOptions};
use graphed::memory::CachingAllocator;
use graphed::nn::Gpt;
use graphed::tensor::Tensor;

use crate::cli::args::TrainArgs;
use crate::cli::scheduled::ScheduledLayers;

/// The model's layers under the schedule, graphed unless `--eager`.
pub struct Scheduled(ScheduledLayers);

impl Scheduled {
    /// The schedule for `model`'s layers and a batch of `batch`, captured unless `--eager`
    /// (with `grad_sync` inside the backward graphs, when given).
    pub fn new(
        model: &Gpt,
        alloc: &CachingAllocator,
        stream: &Stream,
        batch: usize,
        args: &TrainArgs,
        grad_sync: Option<Arc<dyn GradSync>>,
    ) -> anyhow::Result<Scheduled> {
        let layers = model.layers().layers();
        let (schedule, per_chunk) = args.schedule_args.resolve(layers.len())?;
        let m = schedule.microbatches();
        if !batch.is_multiple_of(m) {
            anyhow::bail!(
                "a batch of {batch} does not split into {m} microbatches; pass --batch or --microbatches to fit"
            );
        }
        let shape = [batch / m, model.config().max_len, model.config().dim];
        let sample = Tensor::zeros(alloc, stream, &shape, model.config().dtype)?;
        let capture = (!args.eager).then(|| {
            let options = GraphOptions::default().reuse_buffers(true);
            match grad_sync {
                Some(sync) => options.grad_sync(sync),
                None => options,
            }
        });
        Ok(Scheduled(ScheduledLayers::new(alloc, layers, (schedule, per_chunk), &sample, capture)?))
    }

    /// How it runs, for the banner.
    pub fn describe(&self) -> String {
        let how = match &self.0.graphed {
            Some(g) => {
                format!("{} graphed callables (one per layer and microbatch), buffers reused", g.callables().len())
            }
            None => "eager".to_string(),
        };
        format!("{} ({how})", self.0.schedule)
    }

    /// Forward and backward of one batch under the schedule (the optimizer is the caller's);
    /// returns the per-position losses.
    pub fn step(
        &self,
        model: &Gpt,
        alloc: &CachingAllocator,
        stream: &Stream,
        (tokens, targets, weights): (&Tensor, &Tensor, &Tensor),
    ) -> anyhow::Result<Tensor> {
        let m = self.0.schedule.microbatches();
        let (rows, positions) = (tokens.shape()[0] / m, tokens.numel() / m);
        let losses = Tensor::uninit(alloc, stream, &[tokens.numel()], DType::F32)?;
        let part = |t: &Tensor, j: usize, len: usize| t.narrow(0, j * len, len);
        let inputs =
            (0..m).map(|j| model.embed(&part(tokens, j, rows)?, stream)).collect::<graphed::Result<Vec<_>>>()?;
        let mut head = |j: usize, y: Tensor| -> graphed::Result<Tensor> {
            let (l, ctx) = model.head(&y, &part(targets, j, positions)?, stream)?;
            part(&losses, j, positions)?.copy_from(&l, stream)?;
            model.head_backward(ctx, &part(weights, j, positions)?, stream)
        };
        let step = Some(model.dropout_step());
        let dxs = self.0.run(model.layers().layers(), stream, &inputs, step, &mut head, None)?;
        for (j, dx) in dxs.iter().enumerate() {
            model.embed_backward(&part(tokens, j, rows)?, dx, stream)?;
        }
        Ok(losses)
    }
}
