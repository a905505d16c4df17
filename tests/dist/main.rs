//! Several ranks: the rendezvous, and data parallelism inside the captured backward graphs or on
//! graphs of its own after typed edges, averaged or summed, bit for bit against one rank that
//! accumulates every microbatch, on simulated ranks and (the `two_gpus` tests) on two GPUs
//! through NCCL.

use std::time::Duration;

use anyhow::{ensure, Context};
use graphed::device::{
    AccessMode, CommErrorKind, CommOptions, Communicator, Device, Policy, SimConfig, Stalled, StalledLaunch, Stream,
};
use graphed::dist::{meet, on_sim_ranks, DataParallel, GradReduction, RankEnv, RankWatch, ReductionGraphs};
use graphed::graph::{make_graphed_callables, make_graphed_stack, Callable, GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    Builder, GradHook, Inputs, Layers, Module, Param, ParamStore, SaveHook, Stack, TransformerCtx, TransformerLayer,
};
use graphed::ops::elementwise::scale;
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;
use graphed::Error;

#[path = "../common/mod.rs"]
mod common;
mod fp8;
mod pipeline;

use common::Ranks;

struct Model {
    alloc: CachingAllocator,
    s: Stream,
    store: ParamStore,
    stack: Stack<TransformerLayer>,
    opt: AdamW,
}

/// Three layers of width 32 (f32, no dropout: the masks would differ by microbatch); with
/// `split_dw`, their weight gradients split out into passes of their own.
fn model(dev: &Device, split_dw: bool) -> graphed::Result<Model> {
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(dev));
    let store = ParamStore::new(&alloc, &s, 3 * TransformerLayer::parameter_count(32))?;
    let vb = Builder::new(&store, &alloc, &s)?;
    let mut layers = TransformerLayer::stack(&vb, (32, 1), &Layers::first(3))?;
    for layer in &mut layers {
        for linear in [&mut layer.attn.qkv, &mut layer.attn.proj, &mut layer.mlp.fc1, &mut layer.mlp.fc2] {
            linear.set_split_dw(split_dw);
        }
    }
    let (stack, opt) = (
        Stack::new(layers).with_rng_step(vb.step()),
        AdamW::new(&alloc, &store, AdamWHyper::default(), LrSchedule::Constant(1e-3), &s)?,
    );
    Ok(Model { alloc, s, store, stack, opt })
}

/// Microbatch `k` of step `step`: the input, and the output gradient a loss would give.
fn data(m: &Model, step: u64, k: u64) -> graphed::Result<(Tensor, Tensor)> {
    let at = |salt: u64| -> Vec<f32> {
        (0..2 * 8 * 32).map(|i| ((i as u64 * 31 + step * 131 + k * 7 + salt) % 23) as f32 / 23.0 - 0.5).collect()
    };
    Ok((
        Tensor::from_host(&m.alloc, &m.s, &at(0), &[2, 8, 32])?,
        Tensor::from_host(&m.alloc, &m.s, &at(1000), &[2, 8, 32])?,
    ))
}

const STEPS: u64 = 3;

/// Per step, the gradients before the optimizer and the parameters after it.
type Trace = Vec<(Vec<f32>, Vec<f32>)>;

/// What one rank that sees every rank's microbatch takes as its step's gradients.
#[derive(Debug, Clone, Copy)]
enum Whole {
    /// The microbatches' gradients accumulated: what the ranks' sum holds.
    Sum,
    /// The gradients of the whole batch's mean loss: each microbatch's output gradient divided
    /// by the `ranks` (a power of two: exact), accumulated. What the ranks' mean holds.
    MeanLoss,
    /// The accumulated gradients scaled by `1/ranks` once, as the ranks' mean scales its sum:
    /// what the mean holds for any number of ranks (see Note [Where the mean divides]).
    SumScaled,
}

