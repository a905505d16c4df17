//! Checkpoints: tensors of every stored type round-trip bit for bit; damaged (any flipped bit,
//! truncation, overwritten bytes, edited header), foreign, unchecksummed and mismatched files are
//! typed errors that change nothing; and `graphed train --resume` continues a stopped run bit for
//! bit (on the simulator; the GPU run covers CUDA).

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use graphed::checkpoint::{Checkpoint, CheckpointErrorKind};
use graphed::device::{DType, Device};
use graphed::memory::CachingAllocator;
use graphed::tensor::Tensor;
use proptest::prelude::*;

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
    let e4 = Tensor::from_f32(&alloc, &s, &[448.0, -0.001953125, 1e9], &[3], DType::F8E4M3).unwrap();
    let e5 = Tensor::from_f32(&alloc, &s, &[57344.0, -1.5258789e-5, 3.0], &[3], DType::F8E5M2).unwrap();
    let tensors = [("f", &f), ("b", &b), ("u", &u), ("e4", &e4), ("e5", &e5)];
    let mut ckpt = Checkpoint::new();
    for (name, t) in tensors {
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
    for (name, t) in tensors {
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

/// The binary: under a nextest archive (the GPU machine) it is elsewhere, and nextest says where.
fn exe() -> String {
    std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string())
}

/// The loss lines a run printed after its first step.
fn losses(out: &str) -> Vec<String> {
    out.lines().filter(|l| l.starts_with("step") && !l.starts_with("step     0")).map(str::to_string).collect()
}

/// Runs the binary with `args` in `dir`; returns its stdout, failing with its stderr.
fn graphed(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(exe()).current_dir(dir).args(args).output().expect("the binary runs");
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
    assert_eq!(losses(&resumed), losses(&straight), "losses after the resume");
    let refused = |extra: &[&str], why: &str| {
        let mut args = vec!["train", "--device", "sim", "--steps", "30"];
        args.extend_from_slice(extra);
        assert_refused(&dir, &args, why);
    };
    refused(&["--dropout", "0.2", "--resume", "half"], "dropout");
    // The fused attention's backend rounds its own way: another one is refused, naming the flag.
    refused(&["--dropout", "0.1", "--resume", "half", "--attention-backend", "kernels"], "--attention-backend auto");
    // So does a recomputed GELU output.
    refused(&["--dropout", "0.1", "--resume", "half", "--recompute", "gelu"], "pass --recompute none");
    // Resumed past where the run stops, or from a step count past the run's: refused, naming it.
    refused(&["--dropout", "0.1", "--resume", "half", "--stop-at", "10"], "not before --stop-at 10");
    let mut damaged = load("half");
    damaged.set_meta("done", "1000000000000000");
    std::fs::create_dir_all(dir.join("damaged")).unwrap();
    damaged.save(&dir.join("damaged").join("checkpoint.safetensors")).unwrap();
    refused(&["--dropout", "0.1", "--resume", "damaged"], "the checkpoint is damaged");
    std::fs::remove_dir_all(dir).ok();
}

/// In FP8 too: the recipes' histories and scales are in the checkpoint, the resumed run
/// continues bit for bit, and a resume in another precision, scaling or gradient format is refused.
#[test]
fn fp8_train_resumes_bit_for_bit() {
    let dir = temp_dir("resume-fp8");
    let run = |extra: &[&str]| {
        let mut args = vec!["train", "--device", "sim", "--steps", "20", "--dtype", "fp8", "--eval", "5"];
        args.extend_from_slice(extra);
        graphed(&dir, &args)
    };
    let straight = run(&["--save", "whole"]);
    run(&["--stop-at", "10", "--save", "half"]);
    let resumed = run(&["--resume", "half", "--save", "resumed"]);
    let load = |d: &str| Checkpoint::load(&dir.join(d).join("checkpoint.safetensors")).unwrap();
    assert_eq!(load("resumed"), load("whole"), "the resumed run's state differs from the straight run's");
    let saved = std::fs::read(dir.join("whole").join("checkpoint.safetensors")).unwrap();
    let names = safetensors::SafeTensors::deserialize(&saved)
        .unwrap()
        .names()
        .into_iter()
        .map(str::to_string)
        .collect::<Vec<_>>();
    for part in ["fp8.forward.history", "fp8.forward.scale", "fp8.backward.scale_inv"] {
        assert!(names.iter().any(|n| n == part), "{part} is not in the checkpoint: {names:?}");
    }
    assert_eq!(losses(&resumed), losses(&straight), "losses after the resume");
    let resume = |extra: &[&str], why: &str| {
        let mut args = vec!["train", "--device", "sim", "--steps", "20", "--resume", "half"];
        args.extend_from_slice(extra);
        assert_refused(&dir, &args, why);
    };
    // Another precision; another scaling recipe or gradient format, naming the saved one.
    resume(&["--dtype", "bf16"], "fp8");
    resume(&["--dtype", "fp8", "--fp8-scaling", "current"], "--fp8-scaling delayed");
    resume(&["--dtype", "fp8", "--fp8-gradients", "e4m3"], "--fp8-gradients e5m2");
    std::fs::remove_dir_all(dir).ok();
}

/// Runs `graphed args` in `dir` and asserts it fails with `why` in its standard error.
fn assert_refused(dir: &Path, args: &[&str], why: &str) {
    let out = Command::new(exe()).current_dir(dir).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(why), "{args:?}: {stderr}");
}

