//! `bench graphs` and PyTorch's side of the same run (`bench/torch_reference.py graphs`): wall
//! time per step of every variant, graphed's and PyTorch's side by side, per configuration.

use serde::Deserialize;

use super::{cases, distinct, Case, Median};
use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{mib, or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

/// Issue 31's goals for `graphed` with fused attention: wall ms per step at S, M and L.
const GOALS: [(&str, &str); 3] = [("S", "0.90"), ("M", "3.40"), ("L", "31.0")];

#[derive(Debug, Deserialize)]
struct Row {
    #[serde(flatten)]
    case: Case,
    variant: String,
    wall_ms: Median,
    host_us: Median,
    /// Absent in results older than the allocator's statistics.
    memory: Option<MemoryRow>,
}

/// Of graphed's `memory`: the total's peaks, which cover the capture and the timed steps alike
/// (its `reserved_bytes` missed the graph pool in results before 2026-12-05's fix).
#[derive(Debug, Deserialize)]
struct MemoryRow {
    total: PeakRow,
}

#[derive(Debug, Deserialize)]
struct PeakRow {
    peak_reserved_bytes: f64,
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
    peak_reserved_bytes: Option<f64>,
}

/// One cell's numbers: wall ms, host µs, peak bytes reserved.
type Cell = (f64, f64, Option<f64>);

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
        ours.map(|r| (r.wall_ms.median, r.host_us.median, r.memory.as_ref().map(|m| m.total.peak_reserved_bytes)))
            .or(theirs.map(|r| (r.wall_ms, r.host_us, r.peak_reserved_bytes)))
    };
    // PyTorch with fused attention (`torch-sdpa-*`) is the anchor to beat: its graphed variant's
    // memory too, when the run has it. Memory is the peak reserved on both sides: PyTorch's
    // allocated counter drops a graph's memory once the capture frees its tensors, though the
    // replays keep using it, so only reserved bytes compare.
    // The memory column names the graphed variants the run has of each side.
    let held_by: Vec<&str> = std::iter::once("graphed")
        .chain(["torch-graphed", "torch-sdpa-graphed"].into_iter().filter(|v| theirs.contains(v)))
        .collect();
    let held_title = format!("peak MiB reserved ({})", held_by.join(" / "));
    let mut header = vec!["config", "goal"];
    header.extend(&variants);
    header.push(&held_title);
    let mut table = Table::new(&header);
    let mut panels = Vec::new();
    for case in cases(&report.rows, |r| &r.case) {
        let config = case.config.as_str();
        let goal = GOALS.iter().find(|g| g.0 == config).map(|g| g.1.to_string());
        let mut cells = vec![config.to_string(), or_dash(goal)];
        cells.extend(variants.iter().map(|v| or_dash(cell(config, v).map(|(w, h, _)| format!("{w:.3} [{h:.0}]")))));
        let held = |v: &&str| or_dash(cell(config, v).and_then(|c| c.2).map(mib));
        cells.push(held_by.iter().map(held).collect::<Vec<_>>().join(" / "));
        table.row(cells);
        let wall = |v: &str| cell(config, v).map(|c| c.0);
        let bars = (ours.iter().filter_map(|v| Some(Bar::ours(*v, wall(v)?))))
            .chain(theirs.iter().filter_map(|v| Some(Bar::theirs(*v, wall(v)?))))
            .collect();
        panels.push(Panel { title: case.title(), unit: "wall ms per step (median)".into(), bars });
    }
    Ok(Figure {
        tables: vec![table],
        sources: run.sources(torch_file),
        provenance: report.provenance(),
        note: format!("wall ms per step, median of {} timed steps, `[…]` host µs to issue it", report.reps),
        chart: Bars { title: "graphed bench graphs: one training step, graphed and PyTorch".into(), panels },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: &str = r#"{"commit": "abc1234", "device": "H200", "reps": 20, "rows": [
        {"config": "S", "dim": 256, "layers": 8, "batch": 2, "seq": 64, "dtype": "bf16", "variant": "graphed",
         "wall_ms": {"median": 1.0}, "host_us": {"median": 50.0}, "reserved_bytes": 1048576,
         "memory": {"total": {"peak_reserved_bytes": 3145728}}}]}"#;

    fn torch_row(variant: &str, attention: &str, wall_ms: f64, mib: u32) -> String {
        format!(
            r#"{{"config": "S", "variant": "{variant}", "attention": "{attention}", "dtype": "bfloat16",
                "wall_ms": {wall_ms}, "wall_min_ms": 0.5, "wall_max_ms": 9.0, "host_us": 100.0,
                "reserved_bytes": 1, "peak_allocated_bytes": 1, "peak_reserved_bytes": {},
                "capture_ms": null, "sdpa_backend": "cudnn"}}"#,
            mib << 20
        )
    }

    /// PyTorch's rows of both attention forms (as `torch_reference.py graphs --attention both`
    /// writes them, with fields this reader does not read) get a column each, and the memory
    /// column adds torch-sdpa-graphed's.
    #[test]
    fn fused_attention_variants_get_columns_and_memory() {
        let rows =
            [torch_row("torch-graphed", "unfused", 2.5, 230), torch_row("torch-sdpa-graphed", "fused", 2.0, 200)];
        let torch = format!(r#"{{"bench": "graphs", "impl": "torch", "rows": [{}], "sdpa": {{}}}}"#, rows.join(","));
        let run = Run::written(
            "graphs-sdpa",
            &[
                ("2026-12-03-h200-graphs-abc1234.json", OURS),
                ("2026-12-03-h200-graphs-torch-bf16-abc1234.json", &torch),
            ],
        );
        let table = &figure(&run).unwrap().tables[0];
        assert_eq!(
            table.header,
            [
                "config",
                "goal",
                "graphed",
                "torch-graphed",
                "torch-sdpa-graphed",
                "peak MiB reserved (graphed / torch-graphed / torch-sdpa-graphed)"
            ]
        );
        assert_eq!(table.rows[0][2..], ["1.000 [50]", "2.500 [100]", "2.000 [100]", "3 / 230 / 200"]);
    }

    /// The memory column of a run whose PyTorch side has one attention form: its title and S's cell.
    fn memory_column(name: &str, torch_row: &str) -> (String, String) {
        let torch = format!(r#"{{"rows": [{torch_row}]}}"#);
        let run = Run::written(
            name,
            &[
                ("2026-12-03-h200-graphs-abc1234.json", OURS),
                ("2026-12-03-h200-graphs-torch-bf16-abc1234.json", &torch),
            ],
        );
        let table = figure(&run).unwrap().tables.remove(0);
        (table.header.last().unwrap().clone(), table.rows[0].last().unwrap().clone())
    }

    /// A run whose PyTorch side has no fused attention keeps the table it had; one with fused
    /// attention alone names only its variant in the memory column.
    #[test]
    fn the_memory_column_names_the_graphed_variants_that_ran() {
        assert_eq!(
            memory_column("graphs-unfused", &torch_row("torch-graphed", "unfused", 2.5, 230)),
            ("peak MiB reserved (graphed / torch-graphed)".to_string(), "3 / 230".to_string())
        );
        assert_eq!(
            memory_column("graphs-fused-only", &torch_row("torch-sdpa-graphed", "fused", 2.0, 200)),
            ("peak MiB reserved (graphed / torch-sdpa-graphed)".to_string(), "3 / 200".to_string())
        );
    }
}