/// One rank, graphed, accumulating `ranks` microbatches per step, its gradients as `whole` says.
fn one_rank(dev: &Device, ranks: u64, whole: Whole) -> anyhow::Result<Trace> {
    let m = model(dev, false)?;
    let (x0, _) = data(&m, 0, 0)?;
    let graphed = make_graphed_stack(&m.alloc, &m.stack, &x0, GraphOptions::default())?;
    let k = 1.0 / ranks as f32;
    let mut trace = Vec::new();
    for step in 0..STEPS {
        for r in 0..ranks {
            let (x, mut dy) = data(&m, step, r)?;
            if let Whole::MeanLoss = whole {
                let scaled = Tensor::zeros(&m.alloc, &m.s, dy.shape(), dy.dtype())?;
                scale::<f32>(scaled.view()?, dy.view()?, k, &m.s)?;
                dy = scaled;
            }
            graphed.forward(&m.s, &x, Replay::caller())?;
            graphed.backward(&m.s, &dy)?;
        }
        graphed.join(&m.s)?;
        if let Whole::SumScaled = whole {
            let grads = m.store.grads()?;
            scale::<f32>(grads.view()?, grads.view()?, k, &m.s)?;
        }
        let grads = m.store.grads()?.to_vec::<f32>(&m.s)?;
        m.opt.step(&m.s)?;
        trace.push((grads, m.store.values()?.to_vec::<f32>(&m.s)?));
    }
    Ok(trace)
}

/// The reduction of `comm`'s data-parallel group over `m`'s layers, combining as `reduction` says.
fn reduction_of(
    comm: &Communicator,
    m: &Model,
    callables: Option<&[&dyn Callable]>,
    reduction: GradReduction,
) -> graphed::Result<std::sync::Arc<DataParallel>> {
    let dp = match callables {
        Some(c) => DataParallel::for_callables(comm, &m.store, c)?,
        None => DataParallel::for_stack(comm, &m.store, &m.stack)?,
    };
    match reduction {
        // The default.
        GradReduction::Mean => Ok(dp),
        other => dp.with_reduction(other),
    }
}

/// Where a graphed rank reduces its gradients.
#[derive(Debug, Clone, Copy)]
enum Placement {
    /// Inside the backward graphs (`GraphOptions::grad_sync`).
    InBackward,
    /// On graphs of their own, after typed edges from the backward (`ReductionGraphs`).
    OwnGraphs,
}

/// Rank `comm.rank()` of a data-parallel group, graphed with the reduction where `placement`
/// says and replayed on a side stream; with `split_dw`, the layers' weight gradients in passes
/// of their own, which the reduction follows; with `lend`, the layers' gradients lent to the
/// pool until their backward.
fn data_parallel(
    comm: &Communicator,
    split_dw: bool,
    reduction: GradReduction,
    lend: bool,
    placement: Placement,
) -> anyhow::Result<Trace> {
    let m = model(comm.device(), split_dw)?;
    let dp = reduction_of(comm, &m, None, reduction)?;
    let (x0, _) = data(&m, 0, 0)?;
    let (side, ready) = (comm.device().stream()?, comm.device().event()?);
    let options = GraphOptions::default().sync_event(&ready).lend_gradients(lend);
    let (options, own) = match placement {
        Placement::InBackward => (options.grad_sync(dp), None),
        Placement::OwnGraphs => {
            let graphs = ReductionGraphs::capture(&m.alloc, dp)?;
            (graphs.signalled(options), Some(graphs))
        }
    };
    let graphed = make_graphed_stack(&m.alloc, &m.stack, &x0, options)?;
    let mut trace = Vec::new();
    for step in 0..STEPS {
        let (x, dy) = data(&m, step, comm.rank() as u64)?;
        graphed.forward(&m.s, &x, Replay::side(&side))?;
        graphed.backward(&m.s, &dy)?;
        if split_dw {
            graphed.backward_dw(&m.s)?;
        }
        if let Some(graphs) = &own {
            graphs.replay(&m.s)?;
        }
        graphed.join(&m.s)?;
        graphed.take_gradients()?;
        let grads = m.store.grads()?.to_vec::<f32>(&m.s)?;
        m.opt.step(&m.s)?;
        trace.push((grads, m.store.values()?.to_vec::<f32>(&m.s)?));
    }
    Ok(trace)
}

