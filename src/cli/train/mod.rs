//! `graphed train`: a small GPT learns 3-digit addition (`addition.rs`), or with `--data FILE` a
//! byte-level language model of a local text file (`text.rs`). Its transformer layers replay as
//! graphed callables (`step.rs`; on a side stream with `--side-stream`), the embedding and the
//! head run eagerly around them; `--eager` runs everything eagerly. Reports the loss as it goes,
//! host and wall time per step, and at the end the exact-match accuracy on held-out sums with
//! greedy decoding, or the held-out loss and a sample of the text.

mod addition;
mod checkpoint;
mod interrupt;
mod memory;
mod metrics;
mod outputs;
mod schedule;
mod step;
mod text;
mod upload;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use graphed::device::{CommErrorKind, Device, DeviceKind, Stream};
use graphed::dist::RankEnv;
use graphed::memory::CachingAllocator;
use graphed::nn::{Gpt, GptConfig};
use graphed::optim::{AdamW, AdamWHyper, LrSchedule, NonFinite};
use graphed::tensor::Tensor;
use graphed::Error;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::args::{NonFiniteArg, TrainArgs};
use super::exit::{refuse, Interrupted};

/// What a run settles on, from the arguments and the device.
struct Plan {
    config: GptConfig,
    lr: f32,
    batch: usize,
    steps: usize,
}

/// What the model learns.
enum Task {
    /// 3-digit addition, scored on held-out sums.
    Addition { held: Vec<(u32, u32)>, held_set: HashSet<(u32, u32)> },
    /// The bytes of a text file.
    Text(text::Corpus),
}

impl Task {
    fn new(args: &TrainArgs, eval: usize) -> anyhow::Result<Task> {
        match &args.data {
            Some(path) => Ok(Task::Text(text::Corpus::load(path, args.context as usize)?)),
            None => {
                let held = addition::held_out(eval, args.seed ^ 0x5eed);
                let held_set = held.iter().copied().collect();
                Ok(Task::Addition { held, held_set })
            }
        }
    }

    /// The vocabulary and the positions per sequence.
    fn shape(&self) -> (usize, usize) {
        match self {
            Task::Addition { .. } => (addition::VOCAB, addition::INPUT),
            Task::Text(c) => (text::VOCAB, c.seq()),
        }
    }

    fn batch(&self, rng: &mut SmallRng, b: usize) -> addition::Batch {
        match self {
            Task::Addition { held_set, .. } => addition::batch(rng, b, held_set),
            Task::Text(c) => c.batch(rng, b),
        }
    }

    /// What the loss is of.
    fn loss_of(&self) -> &'static str {
        match self {
            Task::Addition { .. } => "answer digits",
            Task::Text(_) => "bytes, training windows",
        }
    }

    /// Prints the end-of-run score.
    fn report(&self, model: &Gpt, alloc: &CachingAllocator, s: &Stream) -> anyhow::Result<()> {
        match self {
            Task::Addition { held, .. } => {
                let accuracy = accuracy(model, alloc, s, held)?;
                println!("exact-match accuracy on {} held-out sums: {:.1}%", held.len(), 100.0 * accuracy);
            }
            Task::Text(c) => {
                println!("held-out loss {:.4} (bytes, cross-entropy)", c.validation_loss(model, alloc, s, 64)?);
                println!("sample: {:?}", c.sample(model, alloc, s, 80)?);
            }
        }
        Ok(())
    }
}

fn plan(dev: &Device, args: &TrainArgs, (vocab, max_len): (usize, usize)) -> anyhow::Result<Plan> {
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
        dropout: args.dropout,
        seed: args.seed,
        dtype: args.dtype.resolve(dev),
    };
    let lr = args.lr.unwrap_or(if gpu { 3e-3 } else { 5e-3 });
    if !(lr > 0.0 && lr.is_finite()) {
        refuse!("--lr {lr} is not a positive number");
    }
    let batch = pick(args.batch, 256, 64);
    if let Err(limit) = config.validate_batch(batch) {
        let flag = match limit.field {
            "max_len" => "--context",
            "dim" => "--dim",
            "heads" => "--heads",
            "layers" => "--layers",
            _ => "--batch",
        };
        refuse!("{flag} {}: {}", limit.value, limit.why);
    }
    Ok(Plan { config, lr, batch, steps: args.steps.map_or(1000, |s| s as usize) })
}

