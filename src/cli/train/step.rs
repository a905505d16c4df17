//! One training step's forward and backward: eager, or with the transformer layers replayed as
//! graphed callables between the eager embedding and head.

use graphed::device::{Event, Stream};
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, GraphedCallable, Inputs, Replay, Tails};
use graphed::memory::CachingAllocator;
use graphed::nn::Gpt;
use graphed::tensor::Tensor;

use super::addition;
use crate::cli::args::TrainArgs;

/// Runs the forward and backward of a step on `stream`, the way the arguments say.
pub struct Stepper {
    stream: Stream,
    /// `None` with `--eager`.
    graphed: Option<Graphed>,
}

struct Graphed {
    layers: Vec<GraphedCallable>,
    /// The side stream and the event its graphs record, with `--side-stream`.
    side: Option<(Stream, Event)>,
    shared_pool: bool,
}

impl Stepper {
    /// Captures the model's layers unless `--eager`: one pool for all (chained, so that no copies
    /// run between layers) or, with `--pool-per-layer`, one pool per layer.
    pub fn new(
        model: &Gpt,
        alloc: &CachingAllocator,
        stream: &Stream,
        batch: usize,
        args: &TrainArgs,
    ) -> anyhow::Result<Stepper> {
        if args.eager {
            return Ok(Stepper { stream: stream.clone(), graphed: None });
        }
        let dev = stream.device();
        let x = Tensor::<f32>::zeros(alloc, stream, &[batch, addition::INPUT, model.config().dim])?;
        let side = match args.side_stream {
            true => Some((dev.stream()?, dev.event()?)),
            false => None,
        };
        let options = || {
            let o = GraphOptions::default();
            match &side {
                Some((_, e)) => o.sync_event(e),
                None => o,
            }
        };
        let callables: Vec<&dyn Callable> = model.layers().iter().map(|l| l as &dyn Callable).collect();
        let layers = if args.pool_per_layer {
            let mut all = Vec::new();
            for c in &callables {
                all.extend(make_graphed_callables(alloc, &[*c], &[Inputs::args(&[&x])], options())?);
            }
            all
        } else {
            let samples: Vec<Inputs> = callables.iter().map(|_| Inputs::args(&[&x])).collect();
            make_graphed_callables(alloc, &callables, &samples, options().chain(true))?
        };
        let graphed = Graphed { layers, side, shared_pool: !args.pool_per_layer };
        Ok(Stepper { stream: stream.clone(), graphed: Some(graphed) })
    }

    /// How the step runs, for the banner.
    pub fn describe(&self) -> String {
        match &self.graphed {
            None => "eager".into(),
            Some(Graphed { layers, side, shared_pool }) => format!(
                "{} graphed layers ({}, {})",
                layers.len(),
                if side.is_some() { "side stream, resuming at the in-graph event" } else { "caller's stream" },
                if *shared_pool { "one shared pool" } else { "a pool per layer" }
            ),
        }
    }

    /// Forward and backward of one batch; returns the per-position losses.
    pub fn step(
        &mut self,
        model: &Gpt,
        tokens: &Tensor<u32>,
        targets: &Tensor<u32>,
        weights: &Tensor<f32>,
    ) -> anyhow::Result<Tensor<f32>> {
        let stream = &self.stream;
        match &mut self.graphed {
            None => {
                let (losses, ctx) = model.forward(tokens, targets, stream)?;
                model.backward(ctx, weights, stream)?;
                Ok(losses)
            }
            Some(Graphed { layers, side, .. }) => {
                let replay = match side {
                    Some((s, e)) => Replay::resume_at(s, e),
                    None => Replay::caller(),
                };
                let mut tails = Tails::new();
                let mut h = model.embed(tokens, stream)?;
                for layer in layers.iter_mut() {
                    let (y, tail) = layer.forward(stream, &Inputs::args(&[&h]), replay)?;
                    tails.push(tail);
                    h = y[0].get()?.clone();
                }
                let (losses, head) = model.head(&h, targets, stream)?;
                let mut d = model.head_backward(head, weights, stream)?;
                for layer in layers.iter_mut().rev() {
                    let (dx, tail) = layer.backward(stream, &[&d])?;
                    tails.push(tail);
                    let dx = dx
                        .into_iter()
                        .next()
                        .flatten()
                        .ok_or_else(|| anyhow::anyhow!("a layer gave no input gradient"))?;
                    d = dx.get()?.clone();
                }
                model.embed_backward(tokens, &d, stream)?;
                // The optimizer comes next: join every tail first (R4).
                tails.join(stream)?;
                Ok(losses)
            }
        }
    }
}
