//! A `train` run in three parts. [`Training::setup`] refuses whatever can be refused before the
//! first step (the flags, rank 0's output files, the model's sizes and its memory, the checkpoint
//! and data to resume from), then joins the group, builds the model and its step and announces
//! them. [`Training::steps`] trains: losses and metrics are written as they are reported,
//! `--save-every` saves as it goes, a non-finite step stops the run (or is skipped), and an
//! interrupt stops it after a whole step. [`Training::finish`] keeps what was reported, saves,
//! and scores the model; an interrupted run ends with [`Interrupted`] once saved and flushed.

use std::time::{Duration, Instant};

use graphed::device::{CommErrorKind, Device, DeviceKind, Event, Stream};
use graphed::dist::{GradReduction, Grid, ProcessGroup};
use graphed::memory::CachingAllocator;
use graphed::nn::{Gpt, GptConfig, GptPart, Stage};
use graphed::optim::AdamW;
use graphed::tensor::Tensor;
use graphed::Error;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::health::{self, Divergence};
use super::interrupt::Interrupt;
use super::metrics::Metrics;
use super::plan::{self, Plan};
use super::step::Stepper;
use super::task::Task;
use super::upload::{Uploaded, Uploader, WaitFor};
use super::{checkpoint, memory, outputs, Joining};
use crate::cli::args::TrainArgs;
use crate::cli::exit::{refuse, Interrupted};
use crate::cli::group;

/// Where the steps stand, and their clocks.
struct Progress {
    /// Steps done; fewer than the plan's `stop` when interrupted.
    done: usize,
    /// The last reported loss: the whole batch's, every rank's part of it.
    last_loss: f64,
    diverging: Divergence,
    /// When the steps were about to begin: the metrics' seconds count from here.
    started: Instant,
    /// When the timed steps began: after this run's first step, which pays one-time costs
    /// (kernels compiled into an empty cache, the graphs' first uploads), unless it is the only one.
    timed: Instant,
    /// The steps timed from `timed`.
    timed_steps: usize,
    /// Host time spent issuing the timed steps.
    host: Duration,
}

impl Progress {
    /// No step reported yet, `done` steps done; all of the `steps` to come timed from `started`.
    fn new(started: Instant, done: usize, steps: usize) -> Progress {
        Progress {
            done,
            last_loss: f64::NAN,
            diverging: Divergence::default(),
            started,
            timed: started,
            timed_steps: steps,
            host: Duration::ZERO,
        }
    }
}

/// A `train` run, set up. Its fields are dropped in the order they are declared, the stream
/// last.
pub struct Training<'a> {
    args: &'a TrainArgs,
    /// Rank 0, or the only process: the one that reports and plots (and, without a pipeline,
    /// saves).
    lead: bool,
    /// Its pipeline stage (the only one without `--pipeline`) and the grid's replicas.
    place: checkpoint::Place,
    /// Its replica: which part of the whole batch it trains on (see `Task::batch`); its rank
    /// without `--pipeline`. The first replica of each stage saves the stage's state.
    replica: usize,
    plan: Plan,
    /// Steps a resumed run had taken before it; 0 for a fresh one.
    start: usize,
    task: Task,
    /// This rank's batches (each rank draws its own).
    rng: SmallRng,
    uploader: Uploader,
    metrics: Metrics,
    bar: ProgressBar,
    progress: Progress,
    /// Whether the offload policy's table was shown before the steps (graphed runs freeze it when
    /// captured; eager ones after their first step).
    summary_shown: bool,
    stepper: Stepper,
    group: Option<ProcessGroup>,
    /// This rank; 0 without a group.
    rank: usize,
    /// How the ranks' gradients combine, which decides what each rank's loss weighs.
    reduction: GradReduction,
    interrupt: Interrupt,
    optimizer: AdamW,
    model: Gpt,
    alloc: CachingAllocator,
    s: Stream,
}

