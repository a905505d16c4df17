//! Pipeline parallelism: each stage holds its chunks of the model, and activations and
//! gradients cross between stages in grouped sends and receives, eagerly and from captured
//! graphs, bit for bit against the whole model on one device; on simulated ranks, and on two
//! GPUs through NCCL.

use std::collections::BTreeMap;

use anyhow::{ensure, Context};
use graphed::device::{CommErrorKind, CommOptions, Communicator, DType, Device, Policy, SimConfig, Stream};
use graphed::dist::{on_sim_ranks, DataParallel, GradReduction, Grid, P2pLinks};

use crate::common::Ranks;
use graphed::graph::{make_graphed_schedule, Callable, GraphOptions, GraphedSchedule};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    run_pipeline_stage, run_schedule, Builder, EagerPasses, Handed, Inputs, KeepOnDevice, Layers, Module, ParamStore,
    Schedule, SchedulePasses, Stage, StageLinks, TransformerLayer,
};
use graphed::tensor::Tensor;
use graphed::Error;

const SHAPE: [usize; 3] = [2, 8, 32];
const STEPS: u64 = 2;

/// Layers `global` of the model (width 32, dropout 0.1: the masks must follow the microbatch,
/// not the order a schedule runs them in).
struct Part {
    alloc: CachingAllocator,
    s: Stream,
    store: ParamStore,
    step: Tensor,
    global: Vec<usize>,
    layers: Vec<TransformerLayer>,
}

fn part(dev: &Device, global: Vec<usize>) -> graphed::Result<Part> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::new(&alloc, &s, global.len() * TransformerLayer::parameter_count(SHAPE[2]))?;
    let vb = Builder::new(&store, &alloc, &s)?.with_dropout(0.1, 5);
    let layers = TransformerLayer::stack(&vb, (SHAPE[2], 1), &Layers::of(global.iter().copied()))?;
    let step = vb.step().clone();
    Ok(Part { alloc, s, store, step, global, layers })
}

/// Microbatch `j` of step `step`: its input and the upstream gradient its loss gives.
fn microbatch(p: &Part, step: u64, j: usize) -> graphed::Result<(Tensor, Tensor)> {
    let at = |salt: u64| -> Vec<f32> {
        let n = SHAPE.iter().product::<usize>() as u64;
        (0..n).map(|i| ((i * 37 + step * 101 + j as u64 * 11 + salt) % 29) as f32 / 29.0 - 0.5).collect()
    };
    Ok((Tensor::from_host(&p.alloc, &p.s, &at(0), &SHAPE)?, Tensor::from_host(&p.alloc, &p.s, &at(500), &SHAPE)?))
}

/// What a run shows: each model layer's gradients at each step (by layer, then step), and per
/// step each microbatch's output (from the stage that holds the model's end) and input gradient
/// (from the stage that holds its start).
#[derive(Debug, Default, PartialEq)]
struct Trace {
    grads: BTreeMap<(usize, u64), Vec<f32>>,
    outputs: Vec<Vec<Vec<f32>>>,
    input_grads: Vec<Vec<Vec<f32>>>,
}

impl Trace {
    fn merge(&mut self, other: Trace) {
        self.grads.extend(other.grads);
        for (mine, theirs) in [(&mut self.outputs, other.outputs), (&mut self.input_grads, other.input_grads)] {
            if !theirs.is_empty() {
                *mine = theirs;
            }
        }
    }
}

/// The model's `chunks` × `per_chunk` layers on one device, stepped eagerly by 1F1B on one stage,
/// on data-parallel replica `replica`'s microbatches.
fn one_device(
    dev: &Device,
    chunks: usize,
    per_chunk: usize,
    microbatches: usize,
    replica: usize,
) -> anyhow::Result<Trace> {
    let p = part(dev, (0..chunks * per_chunk).collect())?;
    let schedule = Schedule::interleaved_1f1b(1, 0, 1, microbatches)?;
    let mut trace = Trace::default();
    for step in 0..STEPS {
        let data = (0..microbatches)
            .map(|j| microbatch(&p, step, replica * microbatches + j))
            .collect::<graphed::Result<Vec<_>>>()?;
        let inputs: Vec<Tensor> = data.iter().map(|(x, _)| x.clone()).collect();
        let mut outputs = vec![Vec::new(); microbatches];
        let mut head = |j: usize, y: Tensor| {
            outputs[j] = y.to_f32_vec(&p.s)?;
            Ok(data[j].1.clone())
        };
        let mut passes = EagerPasses::new(&p.layers, &KeepOnDevice, &p.s);
        let dx = run_schedule(&mut passes, &schedule, &[p.layers.len()], &inputs, Some(&p.step), &mut head)?;
        trace.outputs.push(outputs);
        trace.input_grads.push(dx.iter().map(|d| d.to_f32_vec(&p.s)).collect::<graphed::Result<_>>()?);
        take_grads(&p, step, &mut trace)?;
    }
    Ok(trace)
}