/// Refuses flags that would do nothing (schedule settings without `--schedule`) and the one
/// combination the graphs cannot replay.
fn check_flags(args: &TrainArgs) -> anyhow::Result<()> {
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

/// The learning rate: linear warmup over the first 5% of the steps, then cosine decay to 10%.
fn schedule(peak: f32, steps: usize) -> LrSchedule {
    LrSchedule::WarmupCosine { peak, warmup: (steps as u64 / 20).max(1), total: steps as u64, floor: 0.1 }
}

/// Trains; `env` when launched as one rank of several (data parallel, rank 0 reports).
///
/// Everything that can refuse the run does before the first step: the flags, the output files
/// (rank 0's), the model's sizes and its memory, the checkpoint and data to resume from. Then
/// losses and metrics are written as they are reported, `--save-every` saves as it goes, a
/// non-finite step stops the run (or is skipped), and an interrupt ends it after a whole step,
/// saved and flushed.
pub fn run(dev: &Device, args: &TrainArgs, env: Option<RankEnv>) -> anyhow::Result<()> {
    let gpu = dev.kind() == DeviceKind::Cuda;
    let lead = env.as_ref().is_none_or(|e| e.rank == 0);
    check_flags(args)?;
    if lead {
        outputs::check(args)?;
    }
    let task = Task::new(args, args.eval.unwrap_or(if gpu { 1000 } else { 100 }) as usize)?;
    let plan = plan(dev, args, task.shape())?;
    let cfg = plan.config;
    let stop = args.stop_at.map_or(plan.steps, |k| k as usize);
    if stop > plan.steps {
        refuse!("--stop-at {stop} is past the run's {} steps; pass at most that", plan.steps);
    }
    memory::check(dev, &cfg, plan.batch, args)?;
    let interrupt = interrupt::Interrupt::install()?;
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let mut model = Gpt::new(&alloc, cfg, &s)?;
    let nonfinite = match args.on_nonfinite {
        NonFiniteArg::Stop => NonFinite::Stop,
        NonFiniteArg::Skip => NonFinite::Skip,
    };
    let hyper = AdamWHyper { weight_decay: 0.0, nonfinite, ..AdamWHyper::default() };
    let optimizer = AdamW::new(&alloc, model.parameters(), hyper, schedule(plan.lr, plan.steps), &s)?;
    let saved = (plan.batch, plan.steps, plan.lr);

    let start = match &args.resume {
        Some(dir) => checkpoint::resume(dir, (&model, &optimizer), &alloc, &s, args, saved, stop)?,
        None => 0,
    };
    // Every rank must build the same model and issue the same collectives: the same steps, and
    // each reduced the same way (after an eager step, or inside the graphs of a stack or of a
    // schedule).
    let reduced = match (args.schedule, args.eager) {
        (false, true) => "eagerly".to_string(),
        (false, false) => "in a graphed stack".to_string(),
        (true, eager) => {
            let (m, v) = (args.schedule_args.microbatches(), args.schedule_args.virtual_stages());
            format!("under a schedule of {m} microbatches × {v} virtual stages{}", if eager { ", eagerly" } else { "" })
        }
    };
    let signature = format!(
        "{cfg:?}; {} parameters; batch {}; steps {start} to {stop} of {}; reduced {reduced}",
        cfg.parameter_count(),
        plan.batch,
        plan.steps
    );
    let group = crate::cli::group::join(dev, env, &signature)?;
    let rank = group.as_ref().map_or(0, |g| g.env().rank);
    if let Some(g) = &group {
        println!("rank {rank} of {} (GPU {} of this host)", g.env().world, g.env().local_rank);
    }
    // The other ranks train quietly and leave reports, checkpoints and plots to rank 0.
    let say = |line: &str| {
        if lead {
            println!("{line}");
        }
    };
    // Whether `nsys profile` will see the step's ranges (docs/profiling.md).
    let nvtx = match (dev.kind(), dev.nvtx()) {
        (DeviceKind::Cuda, true) => "; NVTX ranges on",
        (DeviceKind::Cuda, false) => "; NVTX ranges off (libnvToolsExt.so not found; on CUDA 13 link libnvtx3interop.so.1 under that name, see docs/profiling.md)",
        (DeviceKind::Sim, _) => "",
    };
    say(&format!("device: {}{nvtx}", dev.name()));
    if let Some(dir) = &args.resume {
        say(&format!("resumed from {} after {start} steps", dir.display()));
    }
    let stepper =
        step::Stepper::new(&model, &optimizer, &alloc, &s, plan.batch, args, group.as_ref().map(|g| g.comm()))?;
    say(&format!(
        "model: {} layers, width {}, {} heads ({} attention), {} parameters in {}; batch {}, {} steps, {}",
        cfg.layers,
        cfg.dim,
        cfg.heads,
        cfg.attention,
        cfg.parameter_count(),
        cfg.dtype,
        plan.batch,
        plan.steps,
        stepper.describe()
    ));
    if let Some(g) = &group {
        say(&format!(
            "losses: the whole batch's, the mean over the {} ranks' batches of {}",
            g.env().world,
            plan.batch
        ));
    }
    let summary_shown = stepper.offload_summary().inspect(|s| say(s)).is_some();

    if let Task::Text(c) = &task {
        say(&format!("data: {}", c.describe()));
    }
    // Each rank draws its own batches.
    let mut rng = SmallRng::seed_from_u64(args.seed.wrapping_add(rank as u64 * 0x9E37_79B9));
    let bar = if lead { ProgressBar::new(plan.steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (mut host, started) = (Duration::ZERO, Instant::now());
    // Timing starts after this run's first step, which pays one-time costs (kernels compiled
    // into an empty cache, the graphs' first uploads), unless it is the only one.
    let (mut timed, mut timed_steps) = (started, stop - start);
    let mut last_loss = f64::NAN;
    let mut diverging = Divergence::default();
    let mut metrics =
        metrics::Metrics::open(args.metrics.as_deref().filter(|_| lead), args.resume.as_ref().map(|_| start))?;
    // The data of the steps a resumed run already took, drawn and dropped.
    for _ in 0..start {
        task.batch(&mut rng, plan.batch);
    }
    bar.set_position(start as u64);
    let mut uploader = upload::Uploader::new(dev, plan.batch, cfg.max_len)?;
    let save = |done: usize| -> anyhow::Result<()> {
        match args.save.as_ref().filter(|_| lead) {
            Some(dir) => checkpoint::save(dir, &model, &optimizer, &s, args, saved, done),
            None => Ok(()),
        }
    };
    // The steps done; fewer than `stop` when interrupted.
    let mut done = start;
    // A group's check, polled by waits that a dead rank's collectives would otherwise block.
    let watch = group.as_ref().map(|g| move || g.check());
    let trained = (|| -> anyhow::Result<()> {
        for step in start..stop {
            if let Some(g) = &group {
                // Nothing more for a group that lost a rank: its error names the rank.
                g.check()?;
            }
            let batch = task.batch(&mut rng, plan.batch);
            let upload::Uploaded { tokens, targets, weights } =
                uploader.upload(&alloc, &s, &batch, watch.as_ref().map(|w| w as &dyn Fn() -> graphed::Result<()>))?;
            let issued = Instant::now();
            let losses = {
                // A profiler's timeline shows the step's replays and optimizer step inside this.
                let _range = s.device().range_with(|| format!("step {step}"));
                stepper.step(&model, &optimizer, &tokens, &targets, &weights)?
            };
            host += issued.elapsed();
            done = step + 1;
            let saving = args.save_every.is_some_and(|n| done.is_multiple_of(n as usize));
            let reporting = step % 25 == 0 || done == stop;
            if reporting || saving {
                if let Some(g) = &group {
                    // The watchdog: a rank that died or hangs ends this one with a typed error.
                    g.wait(&s)?;
                }
                // The first step whose gradients were not finite stops the run here, before
                // anything reports or saves what came of it.
                finite(&optimizer, &s, args.on_nonfinite)?;
            }
            if reporting {
                let l = losses.to_vec::<f32>(&s)?;
                let mine = l.iter().zip(&batch.weights).map(|(l, w)| f64::from(*l) * f64::from(*w)).sum();
                // Data parallel: the loss of the whole batch, every rank's part of it.
                last_loss = crate::cli::group::mean_over_ranks(group.as_ref(), &alloc, &s, mine)?;
                if !last_loss.is_finite() && args.on_nonfinite == NonFiniteArg::Stop {
                    anyhow::bail!(
                        "the loss of step {step} is {last_loss} although every gradient was finite; lower --lr, or \
                         check the data"
                    );
                }
                bar.set_message(format!("loss {last_loss:.4}"));
                metrics.record(step, last_loss, started.elapsed().as_secs_f64())?;
                let line = format!("step {step:5}  loss {last_loss:.4}");
                if bar.is_hidden() {
                    say(&line);
                } else {
                    bar.println(line);
                }
                if let Some(warning) = diverging.observe(step, last_loss) {
                    bar.suspend(|| eprintln!("graphed: warning: {warning}"));
                }
            }
            if saving {
                save(done)?;
            }
            if step == start && stop - start > 1 {
                s.synchronize()?;
                (host, timed, timed_steps) = (Duration::ZERO, Instant::now(), stop - start - 1);
            }
            bar.inc(1);
            // A group stops together: every rank learns of any rank's interrupt at the same step.
            let stopping = match &group {
                Some(g) if reporting => crate::cli::group::any_rank(g, &alloc, &s, interrupt.requested())?,
                Some(_) => false,
                None => interrupt.requested(),
            };
            if stopping && done < stop {
                break;
            }
        }
        s.synchronize()?;
        finite(&optimizer, &s, args.on_nonfinite)
    })();
    if let (Err(e), Some(g)) = (&trained, &group) {
        // A dead rank explains whatever failed after it died (work of the aborted communicator):
        // its error comes first, the failure it caused below it.
        let named = matches!(e.downcast_ref(), Some(Error::Comm { kind: CommErrorKind::RankGone { .. }, .. }));
        let err = match (named, g.check()) {
            (false, Err(gone)) => anyhow::anyhow!("{e:#}").context(gone),
            _ => anyhow::anyhow!("{e:#}"),
        };
        // A group that failed cannot be torn down: its collectives may never end, and freeing
        // the memory they use waits for them. The process ends here, as PyTorch's NCCL watchdog
        // ends it, and the driver reclaims the GPU.
        eprintln!("graphed: rank {rank}: {err:#}");
        std::process::exit(1);
    }
    bar.finish_and_clear();
    let title = format!(
        "graphed train: {} layers, width {}, {} ({})",
        cfg.layers,
        cfg.dim,
        cfg.dtype,
        if args.eager { "eager" } else { "graphed" }
    );
    // What was reported is kept whatever happened since: the metrics are on disk already, the
    // plot is drawn from them.
    let plotted = metrics.plot(args.plot.as_deref().filter(|_| lead), &title);
    trained?;
    plotted?;
    // Training is over: a peer that ends from here on, even by crashing, no longer concerns this
    // rank (its watch would otherwise end the process during the evaluation or the save).
    crate::cli::group::leave(group);
    let wall = timed.elapsed();
    save(done)?;
    if let Some(dir) = args.save.as_ref().filter(|_| lead) {
        println!("saved the state after {done} steps to {}", dir.display());
    }
    if done < stop {
        let kept = match &args.save {
            Some(dir) => format!("saved; continue with --resume {}", dir.display()),
            None => "nothing saved (pass --save DIR to keep the state of an interrupted run)".to_string(),
        };
        return Err(Interrupted { steps: done, kept }.into());
    }
    if !summary_shown {
        // Eager offloading freezes its policy after the first step.
        stepper.offload_summary().inspect(|s| say(s));
    }
    let skipped = optimizer.skipped_steps(&s)?;
    drop(stepper);
    model.set_training(false);
    if !lead {
        return Ok(());
    }
    let per_step = |d: Duration| d.as_secs_f64() * 1e6 / timed_steps.max(1) as f64;
    println!("final loss {last_loss:.4} ({}, cross-entropy)", task.loss_of());
    if skipped > 0 {
        println!("skipped {skipped} steps whose gradients were not finite (--on-nonfinite skip)");
    }
    let which = if timed_steps + 1 == stop - start { " (after the first)" } else { "" };
    println!("time per step{which}: wall {:.0} µs, host issuing {:.0} µs", per_step(wall), per_step(host));
    println!("{}", memory::summary(&alloc.stats()));
    task.report(&model, &alloc, &s)
}

/// Fails, naming the first step whose gradients were not finite, unless `policy` skips such
/// steps (the optimizer kept the parameters of the last good step either way).
fn finite(optimizer: &AdamW, s: &Stream, policy: NonFiniteArg) -> anyhow::Result<()> {
    if policy == NonFiniteArg::Skip {
        return Ok(());
    }
    match optimizer.check_finite(s) {
        // The optimizer counts its steps from 1, the run's lines from 0.
        Err(Error::NonFinite { step, param, .. }) => anyhow::bail!(
            "step {} had a gradient that is not finite (the first in `{param}`): the run stopped with the parameters \
             of the step before it and saved nothing after it; lower --lr (or check the data) and resume from the \
             last checkpoint, or pass --on-nonfinite skip to skip such steps",
            step.saturating_sub(1)
        ),
        other => Ok(other?),
    }
}

/// Watches the reported losses for a run that diverges (a learning rate too high for the model),
/// which is finite for a while and then not.
#[derive(Default)]
struct Divergence {
    /// The lowest loss reported so far, and its step.
    best: Option<(usize, f64)>,
    warned: bool,
}

impl Divergence {
    /// A warning, once, when `loss` at `step` is ten times the lowest reported loss and above it
    /// by more than 1 (noise at a low loss is not divergence).
    fn observe(&mut self, step: usize, loss: f64) -> Option<String> {
        let (at, best) = *self.best.get_or_insert((step, loss));
        if loss < best {
            self.best = Some((step, loss));
            return None;
        }
        if self.warned || loss < 10.0 * best || loss < best + 1.0 {
            return None;
        }
        self.warned = true;
        Some(format!(
            "the loss rose from {best:.4} at step {at} to {loss:.4} at step {step}: training diverges; lower --lr"
        ))
    }
}

/// Greedy decoding of each held-out sum's answer, one digit at a time; the share that is exact.
fn accuracy(model: &Gpt, alloc: &CachingAllocator, s: &Stream, held: &[(u32, u32)]) -> anyhow::Result<f64> {
    let mut rows: Vec<Vec<u32>> =
        held.iter().map(|(a, b)| addition::encode(*a, *b)[..addition::INPUT].to_vec()).collect();
    for row in &mut rows {
        row[addition::PROMPT + 1..].fill(0);
    }
    let vocab = addition::VOCAB;
    for pos in addition::PROMPT..addition::INPUT {
        let flat: Vec<u32> = rows.iter().flatten().copied().collect();
        let tokens = Tensor::from_host(alloc, s, &flat, &[rows.len(), addition::INPUT])?;
        let probs = model.probabilities(&tokens, s)?.to_f32_vec(s)?;
        for (r, row) in rows.iter_mut().enumerate() {
            let p = &probs[(r * addition::INPUT + pos) * vocab..][..vocab];
            let best = (0..vocab).max_by(|a, b| p[*a].total_cmp(&p[*b])).unwrap_or(0) as u32;
            if pos + 1 < addition::INPUT {
                row[pos + 1] = best;
            } else {
                row.push(best);
            }
        }
    }
    let correct = rows
        .iter()
        .zip(held)
        .filter(|(row, (a, b))| addition::decode_answer(&row[addition::PROMPT + 1..]) == a + b)
        .count();
    Ok(correct as f64 / held.len() as f64)
}
