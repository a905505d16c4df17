//! `graphed report` on a small repository of its own (a git history of three commits, results
//! files written here): the tables of the README and `docs/benchmarks.md` come from the newest
//! file by commit, each in every page that has its block, a second run changes nothing, `--check`
//! fails after a hand edit, and damaged files are typed errors that name the file and the field.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn graphed(dir: &Path, args: &[&str]) -> Output {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    Command::new(exe).current_dir(dir).arg("report").args(args).output().expect("the binary runs")
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .current_dir(dir)
        .args(["-c", "user.name=report", "-c", "user.email=report@localhost", "-c", "commit.gpgsign=false"])
        .args(args)
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A repository whose history is `commits[0]` (oldest) to `commits[2]` (HEAD), with a README
/// holding prose around an `alloc` block, a `docs/benchmarks.md` without blocks, and an empty
/// `bench/results/`.
struct Repo {
    dir: PathBuf,
    commits: Vec<String>,
}

impl Repo {
    fn new(name: &str) -> Repo {
        let dir = std::env::temp_dir().join(format!("graphed-report-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(dir.join("bench/results")).unwrap();
        std::fs::create_dir_all(dir.join("docs")).unwrap();
        git(&dir, &["init", "-q"]);
        let commits = (0..3)
            .map(|i| {
                git(&dir, &["commit", "-q", "--allow-empty", "-m", &format!("commit {i}")]);
                git(&dir, &["rev-parse", "HEAD"])
            })
            .collect();
        std::fs::write(dir.join("README.md"), README).unwrap();
        std::fs::write(dir.join("docs/benchmarks.md"), BENCHMARKS).unwrap();
        Repo { dir, commits }
    }

    /// Writes an `alloc` results file of `commit` whose rows are `rows` (JSON).
    fn alloc(&self, date: &str, commit: &str, rows: &str) -> PathBuf {
        let json = format!(
            r#"{{"bench": "alloc", "date": "{date}T00:00:00Z", "device": "Test GPU", "commit": "{}", "reps": 200,
                "rows": [{rows}]}}"#,
            &commit[..12]
        );
        let path = self.dir.join(format!("bench/results/{date}-h200-alloc-{}.json", &commit[..7]));
        std::fs::write(&path, json).unwrap();
        path
    }

    fn readme(&self) -> String {
        std::fs::read_to_string(self.dir.join("README.md")).unwrap()
    }

    fn benchmarks(&self) -> String {
        std::fs::read_to_string(self.dir.join("docs/benchmarks.md")).unwrap()
    }

    fn plot(&self) -> PathBuf {
        self.dir.join("bench/results/plots/alloc.svg")
    }
}

