//! Soak (issue 30, item 8): many steps of graphed training, (1) a transformer stack with
//! activation offloading replayed on a side stream and joined, then the optimizer's graph, and
//! (2) the same layers under an interleaved 1F1B schedule, one graph per (layer, microbatch);
//! the process's resident memory, the allocator's bytes, the device's free memory and the loss
//! are sampled after a warm-up and then ten times up to the end: memory stays flat, the loss
//! finite, no gradient non-finite.
//!
//! The simulator runs a few steps (CI: the code path, not the duration). The CUDA runs are
//! ignored without a GPU; on the GPU machine, `cargo test --release --test soak -- --ignored
//! --nocapture` runs `GRAPHED_SOAK_STEPS` steps each (100 000 by default) and prints the samples.

mod common;

use anyhow::{ensure, Context};
use graphed::device::{DType, Device, DeviceKind, Stream};
use graphed::graph::{make_graphed_fn, make_graphed_schedule, make_graphed_stack, Callable, GraphOptions};
use graphed::graph::{Replay, StaticTensor};
use graphed::memory::CachingAllocator;
use graphed::nn::TransformerLayer;
use graphed::nn::{Builder, Inputs, Layers, ParamStore, Schedule, Stack};
use graphed::offload::{OffloadConfig, OffloadManager};
use graphed::ops::elementwise;
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;

type Result<T = ()> = anyhow::Result<T>;

/// Batch, sequence, width; heads; layers. Each saved `(B·T, C)` tensor has 512 elements.
const SHAPE: [usize; 3] = [2, 8, 32];
/// Heads of 32 features, which the fused attention (the default form) runs.
const HEADS: usize = 1;
const LAYERS: usize = 2;

/// Distinct inputs, cycled through, so that inputs change every step without allocating.
const INPUTS: usize = 8;

/// Resident memory may grow by this much from the warm-up's sample (allocator pages, the
/// libraries' lazy caches); a leak of 200 bytes a step passes it within 100 000 steps.
const RSS_SLACK_KIB: u64 = 16 * 1024;

/// The device's free memory may fall by this much from the warm-up's sample (the driver's own
/// lazy allocations come in 2 MiB pages); the allocator's bytes may not change at all.
const FREE_SLACK: usize = 32 << 20;

/// Steps: `GRAPHED_SOAK_STEPS`, else 100 000 on CUDA and 30 on the simulator (whose CPU
/// kernels take tens of milliseconds a step).
fn steps(dev: &Device) -> Result<u64> {
    match std::env::var("GRAPHED_SOAK_STEPS") {
        Ok(s) => s.parse().with_context(|| format!("GRAPHED_SOAK_STEPS={s} is not a step count")),
        Err(_) => Ok(if dev.kind() == DeviceKind::Cuda { 100_000 } else { 30 }),
    }
}

/// The process's resident memory, from `/proc/self/status` (`VmRSS`, in KiB).
fn rss_kib() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).context("no VmRSS in /proc/self/status")?;
    let kib = line.split_whitespace().nth(1).context("an empty VmRSS line")?;
    Ok(kib.parse()?)
}

/// What one sample saw.
#[derive(Debug, Clone, Copy)]
struct Sample {
    step: u64,
    rss_kib: u64,
    /// The allocator's bytes in segments and in blocks handed out.
    reserved: usize,
    allocated: usize,
    /// The device's free memory (`Device::memory_info`).
    free: usize,
    /// The step's loss (of every microbatch under a schedule).
    loss: f64,
}

/// When to sample: after a warm-up (a tenth of the steps, at most 1000), then ten times up to
/// the last step.
fn sample_at(step: u64, steps: u64) -> bool {
    let warmup = (steps / 10).min(1000);
    step == warmup || step == steps || (step > warmup && (step - warmup).is_multiple_of(((steps - warmup) / 10).max(1)))
}

