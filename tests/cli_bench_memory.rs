//! `graphed bench memory` on the simulator: each search ends on a bracket (the largest size
//! whose peak fits the budget, and the next size over it, both probed), and a budget the device
//! cannot hold or cannot read is refused before anything runs.

use std::process::{Command, Output};

fn graphed(args: &[&str]) -> Output {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    Command::new(exe).args(args).output().expect("the binary runs")
}

#[test]
fn every_search_ends_with_the_largest_size_that_fits_next_to_one_that_does_not() {
    let path = std::env::temp_dir().join(format!("graphed-memory-{}.json", std::process::id()));
    let budget = 12usize << 20;
    let out = graphed(&[
        "bench",
        "memory",
        "--device",
        "sim",
        "--config",
        "tiny",
        "--budget",
        "12MiB",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    let rows = report["rows"].as_array().unwrap();
    let searches: Vec<(&str, &str)> =
        rows.iter().map(|r| (r["variant"].as_str().unwrap(), r["search"].as_str().unwrap())).collect();
    assert_eq!(
        searches,
        [
            ("graphed", "batch"),
            ("graphed", "layers"),
            ("graphed-offload", "batch"),
            ("graphed-offload", "layers"),
            ("graphed-recompute", "batch"),
            ("graphed-recompute", "layers")
        ],
        "the automatic policy is skipped on the simulator"
    );
    // Recomputing the GELU output keeps less from the forward to the backward, never more.
    let largest = |variant: &str, search: &str| {
        let row = rows.iter().find(|r| r["variant"] == variant && r["search"] == search);
        row.and_then(|r| r["largest"].as_u64()).unwrap_or(0)
    };
    for search in ["batch", "layers"] {
        assert!(largest("graphed-recompute", search) >= largest("graphed", search), "{search}: {rows:?}");
    }
    for r in rows {
        let largest = r["largest"].as_u64().expect("a tiny model fits 12 MiB") as usize;
        let probes = r["probes"].as_array().unwrap();
        let peak = |size: usize| {
            let p = probes.iter().find(|p| p["size"].as_u64() == Some(size as u64));
            p.map(|p| p["peak_reserved_bytes"].as_u64().unwrap() as usize)
        };
        assert!(peak(largest).unwrap() <= budget, "{r}");
        assert!(peak(largest + 1).expect("the next size was probed") > budget, "{r}");
        let fixed = if r["search"] == "batch" { &r["batch"] } else { &r["layers"] };
        assert_eq!(fixed.as_u64(), Some(largest as u64), "the row's configuration is the largest that fits: {r}");
    }
}

#[test]
fn a_budget_that_is_not_a_size_is_refused_with_the_forms_it_takes() {
    let out = graphed(&["bench", "memory", "--device", "sim", "--config", "tiny", "--budget", "24GB"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown unit `GB`") && err.contains("24GiB"), "{err}");
}

#[test]
fn a_budget_over_the_free_memory_is_refused_before_any_probe() {
    let out = graphed(&["bench", "memory", "--device", "sim", "--config", "tiny", "--budget", "1000TiB"]);
    assert!(!out.status.success());
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(err.contains("free memory") && err.contains("lower the budget"), "{err}");
    assert!(!stdout.contains("peak reserved"), "no probe ran: {stdout}");
}

#[test]
fn an_unwritable_json_path_is_refused_before_any_probe() {
    let out =
        graphed(&["bench", "memory", "--device", "sim", "--config", "tiny", "--json", "/nonexistent-folder/m.json"]);
    assert_eq!(out.status.code(), Some(2));
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(err.contains("--json") && err.contains("does not exist"), "{err}");
    assert!(!stdout.contains("peak reserved"), "no probe ran: {stdout}");
}
