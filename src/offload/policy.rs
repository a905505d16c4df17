//! The policy decided after the recording iteration and frozen before capture (H13): which saved
//! tensors go to host memory, from what the recording iteration recorded and, for the automatic
//! policy, the measured [`Timings`]; and the summary table.

use std::fmt;

use super::config::{OffloadConfig, Policy};
use super::saving::{self, UnitBlocks};
use crate::device::DType;
use crate::nn::Chunk;

/// One saved tensor as the recording iteration recorded it, and the decision.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorLayout {
    /// Its name at the site (`q`).
    pub name: String,
    /// Its shape and element type.
    pub shape: Vec<usize>,
    /// Its element type.
    pub dtype: DType,
    /// Whether it could be copied as it is (a contiguous float tensor).
    pub copyable: bool,
    /// The decision: copied to host memory after its forward, back before its backward.
    pub offload: bool,
}

impl TensorLayout {
    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// One group (the tensors one module saved in one forward) as the recording iteration recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupLayout {
    /// The module's name (`layer3.attn`).
    pub site: String,
    /// The unit (layer) whose forward saved it, counted from 0 in the chunk.
    pub pass: usize,
    /// Its tensors, in save order.
    pub tensors: Vec<TensorLayout>,
}

impl GroupLayout {
    /// Bytes it offloads.
    pub fn offloaded_bytes(&self) -> usize {
        self.tensors.iter().filter(|t| t.offload).map(TensorLayout::bytes).sum()
    }
}

/// What [`Policy::Auto`] decides from: per unit (layer) of a chunk, the milliseconds of its
/// forward and of its backward (the slowest chunk's), the copy bandwidths in bytes per
/// millisecond, and where they were measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Timings {
    /// Per unit, its forward's milliseconds.
    pub forward_ms: Vec<f64>,
    /// Per unit, its backward's milliseconds.
    pub backward_ms: Vec<f64>,
    /// Device-to-host bytes per millisecond.
    pub out_bytes_per_ms: f64,
    /// Host-to-device bytes per millisecond.
    pub in_bytes_per_ms: f64,
    /// Per unit, the milliseconds its forward loses per millisecond of copy out running beside
    /// it (the window probe's; none measured: 0).
    pub forward_interference: Vec<f64>,
    /// Per unit, the same for its backward and the copies back.
    pub backward_interference: Vec<f64>,
    /// Per unit, the milliseconds its forward's graph loses by carrying copies in its tail at
    /// all, however small (the window probe's; none measured: 0).
    pub forward_tail_ms: Vec<f64>,
    /// Per unit, the same for its backward's graph.
    pub backward_tail_ms: Vec<f64>,
    /// Where the unit times and the bandwidths come from.
    pub windows: Windows,
}

impl Timings {
    /// Timings with no measured cost of copies to the kernels beside them.
    pub fn new(forward_ms: Vec<f64>, backward_ms: Vec<f64>, (out, back): (f64, f64), windows: Windows) -> Timings {
        Timings {
            forward_ms,
            backward_ms,
            out_bytes_per_ms: out,
            in_bytes_per_ms: back,
            forward_interference: Vec::new(),
            backward_interference: Vec::new(),
            forward_tail_ms: Vec::new(),
            backward_tail_ms: Vec::new(),
            windows,
        }
    }

    /// The milliseconds the copies of `bytes` out in unit `q`'s forward and back in its backward
    /// are expected to cost those passes: their traffic's cost to the kernels they overlap, plus,
    /// for the first bytes the unit copies (`first`), what its two graphs pay for carrying copies.
    pub fn copy_cost_ms(&self, q: usize, bytes: usize, first: bool) -> f64 {
        let at = |v: &[f64]| v.get(q).copied().unwrap_or(0.0);
        let b = bytes as f64;
        let carrying = if first { at(&self.forward_tail_ms) + at(&self.backward_tail_ms) } else { 0.0 };
        carrying
            + at(&self.forward_interference) * b / self.out_bytes_per_ms
            + at(&self.backward_interference) * b / self.in_bytes_per_ms
    }