/// Fails unless every sample after the first (the warm-up's) has the same allocator bytes, a
/// resident size at most [`RSS_SLACK_KIB`] larger and free device memory at most [`FREE_SLACK`]
/// smaller, and every loss is finite; prints them.
fn expect_flat(what: &str, samples: &[Sample]) -> Result {
    println!("{what}:");
    for s in samples {
        println!(
            "  step {:7}  rss {:8} KiB  reserved {:10} B  allocated {:10} B  free {:12} B  loss {:.6}",
            s.step, s.rss_kib, s.reserved, s.allocated, s.free, s.loss
        );
    }
    let first = samples.first().context("no samples")?;
    for s in samples {
        ensure!(s.loss.is_finite(), "{what}: the loss at step {} is {}", s.step, s.loss);
        ensure!(
            (s.reserved, s.allocated) == (first.reserved, first.allocated),
            "{what}: the allocator grew from {first:?} (after the warm-up) to {s:?}"
        );
        ensure!(
            s.rss_kib <= first.rss_kib + RSS_SLACK_KIB,
            "{what}: resident memory grew by {} KiB from step {} to step {}, more than {RSS_SLACK_KIB} KiB",
            s.rss_kib - first.rss_kib,
            first.step,
            s.step
        );
        ensure!(
            s.free + FREE_SLACK >= first.free,
            "{what}: free device memory fell by {} bytes from step {} to step {}, more than {FREE_SLACK}",
            first.free - s.free,
            first.step,
            s.step
        );
    }
    Ok(())
}

/// A stack of transformer layers (dropout on), its step counter, optimizer and inputs.
struct Model {
    s: Stream,
    alloc: CachingAllocator,
    stack: Stack<TransformerLayer>,
    step: Tensor,
    optimizer: AdamW,
    inputs: Vec<Tensor>,
}

impl Model {
    fn new(dev: &Device) -> Result<Model> {
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let c = SHAPE[2];
        let store = ParamStore::new(&alloc, &s, LAYERS * TransformerLayer::parameter_count(c))?;
        let vb = Builder::new(&store, &alloc, &s)?.with_seed(3).with_dropout(0.1, 7);
        let layers = TransformerLayer::stack(&vb, (c, HEADS), &Layers::first(LAYERS))?;
        let step = vb.step().clone();
        let optimizer = AdamW::new(&alloc, &store, AdamWHyper::default(), LrSchedule::Constant(1e-3), &s)?;
        let n: usize = SHAPE.iter().product();
        let inputs = (0..INPUTS as u64)
            .map(|k| Ok(Tensor::from_host(&alloc, &s, &common::lcg(n, 100 + k), &SHAPE)?))
            .collect::<Result<_>>()?;
        Ok(Model { s, alloc, stack: Stack::new(layers).with_rng_step(&step), step, optimizer, inputs })
    }

    /// Writes into `dy` the gradient of the loss `Σ y² / 2n` (n elements) and returns that loss
    /// when `read` (a host sync), else NaN.
    fn loss_grad(&self, dy: &Tensor, y: &Tensor, read: bool) -> graphed::Result<f64> {
        let n = y.numel() as f32;
        elementwise::scale(dy.view::<f32>()?, y.view::<f32>()?, 1.0 / n, &self.s)?;
        if !read {
            return Ok(f64::NAN);
        }
        let y = y.to_vec::<f32>(&self.s)?;
        Ok(y.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / (2.0 * f64::from(n)))
    }

    /// A sample after the work queued so far, failing if the optimizer found a non-finite
    /// gradient.
    fn sample(&self, step: u64, loss: f64) -> Result<Sample> {
        self.optimizer.check_finite(&self.s)?;
        self.s.synchronize()?;
        let (total, (free, _)) = (self.alloc.stats().total, self.alloc.device().memory_info()?);
        let (reserved, allocated) = (total.reserved, total.allocated);
        Ok(Sample { step, rss_kib: rss_kib()?, reserved, allocated, free, loss })
    }
}

/// The graphed stack with offloading, replayed on a side stream and joined, then the optimizer's
/// graph, `steps` times; with `lend`, the layers' gradients lent to the pool.
fn soak_graphed_offload(dev: &Device, lend: bool) -> Result {
    let steps = steps(dev)?;
    let model = Model::new(dev)?;
    let s = &model.s;
    let dy = Tensor::zeros(&model.alloc, s, &SHAPE, DType::F32)?;
    // Of the model's layers, only the last keeps its activations, so that most are copied.
    let offload = OffloadManager::new(&model.alloc, OffloadConfig::default().min_elements(256).margin(1))?;
    let (side, event) = (dev.stream()?, dev.event()?);
    // The capture's warmup decides what the manager offloads.
    let options = offload.graph_options(GraphOptions::default().sync_event(&event).lend_gradients(lend));
    let graph = make_graphed_stack(&model.alloc, &model.stack, &model.inputs[0], options)?;
    let summary = offload.summary().context("no offload decision after the capture")?;
    ensure!(summary.offloaded_bytes() > 0, "the manager offloads nothing");
    let optimizer = make_graphed_fn(&model.alloc, |s| model.optimizer.step(s))?;
    let mut samples = Vec::new();
    for step in 1..=steps {
        let read = sample_at(step, steps);
        let x = &model.inputs[step as usize % INPUTS];
        let y = graph.forward(s, x, Replay::side(&side))?;
        let loss = model.loss_grad(&dy, y.get()?, read)?;
        graph.backward(s, &dy)?.context("no input gradient")?;
        graph.join(s)?;
        graph.take_gradients()?;
        optimizer.replay(s)?;
        if read {
            samples.push(model.sample(step, loss)?);
        }
    }
    ensure!(model.optimizer.steps(s)? == steps, "every replay stepped the optimizer");
    expect_flat(
        if lend {
            "graphed stack, offloading on, side stream, lent gradients"
        } else {
            "graphed stack, offloading on, side stream"
        },
        &samples,
    )
}

