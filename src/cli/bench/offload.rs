//! `graphed bench offload`: `bench graphs`' training step replayed on a side stream without
//! offloading (graphed-side, the baseline), with the default sites offloaded inside the graphs
//! (graphed-offload), the same captured switchable and switched to keep them on the device
//! (graphed-offload-resident, with the switch's host time), and with the automatic policy filling the whole measured window (its
//! default) and 80% of it (graphed-offload-auto, graphed-offload-auto-0.8), and under each budget
//! `--max-overhead` asks for (graphed-offload-auto-max1%, say). Per variant: the step
//! time and its overhead against the baseline, the graph pool's peak (the device memory saved,
//! against the policy's expectation) and the reserved peak (pools and cache), each pass's time
//! with its tails (the copies), and how early the caller resumes before the tails end; per
//! configuration, the pinned copy peak and the rate of the same copies captured in a graph,
//! measured in the same run.
//!
//! Every variant of a configuration is captured first and then timed in alternating rounds
//! ([`ROUNDS`]), so that a drift of the GPU's clock over the run falls on every variant alike
//! instead of on whichever ran last: an overhead of a few percent is the figure at stake.

use graphed::device::{DType, Device, DeviceKind, Event, Stream};
use graphed::graph::{GraphedStack, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::Chunk;
use graphed::offload::{OffloadConfig, OffloadManager, Policy, AUTO_CANDIDATES};
use serde::Serialize;

use super::graphs::{graphed_step, measure, Samples};
use super::{spread, write_json, Case, MemoryRow, Report, Spread};
use crate::cli::args::{BenchInput, GraphsBenchArgs, OffloadBenchArgs};
use crate::cli::bench_model::{BenchModel, Config};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Variant {
    Side,
    Listed,
    /// The listed policy captured switchable, then switched to keep every offloaded tensor
    /// resident (`OffloadManager::keep_resident`).
    Resident,
    Auto,
    AutoPartial,
    /// The automatic policy with this `max_overhead` (a share of the step).
    AutoWithin(f64),
}

impl Variant {
    fn name(self) -> String {
        match self {
            Variant::Side => "graphed-side".into(),
            Variant::Listed => "graphed-offload".into(),
            Variant::Resident => "graphed-offload-resident".into(),
            Variant::Auto => "graphed-offload-auto".into(),
            Variant::AutoPartial => "graphed-offload-auto-0.8".into(),
            // Rounded so that 7% reads `7%`, not its binary neighbour's digits.
            Variant::AutoWithin(share) => format!("graphed-offload-auto-max{}%", (1e6 * share).round() / 1e4),
        }
    }

    fn config(self) -> Option<OffloadConfig> {
        match self {
            Variant::Side => None,
            Variant::Listed => Some(OffloadConfig::default()),
            Variant::Resident => Some(OffloadConfig::default().switchable(true)),
            Variant::Auto => Some(automatic()),
            Variant::AutoPartial => Some(automatic().slack(0.8)),
            Variant::AutoWithin(share) => Some(automatic().max_overhead(share)),
        }
    }

    fn automatic(self) -> bool {
        matches!(self, Variant::Auto | Variant::AutoPartial | Variant::AutoWithin(_))
    }
}

/// The automatic policy choosing among its candidate sites, filling the whole measured window.
pub(super) fn automatic() -> OffloadConfig {
    OffloadConfig::default().policy(Policy::Auto).candidates(&AUTO_CANDIDATES)
}

/// One (configuration, variant).
#[derive(Serialize, Debug)]
struct OffloadRow {
    #[serde(flatten)]
    case: Case,
    wall_ms: Spread,
    gpu_ms: Option<Spread>,
    /// Against graphed-side's median wall time, in percent.
    overhead_pct: Option<f64>,
    /// The graph pool's peak allocated bytes.
    pool_peak_bytes: usize,
    /// graphed-side's pool peak minus this one's.
    saved_bytes: Option<i64>,
    /// graphed-side's peak reserved bytes (graph pools and cache together) minus this one's.
    reserved_saved_bytes: Option<i64>,
    /// What the frozen policy expects to save at the peak.
    expected_saving_bytes: i64,
    /// What that saving can do to the reserved peak, which moves in whole pages: the least and
    /// the most (`Summary::expected_reserved_saving`).
    expected_reserved_saving_bytes: Option<[i64; 2]>,
    /// Bytes copied out (and back) per step (kept on the device instead, for
    /// graphed-offload-resident).
    offloaded_bytes: usize,
    /// graphed-offload-resident: the switches timed before its steps.
    switch: Option<Switch>,
    /// Median over a few steps: the side stream's end of the forward (or backward) pass, tails
    /// included, minus the moment the main stream resumed after it.
    forward_lead_ms: Option<f64>,
    backward_lead_ms: Option<f64>,
    /// Median over the same steps: the forward pass from the step's start to its tails' end, and
    /// the backward from there to its tails' end.
    forward_ms: Option<f64>,
    backward_ms: Option<f64>,
    /// The policy's summary table.
    summary: Option<String>,
    /// The allocator's statistics after the timed steps: the cache's and every pool's peaks.
    memory: MemoryRow,
    /// The step's input x (`--input`).
    input: BenchInput,
}

/// The copy rates of one configuration, GB/s.
#[derive(Serialize, Debug)]
struct CopyRates {
    config: &'static str,
    /// Eager pinned copies of 64 MiB, each way: the peak.
    peak_out_gbps: f64,
    peak_in_gbps: f64,
    /// One unit's offloaded tensors copied inside a graph, each way, nothing else running.
    graph_out_gbps: f64,
    graph_in_gbps: f64,
}

#[derive(Serialize, Debug)]
struct Rows {
    variants: Vec<OffloadRow>,
    copies: Vec<CopyRates>,
}

pub fn run(offload: &OffloadBenchArgs) -> anyhow::Result<()> {
    let args = &offload.bench;
    let dev = super::open_timing_device(&args.device, "offload", "--configs tiny")?;
    let configs = args.configs(&dev)?;
    let dtype = args.dtype.resolve(&dev)?;
    let on_gpu = dev.kind() == DeviceKind::Cuda;
    let mut rows = Rows { variants: Vec::new(), copies: Vec::new() };
    for &config in &configs {
        println!("{config}, {dtype}");
        let mut built = Vec::new();
        let within = offload.max_overhead.iter().map(|&share| Variant::AutoWithin(share));
        let fixed = [Variant::Side, Variant::Listed, Variant::Resident, Variant::Auto, Variant::AutoPartial];
        for variant in fixed.into_iter().chain(within) {
            if variant.automatic() && !on_gpu {
                println!("  {:<22} skipped: the automatic policy needs the GPU's clock", variant.name());
                continue;
            }
            built.push(Built::new(&dev, (config, dtype), variant, args)?);
        }
        let mut samples: Vec<Samples> = built.iter().map(|_| Samples::default()).collect();
        for round in 0..ROUNDS {
            let steps = args.steps / ROUNDS + u32::from(round < args.steps % ROUNDS);
            let warmup = if round == 0 { args.warmup } else { 1 };
            for (b, s) in built.iter().zip(&mut samples) {
                let step = measure(&dev, &b.main, (warmup, steps), &mut || b.step())?;
                s.wall_ms.extend(step.wall_ms);
                s.host_us.extend(step.host_us);
                s.gpu_ms.extend(step.gpu_ms);
            }
        }
        let first = rows.variants.len();
        for (b, s) in built.into_iter().zip(samples) {
            let (row, rates) = b.finish((config, dtype), s, args, rows.variants.get(first))?;
            print_row(&row);
            rows.variants.push(row);
            rows.copies.extend(rates);
        }
        if let Some(r) = rows.copies.last().filter(|r| r.config == config.name) {
            println!(
                "  copies: pinned peak {:.1} GB/s out, {:.1} back; in a graph {:.1} out ({:.0}%), {:.1} back ({:.0}%)",
                r.peak_out_gbps,
                r.peak_in_gbps,
                r.graph_out_gbps,
                100.0 * r.graph_out_gbps / r.peak_out_gbps,
                r.graph_in_gbps,
                100.0 * r.graph_in_gbps / r.peak_in_gbps
            );
        }
    }
    println!("{}", crate::cli::checker_summary(&dev));
    write_json(&args.json, &Report::new("offload", &dev, args.steps, vec![rows]))
}

/// The rounds each variant's timed steps are split into, the variants taking turns; the first
/// round begins with the `--warmup` steps, each later one with one untimed step.
const ROUNDS: u32 = 4;

/// One variant of a configuration, captured and ready to time: each has an allocator of its
/// own, so that its memory statistics are its alone.
struct Built {
    variant: Variant,
    alloc: CachingAllocator,
    main: Stream,
    side: Stream,
    model: BenchModel,
    manager: Option<OffloadManager>,
    graphed: GraphedStack,
    switch: Option<Switch>,
}

/// The switches each way that graphed-offload-resident times.
const SWITCHES: usize = 100;

/// How long graphed-offload-resident switches back and forth untimed first: the host's clock
/// ramps up over the first few milliseconds of a busy core (on the H200's host the first dozen
/// switches took up to twice the later ones), and a training loop's core is busy launching.
const SWITCH_WARMUP: std::time::Duration = std::time::Duration::from_millis(50);

/// graphed-offload-resident's switches without a new capture, nothing launched between them.
#[derive(Debug, Clone, Copy, Serialize)]
struct Switch {
    /// Host µs to keep every offloaded tensor resident (median of [`SWITCHES`]).
    to_resident_us: f64,
    /// Host µs to offload them again (median of [`SWITCHES`]).
    back_us: f64,
    /// Host µs of a switch that changes nothing, every tensor already resident (median of
    /// [`SWITCHES`]): the part of a switch that does not grow with the tensors it moves.
    unchanged_us: f64,
    /// The tensors each switch moves, and their bytes.
    tensors: usize,
    bytes: usize,
}

/// Switches `graphed`'s offloaded tensors to resident and back for [`SWITCH_WARMUP`], then
/// [`SWITCHES`] times each, timed, ending resident, then asks for them resident [`SWITCHES`]
/// times more, which changes nothing.
fn time_switches(m: &OffloadManager, graphed: &GraphedStack, stream: &Stream) -> anyhow::Result<Switch> {
    // One switch: what it left resident, and its host µs.
    let switch = |resident: bool| -> graphed::Result<(graphed::offload::Resident, f64)> {
        let issued = std::time::Instant::now();
        let now = m.keep_resident(graphed.layers(), stream, |_, _| resident)?;
        Ok((now, issued.elapsed().as_secs_f64() * 1e6))
    };
    let warming = std::time::Instant::now();
    while warming.elapsed() < SWITCH_WARMUP {
        switch(true)?;
        switch(false)?;
    }
    let (mut there, mut back, mut unchanged, mut moved) = (Vec::new(), Vec::new(), Vec::new(), None);
    for i in 0..2 * SWITCHES + 1 {
        let resident = i % 2 == 0;
        let (now, us) = switch(resident)?;
        if resident {
            moved.get_or_insert(now);
        }
        if i < 2 * SWITCHES {
            if resident {
                there.push(us)
            } else {
                back.push(us)
            }
        }
    }
    for _ in 0..SWITCHES {
        unchanged.push(switch(true)?.1);
    }
    let moved = moved.unwrap_or_default();
    Ok(Switch {
        to_resident_us: spread(there).median,
        back_us: spread(back).median,
        unchanged_us: spread(unchanged).median,
        tensors: moved.tensors,
        bytes: moved.bytes,
    })
}

impl Built {
    fn new(
        dev: &Device,
        (config, dtype): (Config, DType),
        variant: Variant,
        args: &GraphsBenchArgs,
    ) -> anyhow::Result<Built> {
        let alloc = CachingAllocator::new(dev);
        let main = dev.stream()?;
        let mut model = BenchModel::new(&alloc, &main, config, dtype)?;
        model.feed(&alloc, &main, args.input)?;
        let manager = variant.config().map(|c| OffloadManager::new(&alloc, c)).transpose()?;
        let (side, event) = (dev.stream()?, dev.event()?);
        let graphed = model.graph(&alloc, Some(&event), manager.as_ref())?;
        if let Some(static_dy) = graphed.static_grad_output()? {
            static_dy.copy_from(&model.dy, &main)?;
        }
        let switch = match (variant, &manager) {
            (Variant::Resident, Some(m)) => Some(time_switches(m, &graphed, &main)?),
            _ => None,
        };
        Ok(Built { variant, alloc, main, side, model, manager, graphed, switch })
    }

    fn step(&self) -> anyhow::Result<()> {
        graphed_step(&self.graphed, &self.model, &self.main, Replay::side(&self.side))
    }

    /// The variant's row from its timed `samples`, after the pass timings and copy rates that
    /// need its graphs.
    fn finish(
        self,
        (config, dtype): (Config, DType),
        samples: Samples,
        args: &GraphsBenchArgs,
        baseline: Option<&OffloadRow>,
    ) -> anyhow::Result<(OffloadRow, Option<CopyRates>)> {
        let Built { variant, alloc, main, side, model, manager, graphed, switch } = self;
        let dev = main.device();
        let leads = match dev.kind() {
            DeviceKind::Cuda => Some(leads(dev, &graphed, &model, &main, &side)?),
            _ => None,
        };
        alloc.synchronize()?;
        let pool = graphed.pool().id();
        let stats = alloc.stats();
        let pool_peak_bytes = stats.pools.iter().find(|(id, _)| *id == pool).map_or(0, |(_, s)| s.peak_allocated);
        let summary = manager.as_ref().and_then(OffloadManager::summary);
        let wall = spread(samples.wall_ms);
        let rates = match (variant, &manager) {
            (Variant::Listed, Some(m)) if dev.kind() == DeviceKind::Cuda => Some(copy_rates(config, m, &main)?),
            _ => None,
        };
        let memory = MemoryRow::of(&stats);
        let reserved = |m: &MemoryRow| m.total.peak_reserved_bytes as i64;
        let row = OffloadRow {
            case: Case::new(config, dtype, variant.name()),
            wall_ms: wall,
            gpu_ms: (!samples.gpu_ms.is_empty()).then(|| spread(samples.gpu_ms)),
            overhead_pct: baseline.map(|b| 100.0 * (wall.median / b.wall_ms.median - 1.0)),
            pool_peak_bytes,
            saved_bytes: baseline.map(|b| b.pool_peak_bytes as i64 - pool_peak_bytes as i64),
            reserved_saved_bytes: baseline.map(|b| reserved(&b.memory) - reserved(&memory)),
            expected_saving_bytes: summary.as_ref().map_or(0, |s| s.expected_peak_saving()),
            expected_reserved_saving_bytes: (summary.as_ref())
                .and_then(|s| s.expected_reserved_saving())
                .map(|r| [*r.start(), *r.end()]),
            offloaded_bytes: summary.as_ref().map_or(0, |s| s.offloaded_bytes()),
            switch,
            forward_lead_ms: leads.as_ref().map(|l| l.forward),
            backward_lead_ms: leads.as_ref().map(|l| l.backward),
            forward_ms: leads.as_ref().map(|l| l.forward_ms),
            backward_ms: leads.as_ref().map(|l| l.backward_ms),
            summary: summary.map(|s| s.to_string()),
            memory,
            input: args.input,
        };
        Ok((row, rates))
    }
}

/// Per pass, median of 5 steps: how early the main stream resumes before the pass's tails end,
/// and how long the pass takes, tails included (from the step's start for the forward, from
/// the forward's end for the backward).
struct Leads {
    forward: f64,
    backward: f64,
    forward_ms: f64,
    backward_ms: f64,
}

fn leads(
    dev: &Device,
    graphed: &GraphedStack,
    model: &BenchModel,
    main: &Stream,
    side: &Stream,
) -> anyhow::Result<Leads> {
    let ev = || dev.timing_event();
    let (mut fwd, mut bwd, mut fwd_ms, mut bwd_ms) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let (resumed_f, tail_f, resumed_b, tail_b): (Event, Event, Event, Event) = (ev()?, ev()?, ev()?, ev()?);
        let start = ev()?;
        main.record(&start)?;
        graphed.forward(main, graphed.static_input()?, Replay::side(side))?;
        main.record(&resumed_f)?;
        side.record(&tail_f)?;
        graphed.backward(main, graphed.static_grad_output()?.unwrap_or(&model.dy))?;
        main.record(&resumed_b)?;
        side.record(&tail_b)?;
        graphed.join(main)?;
        graphed.take_gradients()?;
        main.synchronize()?;
        fwd.push(f64::from(resumed_f.elapsed_ms(&tail_f)?));
        bwd.push(f64::from(resumed_b.elapsed_ms(&tail_b)?));
        fwd_ms.push(f64::from(start.elapsed_ms(&tail_f)?));
        bwd_ms.push(f64::from(tail_f.elapsed_ms(&tail_b)?));
    }
    let median = |v: Vec<f64>| spread(v).median;
    Ok(Leads { forward: median(fwd), backward: median(bwd), forward_ms: median(fwd_ms), backward_ms: median(bwd_ms) })
}

