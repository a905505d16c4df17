//! `bench graphs` and PyTorch's side of the same run (`bench/torch_reference.py graphs`): wall
//! time per step of every variant, graphed's and PyTorch's side by side, per configuration.

use serde::Deserialize;

use super::{cases, distinct, Case, Median};
use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{mib, or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

/// Issue 13's goals for `graphed`: wall ms per step at S, M and L.
const GOALS: [(&str, &str); 3] = [("S", "1.0"), ("M", "4.5"), ("L", "45.0")];

#[derive(Debug, Deserialize)]
struct Row {
    #[serde(flatten)]
    case: Case,
    variant: String,
    wall_ms: Median,
    host_us: Median,
    reserved_bytes: f64,
}

/// PyTorch's file: its rows hold medians as plain numbers.
#[derive(Debug, Deserialize)]
struct TorchFile {
    rows: Vec<TorchRow>,
}

#[derive(Debug, Deserialize)]
struct TorchRow {
    config: String,
    variant: String,
    wall_ms: f64,
    host_us: f64,
    reserved_bytes: f64,
}

/// One cell's numbers: wall ms, host µs, bytes held.
type Cell = (f64, f64, f64);

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let torch_file = run.torch_for(&report.rows[0].case.dtype);
    let torch = match torch_file {
        Some(f) => f.read::<TorchFile>()?.rows,
        None => Vec::new(),
    };
    let (ours, theirs) = (distinct(&report.rows, |r| &r.variant), distinct(&torch, |r| &r.variant));
    let variants: Vec<&str> = ours.iter().chain(&theirs).copied().collect();
    let cell = |config: &str, variant: &str| -> Option<Cell> {
        let ours = report.rows.iter().find(|r| r.case.config == config && r.variant == variant);
        let theirs = torch.iter().find(|r| r.config == config && r.variant == variant);
        ours.map(|r| (r.wall_ms.median, r.host_us.median, r.reserved_bytes))
            .or(theirs.map(|r| (r.wall_ms, r.host_us, r.reserved_bytes)))
    };
    let mut header = vec!["config", "goal"];
    header.extend(&variants);
    header.push("MiB held (graphed / torch-graphed)");
    let mut table = Table::new(&header);
    let mut panels = Vec::new();
    for case in cases(&report.rows, |r| &r.case) {
        let config = case.config.as_str();
        let goal = GOALS.iter().find(|g| g.0 == config).map(|g| g.1.to_string());
        let mut cells = vec![config.to_string(), or_dash(goal)];
        cells.extend(variants.iter().map(|v| or_dash(cell(config, v).map(|(w, h, _)| format!("{w:.3} [{h:.0}]")))));
        let held = |v: &str| or_dash(cell(config, v).map(|c| mib(c.2)));
        cells.push(format!("{} / {}", held("graphed"), held("torch-graphed")));
        table.row(cells);
        let wall = |v: &str| cell(config, v).map(|c| c.0);
        let bars = (ours.iter().filter_map(|v| Some(Bar::ours(*v, wall(v)?))))
            .chain(theirs.iter().filter_map(|v| Some(Bar::theirs(*v, wall(v)?))))
            .collect();
        panels.push(Panel { title: case.title(), unit: "wall ms per step (median)".into(), bars });
    }
    let mut sources = vec![run.ours.name.clone()];
    sources.extend(torch_file.map(|f| f.name.clone()));
    Ok(Figure {
        tables: vec![table],
        sources,
        provenance: report.provenance(),
        note: format!("wall ms per step, median of {} timed steps, `[…]` host µs to issue it", report.reps),
        chart: Bars { title: "graphed bench graphs: one training step, graphed and PyTorch".into(), panels },
    })
}