/// As [`data_parallel`], with the whole stack graphed as one callable: its layers tell the
/// reduction one by one, inside the one backward graph.
fn data_parallel_one_callable(comm: &Communicator, reduction: GradReduction) -> anyhow::Result<Trace> {
    let m = model(comm.device(), false)?;
    let callables: [&dyn Callable; 1] = [&m.stack];
    let dp = reduction_of(comm, &m, Some(&callables), reduction)?;
    let (x0, _) = data(&m, 0, 0)?;
    let (side, ready) = (comm.device().stream()?, comm.device().event()?);
    let options = GraphOptions::default().sync_event(&ready).grad_sync(dp);
    let graphed = make_graphed_callables(&m.alloc, &callables, &[Inputs::one(&x0)], options)?.remove(0);
    let mut trace = Vec::new();
    for step in 0..STEPS {
        let (x, dy) = data(&m, step, comm.rank() as u64)?;
        let (_, forward) = graphed.forward(&m.s, &Inputs::one(&x), Replay::side(&side))?;
        let (_, backward) = graphed.backward(&m.s, &[&dy])?;
        forward.join(&m.s)?;
        backward.join(&m.s)?;
        let grads = m.store.grads()?.to_vec::<f32>(&m.s)?;
        m.opt.step(&m.s)?;
        trace.push((grads, m.store.values()?.to_vec::<f32>(&m.s)?));
    }
    Ok(trace)
}

#[test]
fn two_ranks_with_a_microbatch_each_equal_one_rank_with_both_bit_for_bit_and_race_free() -> anyhow::Result<()> {
    let sim = Device::sim();
    for (reduction, whole) in [(GradReduction::Sum, Whole::Sum), (GradReduction::Mean, Whole::MeanLoss)] {
        let want = one_rank(&sim, 2, whole)?;
        for placement in [Placement::InBackward, Placement::OwnGraphs] {
            for policy in Policy::ALL {
                let on = Ranks::Sim(policy);
                data_parallel_equals(&want, on, 2, |c| data_parallel(c, false, reduction, false, placement))?;
                // Lent gradients: the reduction has them from each backward to the join.
                data_parallel_equals(&want, on, 2, |c| data_parallel(c, false, reduction, true, placement))?;
            }
            // Split weight gradients: the reduction follows the pass that completes them.
            let on = Ranks::Sim(Policy::Adversarial);
            data_parallel_equals(&want, on, 2, |c| data_parallel(c, true, reduction, false, placement))?;
        }
        data_parallel_equals(&want, Ranks::Sim(Policy::Adversarial), 2, |c| data_parallel_one_callable(c, reduction))?;
    }
    // Halving is exact: the mean is the whole batch's mean loss, and the sum scaled once.
    ensure!(one_rank(&sim, 2, Whole::MeanLoss)? == one_rank(&sim, 2, Whole::SumScaled)?);
    Ok(())
}

/// Three ranks, whose `1/3` is not a power of two: the sum is still one rank accumulating the
/// three microbatches (the simulator adds in rank order, as that rank does), and the mean that
/// sum scaled once, bit for bit; the default reduction is the mean.
#[test]
fn three_ranks_sum_as_one_rank_accumulates_and_average_as_it_scales_that_sum_once() -> anyhow::Result<()> {
    let sim = Device::sim();
    for (reduction, whole) in [(GradReduction::Sum, Whole::Sum), (GradReduction::Mean, Whole::SumScaled)] {
        let want = one_rank(&sim, 3, whole)?;
        for placement in [Placement::InBackward, Placement::OwnGraphs] {
            let on = Ranks::Sim(Policy::Adversarial);
            data_parallel_equals(&want, on, 3, |c| data_parallel(c, true, reduction, false, placement))?;
        }
    }
    let defaults = on_sim_ranks(3, SimConfig::default(), CommOptions::default(), |c| {
        Ok(DataParallel::new(c, Vec::new())?.reduction())
    });
    for d in defaults {
        ensure!(d? == GradReduction::Mean, "the default reduction averages");
    }
    Ok(())
}

/// `n` data-parallel ranks `on`, each running `rank`, give `want`'s gradients and parameters at
/// every step, and their checkers stay quiet.
fn data_parallel_equals(
    want: &Trace,
    on: Ranks,
    n: usize,
    rank: impl Fn(&Communicator) -> anyhow::Result<Trace> + Sync,
) -> anyhow::Result<()> {
    let ranks = on.run(n, CommOptions::default(), |c| {
        let trace = rank(c);
        Ok((trace, graphed::check::Checker::of(c.device()).expect("checked").take_hazards()))
    })?;
    for (r, res) in ranks.into_iter().enumerate() {
        let (trace, hazards) = res?;
        let trace = trace.with_context(|| format!("rank {r} {on:?}"))?;
        ensure!(hazards.is_empty(), "{on:?}: rank {r}'s checker reported {hazards:#?}");
        for (step, (got, want)) in trace.iter().zip(want).enumerate() {
            ensure!(got.0 == want.0, "{on:?}: rank {r}'s gradients differ at step {step}");
            ensure!(got.1 == want.1, "{on:?}: rank {r}'s parameters differ at step {step}");
        }
    }
    Ok(())
}

