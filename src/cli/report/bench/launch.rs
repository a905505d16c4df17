//! `bench launch`: N tiny kernels launched eagerly against one captured graph of N, through
//! graphed and through raw cudarc.

use serde::Deserialize;

use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

/// Host times are per kernel for eager launches and per graph launch; GPU times per kernel.
#[derive(Debug, Deserialize)]
struct Row {
    n: usize,
    eager_host_us: f64,
    eager_gpu_us: Option<f64>,
    graph_launch_host_us: f64,
    graph_gpu_us: Option<f64>,
    raw_eager_host_us: Option<f64>,
    raw_graph_launch_host_us: Option<f64>,
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let pair = |a: Option<f64>, b: Option<f64>| format!("{} / {}", or_dash(a.map(f2)), or_dash(b.map(f2)));
    let mut table = Table::new(&[
        "N",
        "eager host µs/kernel: graphed / raw cudarc",
        "graph launch host µs: graphed / raw",
        "GPU µs/kernel: eager / graph",
        "host speedup",
    ]);
    let mut panels = Vec::new();
    for r in &report.rows {
        let n = r.n as f64;
        table.row(vec![
            r.n.to_string(),
            pair(Some(r.eager_host_us), r.raw_eager_host_us),
            pair(Some(r.graph_launch_host_us), r.raw_graph_launch_host_us),
            pair(r.eager_gpu_us, r.graph_gpu_us),
            format!("{:.0}x", n * r.eager_host_us / r.graph_launch_host_us),
        ]);
        let bars = [
            Some(Bar::ours("eager, graphed", n * r.eager_host_us)),
            r.raw_eager_host_us.map(|u| Bar::theirs("eager, raw cudarc", n * u)),
            Some(Bar::ours("graph, graphed", r.graph_launch_host_us)),
            r.raw_graph_launch_host_us.map(|u| Bar::theirs("graph, raw cudarc", u)),
        ];
        panels.push(Panel {
            title: format!("N = {}", r.n),
            unit: format!("host µs to issue {} kernels (median)", r.n),
            bars: bars.into_iter().flatten().collect(),
        });
    }
    Ok(Figure {
        tables: vec![table],
        sources: vec![run.ours.name.clone()],
        provenance: report.provenance(),
        note: format!(
            "medians of {} repetitions; host speedup is N eager launches against one graph launch",
            report.reps
        ),
        chart: Bars { title: "graphed bench launch: N kernels eagerly or as one graph".into(), panels },
    })
}

fn f2(v: f64) -> String {
    format!("{v:.2}")
}
