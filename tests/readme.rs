//! The README stays a front door that holds: every `graphed` command its code blocks show parses
//! (the built binary given the command's arguments and `--help`), every relative link in it and in
//! `docs/` leads to a file of the repository (and to a heading of that file when it names one),
//! and it stays short.
//!
//! The pages are found at run time, from the current directory (cargo and nextest run tests at
//! the package's root), so that a test archive built elsewhere reads the checkout it runs in.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root: the current directory or the nearest folder above it with a
/// `Cargo.toml`.
fn root() -> PathBuf {
    let here = std::env::current_dir().expect("a current directory");
    let found = here.ancestors().find(|d| d.join("Cargo.toml").is_file());
    found.unwrap_or_else(|| panic!("no Cargo.toml in {} or above it", here.display())).to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The pages whose links must resolve: the README, `docs/*.md` and the results folder's README.
fn pages(root: &Path) -> Vec<PathBuf> {
    let mut pages = vec![root.join("README.md"), root.join("bench/results/README.md")];
    let docs = std::fs::read_dir(root.join("docs")).expect("a docs/ folder");
    let mut docs: Vec<PathBuf> =
        docs.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "md")).collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The lines inside the fenced code blocks of `text`, and the lines outside them.
fn split_fences(text: &str) -> (Vec<&str>, Vec<&str>) {
    let (mut inside, mut outside, mut fenced) = (Vec::new(), Vec::new(), false);
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            inside.push(line);
        } else {
            outside.push(line);
        }
    }
    (inside, outside)
}

/// The arguments of each `graphed` command in the code blocks of `text`: a line
/// `cargo run [cargo's flags] -- ARGS`, or `graphed ARGS`, up to a `#` comment.
fn commands(text: &str) -> Vec<Vec<String>> {
    let mut commands = Vec::new();
    for line in split_fences(text).0 {
        let line = line.split(" #").next().unwrap_or_default();
        let words: Vec<&str> = line.split_whitespace().collect();
        let args = match words.as_slice() {
            ["cargo", "run", rest @ ..] => match rest.iter().position(|w| *w == "--") {
                Some(at) => &rest[at + 1..],
                None => continue, // an example or another binary
            },
            ["graphed", rest @ ..] => rest,
            _ => continue,
        };
        commands.push(args.iter().map(|w| w.to_string()).collect());
    }
    commands
}

/// Whether `graphed ARGS --help` succeeds, with what it printed: the subcommands and flags of
/// ARGS exist and each flag has its value. Arguments after a bare `--` (what `launch` runs) are
/// a command of their own.
fn parses(args: &[String]) -> Result<(), String> {
    let (own, tail) = match args.iter().position(|a| a == "--") {
        Some(at) => (&args[..at], Some(&args[at + 1..])),
        None => (args, None),
    };
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    let out = Command::new(exe).args(own).arg("--help").output().expect("the binary runs");
    let said = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || !String::from_utf8_lossy(&out.stdout).contains("Usage:") {
        return Err(format!("`graphed {} --help`: {}", own.join(" "), said.trim()));
    }
    tail.map_or(Ok(()), parses)
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of the headings of `text` (a repeated heading's later ones with `-1`, `-2`, …).
fn anchors(text: &str) -> HashSet<String> {
    let mut anchors = HashSet::new();
    for line in split_fences(text).1 {
        let Some(heading) = line.strip_prefix('#') else { continue };
        let base = slug(heading.trim_start_matches('#'));
        let mut anchor = base.clone();
        for n in 1.. {
            if anchors.insert(anchor.clone()) {
                break;
            }
            anchor = format!("{base}-{n}");
        }
    }
    anchors
}

/// The targets of the Markdown links and images of `text` outside code: `[…](target)`.
fn links(text: &str) -> Vec<String> {
    let mut links = Vec::new();
    for line in split_fences(text).1 {
        // Inline code may show link syntax without being a link.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            links.push(rest[..end].trim().to_string());
            rest = &rest[end..];
        }
    }
    links
}

/// Every relative link of the page at `page` (whose text is `text`) that does not lead to a file
/// inside `root`, or to a heading of it when the link names one, with why.
fn broken_links(root: &Path, page: &Path, text: &str) -> Vec<String> {
    let mut broken = Vec::new();
    let folder = page.parent().expect("a page's folder");
    for link in links(text) {
        if link.contains("://") || link.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match link.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (link.as_str(), None),
        };
        let target = if path.is_empty() { page.to_path_buf() } else { folder.join(path) };
        let inside = target.canonicalize().is_ok_and(|t| t.starts_with(root.canonicalize().unwrap()));
        if !inside {
            broken.push(format!("{}: `{link}` leads to no file of the repository", page.display()));
            continue;
        }
        if let Some(anchor) = anchor.filter(|_| target.extension().is_some_and(|e| e == "md")) {
            // A link within the page names a heading of the text given, not of the file on disk.
            let headings = if path.is_empty() { anchors(text) } else { anchors(&read(&target)) };
            if !headings.contains(anchor) {
                broken.push(format!("{}: `{link}`: {} has no heading `#{anchor}`", page.display(), target.display()));
            }
        }
    }
    broken
}