#[test]
fn grad_sync_without_a_backward_is_refused_before_anything_runs() -> anyhow::Result<()> {
    let out = on_sim_ranks(1, SimConfig::default(), CommOptions::default(), |c| {
        let m = model(c.device(), false)?;
        let dp = DataParallel::new(c, Vec::new())?;
        let (x0, _) = data(&m, 0, 0)?;
        let options = GraphOptions::default().grad_sync(dp).inference();
        Ok(make_graphed_stack(&m.alloc, &m.stack, &x0, options).err())
    });
    let err = out.into_iter().next().context("one rank")??.context("refused")?;
    ensure!(err.to_string().contains("grad_sync needs training mode"), "{err}");
    Ok(())
}

/// The reduction on graphs of its own refuses before anything is enqueued: a `DataParallel`
/// something else holds (a capture's `grad_sync` would reduce the gradients twice), a replay
/// with no backward since the last one (the gradients stay as they were), and a stack whose
/// layer would wait on an edge (a stack's layers may only signal).
#[test]
fn reduction_graphs_refuse_a_shared_reduction_and_a_stale_replay_before_anything_runs() -> anyhow::Result<()> {
    use graphed::graph::{GraphEdge, GraphedErrorKind, Pass};
    // `Ok` where `e` is a graphed refusal that `is` accepts, else what it was.
    fn refused(e: Option<Error>, is: fn(&GraphedErrorKind) -> bool) -> Result<(), String> {
        match e {
            Some(e) if e.graphed_kind().is_some_and(is) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    }
    let not_produced = |k: &GraphedErrorKind| matches!(k, GraphedErrorKind::EdgeNotProduced { .. });
    let out = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |c| {
        let m = model(c.device(), false)?;
        let dp = DataParallel::for_stack(c, &m.store, &m.stack)?.with_reduction(GradReduction::Sum)?;
        let shared = ReductionGraphs::capture(&m.alloc, dp.clone()).err();
        let graphs = ReductionGraphs::capture(&m.alloc, dp)?;
        let (x, dy) = data(&m, 0, c.rank() as u64)?;
        let graphed = make_graphed_stack(&m.alloc, &m.stack, &x, graphs.signalled(GraphOptions::default()))?;
        let unproduced = refused(graphs.replay(&m.s).err(), not_produced);
        graphed.forward(&m.s, &x, Replay::caller())?;
        graphed.backward(&m.s, &dy)?;
        graphs.replay(&m.s)?;
        graphed.join(&m.s)?;
        let reduced = m.store.grads()?.to_vec::<f32>(&m.s)?;
        let stale = refused(graphs.replay(&m.s).err(), not_produced);
        let unchanged = reduced == m.store.grads()?.to_vec::<f32>(&m.s)?;
        let edge = GraphEdge::new(c.device(), "a wait")?;
        let waits = GraphOptions::default().waits_on(0, Pass::Forward, &edge);
        let waiting = make_graphed_stack(&m.alloc, &m.stack, &x, waits).err();
        let waiting = refused(waiting, |k| matches!(k, GraphedErrorKind::EdgePass { .. }));
        Ok((shared, unproduced, stale, unchanged, waiting))
    });
    for (r, res) in out.into_iter().enumerate() {
        let (shared, unproduced, stale, unchanged, waiting) = res.with_context(|| format!("rank {r}"))?;
        let shared = shared.context("a DataParallel held twice was taken")?;
        ensure!(
            matches!(shared, Error::Comm { kind: CommErrorKind::ReducedTwice { holders: 1 }, .. }),
            "rank {r}: {shared}"
        );
        unproduced.map_err(|e| anyhow::anyhow!("rank {r}: a replay before any backward: {e}"))?;
        stale.map_err(|e| anyhow::anyhow!("rank {r}: a second replay after one backward: {e}"))?;
        ensure!(unchanged, "rank {r}: the refused replay changed the gradients");
        waiting.map_err(|e| anyhow::anyhow!("rank {r}: a stack's layer waiting on an edge: {e}"))?;
    }
    Ok(())
}

/// A layer that tells its parameters final before its backward has summed into them: the
/// mistake [`GradHook`] makes possible.
struct TellsEarly(TransformerLayer);

impl Module for TellsEarly {
    type Ctx = TransformerCtx;

