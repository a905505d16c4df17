//! The binary's `inspect`, `bench graphs` and `bench rebind` on the simulator: they graph transformer
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
    // Without dropout the first residual add reads the input in a GEMM's epilogue.
    assert!(out.contains("the input copied in, the upstream gradient "), "no in-place line in:\n{out}");
    std::fs::remove_dir_all(&dir).expect("the temporary directory can be removed");
}

/// `graphed bench graphs` of the tiny configuration on the simulator, with `more` arguments.
fn bench_graphs_tiny(more: &[&str]) -> String {
    graphed(&[&["bench", "graphs", "--device", "sim", "--configs", "tiny"], more].concat())
}

/// Every variant runs and is reported, and the JSON says which input the step was fed.
#[test]
fn bench_graphs_runs_every_variant_on_the_simulator() {
    let dir = temp_dir("graphs");
    let json = dir.join("graphs.json");
    let json_arg = json.to_str().expect("UTF-8");
    let out = bench_graphs_tiny(&["--steps", "2", "--warmup", "1", "--input", "constant", "--json", json_arg]);
    let variants = ["graphed-eager", "graphed", "graphed-side", "graphed-offload", "graphed-whole", "graphed-floor"];
    for variant in variants {
        assert!(out.lines().any(|l| l.split_whitespace().next() == Some(variant)), "no row for {variant} in:\n{out}");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("written")).expect("JSON");
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), variants.len(), "{rows:?}");
    assert!(rows.iter().all(|r| r["input"] == "constant"), "{rows:?}");
    // The bytes held are read while the graphs live: each graphed variant's pool still holds
    // its memory, and the total counts it.
    for row in rows.iter().filter(|r| r["variant"] != "graphed-eager") {
        let pools = row["memory"]["pools"].as_array().expect("pools");
        let pooled: u64 = pools.iter().map(|p| p["reserved_bytes"].as_u64().expect("bytes")).sum();
        assert!(pooled > 0, "{} reports its pool released: {row}", row["variant"]);
        let cache = row["memory"]["cache"]["reserved_bytes"].as_u64().expect("bytes");
        assert_eq!(row["reserved_bytes"].as_u64(), Some(cache + pooled), "{row}");
    }
    std::fs::remove_dir_all(&dir).expect("the temporary directory can be removed");
}

/// `--variants` times only the variants named, in the order given.
#[test]
fn bench_graphs_times_only_the_variants_asked_for() {
    let out = bench_graphs_tiny(&["--steps", "1", "--warmup", "0", "--variants", "graphed-floor,graphed"]);
    let rows: Vec<&str> =
        out.lines().filter_map(|l| l.split_whitespace().next()).filter(|w| w.starts_with("graphed")).collect();
    assert_eq!(rows, ["graphed-floor", "graphed"], "in:\n{out}");
}

#[test]
fn bench_rebind_reads_a_layer_with_dropout_in_place_bit_for_bit() {
    let dir = temp_dir("rebind");
    let json = dir.join("rebind.json");
    graphed(&[
        "bench",
        "rebind",
        "--device",
        "sim",
        "--configs",
        "tiny",
        "--reps",
        "2",
        "--json",
        json.to_str().expect("UTF-8"),
    ]);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("written")).expect("JSON");
    let rows = report["rows"].as_array().expect("rows");
    let (layers, scaling): (Vec<_>, Vec<_>) = rows.iter().partition(|r| r.get("config").is_some());
    assert_eq!(layers.len(), 2, "one row per dropout: {rows:?}");
    let readers: Vec<&str> = scaling.iter().filter_map(|r| r["reader"].as_str()).collect();
    assert_eq!(readers, ["kernels", "device-to-device copies"], "a scaling row for each: {rows:?}");
    for scaling in scaling {
        let calls = scaling["call_us"].as_array().expect("call times");
        assert_eq!(calls.len(), scaling["nodes"].as_array().expect("node counts").len(), "{scaling}");
        assert!(calls.iter().all(|us| us.as_f64().is_some_and(|us| us > 0.0)), "{scaling}");
    }
    for row in layers {
        assert_eq!(row["bitwise_equal"], true, "{row}");
        // Without dropout the residual add rides in a cuBLASLt epilogue, which cannot be rebound.
        let in_place = row["dropout"].as_f64().expect("dropout") > 0.0;
        assert_eq!(row["input_in_place"], in_place, "{row}");
        assert_eq!(row["in_place_bytes"].as_u64() == Some(0), in_place, "{row}");
        assert_eq!(row["nodes_rebound"].as_u64().expect("count") > 0, in_place, "{row}");
        // The rebind call alone is timed where the input is read in place.
        assert_eq!(row["rebind_call_us_per_node"].as_f64().is_some_and(|us| us > 0.0), in_place, "{row}");
    }
    std::fs::remove_dir_all(&dir).expect("the temporary directory can be removed");
}