/// The layers under interleaved 1F1B (one rank, two chunks of one layer, four microbatches),
/// one graph per (layer, microbatch), then the optimizer's graph, `steps` times.
fn soak_graphed_schedule(dev: &Device) -> Result {
    let steps = steps(dev)?;
    let model = Model::new(dev)?;
    let s = &model.s;
    let schedule = Schedule::interleaved_1f1b(1, 0, 2, 4)?;
    let m = schedule.microbatches();
    let samples: Vec<Inputs> = (0..LAYERS * m).map(|i| Inputs::one(&model.inputs[i % INPUTS])).collect();
    let callables: Vec<&dyn Callable> = model.stack.layers().iter().map(|l| l as &dyn Callable).collect();
    let options = GraphOptions::default().reuse_buffers(true);
    let graphs = make_graphed_schedule(&model.alloc, &callables, &schedule, &samples, options)?;
    let optimizer = make_graphed_fn(&model.alloc, |s| model.optimizer.step(s))?;
    let dys = (0..m).map(|_| Ok(Tensor::zeros(&model.alloc, s, &SHAPE, DType::F32)?)).collect::<Result<Vec<_>>>()?;
    let mut samples = Vec::new();
    for step in 1..=steps {
        let read = sample_at(step, steps);
        let inputs: Vec<Tensor> = (0..m).map(|j| model.inputs[(step as usize + j) % INPUTS].clone()).collect();
        let mut loss = 0.0;
        let mut head = |j: usize, y: StaticTensor| -> graphed::Result<Tensor> {
            loss += model.loss_grad(&dys[j], y.get()?, read)?;
            Ok(dys[j].clone())
        };
        graphs.run(s, &inputs, Some(&model.step), &mut head)?;
        optimizer.replay(s)?;
        if read {
            samples.push(model.sample(step, loss)?);
        }
    }
    ensure!(model.optimizer.steps(s)? == steps, "every replay stepped the optimizer");
    expect_flat("interleaved 1F1B, one graph per (layer, microbatch)", &samples)
}

/// Fails on any hazard the simulator's checker reported.
fn expect_no_hazards(dev: &Device) -> Result {
    let hazards = graphed::check::Checker::of(dev).context("the simulator is checked")?.hazards();
    ensure!(hazards.is_empty(), "{}", hazards.iter().map(|h| h.to_string()).collect::<Vec<_>>().join("\n"));
    Ok(())
}

#[test]
fn graphed_offload_side_stream_soak_sim() -> Result {
    let dev = Device::sim();
    soak_graphed_offload(&dev, false)?;
    expect_no_hazards(&dev)
}

#[test]
fn graphed_offload_lent_gradients_soak_sim() -> Result {
    let dev = Device::sim();
    soak_graphed_offload(&dev, true)?;
    expect_no_hazards(&dev)
}

#[test]
fn graphed_schedule_soak_sim() -> Result {
    let dev = Device::sim();
    soak_graphed_schedule(&dev)?;
    expect_no_hazards(&dev)
}

// On CUDA without the checker, as training runs (its host bookkeeping is not what is soaked);
// the simulator's runs are checked.
#[test]
#[ignore = "needs a CUDA GPU"]
fn graphed_offload_side_stream_soak_cuda() -> Result {
    soak_graphed_offload(&Device::cuda(0)?, false)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graphed_offload_lent_gradients_soak_cuda() -> Result {
    soak_graphed_offload(&Device::cuda(0)?, true)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn graphed_schedule_soak_cuda() -> Result {
    soak_graphed_schedule(&Device::cuda(0)?)
}