/// The pinned peak, and the rate of the first offloaded unit's copies captured in a graph, each
/// as `m` measures them for its policy.
fn copy_rates(config: Config, m: &OffloadManager, main: &Stream) -> anyhow::Result<CopyRates> {
    let (peak_out, peak_in) = m.pinned_copy_rates(main)?;
    let layout = m.layout(Chunk::default());
    let first = layout.iter().filter(|g| g.offloaded_bytes() > 0).map(|g| g.pass).min();
    let sizes: Vec<usize> = (layout.iter())
        .filter(|g| Some(g.pass) == first)
        .flat_map(|g| g.tensors.iter().filter(|t| t.offload).map(|t| t.bytes()))
        .collect();
    let (graph_out, graph_in) = if sizes.is_empty() { (0.0, 0.0) } else { m.graph_copy_rates(main, &sizes)? };
    let gbps = |bytes_per_ms: f64| bytes_per_ms / 1e6;
    Ok(CopyRates {
        config: config.name,
        peak_out_gbps: gbps(peak_out),
        peak_in_gbps: gbps(peak_in),
        graph_out_gbps: gbps(graph_out),
        graph_in_gbps: gbps(graph_in),
    })
}

fn print_row(r: &OffloadRow) {
    let mib = |b: f64| b / (1 << 20) as f64;
    let opt = |v: Option<f64>, unit: &str| v.map_or_else(|| "-".to_string(), |v| format!("{v:.3}{unit}"));
    let saved = |b: Option<i64>| b.map_or_else(|| "-".to_string(), |b| format!("{:.1} MiB", mib(b as f64)));
    println!(
        "  {:<22} wall {:.3} ms [{:.3}–{:.3}]  overhead {}  pool peak {:.1} MiB  saved {} (expected {:.1} MiB)  \
         offloaded {:.1} MiB  reserved peak {:.1} MiB, saved {}{}  passes: fwd {} bwd {}  resumes before the tails: fwd {} bwd {}",
        r.case.variant,
        r.wall_ms.median,
        r.wall_ms.min,
        r.wall_ms.max,
        opt(r.overhead_pct, "%"),
        mib(r.pool_peak_bytes as f64),
        saved(r.saved_bytes),
        mib(r.expected_saving_bytes as f64),
        mib(r.offloaded_bytes as f64),
        mib(r.memory.total.peak_reserved_bytes as f64),
        saved(r.reserved_saved_bytes),
        r.expected_reserved_saving_bytes.map_or_else(String::new, |[lo, hi]| match lo == hi {
            true => format!(" (expected {:.1} MiB)", mib(lo as f64)),
            false => format!(" (expected {:.1} to {:.1} MiB)", mib(lo as f64), mib(hi as f64)),
        }),
        opt(r.forward_ms, " ms"),
        opt(r.backward_ms, " ms"),
        opt(r.forward_lead_ms, " ms"),
        opt(r.backward_lead_ms, " ms"),
    );
    if let Some(w) = r.switch {
        println!(
            "    switched without a new capture: {} tensors ({:.1} MiB) kept resident in {:.1} µs host, offloaded again in {:.1} µs; a switch that changes nothing {:.1} µs",
            w.tensors,
            mib(w.bytes as f64),
            w.to_resident_us,
            w.back_us,
            w.unchanged_us
        );
    }
    if let Some(s) = &r.summary {
        for line in s.lines() {
            println!("    {line}");
        }
    }
}
