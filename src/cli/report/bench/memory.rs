//! `bench memory` and PyTorch's side of the same run (`bench/torch_reference.py memory`): per
//! variant, the largest batch and the largest layer count whose step fits the budget, with the
//! peak it reserved and its time per sequence or per layer.

use serde::Deserialize;

use super::distinct;
use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

/// One search, as both sides write it.
#[derive(Debug, Deserialize)]
struct Row {
    config: String,
    variant: String,
    search: String,
    budget_bytes: f64,
    largest: Option<usize>,
    at_largest: Option<AtLargest>,
    ms_per_unit: Option<f64>,
    /// PyTorch's side: whether `make_graphed_callables` captured the variant (else it ran eagerly).
    #[serde(default = "captured")]
    graphed: bool,
}

fn captured() -> bool {
    true
}

#[derive(Debug, Deserialize)]
struct AtLargest {
    peak_reserved_bytes: f64,
    wall_ms: f64,
}

/// PyTorch's file.
#[derive(Debug, Deserialize)]
struct TorchFile {
    rows: Vec<Row>,
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let torch_file = run.torch_for("bf16");
    let torch = match torch_file {
        Some(f) => f.read::<TorchFile>()?.rows,
        None => Vec::new(),
    };
    let rows: Vec<(&Row, bool)> =
        report.rows.iter().map(|r| (r, true)).chain(torch.iter().map(|r| (r, false))).collect();
    let mut table = Table::new(&["search", "variant", "largest", "peak reserved GiB", "ms per step", "ms per unit"]);
    let mut panels = Vec::new();
    let gib = |b: f64| format!("{:.2}", b / f64::from(1 << 30));
    for search in distinct(&rows, |(r, _)| r.search.as_str()) {
        let mut bars = Vec::new();
        for (r, ours) in rows.iter().filter(|(r, _)| r.search == search) {
            let name = match r.graphed {
                true => r.variant.clone(),
                false => format!("{} (eager)", r.variant),
            };
            table.row(vec![
                r.search.clone(),
                name.clone(),
                or_dash(r.largest.map(|n| n.to_string())),
                or_dash(r.at_largest.as_ref().map(|a| gib(a.peak_reserved_bytes))),
                or_dash(r.at_largest.as_ref().map(|a| format!("{:.1}", a.wall_ms))),
                or_dash(r.ms_per_unit.map(|m| format!("{m:.2}"))),
            ]);
            let value = r.largest.unwrap_or(0) as f64;
            bars.push(if *ours { Bar::ours(name, value) } else { Bar::theirs(name, value) });
        }
        let first = rows.iter().find(|(r, _)| r.search == search).map(|(r, _)| r);
        let title = first
            .map_or_else(String::new, |r| format!("{}: largest {search} within {} GiB", r.config, gib(r.budget_bytes)));
        panels.push(Panel { title, unit: format!("largest {search}"), bars });
    }
    Ok(Figure {
        tables: vec![table],
        sources: run.sources(torch_file),
        provenance: report.provenance(),
        note: format!(
            "the largest batch (the configuration's layers kept) and the largest layer count (its batch kept) \
             whose step's peak reserved memory, graph pools and cache together, fits the budget; step time the \
             median of {} steps at that size; ms per unit is per sequence or per layer",
            report.reps
        ),
        chart: Bars { title: "graphed bench memory: what fits a memory budget".into(), panels },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(variant: &str, search: &str, largest: Option<usize>, extra: &str) -> String {
        let at = largest.map_or("null".to_string(), |n| {
            format!(r#"{{"size": {n}, "peak_reserved_bytes": 2147483648, "wall_ms": {}}}"#, 10 * n)
        });
        let per = largest.map_or("null".to_string(), |_| "10.0".to_string());
        format!(
            r#"{{"config": "L", "variant": "{variant}", "search": "{search}", "budget_bytes": 4294967296,
                "largest": {}, "at_largest": {at}, "ms_per_unit": {per}, "probes": []{extra}}}"#,
            largest.map_or("null".to_string(), |n| n.to_string())
        )
    }

    /// Both sides' searches share a table, grouped by what was searched; a PyTorch variant that
    /// ran eagerly says so, and a search where nothing fits shows dashes.
    #[test]
    fn both_sides_searches_share_a_table_grouped_by_search() {
        let ours = format!(
            r#"{{"commit": "abc1234", "device": "H200", "reps": 5, "rows": [{}, {}, {}]}}"#,
            row("graphed", "batch", Some(18), ""),
            row("graphed", "layers", Some(7), ""),
            row("graphed-offload", "batch", None, ""),
        );
        let torch = format!(
            r#"{{"bench": "memory", "impl": "torch", "rows": [{}, {}]}}"#,
            row("torch-sdpa-graphed", "batch", Some(20), r#", "graphed": true"#),
            row("torch-sdpa-checkpoint", "layers", Some(9), r#", "graphed": false, "graphed_error": "x""#),
        );
        let run = Run::written(
            "memory",
            &[
                ("2026-12-03-h200-memory-abc1234.json", &ours),
                ("2026-12-03-h200-memory-torch-bf16-abc1234.json", &torch),
            ],
        );
        let figure = figure(&run).unwrap();
        let cells: Vec<[&str; 3]> =
            figure.tables[0].rows.iter().map(|r| [r[0].as_str(), r[1].as_str(), r[2].as_str()]).collect();
        assert_eq!(
            cells,
            [
                ["batch", "graphed", "18"],
                ["batch", "graphed-offload", "-"],
                ["batch", "torch-sdpa-graphed", "20"],
                ["layers", "graphed", "7"],
                ["layers", "torch-sdpa-checkpoint (eager)", "9"],
            ]
        );
        assert_eq!(figure.tables[0].rows[0][3..], ["2.00", "180.0", "10.00"]);
        assert_eq!(figure.chart.panels.len(), 2);
        assert_eq!(figure.chart.panels[0].title, "L: largest batch within 4.00 GiB");
    }
}
