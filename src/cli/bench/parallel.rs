//! `graphed bench parallel`: data and pipeline parallelism over the GPUs of `graphed launch
//! --gpus N -- bench parallel` (one process per GPU). Per configuration: `one-gpu`, each GPU
//! stepping its own copy alone (graphed, side-stream replay); `dp-eager`, eager steps with every
//! gradient reduced after the backward; `dp-graphed-layer`, graphed steps with each layer's
//! gradients reduced whole inside the next backward graph; `dp-graphed`, the same with each
//! layer's MLP half reduced during its own attention backward (`Module::backward_hooked`);
//! `dp-reduction-graphs`, each layer's gradients reduced whole in a graph of its own on the
//! communication stream, after a typed edge from its backward (`dist::ReductionGraphs`); then
//! the pipeline variants of `pipeline.rs` over `--microbatches` (exchanges on the compute
//! stream, or overlapping it), with their bubbles (with two ranks or more), and each one's
//! stages timed alone (`-alone`: as many stages as ranks, two on
//! one GPU), whose slowest stage bounds the pipeline without exchanges or waits. Throughput
//! counts every rank's samples (an `-alone` row: the stages' as if each had its GPU); the
//! speedup is over `one-gpu`. Rank 0 reports.

use std::sync::Arc;

use graphed::device::{Communicator, DType, Device};
use graphed::dist::{DataParallel, ProcessGroup, RankEnv, ReductionGraphs};
use graphed::graph::{GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Module, Stage};
use serde::Serialize;

use super::graphs::{measure, Samples};
use super::pipeline::{self, Peers};
use super::{spread, write_json, Case, Report, Spread};
use crate::cli::args::ParallelBenchArgs;
use crate::cli::bench_model::{BenchModel, Config};

#[derive(Serialize, Debug)]
struct ParallelRow {
    #[serde(flatten)]
    case: Case,
    /// GPUs stepping; for an `-alone` row, the pipeline's stages (timed one after another).
    ranks: usize,
    wall_ms: Spread,
    host_us: Spread,
    /// Samples per second over every rank.
    samples_per_s: f64,
    /// Over `one-gpu` of the same configuration.
    speedup: Option<f64>,
    /// Pipeline variants: microbatches per step.
    #[serde(skip_serializing_if = "Option::is_none")]
    microbatches: Option<usize>,
    /// Pipeline variants: the measured bubble (see `pipeline::measured_bubble`); for an `-alone`
    /// row, the part of it that splitting the model costs before any exchange or wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    bubble: Option<f64>,
    /// Pipeline variants: the schedule's bubble (see `pipeline::theoretical_bubble`).
    #[serde(skip_serializing_if = "Option::is_none")]
    bubble_theory: Option<f64>,
}

/// Times every configuration of `args`, data parallel then pipelined, on this rank's GPU.
pub fn run(args: &ParallelBenchArgs) -> anyhow::Result<()> {
    let (mut bench, configs) = ParallelBench::setup(args)?;
    for config in configs {
        let one_gpu_ms = bench.data_parallel(config)?;
        bench.pipelines(config, one_gpu_ms)?;
    }
    bench.finish()
}

/// `one-gpu`, the speedups' base, then the data parallel variants, each reducing the gradients
/// its own way (see the module's doc).
const DATA_PARALLEL: [&str; 5] = ["one-gpu", "dp-eager", "dp-graphed-layer", "dp-graphed", "dp-reduction-graphs"];

/// A `bench parallel` run on this rank's GPU: its group, and the rows measured so far.
struct ParallelBench<'a> {
    args: &'a ParallelBenchArgs,
    dev: Device,
    dtype: DType,
    group: Option<ProcessGroup>,
    /// The group's size; 1 without one.
    ranks: usize,
    /// Rank 0, or the only process: the one that prints and writes the results.
    lead: bool,
    rows: Vec<ParallelRow>,
}

