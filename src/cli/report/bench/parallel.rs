//! `bench parallel`: one GPU against data parallelism over every GPU of the launch, eager and
//! with the reduction inside the backward graphs: step time, throughput, speedup.

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
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let mut table = Table::new(&["config", "variant", "ranks", "wall ms", "host ms", "samples/s", "speedup"]);
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
        chart: Bars { title: "graphed bench parallel: data parallelism".into(), panels },
    })
}
