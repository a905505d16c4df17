//! What can go wrong in `graphed report`: each error names the file and says what to do.

use std::path::PathBuf;

/// An error of `graphed report`.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    // ---- files and git --------------------------------------------------------------------------
    /// A file or folder could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The results folder does not exist (`report` was run outside the repository).
    #[error(
        "{}: no such results folder; run `graphed report` at the root of the graphed repository, or pass --results DIR",
        dir.display()
    )]
    NoResults {
        /// The folder.
        dir: PathBuf,
    },
    /// The order of commits, or the repository's top folder, could not be read from git.
    #[error(
        "cannot read the repository's history (git in {}): {reason}; run `graphed report` in a git checkout of the \
         repository with its history (not a shallow clone)",
        dir.display()
    )]
    History {
        /// The results folder, where git ran.
        dir: PathBuf,
        /// Why it failed.
        reason: String,
    },

    // ---- results files --------------------------------------------------------------------------
    /// A `.json` file of the results folder whose name does not say its benchmark and commit.
    #[error(
        "{}: not named `<date>-<gpu>-<bench>[-<tag>]-<commit>.json` (e.g. 2026-12-01-h200-graphs-a92ca49.json); \
         rename it",
        file.display()
    )]
    Name {
        /// The file.
        file: PathBuf,
    },
    /// A results file of a benchmark that `report` has no table for.
    #[error(
        "{}: `graphed report` has no table for benchmark `{bench}` (it knows {known}); add one under \
         src/cli/report/bench/ or move the file out of the results folder",
        file.display()
    )]
    UnknownBench {
        /// The file.
        file: PathBuf,
        /// The benchmark its name gives.
        bench: String,
        /// The benchmarks `report` knows.
        known: String,
    },
    /// Two results files of graphed's side of one benchmark come from one commit, so neither is
    /// the newest.
    #[error(
        "{first} and {second} are both `{bench}` results of commit {commit}; keep one, or tag PyTorch's side \
         `-torch-…`"
    )]
    Tie {
        /// The benchmark.
        bench: String,
        /// The commit both names give.
        commit: String,
        /// One file's name.
        first: String,
        /// The other's.
        second: String,
    },
    /// A results file that is not JSON, or is cut short.
    #[error("{}: damaged JSON ({message}); restore it from git or run the benchmark again", file.display())]
    Damaged {
        /// The file.
        file: PathBuf,
        /// What the parser said, with the line and column.
        message: String,
    },
    /// A field that is missing or of another type than `graphed bench` writes.
    #[error(
        "{}: field `{field}`: {message}; this is not what `graphed bench {bench}` writes: fix the file or run the \
         benchmark again",
        file.display()
    )]
    Field {
        /// The file.
        file: PathBuf,
        /// The field's path, e.g. `rows[2].wall_ms.median`.
        field: String,
        /// The benchmark.
        bench: &'static str,
        /// What the parser said.
        message: String,
    },
    /// A results file with no rows.
    #[error("{}: no rows to report; run the benchmark again", file.display())]
    Empty {
        /// The file.
        file: PathBuf,
    },

    // ---- pages ----------------------------------------------------------------------------------
    /// No page has the block of a benchmark that has results.
    #[error(
        "no `<!-- report:{bench} -->` block for the `{bench}` results in {pages}; add the lines \
         `<!-- report:{bench} -->` and `<!-- /report:{bench} -->` where its table belongs"
    )]
    MissingBlock {
        /// The pages searched, comma-separated.
        pages: String,
        /// The benchmark.
        bench: String,
    },
    /// A page's block that is not closed, is repeated, or names a benchmark without results.
    #[error("{}: the `<!-- report:{bench} -->` block {problem}", page.display())]
    BadBlock {
        /// The page.
        page: PathBuf,
        /// The name in the marker.
        bench: String,
        /// What is wrong and what to do.
        problem: &'static str,
    },
    /// A page outside the repository that holds the results folder, whose links to the plots
    /// would leave the repository.
    #[error(
        "{} is not inside {}, the repository of the results folder; its links to the plots would leave it: pass \
         pages inside the repository",
        page.display(),
        root.display()
    )]
    Outside {
        /// The page.
        page: PathBuf,
        /// The repository's top folder.
        root: PathBuf,
    },

    // ---- what report writes ---------------------------------------------------------------------
    /// A plot that plotters could not draw.
    #[error("cannot draw the plot of `{bench}`: {source}")]
    Draw {
        /// The benchmark.
        bench: &'static str,
        /// Plotters' error.
        source: crate::cli::plot::DrawError,
    },
    /// `--check`: the pages or the plots are not what `report` writes.
    #[error(
        "not what `graphed report` writes: {}; run `graphed report` and commit what it writes",
        stale.join(", ")
    )]
    Stale {
        /// Each page's block or plot that differs, e.g. `README.md block report:graphs`.
        stale: Vec<String>,
    },
}

impl ReportError {
    /// An I/O error on `path`.
    pub fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> ReportError + '_ {
        move |source| ReportError::Io { path: path.to_path_buf(), source }
    }
}