impl<'a> ParallelBench<'a> {
    /// Opens this rank's GPU, refuses configurations it cannot run, and joins the group (if
    /// launched as one rank of several); the run and its configurations.
    fn setup(args: &'a ParallelBenchArgs) -> anyhow::Result<(ParallelBench<'a>, Vec<Config>)> {
        let env = RankEnv::from_env()?;
        let local = env.as_ref().map_or(0, |e| e.local_rank);
        let dev = Device::cuda(local).map_err(|e| anyhow::anyhow!("bench parallel times GPUs: {e}"))?;
        let dtype = args.dtype.resolve(&dev)?;
        let configs = args.configs.iter().map(|n| Ok(Config::named(n)?.with_attention(args.attention)));
        let configs = configs.collect::<anyhow::Result<Vec<_>>>()?;
        for c in &configs {
            c.check_device(&dev, "--configs")?;
        }
        // Every rank must issue the same collectives: the same configurations, steps and microbatches.
        let signature = format!(
            "bench parallel {:?} {dtype}; {} steps after {} warmup; {} microbatches",
            args.configs, args.steps, args.warmup, args.microbatches
        );
        let group = crate::cli::group::join(&dev, env, &signature, graphed::device::CommOptions::default())?;
        let ranks = group.as_ref().map_or(1, |g| g.env().world);
        let lead = group.as_ref().is_none_or(|g| g.env().rank == 0);
        if lead {
            println!("{ranks} rank(s), {dtype}");
        }
        Ok((ParallelBench { args, dev, dtype, group, ranks, lead, rows: Vec::new() }, configs))
    }

    /// The `one-gpu` and data parallel rows of `config` (the latter in a group only); the one-GPU
    /// step's median in ms: its throughput is the speedups' base, its time T₁ the bubbles'.
    fn data_parallel(&mut self, config: Config) -> anyhow::Result<Option<f64>> {
        let mut one_gpu_ms: Option<f64> = None;
        for variant in DATA_PARALLEL {
            let comm = match (variant, &self.group) {
                ("one-gpu", _) => None,
                (_, Some(g)) => Some(g.comm()),
                (_, None) => continue,
            };
            let samples = self.time_step(config, variant, comm)?;
            let wall = spread(samples.wall_ms);
            let used = if comm.is_some() { self.ranks } else { 1 };
            let samples_per_s = rate(used * config.batch, wall.median);
            let speedup = one_gpu_ms.map(|t| samples_per_s / rate(config.batch, t));
            if variant == "one-gpu" {
                one_gpu_ms = Some(wall.median);
            }
            self.push(ParallelRow {
                case: Case::new(config, self.dtype, variant),
                ranks: used,
                wall_ms: wall,
                host_us: spread(samples.host_us),
                samples_per_s,
                speedup,
                microbatches: None,
                bubble: None,
                bubble_theory: None,
            });
        }
        Ok(one_gpu_ms)
    }

    /// Times a step of `config` as `variant` runs it: eager steps with every gradient reduced
    /// after the backward (`dp-eager`), else graphed steps replayed on a side stream, whose
    /// gradients `comm` reduces inside the backward graphs or on graphs of their own
    /// (`dp-reduction-graphs`; none for `one-gpu`).
    fn time_step(&self, config: Config, variant: &str, comm: Option<&Communicator>) -> anyhow::Result<Samples> {
        let (dev, timing) = (&self.dev, (self.args.warmup, self.args.steps));
        let alloc = CachingAllocator::new(dev);
        let main = dev.stream()?;
        let model = BenchModel::new(&alloc, &main, config, self.dtype)?;
        if let ("dp-eager", Some(c)) = (variant, comm) {
            let dp = DataParallel::new(c, Vec::new())?;
            let grads = model.store.grads()?;
            return measure(dev, &main, timing, &mut || {
                model.eager_step(&main)?;
                dp.all_reduce(&main, &grads)?;
                Ok(())
            });
        }
        let (side, ready) = (dev.stream()?, dev.event()?);
        let mut options = GraphOptions::default().sync_event(&ready);
        let mut own = None;
        match comm {
            Some(c) if variant == "dp-reduction-graphs" => {
                let graphs = ReductionGraphs::capture(&alloc, reduction(c, &model, variant)?)?;
                options = graphs.signalled(options);
                own = Some(graphs);
            }
            Some(c) => options = options.grad_sync(reduction(c, &model, variant)?),
            None => {}
        }
        let graphed = model.graph_with(&alloc, options)?;
        measure(dev, &main, timing, &mut || {
            graphed.forward(&main, &model.x, Replay::side(&side))?;
            graphed.backward(&main, &model.dy)?;
            if let Some(graphs) = &own {
                graphs.replay(&main)?;
            }
            graphed.join(&main)?;
            Ok(())
        })
    }

