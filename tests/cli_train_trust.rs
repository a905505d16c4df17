//! `graphed train` as a user meets it on the simulator: refusals before anything runs (exit 2,
//! nothing changed), an interrupt that saves and flushes (exit 130), periodic saves that survive
//! a kill, a non-finite step that stops the run (exit 1) without saving, and messages that do not
//! mislead.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use graphed::checkpoint::Checkpoint;

fn exe() -> String {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string())
}

/// `graphed train --device sim` with `args`, in `dir`.
fn train(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(exe());
    cmd.current_dir(dir).args(["train", "--device", "sim"]).args(args);
    if !args.contains(&"--data") {
        cmd.args(["--eval", "5"]);
    }
    cmd
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs and returns (exit code, stdout, stderr).
fn run(dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out: Output = train(dir, args).output().expect("the binary runs");
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// Waits (at most two minutes) until `path` holds a metrics line of a step at or after `step`.
fn wait_for_step(child: &mut Child, path: &Path, step: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let lines = std::fs::read_to_string(path).unwrap_or_default();
        let last = lines.lines().filter_map(step_of).max();
        if last.is_some_and(|s| s >= step) {
            return;
        }
        assert!(child.try_wait().ok().flatten().is_none(), "train ended before step {step}");
        assert!(Instant::now() < deadline, "no metrics line of step {step} in two minutes: {lines}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn step_of(line: &str) -> Option<usize> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    Some(v.get("step")?.as_u64()? as usize)
}

fn signal(child: &Child, name: &str) {
    let ok = Command::new("kill").args([&format!("-{name}"), &child.id().to_string()]).status();
    assert!(ok.is_ok_and(|s| s.success()), "kill -{name} failed");
}

fn done_of(dir: &Path) -> usize {
    let ckpt = Checkpoint::load(&dir.join("checkpoint.safetensors")).expect("a checkpoint was saved");
    ckpt.meta("done").and_then(|d| d.parse().ok()).expect("the checkpoint has its step count")
}

#[test]
fn refusals_exit_2_before_the_first_step_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("file"), "keep").unwrap();
    std::fs::write(d.join("metrics.jsonl"), "{\"step\":0,\"loss\":1.0,\"seconds\":0.1}\n").unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--save", "file"], "--save file is a file"),
        (&["--save", "file/sub"], "--save file/sub"),
        (&["--metrics", "nowhere/m.jsonl"], "--metrics nowhere/m.jsonl"),
        (&["--metrics", "metrics.jsonl", "--plot", "./metrics.jsonl"], "are the same file"),
        (&["--stop-at", "0"], "--stop-at"),
        (&["--steps", "10", "--stop-at", "11"], "--stop-at 11"),
        (&["--stop-at", "1001"], "--stop-at 1001 is past the run's 1000 steps"),
        (&["--microbatches", "4"], "add --schedule"),
        (&["--dim", "3", "--heads", "1"], "--dim 3"),
        (&["--dim", "8192"], "--dim 8192"),
        (&["--batch", "65536", "--dim", "512"], "need about"),
        (&["--offload", "--offload-sites", "attn.bogus"], "attn.bogus"),
        // Heads of 16 features: the fused attention (the default) has none; the way out is named.
        (&["--heads", "2"], "--attention unfused"),
        // Each form saves what the other does not.
        (&["--offload", "--offload-sites", "attn.probs"], "--attention unfused"),
        (&["--attention", "unfused", "--offload", "--offload-sites", "attn.lse"], "--attention fused"),
        (&["--eval", "5", "--data", "file"], "--eval"),
        (&["--save-every", "5"], "--save"),
        (&["--offload", "--pool-per-layer", "--side-stream"], "drop one of the three"),
        // FP8 GEMMs need k a multiple of 16: 8 microbatches of 8 sums of 11 tokens are 88.
        (&["--dtype", "fp8", "--schedule"], "--dtype fp8 needs"),
        // A scaling without FP8 would change nothing.
        (&["--fp8-scaling", "current"], "pass --dtype fp8 with it"),
        (&["--fp8-gradients", "e4m3"], "--fp8-gradients sets how FP8"),
    ];
    for (args, why) in cases {
        let started = Instant::now();
        let (code, stdout, stderr) = run(d, args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(why), "{args:?}: expected `{why}` in: {stderr}");
        assert!(!stdout.contains("step ") && !stderr.contains("no hazards found"), "{args:?}: {stdout}{stderr}");
        // Refused before the model is trained (a refusal of sizes comes before any allocation).
        assert!(started.elapsed() < Duration::from_secs(60), "{args:?} took {:?}", started.elapsed());
    }
    assert_eq!(std::fs::read_to_string(d.join("file")).unwrap(), "keep");
    assert!(std::fs::read_to_string(d.join("metrics.jsonl")).unwrap().starts_with("{\"step\":0"));
    // The bogus site is refused listing what the model saves: the fused attention's log-sum-exp,
    // no probabilities; the unfused attention's probabilities, which it offers.
    let (_, _, stderr) = run(d, &["--offload", "--offload-sites", "attn.bogus"]);
    assert!(stderr.contains("attn.qkv") && stderr.contains("mlp.input"), "{stderr}");
    assert!(stderr.contains("attn.lse") && !stderr.contains("attn.probs"), "{stderr}");
    let (_, _, stderr) = run(d, &["--attention", "unfused", "--offload", "--offload-sites", "attn.bogus"]);
    assert!(stderr.contains("attn.probs") && !stderr.contains("attn.lse"), "{stderr}");
}