#[test]
fn every_command_the_readme_shows_parses() {
    let readme = read(&root().join("README.md"));
    let commands = commands(&readme);
    assert!(commands.len() >= 5, "the README's code blocks show only {commands:?}");
    assert!(
        commands.iter().any(|c| c == &["train"]),
        "the README lost its first command, `cargo run --release -- train`"
    );
    let failures: Vec<String> = commands.iter().filter_map(|c| parses(c).err()).collect();
    assert!(failures.is_empty(), "commands in README.md that do not parse:\n{}", failures.join("\n"));
}

#[test]
fn every_relative_link_of_the_readme_and_the_docs_resolves() {
    let root = root();
    let mut broken = Vec::new();
    let mut count = 0;
    for page in pages(&root) {
        let text = read(&page);
        count += links(&text).len();
        broken.extend(broken_links(&root, &page, &text));
    }
    assert!(count >= 10, "only {count} links found: the link parser is broken");
    assert!(broken.is_empty(), "links that do not resolve:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_stays_a_front_door() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(lines <= 300, "README.md has {lines} lines; move details to docs/ (at most 300)");
    assert!(readme.contains("cargo run --release -- train") && readme.contains("\ncargo test"), "the two commands");
    let tables = readme.matches("<!-- report:").count();
    assert_eq!(tables, 1, "the README holds one generated table (graphs); the others live in docs/benchmarks.md");
}

/// The checks see what they are for: a flag without its value, an unknown subcommand, a missing
/// file and a missing heading are caught.
#[test]
fn the_checks_catch_a_bad_command_and_a_broken_link() {
    let planted = "```sh\ncargo run --release -- train --plot  # no file\ngraphed trian\n```\n";
    let found = commands(planted);
    assert_eq!(found, [vec!["train".to_string(), "--plot".into()], vec!["trian".into()]]);
    assert!(parses(&found[0]).unwrap_err().contains("--plot"), "{:?}", parses(&found[0]));
    assert!(parses(&found[1]).is_err());
    assert!(parses(&["launch".into(), "--gpus".into(), "2".into(), "--".into(), "train".into()]).is_ok());
    assert!(parses(&["launch".into(), "--".into(), "trian".into()]).is_err());

    let root = root();
    let page = root.join("README.md");
    let text = "# Top\n[ok](docs/train.md#exit-codes) [gone](DESIGN.md) [no heading](docs/train.md#nowhere) \
                [here](#top) `[code](nowhere.md)` [web](https://example.com)\n";
    let broken = broken_links(&root, &page, text);
    assert_eq!(broken.len(), 2, "{broken:?}");
    assert!(broken[0].contains("`DESIGN.md` leads to no file") && broken[1].contains("no heading `#nowhere`"));
    assert_eq!(slug(" The replay rules R1–R9"), "the-replay-rules-r1r9");
    assert_eq!(slug("`graphed train`: what a run promises"), "graphed-train-what-a-run-promises");
}
