//! Learning on the simulator: `graphed train` on a small config must bring the loss on the answer
//! digits below a stated threshold within CI time.

use std::process::Command;

/// Guessing digits gives ln(10) ≈ 2.30; the simulator's default model (width 32 in one fused head,
/// 2 layers, 1000 steps) ends near 0.007 with 99% exact-match accuracy on 100 held-out sums, in
/// f32 and bf16. The task is sensitive to the seed at this size (seed 1 stays near 1.6 in either
/// attention form, as it did with the earlier default of two unfused heads of 16 features and
/// 600 steps), so the test keeps the default seed.
const THRESHOLD: f64 = 0.5;

/// `graphed train` on the simulator with `extra` arguments must end below [`THRESHOLD`].
fn learns(extra: &[&str]) {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    let mut args = vec!["train", "--device", "sim", "--eval", "20"];
    args.extend(extra);
    let out = Command::new(exe).args(&args).output().expect("the graphed binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "train failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let loss: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("final loss ")?.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no final loss in:\n{stdout}"));
    assert!(loss < THRESHOLD, "final loss {loss} with {extra:?} is not below {THRESHOLD}:\n{stdout}");
}

#[test]
fn a_small_gpt_learns_addition_on_the_simulator() {
    learns(&[]);
}

/// Mixed precision: bf16 weights and activations, f32 statistics, loss and master weights.
#[test]
fn a_small_gpt_learns_addition_in_bf16_on_the_simulator() {
    learns(&["--dtype", "bf16"]);
}

/// The loss lines of `graphed train` with `extra` arguments: a short run with dropout on.
fn losses(extra: &[&str]) -> Vec<String> {
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    let mut args = vec!["train", "--device", "sim", "--steps", "30", "--eval", "5", "--dropout", "0.1"];
    args.extend(extra);
    let out = Command::new(exe).args(&args).output().expect("the graphed binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "train {extra:?} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<String> =
        stdout.lines().filter(|l| l.starts_with("step") || l.starts_with("final loss")).map(str::to_string).collect();
    assert!(lines.len() >= 3, "no loss lines in:\n{stdout}");
    lines
}

#[test]
fn graphed_training_follows_eager_bitwise() {
    let eager = losses(&["--eager"]);
    let whole_offloaded = ["--whole-step", "--side-stream", "--offload", "listed", "--offload-margin", "0"];
    // Lent gradients: each backward starts its layer's from zero, as the optimizer left them.
    let lent_offloaded = ["--lend-gradients", "--side-stream", "--offload", "listed", "--offload-margin", "0"];
    let modes =
        [&[][..], &["--side-stream"], &["--pool-per-layer"], &["--whole-step"], &whole_offloaded, &lent_offloaded];
    for mode in modes {
        assert_eq!(losses(mode), eager, "graphed train {mode:?} against --eager");
    }
}

#[test]
fn graphed_training_follows_eager_bitwise_in_bf16() {
    let eager = losses(&["--eager", "--dtype", "bf16"]);
    assert_eq!(losses(&["--dtype", "bf16"]), eager, "graphed train --dtype bf16 against --eager");
    assert_eq!(losses(&["--dtype", "bf16", "--whole-step"]), eager, "the whole step graphed, in bf16");
    assert_eq!(losses(&["--dtype", "bf16", "--lend-gradients"]), eager, "the layers' gradients lent, in bf16");
    // Recomputing the LayerNorm outputs runs the same kernel on the same bits: no bit changes,
    // with the default offloading (whose sites it no longer saves two of) or the second
    // LayerNorm's input offloaded and brought back early for the recomputation.
    let norm = ["--dtype", "bf16", "--recompute", "norm", "--side-stream", "--lend-gradients"];
    assert_eq!(losses(&norm), eager, "the LayerNorm outputs recomputed, in bf16");
    let offloaded = ["--offload", "listed", "--offload-margin", "0"];
    assert_eq!(losses(&[&norm[..], &offloaded].concat()), eager, "recomputed and offloaded at the default sites");
    let ln2 = [&norm[..], &offloaded, &["--offload-sites", "ln2.input,attn.qkv"]].concat();
    assert_eq!(losses(&ln2), eager, "recomputed from an offloaded LayerNorm input");
}

/// FP8: the casts, amax slots and scales inside the layers' graphs and the optimizer's, with
/// activations offloaded inside the graphs, and under a pipeline schedule (each against the same
/// run eagerly: the schedule's microbatches accumulate in its own order).
#[test]
fn graphed_training_follows_eager_bitwise_in_fp8_offloaded_and_scheduled() {
    let fp8 = ["--dtype", "fp8"];
    let eager = losses(&[&fp8[..], &["--eager"]].concat());
    assert_eq!(losses(&fp8), eager, "graphed train --dtype fp8 against --eager");
    assert_eq!(losses(&[&fp8[..], &["--whole-step"]].concat()), eager, "the whole step graphed in FP8");
    assert_eq!(losses(&[&fp8[..], &["--lend-gradients"]].concat()), eager, "the layers' gradients lent in FP8");
    let offload = [&fp8[..], &["--offload", "listed", "--offload-margin", "0"]].concat();
    let eager_offload = losses(&[&offload[..], &["--eager"]].concat());
    assert_eq!(eager_offload, eager, "offloading in FP8 changes nothing eagerly");
    assert_eq!(losses(&offload), eager, "graphed and offloaded in FP8 against --eager");
    let scheduled = [&fp8[..], &["--schedule", "--microbatches", "2", "--virtual-stages", "2"]].concat();
    let eager_scheduled = losses(&[&scheduled[..], &["--eager"]].concat());
    assert_eq!(losses(&scheduled), eager_scheduled, "graphed under a schedule in FP8 against --eager");
    // Current scaling rescales every cast: under a schedule, a tensor kept from one microbatch
    // must not be read with a scale another microbatch's cast wrote.
    let current = [&scheduled[..], &["--fp8-scaling", "current"]].concat();
    let eager_current = losses(&[&current[..], &["--eager"]].concat());
    assert_eq!(losses(&current), eager_current, "graphed under a schedule with current scaling against --eager");
    assert_ne!(eager_current, eager_scheduled, "current scaling trains as delayed scaling does");
}
