//! The pages' generated blocks: the lines between `<!-- report:<bench> -->` and
//! `<!-- /report:<bench> -->`, each rewritten whole; everything outside them is left as it is.

use std::collections::BTreeMap;
use std::path::Path;

use super::error::ReportError;

/// A page with its blocks rewritten.
#[derive(Debug)]
pub struct Spliced {
    /// The new text.
    pub text: String,
    /// The benchmarks whose blocks changed, in the page's order.
    pub changed: Vec<String>,
    /// The benchmarks that have a block, in the page's order.
    pub placed: Vec<String>,
}

/// Rewrites each block of `text` (the page at `page`) with `blocks[bench]`. Every block needs a
/// benchmark of `blocks` and may appear once; a page need not have every benchmark's block
/// (the caller checks that each has one somewhere).
pub fn splice(page: &Path, text: &str, blocks: &BTreeMap<&str, String>) -> Result<Spliced, ReportError> {
    let bad = |bench: &str, problem| ReportError::BadBlock { page: page.to_path_buf(), bench: bench.into(), problem };
    let mut out = String::with_capacity(text.len());
    let mut changed = Vec::new();
    let mut placed: Vec<String> = Vec::new();
    let mut lines = text.split_inclusive('\n');
    while let Some(line) = lines.next() {
        out.push_str(line);
        let Some(bench) = marker(line, "report:") else { continue };
        let block = blocks.get(bench).ok_or_else(|| {
            bad(
                bench,
                "names a benchmark with no results file in HEAD's history; remove the block or commit its results",
            )
        })?;
        if placed.iter().any(|p| p == bench) {
            return Err(bad(bench, "appears twice; keep one"));
        }
        let mut old = String::new();
        let end = loop {
            match lines.next() {
                Some(l) if marker(l, "/report:") == Some(bench) => break l,
                Some(l) => old.push_str(l),
                None => return Err(bad(bench, "is not closed; add `<!-- /report:NAME -->` after it")),
            }
        };
        let new = format!("{block}\n");
        if old != new {
            changed.push(bench.to_string());
        }
        out.push_str(&new);
        out.push_str(end);
        placed.push(bench.to_string());
    }
    Ok(Spliced { text: out, changed, placed })
}

/// The name in a marker line `<!-- {prefix}NAME -->`.
fn marker<'a>(line: &'a str, prefix: &str) -> Option<&'a str> {
    line.trim().strip_prefix("<!-- ")?.strip_suffix(" -->")?.strip_prefix(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks() -> BTreeMap<&'static str, String> {
        BTreeMap::from([("gemm", "| new |".to_string())])
    }

    #[test]
    fn only_the_blocks_change() {
        let text = "prose\n<!-- report:gemm -->\n| old |\n<!-- /report:gemm -->\nmore prose\n";
        let s = splice(Path::new("R.md"), text, &blocks()).unwrap();
        assert_eq!(s.text, "prose\n<!-- report:gemm -->\n| new |\n<!-- /report:gemm -->\nmore prose\n");
        assert_eq!(s.changed, ["gemm"]);
        assert_eq!(s.placed, ["gemm"]);
        let again = splice(Path::new("R.md"), &s.text, &blocks()).unwrap();
        assert_eq!((again.text, again.changed.len()), (s.text, 0));
        let none = splice(Path::new("R.md"), "prose\n", &blocks()).unwrap();
        assert_eq!((none.text.as_str(), none.placed.len()), ("prose\n", 0));
    }

    #[test]
    fn blocks_unclosed_repeated_or_unknown_are_refused() {
        let refused = |text: &str| splice(Path::new("R.md"), text, &blocks()).unwrap_err();
        assert!(
            matches!(refused("<!-- report:gemm -->\n| old |\n"), ReportError::BadBlock { problem, .. } if problem.contains("not closed"))
        );
        let twice = "<!-- report:gemm -->\n<!-- /report:gemm -->\n<!-- report:gemm -->\n<!-- /report:gemm -->\n";
        assert!(matches!(refused(twice), ReportError::BadBlock { problem, .. } if problem.contains("twice")));
        let unknown = "<!-- report:gemm -->\n<!-- /report:gemm -->\n<!-- report:sort -->\n<!-- /report:sort -->\n";
        assert!(matches!(refused(unknown), ReportError::BadBlock { bench, .. } if bench == "sort"));
    }
}
