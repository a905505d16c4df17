//! `train --save DIR` and `--resume DIR`: the model's parameters (under their module names), the
//! optimizer's state, the dropout step counter and the steps taken, in
//! `DIR/checkpoint.safetensors` (every tensor and the metadata under a checksum, verified before
//! anything is restored), with the run's settings as metadata that a resumed run must match, and
//! the `--data` file's size and hash, which it must match unless `--accept-changed-data`.
//!
//! A grid run (`--pipeline P` on N ranks) saves one file per stage, written by the stage's first
//! replica (its replicas hold the same state): `DIR/checkpoint-stage-S-of-P.safetensors`, each
//! with its stage's parameters under the whole model's names, its optimizer state and its
//! dropout counter. Each stage's ranks resume from their stage's file; every file records the
//! grid's shape, and a run of another shape is refused naming the flags.

use std::path::{Path, PathBuf};

use graphed::checkpoint::Checkpoint;
use graphed::device::Stream;
use graphed::memory::CachingAllocator;
use graphed::nn::{AttentionKind, Gpt, Stage};
use graphed::optim::AdamW;
use graphed::tensor::Tensor;

use crate::cli::args::TrainArgs;
use crate::cli::exit::refuse;

const FILE: &str = "checkpoint.safetensors";

/// The checkpoint file of the folder `dir` of a run without a pipeline.
pub fn file(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Where a rank's state sits in a grid run: its pipeline stage, and how many replicas the grid
/// has of it (the data-parallel ranks; 1 for a process alone).
#[derive(Debug, Clone, Copy)]
pub struct Place {
    /// Its stage: which file it saves and resumes from ([`Stage::single`] without a pipeline).
    pub stage: Stage,
    /// The grid's replicas of the stage, which decide each replica's part of the batch.
    pub replicas: usize,
}

impl Place {
    /// The file of this place's stage in the folder `dir` ([`file`] without a pipeline).
    fn file(self, dir: &Path) -> PathBuf {
        match self.stage.count() {
            1 => file(dir),
            p => dir.join(format!("checkpoint-stage-{}-of-{p}.safetensors", self.stage.index())),
        }
    }
}

/// The metadata keys of the grid's shape: its pipeline stages and its data-parallel replicas.
/// Checkpoints from before the keys existed are of one stage, and of replicas unknown (any).
const PIPELINE: &str = "pipeline";
const REPLICAS: &str = "replicas";

/// The settings a resumed run must share with the saved one.
fn settings(model: &Gpt, args: &TrainArgs, (batch, steps, lr): (usize, usize, f32)) -> Vec<(&'static str, String)> {
    let c = model.config();
    vec![
        ("format", "graphed-train-2".into()),
        ("dim", c.dim.to_string()),
        ("layers", c.layers.to_string()),
        ("heads", c.heads.to_string()),
        (ATTENTION, c.attention.name().to_string()),
        (ATTENTION_BACKEND, c.attention_backend.name().to_string()),
        ("dtype", if model.fp8().is_some() { "fp8".into() } else { c.dtype.to_string() }),
        (FP8_SCALING, model.fp8().map_or("none", |f| f.recipe().scaling.name()).into()),
        (FP8_GRADIENTS, model.fp8().map_or("none", |f| f.recipe().gradients.name()).into()),
        (RECOMPUTE, c.recompute.name().into()),
        ("dropout", c.dropout.to_string()),
        ("seed", args.seed.to_string()),
        ("batch", batch.to_string()),
        ("steps", steps.to_string()),
        ("lr", lr.to_string()),
        ("data", args.data.as_ref().map_or("addition".into(), |p| p.display().to_string())),
        ("context", c.max_len.to_string()),
    ]
}

/// The metadata key of the attention form (`fused` or `unfused`). A resume must use the saved
/// form: the parameters would load into either (both forms have the same ones), but the forms
/// round differently, so the resumed run would not continue bit for bit as the saved one would
/// have. Checkpoints from before the key existed were trained unfused, the only form then.
const ATTENTION: &str = "attention";

/// The metadata key of the fused attention's backend setting (`auto`, `cudnn`, `kernels` or
/// `cudnn-nondeterministic`). cuDNN and graphed's kernels round differently, so a fused run
/// resumes only with its own setting; checkpoints from before the key existed ran `auto`, the
/// only setting then. An unfused run runs no backend and resumes under any.
const ATTENTION_BACKEND: &str = "attention_backend";

/// The metadata key of the FP8 recipe (`--fp8-scaling`'s `delayed` or `current`, or `none`
/// without FP8). The recipes round differently; checkpoints from before the key existed ran
/// delayed scaling, the only recipe then, if any. A resume in another precision is the `dtype`
/// key's refusal.
const FP8_SCALING: &str = "fp8_scaling";

/// The metadata key of the FP8 gradients' format (`--fp8-gradients`'s `e5m2` or `e4m3`, or
/// `none` without FP8). The formats round differently; checkpoints from before the key existed
/// ran E5M2, the only format then, if any.
const FP8_GRADIENTS: &str = "fp8_gradients";

/// The metadata key of what the backward recomputes (`--recompute`'s `none` or `gelu`). A
/// recomputed GELU output can differ from the kept one in its last bit, so a run resumes only
/// with its own setting; checkpoints from before the key existed recomputed nothing.
const RECOMPUTE: &str = "recompute";

/// A setting a resume checks with the flag that sets it as the way out, rather than as a damaged
/// or foreign checkpoint: it rounds its own way, and older checkpoints lack it.
struct Flagged {
    key: &'static str,
    /// Its value in checkpoints from before the key existed.
    absent: &'static str,
    /// What the saved run did, before its value: `computed attention`.
    what: &'static str,
    /// The values' kind, plural: `forms`.
    kind: &'static str,
    flag: &'static str,
    /// Whether it bears on this run (a backend only on the fused form; a recipe only between two
    /// FP8 runs).
    applies: bool,
}

/// The settings `resume` checks as [`Flagged`], for `model` resuming `ckpt`.
fn flagged(model: &Gpt, ckpt: &Checkpoint) -> [Flagged; 5] {
    let fused = model.config().attention == AttentionKind::Fused;
    let fp8 = model.fp8().is_some() && ckpt.meta("dtype") == Some("fp8");
    [
        Flagged {
            key: ATTENTION,
            absent: "unfused",
            what: "computed attention",
            kind: "forms",
            flag: "--attention",
            applies: true,
        },
        Flagged {
            key: ATTENTION_BACKEND,
            absent: "auto",
            what: "ran fused attention on backend",
            kind: "backends",
            flag: "--attention-backend",
            applies: fused,
        },
        Flagged {
            key: FP8_SCALING,
            absent: "delayed",
            what: "ran FP8 with scaling",
            kind: "recipes",
            flag: "--fp8-scaling",
            applies: fp8,
        },
        Flagged {
            key: FP8_GRADIENTS,
            absent: "e5m2",
            what: "ran FP8 with gradients in",
            kind: "formats",
            flag: "--fp8-gradients",
            applies: fp8,
        },
        Flagged {
            key: RECOMPUTE,
            absent: "none",
            what: "ran with --recompute",
            kind: "settings",
            flag: "--recompute",
            applies: true,
        },
    ]
}

/// The metadata key of the data file's size and hash (`none` for the addition task, whose data
/// is generated).
const DATA_DIGEST: &str = "data_digest";

/// The `--data` file's size and SHA-256, as a checkpoint records it.
fn data_digest(args: &TrainArgs) -> anyhow::Result<String> {
    Ok(match &args.data {
        Some(path) => graphed::checkpoint::file_digest(path)?.to_string(),
        None => "none".into(),
    })
}

/// What a checkpoint keeps, by name: every parameter (`param.` and its module name), the
/// optimizer's state (`optim.`), the dropout step counter and, with FP8, the scaling recipes'
/// state (`fp8.`).
fn state(model: &Gpt, optimizer: &AdamW) -> anyhow::Result<Vec<(String, Tensor)>> {
    let params = model.parameters().named_values()?.into_iter().map(|(name, t)| (format!("param.{name}"), t));
    let optim = optimizer.state().into_iter().map(|(name, t)| (format!("optim.{name}"), t.clone()));
    let rng = std::iter::once(("rng.dropout_step".to_string(), model.dropout_step().clone()));
    let fp8 = model.fp8().map(|f| f.named_state()).transpose()?.unwrap_or_default();
    let fp8 = fp8.into_iter().map(|(name, t)| (format!("fp8.{name}"), t));
    Ok(params.chain(optim).chain(rng).chain(fp8).collect())
}

/// Writes the state after `done` steps of the stage at `place` to its file in `dir` (the
/// previous checkpoint stays whole until the new one is).
pub fn save(
    dir: &Path,
    (model, optimizer): (&Gpt, &AdamW),
    stream: &Stream,
    args: &TrainArgs,
    (plan, place): ((usize, usize, f32), Place),
    done: usize,
) -> anyhow::Result<()> {
    let mut ckpt = Checkpoint::new();
    for (name, t) in state(model, optimizer)? {
        ckpt.put(&name, &t, stream)?;
    }
    for (k, v) in settings(model, args, plan) {
        ckpt.set_meta(k, v);
    }
    ckpt.set_meta("done", done);
    ckpt.set_meta(DATA_DIGEST, data_digest(args)?);
    ckpt.set_meta(PIPELINE, place.stage.count());
    ckpt.set_meta(REPLICAS, place.replicas);
    // A failure to write is a failure of the run, not a refusal of its input: kept as text.
    std::fs::create_dir_all(dir)
        .map_err(anyhow::Error::from)
        .and_then(|()| Ok(ckpt.save(&place.file(dir))?))
        .map_err(|e| anyhow::anyhow!("cannot save to --save {}: {e}", dir.display()))
}

/// Refuses the checkpoint `ckpt` in `dir` unless it was saved by a grid of `place`'s shape: a
/// stage's state belongs to that stage, and its data to that many replicas.
fn check_shape(ckpt: &Checkpoint, dir: &Path, place: Place) -> anyhow::Result<()> {
    let (p, r) = (place.stage.count(), place.replicas);
    let saved_p: usize = ckpt.meta(PIPELINE).and_then(|v| v.parse().ok()).unwrap_or(1);
    let saved_r: Option<usize> = ckpt.meta(REPLICAS).and_then(|v| v.parse().ok());
    if saved_p != p || saved_r.is_some_and(|s| s != r) {
        let (ranks, was) = match saved_r {
            Some(s) => (format!(" and `graphed launch --gpus {}`", saved_p * s), format!("{saved_p} × {s}")),
            None => (String::new(), format!("{saved_p} × some")),
        };
        refuse!(
            "{}: the run saved there was a grid of {was} (pipeline stages × data-parallel replicas), this one is \
             {p} × {r}; a stage's state and the replicas' data belong to that grid: resume with --pipeline \
             {saved_p}{ranks}",
            dir.display()
        );
    }
    Ok(())
}

/// The checkpoint of `place`'s stage in `dir`, refused when the folder holds another grid's.
fn load(dir: &Path, place: Place) -> anyhow::Result<Checkpoint> {
    let path = place.file(dir);
    if !path.exists() {
        // Another grid's file says which flags to pass.
        let other = std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("checkpoint") && n.ends_with(".safetensors"))
        });
        if let Some(ckpt) = other.and_then(|o| Checkpoint::load_unverified(&o).ok()) {
            check_shape(&ckpt, dir, place)?;
        }
    }
    let ckpt = Checkpoint::load(&path)?;
    check_shape(&ckpt, dir, place)?;
    Ok(ckpt)
}

