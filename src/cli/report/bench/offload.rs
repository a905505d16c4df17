//! `bench offload`: graphed-side against the same step with activations offloaded inside the
//! graphs (step time, overhead, bytes moved and saved), and the copy rates against the pinned
//! peak, per configuration.

use serde::Deserialize;

use super::{cases, Case, Median};
use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{mib, or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

/// The file's one row: every variant, and the copy rates.
#[derive(Debug, Deserialize)]
struct Rows {
    variants: Vec<Variant>,
    copies: Vec<Copies>,
}

#[derive(Debug, Deserialize)]
struct Variant {
    #[serde(flatten)]
    case: Case,
    variant: String,
    wall_ms: Median,
    overhead_pct: Option<f64>,
    offloaded_bytes: f64,
    saved_bytes: Option<f64>,
    expected_saving_bytes: f64,
    memory: Memory,
}

/// The allocator's statistics of a variant's run: its totals.
#[derive(Debug, Deserialize)]
struct Memory {
    total: Totals,
}

#[derive(Debug, Deserialize)]
struct Totals {
    peak_allocated_bytes: f64,
    peak_reserved_bytes: f64,
}

#[derive(Debug, Deserialize)]
struct Copies {
    config: String,
    peak_out_gbps: f64,
    peak_in_gbps: f64,
    graph_out_gbps: f64,
    graph_in_gbps: f64,
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Rows>::of(run)?;
    let variants: Vec<&Variant> = report.rows.iter().flat_map(|r| &r.variants).collect();
    let copies: Vec<&Copies> = report.rows.iter().flat_map(|r| &r.copies).collect();
    let mut steps = Table::new(&[
        "config",
        "variant",
        "wall ms",
        "overhead",
        "offloaded MiB per step",
        "pool peak saved MiB (expected)",
        "peak reserved MiB (÷ allocated)",
        "reserved saved MiB (÷ offloaded)",
    ]);
    let mut panels = Vec::new();
    for case in cases(&variants, |v| &v.case) {
        let of_case: Vec<&&Variant> = variants.iter().filter(|v| v.case.config == case.config).collect();
        // The first variant of a configuration is the baseline, graphed-side.
        let baseline = of_case.first().map(|b| b.memory.total.peak_reserved_bytes);
        for v in &of_case {
            let saved = v.saved_bytes.map(|s| format!("{} ({})", mib(s), mib(v.expected_saving_bytes)));
            let total = &v.memory.total;
            let reserved = format!(
                "{} ({:.3})",
                mib(total.peak_reserved_bytes),
                total.peak_reserved_bytes / total.peak_allocated_bytes
            );
            let reserved_saved = baseline.filter(|_| v.offloaded_bytes > 0.0).map(|b| {
                let saved = b - total.peak_reserved_bytes;
                format!("{} ({:.0}%)", mib(saved), 100.0 * saved / v.offloaded_bytes)
            });
            steps.row(vec![
                case.config.clone(),
                v.variant.clone(),
                format!("{:.3}", v.wall_ms.median),
                or_dash(v.overhead_pct.map(|p| format!("{p:.2}%"))),
                mib(v.offloaded_bytes),
                or_dash(saved),
                reserved,
                or_dash(reserved_saved),
            ]);
        }
        let bars = of_case.iter().map(|v| Bar::ours(&v.variant, v.wall_ms.median)).collect();
        panels.push(Panel { title: case.title(), unit: "wall ms per step (median)".into(), bars });
    }
    let mut rates = Table::new(&["config", "pinned peak GB/s (to host / back)", "in the graphs GB/s (to host / back)"]);
    for c in copies {
        // No copies ran (nothing was offloaded): no rate.
        let in_graphs = (c.graph_out_gbps > 0.0).then(|| format!("{:.1} / {:.1}", c.graph_out_gbps, c.graph_in_gbps));
        rates.row(vec![
            c.config.clone(),
            format!("{:.1} / {:.1}", c.peak_out_gbps, c.peak_in_gbps),
            or_dash(in_graphs),
        ]);
    }
    Ok(Figure {
        tables: vec![steps, rates],
        sources: vec![run.ours.name.clone()],
        provenance: report.provenance(),
        note: format!(
            "wall ms per step, median of {} timed steps; overhead against graphed-side; saved is the graph pool's peak; reserved is the allocator's, graph pools and cache together, and its saving against graphed-side",
            report.reps
        ),
        chart: Bars { title: "graphed bench offload: activations offloaded inside the graphs".into(), panels },
    })
}
