//! `graphed bench schedule`: `BENCH.md`'s layers split into virtual stages and stepped under
//! interleaved 1F1B over several microbatches on one GPU (all stages local): eagerly, and as one
//! graph per (layer, microbatch) captured and replayed in the schedule's order, without and with
//! buffer reuse across microbatches (static inputs and output gradients, and the outputs and
//! input gradients shared inside each chunk). Per variant: step time, capture time and graph
//! count, static and pool memory; then what reuse took off the pool's peak.

use std::time::Instant;

use graphed::device::{DType, Device, DeviceKind};
use graphed::graph::{static_bytes, GraphOptions};
use graphed::memory::CachingAllocator;
use graphed::nn::Stage;
use graphed::tensor::Tensor;
use serde::Serialize;

use super::graphs::measure;
use super::{spread, write_json, Case, Report, Spread};
use crate::cli::args::ScheduleBenchArgs;
use crate::cli::bench_model::{BenchModel, Config};
use crate::cli::scheduled::ScheduledLayers;

#[derive(Serialize, Debug)]
struct ScheduleRow {
    #[serde(flatten)]
    case: Case,
    schedule: String,
    microbatches: usize,
    virtual_stages: usize,
    wall_ms: Spread,
    gpu_ms: Option<Spread>,
    host_us: Spread,
    /// Graphs captured (forward and backward per (layer, microbatch)); none eager.
    graphs: Option<usize>,
    capture_ms: Option<f64>,
    /// Static buffers outside the pool (inputs and output gradients), each once.
    static_bytes: Option<usize>,
    /// The graph pool's peak allocation and reservation.
    pool_peak_bytes: Option<usize>,
    pool_reserved_bytes: Option<usize>,
}

pub fn run(args: &ScheduleBenchArgs) -> anyhow::Result<()> {
    let dev = super::open_timing_device(&args.device, "schedule", "--config tiny")?;
    let on_gpu = dev.kind() == DeviceKind::Cuda;
    let config = Config::named(args.config.as_deref().unwrap_or(if on_gpu { "M" } else { "tiny" }))?
        .with_attention(args.attention);
    config.check_device(&dev, "--config")?;
    let dtype = args.dtype.resolve(&dev)?;
    let (schedule, _) = args.schedule.resolve(config.layers, Stage::single())?;
    println!("{config}, {dtype}; {schedule}");
    let mut rows = Vec::new();
    for variant in ["schedule-eager", "schedule-graphed", "schedule-graphed-reuse"] {
        let row = run_variant(&dev, (config, dtype), variant, args)?;
        print_row(&row);
        rows.push(row);
    }
    if let [eager, graphed, reuse] = &rows[..] {
        println!("  wall time: graphed/eager {:.2}x", graphed.wall_ms.median / eager.wall_ms.median);
        // Outputs shared inside each chunk (graph/output.rs) are what reuse takes off the pool.
        if let (Some(without), Some(with)) = (graphed.pool_peak_bytes, reuse.pool_peak_bytes) {
            let less = without
                .checked_sub(with)
                .map_or_else(|| format!("{} more", size(Some(with - without))), |d| format!("{} less", size(Some(d))));
            println!("  pool peak with reuse: {less} ({} against {})", size(Some(with)), size(Some(without)));
        }
    }
    println!("{}", crate::cli::checker_summary(&dev));
    write_json(&args.json, &Report::new("schedule", &dev, args.steps, rows))
}

fn run_variant(
    dev: &Device,
    (config, dtype): (Config, DType),
    variant: &'static str,
    args: &ScheduleBenchArgs,
) -> anyhow::Result<ScheduleRow> {
    let alloc = CachingAllocator::new(dev);
    let main = dev.stream()?;
    let model = BenchModel::new(&alloc, &main, config, dtype)?;
    let (schedule, per_chunk) = args.schedule.resolve(config.layers, Stage::single())?;
    let m = schedule.microbatches();
    let inputs = vec![model.x.clone(); m];
    let layers = model.stack.layers();
    let mut head = |_: usize, _: Tensor| Ok(model.dy.clone());
    let began = Instant::now();
    let capture =
        (variant != "schedule-eager").then(|| GraphOptions::default().reuse_buffers(variant.ends_with("reuse")));
    let captured = capture.is_some();
    let scheduled = ScheduledLayers::new(&alloc, layers, (schedule, per_chunk), &model.x, capture)?;
    let capture_ms = captured.then(|| began.elapsed().as_secs_f64() * 1e3);
    let mut step = || -> anyhow::Result<()> {
        scheduled.run(layers, &main, &inputs, None, &mut head, None)?;
        Ok(())
    };
    let samples = measure(dev, &main, (args.warmup, args.steps), &mut step)?;
    alloc.synchronize()?;
    let (schedule, graphed) = (&scheduled.schedule, &scheduled.graphed);
    let pool = graphed.as_ref().and_then(|g| g.callables().first()).map(|c| c.pool().id());
    let stats = alloc.stats();
    let pool_stats = pool.and_then(|p| stats.pools.iter().find(|(id, _)| *id == p)).map(|(_, s)| *s);
    Ok(ScheduleRow {
        case: Case::new(config, dtype, variant),
        schedule: schedule.to_string(),
        microbatches: m,
        virtual_stages: schedule.chunks(),
        wall_ms: spread(samples.wall_ms),
        gpu_ms: (!samples.gpu_ms.is_empty()).then(|| spread(samples.gpu_ms)),
        host_us: spread(samples.host_us),
        graphs: graphed.as_ref().map(|g| g.callables().iter().map(|c| c.graphs().len()).sum()),
        capture_ms,
        static_bytes: graphed.as_ref().map(|g| static_bytes(g.callables())),
        pool_peak_bytes: pool_stats.map(|s| s.peak_allocated),
        pool_reserved_bytes: pool_stats.map(|s| s.reserved),
    })
}

/// Bytes in MiB, or in KiB below one MiB (the simulator's small configurations); `-` for none.
fn size(bytes: Option<usize>) -> String {
    match bytes {
        None => "-".to_string(),
        Some(b) if b < 1 << 20 => format!("{:.1} KiB", b as f64 / 1024.0),
        Some(b) => format!("{:.1} MiB", b as f64 / (1 << 20) as f64),
    }
}

fn print_row(r: &ScheduleRow) {
    let mib = size;
    println!(
        "  {:<24} wall {:.3} ms [{:.3}–{:.3}]  host {:.0} µs  graphs {}  capture {}  static {}  pool peak {}  pool reserved {}",
        r.case.variant,
        r.wall_ms.median,
        r.wall_ms.min,
        r.wall_ms.max,
        r.host_us.median,
        r.graphs.map_or_else(|| "-".to_string(), |n| n.to_string()),
        r.capture_ms.map_or_else(|| "-".to_string(), |v| format!("{v:.0} ms")),
        mib(r.static_bytes),
        mib(r.pool_peak_bytes),
        mib(r.pool_reserved_bytes),
    );
}