/// The checkpoint the damage tests start from (tensors of three element types and two metadata
/// keys) and the bytes of its file.
fn saved() -> &'static (Checkpoint, Vec<u8>) {
    static SAVED: OnceLock<(Checkpoint, Vec<u8>)> = OnceLock::new();
    SAVED.get_or_init(|| {
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
        ckpt.set_meta("step", "7");
        let dir = temp_dir("saved");
        let path = dir.join("c.safetensors");
        ckpt.save(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_dir_all(dir).ok();
        (ckpt, bytes)
    })
}

/// Where each tensor's bytes lie in the file `bytes`.
fn layout(bytes: &[u8]) -> Vec<(String, Range<usize>)> {
    let (n, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let data = 8 + n;
    header
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, data + info.data_offsets.0..data + info.data_offsets.1))
        .collect()
}

/// Writes `bytes` as `path` and loads it: `Err` with the kind of a refusal, `Ok` if it loaded,
/// and then (asserted here) to exactly the saved checkpoint. Any other outcome fails the test.
fn load_damaged(path: &Path, bytes: &[u8]) -> Result<(), CheckpointErrorKind> {
    std::fs::write(path, bytes).unwrap();
    match Checkpoint::load(path) {
        Ok(loaded) => {
            assert_eq!(loaded, saved().0, "a damaged file loaded to another checkpoint");
            Ok(())
        }
        Err(graphed::Error::Checkpoint { kind, .. }) => Err(kind),
        Err(other) => panic!("not a checkpoint error: {other}"),
    }
}

/// The file's header as JSON, and its data.
fn split(bytes: &[u8]) -> (serde_json::Value, &[u8]) {
    let (n, _) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), &bytes[8 + n..])
}

/// A safetensors file of `header` (padded as safetensors pads it) and `data`.
fn join(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let mut text = header.to_string();
    text.push_str(&" ".repeat(text.len().next_multiple_of(8) - text.len()));
    [&(text.len() as u64).to_le_bytes()[..], text.as_bytes(), data].concat()
}

/// The `graphed` metadata object of `header`, edited by `edit`.
fn edit_meta(header: &mut serde_json::Value, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let stored = &mut header["__metadata__"]["graphed"];
    let mut meta: serde_json::Map<String, serde_json::Value> = serde_json::from_str(stored.as_str().unwrap()).unwrap();
    edit(&mut meta);
    *stored = serde_json::Value::String(serde_json::Value::Object(meta).to_string());
}

