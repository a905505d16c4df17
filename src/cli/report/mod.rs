//! `graphed report`: the README's performance tables and the benchmarks' plots, made from the
//! newest results file of each benchmark (`results.rs` says which is newest). The tables go
//! between the README's `<!-- report:<bench> -->` markers, each followed by the files it came
//! from and its plot, `<results>/plots/<bench>.svg`; `--check` writes nothing and fails if the
//! README or the plots differ from what it would write.

mod bench;
mod error;
mod figure;
mod readme;
mod results;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use error::ReportError;

use crate::cli::args::ReportArgs;

/// The plots' folder, inside the results folder.
const PLOTS: &str = "plots";

/// Writes (or, with `--check`, checks) the README's blocks and the plots.
pub fn run(args: &ReportArgs) -> Result<(), ReportError> {
    let runs = results::newest_runs(&args.results)?;
    let plots = args.results.join(PLOTS);
    let link = plots_link(&args.results, &args.readme)?;
    let mut blocks = BTreeMap::new();
    let mut svgs = BTreeMap::new();
    for (bench, run) in &runs {
        let figure = bench.figure(run)?;
        let svg = crate::cli::plot::bar_chart(&figure.chart)
            .map_err(|source| ReportError::Draw { bench: bench.name(), source })?;
        blocks.insert(bench.name(), figure.markdown(&format!("{link}/{}.svg", bench.name())));
        svgs.insert(plots.join(format!("{}.svg", bench.name())), svg);
    }
    let text = std::fs::read_to_string(&args.readme).map_err(ReportError::io(&args.readme))?;
    let spliced = readme::splice(&args.readme, &text, &blocks)?;
    let strays = stray_plots(&plots, &svgs)?;
    let mut stale: Vec<String> =
        spliced.changed.iter().map(|b| format!("{} block report:{b}", args.readme.display())).collect();
    for (path, svg) in &svgs {
        match std::fs::read_to_string(path) {
            Ok(old) if old == *svg => {}
            Ok(_) => stale.push(path.display().to_string()),
            Err(_) => stale.push(format!("{} (missing)", path.display())),
        }
    }
    stale.extend(strays.iter().map(|p| format!("{} (no benchmark draws it)", p.display())));
    if args.check {
        if !stale.is_empty() {
            return Err(ReportError::Stale { stale });
        }
        println!("the README's {} blocks and their plots are up to date", blocks.len());
        return Ok(());
    }
    std::fs::create_dir_all(&plots).map_err(ReportError::io(&plots))?;
    for (path, svg) in &svgs {
        std::fs::write(path, svg).map_err(ReportError::io(path))?;
    }
    for path in &strays {
        std::fs::remove_file(path).map_err(ReportError::io(path))?;
    }
    std::fs::write(&args.readme, spliced.text).map_err(ReportError::io(&args.readme))?;
    match stale.is_empty() {
        true => println!("the README's {} blocks and their plots were up to date", blocks.len()),
        false => println!("wrote {}", stale.join(", ")),
    }
    Ok(())
}

/// The plots' folder as the README links it: relative to the README's folder, which must hold
/// the results folder.
fn plots_link(results: &Path, readme: &Path) -> Result<String, ReportError> {
    let outside = || ReportError::Outside { results: results.to_path_buf(), readme: readme.to_path_buf() };
    let base = match readme.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let base = base.canonicalize().map_err(ReportError::io(base))?;
    let results = results.canonicalize().map_err(ReportError::io(results))?;
    let inside = results.strip_prefix(&base).map_err(|_| outside())?;
    let parts: Option<Vec<&str>> = inside.components().map(|c| c.as_os_str().to_str()).collect();
    let mut parts = parts.ok_or_else(outside)?;
    parts.push(PLOTS);
    Ok(parts.join("/"))
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