/// Puts each layer's gradients of step `step` into `trace`, and zeroes them for the next step
/// (as an optimizer step would).
fn take_grads(p: &Part, step: u64, trace: &mut Trace) -> graphed::Result<()> {
    for (&g, l) in p.global.iter().zip(&p.layers) {
        trace.grads.insert((g, step), p.store.grads_of(&l.parameters())?.to_f32_vec(&p.s)?);
    }
    p.store.grads()?.zero(&p.s)
}

/// A pipeline's shape: stages (ranks), chunks per stage, layers per chunk, microbatches; and
/// whether its schedule is zero-bubble (one chunk, the layers' weight gradients split out and
/// run one backward later), else interleaved 1F1B.
#[derive(Debug, Clone, Copy)]
struct Pipeline {
    stages: usize,
    chunks: usize,
    per_chunk: usize,
    microbatches: usize,
    zero_bubble: bool,
}

/// How a stage runs: its passes eagerly or graphed, its exchanges on its stream or overlapped
/// (`P2pLinks::overlapped`).
#[derive(Debug, Clone, Copy)]
struct How {
    graphed: bool,
    overlap: bool,
}

/// Every way a stage runs.
const HOWS: [How; 4] = [
    How { graphed: false, overlap: false },
    How { graphed: true, overlap: false },
    How { graphed: false, overlap: true },
    How { graphed: true, overlap: true },
];

/// Stage `comm.rank()` of `pipe` under its schedule, as `how` says; with `dp`, as
/// replica `dp.rank()` of its stage, on that replica's microbatches, its gradients summed over
/// `dp` at every step: inside the backward graphs when graphed, else after the step.
fn stage(comm: &Communicator, dp: Option<&Communicator>, pipe: Pipeline, how: How) -> graphed::Result<Trace> {
    let Pipeline { stages, chunks, per_chunk, microbatches, zero_bubble } = pipe;
    let graphed = how.graphed;
    let stage = Stage::new(comm.rank(), stages)?;
    let mut p = part(comm.device(), stage.model_layers(chunks, per_chunk))?;
    let schedule = match zero_bubble {
        true => Schedule::zero_bubble(stages, stage.index(), microbatches)?,
        false => Schedule::interleaved_1f1b(stages, stage.index(), chunks, microbatches)?,
    };
    for l in p.layers.iter_mut().filter(|_| zero_bubble) {
        for linear in [&mut l.attn.qkv, &mut l.attn.proj, &mut l.mlp.fc1, &mut l.mlp.fc2] {
            linear.set_split_dw(true);
        }
    }
    let layers_per_chunk = vec![per_chunk; chunks];
    let layers: Vec<&dyn Callable> = p.layers.iter().map(|l| l as &dyn Callable).collect();
    let callables: Option<GraphedSchedule> = match graphed {
        false => None,
        true => {
            let (x0, _) = microbatch(&p, 0, 0)?;
            let samples: Vec<Inputs> = (0..p.layers.len() * microbatches).map(|_| Inputs::one(&x0)).collect();
            let mut options = GraphOptions::default().reuse_buffers(true);
            if let Some(dp) = dp {
                // Summed, as the eager path's all-reduce sums (the default mean is tested in main.rs).
                let reduce = DataParallel::for_callables(dp, &p.store, &layers)?.with_reduction(GradReduction::Sum)?;
                options = options.grad_sync(reduce);
            }
            Some(make_graphed_schedule(&p.alloc, &layers, &schedule, &samples, options)?)
        }
    };
    let links = match graphed {
        false => P2pLinks::eager(comm, &p.alloc, &p.s, &SHAPE, DType::F32),
        true => P2pLinks::graphed(comm, &p.alloc, &p.s, &SHAPE, DType::F32),
    };
    let mut links = if how.overlap { links.overlapped()? } else { links };
    let mut trace = Trace::default();
    let first = dp.map_or(0, |d| d.rank() * microbatches);
    for step in 0..STEPS {
        let data = (0..microbatches).map(|j| microbatch(&p, step, first + j)).collect::<graphed::Result<Vec<_>>>()?;
        let inputs: Vec<Tensor> = match stage.index() {
            0 => data.iter().map(|(x, _)| x.clone()).collect(),
            _ => Vec::new(),
        };
        let mut outputs = vec![Vec::new(); microbatches];
        let dys: Vec<Tensor> = data.iter().map(|(_, dy)| dy.clone()).collect();
        let run = (&layers_per_chunk[..], &inputs[..]);
        let (s, counter) = (&p.s, Some(&p.step));
        let dx = match &callables {
            None => {
                let mut passes = EagerPasses::new(&p.layers, &KeepOnDevice, &p.s);
                stage_step(&mut passes, (&schedule, run, counter), (&dys, &mut outputs), (stage, &mut links), s)?
            }
            Some(g) => {
                let mut passes = g.passes(&p.s);
                stage_step(&mut passes, (&schedule, run, counter), (&dys, &mut outputs), (stage, &mut links), s)?
            }
        };
        if stage.index() == stages - 1 {
            trace.outputs.push(outputs);
        }
        if stage.index() == 0 {
            trace.input_grads.push(dx);
        }
        if let Some(dp) = dp.filter(|_| !graphed) {
            dp.all_reduce(&p.s, p.store.grads()?.view::<f32>()?)?;
        }
        take_grads(&p, step, &mut trace)?;
    }
    Ok(trace)
}

