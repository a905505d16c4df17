//! What a `train` run settles on from its arguments and the device, refused before anything is
//! built when it cannot run: the model's sizes, the learning rate and its schedule, the batch,
//! the steps, and the flags that would do nothing.

use graphed::device::{Device, DeviceKind};
use graphed::nn::{AttentionKind, GptConfig, Recompute};
use graphed::ops::attention::cudnn_refusal;
use graphed::optim::{AdamWHyper, LrSchedule, NonFinite};

use crate::cli::args::{NonFiniteArg, TrainArgs};
use crate::cli::exit::refuse;

/// What a run settles on.
pub struct Plan {
    pub config: GptConfig,
    /// The peak learning rate.
    pub lr: f32,
    pub batch: usize,
    /// The run's steps, which its learning rate schedule spans.
    pub steps: usize,
    /// The step this process stops at (`--stop-at`, at most `steps`).
    pub stop: usize,
    /// The precision in reports: the element type, and whether the layers' GEMMs run in FP8.
    pub precision: String,
}

impl Plan {
    /// The plan for a model of `vocab` tokens over `max_len` positions on `dev`.
    pub fn new(dev: &Device, args: &TrainArgs, (vocab, max_len): (usize, usize)) -> anyhow::Result<Plan> {
        let gpu = dev.kind() == DeviceKind::Cuda;
        let pick = |v: Option<u32>, cuda: u32, sim: u32| v.unwrap_or(if gpu { cuda } else { sim }) as usize;
        // Heads of 32 features by default (4 at CUDA's default width, 1 at the simulator's), which
        // the fused attention runs.
        let dim = pick(args.dim, 128, 32);
        let heads = args.heads.map_or((dim / 32).max(1), |h| h as usize);
        if !(0.0..1.0).contains(&args.dropout) {
            refuse!("--dropout {} is not in [0, 1)", args.dropout);
        }
        let config = GptConfig {
            vocab,
            max_len,
            dim,
            layers: pick(args.layers, 2, 2),
            heads,
            attention: args.attention.kind(),
            attention_backend: args.attention.backend(),
            dropout: args.dropout,
            seed: args.seed,
            dtype: args.dtype.storage(dev),
            recompute: args.recompute.recompute(),
        };
        if config.attention_backend.requires_cudnn() {
            let fused = config.attention == AttentionKind::Fused;
            let hd = config.dim / config.heads;
            let why = match cudnn_refusal(config.dtype, hd, max_len, config.dropout) {
                _ if !gpu => Some("the simulator has no cuDNN"),
                _ if !fused => Some("cuDNN runs the fused form only (`--attention fused`)"),
                why => why,
            };
            if let Some(why) = why {
                refuse!(
                    "--attention-backend {} cannot run this model: {why}; pass --attention-backend auto or kernels",
                    config.attention_backend
                );
            }
        }
        let lr = args.lr.unwrap_or(if gpu { 3e-3 } else { 5e-3 });
        if !(lr > 0.0 && lr.is_finite()) {
            refuse!("--lr {lr} is not a positive number");
        }
        let batch = pick(args.batch, 256, 64);
        check_batch(&config, batch)?;
        check_fp8(args, &config, batch)?;
        let steps = args.steps.map_or(1000, |s| s as usize);
        let stop = args.stop_at.map_or(steps, |k| k as usize);
        if stop > steps {
            refuse!("--stop-at {stop} is past the run's {steps} steps; pass at most that");
        }
        let precision = match args.dtype.fp8_recipe()? {
            Some(recipe) => format!("{} (the layers' GEMMs in FP8, {recipe})", config.dtype),
            None => config.dtype.to_string(),
        };
        Ok(Plan { config, lr, batch, steps, stop, precision })
    }

    /// What a checkpoint records of the plan, and a resumed run must match.
    pub fn saved(&self) -> (usize, usize, f32) {
        (self.batch, self.steps, self.lr)
    }

