//! `bench parallel`: one GPU against data parallelism over every GPU of the launch, eager and
//! with the reduction inside the backward graphs, and against pipelines of one stage per GPU:
//! step time, throughput, speedup, and a pipeline's bubble against its schedule's.

use serde::Deserialize;

use super::{cases, Case, Median};
use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

#[derive(Debug, Deserialize)]
struct Row {
    #[serde(flatten)]
    case: Case,
    variant: String,
    ranks: usize,
    wall_ms: Median,
    host_us: Median,
    samples_per_s: f64,
    speedup: Option<f64>,
    bubble: Option<f64>,
    bubble_theory: Option<f64>,
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let mut table = Table::new(&[
        "config",
        "variant",
        "ranks",
        "wall ms",
        "host ms",
        "samples/s",
        "speedup",
        "bubble",
        "schedule's bubble",
    ]);
    let mut panels = Vec::new();
    for case in cases(&report.rows, |r| &r.case) {
        let rows: Vec<&Row> = report.rows.iter().filter(|r| r.case.config == case.config).collect();
        for r in &rows {
            table.row(vec![
                case.config.clone(),
                r.variant.clone(),
                r.ranks.to_string(),
                format!("{:.3}", r.wall_ms.median),
                format!("{:.3}", r.host_us.median / 1e3),
                format!("{:.0}", r.samples_per_s),
                or_dash(r.speedup.map(|s| format!("{s:.2}x"))),
                or_dash(r.bubble.map(|b| format!("{:.1}%", 100.0 * b))),
                or_dash(r.bubble_theory.map(|b| format!("{:.1}%", 100.0 * b))),
            ]);
        }
        panels.push(Panel {
            title: format!("{}: throughput", case.title()),
            unit: "samples per second (median step)".into(),
            bars: rows.iter().map(|r| Bar::ours(&r.variant, r.samples_per_s)).collect(),
        });
    }
    Ok(Figure {
        tables: vec![table],
        sources: vec![run.ours.name.clone()],
        provenance: report.provenance(),
        note: format!("medians of {} timed steps; speedup over one GPU of the same run", report.reps),
        chart: Bars { title: "graphed bench parallel: data and pipeline parallelism".into(), panels },
    })
}
