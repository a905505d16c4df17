//! `graphed bench memory`: how much model fits a device-memory budget. For a configuration's
//! width and sequence length, the largest batch (its layer count kept) and the largest layer
//! count (its batch kept) whose graphed training step (`bench graphs`' step) reserves at most the
//! budget at its peak, graph pools and cache together, each with its step time: graphed alone,
//! with the default sites offloaded and with the automatic offload policy.
//!
//! Each probe builds, captures and times a fresh model on a fresh allocator, so its peak is its
//! own. A step's peak grows nearly affinely with the batch and with the layers, so a secant
//! through the last two probes guesses the boundary and a bracket (largest size that fits,
//! smallest that does not) closes on it: four or five probes per search where the estimate is
//! good. `bench/torch_reference.py memory` searches PyTorch's side the same way.

use graphed::device::{DType, Device, DeviceKind};
use graphed::memory::CachingAllocator;
use graphed::nn::Recompute;
use graphed::offload::{OffloadConfig, OffloadManager};
use serde::Serialize;

use super::graphs::time_graphed;
use super::{spread, write_json, Case, Report};
use crate::cli::args::{MemoryBenchArgs, MemorySearch, MemoryVariant};
use crate::cli::bench_model::{BenchModel, Config};

impl MemoryVariant {
    /// Its name in results, as `--variants` takes it.
    fn name(self) -> &'static str {
        match self {
            MemoryVariant::Graphed => "graphed",
            MemoryVariant::GraphedOffload => "graphed-offload",
            MemoryVariant::GraphedOffloadAuto => "graphed-offload-auto",
            MemoryVariant::GraphedRecompute => "graphed-recompute",
            MemoryVariant::GraphedRecomputeOffloadAuto => "graphed-recompute-offload-auto",
        }
    }

    /// What its layers' backward recomputes.
    fn recompute(self) -> Recompute {
        match self {
            MemoryVariant::GraphedRecompute | MemoryVariant::GraphedRecomputeOffloadAuto => Recompute::Gelu,
            _ => Recompute::Nothing,
        }
    }

    /// Its offloading: none (per-layer graphs on the caller's stream), the default sites, or the
    /// automatic policy (both replayed on a side stream).
    fn offload(self) -> Option<OffloadConfig> {
        match self {
            MemoryVariant::Graphed | MemoryVariant::GraphedRecompute => None,
            MemoryVariant::GraphedOffload => Some(OffloadConfig::default()),
            MemoryVariant::GraphedOffloadAuto | MemoryVariant::GraphedRecomputeOffloadAuto => {
                Some(super::offload::automatic())
            }
        }
    }
}

impl MemorySearch {
    /// Its name in results, as `--search` takes it.
    fn name(self) -> &'static str {
        match self {
            MemorySearch::Batch => "batch",
            MemorySearch::Layers => "layers",
        }
    }
}

/// One probed size.
#[derive(Serialize, Debug, Clone, Copy)]
struct Probe {
    /// The batch or the layer count probed.
    size: usize,
    /// Whether its peak reserved bytes are within the budget.
    fits: bool,
    peak_reserved_bytes: usize,
    peak_allocated_bytes: usize,
    /// The same peaks of the cache outside graph pools, and of the graph pools (the sum of each
    /// pool's): where the reserved bytes beyond the allocated ones are.
    cache_peak_reserved_bytes: usize,
    cache_peak_allocated_bytes: usize,
    pools_peak_reserved_bytes: usize,
    pools_peak_allocated_bytes: usize,
    /// Median wall time of a step.
    wall_ms: f64,
    /// Bytes copied to host memory per step.
    offloaded_bytes: usize,
}

/// One search: a variant, what was searched, and the largest size that fits.
#[derive(Serialize, Debug)]
struct SearchRow {
    /// The configuration at the largest size that fits (at the base configuration when none
    /// does).
    #[serde(flatten)]
    case: Case,
    search: &'static str,
    budget_bytes: usize,
    /// The largest batch or layer count that fits; none when not even one does.
    largest: Option<usize>,
    /// The probe at `largest`.
    at_largest: Option<Probe>,
    /// Step time per sequence (batch search) or per layer (layer search) at `largest`.
    ms_per_unit: Option<f64>,
    /// Every probe, in the order run.
    probes: Vec<Probe>,
}

