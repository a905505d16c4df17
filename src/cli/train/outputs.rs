//! The files a run writes (`--save`, `--metrics`, `--plot`), checked before anything runs: each
//! must be writable, and no two of them (nor the `--data` file they would overwrite) may be the
//! same file. The checks write nothing the user can see: a temporary file is made beside each
//! output and removed, so a refused run leaves every file as it was.

use std::path::{Path, PathBuf};

use crate::cli::args::TrainArgs;
use crate::cli::exit::refuse;

use super::checkpoint;

/// A file the run reads or writes, under the flag that names it.
struct Named<'a> {
    flag: &'static str,
    path: &'a Path,
    /// The file itself: the checkpoint inside a `--save` or `--resume` folder.
    file: PathBuf,
}

/// Refuses the run unless every output can be written and no two paths name one file (a run
/// may save where it resumed from: that is how a run continues).
pub fn check(args: &TrainArgs) -> anyhow::Result<()> {
    if let Some(dir) = &args.save {
        writable_dir("--save", dir)?;
    }
    for (flag, path) in [("--metrics", &args.metrics), ("--plot", &args.plot)] {
        if let Some(p) = path {
            writable_file(flag, p)?;
        }
    }
    let named: Vec<Named> = [
        args.save.as_deref().map(|d| ("--save", d, checkpoint::file(d))),
        args.resume.as_deref().map(|d| ("--resume", d, checkpoint::file(d))),
        args.metrics.as_deref().map(|p| ("--metrics", p, p.to_path_buf())),
        args.plot.as_deref().map(|p| ("--plot", p, p.to_path_buf())),
        args.data.as_deref().map(|p| ("--data", p, p.to_path_buf())),
    ]
    .into_iter()
    .flatten()
    .map(|(flag, path, file)| Named { flag, path, file: identity(&file) })
    .collect();
    for (i, a) in named.iter().enumerate() {
        for b in &named[i + 1..] {
            let continuing = matches!((a.flag, b.flag), ("--save", "--resume"));
            if a.file == b.file && !continuing {
                refuse!(
                    "{} {} and {} {} are the same file ({}); give each its own",
                    a.flag,
                    a.path.display(),
                    b.flag,
                    b.path.display(),
                    a.file.display()
                );
            }
        }
    }
    Ok(())
}

/// `dir` is (or can be made) a folder in which a file can be written.
fn writable_dir(flag: &str, dir: &Path) -> anyhow::Result<()> {
    if dir.exists() && !dir.is_dir() {
        refuse!("{flag} {} is a file, not a folder; pass a folder for the checkpoint", dir.display());
    }
    if let Err(e) = std::fs::create_dir_all(dir) {
        refuse!("cannot make the folder {flag} {}: {e}; pass a folder you can write", dir.display());
    }
    if let Err(e) = tempfile::NamedTempFile::new_in(dir) {
        refuse!("cannot write in {flag} {}: {e}; pass a folder you can write", dir.display());
    }
    Ok(())
}

/// `file` can be written: not a folder, in a folder that takes new files (also a benchmark's
/// `--json`, checked before it runs).
pub(crate) fn writable_file(flag: &str, file: &Path) -> anyhow::Result<()> {
    if file.is_dir() {
        refuse!("{flag} {} is a folder; pass a file name", file.display());
    }
    let parent = folder_of(file);
    if !parent.is_dir() {
        refuse!("{flag} {}: the folder {} does not exist; make it first", file.display(), parent.display());
    }
    if let Err(e) = tempfile::NamedTempFile::new_in(parent) {
        refuse!("cannot write {flag} {}: {e}; pass a path you can write", file.display());
    }
    if file.exists() {
        if let Err(e) = std::fs::OpenOptions::new().append(true).open(file) {
            refuse!("cannot write {flag} {}: {e}; pass a path you can write", file.display());
        }
    }
    Ok(())
}

/// The folder holding `file` (`.` for a bare name).
fn folder_of(file: &Path) -> &Path {
    match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A path that is the same for every way of naming one file (through `..`, links, a relative
/// path), whether the file exists yet or not: its folder resolved, then its name.
fn identity(file: &Path) -> PathBuf {
    if let Ok(p) = file.canonicalize() {
        return p;
    }
    let folder = folder_of(file).canonicalize().unwrap_or_else(|_| folder_of(file).to_path_buf());
    match file.file_name() {
        Some(name) => folder.join(name),
        None => folder,
    }
}

/// Writes `bytes` to `path` whole or not at all: to a temporary file beside it, renamed over it.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = tempfile::NamedTempFile::new_in(folder_of(path))?;
    std::io::Write::write_all(&mut tmp, bytes)?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::args::{Cli, Command};

    /// `train` parsed with `extra` arguments.
    pub(in crate::cli::train) fn train_args(extra: &[&str]) -> TrainArgs {
        let argv = ["graphed", "train"].iter().chain(extra).copied();
        match Cli::parse_from(argv).command {
            Command::Train(a) => a,
            _ => unreachable!("parsed `train`"),
        }
    }

    fn refusal(extra: &[&str]) -> String {
        check(&train_args(extra)).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn outputs_that_cannot_be_written_are_refused_naming_the_flag_and_path() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("f");
        std::fs::write(&file, "keep")?;
        let under_file = file.join("x");
        let (f, u) = (file.to_str().unwrap_or_default(), under_file.to_str().unwrap_or_default());
        assert!(refusal(&["--save", f]).contains(&format!("--save {f} is a file")));
        assert!(refusal(&["--save", u]).contains(&format!("--save {u}")));
        assert!(refusal(&["--metrics", u]).contains(&format!("--metrics {u}")));
        assert!(refusal(&["--plot", dir.path().to_str().unwrap_or_default()]).contains("is a folder"));
        // Nothing was changed by the checks.
        assert_eq!(std::fs::read_to_string(&file)?, "keep");
        assert_eq!(std::fs::read_dir(dir.path())?.count(), 1);
        Ok(())
    }

    #[test]
    fn two_outputs_naming_one_file_are_refused_but_saving_where_resumed_is_not() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let m = dir.path().join("m.jsonl");
        let (m, d) = (m.to_str().unwrap_or_default(), dir.path().to_str().unwrap_or_default());
        let other_name = format!("{d}/../{}/m.jsonl", dir.path().file_name().and_then(|n| n.to_str()).unwrap_or(""));
        assert!(refusal(&["--metrics", m, "--plot", &other_name]).contains("are the same file"));
        assert!(refusal(&["--metrics", m, "--data", m]).contains("--metrics"));
        let ckpt = format!("{d}/checkpoint.safetensors");
        assert!(refusal(&["--save", d, "--plot", &ckpt]).contains("are the same file"));
        check(&train_args(&["--save", d, "--resume", d, "--metrics", m]))?;
        Ok(())
    }

    #[test]
    fn an_atomic_write_replaces_the_file_whole() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let p = dir.path().join("plot.svg");
        std::fs::write(&p, "old")?;
        write_atomically(&p, b"new")?;
        assert_eq!(std::fs::read_to_string(&p)?, "new");
        assert_eq!(std::fs::read_dir(dir.path())?.count(), 1);
        Ok(())
    }
}
