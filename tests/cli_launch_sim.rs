//! `graphed launch --gpus N -- train --device sim`: simulated ranks, threads of the launcher, train
//! data parallel as processes on GPUs do, bit for bit as one process that accumulates the whole
//! batch's microbatches, and resume so; what is refused before any rank is built; a failure that
//! ends them all.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use graphed::checkpoint::Checkpoint;

fn exe() -> String {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string())
}

/// A fresh folder for one test's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("graphed-launch-sim-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    dir
}

/// The smallest model `train` has flags for, trained for 30 steps: losses reported at steps 0,
/// 25 and 29.
const TINY: [&str; 10] =
    ["--device", "sim", "--layers", "1", "--steps", "30", "--eval", "5", "--sim-policy", "adversarial"];

/// Runs `graphed args` in `dir`.
fn graphed(dir: &Path, args: &[&str]) -> Output {
    Command::new(exe()).current_dir(dir).args(args).output().expect("the binary runs")
}

/// `graphed launch --gpus ranks -- train` of [`TINY`] with `extra`, saved to `save`; its stdout
/// and stderr, failing with them unless it succeeded.
fn launched(dir: &Path, ranks: usize, save: &str, extra: &[&str]) -> (String, String) {
    let gpus = ranks.to_string();
    let mut args = vec!["launch", "--gpus", &gpus, "--", "train", "--save", save];
    args.extend(TINY);
    args.extend(extra);
    succeeded(&args, graphed(dir, &args))
}

/// One process that runs the whole batch of `ranks` ranks of `batch` as `ranks` microbatches
/// (a pipeline schedule of one stage, which accumulates them), saved to `save`.
fn one_process(dir: &Path, ranks: usize, batch: usize, save: &str) -> (String, String) {
    let (whole, microbatches) = ((ranks * batch).to_string(), ranks.to_string());
    let mut args = vec!["train", "--save", save, "--batch", &whole, "--schedule", "--microbatches", &microbatches];
    args.extend(["--virtual-stages", "1"]);
    args.extend(TINY);
    succeeded(&args, graphed(dir, &args))
}

fn succeeded(args: &[&str], out: Output) -> (String, String) {
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "graphed {args:?} failed:\n{stderr}\n{stdout}");
    (stdout.into_owned(), stderr.into_owned())
}

/// The loss lines a run printed.
fn losses(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.starts_with("step")).collect()
}

/// The state `train --save` wrote to `dir/save` (verified), but for the dropout step counter:
/// every tensor by name, its bytes. A schedule's counter advances once per microbatch, a group's
/// once per step, and without dropout it draws nothing.
fn saved(dir: &Path, save: &str) -> Vec<(String, Vec<u8>)> {
    let file = dir.join(save).join("checkpoint.safetensors");
    Checkpoint::load(&file).expect("a checkpoint whose checksums hold");
    let bytes = std::fs::read(&file).expect("the checkpoint reads");
    let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    let mut named: Vec<(String, Vec<u8>)> = (tensors.tensors().into_iter())
        .filter(|(name, _)| name != "rng.dropout_step")
        .map(|(name, t)| (name, t.data().to_vec()))
        .collect();
    named.sort();
    assert!(named.iter().any(|(n, _)| n.starts_with("param.")) && named.iter().any(|(n, _)| n.starts_with("optim.")));
    named
}

