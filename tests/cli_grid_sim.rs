//! `graphed launch --gpus N -- train --pipeline P --device sim`: Megatron-LM's grid of P
//! pipeline stages × N / P data-parallel replicas on simulated ranks, against one process running
//! the same schedule on the whole batch (bit for bit where the arithmetic is the same), its
//! checkpoints (a file per stage) resumed, and the flags refused before any rank is built; and
//! two stages on two GPUs, which CI reports as not run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use graphed::checkpoint::Checkpoint;

fn exe() -> String {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string())
}

/// A fresh folder for one test's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("graphed-grid-sim-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    dir
}

/// A small model trained for 30 steps on the simulator under the adversarial scheduler: losses
/// reported at steps 0, 25 and 29.
const TINY: [&str; 8] = ["--device", "sim", "--steps", "30", "--eval", "5", "--sim-policy", "adversarial"];

/// Runs `graphed args` in `dir`.
fn graphed(dir: &Path, args: &[&str]) -> Output {
    Command::new(exe()).current_dir(dir).args(args).output().expect("the binary runs")
}

/// `graphed words` with [`TINY`] and `--save save` after them, in `dir`; its stdout, failing
/// with its output unless it succeeded.
fn run(dir: &Path, words: &[&str], save: &str) -> String {
    run_on(dir, words, &TINY, save)
}

/// [`run`] with `device` (the device and the run's length) instead of [`TINY`].
fn run_on(dir: &Path, words: &[&str], device: &[&str], save: &str) -> String {
    let mut args = words.to_vec();
    args.extend(device);
    args.extend(["--save", save]);
    let out = graphed(dir, &args);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "graphed {args:?} failed:\n{stderr}\n{stdout}");
    stdout.into_owned()
}

/// `train` under a schedule of `microbatches` × `virtual` chunks per stage, batch `batch`
/// (per replica), with `extra`.
fn train<'a>(batch: &'a str, microbatches: &'a str, virtual_stages: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["train", "--batch", batch, "--schedule", "--microbatches", microbatches];
    args.extend(["--virtual-stages", virtual_stages]);
    args.extend(extra);
    args
}

/// `train_args` launched on `gpus` simulated ranks.
fn launch<'a>(gpus: &'a str, train_args: Vec<&'a str>) -> Vec<&'a str> {
    [vec!["launch", "--gpus", gpus, "--"], train_args].concat()
}

/// The loss lines a run printed.
fn losses(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.starts_with("step")).collect()
}

/// The parameters `train --save` wrote to `dir/save`, every stage's file (verified) together:
/// each by its name in the whole model, its bytes.
fn parameters(dir: &Path, save: &str) -> BTreeMap<String, Vec<u8>> {
    let mut named = BTreeMap::new();
    for entry in std::fs::read_dir(dir.join(save)).expect("a checkpoint folder") {
        let file = entry.expect("a file").path();
        Checkpoint::load(&file).expect("a checkpoint whose checksums hold");
        let bytes = std::fs::read(&file).expect("the checkpoint reads");
        let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
        for (name, t) in tensors.tensors().into_iter().filter(|(n, _)| n.starts_with("param.")) {
            assert!(named.insert(name.clone(), t.data().to_vec()).is_none(), "{name} saved by two stages");
        }
    }
    named
}

