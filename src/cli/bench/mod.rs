//! `graphed bench`: benchmarks whose results go to `bench/results/`.

mod alloc;
mod attention;
mod check;
mod gemm;
mod graphs;
mod launch;
mod layer;
mod memory;
mod offload;
mod parallel;
mod parity;
mod pipeline;
mod rebind;
mod schedule;

use std::path::PathBuf;

use graphed::device::Device;
use serde::Serialize;

use super::args::{BenchArgs, BenchCommand};

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    // Checked before anything runs, so that minutes of timing are not lost to an unwritable path.
    if let Some((flag, path)) = args.which.output() {
        super::train::outputs::writable_file(flag, path)?;
    }
    match &args.which {
        BenchCommand::Launch(a) => launch::run(a),
        BenchCommand::Alloc(a) => alloc::run(a),
        BenchCommand::Check(a) => check::run(a),
        BenchCommand::Gemm(a) => gemm::run(a),
        BenchCommand::Attention(a) => attention::run(a),
        BenchCommand::Layer(a) => layer::run(a),
        BenchCommand::Graphs(a) => graphs::run(a),
        BenchCommand::Offload(a) => offload::run(a),
        BenchCommand::Memory(a) => memory::run(a),
        BenchCommand::Schedule(a) => schedule::run(a),
        BenchCommand::Parallel(a) => parallel::run(a),
        BenchCommand::Parity(a) => parity::run(a),
        BenchCommand::Rebind(a) => rebind::run(a),
    }
}

/// The device of a benchmark that times GPU work: refused on the simulator unless asked for by
/// name (`--device sim`, a smoke test with `smoke`, the flag of its smallest configuration).
fn open_timing_device(args: &super::args::DeviceArgs, bench: &str, smoke: &str) -> anyhow::Result<Device> {
    let dev = super::open_device(args)?;
    if dev.kind() != graphed::device::DeviceKind::Cuda && args.device != super::args::DeviceChoice::Sim {
        anyhow::bail!(
            "bench {bench} times GPU work; run it on a CUDA device (or smoke-test it with `--device sim {smoke}`)"
        );
    }
    Ok(dev)
}

/// A benchmark's results with what identifies the run: date, device, commit.
#[derive(Serialize, Debug)]
struct Report<R: Serialize> {
    bench: &'static str,
    date: String,
    device: String,
    commit: &'static str,
    reps: u32,
    rows: Vec<R>,
}

impl<R: Serialize> Report<R> {
    fn new(bench: &'static str, dev: &Device, reps: u32, rows: Vec<R>) -> Report<R> {
        Report {
            bench,
            date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            device: dev.name(),
            commit: env!("GRAPHED_COMMIT"),
            reps,
            rows,
        }
    }
}

fn write_json<R: Serialize>(path: &Option<PathBuf>, report: &Report<R>) -> anyhow::Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(report)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn median(v: Vec<f64>) -> f64 {
    spread(v).median
}

/// Which step a row of `bench graphs` or `bench offload` measured: the configuration, the
/// element type and the variant.
#[derive(Serialize, Debug)]
struct Case {
    config: &'static str,
    dim: usize,
    layers: usize,
    batch: usize,
    seq: usize,
    dtype: String,
    /// `fused` or `unfused`.
    attention: &'static str,
    /// What the backward recomputed (`--recompute`), when anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    recompute: Option<&'static str>,
    /// Whether the graphed stack's layers lent their gradients to its pool (`--lend-gradients`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    lend_gradients: bool,
    /// cuDNN's attention backward scratch limit in every layer (`--scratch-limit-mib`), if set.
    #[serde(skip_serializing_if = "Option::is_none")]
    scratch_limit_mib: Option<usize>,
    variant: String,
}

impl Case {
    fn new(config: crate::cli::bench_model::Config, dtype: impl std::fmt::Display, variant: impl Into<String>) -> Case {
        let crate::cli::bench_model::Config {
            name,
            dim,
            layers,
            batch,
            seq,
            attention,
            recompute,
            lend_gradients,
            scratch_limit,
            ..
        } = config;
        let recompute = (recompute != graphed::nn::Recompute::Nothing).then(|| recompute.name());
        let (dtype, attention) = (dtype.to_string(), attention.name());
        let scratch_limit_mib = scratch_limit.map(|bytes| bytes >> 20);
        Case {
            config: name,
            dim,
            layers,
            batch,
            seq,
            dtype,
            attention,
            recompute,
            lend_gradients,
            scratch_limit_mib,
            variant: variant.into(),
        }
    }
}

/// One arena's byte counts (`graphed::memory::Stats`) in a row of results.
#[derive(Serialize, Debug)]
struct StatsRow {
    /// The graph pool; none for the cache outside pools and for the total.
    #[serde(skip_serializing_if = "Option::is_none")]
    pool: Option<String>,
    allocated_bytes: usize,
    reserved_bytes: usize,
    peak_allocated_bytes: usize,
    peak_reserved_bytes: usize,
    largest_free_bytes: usize,
    /// Bytes of lent memory in use (the gradients a graphed stack's layers lend its pool),
    /// counted in the cache's allocated bytes, not here.
    #[serde(skip_serializing_if = "is_zero")]
    lent_bytes: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl StatsRow {
    fn of(pool: Option<String>, s: &graphed::memory::Stats) -> StatsRow {
        StatsRow {
            pool,
            allocated_bytes: s.allocated,
            reserved_bytes: s.reserved,
            peak_allocated_bytes: s.peak_allocated,
            peak_reserved_bytes: s.peak_reserved,
            largest_free_bytes: s.largest_free,
            lent_bytes: s.lent,
        }
    }
}

/// The allocator's statistics at the end of a variant: whether its segments were expandable,
/// the total (whose peaks are those of the sum), the cache outside pools and each graph pool.
#[derive(Serialize, Debug)]
struct MemoryRow {
    expandable: bool,
    total: StatsRow,
    cache: StatsRow,
    pools: Vec<StatsRow>,
}

impl MemoryRow {
    fn of(stats: &graphed::memory::MemoryStats) -> MemoryRow {
        MemoryRow {
            expandable: stats.expandable,
            total: StatsRow::of(None, &stats.total),
            cache: StatsRow::of(None, &stats.default),
            pools: stats.pools.iter().map(|(id, s)| StatsRow::of(Some(id.to_string()), s)).collect(),
        }
    }
}

/// The median and range of some samples.
#[derive(Serialize, Debug, Clone, Copy)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

/// The median and range of `v`, which must not be empty.
fn spread(mut v: Vec<f64>) -> Spread {
    v.sort_by(f64::total_cmp);
    Spread { median: v[v.len() / 2], min: v[0], max: v[v.len() - 1] }
}