/// The schedule's (`run`'s inputs, dropout `counter`) step of `passes` as `stage` over `links`,
/// each microbatch's upstream gradient from `dys` and its output read into `outputs`; returns
/// the input gradients read.
fn stage_step<P: SchedulePasses>(
    passes: &mut P,
    (schedule, run, counter): (&Schedule, (&[usize], &[Tensor]), Option<&Tensor>),
    (dys, outputs): (&[Tensor], &mut [Vec<f32>]),
    (stage, links): (Stage, &mut P2pLinks),
    s: &graphed::device::Stream,
) -> graphed::Result<Vec<Vec<f32>>> {
    let mut head = |j: usize, y: P::Out| {
        outputs[j] = y.tensor()?.to_f32_vec(s)?;
        Ok(dys[j].clone())
    };
    let dx = run_pipeline_stage(passes, schedule, run, counter, &mut head, stage, links)?;
    dx.iter().map(|d| d.tensor()?.to_f32_vec(s)).collect()
}

/// Every stage of `pipe` on ranks `on`; their traces merged, after checking that no rank's
/// checker saw a race.
fn pipeline(pipe: Pipeline, how: How, on: Ranks) -> anyhow::Result<Trace> {
    let ranks = on.run(pipe.stages, CommOptions::default(), |c| {
        let trace = stage(c, None, pipe, how);
        Ok((trace, graphed::check::Checker::of(c.device()).expect("checked").take_hazards()))
    })?;
    let mut merged = Trace::default();
    for (r, res) in ranks.into_iter().enumerate() {
        let (trace, hazards) = res?;
        let trace = trace.with_context(|| format!("stage {r} of {pipe:?}, {how:?}, {on:?}"))?;
        ensure!(hazards.is_empty(), "{pipe:?} {on:?}: stage {r}'s checker reported {hazards:#?}");
        merged.merge(trace);
    }
    Ok(merged)
}

/// `pipe` on ranks `on`, every way a stage runs, against the whole model on `one`.
fn pipeline_equals_one_device(pipe: Pipeline, on: Ranks, one: &Device) -> anyhow::Result<()> {
    let want = one_device(one, pipe.stages * pipe.chunks, pipe.per_chunk, pipe.microbatches, 0)?;
    for how in HOWS {
        let got = pipeline(pipe, how, on)?;
        ensure!(got.grads.keys().eq(want.grads.keys()), "{pipe:?}: layers {:?}", got.grads.keys());
        for ((layer, step), g) in &got.grads {
            ensure!(
                *g == want.grads[&(*layer, *step)],
                "{pipe:?}, {how:?}, {on:?}: layer {layer}'s gradients at step {step}"
            );
        }
        ensure!(got.outputs == want.outputs, "{pipe:?}, {how:?}, {on:?}: outputs");
        ensure!(got.input_grads == want.input_grads, "{pipe:?}, {how:?}, {on:?}: input gradients");
    }
    Ok(())
}