    /// The measured step: every unit's forward and backward.
    pub fn step_ms(&self) -> f64 {
        self.forward_ms.iter().chain(&self.backward_ms).sum()
    }
}

/// Where the automatic policy's [`Timings`] were measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Windows {
    /// An eager recording iteration ([`end_iteration`](super::OffloadManager::end_iteration)):
    /// each unit from its forward's start to the next mark, launch gaps included; the copies
    /// eager pinned copies of 64 MiB.
    Eager,
    /// A capture's window probe: each unit's forward and backward captured without offloading
    /// and replayed as graphs, the median of `replays` replays, alone, with one unit's candidate
    /// copies beside them, and captured again with a small copy in their tails; the copies
    /// captured in a graph on the copy streams (the best of three replays).
    Graphs {
        /// Replays per pass.
        replays: usize,
    },
}

impl fmt::Display for Windows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Windows::Eager => write!(f, "the eager recording iteration"),
            Windows::Graphs { replays } => write!(f, "graph replays (the median of {replays})"),
        }
    }
}

/// Decides, in place, which tensors of one chunk's `groups` are offloaded.
///
/// Eligible: selected by the configured sites, copyable, at least the minimum size, and saved by
/// a unit outside the margin (the last `margin` units). [`Policy::Listed`] takes every eligible
/// tensor, earlier units first, within the byte budget; [`Policy::Auto`] takes, per unit `p`,
/// the largest eligible tensors whose copy out fits `slack` of unit `p + 1`'s forward and whose
/// copy back fits `slack` of its backward (where the copies run: see the module docs), and whose
/// cost ([`Timings::copy_cost_ms`]: to the kernels they overlap, and, for a unit's first copy,
/// to the graphs that carry them) fits what is left of `max_overhead` of the measured step,
/// earlier units first; within the byte budget. Where the layers lend their gradients to the
/// pool (`lent[i]`: what layer `i` lends; empty: no lending), the automatic policy then keeps
/// every unit whose copies would not lower the pool's peak (Note [Offloading lent memory] in
/// `offload/saving.rs`), earlier units first.
pub fn decide(config: &OffloadConfig, groups: &mut [GroupLayout], timings: Option<&Timings>, lent: &[usize]) {
    let units = mark_eligible(config, groups);
    if let (Policy::Auto, Some(timings)) = (config.policy, timings) {
        let mut cost_budget = config.max_overhead * timings.step_ms();
        for p in 0..units {
            let window = |ms: &[f64]| ms.get(p + 1).copied().unwrap_or(0.0) * config.slack;
            let mut out_budget = window(&timings.forward_ms) * timings.out_bytes_per_ms;
            let mut in_budget = window(&timings.backward_ms) * timings.in_bytes_per_ms;
            let mut candidates: Vec<(usize, usize)> = (groups.iter().enumerate())
                .filter(|(_, g)| g.pass == p)
                .flat_map(|(gi, g)| (0..g.tensors.len()).filter(|ti| g.tensors[*ti].offload).map(move |ti| (gi, ti)))
                .collect();
            // Largest first (ties in save order): the most bytes for the window.
            candidates.sort_by_key(|&(gi, ti)| std::cmp::Reverse(groups[gi].tensors[ti].bytes()));
            let mut first = true;
            for (gi, ti) in candidates {
                let t = &mut groups[gi].tensors[ti];
                let b = t.bytes() as f64;
                let cost = timings.copy_cost_ms(p + 1, t.bytes(), first);
                t.offload = b <= out_budget && b <= in_budget && cost <= cost_budget;
                if t.offload {
                    out_budget -= b;
                    in_budget -= b;
                    cost_budget -= cost;
                    first = false;
                }
            }
        }
    }
    if let Some(max) = config.max_bytes {
        let mut total = 0;
        for t in groups.iter_mut().flat_map(|g| g.tensors.iter_mut()).filter(|t| t.offload) {
            t.offload = total + t.bytes() <= max;
            total += if t.offload { t.bytes() } else { 0 };
        }
    }
    if config.policy == Policy::Auto && !lent.is_empty() {
        keep_units_that_save_nothing(groups, units, lent);
    }
}