/// The report: bytes of a tensor overwritten, or one bit flipped, resumed silently. Now
/// the tensor is named; edited metadata is named as such.
#[test]
fn damaged_tensors_and_metadata_are_named() {
    let (_, bytes) = saved();
    let dir = temp_dir("named");
    let path = dir.join("c.safetensors");
    for (name, range) in layout(bytes) {
        let mut flipped = bytes.clone();
        flipped[range.start] ^= 0x10;
        assert_eq!(load_damaged(&path, &flipped), Err(CheckpointErrorKind::Corrupt { tensor: name.clone() }));
        let mut overwritten = bytes.clone();
        overwritten[range].iter_mut().for_each(|b| *b = !*b);
        assert_eq!(load_damaged(&path, &overwritten), Err(CheckpointErrorKind::Corrupt { tensor: name }));
    }
    // A value edited, a key added, a key removed: the file stays a valid safetensors file.
    let (header, data) = split(bytes);
    assert_eq!(load_damaged(&path, &join(&header, data)), Ok(()), "the file rewritten unchanged loads");
    let edits: [fn(&mut serde_json::Map<String, serde_json::Value>); 3] = [
        |m| {
            m.insert("step".into(), "8".into());
        },
        |m| {
            m.insert("extra".into(), "1".into());
        },
        |m| {
            m.remove("k");
        },
    ];
    for edit in edits {
        let mut header = header.clone();
        edit_meta(&mut header, edit);
        assert_eq!(load_damaged(&path, &join(&header, data)), Err(CheckpointErrorKind::CorruptMeta));
    }
    // Bytes from one tensor's place swapped into another's of the same size and type: the
    // offsets of `f` and `u` (16 bytes each) exchanged.
    let mut swapped = header.clone();
    let (f, u) = (swapped["f"]["data_offsets"].clone(), swapped["u"]["data_offsets"].clone());
    (swapped["f"]["data_offsets"], swapped["u"]["data_offsets"]) = (u, f);
    swapped["f"]["dtype"] = "U64".into();
    swapped["u"]["dtype"] = "F32".into();
    swapped["u"]["shape"] = serde_json::json!([2, 2]);
    swapped["f"]["shape"] = serde_json::json!([2]);
    assert!(matches!(load_damaged(&path, &join(&swapped, data)), Err(CheckpointErrorKind::Corrupt { .. })));
    std::fs::remove_dir_all(dir).ok();
}

/// A file without checksums, from an older graphed or from another tool, is refused unless the
/// caller accepts it explicitly; saved again, it has them. The file stays what PyTorch and
/// `bench/torch_reference.py` read: safetensors with the metadata as one flat JSON object.
#[test]
fn files_without_checksums_load_only_when_asked() {
    let (ckpt, bytes) = saved();
    let dir = temp_dir("unverified");
    let (mut header, data) = split(bytes);
    let meta: HashMap<String, String> =
        serde_json::from_str(header["__metadata__"]["graphed"].as_str().unwrap()).unwrap();
    assert_eq!((meta["k"].as_str(), meta["step"].as_str(), meta.len()), ("v", "7", 3), "{meta:?}");
    edit_meta(&mut header, |m| drop(m.remove("graphed.sha256")));
    let older = dir.join("older.safetensors");
    std::fs::write(&older, join(&header, data)).unwrap();
    let mut foreign = header.clone();
    foreign.as_object_mut().unwrap().remove("__metadata__");
    let other_tool = dir.join("other.safetensors");
    std::fs::write(&other_tool, join(&foreign, data)).unwrap();
    for path in [&older, &other_tool] {
        assert!(matches!(kind(Checkpoint::load(path)), CheckpointErrorKind::Unverified), "{path:?}");
    }
    assert_eq!(Checkpoint::load_unverified(&older).unwrap(), *ckpt);
    let tensors_only = Checkpoint::load_unverified(&other_tool).unwrap();
    assert_eq!((tensors_only.names().collect::<Vec<_>>(), tensors_only.meta("k")), (vec!["b", "f", "u"], None));
    // Saved again, it has checksums: the same file graphed writes.
    let resaved = dir.join("resaved.safetensors");
    Checkpoint::load_unverified(&older).unwrap().save(&resaved).unwrap();
    assert!(std::fs::read(&resaved).unwrap() == *bytes, "the re-saved file is the saved one");
    // A file with checksums is verified by load_unverified too.
    let mut flipped = bytes.clone();
    *flipped.last_mut().unwrap() ^= 1;
    std::fs::write(&older, flipped).unwrap();
    assert!(matches!(kind(Checkpoint::load_unverified(&older)), CheckpointErrorKind::Corrupt { .. }));
    std::fs::remove_dir_all(dir).ok();
}

