//! `graphed report`: the performance tables of the README and of `docs/benchmarks.md`, and the
//! benchmarks' plots, made from the newest results file of each benchmark (`results.rs` says
//! which is newest). A benchmark's table goes between the `<!-- report:<bench> -->` markers of
//! every page that has them (each benchmark needs them in one page at least), followed by the
//! files it came from and its plot, `<results>/plots/<bench>.svg`, linked from the page's folder;
//! `--check` writes nothing and fails if a page or a plot differs from what it would write.

mod bench;
mod error;
mod figure;
mod pages;
mod results;

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

pub use error::ReportError;

use crate::cli::args::ReportArgs;

/// The plots' folder, inside the results folder.
const PLOTS: &str = "plots";

/// Writes (or, with `--check`, checks) the pages' blocks and the plots.
pub fn run(args: &ReportArgs) -> Result<(), ReportError> {
    let runs = results::newest_runs(&args.results)?;
    let plots = args.results.join(PLOTS);
    let root = results::repository_root(&args.results)?;
    let mut figures = BTreeMap::new();
    let mut svgs = BTreeMap::new();
    for (bench, run) in &runs {
        let figure = bench.figure(run)?;
        let svg = crate::cli::plot::bar_chart(&figure.chart)
            .map_err(|source| ReportError::Draw { bench: bench.name(), source })?;
        svgs.insert(plots.join(format!("{}.svg", bench.name())), svg);
        figures.insert(bench.name(), figure);
    }
    let mut stale = Vec::new();
    let mut written = Vec::new();
    let mut placed = Vec::new();
    for page in &args.pages {
        let link = plots_link(&root, &args.results, page)?;
        let blocks = figures.iter().map(|(name, f)| (*name, f.markdown(&format!("{link}/{name}.svg")))).collect();
        let text = std::fs::read_to_string(page).map_err(ReportError::io(page))?;
        let spliced = pages::splice(page, &text, &blocks)?;
        stale.extend(spliced.changed.iter().map(|b| format!("{} block report:{b}", page.display())));
        placed.extend(spliced.placed);
        written.push((page, spliced.text));
    }
    if let Some(missing) = figures.keys().find(|b| !placed.iter().any(|p| p == *b)) {
        let pages = args.pages.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
        return Err(ReportError::MissingBlock { pages, bench: missing.to_string() });
    }
    let strays = stray_plots(&plots, &svgs)?;
    for (path, svg) in &svgs {
        match std::fs::read_to_string(path) {
            Ok(old) if old == *svg => {}
            Ok(_) => stale.push(path.display().to_string()),
            Err(_) => stale.push(format!("{} (missing)", path.display())),
        }
    }
    stale.extend(strays.iter().map(|p| format!("{} (no benchmark draws it)", p.display())));
    let what = format!("the {} blocks of {} pages and their plots", placed.len(), args.pages.len());
    if args.check {
        if !stale.is_empty() {
            return Err(ReportError::Stale { stale });
        }
        println!("{what} are up to date");
        return Ok(());
    }
    std::fs::create_dir_all(&plots).map_err(ReportError::io(&plots))?;
    for (path, svg) in &svgs {
        std::fs::write(path, svg).map_err(ReportError::io(path))?;
    }
    for path in &strays {
        std::fs::remove_file(path).map_err(ReportError::io(path))?;
    }
    for (page, text) in &written {
        std::fs::write(page, text).map_err(ReportError::io(page))?;
    }
    match stale.is_empty() {
        true => println!("{what} were up to date"),
        false => println!("wrote {}", stale.join(", ")),
    }
    Ok(())
}

/// The plots' folder as `page` links it: relative to the page's folder, both inside the
/// repository whose top folder is `root`.
fn plots_link(root: &Path, results: &Path, page: &Path) -> Result<String, ReportError> {
    let outside = || ReportError::Outside { page: page.to_path_buf(), root: root.to_path_buf() };
    let base = match page.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let root = root.canonicalize().map_err(ReportError::io(root))?;
    let base = base.canonicalize().map_err(ReportError::io(base))?;
    let results = results.canonicalize().map_err(ReportError::io(results))?;
    let (Ok(base), Ok(results)) = (base.strip_prefix(&root), results.strip_prefix(&root)) else {
        return Err(outside());
    };
    // Up from the page's folder to the root, then down to the results.
    let up = base.components().map(|_| Some(".."));
    let down = results.components().map(|c| match c {
        Component::Normal(name) => name.to_str(),
        _ => None,
    });
    let parts: Option<Vec<&str>> = up.chain(down).chain([Some(PLOTS)]).collect();
    Ok(parts.ok_or_else(outside)?.join("/"))
}

/// SVG files in the plots' folder that no benchmark draws (left by a benchmark no longer
/// reported).
fn stray_plots(plots: &Path, svgs: &BTreeMap<PathBuf, String>) -> Result<Vec<PathBuf>, ReportError> {
    let Ok(entries) = std::fs::read_dir(plots) else { return Ok(Vec::new()) };
    let mut strays = Vec::new();
    for entry in entries {
        let path = entry.map_err(ReportError::io(plots))?.path();
        if path.extension().is_some_and(|e| e == "svg") && !svgs.contains_key(&path) {
            strays.push(path);
        }
    }
    strays.sort();
    Ok(strays)
}
