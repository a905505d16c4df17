//! The binary's `inspect` and `bench graphs` on the simulator: they graph a stack of transformer
//! layers end to end, so these catch a CLI that no longer runs against the graph API.

use std::path::PathBuf;
use std::process::Command;

/// Runs the binary with `args`; returns its stdout, failing with its stderr if it failed.
fn graphed(args: &[&str]) -> String {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    let out = Command::new(exe).args(args).output().expect("the binary runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "graphed {args:?} failed:\n{stderr}\n{stdout}");
    stdout.into_owned()
}

/// A fresh directory of its own under the system's temporary directory.
fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_nanos();
    let dir = std::env::temp_dir().join(format!("graphed-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("the temporary directory is writable");
    dir
}

#[test]
fn inspect_reports_every_graph_and_writes_dot_files() {
    let dir = temp_dir("inspect");
    let out = graphed(&["inspect", "--device", "sim", "--side-stream", "--dot", dir.to_str().expect("a UTF-8 path")]);
    // The simulator's default configuration, `tiny`, has two layers.
    for layer in 0..2 {
        for pass in ["Forward", "Backward"] {
            let name = format!("TransformerLayer#{layer} (layer{layer}) {pass}");
            let line = out.lines().find(|l| l.trim_start().starts_with(&name));
            let line = line.unwrap_or_else(|| panic!("no line for {name} in:\n{out}"));
            // Captured with a sync event: every graph records it.
            assert!(!line.ends_with("records none"), "{name} records no event: {line}");
            let dot = dir.join(format!("TransformerLayer_{layer}_layer{layer}-{pass}.dot"));
            let text = std::fs::read_to_string(&dot).unwrap_or_else(|e| panic!("{}: {e}", dot.display()));
            assert!(text.starts_with("digraph"), "{} is not DOT: {}", dot.display(), &text[..text.len().min(80)]);
        }
    }
    assert!(out.contains("replay order: "), "no replay order in:\n{out}");
    std::fs::remove_dir_all(&dir).expect("the temporary directory can be removed");
}

#[test]
fn bench_graphs_runs_every_variant_on_the_simulator() {
    let out = graphed(&["bench", "graphs", "--device", "sim", "--configs", "tiny", "--steps", "2", "--warmup", "1"]);
    for variant in ["graphed-eager", "graphed", "graphed-side", "graphed-offload", "graphed-whole", "graphed-floor"] {
        assert!(out.lines().any(|l| l.split_whitespace().next() == Some(variant)), "no row for {variant} in:\n{out}");
    }
}
