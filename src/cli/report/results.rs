//! The results folder: what each file holds, told by its name
//! (`<date>-<gpu>-<bench>[-<tag>]-<commit>.json`), and the newest run of each benchmark.
//!
//! The newest file of a benchmark is graphed's file (untagged, or tagged with anything but
//! `torch`) whose commit comes first in `git rev-list HEAD` of the repository holding the folder:
//! file times say nothing in a fresh clone, and the dates in names tie within a day. Files of
//! commits outside that history (another branch) are left out. The run's PyTorch side is its
//! files tagged `torch` or `torch-<…>` with the same commit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::bench::Bench;
use super::error::ReportError;

/// One results file, as its name describes it.
#[derive(Debug, Clone)]
pub struct ResultsFile {
    /// Where it is.
    pub path: PathBuf,
    /// Its file name.
    pub name: String,
    /// Its benchmark.
    pub bench: Bench,
    /// What follows the benchmark in its name: `torch-bf16`, a configuration such as `S`, …
    pub tag: Option<String>,
    /// The commit the run was built from, abbreviated as in the name.
    pub commit: String,
}

impl ResultsFile {
    /// Reads what the name of `path` says, refusing names that do not say it.
    fn parse(path: &Path) -> Result<ResultsFile, ReportError> {
        let bad = || ReportError::Name { file: path.to_path_buf() };
        let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(bad)?;
        let stem = name.strip_suffix(".json").ok_or_else(bad)?;
        let (rest, commit) = stem.rsplit_once('-').ok_or_else(bad)?;
        if commit.len() < 7 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let date = rest.get(..10).ok_or_else(bad)?;
        let dated =
            date.split('-').map(str::len).eq([4, 2, 2]) && date.bytes().all(|b| b == b'-' || b.is_ascii_digit());
        let (gpu, what) = rest[10..].strip_prefix('-').and_then(|r| r.split_once('-')).ok_or_else(bad)?;
        if !dated || gpu.is_empty() || what.is_empty() {
            return Err(bad());
        }
        let (bench, tag) = match what.split_once('-') {
            Some((bench, tag)) => (bench, Some(tag.to_string())),
            None => (what, None),
        };
        let bench = Bench::named(bench).ok_or_else(|| ReportError::UnknownBench {
            file: path.to_path_buf(),
            bench: bench.to_string(),
            known: Bench::ALL.map(Bench::name).join(", "),
        })?;
        Ok(ResultsFile { path: path.to_path_buf(), name: name.to_string(), bench, tag, commit: commit.to_string() })
    }

    /// Whether it holds PyTorch's side of a run.
    pub fn is_torch(&self) -> bool {
        self.tag.as_deref().is_some_and(|t| t == "torch" || t.starts_with("torch-"))
    }

    /// Reads it as `T`; an error names the field that does not fit.
    pub fn read<T: DeserializeOwned>(&self) -> Result<T, ReportError> {
        let text = std::fs::read_to_string(&self.path).map_err(ReportError::io(&self.path))?;
        let mut de = serde_json::Deserializer::from_str(&text);
        let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let field = e.path().to_string();
            let inner = e.into_inner();
            match inner.classify() {
                serde_json::error::Category::Data => ReportError::Field {
                    file: self.path.clone(),
                    field,
                    bench: self.bench.name(),
                    message: inner.to_string(),
                },
                _ => ReportError::Damaged { file: self.path.clone(), message: inner.to_string() },
            }
        })?;
        de.end().map_err(|e| ReportError::Damaged { file: self.path.clone(), message: e.to_string() })?;
        Ok(value)
    }
}

/// What every file graphed's `bench` writes holds, around its rows.
#[derive(Debug, Deserialize)]
pub struct Report<R> {
    /// The commit the binary was built from.
    pub commit: String,
    /// The GPU, its architecture and driver.
    pub device: String,
    /// Timed repetitions.
    pub reps: u32,
    /// The measurements.
    pub rows: Vec<R>,
}

impl<R> Report<R> {
    /// Reads graphed's file of `run`, refusing one without rows.
    pub fn of(run: &Run) -> Result<Report<R>, ReportError>
    where
        R: DeserializeOwned,
    {
        let report: Report<R> = run.ours.read()?;
        match report.rows.is_empty() {
            true => Err(ReportError::Empty { file: run.ours.path.clone() }),
            false => Ok(report),
        }
    }

    /// The commit and device, as a table's source line gives them.
    pub fn provenance(&self) -> String {
        format!("commit {}, {}", self.commit, self.device)
    }
}

/// The newest run of one benchmark.
#[derive(Debug)]
pub struct Run {
    /// Graphed's file.
    pub ours: ResultsFile,
    /// PyTorch's files of the same run.
    pub torch: Vec<ResultsFile>,
}

impl Run {
    /// The names of graphed's file and of `torch`, PyTorch's file that a figure read, if any: a
    /// figure's sources.
    pub fn sources(&self, torch: Option<&ResultsFile>) -> Vec<String> {
        std::iter::once(&self.ours).chain(torch).map(|f| f.name.clone()).collect()
    }

