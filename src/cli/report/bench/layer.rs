//! `bench layer` and PyTorch's side of the same run (`bench/torch_reference.py layer`): one
//! transformer layer's forward and backward, eager, per configuration.

use serde::Deserialize;

use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{or_dash, Figure, Table};
use crate::cli::report::results::{Report, Run};

#[derive(Debug, Deserialize)]
struct Row {
    config: String,
    dim: usize,
    batch: usize,
    seq: usize,
    dtype: String,
    gpu_ms: Option<f64>,
    host_ms: f64,
    kernels_forward: usize,
    kernels_backward: usize,
    /// `unfused` or `fused`, where the row says.
    attention: Option<String>,
}

#[derive(Debug, Deserialize)]
struct TorchFile {
    rows: Vec<TorchRow>,
}

#[derive(Debug, Deserialize)]
struct TorchRow {
    config: String,
    gpu_ms: f64,
    /// `unfused` or `fused` (`torch_reference.py layer --attention`), where the row says.
    attention: Option<String>,
}

/// A row's attention form: the one it states, or unfused, the only form before rows stated it.
fn form(attention: &Option<String>) -> &str {
    attention.as_deref().unwrap_or("unfused")
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let torch_file = run.torch_for(&report.rows[0].dtype);
    let torch = match torch_file {
        Some(f) => f.read::<TorchFile>()?.rows,
        None => Vec::new(),
    };
    let mut header = vec!["config", "dtype", "GPU ms", "host ms", "kernels forward / backward"];
    if torch_file.is_some() {
        header.push("PyTorch GPU ms");
    }
    let mut table = Table::new(&header);
    let mut panels = Vec::new();
    for r in &report.rows {
        let same = |t: &&TorchRow| t.config == r.config && form(&t.attention) == form(&r.attention);
        let theirs = torch.iter().find(same).map(|t| t.gpu_ms);
        let mut cells = vec![
            r.config.clone(),
            r.dtype.clone(),
            or_dash(r.gpu_ms.map(|g| format!("{g:.3}"))),
            format!("{:.3}", r.host_ms),
            format!("{} / {}", r.kernels_forward, r.kernels_backward),
        ];
        if torch_file.is_some() {
            cells.push(or_dash(theirs.map(|g| format!("{g:.3}"))));
        }
        table.row(cells);
        let mut bars: Vec<Bar> = r.gpu_ms.map(|g| Bar::ours("graphed GPU", g)).into_iter().collect();
        bars.push(Bar::ours("graphed host", r.host_ms));
        bars.extend(theirs.map(|g| Bar::theirs("PyTorch GPU", g)));
        panels.push(Panel {
            title: format!("{}: d={}, batch {} × {} tokens, {}", r.config, r.dim, r.batch, r.seq, r.dtype),
            unit: "ms per forward and backward (median)".into(),
            bars,
        });
    }
    Ok(Figure {
        tables: vec![table],
        sources: run.sources(torch_file),
        provenance: report.provenance(),
        note: format!("one layer's forward and backward, eager, median of {} repetitions", report.reps),
        chart: Bars { title: "graphed bench layer: one transformer layer, eager".into(), panels },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours(attention: &str) -> String {
        format!(
            r#"{{"commit": "abc1234", "device": "H200", "reps": 10, "rows": [{{"config": "S", "dim": 256,
                "batch": 2, "seq": 64, "dtype": "f32", "gpu_ms": 1.0, "host_ms": 0.5, "kernels_forward": 11,
                "kernels_backward": 19{attention}}}]}}"#
        )
    }

    /// PyTorch's file of both attention forms: graphed's row is compared with PyTorch's of its
    /// own form, and a row that states none with PyTorch's unfused one.
    #[test]
    fn pytorchs_row_is_of_the_same_attention_form() {
        let torch = r#"{"bench": "layer", "impl": "torch-eager", "dtype": "f32", "attention": ["unfused", "fused"],
            "rows": [{"config": "S", "attention": "unfused", "impl": "torch-eager", "gpu_ms": 2.0},
                     {"config": "S", "attention": "fused", "impl": "torch-sdpa-eager", "gpu_ms": 1.5}]}"#;
        for (attention, want) in
            [("", "2.000"), (r#", "attention": "unfused""#, "2.000"), (r#", "attention": "fused""#, "1.500")]
        {
            let run = Run::written(
                "layer-forms",
                &[
                    ("2026-12-03-h200-layer-abc1234.json", &ours(attention)),
                    ("2026-12-03-h200-layer-torch-f32-abc1234.json", torch),
                ],
            );
            let table = &figure(&run).unwrap().tables[0];
            assert_eq!(table.rows[0].last().unwrap(), want, "graphed's row with {attention:?}");
        }
    }
}