    /// The optimizer's settings: no weight decay, non-finite steps as `--on-nonfinite` says.
    pub fn hyper(args: &TrainArgs) -> AdamWHyper {
        let nonfinite = match args.on_nonfinite {
            NonFiniteArg::Stop => NonFinite::Stop,
            NonFiniteArg::Skip => NonFinite::Skip,
        };
        AdamWHyper { weight_decay: 0.0, nonfinite, ..AdamWHyper::default() }
    }

    /// The learning rate: linear warmup over the first 5% of the steps, then cosine decay to 10%.
    pub fn lr_schedule(&self) -> LrSchedule {
        let steps = self.steps as u64;
        LrSchedule::WarmupCosine { peak: self.lr, warmup: (steps / 20).max(1), total: steps, floor: 0.1 }
    }

    /// What every rank of a group must agree on to build the same model and issue the same
    /// collectives, for a run resumed after `start` steps: the same steps, each reduced the
    /// same way (after an eager step, or inside the graphs of a stack or of a schedule), and the
    /// gradients combined the same way (a rank that sums among ranks that average would weigh
    /// its loss otherwise and skip their scaling).
    pub fn signature(&self, args: &TrainArgs, start: usize) -> String {
        let reduced = match (args.schedule, args.eager) {
            (false, true) => "eagerly".to_string(),
            (false, false) => "in a graphed stack".to_string(),
            (true, eager) => {
                let (m, v) = (args.schedule_args.microbatches(), args.schedule_args.virtual_stages());
                format!(
                    "under a schedule of {m} microbatches × {v} virtual stages{}",
                    if eager { ", eagerly" } else { "" }
                )
            }
        };
        format!(
            "{:?}; {} parameters; {} pipeline stages; batch {}; steps {start} to {} of {}; reduced {reduced}; gradients' {}",
            self.config,
            self.config.parameter_count(),
            args.pipeline,
            self.batch,
            self.stop,
            self.steps,
            graphed::dist::GradReduction::from(args.grad_reduce)
        )
    }
}

/// Refuses `--fp8-scaling` without `--dtype fp8`, and `--dtype fp8` where an FP8 GEMM could not
/// run: every `k` of the layers' GEMMs (the width, and the tokens of what one forward takes, a
/// batch or a schedule's microbatch) must be a multiple of 16.
fn check_fp8(args: &TrainArgs, config: &GptConfig, batch: usize) -> anyhow::Result<()> {
    if let Err(e) = args.dtype.fp8_recipe() {
        refuse!("{e}");
    }
    if !args.dtype.fp8() {
        return Ok(());
    }
    if config.recompute != Recompute::Nothing {
        refuse!(
            "--recompute {} is not supported with --dtype fp8, whose layers keep the MLP's activation quantized; pass --recompute none or another --dtype",
            config.recompute.name()
        );
    }
    let per_forward = if args.schedule { batch / args.schedule_args.microbatches().max(1) } else { batch };
    let tokens = per_forward * config.max_len;
    if !config.dim.is_multiple_of(16) || !tokens.is_multiple_of(16) {
        refuse!(
            "--dtype fp8 needs the width ({}) and the tokens of one forward ({per_forward} sequences of {}: {tokens}) to be multiples of 16, as FP8 GEMMs do; change --dim, --batch{}",
            config.dim,
            config.max_len,
            if args.schedule { " or --microbatches" } else { " or --context" }
        );
    }
    Ok(())
}

