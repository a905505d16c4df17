//! `train --metrics FILE` and `--plot FILE`: the losses `train` prints, as JSON lines (one object
//! per reported step, each flushed as it is reported, so that a killed run keeps them) and as an
//! SVG chart of the loss curve. A resumed run continues its file: the lines of the steps it
//! already took stay, those of steps after its checkpoint (reported by the run that went on
//! after saving) are dropped, and the new ones are appended.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The reported losses of a run, written as they come and plotted at the end.
pub struct Metrics {
    lines: Option<(PathBuf, std::fs::File)>,
    points: Vec<(usize, f64)>,
}

impl Metrics {
    /// Opens `lines` for writing, if given: a fresh run (`resumed_at` `None`) truncates it, a run
    /// resumed after `resumed_at` steps keeps its lines of earlier steps and appends.
    pub fn open(lines: Option<&Path>, resumed_at: Option<usize>) -> anyhow::Result<Metrics> {
        let Some(path) = lines else { return Ok(Metrics { lines: None, points: Vec::new() }) };
        let cannot = |e: std::io::Error| anyhow::anyhow!("cannot write --metrics {}: {e}", path.display());
        let mut points = Vec::new();
        let file = match resumed_at {
            None => std::fs::File::create(path).map_err(cannot)?,
            Some(start) => {
                let earlier = std::fs::read_to_string(path).unwrap_or_default();
                let mut kept = String::new();
                for line in earlier.lines() {
                    match parse(line) {
                        Some((step, loss)) if step < start => {
                            points.push((step, loss));
                            kept.push_str(line);
                            kept.push('\n');
                        }
                        Some(_) => {}
                        None => anyhow::bail!(
                            "--metrics {} has a line that is not one `train` wrote ({line:?}); pass another file",
                            path.display()
                        ),
                    }
                }
                super::outputs::write_atomically(path, kept.as_bytes()).map_err(cannot)?;
                std::fs::OpenOptions::new().append(true).open(path).map_err(cannot)?
            }
        };
        Ok(Metrics { lines: Some((path.to_path_buf(), file)), points })
    }

    /// The loss after `step`, `seconds` into the run, written and flushed at once.
    pub fn record(&mut self, step: usize, loss: f64, seconds: f64) -> anyhow::Result<()> {
        self.points.push((step, loss));
        if let Some((path, f)) = &mut self.lines {
            let line = serde_json::json!({ "step": step, "loss": loss, "seconds": seconds });
            writeln!(f, "{line}")
                .and_then(|()| f.flush())
                .map_err(|e| anyhow::anyhow!("cannot write --metrics {}: {e}", path.display()))?;
        }
        Ok(())
    }

    /// Draws the loss curve (`title` above it) to `plot` if given, whole or not at all.
    pub fn plot(&self, plot: Option<&Path>, title: &str) -> anyhow::Result<()> {
        let Some(plot) = plot else { return Ok(()) };
        let svg = crate::cli::plot::line_chart(title, ("step", "loss"), &self.points)
            .map_err(|e| anyhow::anyhow!("cannot draw --plot {}: {e}", plot.display()))?;
        super::outputs::write_atomically(plot, svg.as_bytes())
            .map_err(|e| anyhow::anyhow!("cannot write --plot {}: {e}", plot.display()))
    }
}

/// The step and loss of a line `record` wrote.
fn parse(line: &str) -> Option<(usize, f64)> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    // A non-finite loss is written as null.
    Some((usize::try_from(v.get("step")?.as_u64()?).ok()?, v.get("loss")?.as_f64().unwrap_or(f64::NAN)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_run_keeps_earlier_lines_drops_later_ones_and_appends() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("m.jsonl");
        let mut first = Metrics::open(Some(&path), None)?;
        for step in [0, 25, 50] {
            first.record(step, 1.0 / (step + 1) as f64, 0.5)?;
        }
        // Flushed line by line: a reader sees every line before the run ends.
        assert_eq!(std::fs::read_to_string(&path)?.lines().count(), 3);
        drop(first);
        // Resumed from a checkpoint after 30 steps: the line of step 50 came after it.
        let mut resumed = Metrics::open(Some(&path), Some(30))?;
        assert_eq!(resumed.points.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 25]);
        resumed.record(30, 0.1, 1.0)?;
        let steps: Vec<usize> = std::fs::read_to_string(&path)?.lines().filter_map(parse).map(|(s, _)| s).collect();
        assert_eq!(steps, [0, 25, 30]);
        Ok(())
    }

    #[test]
    fn a_foreign_file_is_not_overwritten_by_a_resumed_run() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("notes.txt");
        std::fs::write(&path, "my notes\n")?;
        assert!(Metrics::open(Some(&path), Some(10)).is_err());
        assert_eq!(std::fs::read_to_string(&path)?, "my notes\n");
        Ok(())
    }
}
