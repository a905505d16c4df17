//! `bench check`: the stream-safety checker's host cost on CUDA, and a planted race run with and
//! without its fix (how often it corrupted the result, and the checker's report).

use serde::Deserialize;

use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{Figure, Table};
use crate::cli::report::results::{Report, Run};

/// The file's rows: the cost with the checker off and on, then the race without and with its fix.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Row {
    Cost { checked: bool, eager_host_us: f64, graph_launch_host_us: f64 },
    Race { fixed: bool, trials: u32, corrupted: u32, report: Option<String> },
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let mut cost = Table::new(&["checker", "eager launch host µs", "graph launch host µs"]);
    let mut race = Table::new(&["planted race", "runs corrupted", "the checker's report"]);
    let (mut eager, mut graph) = (Vec::new(), Vec::new());
    for row in &report.rows {
        match row {
            Row::Cost { checked, eager_host_us, graph_launch_host_us } => {
                let label = if *checked { "on (GRAPHED_CHECK=1)" } else { "off" };
                cost.row(vec![label.into(), format!("{eager_host_us:.2}"), format!("{graph_launch_host_us:.1}")]);
                eager.push(Bar::ours(format!("checker {label}"), *eager_host_us));
                graph.push(Bar::ours(format!("checker {label}"), *graph_launch_host_us));
            }
            Row::Race { fixed, trials, corrupted, report } => {
                let label = if *fixed { "with its fix" } else { "without its fix" };
                let said = report.as_ref().map_or_else(|| "none".to_string(), |r| format!("`{r}`"));
                race.row(vec![label.into(), format!("{corrupted} of {trials}"), said]);
            }
        }
    }
    let unit = "host µs per launch (median)".to_string();
    let panels = vec![
        Panel { title: "eager kernel launch".into(), unit: unit.clone(), bars: eager },
        Panel { title: "graph launch".into(), unit, bars: graph },
    ];
    Ok(Figure {
        tables: vec![cost, race],
        sources: vec![run.ours.name.clone()],
        provenance: report.provenance(),
        note: format!("host µs, median of {} repetitions", report.reps),
        chart: Bars { title: "graphed bench check: the stream-safety checker's cost on CUDA".into(), panels },
    })
}
