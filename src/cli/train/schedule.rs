//! `train --schedule`: each batch split into microbatches and the layers into virtual stages,
//! stepped under interleaved 1F1B by `nn::run_schedule`, eagerly or through one graph per
//! (layer, microbatch) replayed in the schedule's order; the embedding, the head and the
//! optimizer around it as in the other modes.

use graphed::device::{DType, Stream};
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, GraphedCallable, GraphedPasses};
use graphed::memory::CachingAllocator;
use graphed::nn::{run_schedule, EagerPasses, Gpt, Inputs, KeepOnDevice, Schedule, SchedulePasses};
use graphed::tensor::Tensor;

use crate::cli::args::TrainArgs;

/// The schedule, its chunks, and the graphed callables unless `--eager`.
pub struct Scheduled {
    schedule: Schedule,
    per_chunk: Vec<usize>,
    graphed: Option<Vec<GraphedCallable>>,
}

impl Scheduled {
    /// The schedule for `model`'s layers and a batch of `batch`, captured unless `--eager`.
    pub fn new(
        model: &Gpt,
        alloc: &CachingAllocator,
        stream: &Stream,
        batch: usize,
        args: &TrainArgs,
    ) -> anyhow::Result<Scheduled> {
        let layers = model.layers().layers();
        let (schedule, per_chunk) = args.schedule_args.resolve(layers.len())?;
        let m = schedule.microbatches();
        if !batch.is_multiple_of(m) {
            anyhow::bail!(
                "a batch of {batch} does not split into {m} microbatches; pass --batch or --microbatches to fit"
            );
        }
        let graphed = match args.eager {
            true => None,
            false => {
                let shape = [batch / m, model.config().max_len, model.config().dim];
                let sample = Tensor::zeros(alloc, stream, &shape, model.config().dtype)?;
                let callables: Vec<&dyn Callable> = layers.iter().map(|l| l as &dyn Callable).collect();
                let samples: Vec<Inputs> = (0..layers.len() * m).map(|_| Inputs::one(&sample)).collect();
                let options = GraphOptions::default().schedule(&schedule).reuse_buffers(true);
                Some(make_graphed_callables(alloc, &callables, &samples, options)?)
            }
        };
        Ok(Scheduled { schedule, per_chunk, graphed })
    }

    /// How it runs, for the banner.
    pub fn describe(&self) -> String {
        let how = match &self.graphed {
            Some(g) => format!("{} graphed callables (one per layer and microbatch), buffers reused", g.len()),
            None => "eager".to_string(),
        };
        format!("{} ({how})", self.schedule)
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
        let m = self.schedule.microbatches();
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
        let mut eager;
        let mut replays;
        let passes: &mut dyn SchedulePasses = match &self.graphed {
            None => {
                eager = EagerPasses::new(model.layers().layers(), &KeepOnDevice, stream);
                &mut eager
            }
            Some(g) => {
                replays = GraphedPasses::new(g, &self.schedule, &self.per_chunk, stream);
                &mut replays
            }
        };
        let step = Some(model.dropout_step());
        let dxs = run_schedule(passes, &self.schedule, &self.per_chunk, &inputs, step, &mut head)?;
        for (j, dx) in dxs.iter().enumerate() {
            model.embed_backward(&part(tokens, j, rows)?, dx, stream)?;
        }
        Ok(losses)
    }
}
