//! One training step: forward, backward and the optimizer, eager, or with the transformer layers
//! replayed as a graphed stack between the eager embedding and head (with `--whole-step`, the
//! whole model as one forward and one backward graph) and the optimizer replayed as one more
//! graph; with `--offload`, the layers' activations go to host memory and back (inside the
//! graphs when graphed). With `--pipeline`, a stage's part of the model under the schedule.

use std::sync::Arc;

use graphed::device::DType;
use graphed::device::{Communicator, Stream};
use graphed::dist::{DataParallel, GradReduction};
use graphed::graph::{
    make_graphed_callables, make_graphed_fn, make_graphed_stack, Callable, GradSync, GraphOptions, GraphedCallable,
    GraphedFn, GraphedStack, Replay,
};
use graphed::memory::CachingAllocator;
use graphed::nn::{Chunk, Gpt, Inputs, KeepOnDevice, Module, SaveHook};
use graphed::offload::OffloadManager;
use graphed::optim::AdamW;
use graphed::tensor::Tensor;

use super::schedule::Scheduled;
use crate::cli::args::TrainArgs;

/// Runs a step on `stream`, the way the arguments say.
pub struct Stepper {
    stream: Stream,
    alloc: CachingAllocator,
    layers: Layers,
    /// The optimizer step as a graph; `None` with `--eager`.
    optimizer: Option<GraphedFn>,
    /// With `--offload`: the manager (its policy frozen when graphed; after the first step
    /// when eager).
    offload: Option<OffloadManager>,
    /// Launched on several GPUs: the gradient reduction, and the gradients it reduces eagerly
    /// after the backward (all of them when eager; the embedding's and the head's when graphed,
    /// the layers' being reduced inside their backward graphs, under a schedule after each
    /// layer's last microbatch).
    data_parallel: Option<(Arc<DataParallel>, Vec<Tensor>)>,
}

/// How the transformer layers run.
enum Layers {
    /// Module by module (`--eager`).
    Eager,
    /// A graphed stack.
    Stack {
        stack: GraphedStack,
        /// The side stream, with `--side-stream`.
        side: Option<Stream>,
        pool_per_layer: bool,
        /// With `--lend-gradients`.
        lends: bool,
    },
    /// Under a pipeline schedule (`--schedule`), graphed unless `--eager`.
    Scheduled(Scheduled),
    /// The whole model graphed as one callable (`--whole-step`): embedding, layers, head and
    /// loss in its forward graph, their gradients in its backward graph.
    Whole {
        graphed: GraphedCallable,
        /// The side stream, with `--side-stream`.
        side: Option<Stream>,
    },
}