    /// The pipeline rows of `config`, each variant's printed as it is timed; `one_gpu_ms` gives
    /// their speedups and bubbles.
    fn pipelines(&mut self, config: Config, one_gpu_ms: Option<f64>) -> anyhow::Result<()> {
        for variant in &pipeline::VARIANTS {
            for row in self.pipeline(config, variant, one_gpu_ms)? {
                self.push(row);
            }
        }
        Ok(())
    }

    /// The rows of `variant` of `config`: a pipeline of a stage per rank (two ranks or more),
    /// then its stages alone, one after another on this GPU (as many as the ranks; two on one
    /// GPU); none when the layers do not split into the variant's chunks.
    fn pipeline(
        &self,
        config: Config,
        variant: &pipeline::Variant,
        one_gpu_ms: Option<f64>,
    ) -> anyhow::Result<Vec<ParallelRow>> {
        let comm = self.group.as_ref().map(|g| g.comm()).filter(|c| c.size() > 1);
        let stages = comm.map_or(2, Communicator::size);
        let (model, m, timing) = ((config, self.dtype), self.args.microbatches, (self.args.warmup, self.args.steps));
        let mut timed: Vec<(&'static str, Samples, Option<f64>)> = Vec::new();
        if let Some(c) = comm {
            let Some(samples) = pipeline::time_variant(&self.dev, Peers::Ranks(c), model, variant, m, timing)? else {
                unsplit(self.lead, config, variant, stages);
                return Ok(Vec::new());
            };
            timed.push((variant.name, samples, Some(pipeline::theoretical_bubble(stages, variant.chunks, m))));
        }
        if let Some(name) = variant.alone {
            let Some(samples) = slowest_alone(&self.dev, model, variant, stages, m, timing)? else {
                unsplit(self.lead, config, variant, stages);
                return Ok(Vec::new());
            };
            timed.push((name, samples, None));
        }
        Ok(timed.into_iter().map(|t| pipeline_row(t, model, stages, m, one_gpu_ms)).collect())
    }

    /// Keeps `row`, printed on the lead rank.
    fn push(&mut self, row: ParallelRow) {
        if self.lead {
            print_row(&row);
        }
        self.rows.push(row);
    }

    /// Leaves the group, the timing over (a peer that ends from here on no longer concerns this
    /// rank), and writes the results on the lead rank.
    fn finish(self) -> anyhow::Result<()> {
        crate::cli::group::leave(self.group);
        if self.lead {
            println!("{}", crate::cli::checker_summary(&self.dev));
            write_json(&self.args.json, &Report::new("parallel", &self.dev, self.args.steps, self.rows))?;
        }
        Ok(())
    }
}

/// The gradient reduction of a graphed `variant` over `comm`: each layer's gradients whole
/// (`dp-graphed-layer` inside the next backward graph, `dp-reduction-graphs` on a graph of their
/// own), or each layer's MLP half during its own attention backward (`dp-graphed`,
/// `Module::backward_hooked`).
fn reduction(comm: &Communicator, model: &BenchModel, variant: &str) -> anyhow::Result<Arc<DataParallel>> {
    Ok(match variant {
        "dp-graphed-layer" | "dp-reduction-graphs" => {
            let layers = model.stack.layers().iter();
            let buckets = layers.map(|l| model.store.grads_of(&l.parameters()));
            DataParallel::new(comm, buckets.collect::<graphed::Result<_>>()?)?
        }
        _ => DataParallel::for_stack(comm, &model.store, &model.stack)?,
    })
}

/// The row of a pipeline variant `name` of `stages` over `m` microbatches timed as `samples`
/// (`bubble_theory`: the schedule's bubble, for a pipeline across ranks).
fn pipeline_row(
    (name, samples, bubble_theory): (&'static str, Samples, Option<f64>),
    (config, dtype): (Config, DType),
    stages: usize,
    m: usize,
    one_gpu_ms: Option<f64>,
) -> ParallelRow {
    let wall = spread(samples.wall_ms);
    let samples_per_s = rate(m * config.batch, wall.median);
    ParallelRow {
        case: Case::new(config, dtype, name),
        ranks: stages,
        host_us: spread(samples.host_us),
        samples_per_s,
        speedup: one_gpu_ms.map(|t| samples_per_s / rate(config.batch, t)),
        microbatches: Some(m),
        bubble: one_gpu_ms.map(|t1| pipeline::measured_bubble(t1, stages, m, wall.median)),
        bubble_theory,
        wall_ms: wall,
    }
}

/// Each of `variant`'s `stages` timed alone on `dev`, one after another: the slowest stage's
/// samples, which bound the pipeline without exchanges or waits; `None` when the layers do not
/// split into the stages' chunks.
fn slowest_alone(
    dev: &Device,
    model: (Config, DType),
    variant: &pipeline::Variant,
    stages: usize,
    m: usize,
    timing: (u32, u32),
) -> anyhow::Result<Option<Samples>> {
    let mut slowest: Option<(f64, Samples)> = None;
    for s in 0..stages {
        let Some(samples) =
            pipeline::time_variant(dev, Peers::Alone(Stage::new(s, stages)?), model, variant, m, timing)?
        else {
            return Ok(None);
        };
        let median = spread(samples.wall_ms.clone()).median;
        if slowest.as_ref().is_none_or(|(t, _)| *t < median) {
            slowest = Some((median, samples));
        }
    }
    Ok(slowest.map(|(_, samples)| samples))
}

/// Samples per second of `samples` in a step of `ms`.
fn rate(samples: usize, ms: f64) -> f64 {
    samples as f64 / (ms / 1e3)
}

/// Says (on the lead rank) that `variant` cannot run: the layers do not split into its chunks.
fn unsplit(lead: bool, config: Config, variant: &pipeline::Variant, stages: usize) {
    if lead {
        println!(
            "  {} {}: {} layers do not split into {} stages × {} chunks",
            config.name, variant.name, config.layers, stages, variant.chunks
        );
    }
}

fn print_row(r: &ParallelRow) {
    let bubble = match (r.bubble, r.bubble_theory) {
        (Some(b), Some(t)) => format!("  bubble {:.1}% (schedule {:.1}%)", 100.0 * b, 100.0 * t),
        (Some(b), None) => format!("  bubble {:.1}% (the split alone)", 100.0 * b),
        (None, _) => String::new(),
    };
    println!(
        "  {} {:<28} ranks {}  wall {:.3} ms [{:.3}–{:.3}]  host {:.0} µs  {:.0} samples/s{}{bubble}",
        r.case.config,
        r.case.variant,
        r.ranks,
        r.wall_ms.median,
        r.wall_ms.min,
        r.wall_ms.max,
        r.host_us.median,
        r.samples_per_s,
        r.speedup.map_or_else(String::new, |s| format!("  {s:.2}x one GPU")),
    );
}