pub fn run(args: &MemoryBenchArgs) -> anyhow::Result<()> {
    let dev = super::open_timing_device(&args.device, "memory", "--config tiny")?;
    let config = (Config::named(&args.config)?.with_attention(args.attention))
        .with_lending(args.lend.lend_gradients)
        .with_scratch_limit(args.scratch.bytes());
    config.check_device(&dev, "--config")?;
    let dtype = args.dtype.resolve(&dev)?;
    let (free, _) = dev.memory_info()?;
    anyhow::ensure!(
        args.budget <= free,
        "--budget {} is more than the device's free memory ({}): a probe could run out of memory; lower the budget",
        gib(args.budget),
        gib(free)
    );
    println!("{config}, {dtype}; budget {} of peak reserved memory", gib(args.budget));
    let mut rows = Vec::new();
    for &variant in &args.variants {
        let automatic =
            matches!(variant, MemoryVariant::GraphedOffloadAuto | MemoryVariant::GraphedRecomputeOffloadAuto);
        if automatic && dev.kind() != DeviceKind::Cuda {
            println!("  {:<22} skipped: the automatic policy needs the GPU's clock", variant.name());
            continue;
        }
        for &search in &args.search {
            let row = search_variant(&dev, (config, dtype), variant, search, args)?;
            print_row(&row);
            rows.push(row);
            // Written after every search, so that a run stopped midway keeps what it found.
            write_json(&args.json, &Report::new("memory", &dev, args.steps, rows.iter().collect()))?;
        }
    }
    print_ratios(&rows);
    println!("{}", crate::cli::checker_summary(&dev));
    Ok(())
}

/// The largest size of `search` that fits the budget, for `variant`.
fn search_variant(
    dev: &Device,
    (config, dtype): (Config, DType),
    variant: MemoryVariant,
    search: MemorySearch,
    args: &MemoryBenchArgs,
) -> anyhow::Result<SearchRow> {
    let sized = |n: usize| match search {
        MemorySearch::Batch => Config { batch: n, ..config },
        MemorySearch::Layers => Config { layers: n, ..config },
    };
    let (free, _) = dev.memory_info()?;
    let probes = largest_fitting(args.budget, free, &mut |n| {
        let p = probe(dev, (sized(n), dtype, n), variant, (args.warmup, args.steps), args.budget)?;
        println!(
            "    {} {:<6} {n:>5}: peak reserved {} ({}), {:.3} ms; peak allocated {}; cache {} reserved, {} allocated; \
             pools {} reserved, {} allocated",
            variant.name(),
            search.name(),
            gib(p.peak_reserved_bytes),
            if p.fits { "fits" } else { "over" },
            p.wall_ms,
            gib(p.peak_allocated_bytes),
            gib(p.cache_peak_reserved_bytes),
            gib(p.cache_peak_allocated_bytes),
            gib(p.pools_peak_reserved_bytes),
            gib(p.pools_peak_allocated_bytes),
        );
        Ok(p)
    })?;
    let at_largest = probes.iter().filter(|p| p.fits).max_by_key(|p| p.size).copied();
    let largest = at_largest.map(|p| p.size);
    Ok(SearchRow {
        case: Case::new(largest.map_or(config, sized), dtype, variant.name()),
        search: search.name(),
        budget_bytes: args.budget,
        largest,
        at_largest,
        ms_per_unit: at_largest.map(|p| p.wall_ms / p.size as f64),
        probes,
    })
}

/// The largest batch or layer count a search probes.
const MAX_SIZE: usize = 1 << 16;

/// Probes sizes from 1 up until the largest whose peak fits `budget` is followed by two sizes
/// that do not, and returns every probe. The second is probed because the reserved peak need not
/// grow with the size: a larger block (cuDNN's scratch, whose executions take a divisor of the
/// batch) can leave more memory unusable at one size than at the next. The next size is the
/// secant's guess through the last two probes, kept strictly inside the bracket and, while no
/// probe has failed, below the size the guess expects to reserve `limit` (the device's free
/// memory), so that no probe runs out.
fn largest_fitting(
    budget: usize,
    limit: usize,
    probe: &mut dyn FnMut(usize) -> anyhow::Result<Probe>,
) -> anyhow::Result<Vec<Probe>> {
    let mut probes: Vec<Probe> = Vec::new();
    let mut next = 1;
    loop {
        probes.push(probe(next)?);
        let fits = probes.iter().filter(|p| p.fits).map(|p| p.size).max().unwrap_or(0);
        let over = |size: usize| probes.iter().any(|p| p.size == size && !p.fits);
        // The smallest size above the largest that fits that does not.
        let above = probes.iter().filter(|p| !p.fits && p.size > fits).map(|p| p.size).min();
        let confirmed = over(fits + 1) && (over(fits + 2) || fits + 2 > MAX_SIZE);
        if fits == 0 && above.is_some() || confirmed || fits >= MAX_SIZE {
            return Ok(probes);
        }
        if above == Some(fits + 1) {
            next = fits + 2;
            continue;
        }
        let guess = |target: usize| secant(&probes, target);
        // A flat line (reserved memory grows in segments) says nothing: double instead.
        let mut n = guess(budget).unwrap_or(2 * fits).max(fits + 1);
        match above {
            Some(o) => n = n.min(o - 1),
            None => {
                let safe = guess(limit).unwrap_or(usize::MAX);
                anyhow::ensure!(
                    safe > fits,
                    "size {} would exceed the device's free memory before the budget is reached",
                    fits + 1
                );
                n = n.min(safe);
            }
        }
        next = n.min(MAX_SIZE);
    }
}