/// The files `train --save` wrote to `dir/save`, sorted.
fn files(dir: &Path, save: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join(save))
        .expect("a checkpoint folder")
        .map(|e| e.expect("a file").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Two ranks as two pipeline stages (interleaved: two chunks each), graphed and eager, print the
/// losses of one process running the same schedule on the same batch and end with its
/// parameters, bit for bit, dropout on: a pipeline moves the layers, not the arithmetic, and each
/// stage draws a microbatch's masks as the whole model does. Each stage saves its own file, the
/// first stage's holding the embedding, the last's the head.
#[test]
fn two_pipeline_stages_train_as_one_process_bit_for_bit() {
    let dir = temp_dir("stages");
    let model = ["--layers", "4", "--dropout", "0.1"];
    let one = run(&dir, &[train("4", "2", "2", &[]), model.to_vec()].concat(), "one");
    let want = parameters(&dir, "one");
    for (save, extra) in [("graphed", &[][..]), ("eager", &["--eager"][..])] {
        let mut extra = extra.to_vec();
        extra.extend(model);
        extra.extend(["--pipeline", "2"]);
        let out = run(&dir, &launch("2", train("4", "2", "2", &extra)), save);
        for r in 0..2 {
            let line = format!(
                "rank {r} of 2 (simulated device {r}, a thread of this process, stage {r} of 2 of replica 0 of 1)"
            );
            assert!(out.contains(&line), "{save}: no line `{line}`:\n{out}");
        }
        assert!(out.contains("grid: 2 ranks as 2 pipeline stages × 1 data-parallel replicas"), "{out}");
        assert!(out.contains("no held-out score: the model is split over 2 pipeline stages"), "{out}");
        assert_eq!(losses(&out), losses(&one), "{save}: the pipeline's losses are one process's");
        assert_eq!(files(&dir, save), ["checkpoint-stage-0-of-2.safetensors", "checkpoint-stage-1-of-2.safetensors"]);
        let got = parameters(&dir, save);
        assert!(got.keys().eq(want.keys()), "{save}: the stages hold {:?}", got.keys());
        assert!(got == want, "{save}: the stages' parameters differ from one process's");
        // Megatron-LM's placement: chunk k of stage s is the model's chunk 2k + s.
        for (stage, modules) in [(0, ["emb", "h0", "h2"]), (1, ["h1", "h3", "ln_f"])] {
            let file = dir.join(save).join(format!("checkpoint-stage-{stage}-of-2.safetensors"));
            let mut held: Vec<String> = parameters_of(&std::fs::read(file).expect("a stage's file"))
                .into_iter()
                .filter_map(|n| n.split('.').nth(1).map(str::to_string))
                .collect();
            held.dedup();
            let mut modules: Vec<&str> = modules.to_vec();
            if stage == 1 {
                modules.insert(2, "head");
            }
            assert_eq!(held, modules, "{save}: stage {stage}'s parameters");
        }
    }
    std::fs::remove_dir_all(dir).ok();
}

/// Two GPUs, a process each joined through NCCL, as two pipeline stages: the losses and
/// parameters of one process on one GPU running the same schedule, bit for bit in f32 (the same
/// kernels on the same shapes, the activations and gradients crossing unchanged).
#[test]
#[ignore = "needs two CUDA GPUs and NCCL"]
fn two_gpus_as_two_pipeline_stages_train_as_one_gpu_bit_for_bit() {
    let dir = temp_dir("gpus");
    let gpu = ["--device", "cuda", "--dtype", "f32", "--layers", "4", "--steps", "30", "--eval", "5"];
    let one = run_on(&dir, &train("8", "4", "2", &[]), &gpu, "one");
    let out = run_on(&dir, &launch("2", train("8", "4", "2", &["--pipeline", "2"])), &gpu, "pipeline");
    assert!(out.contains("rank 1 of 2 (GPU 1 of this host, stage 1 of 2 of replica 0 of 1)"), "{out}");
    assert_eq!(losses(&out), losses(&one), "the pipeline's losses are one GPU's");
    assert!(parameters(&dir, "pipeline") == parameters(&dir, "one"), "the stages' parameters differ from one GPU's");
    std::fs::remove_dir_all(dir).ok();
}

/// The parameter names of a checkpoint file's bytes, sorted.
fn parameters_of(bytes: &[u8]) -> Vec<String> {
    let tensors = safetensors::SafeTensors::deserialize(bytes).expect("a safetensors file");
    let mut names: Vec<String> =
        tensors.names().into_iter().filter(|n| n.starts_with("param.")).map(str::to_string).collect();
    names.sort();
    names
}

/// Four ranks as a 2 × 2 grid, one microbatch per replica, their gradients averaged (the
/// default) or summed: the losses and parameters of one process accumulating both replicas'
/// microbatches (one addition, and the mean's halving, both exact in f32). With two microbatches
/// per replica (interleaved), each replica adds its own two first, one process all four in a
/// row, which rounds otherwise: there the grid equals two data-parallel ranks of the same
/// schedule, bit for bit. Stopped at step 15 and resumed from its stages' files, the grid ends
/// as the run that never stopped.
#[test]
fn a_grid_of_two_stages_by_two_replicas_trains_as_one_process_and_resumes_bit_for_bit() {
    let dir = temp_dir("grid");
    let layers = ["--layers", "2"];
    let one = run(&dir, &[train("4", "2", "1", &[]), layers.to_vec()].concat(), "one");
    let want = parameters(&dir, "one");
    for (save, extra) in [("mean", &[][..]), ("sum", &["--grad-reduce", "sum"][..])] {
        let extra = [extra, &layers, &["--pipeline", "2"]].concat();
        let out = run(&dir, &launch("4", train("2", "1", "1", &extra)), save);
        let line = "rank 3 of 4 (simulated device 3, a thread of this process, stage 1 of 2 of replica 1 of 2)";
        assert!(out.contains(line), "{save}: no line `{line}`:\n{out}");
        assert_eq!(out.matches("final loss").count(), 1, "{save}: rank 0 alone reports:\n{out}");
        assert_eq!(losses(&out), losses(&one), "{save}: the grid's losses are the whole batch's");
        assert!(parameters(&dir, save) == want, "{save}: the grid's parameters differ from one process's");
    }
    let interleaved = ["--layers", "4"];
    let dp = run(&dir, &launch("2", train("2", "2", "2", &interleaved)), "dp");
    let grid = run(&dir, &launch("4", train("2", "2", "2", &[&interleaved[..], &["--pipeline", "2"]].concat())), "gi");
    assert_eq!(losses(&grid), losses(&dp), "the interleaved grid's losses are two data-parallel ranks'");
    assert!(parameters(&dir, "gi") == parameters(&dir, "dp"), "the interleaved grid's parameters differ");
    let grid_args = |extra: &[&'static str]| {
        launch("4", train("2", "1", "1", &[&layers[..], &["--pipeline", "2"], extra].concat()))
    };
    run(&dir, &grid_args(&["--stop-at", "15"]), "half");
    let resumed = run(&dir, &grid_args(&["--resume", "half"]), "resumed");
    assert!(resumed.contains("resumed from half after 15 steps"), "{resumed}");
    assert_eq!(losses(&resumed), losses(&one)[1..], "the resumed grid's losses");
    for file in files(&dir, "mean") {
        let bytes = |save: &str| std::fs::read(dir.join(save).join(&file)).expect("a stage's file");
        assert!(bytes("resumed") == bytes("mean"), "{file}: the resumed grid's differs from the straight run's");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// A grid the flags cannot make, and a resume from another grid's checkpoint, are refused once,
/// with exit status 2 and a message naming the flags, before any rank is built.
#[test]
fn grids_that_cannot_run_are_refused_before_any_rank_is_built() {
    let dir = temp_dir("refused");
    run(&dir, &launch("4", train("2", "1", "1", &["--layers", "2", "--pipeline", "2"])), "saved");
    let cases: [(&[&str], &str); 7] = [
        (
            &["launch", "--gpus", "3", "--", "train", "--pipeline", "2", "--schedule"],
            "--pipeline 2 does not divide the 3 ranks",
        ),
        (&["launch", "--gpus", "2", "--", "train", "--pipeline", "2"], "add --schedule"),
        (&["train", "--pipeline", "2", "--schedule"], "graphed launch --gpus 2"),
        (
            &["launch", "--gpus", "2", "--", "train", "--pipeline", "2", "--schedule", "--layers", "2"],
            "--pipeline 2 × --virtual-stages 2",
        ),
        (
            &[
                "launch",
                "--gpus",
                "2",
                "--",
                "train",
                "--pipeline",
                "2",
                "--schedule",
                "--layers",
                "4",
                "--microbatches",
                "3",
            ],
            "--microbatches 3 is not a multiple of 2",
        ),
        (
            &["launch", "--gpus", "2", "--", "train", "--pipeline", "2", "--schedule", "--on-nonfinite", "skip"],
            "--on-nonfinite stop",
        ),
        (
            &[
                "launch",
                "--gpus",
                "2",
                "--",
                "train",
                "--pipeline",
                "2",
                "--schedule",
                "--virtual-stages",
                "1",
                "--batch",
                "2",
                "--microbatches",
                "1",
                "--resume",
                "saved",
            ],
            "resume with --pipeline 2 and `graphed launch --gpus 4`",
        ),
    ];
    for (args, why) in cases {
        let args = [args, &["--device", "sim"]].concat();
        let out = graphed(&dir, &args);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(why), "{args:?}: no `{why}` in {stderr}");
        assert!(!stdout.contains("rank 0 of"), "{args:?}: a rank was built:\n{stdout}");
    }
    std::fs::remove_dir_all(dir).ok();
}