#[test]
fn pipelines_under_1f1b_interleaving_and_zero_bubble_equal_one_device_bit_for_bit_eager_and_graphed(
) -> anyhow::Result<()> {
    for (pipe, policies) in [
        (Pipeline { stages: 2, chunks: 1, per_chunk: 2, microbatches: 4, zero_bubble: false }, &Policy::ALL[..]),
        (Pipeline { stages: 2, chunks: 2, per_chunk: 1, microbatches: 4, zero_bubble: false }, &Policy::ALL[..]),
        (Pipeline { stages: 3, chunks: 1, per_chunk: 1, microbatches: 5, zero_bubble: false }, &[Policy::Random][..]),
        (
            Pipeline { stages: 3, chunks: 2, per_chunk: 1, microbatches: 6, zero_bubble: false },
            &[Policy::Adversarial][..],
        ),
        (Pipeline { stages: 4, chunks: 1, per_chunk: 1, microbatches: 4, zero_bubble: false }, &[Policy::InOrder][..]),
        (Pipeline { stages: 4, chunks: 2, per_chunk: 1, microbatches: 8, zero_bubble: false }, &[Policy::Random][..]),
        (Pipeline { stages: 2, chunks: 3, per_chunk: 1, microbatches: 2, zero_bubble: false }, &[Policy::Random][..]),
        // As many microbatches as stages: ranks 0 and 1 run every forward before a backward.
        (Pipeline { stages: 3, chunks: 2, per_chunk: 1, microbatches: 3, zero_bubble: false }, &[Policy::InOrder][..]),
        (
            Pipeline { stages: 2, chunks: 1, per_chunk: 2, microbatches: 4, zero_bubble: true },
            &[Policy::Adversarial][..],
        ),
    ] {
        for &policy in policies {
            pipeline_equals_one_device(pipe, Ranks::Sim(policy), &Device::sim())?;
        }
    }
    Ok(())
}