/// Truncations at every kind of place (in the length prefix, in the header, at its end, at and
/// around each tensor's boundaries, one byte short) and a byte appended: refused as not a whole
/// safetensors file.
#[test]
fn every_kind_of_truncation_is_refused() {
    let (_, bytes) = saved();
    let dir = temp_dir("truncations");
    let path = dir.join("c.safetensors");
    let data = layout(bytes).iter().map(|(_, r)| r.start).min().unwrap();
    let mut lengths: Vec<usize> =
        (0..=9).chain((9..data).step_by(61)).chain([data - 1, data, bytes.len() - 1]).collect();
    for (_, r) in layout(bytes) {
        lengths.extend([r.start + 1, r.end - 1, r.end]);
    }
    lengths.retain(|&len| len < bytes.len());
    for len in lengths {
        assert!(matches!(load_damaged(&path, &bytes[..len]), Err(CheckpointErrorKind::Format(_))), "{len} bytes");
    }
    let longer = [&bytes[..], &[0]].concat();
    assert!(matches!(load_damaged(&path, &longer), Err(CheckpointErrorKind::Format(_))));
    std::fs::remove_dir_all(dir).ok();
}

/// One edit of a file's header, as a person or a broken tool might make it.
#[derive(Debug, Clone)]
enum Edit {
    /// A tensor's element type.
    DType(usize, &'static str),
    /// A tensor's shape.
    Shape(usize, Vec<usize>),
    /// A tensor's data offsets, moved.
    Offsets(usize, i64, i64),
    /// A tensor renamed.
    Rename(usize, String),
    /// A metadata value set (an existing key or a new one).
    Meta(String, String),
    /// A metadata key removed.
    Unset(String),
    /// A tensor's checksum (or, past the tensors, the metadata's) replaced.
    Sum(usize, String),
}

/// Any one [`Edit`] of the saved file's header.
fn edit() -> impl Strategy<Value = Edit> {
    let dtype = prop::sample::select(vec!["F32", "BF16", "F16", "U32", "I32", "U64", "I64", "F64", "U8", "BOOL"]);
    let key = prop::sample::select(vec!["k".to_string(), "step".into(), "new".into()]);
    prop_oneof![
        (0..3usize, dtype).prop_map(|(t, d)| Edit::DType(t, d)),
        (0..3usize, prop::collection::vec(0..9usize, 0..4)).prop_map(|(t, s)| Edit::Shape(t, s)),
        (0..3usize, -9..9i64, -9..9i64).prop_map(|(t, a, b)| Edit::Offsets(t, a, b)),
        (0..3usize, "[a-z]{1,2}").prop_map(|(t, n)| Edit::Rename(t, n)),
        (key.clone(), "[0-9a-z]{0,2}").prop_map(|(k, v)| Edit::Meta(k, v)),
        key.prop_map(Edit::Unset),
        (0..4usize, "[0-9a-f]{64}").prop_map(|(t, h)| Edit::Sum(t, h)),
    ]
}

/// Applies `edit` to `header`, whose tensors are `names`.
fn apply(header: &mut serde_json::Value, names: &[&str], edit: &Edit) {
    match edit {
        Edit::DType(t, d) => header[names[*t]]["dtype"] = (*d).into(),
        Edit::Shape(t, s) => header[names[*t]]["shape"] = serde_json::json!(s),
        Edit::Offsets(t, a, b) => {
            let offsets = &mut header[names[*t]]["data_offsets"];
            let moved = |i: usize, by: i64| (offsets[i].as_i64().unwrap_or(0) + by).max(0);
            *offsets = serde_json::json!([moved(0, *a), moved(1, *b)]);
        }
        Edit::Rename(t, to) => {
            let object = header.as_object_mut().unwrap();
            // (Unless an earlier edit renamed it already.)
            if let Some(info) = object.remove(names[*t]) {
                object.insert(to.clone(), info);
            }
        }
        Edit::Meta(k, v) => edit_meta(header, |m| {
            m.insert(k.clone(), v.clone().into());
        }),
        Edit::Unset(k) => edit_meta(header, |m| {
            m.remove(k);
        }),
        Edit::Sum(t, hex) => edit_meta(header, |m| {
            let mut sums: serde_json::Value = serde_json::from_str(m["graphed.sha256"].as_str().unwrap()).unwrap();
            match names.get(*t) {
                Some(name) => sums["tensors"][name] = hex.clone().into(),
                None => sums["meta"] = hex.clone().into(),
            }
            m.insert("graphed.sha256".into(), sums.to_string().into());
        }),
    }
}

// Case counts keep each property to about a second on a busy two-core machine, where writing the
// damaged file is most of a case's time.
proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::with_cases(96) })]

    /// One bit flipped anywhere (header or data): never a panic; refused with a typed error, or
    /// (a flip safetensors ignores) loaded equal to the saved checkpoint. A flip in a tensor's
    /// bytes names that tensor.
    #[test]
    fn single_bit_flips_are_refused_or_harmless(at in any::<prop::sample::Index>(), bit in 0..8u8) {
        let (_, bytes) = saved();
        let at = at.index(bytes.len());
        let mut flipped = bytes.clone();
        flipped[at] ^= 1 << bit;
        let dir = temp_dir("flips");
        let outcome = load_damaged(&dir.join("c.safetensors"), &flipped);
        std::fs::remove_dir_all(dir).ok();
        if let Some((name, _)) = layout(bytes).into_iter().find(|(_, r)| r.contains(&at)) {
            prop_assert_eq!(outcome, Err(CheckpointErrorKind::Corrupt { tensor: name }));
        }
    }

    /// Cut anywhere: refused as not a whole safetensors file.
    #[test]
    fn truncations_anywhere_are_refused(len in any::<prop::sample::Index>()) {
        let (_, bytes) = saved();
        let dir = temp_dir("cuts");
        let outcome = load_damaged(&dir.join("c.safetensors"), &bytes[..len.index(bytes.len())]);
        std::fs::remove_dir_all(dir).ok();
        prop_assert!(matches!(outcome, Err(CheckpointErrorKind::Format(_))), "{:?}", outcome);
    }

    /// Edits of the header (types, shapes, offsets, names, metadata, checksums; up to three at
    /// once): refused with a typed error, or the file still holds exactly what was saved.
    #[test]
    fn header_edits_are_refused_or_harmless(edits in prop::collection::vec(edit(), 1..4)) {
        let (_, bytes) = saved();
        let (mut header, data) = split(bytes);
        for e in &edits {
            apply(&mut header, &["b", "f", "u"], e);
        }
        let dir = temp_dir("edits");
        // Refused or the same: load_damaged asserts that an edited file that loads is the saved one.
        let _refused = load_damaged(&dir.join("c.safetensors"), &join(&header, data));
        std::fs::remove_dir_all(dir).ok();
    }

    /// Up to 32 bytes overwritten anywhere with any values: refused with a typed error, or the
    /// same checkpoint; bytes changed inside the tensors' data name one of the tensors changed.
    #[test]
    fn overwritten_bytes_are_refused_or_harmless(at in any::<prop::sample::Index>(), new in prop::collection::vec(any::<u8>(), 1..32)) {
        let (_, bytes) = saved();
        let at = at.index(bytes.len());
        let mut damaged = bytes.clone();
        let end = (at + new.len()).min(bytes.len());
        damaged[at..end].copy_from_slice(&new[..end - at]);
        let dir = temp_dir("overwrites");
        let outcome = load_damaged(&dir.join("c.safetensors"), &damaged);
        std::fs::remove_dir_all(dir).ok();
        let tensors = layout(bytes);
        let changed: Vec<&str> = tensors
            .iter()
            .filter(|(_, r)| r.clone().any(|i| damaged[i] != bytes[i]))
            .map(|(name, _)| name.as_str())
            .collect();
        if at >= tensors.iter().map(|(_, r)| r.start).min().unwrap() && !changed.is_empty() {
            prop_assert!(matches!(&outcome, Err(CheckpointErrorKind::Corrupt { tensor }) if changed.contains(&tensor.as_str())), "{outcome:?}, {changed:?}");
        }
    }
}
