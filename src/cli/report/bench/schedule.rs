//! `bench schedule`: a pipeline schedule on one GPU, eager against one graph per (layer,
//! microbatch), with and without buffer reuse: wall and host time per step, capture cost, memory.

use serde::Deserialize;

use super::{cases, Case, Median};
use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{mib, or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

#[derive(Debug, Deserialize)]
struct Row {
    #[serde(flatten)]
    case: Case,
    variant: String,
    microbatches: usize,
    virtual_stages: usize,
    wall_ms: Median,
    host_us: Median,
    graphs: Option<usize>,
    capture_ms: Option<f64>,
    static_bytes: Option<f64>,
    pool_peak_bytes: Option<f64>,
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let mut table = Table::new(&[
        "config",
        "microbatches × virtual stages",
        "variant",
        "wall ms",
        "host ms",
        "graphs",
        "capture ms",
        "static buffers MiB",
        "pool peak MiB",
    ]);
    let mut panels = Vec::new();
    for case in cases(&report.rows, |r| &r.case) {
        let rows: Vec<&Row> = report.rows.iter().filter(|r| r.case.config == case.config).collect();
        for r in &rows {
            table.row(vec![
                case.config.clone(),
                format!("{} × {}", r.microbatches, r.virtual_stages),
                r.variant.clone(),
                format!("{:.3}", r.wall_ms.median),
                format!("{:.3}", r.host_us.median / 1e3),
                or_dash(r.graphs.map(|g| g.to_string())),
                or_dash(r.capture_ms.map(|c| format!("{c:.0}"))),
                or_dash(r.static_bytes.map(mib)),
                or_dash(r.pool_peak_bytes.map(mib)),
            ]);
        }
        let bars = |f: fn(&Row) -> f64| rows.iter().map(|r| Bar::ours(&r.variant, f(r))).collect();
        panels.push(Panel {
            title: format!("{}: wall", case.title()),
            unit: "ms per step (median)".into(),
            bars: bars(|r| r.wall_ms.median),
        });
        let host = bars(|r| r.host_us.median / 1e3);
        panels.push(Panel {
            title: format!("{}: host", case.title()),
            unit: "ms per step to issue it (median)".into(),
            bars: host,
        });
    }
    Ok(Figure {
        tables: vec![table],
        sources: vec![run.ours.name.clone()],
        provenance: report.provenance(),
        note: format!("medians of {} timed steps; host is the time to issue a step", report.reps),
        chart: Bars { title: "graphed bench schedule: interleaved 1F1B on one GPU".into(), panels },
    })
}