#[test]
fn pipelines_of_data_parallel_replicas_equal_each_replica_on_one_device_summed() -> anyhow::Result<()> {
    grid_equals_replicas_summed(
        Pipeline { stages: 2, chunks: 2, per_chunk: 1, microbatches: 4, zero_bubble: false },
        2,
        Ranks::Sim(Policy::Random),
        &Device::sim(),
    )?;
    // Zero-bubble: a layer's gradients are complete after its last weight-gradient pass.
    grid_equals_replicas_summed(
        Pipeline { stages: 2, chunks: 1, per_chunk: 2, microbatches: 4, zero_bubble: true },
        2,
        Ranks::Sim(Policy::Adversarial),
        &Device::sim(),
    )?;
    // One stage: data parallelism under a schedule alone.
    grid_equals_replicas_summed(
        Pipeline { stages: 1, chunks: 1, per_chunk: 2, microbatches: 4, zero_bubble: false },
        2,
        Ranks::Sim(Policy::Adversarial),
        &Device::sim(),
    )
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL"]
fn two_gpus_as_replicas_under_a_schedule_equal_each_replica_on_one_gpu_summed() -> anyhow::Result<()> {
    for zero_bubble in [false, true] {
        let pipe = Pipeline { stages: 1, chunks: 1, per_chunk: 2, microbatches: 4, zero_bubble };
        grid_equals_replicas_summed(pipe, 2, Ranks::Gpus, &Device::cuda_checked(0)?)?;
    }
    Ok(())
}

/// Megatron-LM's grid of `pipe.stages` × `replicas` ranks `on`, rank = stage·replicas + replica:
/// each stage's replicas reduce its gradients (inside the schedule's backward graphs when
/// graphed), each replica's stages pipeline its microbatches. Per replica, the outputs and input
/// gradients of that replica alone on `one`; per layer and step, the replicas' gradients summed,
/// bit for bit; every checker quiet.
fn grid_equals_replicas_summed(pipe: Pipeline, replicas: usize, on: Ranks, one: &Device) -> anyhow::Result<()> {
    let layers = pipe.stages * pipe.chunks;
    let each: Vec<Trace> = (0..replicas)
        .map(|r| one_device(one, layers, pipe.per_chunk, pipe.microbatches, r))
        .collect::<anyhow::Result<_>>()?;
    for how in HOWS {
        let ranks = on.run(pipe.stages * replicas, CommOptions::default(), |world| {
            let grid = Grid::split(world, pipe.stages, &|color, key| world.split(color, key))?;
            let replica = grid.replica();
            let trace = stage(grid.pipeline(), Some(grid.data_parallel()), pipe, how)?;
            let hazards = graphed::check::Checker::of(world.device()).expect("checked").take_hazards();
            Ok((replica, trace, hazards))
        })?;
        let mut grads = BTreeMap::new();
        for (r, res) in ranks.into_iter().enumerate() {
            let (replica, trace, hazards) = res.with_context(|| format!("rank {r} of {pipe:?}, {how:?}"))?;
            ensure!(hazards.is_empty(), "{pipe:?}, {how:?}: rank {r}'s checker reported {hazards:#?}");
            let want = &each[replica];
            ensure!(trace.outputs.is_empty() || trace.outputs == want.outputs, "rank {r}: outputs");
            ensure!(trace.input_grads.is_empty() || trace.input_grads == want.input_grads, "rank {r}: input grads");
            for (at, g) in trace.grads {
                let other = grads.insert(at, g.clone());
                ensure!(other.is_none_or(|o| o == g), "{pipe:?}, {how:?}: the replicas differ at {at:?}");
            }
        }
        ensure!(grads.keys().eq(each[0].grads.keys()), "{how:?}: (layer, step) {:?}", grads.keys());
        for (at, got) in &grads {
            let sum = (0..replicas)
                .map(|r| &each[r].grads[at])
                .fold(vec![0.0f32; got.len()], |acc, g| acc.iter().zip(g).map(|(a, b)| a + b).collect());
            ensure!(*got == sum, "{pipe:?}, {how:?}: gradients at {at:?} are not the replicas' sum");
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL"]
fn two_gpus_under_1f1b_and_interleaving_equal_one_gpu_bit_for_bit_eager_and_graphed() -> anyhow::Result<()> {
    for pipe in [
        Pipeline { stages: 2, chunks: 1, per_chunk: 2, microbatches: 4, zero_bubble: false },
        Pipeline { stages: 2, chunks: 2, per_chunk: 1, microbatches: 4, zero_bubble: false },
        Pipeline { stages: 2, chunks: 3, per_chunk: 1, microbatches: 6, zero_bubble: false },
    ] {
        pipeline_equals_one_device(pipe, Ranks::Gpus, &Device::cuda_checked(0)?)?;
    }
    Ok(())
}

#[test]
fn a_stage_left_waiting_by_one_that_disagrees_on_the_schedule_fails_instead_of_hanging() -> anyhow::Result<()> {
    let pipe = Pipeline { stages: 2, chunks: 1, per_chunk: 1, microbatches: 3, zero_bubble: false };
    let out = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |c| {
        // Stage 1 believes in one microbatch more than stage 0 sends; stage 0 ends its step.
        stage(c, None, Pipeline { microbatches: pipe.microbatches + c.rank(), ..pipe }, HOWS[0])
    });
    ensure!(out[0].is_ok(), "stage 0: {:?}", out[0].as_ref().err());
    let Err(Error::Comm { rank: 1, kind, .. }) = &out[1] else { anyhow::bail!("stage 1: {:?}", out[1].as_ref().err()) };
    ensure!(matches!(kind, CommErrorKind::RankGone { rank: 0 }), "stage 1: {kind}");
    Ok(())
}

/// Eager passes whose backward of `fails` (layer, microbatch) fails once, before it runs.
struct FailOnce<'a> {
    inner: EagerPasses<'a, TransformerLayer>,
    fails: Option<(usize, usize)>,
}

impl SchedulePasses for FailOnce<'_> {
    type Out = Tensor;

    fn advance_rng(&mut self, step: &Tensor, by: u64) -> graphed::Result<()> {
        self.inner.advance_rng(step, by)
    }
    fn forward(&mut self, layer: usize, microbatch: usize, x: &Tensor) -> graphed::Result<Tensor> {
        self.inner.forward(layer, microbatch, x)
    }
    fn backward(&mut self, layer: usize, microbatch: usize, dy: &Tensor) -> graphed::Result<Tensor> {
        if self.fails.take_if(|f| *f == (layer, microbatch)).is_some() {
            return Err(Error::MissingGradient { op: "FailOnce", what: "a failure the test asked for".into() });
        }
        self.inner.backward(layer, microbatch, dy)
    }
    fn weight_grad(&mut self, layer: usize, microbatch: usize) -> graphed::Result<()> {
        self.inner.weight_grad(layer, microbatch)
    }
    fn splits_weight_grads(&self, layer: usize) -> graphed::Result<bool> {
        self.inner.splits_weight_grads(layer)
    }
}

/// A step that fails on stage 0 after it waited for a received gradient (its last backward,
/// which no peer waits on) leaves its overlapped links joined: the next step waits for its own
/// exchanges again, so its passes read what they receive only after it arrived.
#[test]
fn a_failed_step_leaves_overlapped_links_joined_for_the_next() -> anyhow::Result<()> {
    let microbatches = 2;
    let out = on_sim_ranks(
        2,
        SimConfig { policy: Policy::Adversarial, ..SimConfig::default() },
        CommOptions::default(),
        |c| {
            let stage = Stage::new(c.rank(), 2)?;
            let p = part(c.device(), stage.model_layers(1, 1))?;
            let schedule = Schedule::interleaved_1f1b(2, stage.index(), 1, microbatches)?;
            let mut links = P2pLinks::eager(c, &p.alloc, &p.s, &SHAPE, DType::F32).overlapped()?;
            let mut steps = Vec::new();
            for step in 0..2 {
                let data = (0..microbatches).map(|j| microbatch(&p, step, j)).collect::<graphed::Result<Vec<_>>>()?;
                let inputs: Vec<Tensor> = match stage.index() {
                    0 => data.iter().map(|(x, _)| x.clone()).collect(),
                    _ => Vec::new(),
                };
                let mut head = |j: usize, _: Tensor| Ok(data[j].1.clone());
                let fails = (step == 0 && stage.index() == 0).then_some((0, microbatches - 1));
                let mut passes = FailOnce { inner: EagerPasses::new(&p.layers, &KeepOnDevice, &p.s), fails };
                let run = (&[1][..], &inputs[..]);
                steps.push(
                    run_pipeline_stage(&mut passes, &schedule, run, Some(&p.step), &mut head, stage, &mut links)
                        .map(|_| ()),
                );
            }
            p.s.synchronize()?;
            let hazards = graphed::check::Checker::of(c.device()).expect("checked").take_hazards();
            Ok((steps, hazards))
        },
    );
    for (r, res) in out.into_iter().enumerate() {
        let (steps, hazards) = res.with_context(|| format!("rank {r}"))?;
        ensure!(steps[0].is_err() == (r == 0), "rank {r}'s first step: {:?}", steps[0]);
        ensure!(steps[1].is_ok(), "rank {r}'s second step: {:?}", steps[1]);
        ensure!(hazards.is_empty(), "rank {r}'s checker reported {hazards:#?}");
    }
    Ok(())
}

#[test]
fn graphed_links_refuse_a_step_that_sends_other_buffers_than_they_captured() -> anyhow::Result<()> {
    for overlap in [false, true] {
        let out = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |c| {
            let (alloc, s) = (CachingAllocator::new(c.device()), c.device().stream()?);
            let links = P2pLinks::graphed(c, &alloc, &s, &[4], DType::F32);
            let mut links = if overlap { links.overlapped()? } else { links };
            let (a, b) = (Tensor::zeros(&alloc, &s, &[4], DType::F32)?, Tensor::zeros(&alloc, &s, &[4], DType::F32)?);
            let send = |links: &mut P2pLinks, t: &Tensor| match c.rank() {
                0 => links.exchange(0, &[(1, t.clone())], &[]),
                _ => links.exchange(0, &[], &[0]),
            };
            send(&mut links, &a)?;
            let again = send(&mut links, &a)?;
            let other = (c.rank() == 0).then(|| send(&mut links, &b).err()).flatten();
            let wrong_shape = links.exchange(1, &[(1 - c.rank(), Tensor::zeros(&alloc, &s, &[5], DType::F32)?)], &[]);
            // Peers outside the group, or this rank, sending or receiving.
            let bad_peers = [links.exchange(1, &[(2, a.clone())], &[]), links.exchange(1, &[], &[c.rank()])]
                .map(|r| matches!(r, Err(graphed::Error::Comm { kind: CommErrorKind::BadPeer { .. }, .. })));
            links.join()?;
            // After the join, exchange 0 is the last step's: waiting for it would read an old event.
            let stale = links.wait(0).err().map(|e| e.to_string());
            s.synchronize()?;
            Ok((again.len(), other.map(|e| e.to_string()), wrong_shape.err().map(|e| e.to_string()), stale, bad_peers))
        });
        for (r, res) in out.into_iter().enumerate() {
            let (received, other, wrong_shape, stale, bad_peers) =
                res.with_context(|| format!("rank {r}, overlap {overlap}"))?;
            ensure!(bad_peers == [true, true], "rank {r}: bad peers refused as BadPeer: {bad_peers:?}");
            ensure!(
                stale.as_deref().is_some_and(|e| e.contains("has not run")) == overlap,
                "rank {r}, overlap {overlap}: {stale:?}"
            );
            ensure!(received == r, "rank {r} received {received} tensors");
            ensure!(r == 1 || other.as_deref().is_some_and(|e| e.contains("other buffers")), "rank {r}: {other:?}");
            ensure!(wrong_shape.as_deref().is_some_and(|e| e.contains("boundary")), "rank {r}: {wrong_shape:?}");
        }
    }
    Ok(())
}

