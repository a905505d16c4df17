//! `graphed train --data FILE` on the simulator: a byte-level model of a local text file learns
//! (its loss falls), reports a held-out loss and writes a sample, its losses also as JSON lines
//! and an SVG chart; a file too short for it is refused with what it needs.

use std::process::{Command, Output};

fn graphed(args: &[&str]) -> Output {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    Command::new(exe).args(args).output().expect("the binary runs")
}

#[test]
fn a_text_file_trains_a_byte_level_model() {
    let dir = std::env::temp_dir().join(format!("graphed-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "the cat sat on the mat. ".repeat(200)).unwrap();
    let path = text.to_str().unwrap();
    let (lines, plot) = (dir.join("metrics.jsonl"), dir.join("loss.svg"));
    let (lines_arg, plot_arg) = (lines.to_str().unwrap(), plot.to_str().unwrap());
    let out = graphed(&[
        "train",
        "--device",
        "sim",
        "--data",
        path,
        "--steps",
        "40",
        "--context",
        "16",
        "--batch",
        "16",
        "--metrics",
        lines_arg,
        "--plot",
        plot_arg,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let losses: Vec<f64> = (stdout.lines())
        .filter_map(|l| l.strip_prefix("step").and_then(|r| r.split("loss").nth(1)))
        .map(|v| v.trim().parse().expect("a loss"))
        .collect();
    assert!(losses.len() >= 2 && losses[losses.len() - 1] < 0.7 * losses[0], "the loss did not fall: {losses:?}");
    assert!(stdout.contains("held-out loss") && stdout.contains("sample: "), "{stdout}");
    // The JSON lines hold the printed losses, in order.
    let recorded: Vec<f64> = (std::fs::read_to_string(&lines).unwrap().lines())
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line")["loss"].as_f64().expect("a loss"))
        .collect();
    assert_eq!(recorded.len(), losses.len());
    assert!(recorded.iter().zip(&losses).all(|(r, p)| (r - p).abs() < 5e-5), "{recorded:?} against {losses:?}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"), "an SVG line chart");
    let short = dir.join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    let out = graphed(&["train", "--device", "sim", "--data", short.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("needs at least"), "{stderr}");
    std::fs::remove_dir_all(dir).ok();
}