#[test]
fn an_interrupt_finishes_the_step_saves_flushes_and_exits_130_and_a_resume_appends() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let metrics = d.join("m.jsonl");
    let mut child = train(d, &["--steps", "100000", "--save", "ckpt", "--metrics", "m.jsonl"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_step(&mut child, &metrics, 25);
    signal(&child, "INT");
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    let done = done_of(&d.join("ckpt"));
    assert!(stderr.contains(&format!("interrupted after step {done}")), "{stderr}");
    assert!(stderr.contains("--resume ckpt"), "{stderr}");
    // Every reported step up to the interrupt is in the metrics.
    let before: Vec<usize> = std::fs::read_to_string(&metrics).unwrap().lines().filter_map(step_of).collect();
    assert!(before.first() == Some(&0) && before.iter().all(|&s| s < done), "{before:?} done {done}");
    // The resumed run keeps those lines and appends its own.
    let stop = (done + 30).to_string();
    let (code, _, stderr) = run(
        d,
        &["--steps", "100000", "--resume", "ckpt", "--save", "ckpt", "--metrics", "m.jsonl", "--stop-at", &stop],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let after: Vec<usize> = std::fs::read_to_string(&metrics).unwrap().lines().filter_map(step_of).collect();
    assert_eq!(&after[..before.len()], &before[..]);
    assert!(after.len() > before.len() && after.windows(2).all(|w| w[0] < w[1]), "{after:?}");
}

#[test]
fn save_every_keeps_a_resumable_state_through_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut child = train(d, &["--steps", "100000", "--save", "ckpt", "--save-every", "10", "--metrics", "m.jsonl"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_step(&mut child, &d.join("m.jsonl"), 25);
    signal(&child, "KILL");
    child.wait().unwrap();
    let done = done_of(&d.join("ckpt"));
    assert!(done >= 20 && done.is_multiple_of(10), "saved after {done} steps");
    let stop = (done + 5).to_string();
    let (code, stdout, stderr) = run(d, &["--steps", "100000", "--resume", "ckpt", "--stop-at", &stop]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains(&format!("resumed from ckpt after {done} steps")), "{stdout}");
}

#[test]
fn a_non_finite_step_stops_the_run_naming_it_and_never_saves_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (code, _, stderr) = run(d, &["--steps", "40", "--save", "good"]);
    assert_eq!(code, Some(0), "{stderr}");
    let good = std::fs::read(d.join("good/checkpoint.safetensors")).unwrap();
    let (code, stdout, stderr) = run(d, &["--steps", "40", "--lr", "1e30", "--save", "good"]);
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("not finite") && stderr.contains("step"), "{stderr}");
    assert!(!stdout.contains("final loss"), "{stdout}");
    assert_eq!(std::fs::read(d.join("good/checkpoint.safetensors")).unwrap(), good, "the good checkpoint was replaced");
    // Skipping instead: the run ends, saying how many steps it skipped.
    let (code, stdout, stderr) = run(d, &["--steps", "40", "--lr", "1e30", "--on-nonfinite", "skip"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("skipped") && stdout.contains("not finite"), "{stdout}");
}

#[test]
fn a_plain_run_says_what_it_runs_on_in_its_own_words_and_summarises_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(exe());
    // `--device auto`, the default: on a machine without a GPU, the simulator.
    let out = cmd.current_dir(dir.path()).args(["train", "--steps", "3", "--eval", "2"]).output().unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("Device::sim()"), "library advice shown to a user: {stderr}");
    if stdout.contains("device: simulator") || stdout.contains("device: sim") {
        assert!(stderr.contains("running on the CPU simulator"), "{stderr}");
    }
    assert!(!stdout.contains("stream-safety checker") && stderr.contains("stream-safety checker"), "{stdout}{stderr}");
    // A failure is not preceded by a summary that reads as success.
    let (code, stdout, stderr) = run(dir.path(), &["--resume", "absent"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(!stdout.contains("no hazards") && !stderr.contains("no hazards"), "{stdout}{stderr}");
}

#[test]
fn a_damaged_checkpoint_and_a_changed_data_file_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (code, _, stderr) = run(d, &["--steps", "20", "--stop-at", "10", "--save", "ckpt"]);
    assert_eq!(code, Some(0), "{stderr}");
    let path = d.join("ckpt/checkpoint.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let (code, stdout, stderr) = run(d, &["--steps", "20", "--resume", "ckpt"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("tensor") && !stdout.contains("step "), "{stderr}");

    let text: String = (0..400).map(|i| format!("line {i}: the quick brown fox\n")).collect();
    std::fs::write(d.join("data.txt"), &text).unwrap();
    let data = ["--data", "data.txt", "--steps", "20"];
    let (code, _, stderr) = run(d, &[&data[..], &["--stop-at", "10", "--save", "text"]].concat());
    assert_eq!(code, Some(0), "{stderr}");
    std::fs::write(d.join("data.txt"), text.replace("fox", "cat")).unwrap();
    let (code, _, stderr) = run(d, &[&data[..], &["--resume", "text"]].concat());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("the data file changed") && stderr.contains("--accept-changed-data"), "{stderr}");
    // The other attention form would load the same parameters but not continue bit for bit.
    let other = ["--resume", "text", "--accept-changed-data", "--attention", "unfused"];
    let (code, _, stderr) = run(d, &[&data[..], &other[..]].concat());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("computed attention fused") && stderr.contains("--attention fused"), "{stderr}");
    let (code, _, stderr) = run(d, &[&data[..], &["--resume", "text", "--accept-changed-data"]].concat());
    assert_eq!(code, Some(0), "{stderr}");
}

/// A log that goes to a pipe or a file is plain text, without a terminal's colour codes, and
/// the allocator's trace (`GRAPHED_LOG=graphed::memory=trace`) names each allocation's place
/// (the allocator's too: a benchmark makes several, each numbering its pools and segments).
#[test]
fn logs_to_a_pipe_are_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(dir.path(), &["--steps", "1"]).env("GRAPHED_LOG", "graphed::memory=trace").output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "train failed: {err}");
    let alloc = err.lines().find(|l| l.contains("graphed: alloc")).expect("the allocator's trace");
    for field in ["allocator=", "pool=", "segment=", "offset=", "size=", "bytes=", "stream="] {
        assert!(alloc.contains(field), "no {field} in {alloc:?}");
    }
    assert!(!err.contains('\u{1b}'), "colour codes in a piped log: {:?}", alloc);
}
