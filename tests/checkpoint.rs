//! Checkpoints: tensors of every stored type round-trip bit for bit; damaged, foreign and
//! mismatched files are typed errors that change nothing; and `graphed train --resume` continues
//! a stopped run bit for bit (on the simulator; the GPU run covers CUDA).

use std::path::{Path, PathBuf};
use std::process::Command;

use graphed::checkpoint::{Checkpoint, CheckpointErrorKind};
use graphed::device::{DType, Device};
use graphed::memory::CachingAllocator;
use graphed::tensor::Tensor;

fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_nanos();
    let dir = std::env::temp_dir().join(format!("graphed-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("the temporary directory is writable");
    dir
}

fn kind(r: graphed::Result<impl std::fmt::Debug>) -> CheckpointErrorKind {
    match r {
        Err(graphed::Error::Checkpoint { kind, .. }) => kind,
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn tensors_round_trip_and_bad_files_are_typed_errors() {
    let dev = Device::sim();
    let s = dev.stream().unwrap();
    let alloc = CachingAllocator::new(&dev);
    let f = Tensor::from_f32(&alloc, &s, &[1.5, -2.25, 3e-8, f32::MAX], &[2, 2], DType::F32).unwrap();
    let b = Tensor::from_f32(&alloc, &s, &[0.1, 0.2, 0.3], &[3], DType::BF16).unwrap();
    let u = Tensor::from_host(&alloc, &s, &[u64::MAX, 7], &[2]).unwrap();
    let mut ckpt = Checkpoint::new();
    for (name, t) in [("f", &f), ("b", &b), ("u", &u)] {
        ckpt.put(name, t, &s).unwrap();
    }
    ckpt.set_meta("k", "v");
    let dir = temp_dir("ckpt");
    let path = dir.join("c.safetensors");
    ckpt.save(&path).unwrap();
    ckpt.save(&path).unwrap();
    assert!(!dir.join("c.safetensors.tmp").exists(), "the temporary file was renamed");
    let back = Checkpoint::load(&path).unwrap();
    assert_eq!(back, ckpt);
    for (name, t) in [("f", &f), ("b", &b), ("u", &u)] {
        let into = Tensor::zeros(&alloc, &s, t.shape(), t.dtype()).unwrap();
        back.restore(name, &into, &alloc, &s).unwrap();
        let bits = |x: &Tensor| x.to_f32_vec(&s).map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>());
        match t.dtype() {
            DType::U64 => assert_eq!(into.to_vec::<u64>(&s).unwrap(), t.to_vec::<u64>(&s).unwrap()),
            _ => assert_eq!(bits(&into).unwrap(), bits(t).unwrap(), "{name}"),
        }
    }
    // Another shape or type, a missing tensor, another setting: refused, nothing written.
    let other = Tensor::from_f32(&alloc, &s, &[9.0; 4], &[4], DType::F32).unwrap();
    assert!(
        matches!(kind(back.restore("f", &other, &alloc, &s)), CheckpointErrorKind::Mismatch { tensor, .. } if tensor == "f")
    );
    assert_eq!(other.to_vec::<f32>(&s).unwrap(), vec![9.0; 4], "a refused restore writes nothing");
    let wide = Tensor::zeros(&alloc, &s, &[3], DType::F32).unwrap();
    assert!(matches!(kind(back.restore("b", &wide, &alloc, &s)), CheckpointErrorKind::Mismatch { .. }));
    assert!(matches!(kind(back.restore("nope", &wide, &alloc, &s)), CheckpointErrorKind::Missing { .. }));
    assert!(matches!(kind(back.expect_meta("k", "w")), CheckpointErrorKind::Meta { .. }));
    // Truncated, foreign and missing files.
    let bytes = std::fs::read(&path).unwrap();
    for (name, content) in [("truncated", &bytes[..bytes.len() - 3]), ("foreign", &b"not a checkpoint at all"[..])] {
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        assert!(matches!(kind(Checkpoint::load(&p)), CheckpointErrorKind::Format(_)), "{name}");
    }
    assert!(matches!(kind(Checkpoint::load(&dir.join("absent"))), CheckpointErrorKind::Io(_)));
    std::fs::remove_dir_all(dir).ok();
}

/// Runs the binary with `args` in `dir`; returns its stdout, failing with its stderr.
fn graphed(dir: &Path, args: &[&str]) -> String {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    let out = Command::new(exe).current_dir(dir).args(args).output().expect("the binary runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "graphed {args:?} failed:\n{stderr}\n{stdout}");
    stdout.into_owned()
}

/// A run stopped halfway, saved and resumed ends with the same parameters, optimizer state and
/// counters, bit for bit, and prints the same losses, as the run that never stopped (dropout on,
/// so the random-number counter must come back too); a resume with other settings is refused.
#[test]
fn train_resumes_bit_for_bit() {
    let dir = temp_dir("resume");
    let run = |extra: &[&str]| {
        let mut args = vec!["train", "--device", "sim", "--steps", "30", "--dropout", "0.1", "--eval", "5"];
        args.extend_from_slice(extra);
        graphed(&dir, &args)
    };
    let straight = run(&["--save", "whole"]);
    run(&["--stop-at", "15", "--save", "half"]);
    let resumed = run(&["--resume", "half", "--save", "resumed"]);
    let load = |d: &str| Checkpoint::load(&dir.join(d).join("checkpoint.safetensors")).unwrap();
    assert_eq!(load("resumed"), load("whole"), "the resumed run's state differs from the straight run's");
    let bytes = |d: &str| std::fs::read(dir.join(d).join("checkpoint.safetensors")).unwrap();
    assert!(bytes("resumed") == bytes("whole"), "equal checkpoints are equal files");
    let losses = |out: &str| {
        out.lines()
            .filter(|l| l.starts_with("step") && !l.starts_with("step     0"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(&resumed), losses(&straight), "losses after the resume");
    let refused = |extra: &[&str], why: &str| {
        let exe =
            std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
        let mut args = vec!["train", "--device", "sim", "--steps", "30"];
        args.extend_from_slice(extra);
        let out = Command::new(exe).current_dir(&dir).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(why), "{extra:?}: {stderr}");
    };
    refused(&["--dropout", "0.2", "--resume", "half"], "dropout");
    // Resumed past where the run stops, or from a step count past the run's: refused, naming it.
    refused(&["--dropout", "0.1", "--resume", "half", "--stop-at", "10"], "not before --stop-at 10");
    let mut damaged = load("half");
    damaged.set_meta("done", "1000000000000000");
    std::fs::create_dir_all(dir.join("damaged")).unwrap();
    damaged.save(&dir.join("damaged").join("checkpoint.safetensors")).unwrap();
    refused(&["--dropout", "0.1", "--resume", "damaged"], "the checkpoint is damaged");
    std::fs::remove_dir_all(dir).ok();
}