/// Refuses a `--resume` from `dir` that the ranks of a grid of `stages` × `replicas` could not
/// resume: another grid's checkpoint, a stage's file missing, or stages' files of different
/// steps (a save cut short between them). What the launcher of simulated ranks checks once,
/// before any rank is built (each rank checks its own file as it resumes; launched processes
/// that would start at different steps are refused by the rendezvous).
pub fn check_resumable(dir: &Path, stages: usize, replicas: usize) -> anyhow::Result<()> {
    let mut done: Vec<String> = Vec::with_capacity(stages);
    for s in 0..stages {
        let ckpt = load(dir, Place { stage: Stage::new(s, stages)?, replicas })?;
        done.push(ckpt.meta("done").unwrap_or("none").to_string());
    }
    if done.iter().any(|d| *d != done[0]) {
        refuse!(
            "{}: the stages' files are of different steps ({}): a save was cut short between them; resume from a \
             folder whose files one run wrote together",
            dir.display(),
            done.iter().enumerate().map(|(s, d)| format!("stage {s} after {d}")).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

/// Restores the state of `place`'s stage saved in `dir` for a run that stops after `stop` steps;
/// returns the steps it had taken. Every tensor and setting, the grid's shape and the step count
/// are checked before anything is restored.
pub fn resume(
    dir: &Path,
    (model, optimizer): (&Gpt, &AdamW),
    (alloc, stream): (&CachingAllocator, &Stream),
    args: &TrainArgs,
    (plan, place): ((usize, usize, f32), Place),
    stop: usize,
) -> anyhow::Result<usize> {
    let ckpt = load(dir, place)?;
    let settings = settings(model, args, plan);
    let flagged = flagged(model, &ckpt);
    for Flagged { key, absent, what, kind, flag, applies } in &flagged {
        let now = settings.iter().find(|(k, _)| k == key).map_or("", |(_, v)| v.as_str());
        let saved = ckpt.meta(key).unwrap_or(absent);
        if *applies && saved != now {
            refuse!(
                "{}: the run saved there {what} {saved}, this one {now}; the {kind} round differently, so the run \
                 would not continue as it would have; pass {flag} {saved}",
                dir.display()
            );
        }
    }
    for (k, v) in settings.into_iter().filter(|(k, _)| !flagged.iter().any(|f| f.key == *k)) {
        ckpt.expect_meta(k, v)?;
    }
    let Some(done) = ckpt.meta("done").and_then(|d| d.parse::<usize>().ok()) else {
        refuse!(
            "{}: no step count (`done`) in the metadata; point at a checkpoint `train --save` wrote",
            dir.display()
        );
    };
    if done > plan.1 {
        refuse!(
            "{}: the step count (`done` = {done}) is past the run's {} steps; the checkpoint is damaged, point at one \
             `train --save` wrote",
            dir.display(),
            plan.1
        );
    }
    if done == plan.1 {
        refuse!(
            "{}: the run saved there finished all its {done} steps: nothing to run; start a new run, or one with more \
             --steps from scratch",
            dir.display()
        );
    }
    if done >= stop {
        refuse!(
            "{}: the checkpoint is after {done} steps, not before --stop-at {stop}: nothing to run; pass a later \
             --stop-at, or none",
            dir.display()
        );
    }
    let (saved_on, now) = (ckpt.meta(DATA_DIGEST).unwrap_or("missing"), data_digest(args)?);
    if saved_on != now && !args.accept_changed_data {
        refuse!(
            "{}: the data file changed since the checkpoint was saved (it was {saved_on}, it is {now}); pass the file \
             it was trained on, or --accept-changed-data to go on with this one",
            dir.display()
        );
    }
    let targets = state(model, optimizer)?;
    for (name, t) in &targets {
        ckpt.check(name, t)?;
    }
    for (name, t) in &targets {
        ckpt.restore(name, t, alloc, stream)?;
    }
    if let Some(fp8) = model.fp8() {
        fp8.refresh_weights(stream)?;
    }
    Ok(done)
}