    fn forward(
        &self,
        inputs: &Inputs,
        hook: &dyn SaveHook,
        s: &Stream,
    ) -> graphed::Result<(Vec<Tensor>, TransformerCtx)> {
        self.0.forward(inputs, hook, s)
    }

    fn backward(&self, ctx: TransformerCtx, dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        self.0.backward(ctx, dys, s)
    }

    fn backward_hooked(
        &self,
        ctx: TransformerCtx,
        dys: &[&Tensor],
        hook: &dyn GradHook,
        s: &Stream,
    ) -> graphed::Result<Vec<Option<Tensor>>> {
        hook.grads_final(&self.0.parameters(), s)?;
        self.0.backward(ctx, dys, s)
    }

    fn parameters(&self) -> Vec<&Param> {
        self.0.parameters()
    }

    fn set_training(&mut self, training: bool) {
        self.0.set_training(training);
    }
}

#[test]
fn a_layer_that_tells_its_gradients_final_too_early_is_caught_by_the_checker() -> anyhow::Result<()> {
    let ranks = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |c| {
        let (s, alloc) = (c.device().stream()?, CachingAllocator::new(c.device()));
        let store = ParamStore::new(&alloc, &s, TransformerLayer::parameter_count(32))?;
        let layer = TransformerLayer::new(&Builder::new(&store, &alloc, &s)?.pp("h0"), (32, 1))?;
        let stack = Stack::new(vec![TellsEarly(layer)]);
        let dp = DataParallel::for_stack(c, &store, &stack)?;
        let x = Tensor::from_host(&alloc, &s, &[0.25f32; 2 * 8 * 32], &[2, 8, 32])?;
        let captured = make_graphed_stack(&alloc, &stack, &x, GraphOptions::default().grad_sync(dp));
        let hazards = graphed::check::Checker::of(c.device()).expect("checked").take_hazards();
        let grads = store.grads()?.access(AccessMode::Read)?.buffer;
        Ok((captured.err().map(|e| e.to_string()), hazards, grads))
    });
    for (r, res) in ranks.into_iter().enumerate() {
        let (refused, hazards, grads) = res?;
        ensure!(refused.is_none(), "rank {r}: the capture itself was refused: {refused:?}");
        ensure!(!hazards.is_empty(), "rank {r}: the early reduction went unnoticed");
        for h in &hazards {
            let earlier = h.earlier.as_ref().map(|o| o.op.as_str());
            // The reduction is the all-reduce and, for the mean, the scaling after it.
            ensure!(
                h.buffer == Some(grads) && matches!(earlier, Some("all_reduce" | "scale_f32")),
                "rank {r}: a hazard other than the reduction racing the gradients: {h:?}"
            );
        }
    }
    Ok(())
}