impl<'a> Training<'a> {
    /// Refuses the run before anything is built if it cannot run as asked, then builds it on
    /// `dev`, alone or joining a data-parallel group, or a grid of pipelines with `--pipeline`,
    /// as `joining` says (rank 0 reports).
    pub fn setup(dev: &Device, args: &'a TrainArgs, joining: Joining) -> anyhow::Result<Training<'a>> {
        let lead = joining.lead();
        let (rank, world) = joining.place();
        let (task, plan) = refusals(dev, args, lead, world)?;
        // This rank's stage and replica in the grid (`--pipeline`; refused above unless it fits).
        let (stage, replica) = Grid::place(rank, world, args.pipeline as usize)?;
        let place = checkpoint::Place { stage, replicas: world / stage.count() };
        let interrupt = Interrupt::install()?;
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let model = match args.dtype.fp8_recipe()? {
            Some(recipe) => Gpt::with_fp8(&alloc, plan.config, recipe, &s)?,
            None if stage.count() > 1 => {
                let part = GptPart::stage(plan.config.layers, stage, args.schedule_args.virtual_stages())?;
                Gpt::part(&alloc, plan.config, &part, &s)?
            }
            None => Gpt::new(&alloc, plan.config, &s)?,
        };
        let optimizer = AdamW::new(&alloc, model.parameters(), Plan::hyper(args), plan.lr_schedule(), &s)?;
        let optimizer = match model.fp8() {
            Some(fp8) => optimizer.with_fp8(fp8),
            None => optimizer,
        };
        let start = match &args.resume {
            Some(dir) => {
                checkpoint::resume(dir, (&model, &optimizer), (&alloc, &s), args, (plan.saved(), place), plan.stop)?
            }
            None => 0,
        };
        let group = match joining {
            Joining::Alone => None,
            Joining::Launched(env) => group::join(dev, Some(env), &plan.signature(args, start), args.comm_options())?,
            // Its ranks are threads of this process, given the same arguments: the same model.
            Joining::Simulated(g) => Some(g),
        };
        let reduction = GradReduction::from(args.grad_reduce);
        announce_device(dev, args, group.as_ref(), lead, start, place);
        let grid = match &group {
            Some(g) if stage.count() > 1 => Some(g.grid(stage.count())?),
            _ => None,
        };
        // The gradients are reduced over the stage's replicas: the whole group without a
        // pipeline, none for a grid of one replica.
        let data_parallel = match &grid {
            Some(g) => Some(g.data_parallel()).filter(|c| c.size() > 1),
            None => group.as_ref().map(|g| g.comm()),
        };
        // Every rank's scales from the amaxes of the whole batch, as one GPU would compute them.
        if let (Some(fp8), Some(c)) = (model.fp8(), data_parallel) {
            fp8.reduce_amaxes_over(c)?;
        }
        let comms = (data_parallel, grid.as_ref().map(Grid::pipeline));
        let stepper = Stepper::new(&model, &optimizer, &alloc, &s, plan.batch, args, comms)?;
        let summary_shown = announce_model(lead, &plan, &stepper, group.as_ref(), &task, (reduction, place));
        // Every rank draws the whole batch and keeps its part (see `Task::batch`).
        let mut rng = SmallRng::seed_from_u64(args.seed);
        let started = Instant::now();
        let metrics = Metrics::open(args.metrics.as_deref().filter(|_| lead), args.resume.as_ref().map(|_| start))?;
        // The data of the steps a resumed run already took, drawn and dropped.
        for _ in 0..start {
            task.batch(&mut rng, plan.batch, (replica, place.replicas), reduction);
        }
        let uploader = Uploader::new(dev, plan.batch, plan.config.max_len)?;
        let bar = progress_bar(lead, plan.steps, start);
        let progress = Progress::new(started, start, plan.stop - start);
        Ok(Training {
            args,
            lead,
            place,
            replica,
            plan,
            start,
            task,
            rng,
            uploader,
            metrics,
            bar,
            progress,
            summary_shown,
            stepper,
            group,
            rank,
            reduction,
            interrupt,
            optimizer,
            model,
            alloc,
            s,
        })
    }

    /// Trains from the run's start to its stop, or until an interrupt (on any rank) after a
    /// whole step; the steps done are kept for [`Training::finish`].
    pub fn steps(&mut self) -> anyhow::Result<()> {
        for step in self.start..self.plan.stop {
            if self.step(step)? {
                break;
            }
        }
        self.s.synchronize()?;
        health::gradients(&self.optimizer, &self.s, self.args.on_nonfinite)
    }

    /// Step `step`, reported and saved as the arguments say; whether the run stops after it.
    fn step(&mut self, step: usize) -> anyhow::Result<bool> {
        if let Some(g) = &self.group {
            // Nothing more for a group that lost a rank: its error names the rank.
            g.check()?;
        }
        let batch =
            self.task.batch(&mut self.rng, self.plan.batch, (self.replica, self.place.replicas), self.reduction);
        // The group's watchdog, for a wait that a dead or stalled rank's collectives would block.
        let watched = self.group.as_ref().map(|g| move |e: &Event| g.wait_event(e));
        let watched = watched.as_ref().map(|w| w as &WaitFor<'_>);
        let Uploaded { tokens, targets, weights } = self.uploader.upload(&self.alloc, &self.s, &batch, watched)?;
        let issued = Instant::now();
        let losses = {
            // A profiler's timeline shows the step's replays and optimizer step inside this.
            let _range = self.s.device().range_with(|| format!("step {step}"));
            self.stepper.step(&self.model, &self.optimizer, &tokens, &targets, &weights)?
        };
        self.progress.host += issued.elapsed();
        let done = step + 1;
        self.progress.done = done;
        let saving = self.args.save_every.is_some_and(|n| done.is_multiple_of(n as usize));
        let reporting = step.is_multiple_of(25) || done == self.plan.stop;
        if reporting || saving {
            self.settle()?;
        }
        if reporting {
            self.report(step, losses.as_ref(), &batch.weights)?;
        }
        if saving {
            self.save()?;
        }
        if step == self.start && self.plan.stop - self.start > 1 {
            self.s.synchronize()?;
            let timed_steps = self.plan.stop - self.start - 1;
            (self.progress.host, self.progress.timed, self.progress.timed_steps) =
                (Duration::ZERO, Instant::now(), timed_steps);
        }
        self.bar.inc(1);
        Ok(self.stopping(reporting)? && done < self.plan.stop)
    }

    /// Waits for the steps issued so far (in a group, under its watchdog: a rank that died or
    /// hangs ends this one with a typed error), then fails at the first step whose gradients
    /// were not finite, before anything reports or saves what came of it.
    fn settle(&self) -> anyhow::Result<()> {
        if let Some(g) = &self.group {
            g.wait(&self.s)?;
        }
        health::gradients(&self.optimizer, &self.s, self.args.on_nonfinite)
    }

    /// Reports the loss of `step` from its per-position `losses` (on the rank that computes
    /// them: with `--pipeline`, the last stage's) and their `weights`: on the progress bar, in
    /// the metrics, as a line, and as a warning if the run diverges.
    fn report(&mut self, step: usize, losses: Option<&Tensor>, weights: &[f32]) -> anyhow::Result<()> {
        let mine = match losses {
            Some(losses) => {
                let l = losses.to_vec::<f32>(&self.s)?;
                l.iter().zip(weights).map(|(l, w)| f64::from(*l) * f64::from(*w)).sum()
            }
            // A stage without the head adds nothing (an exact zero) to the sum below.
            None => 0.0,
        };
        // Data parallel: the loss of the whole batch, every replica's part of it: the mean of the
        // replicas' own means, or the sum of their shares of the whole batch's (see
        // `Task::batch`). The world's gather (in rank order) brings the last stages' losses to
        // rank 0 in the grid: the one collective of a reporting step, no send of its own.
        let sum = group::sum_over_ranks(self.group.as_ref(), &self.alloc, &self.s, mine)?;
        let loss = match self.reduction {
            GradReduction::Mean => sum / self.place.replicas as f64,
            GradReduction::Sum => sum,
        };
        self.progress.last_loss = loss;
        health::loss(step, loss, self.args.on_nonfinite)?;
        self.bar.set_message(format!("loss {loss:.4}"));
        self.metrics.record(step, loss, self.progress.started.elapsed().as_secs_f64())?;
        let line = format!("step {step:5}  loss {loss:.4}");
        if self.bar.is_hidden() {
            say(self.lead, &line);
        } else {
            self.bar.println(line);
        }
        if let Some(warning) = self.progress.diverging.observe(step, loss) {
            self.bar.suspend(|| eprintln!("graphed: warning: {warning}"));
        }
        Ok(())
    }

    /// Saves the state after the steps done to `--save`, if given: the first replica of each
    /// stage saves the stage's for its replicas (rank 0 the whole model's without a pipeline).
    fn save(&self) -> anyhow::Result<()> {
        let Some(dir) = self.args.save.as_ref().filter(|_| self.replica == 0) else { return Ok(()) };
        let (model, at) = ((&self.model, &self.optimizer), (self.plan.saved(), self.place));
        checkpoint::save(dir, model, &self.s, self.args, at, self.progress.done)
    }

    /// Whether an interrupt asks the run to stop. A group stops together: every rank learns of
    /// any rank's interrupt at the same step (a reported one).
    fn stopping(&self, reporting: bool) -> anyhow::Result<bool> {
        Ok(match &self.group {
            Some(g) if reporting => group::any_rank(g, &self.alloc, &self.s, self.interrupt.requested())?,
            Some(_) => false,
            None => self.interrupt.requested(),
        })
    }

    /// Ends the run whose steps gave `trained`: what was reported is kept whatever happened (the
    /// metrics are on disk already, the plot is drawn from them), then the state after the steps
    /// done is saved; an interrupted run ends there with [`Interrupted`], a finished one is scored.
    pub fn finish(mut self, trained: anyhow::Result<()>) -> anyhow::Result<()> {
        if let (Err(e), true) = (&trained, self.group.is_some()) {
            return Err(self.abandon(e));
        }
        self.bar.finish_and_clear();
        let plotted = self.metrics.plot(self.args.plot.as_deref().filter(|_| self.lead), &self.title());
        trained?;
        plotted?;
        // Training is over: a peer that ends from here on, even by crashing, no longer concerns
        // this rank (its watch would otherwise end the process during the evaluation or the save).
        group::leave(self.group.take());
        let wall = self.progress.timed.elapsed();
        self.save()?;
        if let Some(dir) = self.args.save.as_ref().filter(|_| self.lead) {
            println!("saved the state after {} steps to {}", self.progress.done, dir.display());
        }
        if self.progress.done < self.plan.stop {
            let kept = match &self.args.save {
                Some(dir) => format!("saved; continue with --resume {}", dir.display()),
                None => "nothing saved (pass --save DIR to keep the state of an interrupted run)".to_string(),
            };
            return Err(Interrupted { steps: self.progress.done, kept }.into());
        }
        self.score(wall)
    }

    /// The error `e` of a rank whose group failed, with nothing of the run dropped on GPUs. A
    /// group of GPUs that failed cannot be torn down: its collectives may never end, and freeing
    /// the memory they use (or the graphs and communicators) waits for them. So the run is
    /// forgotten, not dropped: `main` ends the process with the error, and the driver reclaims
    /// the GPU as the process ends, as after PyTorch's NCCL watchdog. Simulated ranks are
    /// threads of a process that goes on, and the simulator's waits end by themselves (a rank
    /// gone, a deadlock, the timeout): there the run is dropped, which takes this rank out of
    /// the group, so that the others' waits on it fail at once naming it.
    fn abandon(self, e: &anyhow::Error) -> anyhow::Error {
        // A dead rank explains whatever failed after it died (work of the aborted communicator):
        // its error comes first, the failure it caused below it.
        let named = match e.downcast_ref() {
            Some(Error::Comm { kind: CommErrorKind::RankGone { .. }, .. }) => true,
            Some(Error::Comm { kind: CommErrorKind::Stalled(s), .. }) => {
                matches!(s.cause, CommErrorKind::RankGone { .. })
            }
            _ => false,
        };
        let err = match (named, self.group.as_ref().map(ProcessGroup::check)) {
            (false, Some(Err(gone))) => anyhow::anyhow!("{e:#}").context(gone),
            _ => anyhow::anyhow!("{e:#}"),
        };
        let rank = self.rank;
        match self.s.device().kind() {
            DeviceKind::Cuda => std::mem::forget(self),
            DeviceKind::Sim => drop(self),
        }
        err.context(format!("rank {rank}"))
    }

    /// The plot's title.
    fn title(&self) -> String {
        let (cfg, how) = (&self.plan.config, if self.args.eager { "eager" } else { "graphed" });
        format!("graphed train: {} layers, width {}, {} ({how})", cfg.layers, cfg.dim, cfg.dtype)
    }

    /// The summaries of a finished run on rank 0: the final loss, the skipped steps, the time
    /// per step over `wall`, the memory, and the task's score (after the steps' graphs are
    /// dropped, so that their memory is free for it).
    fn score(mut self, wall: Duration) -> anyhow::Result<()> {
        if !self.summary_shown {
            // Eager offloading freezes its policy after the first step.
            self.stepper.offload_summary().inspect(|s| say(self.lead, s));
        }
        let skipped = self.optimizer.skipped_steps(&self.s)?;
        drop(self.stepper);
        self.model.set_training(false);
        if !self.lead {
            return Ok(());
        }
        let Progress { timed_steps, host, last_loss, .. } = self.progress;
        let per_step = |d: Duration| d.as_secs_f64() * 1e6 / timed_steps.max(1) as f64;
        println!("final loss {last_loss:.4} ({}, cross-entropy)", self.task.loss_of());
        if skipped > 0 {
            println!("skipped {skipped} steps whose gradients were not finite (--on-nonfinite skip)");
        }
        let which = if timed_steps + 1 == self.plan.stop - self.start { " (after the first)" } else { "" };
        println!("time per step{which}: wall {:.0} µs, host issuing {:.0} µs", per_step(wall), per_step(host));
        println!("{}", memory::summary(&self.alloc.stats()));
        let stages = self.place.stage.count();
        if stages > 1 {
            // Decoding runs the whole model on one device, which no rank of a pipeline holds.
            println!("no held-out score: the model is split over {stages} pipeline stages");
            return Ok(());
        }
        self.task.report(&self.model, &self.alloc, &self.s)
    }
}

/// Prints `line` on rank 0: the other ranks train quietly and leave reports, checkpoints and
/// plots to it.
fn say(lead: bool, line: &str) {
    if lead {
        println!("{line}");
    }
}

/// Refuses, as rank 0 of a group of `world` ranks or a single process would, a run that cannot
/// run on `dev`, and a checkpoint to resume that is not there, of another grid or cut short: what
/// simulated ranks check once, before any rank is built (each rank checks again as it sets up,
/// as every process does).
pub fn check(dev: &Device, args: &TrainArgs, world: usize) -> anyhow::Result<()> {
    refusals(dev, args, true, world)?;
    let p = args.pipeline as usize;
    args.resume.as_ref().map_or(Ok(()), |dir| checkpoint::check_resumable(dir, p, world / p))
}

/// What can be refused before anything is built for a rank of `world` ranks: the flags, the
/// output files (rank 0's, `lead`), the task's data, the plan, the schedule's fit to the grid
/// and the memory it needs.
fn refusals(dev: &Device, args: &TrainArgs, lead: bool, world: usize) -> anyhow::Result<(Task, Plan)> {
    plan::check_flags(args, world)?;
    if lead {
        outputs::check(args)?;
    }
    let eval = args.eval.unwrap_or(if dev.kind() == DeviceKind::Cuda { 1000 } else { 100 });
    let task = Task::new(args, eval as usize)?;
    let plan = Plan::new(dev, args, task.shape())?;
    if args.schedule {
        // Every stage's schedule fits as the first one's does.
        args.schedule_args.resolve(plan.config.layers, Stage::new(0, args.pipeline as usize)?)?;
        let (batch, m) = (plan.batch, args.schedule_args.microbatches());
        if !batch.is_multiple_of(m) {
            refuse!("a batch of {batch} does not split into {m} microbatches; pass --batch or --microbatches to fit");
        }
    }
    // A stage holds its share of the layers (the embedding's and head's parameters counted on
    // every stage, the whole batch's activations as without a pipeline: a bound on its part).
    let held = GptConfig { layers: plan.config.layers / args.pipeline as usize, ..plan.config };
    memory::check(dev, &held, plan.batch, args)?;
    Ok((task, plan))
}

/// Says where the run is: its rank in the `group` (every rank; with `--pipeline`, its `place`
/// in the grid), then on rank 0 the device and where a resumed run starts.
fn announce_device(
    dev: &Device,
    args: &TrainArgs,
    group: Option<&ProcessGroup>,
    lead: bool,
    start: usize,
    place: checkpoint::Place,
) {
    if let Some(g) = group {
        let (env, kind) = (g.env(), g.comm().device().kind());
        let stage = place.stage;
        let grid = match stage.count() {
            1 => String::new(),
            p => format!(
                ", stage {} of {p} of replica {} of {}",
                stage.index(),
                env.rank % place.replicas,
                place.replicas
            ),
        };
        match kind {
            DeviceKind::Cuda => {
                println!("rank {} of {} (GPU {} of this host{grid})", env.rank, env.world, env.local_rank)
            }
            DeviceKind::Sim => println!(
                "rank {} of {} (simulated device {}, a thread of this process{grid})",
                env.rank, env.world, env.local_rank
            ),
        }
    }
    say(lead, &format!("device: {}{}", dev.name(), nvtx(dev)));
    if let Some(dir) = &args.resume {
        say(lead, &format!("resumed from {} after {start} steps", dir.display()));
    }
}

/// Whether `nsys profile` will see the step's ranges (docs/profiling.md), for the device line.
fn nvtx(dev: &Device) -> &'static str {
    match (dev.kind(), dev.nvtx()) {
        (DeviceKind::Cuda, true) => "; NVTX ranges on",
        (DeviceKind::Cuda, false) => "; NVTX ranges off (libnvToolsExt.so not found; on CUDA 13 link libnvtx3interop.so.1 under that name, see docs/profiling.md)",
        (DeviceKind::Sim, _) => "",
    }
}

/// Says what runs: the model and its step (rank 0's stage's, with a pipeline), the group's
/// losses and gradients (combined over the replicas of the grid at `place` as `reduction` says),
/// the offload policy once frozen, the data; whether the offload policy's table was shown.
fn announce_model(
    lead: bool,
    plan: &Plan,
    stepper: &Stepper,
    group: Option<&ProcessGroup>,
    task: &Task,
    (reduction, place): (GradReduction, checkpoint::Place),
) -> bool {
    let cfg = &plan.config;
    say(
        lead,
        &format!(
            "model: {} layers, width {}, {} heads ({} attention), {} parameters in {}; batch {}, {} steps, {}",
            cfg.layers,
            cfg.dim,
            cfg.heads,
            cfg.attention,
            cfg.parameter_count(),
            plan.precision,
            plan.batch,
            plan.steps,
            stepper.describe()
        ),
    );
    if let Some(g) = group {
        let (world, batch, stages, replicas) = (g.env().world, plan.batch, place.stage.count(), place.replicas);
        if stages > 1 {
            say(
                lead,
                &format!(
                    "grid: {world} ranks as {stages} pipeline stages × {replicas} data-parallel replicas; the last \
                     stage computes each replica's loss"
                ),
            );
        }
        let how = match reduction {
            GradReduction::Mean => "gradients averaged over the ranks, each rank's loss its own batch's mean",
            GradReduction::Sum => "gradients summed over the ranks, each rank's loss weighed by the whole batch",
        };
        let ranks = if stages > 1 { "replicas" } else { "ranks" };
        say(lead, &format!("losses: the whole batch's ({replicas} {ranks} × {batch}, each its part of it); {how}"));
    }
    let summary_shown = stepper.offload_summary().inspect(|s| say(lead, s)).is_some();
    if let Some(data) = task.describe() {
        say(lead, &data);
    }
    summary_shown
}

/// Rank 0's progress bar over the run's steps, at `start`; hidden on the other ranks.
fn progress_bar(lead: bool, steps: usize, start: usize) -> ProgressBar {
    let bar = if lead { ProgressBar::new(steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(start as u64);
    bar
}