/// The size at which the line through the last two probes of different sizes reaches `target`
/// bytes (rounded down); none with fewer than two sizes or a line that does not rise. The line
/// is drawn through the allocated peaks, which grow smoothly, and the reserved one's excess at
/// the last probe is added to it.
fn secant(probes: &[Probe], target: usize) -> Option<usize> {
    let last = probes.last()?;
    let other = probes.iter().rev().find(|p| p.size != last.size)?;
    let (x0, y0, x1, y1) =
        (other.size as f64, other.peak_allocated_bytes as f64, last.size as f64, last.peak_allocated_bytes as f64);
    let slope = (y1 - y0) / (x1 - x0);
    let excess = last.peak_reserved_bytes.saturating_sub(last.peak_allocated_bytes) as f64;
    (slope > 0.0).then(|| (x1 + (target as f64 - excess - y1) / slope).floor().max(1.0) as usize)
}

/// One size: a fresh allocator and model, graphed (with `variant`'s offloading), timed.
fn probe(
    dev: &Device,
    (config, dtype, size): (Config, DType, usize),
    variant: MemoryVariant,
    (warmup, steps): (u32, u32),
    budget: usize,
) -> anyhow::Result<Probe> {
    let alloc = CachingAllocator::new(dev);
    let main = dev.stream()?;
    let model = BenchModel::new(&alloc, &main, config.with_recompute(variant.recompute()), dtype)?;
    let manager = variant.offload().map(|c| OffloadManager::new(&alloc, c)).transpose()?;
    let (side, event) = (dev.stream()?, dev.event()?);
    let on_side = manager.is_some().then_some((&side, &event));
    let timed = time_graphed(dev, (&alloc, &main), &model, on_side, manager.as_ref(), (warmup, steps))?;
    alloc.synchronize()?;
    let stats = alloc.stats();
    let (total, pools) = (&stats.total, stats.pools.iter().map(|(_, s)| s));
    Ok(Probe {
        size,
        fits: total.peak_reserved <= budget,
        peak_reserved_bytes: total.peak_reserved,
        peak_allocated_bytes: total.peak_allocated,
        cache_peak_reserved_bytes: stats.default.peak_reserved,
        cache_peak_allocated_bytes: stats.default.peak_allocated,
        pools_peak_reserved_bytes: pools.clone().map(|s| s.peak_reserved).sum(),
        pools_peak_allocated_bytes: pools.map(|s| s.peak_allocated).sum(),
        wall_ms: spread(timed.samples.wall_ms).median,
        offloaded_bytes: manager.as_ref().and_then(OffloadManager::summary).map_or(0, |s| s.offloaded_bytes()),
    })
}

/// Bytes in GiB, or in MiB below one GiB.
fn gib(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    }
}

fn print_row(r: &SearchRow) {
    match (r.largest, r.at_largest, r.ms_per_unit) {
        (Some(n), Some(p), Some(per)) => println!(
            "  {:<22} largest {} {n}: peak reserved {}, {:.3} ms per step, {per:.3} ms per {}",
            r.case.variant,
            r.search,
            gib(p.peak_reserved_bytes),
            p.wall_ms,
            if r.search == "batch" { "sequence" } else { "layer" }
        ),
        _ => println!("  {:<22} largest {}: none fits {}", r.case.variant, r.search, gib(r.budget_bytes)),
    }
}