impl Drop for Repo {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// One `alloc` row: `cached_us` at 4 KiB (JSON, so that a test can put a string there).
fn row(cached_us: &str) -> String {
    format!(r#"{{"bytes": 4096, "cached_us": {cached_us}, "plain_us": 56.7}}"#)
}

const README: &str = "# A project\n\nProse before.\n\n<!-- report:alloc -->\n<!-- /report:alloc -->\n\nProse after.\n";
const BENCHMARKS: &str = "# Benchmarks\n\nNo blocks yet.\n";

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn tables_come_from_the_newest_file_by_commit_and_a_second_run_changes_nothing() {
    let repo = Repo::new("newest");
    // The newest commit's file has the older date: the history decides, not the name.
    repo.alloc("2026-01-01", &repo.commits[2], &row("0.25"));
    repo.alloc("2026-01-05", &repo.commits[1], &row("9.75"));
    let out = graphed(&repo.dir, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let readme = repo.readme();
    let name = format!("2026-01-01-h200-alloc-{}.json", &repo.commits[2][..7]);
    assert!(readme.contains("| 4 KiB | 0.25 | 56.7 |"), "{readme}");
    assert!(readme.contains(&format!("From `{name}` (commit {}, Test GPU)", &repo.commits[2][..12])), "{readme}");
    assert!(readme.contains("](bench/results/plots/alloc.svg)") && !readme.contains("9.75"), "{readme}");
    assert!(readme.starts_with("# A project\n\nProse before.\n\n<!-- report:alloc -->\n"), "{readme}");
    assert!(readme.ends_with("<!-- /report:alloc -->\n\nProse after.\n"), "{readme}");
    let svg = std::fs::read_to_string(repo.plot()).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("\n0.250\n") && svg.contains("\ncaching allocator\n"), "{svg}");

    let again = graphed(&repo.dir, &[]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!((repo.readme(), std::fs::read_to_string(repo.plot()).unwrap()), (readme, svg));
    let check = graphed(&repo.dir, &["--check"]);
    assert!(check.status.success(), "{}", stderr(&check));

    assert_eq!(repo.benchmarks(), BENCHMARKS, "a page without blocks is left as it was");

    // A file of a commit outside HEAD's history (another branch) is left out.
    std::fs::write(repo.dir.join("bench/results/2026-02-01-h200-alloc-0123456.json"), "{}").unwrap();
    assert!(graphed(&repo.dir, &["--check"]).status.success());
}

#[test]
fn check_fails_after_a_hand_edit_and_writes_nothing() {
    let repo = Repo::new("check");
    repo.alloc("2026-01-01", &repo.commits[2], &row("0.25"));
    assert!(graphed(&repo.dir, &[]).status.success());
    let edited = repo.readme().replace("| 4 KiB | 0.25 |", "| 4 KiB | 0.20 |");
    std::fs::write(repo.dir.join("README.md"), &edited).unwrap();
    std::fs::remove_file(repo.plot()).unwrap();
    let out = graphed(&repo.dir, &["--check"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("README.md block report:alloc") && err.contains("alloc.svg (missing)"), "{err}");
    assert!(err.contains("run `graphed report`"), "{err}");
    assert_eq!(repo.readme(), edited);
    assert!(!repo.plot().exists());
    // A newer run makes the committed table stale too.
    assert!(graphed(&repo.dir, &[]).status.success());
    git(&repo.dir, &["commit", "-q", "--allow-empty", "-m", "a newer run"]);
    let newer = git(&repo.dir, &["rev-parse", "HEAD"]);
    repo.alloc("2026-01-02", &newer, &row("0.5"));
    let out = graphed(&repo.dir, &["--check"]);
    assert!(!out.status.success() && stderr(&out).contains("report:alloc"), "{}", stderr(&out));
}

#[test]
fn a_block_is_filled_in_every_page_that_has_it_with_links_from_the_pages_folder() {
    let repo = Repo::new("pages");
    repo.alloc("2026-01-01", &repo.commits[2], &row("0.25"));
    let benchmarks = "# Benchmarks\n\n<!-- report:alloc -->\n<!-- /report:alloc -->\n";
    std::fs::write(repo.dir.join("docs/benchmarks.md"), benchmarks).unwrap();
    let out = graphed(&repo.dir, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (readme, docs) = (repo.readme(), repo.benchmarks());
    assert!(readme.contains("| 4 KiB | 0.25 | 56.7 |") && docs.contains("| 4 KiB | 0.25 | 56.7 |"), "{docs}");
    assert!(readme.contains("](bench/results/plots/alloc.svg)"), "{readme}");
    assert!(docs.contains("](../bench/results/plots/alloc.svg)"), "{docs}");
    assert!(graphed(&repo.dir, &["--check"]).status.success());

    // The block only in docs/benchmarks.md: the README is left alone.
    std::fs::write(repo.dir.join("README.md"), "# A project\n").unwrap();
    std::fs::write(repo.dir.join("docs/benchmarks.md"), benchmarks).unwrap();
    let out = graphed(&repo.dir, &["--check"]);
    assert!(stderr(&out).contains("docs/benchmarks.md block report:alloc"), "{}", stderr(&out));
    assert!(graphed(&repo.dir, &[]).status.success());
    assert_eq!((repo.readme(), repo.benchmarks()), ("# A project\n".to_string(), docs));

    // `--page` picks the pages; one outside the repository is refused.
    let out = graphed(&repo.dir, &["--page", "README.md"]);
    assert!(stderr(&out).contains("no `<!-- report:alloc -->` block") && stderr(&out).contains("in README.md"));
    let elsewhere = tempfile::tempdir().unwrap();
    let page = elsewhere.path().join("page.md");
    std::fs::write(&page, README).unwrap();
    let out = graphed(&repo.dir, &["--page", page.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("is not inside") && stderr(&out).contains("pass pages inside"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&page).unwrap(), README);
}

#[test]
fn damaged_files_are_typed_errors_naming_the_file_and_the_field() {
    let repo = Repo::new("damaged");
    let path = repo.alloc("2026-01-01", &repo.commits[2], &row(r#""fast""#));
    let out = graphed(&repo.dir, &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let name = path.file_name().unwrap().to_str().unwrap();
    assert!(err.contains(name) && err.contains("field `rows[0].cached_us`: invalid type: string"), "{err}");
    assert!(err.contains("graphed bench alloc") && !err.contains("panicked"), "{err}");
    let json = std::fs::read_to_string(repo.alloc("2026-01-01", &repo.commits[2], &row("0.25"))).unwrap();
    std::fs::write(&path, &json[..json.len() / 2]).unwrap();
    let err = stderr(&graphed(&repo.dir, &[]));
    assert!(err.contains(name) && err.contains("damaged JSON"), "{err}");
    repo.alloc("2026-01-01", &repo.commits[2], "");
    let err = stderr(&graphed(&repo.dir, &[]));
    assert!(err.contains("no rows to report"), "{err}");
    // Nothing was written on the way.
    assert_eq!(repo.readme(), README);
}

#[test]
fn a_bench_without_a_block_and_a_badly_named_file_are_refused() {
    let repo = Repo::new("blocks");
    repo.alloc("2026-01-01", &repo.commits[2], &row("0.25"));
    std::fs::write(repo.dir.join("README.md"), "# No blocks\n").unwrap();
    let err = stderr(&graphed(&repo.dir, &[]));
    assert!(err.contains("no `<!-- report:alloc -->` block"), "{err}");
    std::fs::write(repo.dir.join("README.md"), README).unwrap();
    std::fs::write(repo.dir.join("bench/results/alloc-latest.json"), "{}").unwrap();
    let err = stderr(&graphed(&repo.dir, &[]));
    assert!(err.contains("alloc-latest.json: not named `<date>-<gpu>-<bench>[-<tag>]-<commit>.json`"), "{err}");
}

/// Outside the repository the missing results folder is named, not git.
#[test]
fn outside_the_repository_the_missing_results_folder_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = graphed(dir.path(), &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("bench/results: no such results folder") && !err.contains("git checkout"), "{err}");
}