fn env(rank: usize, world: usize, port: u16) -> RankEnv {
    RankEnv { rank, world, local_rank: rank, master_addr: "127.0.0.1".into(), master_port: port }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// Ranks `0..n` meet, each on a thread of its own, as `who(r)` says (its place, and the model it
/// builds); rank 0 shares `payload`. Every rank's result, in rank order.
fn meet_threads(
    n: usize,
    payload: &[u8],
    who: impl Fn(usize) -> (RankEnv, &'static str) + Sync,
) -> Vec<graphed::Result<(Vec<u8>, RankWatch)>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let who = &who;
                s.spawn(move || {
                    let (env, model) = who(r);
                    meet(&env, model, (r == 0).then(|| payload.to_vec()), Duration::from_secs(20))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    })
}

#[test]
fn the_rendezvous_shares_rank_0s_payload_and_refuses_a_rank_with_another_model() -> anyhow::Result<()> {
    let port = free_port();
    let got = meet_threads(3, &[7, 0, 255], |r| (env(r, 3, port), "gpt 32x3"));
    for g in got {
        ensure!(g?.0 == [7, 0, 255]);
    }

    let port = free_port();
    let got = meet_threads(2, &[1], |r| (env(r, 2, port), if r == 0 { "gpt 32x3" } else { "gpt 64x3" }));
    let Err(Error::Comm { kind: CommErrorKind::ModelMismatch { rank: 1, .. }, .. }) = &got[0] else {
        anyhow::bail!("rank 0: {:?}", got[0])
    };
    // Every rank learns it as the same typed error, naming the rank and both models.
    let Err(Error::Comm { kind: CommErrorKind::ModelMismatch { rank: 1, ours, theirs }, .. }) = &got[1] else {
        anyhow::bail!("rank 1: {:?}", got[1])
    };
    ensure!((ours.as_str(), theirs.as_str()) == ("gpt 32x3", "gpt 64x3"), "rank 1 must learn why: {ours} / {theirs}");
    Ok(())
}

#[test]
fn a_rank_launched_for_another_world_is_refused_with_the_group_naming_it() -> anyhow::Result<()> {
    let port = free_port();
    // Rank 1 believes in a group of 3; rank 0 in one of 2.
    let got = meet_threads(2, &[1], |r| (env(r, 2 + r, port), "m"));
    for (r, g) in got.iter().enumerate() {
        let Err(e) = g else { anyhow::bail!("rank {r} was let in") };
        ensure!(e.to_string().contains("rank 1 was launched for 3 ranks, rank 0 for 2"), "rank {r}: {e}");
    }
    Ok(())
}

#[test]
fn a_rank_that_never_arrives_is_named_after_the_timeout() -> anyhow::Result<()> {
    let port = free_port();
    let err = meet(&env(0, 3, port), "m", Some(vec![1]), Duration::from_millis(300)).expect_err("nobody came");
    ensure!(err.to_string().contains("ranks 1, 2 did not arrive"), "{err}");
    let err = meet(&env(1, 2, free_port()), "m", None, Duration::from_millis(300)).expect_err("no rank 0");
    ensure!(err.to_string().contains("not listening"), "{err}");
    Ok(())
}

/// Polls `done` until it holds; fails naming `what` after a generous deadline (a watch that
/// never learns is a failure, not a hang).
fn eventually(what: &str, done: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !done() {
        ensure!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Connects to rank 0 at `port` as `rank` of `world` by hand, as a process that can die.
fn raw_rank(rank: usize, world: usize, port: u16) -> anyhow::Result<std::net::TcpStream> {
    use std::io::{BufRead, Write};
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut conn = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(c) => break c,
            Err(e) if std::time::Instant::now() > deadline => return Err(e.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    write!(conn, "graphed-rendezvous/1 {rank} {world}\nm\n")?;
    let mut reply = String::new();
    std::io::BufReader::new(&conn).read_line(&mut reply)?;
    ensure!(reply.starts_with("ok "), "rank 0 answered {reply}");
    Ok(conn)
}

#[test]
fn a_rank_whose_process_dies_or_that_fails_is_named_to_every_rank_and_one_that_leaves_is_not() -> anyhow::Result<()> {
    let port = free_port();
    let long = Duration::from_secs(20);
    let (w0, w1, dying) = std::thread::scope(|s| -> anyhow::Result<_> {
        let lead = s.spawn(move || meet(&env(0, 3, port), "m", Some(vec![1]), long));
        let follower = s.spawn(move || meet(&env(1, 3, port), "m", None, long));
        let dying = raw_rank(2, 3, port)?;
        let (lead, follower) = (lead.join().expect("rank 0"), follower.join().expect("rank 1"));
        Ok((lead?.1, follower?.1, dying))
    })?;
    ensure!(w0.gone().is_none() && w1.gone().is_none(), "nobody died yet");
    let (told, deaths) = std::sync::mpsc::channel();
    w1.on_death(move |rank| told.send(rank).expect("the test listens"));
    // Rank 2's process ends: its connection closes without a goodbye.
    drop(dying);
    eventually("rank 0 sees rank 2 die", || w0.gone() == Some(2))?;
    eventually("rank 1 hears of it from rank 0", || w1.gone() == Some(2))?;
    ensure!(matches!(w1.error(), Some(CommErrorKind::RankGone { rank: 2 })), "{:?}", w1.error());
    ensure!(deaths.recv_timeout(Duration::from_secs(20))? == 2, "rank 1's handler hears of rank 2");
    // Rank 1 leaves on purpose: rank 0 sees a goodbye, not a death.
    w1.leave();
    eventually("rank 0 sees rank 1 leave", || w0.left() == [1])?;
    ensure!(w0.gone() == Some(2), "{:?}", w0.gone());

    // A rank that drops its watch without leaving (it failed) is a death to the others.
    let port = free_port();
    let mut watches = meet_threads(2, &[1], |r| (env(r, 2, port), "m")).into_iter();
    let (Some(w0), Some(w1)) = (watches.next(), watches.next()) else { anyhow::bail!("two ranks met") };
    let (w0, w1) = (w0?.1, w1?.1);
    drop(w1);
    eventually("rank 0 sees rank 1 fail", || w0.gone() == Some(1))?;
    ensure!(w0.left().is_empty(), "a failed rank did not leave: {:?}", w0.left());

    // Rank 0 dies after the rendezvous: the others name it.
    let port = free_port();
    let listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
    let follower = std::thread::spawn(move || meet(&env(1, 2, port), "m", None, long));
    let (conn, _) = listener.accept()?;
    {
        use std::io::{BufRead, Write};
        let mut lines = std::io::BufReader::new(&conn).lines();
        ensure!(lines.next().transpose()?.is_some_and(|l| l.starts_with("graphed-rendezvous/1 1 2")));
        ensure!(lines.next().transpose()?.as_deref() == Some("m"));
        writeln!(&conn, "ok 07")?;
    }
    let (payload, w1) = follower.join().expect("rank 1")?;
    ensure!(payload == [7]);
    drop((conn, listener));
    eventually("rank 1 sees rank 0 die", || w1.gone() == Some(0))?;
    Ok(())
}

#[test]
fn the_launchers_variables_are_read_or_refused_by_name() -> anyhow::Result<()> {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    };
    ensure!(RankEnv::from_vars(vars(&[]))?.is_none());
    let e = RankEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_PORT", "29555")]))?;
    ensure!(e == Some(env(1, 2, 29555)));
    // A program written for a fixed number of ranks refuses another, naming the variable.
    env(1, 2, 29555).require_world(2, "two stages")?;
    match env(1, 2, 29555).require_world(4, "two stages × two replicas") {
        Err(Error::Comm { rank: 1, kind: CommErrorKind::Env { var: "WORLD_SIZE", why }, .. })
            if why.contains("2 ranks") && why.contains("start 4") => {}
        other => anyhow::bail!("a group of 2 where 4 are needed: {other:?}"),
    }
    for (bad, var) in [
        (&[("WORLD_SIZE", "2")][..], "RANK"),
        (&[("WORLD_SIZE", "2"), ("RANK", "2")][..], "RANK"),
        (&[("WORLD_SIZE", "x"), ("RANK", "0")][..], "WORLD_SIZE"),
        (&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "70000")][..], "MASTER_PORT"),
    ] {
        let pairs: &'static [(&'static str, &'static str)] = Box::leak(bad.to_vec().into_boxed_slice());
        match RankEnv::from_vars(vars(pairs)) {
            Err(Error::Comm { kind: CommErrorKind::Env { var: v, .. }, .. }) if v == var => {}
            other => anyhow::bail!("{bad:?}: {other:?}"),
        }
    }
    Ok(())
}

/// Rank 1 of a data-parallel group stalls inside a graphed step: it replays the forward, then
/// never launches its backward graphs (whose gradient all-reduces rank 0's wait for), staying in
/// the group (`dies`: failing, as a rank whose process ends). Rank 0's wait for an event after
/// its step (as train's wait for an earlier step's copy) fails
/// within the timeout, naming the last layer's backward graph (replayed first), its
/// all-reduce and rank 1 as missing, instead of hanging.
fn a_rank_stalled_in_a_graphed_step_is_named(on: Ranks, dies: bool) -> anyhow::Result<()> {
    // On GPUs the timeout also bounds NCCL's making of the group, which takes seconds.
    let timeout = match on {
        Ranks::Sim(_) => Duration::from_millis(500),
        Ranks::Gpus => Duration::from_secs(10),
    };
    let rank_0_done = std::sync::Barrier::new(2);
    let out = on.run(2, CommOptions { timeout }, |c| {
        let m = model(c.device(), false)?;
        let dp = reduction_of(c, &m, None, GradReduction::Mean)?;
        let (x, dy) = data(&m, 0, c.rank() as u64)?;
        let graphed = make_graphed_stack(&m.alloc, &m.stack, &x, GraphOptions::default().grad_sync(dp))?;
        graphed.forward(&m.s, &x, Replay::caller())?;
        c.wait(&m.s)?;
        if c.rank() == 1 {
            if dies {
                return Err(Error::Unsupported { op: "test", backend: "sim", why: "rank 1 dies mid-step" });
            }
            rank_0_done.wait();
            return Ok(());
        }
        graphed.backward(&m.s, &dy)?;
        graphed.join(&m.s)?;
        // As train waits for the copy of an earlier step: an event behind the step's collectives.
        let copied = c.device().event()?;
        m.s.record(&copied)?;
        let waited = c.wait_event_watching(&copied, &|| None);
        if !dies {
            rank_0_done.wait();
        }
        waited
    })?;
    let Err(Error::Comm { kind: CommErrorKind::Stalled(stalled), .. }) = &out[0] else {
        anyhow::bail!("{on:?}: expected a stalled graph on rank 0, got {:?}", out[0]);
    };
    let Stalled { graph, collective, arrived, missing, cause, .. } = &**stalled;
    let name = graph.as_ref().map(|g: &StalledLaunch| g.graph.as_str());
    ensure!(name == Some("TransformerLayer#2 (h2) Backward"), "{on:?}: {graph:?}");
    ensure!(collective.contains("all_reduce of") && collective.contains("rank 0 of a group of 2"), "{collective}");
    match (on, dies) {
        (Ranks::Sim(_), _) => ensure!(
            arrived.as_deref() == Some(&[0][..]) && missing.as_deref() == Some(&[1][..]),
            "{arrived:?} {missing:?}"
        ),
        (Ranks::Gpus, _) => ensure!(arrived.is_none(), "{arrived:?}"),
    }
    match dies {
        true => ensure!(matches!(cause, CommErrorKind::RankGone { rank: 1 }), "{cause:?}"),
        false => ensure!(matches!(cause, CommErrorKind::Timeout { .. }), "{cause:?}"),
    }
    Ok(())
}

#[test]
fn a_rank_stalled_or_dead_inside_a_graphed_data_parallel_step_is_named_with_the_graph_and_collective(
) -> anyhow::Result<()> {
    for dies in [false, true] {
        a_rank_stalled_in_a_graphed_step_is_named(Ranks::Sim(Policy::Random), dies)?;
    }
    Ok(())
}

/// One rank over NCCL on one GPU: its gradients reduced inside the backward graphs and on
/// graphs of their own (NCCL's one-rank all-reduce, captured, after typed edges on the device),
/// against the GPU stepping alone, bit for bit and race-free.
mod one_gpu {
    use super::*;

    #[test]
    #[ignore = "needs a CUDA GPU and NCCL"]
    fn one_gpu_rank_reducing_on_graphs_of_its_own_equals_the_gpu_alone() -> anyhow::Result<()> {
        let want = one_rank(&Device::cuda_checked(0)?, 1, Whole::Sum)?;
        for placement in [Placement::InBackward, Placement::OwnGraphs] {
            for (split_dw, lend) in [(false, false), (true, false), (false, true)] {
                let mean = GradReduction::Mean;
                data_parallel_equals(&want, Ranks::Gpus, 1, |c| data_parallel(c, split_dw, mean, lend, placement))?;
            }
        }
        Ok(())
    }
}

/// The same programs on two GPUs of one process, against one GPU.
mod two_gpus {
    use super::*;

    #[test]
    #[ignore = "needs two CUDA GPUs and NCCL"]
    fn two_gpus_with_a_microbatch_each_equal_one_gpu_with_both_bit_for_bit() -> anyhow::Result<()> {
        let gpu = Device::cuda_checked(0)?;
        for (reduction, whole) in [(GradReduction::Sum, Whole::Sum), (GradReduction::Mean, Whole::MeanLoss)] {
            let want = one_rank(&gpu, 2, whole)?;
            for placement in [Placement::InBackward, Placement::OwnGraphs] {
                data_parallel_equals(&want, Ranks::Gpus, 2, |c| data_parallel(c, false, reduction, false, placement))?;
                data_parallel_equals(&want, Ranks::Gpus, 2, |c| data_parallel(c, true, reduction, false, placement))?;
                data_parallel_equals(&want, Ranks::Gpus, 2, |c| data_parallel(c, false, reduction, true, placement))?;
            }
            data_parallel_equals(&want, Ranks::Gpus, 2, |c| data_parallel_one_callable(c, reduction))?;
        }
        Ok(())
    }

    /// A rank that never launches its backward graphs: the other's wait fails after the
    /// timeout naming the graph and its all-reduce instead of hanging.
    #[test]
    #[ignore = "needs two CUDA GPUs and NCCL"]
    fn a_rank_stalled_inside_a_graphed_step_is_named_with_the_graph() -> anyhow::Result<()> {
        a_rank_stalled_in_a_graphed_step_is_named(Ranks::Gpus, false)
    }
}