#[test]
fn every_exchange_of_a_step_is_a_profiler_range_naming_its_peers() -> anyhow::Result<()> {
    let pipe = Pipeline { stages: 2, chunks: 2, per_chunk: 1, microbatches: 4, zero_bubble: false };
    let out = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |c| {
        c.device().record_ranges(true);
        stage(c, None, pipe, HOWS[3])?;
        Ok(c.device().take_ranges())
    });
    for (r, log) in out.into_iter().enumerate() {
        let spans = log.with_context(|| format!("rank {r}"))?.spans()?;
        let exchanges: Vec<(String, usize)> = spans
            .into_iter()
            .filter(|s| s.name.as_str().starts_with("exchange"))
            .map(|s| (s.name.to_string(), s.depth))
            .collect();
        // Each of the two steps numbers its exchanges from 0, between the passes' ranges.
        let per_step = exchanges.len() / STEPS as usize;
        ensure!(per_step > 0 && exchanges.len() == STEPS as usize * per_step, "rank {r}: {exchanges:?}");
        for (n, (name, depth)) in exchanges.iter().enumerate() {
            let (head, peers) = name.split_once(": ").with_context(|| format!("rank {r}: {name}"))?;
            ensure!(head == format!("exchange {}", n % per_step), "rank {r}: {name} is exchange {n} of its step");
            ensure!(peers.starts_with("send to [") && peers.contains("], receive from ["), "rank {r}: {name}");
            let digits = peers.chars().filter(char::is_ascii_digit);
            ensure!(digits.clone().count() > 0, "rank {r}: {name} names no peer");
            ensure!(digits.into_iter().all(|d| d == char::from(b'0' + (1 - r) as u8)), "rank {r}: {name}'s peers");
            ensure!(*depth == 0, "rank {r}: {name} nests in another range");
        }
    }
    Ok(())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 6, ..Default::default() })]

    /// Random pipelines (2 to 4 stages; 1F1B, interleaved over 1 to 3 chunks, or zero-bubble;
    /// as many microbatches as stages or more, and fewer without interleaving), every way a stage
    /// runs, overlapped links included, equal the whole model on one device bit for bit, meet
    /// without deadlock, and leave every checker quiet.
    #[test]
    fn random_pipelines_equal_one_device_every_way_a_stage_runs(
        stages in 2usize..5,
        chunks in 1usize..4,
        rounds in 1usize..3,
        extra in 0usize..4,
        zero_bubble in proptest::bool::ANY,
    ) {
        let chunks = if zero_bubble { 1 } else { chunks };
        // Interleaving needs a multiple of the stages; 1F1B takes any count, fewer than the
        // stages included.
        let microbatches = if chunks > 1 { stages * rounds } else { (stages * rounds + extra).saturating_sub(2).max(1) };
        let pipe = Pipeline { stages, chunks, per_chunk: 1, microbatches, zero_bubble };
        let outcome = pipeline_equals_one_device(pipe, Ranks::Sim(Policy::Random), &Device::sim());
        proptest::prop_assert!(outcome.is_ok(), "{:?}", outcome.err());
    }
}