/// Keeps on the device, earlier units first, every unit whose offloaded tensors do not lower
/// the pool's replayed peak given the other units' choices.
fn keep_units_that_save_nothing(groups: &mut [GroupLayout], units: usize, lent: &[usize]) {
    for p in 0..units {
        let mine = |g: &GroupLayout| g.pass == p && g.offloaded_bytes() > 0;
        if !groups.iter().any(mine) {
            continue;
        }
        let mut without = groups.to_vec();
        without.iter_mut().filter(|g| g.pass == p).flat_map(|g| g.tensors.iter_mut()).for_each(|t| t.offload = false);
        // Both savings are from the same peak with nothing offloaded: compare the peaks.
        if saving::own_peak(&UnitBlocks::of(groups), lent) >= saving::own_peak(&UnitBlocks::of(&without), lent) {
            groups.clone_from_slice(&without);
        }
    }
}

/// Marks the eligible tensors of `groups` as offloaded (see [`decide`]); returns the number of
/// units.
pub(crate) fn mark_eligible(config: &OffloadConfig, groups: &mut [GroupLayout]) -> usize {
    let units = groups.iter().map(|g| g.pass + 1).max().unwrap_or(0);
    let kept_from = units.saturating_sub(config.margin);
    for g in groups.iter_mut() {
        let in_margin = g.pass >= kept_from;
        for t in &mut g.tensors {
            let numel: usize = t.shape.iter().product();
            t.offload = !in_margin && t.copyable && numel >= config.min_elements && config.selects(&g.site, &t.name);
        }
    }
    units
}

/// One row of the [`Summary`]: a unit (layer) of a chunk.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryRow {
    /// The chunk.
    pub chunk: Chunk,
    /// The unit.
    pub pass: usize,
    /// The groups with offloaded tensors, as `site(tensor, ...)`.
    pub groups: Vec<String>,
    /// Bytes copied out and back.
    pub offloaded: usize,
    /// Bytes of selected sites kept on the device (margin, size, budget or time).
    pub kept: usize,
    /// The forward of the next unit, where the copy out runs (ms; `None` without timings).
    pub window_ms: Option<f64>,
    /// The copy out at the measured bandwidth (ms; `None` without timings).
    pub copy_ms: Option<f64>,
    /// What the copies out and back are expected to cost the passes they overlap (ms; `None`
    /// without timings).
    pub cost_ms: Option<f64>,
}

impl SummaryRow {
    /// The share of the copy that the window hides, as expected from the timings.
    pub fn expected_overlap(&self) -> Option<f64> {
        match (self.window_ms, self.copy_ms) {
            (Some(w), Some(c)) if c > 0.0 => Some((w / c).min(1.0)),
            (Some(_), Some(_)) => Some(1.0),
            _ => None,
        }
    }
}

/// The frozen policy, per unit: what is offloaded, and how much of the copies the next unit's
/// compute is expected to hide.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The rows, by chunk and unit.
    pub rows: Vec<SummaryRow>,
    /// Why nothing is offloaded, when nothing is: the settings that kept every selected tensor
    /// on the device.
    pub nothing_offloaded: Option<String>,
    /// The measured bandwidths (device to host, host to device) in GB/s, with the automatic
    /// policy.
    pub bandwidth_gbps: Option<(f64, f64)>,
    /// Where the automatic policy's windows and bandwidths were measured.
    pub windows: Option<Windows>,
    /// The measured step (every unit's forward and backward), ms, with the automatic policy.
    pub step_ms: Option<f64>,
    /// Whether the layers lend their gradients to the pool, which the expected saving counts.
    pub lent: bool,
    /// The pages the pool's reserved memory moves by (`CachingAllocator::page_bytes`), if known.
    pub page_bytes: Option<usize>,
    saving: i64,
}

