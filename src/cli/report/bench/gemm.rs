//! `bench gemm` and PyTorch's side of the same run (`bench/torch_reference.py gemm`): TFLOP/s of
//! a d×d×d bf16 GEMM.

use serde::Deserialize;

use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

/// A row of graphed's file; PyTorch's file is one such row at its top level.
#[derive(Debug, Deserialize)]
struct Row {
    d: usize,
    median_ms: f64,
    tflops: f64,
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let torch_file = run.torch_for("bf16");
    let torch = match torch_file {
        Some(f) => Some(f.read::<Row>()?),
        None => None,
    };
    let mut table = Table::new(&["d", "graphed TFLOP/s", "graphed ms", "PyTorch TFLOP/s", "PyTorch ms"]);
    let mut panels = Vec::new();
    for r in &report.rows {
        let theirs = torch.as_ref().filter(|t| t.d == r.d);
        table.row(vec![
            r.d.to_string(),
            format!("{:.1}", r.tflops),
            format!("{:.4}", r.median_ms),
            or_dash(theirs.map(|t| format!("{:.1}", t.tflops))),
            or_dash(theirs.map(|t| format!("{:.4}", t.median_ms))),
        ]);
        let mut bars = vec![Bar::ours("graphed", r.tflops)];
        bars.extend(theirs.map(|t| Bar::theirs("PyTorch", t.tflops)));
        panels.push(Panel { title: format!("d = {}: {0}×{0}×{0} bf16", r.d), unit: "TFLOP/s".into(), bars });
    }
    Ok(Figure {
        tables: vec![table],
        sources: run.sources(torch_file),
        provenance: report.provenance(),
        note: format!("bf16 with f32 accumulation, median of {} GEMMs timed with CUDA events", report.reps),
        chart: Bars { title: "graphed bench gemm: one bf16 GEMM through cuBLASLt".into(), panels },
    })
}