/// Each offloading variant's largest size and time per unit against graphed's.
fn print_ratios(rows: &[SearchRow]) {
    for r in rows.iter().filter(|r| r.case.variant != MemoryVariant::Graphed.name()) {
        let base = rows.iter().find(|b| b.case.variant == MemoryVariant::Graphed.name() && b.search == r.search);
        if let Some((b, n, bn, per, bper)) =
            base.and_then(|b| Some((b, r.largest?, b.largest?, r.ms_per_unit?, b.ms_per_unit?)))
        {
            println!(
                "  {} against {}: {:.2}x the {}, {:+.1}% time per unit",
                r.case.variant,
                b.case.variant,
                n as f64 / bn as f64,
                r.search,
                100.0 * (per / bper - 1.0)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe of a step whose peak is `fixed + per · size` bytes.
    fn affine(fixed: usize, per: usize, budget: usize) -> impl FnMut(usize) -> anyhow::Result<Probe> {
        move |size| {
            let peak = fixed + per * size;
            Ok(Probe {
                size,
                fits: peak <= budget,
                peak_reserved_bytes: peak,
                peak_allocated_bytes: peak,
                cache_peak_reserved_bytes: peak,
                cache_peak_allocated_bytes: peak,
                pools_peak_reserved_bytes: 0,
                pools_peak_allocated_bytes: 0,
                wall_ms: size as f64,
                offloaded_bytes: 0,
            })
        }
    }

    fn largest(probes: &[Probe]) -> Option<usize> {
        probes.iter().filter(|p| p.fits).map(|p| p.size).max()
    }

    #[test]
    fn an_affine_peak_is_bracketed_in_a_few_probes() {
        let mut p = affine(3000, 100, 10_000);
        let probes = largest_fitting(10_000, usize::MAX, &mut p).unwrap();
        assert_eq!(largest(&probes), Some(70));
        let failed: Vec<usize> = probes.iter().filter(|p| !p.fits).map(|p| p.size).collect();
        assert!(
            failed.contains(&71) && failed.contains(&72),
            "the boundary is shown by two failing probes: {failed:?}"
        );
        assert!(probes.len() <= 5, "{} probes", probes.len());
    }

    #[test]
    fn a_size_that_reserves_more_than_the_next_does_not_end_the_search() {
        // Even sizes reserve 450 more than their neighbours (a larger scratch block): 16 and 18
        // are over while 17 and 19 fit; 20 and 21 are over.
        let mut probe = |size: usize| {
            let bump = if size.is_multiple_of(2) { 450 } else { 0 };
            let mut p = affine(1000 + 100 * size + bump, 0, 3_000)(size)?;
            p.peak_allocated_bytes = 1000 + 100 * size;
            Ok(p)
        };
        let probes = largest_fitting(3_000, usize::MAX, &mut probe).unwrap();
        assert_eq!(largest(&probes), Some(19), "{:?}", probes.iter().map(|p| (p.size, p.fits)).collect::<Vec<_>>());
        assert!(probes.iter().any(|p| !p.fits && p.size < 19), "the search went past a size that was over");
    }

    #[test]
    fn a_peak_that_grows_faster_than_its_first_probes_say_is_still_bracketed() {
        // Peaks rise by 100 up to size 10 and by 400 after, so the first guess overshoots.
        let mut probe = |size: usize| {
            let peak = 1000 + 100 * size.min(10) + 400 * size.saturating_sub(10);
            affine(peak, 0, 20_000)(size)
        };
        let probes = largest_fitting(20_000, usize::MAX, &mut probe).unwrap();
        assert_eq!(largest(&probes), Some(55));
        assert!(probes.iter().any(|p| p.size == 56 && !p.fits));
    }

    #[test]
    fn a_boundary_at_the_largest_size_ends_the_search() {
        // Every size below the largest probed fits, the largest does not: there is no size after
        // it to confirm the boundary with.
        let mut p = affine(0, 1, MAX_SIZE - 1);
        let probes = largest_fitting(MAX_SIZE - 1, usize::MAX, &mut p).unwrap();
        assert_eq!(largest(&probes), Some(MAX_SIZE - 1));
        assert!(probes.iter().any(|p| p.size == MAX_SIZE && !p.fits));
    }

    #[test]
    fn nothing_fits_when_one_is_over() {
        let mut p = affine(5000, 100, 1000);
        let probes = largest_fitting(1000, usize::MAX, &mut p).unwrap();
        assert_eq!(largest(&probes), None);
        assert_eq!(probes.len(), 1);
    }

    #[test]
    fn a_search_that_would_pass_the_device_memory_is_refused() {
        let mut p = affine(1000, 100, 100_000);
        let e = largest_fitting(100_000, 2_000, &mut p).unwrap_err();
        assert!(e.to_string().contains("free memory"), "{e}");
    }
}