impl Summary {
    /// The summary of chunks' decided layouts, with the timings they were decided from and
    /// what each layer lends the pool (`lent`, as [`decide`] takes it).
    pub fn from_layouts(
        chunks: &[(Chunk, &[GroupLayout])],
        timings: Option<&Timings>,
        config: &OffloadConfig,
        lent: &[usize],
    ) -> Summary {
        let mut rows = Vec::new();
        for (chunk, groups) in chunks {
            let units = groups.iter().map(|g| g.pass + 1).max().unwrap_or(0);
            for p in 0..units {
                let mine = groups.iter().filter(|g| g.pass == p);
                let mut row = SummaryRow {
                    chunk: *chunk,
                    pass: p,
                    groups: Vec::new(),
                    offloaded: 0,
                    kept: 0,
                    window_ms: None,
                    copy_ms: None,
                    cost_ms: None,
                };
                for g in mine {
                    let names: Vec<&str> = g.tensors.iter().filter(|t| t.offload).map(|t| t.name.as_str()).collect();
                    if !names.is_empty() {
                        row.groups.push(format!("{}({})", g.site, names.join(",")));
                    }
                    row.offloaded += g.offloaded_bytes();
                    row.kept += (g.tensors.iter())
                        .filter(|t| !t.offload && config.selects(&g.site, &t.name))
                        .map(TensorLayout::bytes)
                        .sum::<usize>();
                }
                if let Some(t) = timings {
                    row.window_ms = t.forward_ms.get(p + 1).copied().or(Some(0.0));
                    row.copy_ms = Some(row.offloaded as f64 / t.out_bytes_per_ms);
                    row.cost_ms = Some(t.copy_cost_ms(p + 1, row.offloaded, row.offloaded > 0));
                }
                rows.push(row);
            }
        }
        let bandwidth_gbps = timings.map(|t| (t.out_bytes_per_ms / 1e6, t.in_bytes_per_ms / 1e6));
        let windows = timings.map(|t| t.windows);
        let step_ms = timings.map(Timings::step_ms);
        let nothing_offloaded = rows.iter().all(|r| r.offloaded == 0).then(|| {
            let units = rows.iter().map(|r| r.pass + 1).max().unwrap_or(0);
            let selected = chunks.iter().flat_map(|(_, groups)| groups.iter()).flat_map(|g| {
                g.tensors.iter().filter(move |t| config.selects(&g.site, &t.name)).map(|t| t.shape.iter().product())
            });
            let largest: usize = selected.max().unwrap_or(0);
            let mut why = vec![format!(
                "the last {} of the {units} layers per chunk keep theirs (the margin)",
                config.margin.min(units)
            )];
            if largest < config.min_elements {
                why.push(format!(
                    "the largest selected tensor has {largest} elements, fewer than the minimum {}",
                    config.min_elements
                ));
            }
            if config.policy == Policy::Auto {
                why.push(format!(
                    "the automatic policy found no copy that the next layer's time hides at a cost to its kernels \
                     within {:.1}% of the step (max_overhead)",
                    100.0 * config.max_overhead
                ));
            }
            if config.policy == Policy::Auto && !lent.is_empty() {
                why.push(
                    "or, with the layers' gradients lent to the pool, no copy would lower its own peak (their \
                     activations lie in lent memory)"
                        .into(),
                );
            }
            format!(
                "nothing is offloaded: {}; lower the margin or the minimum size, or select other sites",
                why.join("; ")
            )
        });
        let saving = chunks.iter().map(|(_, groups)| saving::expected_saving(&UnitBlocks::of(groups), lent)).sum();
        let lent = !lent.is_empty();
        Summary { rows, nothing_offloaded, bandwidth_gbps, windows, step_ms, lent, page_bytes: None, saving }
    }

    /// The same summary, for a pool whose reserved memory moves in pages of `page_bytes`.
    pub fn in_pages(self, page_bytes: Option<usize>) -> Summary {
        Summary { page_bytes, ..self }
    }

    /// What the copies are expected to cost the passes they overlap, in milliseconds (`None`
    /// without timings).
    pub fn expected_cost_ms(&self) -> Option<f64> {
        self.rows.iter().map(|r| r.cost_ms).sum()
    }