impl Stepper {
    /// Captures the model's layers and the optimizer step unless `--eager`: the layers into one
    /// pool (chained, so that no copies run between layers), with `--pool-per-layer` one pool
    /// per layer, with `--schedule` one graph per (layer, microbatch). The gradients are reduced
    /// over `data_parallel`'s ranks when given; `pipeline`, when given, is this stage's pipeline
    /// (`--pipeline`, under the schedule).
    pub fn new(
        model: &Gpt,
        optimizer: &AdamW,
        alloc: &CachingAllocator,
        stream: &Stream,
        batch: usize,
        args: &TrainArgs,
        (data_parallel, pipeline): (Option<&Communicator>, Option<&Communicator>),
    ) -> anyhow::Result<Stepper> {
        let dev = stream.device();
        let reduction = GradReduction::from(args.grad_reduce);
        let reducing = |dp: Arc<DataParallel>| match reduction {
            GradReduction::Mean => Ok(dp),
            other => dp.with_reduction(other),
        };
        let data_parallel = match data_parallel {
            None => None,
            // Eager, every gradient is reduced after the step's last backward.
            Some(c) if args.eager => {
                Some((reducing(DataParallel::new(c, Vec::new())?)?, vec![model.parameters().grads()?]))
            }
            // Whole, every gradient is reduced inside the backward graph.
            Some(c) if args.whole_step => {
                let whole: [&dyn Callable; 1] = [model];
                Some((reducing(DataParallel::for_callables(c, model.parameters(), &whole)?)?, Vec::new()))
            }
            Some(c) => {
                let in_layers: Vec<_> = model.layers().layers().iter().flat_map(|l| l.parameters()).collect();
                let rest = model.parameters().grads_outside(&in_layers)?;
                Some((reducing(DataParallel::for_stack(c, model.parameters(), model.layers())?)?, rest))
            }
        };
        let offload = args.offload.config(dev).map(|c| OffloadManager::new(alloc, c)).transpose()?;
        let layers = match (args.schedule, args.eager) {
            _ if args.whole_step => {
                let (b, t) = (batch, model.config().max_len);
                let tokens = Tensor::zeros(alloc, stream, &[b, t], DType::U32)?;
                let targets = Tensor::zeros(alloc, stream, &[b * t], DType::U32)?;
                let mut options = GraphOptions::default();
                if let Some((dp, _)) = &data_parallel {
                    options = options.grad_sync(dp.clone());
                }
                if let Some(m) = &offload {
                    options = m.graph_options(options);
                }
                let (side, event) = match args.side_stream {
                    true => (Some(dev.stream()?), Some(dev.event()?)),
                    false => (None, None),
                };
                if let Some(e) = &event {
                    options = options.sync_event(e);
                }
                let whole: [&dyn Callable; 1] = [model];
                let samples = [Inputs::new().constant("tokens", &tokens).constant("targets", &targets)];
                let graphed = make_graphed_callables(alloc, &whole, &samples, options)?.remove(0);
                Layers::Whole { graphed, side }
            }
            (true, _) => {
                let sync = data_parallel.as_ref().map(|(dp, _)| dp.clone() as Arc<dyn GradSync>);
                Layers::Scheduled(Scheduled::new(model, (alloc, stream), batch, args, sync, pipeline)?)
            }
            (false, true) => Layers::Eager,
            (false, false) => {
                let x = Tensor::zeros(
                    alloc,
                    stream,
                    &[batch, model.config().max_len, model.config().dim],
                    model.config().dtype,
                )?;
                let (side, event) = match args.side_stream {
                    true => (Some(dev.stream()?), Some(dev.event()?)),
                    false => (None, None),
                };
                let mut options =
                    GraphOptions::default().pool_per_callable(args.pool_per_layer).lend_gradients(args.lend_gradients);
                if let Some(e) = &event {
                    options = options.sync_event(e);
                }
                if let Some(m) = &offload {
                    options = m.graph_options(options);
                }
                if let Some((dp, _)) = &data_parallel {
                    options = options.grad_sync(dp.clone());
                }
                let stack = make_graphed_stack(alloc, model.layers(), &x, options)?;
                Layers::Stack { stack, side, pool_per_layer: args.pool_per_layer, lends: args.lend_gradients }
            }
        };
        let optimizer = (!args.eager).then(|| make_graphed_fn(alloc, |s| optimizer.step(s))).transpose()?;
        let optimizer = optimizer.map(|g| g.with_name("optimizer step"));
        Ok(Stepper { stream: stream.clone(), alloc: alloc.clone(), layers, optimizer, offload, data_parallel })
    }

    /// The offload policy's table, once frozen.
    pub fn offload_summary(&self) -> Option<String> {
        self.offload.as_ref().and_then(OffloadManager::summary).map(|s| s.to_string())
    }

