//! `train --metrics FILE` and `--plot FILE`: the losses `train` prints, as JSON lines (one object
//! per reported step) and as an SVG chart of the loss curve.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The reported losses of a run, written as they come and plotted at the end.
pub struct Metrics {
    lines: Option<(PathBuf, std::io::BufWriter<std::fs::File>)>,
    points: Vec<(usize, f64)>,
}

impl Metrics {
    /// Opens `lines` for writing (truncating it), if given.
    pub fn new(lines: Option<&Path>) -> anyhow::Result<Metrics> {
        let lines = match lines {
            Some(p) => {
                let f = std::fs::File::create(p)
                    .map_err(|e| anyhow::anyhow!("cannot write --metrics {}: {e}", p.display()))?;
                Some((p.to_path_buf(), std::io::BufWriter::new(f)))
            }
            None => None,
        };
        Ok(Metrics { lines, points: Vec::new() })
    }

    /// The loss after `step`, `seconds` into the run.
    pub fn record(&mut self, step: usize, loss: f64, seconds: f64) -> anyhow::Result<()> {
        self.points.push((step, loss));
        if let Some((path, w)) = &mut self.lines {
            let line = serde_json::json!({ "step": step, "loss": loss, "seconds": seconds });
            writeln!(w, "{line}").map_err(|e| anyhow::anyhow!("cannot write --metrics {}: {e}", path.display()))?;
        }
        Ok(())
    }

    /// Flushes the JSON lines, and draws the loss curve (`title` above it) to `plot` if given.
    pub fn finish(mut self, plot: Option<&Path>, title: &str) -> anyhow::Result<()> {
        if let Some((path, w)) = &mut self.lines {
            w.flush().map_err(|e| anyhow::anyhow!("cannot write --metrics {}: {e}", path.display()))?;
        }
        let Some(plot) = plot else { return Ok(()) };
        let svg = crate::cli::plot::line_chart(title, ("step", "loss"), &self.points)
            .map_err(|e| anyhow::anyhow!("cannot draw --plot {}: {e}", plot.display()))?;
        std::fs::write(plot, svg).map_err(|e| anyhow::anyhow!("cannot write --plot {}: {e}", plot.display()))?;
        Ok(())
    }
}