    /// Bytes offloaded per iteration.
    pub fn offloaded_bytes(&self) -> usize {
        self.rows.iter().map(|r| r.offloaded).sum()
    }

    /// The memory the offloading is expected to save at the graph pool's peak, in bytes, over
    /// its chunks; negative where it raises the peak (lent gradient memory: Note [Offloading
    /// lent memory] in `offload/saving.rs`). Each chunk's step is replayed through the pool's
    /// bookkeeping with every saved tensor, offloaded as decided and with nothing offloaded:
    /// while unit `q` runs (its forward, where the copy out of unit `q - 1` runs, or its
    /// backward, which prefetches unit `q - 1`) the device holds the kept bytes of units up to
    /// `q` and the offloaded bytes of units `q` and `q - 1`. So a margin of one unit saves every
    /// offloaded byte but the last offloaded unit's, and a margin of two saves every one.
    pub fn expected_peak_saving(&self) -> i64 {
        self.saving
    }

    /// What [`expected_peak_saving`](Summary::expected_peak_saving) can do to the reserved peak,
    /// which moves in whole pages: between the whole pages within the saving and the pages that
    /// cover it, both included (where the peak's other bytes fall within a page is not known
    /// here). At S a saving of 0.5 MiB lowers the reserved peak by 0 or 2 MiB. `None` where the
    /// pages are not known.
    pub fn expected_reserved_saving(&self) -> Option<std::ops::RangeInclusive<i64>> {
        let page = i64::try_from(self.page_bytes?).ok().filter(|p| *p > 0)?;
        let whole = self.saving.div_euclid(page) * page;
        Some(whole..=if whole == self.saving { whole } else { whole + page })
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// As [`mib`], for a saving that may be negative.
fn signed_mib(bytes: i64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((out, back)) = self.bandwidth_gbps {
            writeln!(f, "copy bandwidth measured: {out:.1} GB/s to host, {back:.1} GB/s back")?;
        }
        if let Some(windows) = self.windows {
            writeln!(f, "windows and copies timed in {windows}")?;
        }
        writeln!(
            f,
            "{:>5} {:>4} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8}  groups",
            "chunk", "unit", "offl. MiB", "kept MiB", "window ms", "copy ms", "hidden", "cost ms"
        )?;
        for r in &self.rows {
            let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
            let hidden = r.expected_overlap().map_or("-".to_string(), |o| format!("{:.0}%", o * 100.0));
            writeln!(
                f,
                "{:>5} {:>4} {:>10.1} {:>9.1} {:>10} {:>9} {:>8} {:>8}  {}",
                format!("{}/{}", r.chunk.microbatch, r.chunk.stage),
                r.pass,
                mib(r.offloaded),
                mib(r.kept),
                ms(r.window_ms),
                ms(r.copy_ms),
                hidden,
                ms(r.cost_ms),
                if r.groups.is_empty() { "-".to_string() } else { r.groups.join(" ") }
            )?;
        }
        if let Some(why) = &self.nothing_offloaded {
            return write!(f, "{why}");
        }
        write!(
            f,
            "offloaded {:.1} MiB per iteration; expected peak saving {:.1} MiB{}",
            mib(self.offloaded_bytes()),
            signed_mib(self.expected_peak_saving()),
            if self.lent { " (of the pool's own memory: lent gradient memory is the gradients')" } else { "" }
        )?;
        if let (Some(range), Some(page)) = (self.expected_reserved_saving(), self.page_bytes) {
            if range.start() != range.end() {
                let (lo, hi) = (signed_mib(*range.start()), signed_mib(*range.end()));
                let page = mib(page);
                write!(f, " (reserved memory moves in {page:.0} MiB pages: the reserved peak falls by {lo:.0} to {hi:.0} MiB)")?;
            }
        }
        match (self.expected_cost_ms(), self.step_ms) {
            (Some(cost), Some(step)) if step > 0.0 => {
                write!(f, "; expected cost {cost:.3} ms, {:.1}% of the {step:.3} ms step", 100.0 * cost / step)
            }
            _ => Ok(()),
        }
    }
}