    /// How the step runs, for the banner.
    pub fn describe(&self) -> String {
        let offload = if self.offload.is_some() { ", activations offloaded to host memory" } else { "" };
        let parallel = match &self.data_parallel {
            Some((dp, _)) => format!(", data parallel over {} ranks (gradients' {})", dp.comm().size(), dp.reduction()),
            None => String::new(),
        };
        let optimizer = if self.optimizer.is_some() { " and a graphed optimizer step" } else { "" };
        let how = match &self.layers {
            Layers::Eager => "eager".into(),
            Layers::Stack { stack, side, pool_per_layer, lends } => format!(
                "a graphed stack of {} layers ({}, {}{})",
                stack.layers().len(),
                if side.is_some() { "side stream, resuming at the in-graph event" } else { "caller's stream" },
                if *pool_per_layer { "a pool per layer" } else { "one shared pool" },
                if *lends { ", the layers' gradients lent to it" } else { "" }
            ),
            Layers::Scheduled(s) => format!("a pipeline schedule, {}", s.describe()),
            Layers::Whole { side, .. } => format!(
                "the whole step graphed (one forward and one backward graph, {})",
                if side.is_some() { "side stream, resuming at the in-graph event" } else { "caller's stream" }
            ),
        };
        format!("{how}{optimizer}{offload}{parallel}")
    }

    /// Forward, backward and optimizer step of one batch; returns the per-position losses, on
    /// the rank whose part of the model computes them (`None` on a pipeline stage without the
    /// head).
    pub fn step(
        &mut self,
        model: &Gpt,
        optimizer: &AdamW,
        tokens: &Tensor,
        targets: &Tensor,
        weights: &Tensor,
    ) -> anyhow::Result<Option<Tensor>> {
        let stream = &self.stream;
        let losses = match &mut self.layers {
            Layers::Eager => {
                let hook: Box<dyn SaveHook> = match &self.offload {
                    Some(m) => Box::new(m.chunk(Chunk::default())),
                    None => Box::new(KeepOnDevice),
                };
                let (losses, ctx) = model.forward_with(tokens, targets, hook.as_ref(), stream)?;
                model.backward(ctx, weights, stream)?;
                if let Some(m) = &self.offload {
                    m.end_iteration(stream)?;
                }
                Some(losses)
            }
            Layers::Scheduled(s) => s.step(model, &self.alloc, stream, (tokens, targets, weights))?,
            Layers::Whole { graphed: g, side } => {
                let replay = side.as_ref().map_or(Replay::caller(), Replay::side);
                let inputs = Inputs::new().constant("tokens", tokens).constant("targets", targets);
                // The step's uploaded batch is read where it is (our embedding and loss kernels
                // read it): nothing is copied in, and the batch lives until the step is done.
                let (losses, forward) = g.forward_in_place(stream, &inputs, replay)?;
                // The next step's replay writes the losses' static buffer: the caller's copy.
                let losses = losses[0].to_owned(&self.alloc, stream)?;
                let (_, backward) = g.backward_in_place(stream, &[weights])?;
                forward.join(stream)?;
                backward.join(stream)?;
                Some(losses)
            }
            Layers::Stack { stack, side, .. } => {
                let replay = side.as_ref().map_or(Replay::caller(), Replay::side);
                let h = model.embed(tokens, stream)?;
                // Read where they are when the layers' graphs allow it (with dropout; without,
                // the first residual add reads the input in a cuBLASLt epilogue: copied in).
                let y = stack.forward_in_place(stream, &h, replay)?;
                let (losses, head) = model.head(y.get()?, targets, stream)?;
                let dy = model.head_backward(head, weights, stream)?;
                let dx = stack.backward_in_place(stream, &dy)?;
                let dx = dx.ok_or_else(|| anyhow::anyhow!("the first layer gave no input gradient"))?;
                model.embed_backward(tokens, dx.get()?, stream)?;
                // The optimizer reads every gradient: join the tails first (R4), and take them
                // (lent ones are checked whole).
                stack.join(stream)?;
                stack.take_gradients()?;
                Some(losses)
            }
        };
        if let Some((dp, rest)) = &self.data_parallel {
            for grads in rest {
                dp.all_reduce(stream, grads)?;
            }
        }
        match &self.optimizer {
            Some(g) => g.replay(stream)?,
            None => optimizer.step(stream)?,
        }
        Ok(losses)
    }
}