    /// PyTorch's file of the run in `dtype` (tagged `torch-<dtype>`), or its only one (tagged
    /// `torch`).
    pub fn torch_for(&self, dtype: &str) -> Option<&ResultsFile> {
        let tagged = format!("torch-{dtype}");
        self.torch.iter().find(|f| f.tag.as_deref().is_some_and(|t| t == tagged || t == "torch"))
    }
}

/// The newest run of every benchmark with results in `dir` (see the module's doc).
pub fn newest_runs(dir: &Path) -> Result<BTreeMap<Bench, Run>, ReportError> {
    // Before git is asked: outside the repository the folder is what is missing, not git.
    if !dir.is_dir() {
        return Err(ReportError::NoResults { dir: dir.to_path_buf() });
    }
    let history = history(dir)?;
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(ReportError::io(dir))? {
        let path = entry.map_err(ReportError::io(dir))?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == "json") {
            let file = ResultsFile::parse(&path)?;
            // Its place in the history: 0 is HEAD.
            if let Some(age) = history.iter().position(|c| c.starts_with(&file.commit)) {
                files.push((age, file));
            }
        }
    }
    files.sort_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
    let mut runs = BTreeMap::<Bench, (usize, Run)>::new();
    for (age, file) in files.iter().filter(|(_, f)| !f.is_torch()) {
        match runs.get(&file.bench) {
            Some((newest, run)) if newest == age => {
                return Err(ReportError::Tie {
                    bench: file.bench.name().to_string(),
                    commit: file.commit.clone(),
                    first: run.ours.name.clone(),
                    second: file.name.clone(),
                })
            }
            Some(_) => {}
            None => {
                runs.insert(file.bench, (*age, Run { ours: file.clone(), torch: Vec::new() }));
            }
        }
    }
    for (age, file) in files.into_iter().filter(|(_, f)| f.is_torch()) {
        if let Some((newest, run)) = runs.get_mut(&file.bench) {
            if *newest == age {
                run.torch.push(file);
            }
        }
    }
    Ok(runs.into_iter().map(|(bench, (_, run))| (bench, run)).collect())
}

/// The commits of HEAD's history, newest first, in the repository holding `dir`.
fn history(dir: &Path) -> Result<Vec<String>, ReportError> {
    Ok(git(dir, &["rev-list", "HEAD"])?.lines().map(str::to_string).collect())
}

/// The top folder of the repository holding the results folder `dir`: the pages' links to the
/// plots must stay inside it.
pub fn repository_root(dir: &Path) -> Result<PathBuf, ReportError> {
    Ok(PathBuf::from(git(dir, &["rev-parse", "--show-toplevel"])?.trim()))
}

/// What `git -C dir args` prints.
fn git(dir: &Path, args: &[&str]) -> Result<String, ReportError> {
    let failed = |reason: String| ReportError::History { dir: dir.to_path_buf(), reason };
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .map_err(|e| failed(format!("cannot run git: {e}")))?;
    if !out.status.success() {
        return Err(failed(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
impl Run {
    /// A run of `files` (name, contents; graphed's first, then PyTorch's) written to a fresh folder
    /// named after `test`.
    pub fn written(test: &str, files: &[(&str, &str)]) -> Run {
        let dir = std::env::temp_dir().join(format!("graphed-results-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut parsed = files.iter().map(|(name, text)| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            ResultsFile::parse(&path).unwrap()
        });
        let ours = parsed.next().expect("graphed's file");
        Run { ours, torch: parsed.collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_give_bench_tag_and_commit() {
        let f = ResultsFile::parse(Path::new("r/2026-12-01-h200-graphs-torch-bf16-a92ca49.json")).unwrap();
        assert_eq!(
            (f.bench, f.tag.as_deref(), f.commit.as_str(), f.is_torch()),
            (Bench::Graphs, Some("torch-bf16"), "a92ca49", true)
        );
        let f = ResultsFile::parse(Path::new("2026-11-29-h200-graphs-S-2746e2b.json")).unwrap();
        assert_eq!((f.tag.as_deref(), f.is_torch()), (Some("S"), false));
        let f = ResultsFile::parse(Path::new("2026-11-29-h200-alloc-9888d4a.json")).unwrap();
        assert_eq!((f.bench, f.tag), (Bench::Alloc, None));
    }

    #[test]
    fn names_that_do_not_say_it_are_refused() {
        for name in [
            "graphs.json",
            "2026-12-01-h200-graphs.json",
            "2026-12-01-h200-graphs-xyz1234.json",
            "26-12-01-h200-graphs-a92ca49.json",
            "2026-12-01-h200--a92ca49.json",
        ] {
            assert!(matches!(ResultsFile::parse(Path::new(name)), Err(ReportError::Name { .. })), "{name}");
        }
        let unknown = ResultsFile::parse(Path::new("2026-12-01-h200-sort-a92ca49.json"));
        assert!(matches!(unknown, Err(ReportError::UnknownBench { bench, .. }) if bench == "sort"));
    }
}