/// Refuses a `--pipeline` that cannot split `world` ranks (1 for a process alone) into a grid, or
/// that asks for what stages do not run; the layers' and microbatches' fit to the stages is
/// the schedule's to refuse ([`ScheduleArgs::resolve`](crate::cli::args::ScheduleArgs::resolve)).
fn check_grid(args: &TrainArgs, world: usize) -> anyhow::Result<()> {
    let p = args.pipeline as usize;
    if p == 1 {
        return Ok(());
    }
    if world == 1 {
        refuse!(
            "--pipeline {p} splits the layers over {p} ranks, and this is one process; start them with `graphed launch \
             --gpus {p} -- train ...` (with --device sim, as simulated ranks), or drop --pipeline"
        );
    }
    if !world.is_multiple_of(p) {
        refuse!(
            "--pipeline {p} does not divide the {world} ranks into replicas of {p} stages; launch a multiple of {p} \
             (--gpus), or pass a --pipeline that divides {world}"
        );
    }
    if !args.schedule {
        refuse!("--pipeline runs the layers under a pipeline schedule; add --schedule (and --microbatches, --virtual-stages)");
    }
    if args.dtype.fp8() {
        refuse!(
            "--dtype fp8 is not split over pipeline stages (its scales are reduced over data-parallel ranks holding \
             every layer); drop --pipeline or --dtype fp8"
        );
    }
    if args.on_nonfinite == NonFiniteArg::Skip {
        refuse!(
            "--on-nonfinite skip with --pipeline: each stage sees only its own gradients, so stages could skip \
             different steps and the model's parts drift apart; pass --on-nonfinite stop"
        );
    }
    Ok(())
}

/// Refuses flags that would do nothing (schedule settings without `--schedule`), the one
/// combination the graphs cannot replay, and a grid that `world` ranks cannot make.
pub fn check_flags(args: &TrainArgs, world: usize) -> anyhow::Result<()> {
    check_grid(args, world)?;
    if !args.schedule && args.schedule_args.given() {
        refuse!("--microbatches and --virtual-stages shape a pipeline schedule; add --schedule, or drop them");
    }
    if args.offload.offload.is_some() && args.pool_per_layer && args.side_stream {
        refuse!(
            "--offload with --pool-per-layer cannot replay on a --side-stream: a layer's graph copies the layer \
             before's saved activations to the host after its sync event, and they live in that layer's own pool, \
             whose later replays would not wait for the copies (replay contract R3); drop one of the three"
        );
    }
    Ok(())
}

/// Refuses a batch the model's sizes cannot run, naming the flag to change.
fn check_batch(config: &GptConfig, batch: usize) -> anyhow::Result<()> {
    let Err(limit) = config.validate_batch(batch) else { return Ok(()) };
    let flag = match limit.field {
        "max_len" => "--context",
        "dim" => "--dim",
        "heads" => "--heads",
        "layers" => "--layers",
        _ => "--batch",
    };
    refuse!("{flag} {}: {}", limit.value, limit.why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::train::outputs::tests::train_args;

    #[test]
    fn the_cudnn_backend_is_refused_where_it_cannot_run_before_anything_is_built() {
        let dev = Device::sim();
        let refusal = |extra: &[&str]| Plan::new(&dev, &train_args(extra), (12, 128)).err().map(|e| e.to_string());
        let sim = refusal(&["--attention-backend", "cudnn"]).expect("refused on the simulator");
        assert!(sim.contains("the simulator has no cuDNN") && sim.contains("--attention-backend auto"), "{sim}");
        for backend in ["auto", "kernels"] {
            assert_eq!(refusal(&["--attention-backend", backend]), None, "{backend} runs anywhere");
        }
    }

    #[test]
    fn recomputing_in_fp8_is_refused_before_anything_is_built() {
        let dev = Device::sim();
        let refusal = |extra: &[&str]| Plan::new(&dev, &train_args(extra), (12, 128)).err().map(|e| e.to_string());
        let fp8 = refusal(&["--dtype", "fp8", "--dim", "32", "--batch", "16", "--recompute", "gelu"]);
        let fp8 = fp8.expect("refused in FP8");
        assert!(fp8.contains("--recompute none"), "{fp8}");
        assert_eq!(refusal(&["--dtype", "fp8", "--dim", "32", "--batch", "16"]), None, "FP8 alone runs");
        assert_eq!(refusal(&["--recompute", "gelu"]), None, "bf16 and f32 recompute");
    }
}