/// Two simulated ranks, their gradients averaged (the default; inside the graphs, or after an
/// eager step) or summed, print the losses and end with the parameters and optimizer state of one
/// process that accumulates both ranks' batches, bit for bit; rank 0 alone reports and saves,
/// every rank says where it is, each rank's checker stays quiet, and rank 0's checkpoint resumes
/// the group bit for bit.
#[test]
fn two_simulated_ranks_train_as_one_process_on_the_whole_batch_averaged_or_summed() {
    let dir = temp_dir("two");
    let (one, _) = one_process(&dir, 2, 2, "one");
    let want = saved(&dir, "one");
    assert_eq!(losses(&one).len(), 3, "{one}");
    let averaged = "gradients averaged over the ranks";
    let cases: [(&[&str], &str, &str); 4] = [
        (&[], "mean", averaged),
        (&["--eager"], "eager", averaged),
        // The whole step as two graphs: the reduction inside the backward graph.
        (&["--whole-step"], "whole", averaged),
        (&["--grad-reduce", "sum"], "sum", "gradients summed over the ranks"),
    ];
    for (extra, save, how) in cases {
        let (out, err) = launched(&dir, 2, save, &[&["--batch", "2"], extra].concat());
        for r in 0..2 {
            let line = format!("rank {r} of 2 (simulated device {r}, a thread of this process)");
            assert!(out.contains(&line), "{save}: no line `{line}`:\n{out}");
            let checker = format!("rank {r}: stream-safety checker: no hazards found");
            assert!(err.contains(&checker), "{save}: no line `{checker}`:\n{err}");
        }
        assert!(out.contains(how), "{save}: the banner must say how gradients combine:\n{out}");
        for once in ["device: simulator", "final loss", "saved the state after 30 steps", "exact-match accuracy"] {
            assert_eq!(out.matches(once).count(), 1, "{save}: rank 0 alone says `{once}`:\n{out}");
        }
        assert_eq!(losses(&out), losses(&one), "{save}: the group's losses are the whole batch's");
        assert!(
            saved(&dir, save) == want,
            "{save}: the group's parameters or optimizer state differ from one process's"
        );
    }
    // Rank 0's checkpoint resumes the group bit for bit: stopped at step 15 and resumed, it ends
    // as the run that never stopped (the same file), printing the same losses after the resume.
    launched(&dir, 2, "half", &["--batch", "2", "--stop-at", "15"]);
    let (resumed, _) = launched(&dir, 2, "resumed", &["--batch", "2", "--resume", "half"]);
    assert!(resumed.contains("resumed from half after 15 steps"), "{resumed}");
    let file = |save: &str| std::fs::read(dir.join(save).join("checkpoint.safetensors")).expect("a checkpoint");
    assert!(file("resumed") == file("mean"), "the resumed group's checkpoint differs from the straight run's");
    assert_eq!(losses(&resumed), losses(&one)[1..], "the resumed group's losses");
    std::fs::remove_dir_all(dir).ok();
}

/// Three ranks, whose `1/3` is not a power of two: summed, they are still one process that
/// accumulates the three microbatches (each rank's loss weighed by the whole batch, the sum in
/// rank order as that process accumulates), bit for bit.
#[test]
fn three_simulated_ranks_summing_train_as_one_process_on_the_whole_batch() {
    let dir = temp_dir("three");
    let (one, _) = one_process(&dir, 3, 2, "one");
    let (out, _) = launched(&dir, 3, "sum", &["--batch", "2", "--grad-reduce", "sum"]);
    assert!(out.contains("rank 2 of 3 (simulated device 2"), "{out}");
    assert_eq!(losses(&out), losses(&one), "the group's losses are the whole batch's");
    assert!(
        saved(&dir, "sum") == saved(&dir, "one"),
        "the group's parameters or optimizer state differ from one process's"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// What rank 0 would refuse is refused once, with exit status 2, before any rank is built (no
/// rank line); so are several hosts of simulated ranks, and `--device sim` in a process that
/// another launcher started as a rank.
#[test]
fn refusals_come_before_any_simulated_rank_is_built() {
    let dir = temp_dir("refused");
    let expect = |args: &[&str], out: Output, why: &str| {
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(why), "{args:?}: {stderr}");
        assert!(!stdout.contains("rank 0 of"), "{args:?}: a rank was built:\n{stdout}");
    };
    let same_file = ["launch", "--gpus", "2", "--", "train", "--device", "sim", "--metrics", "m", "--plot", "m"];
    expect(&same_file, graphed(&dir, &same_file), "are the same file");
    let hosts = ["launch", "--nnodes", "2", "--master-addr", "127.0.0.1", "--", "train", "--device", "sim"];
    expect(&hosts, graphed(&dir, &hosts), "simulated ranks are threads of this process");
    let as_rank = ["train", "--device", "sim"];
    let out = Command::new(exe())
        .current_dir(&dir)
        .args(as_rank)
        .envs([("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")])
        .output()
        .expect("the binary runs");
    expect(&as_rank, out, "graphed launch --gpus 2 -- train --device sim");
    // Every rank refuses a checkpoint that is not there, before it joins the others.
    let absent = ["launch", "--", "train", "--device", "sim", "--resume", "absent"];
    expect(&absent, graphed(&dir, &absent), "absent");
    std::fs::remove_dir_all(dir).ok();
}

/// A step that fails on every rank (its gradients not finite) ends the launcher with that
/// failure (exit status 1) instead of a hang: each rank's run is dropped, which ends its part in
/// the group; nothing is reported as finished.
#[test]
fn a_failed_step_ends_every_simulated_rank_and_the_launcher_with_it() {
    let dir = temp_dir("failed");
    let mut args = vec!["launch", "--", "train", "--batch", "2", "--lr", "1e30"];
    args.extend(TINY);
    let out = graphed(&dir, &args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("not finite") && stderr.contains("failed first"), "{stderr}");
    assert!(!stdout.contains("final loss") && !stderr.contains("no hazards"), "{stdout}{stderr}");
    std::fs::remove_dir_all(dir).ok();
}
