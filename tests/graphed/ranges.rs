//! Profiler ranges: every warmup pass, capture, replay, offload copy and optimizer step of a
//! graphed training step is named for its layer and pass, and the ranges nest, as the device's
//! range log records them (NVTX sees the same pushes and pops on CUDA).

use anyhow::ensure;
use graphed::device::Device;
use graphed::graph::{make_graphed_fn, make_graphed_schedule, GraphOptions, Replay};
use graphed::nn::{Chunk, Inputs, Module, Schedule};
use graphed::offload::{OffloadConfig, OffloadManager};
use graphed::tensor::Tensor;

use super::fixtures::{Model, Result, LAYERS};

/// The device's ranges since the last take, as (name, depth), in order of their begins; fails
/// unless every range ended, nested in the one open when it began.
fn take_spans(dev: &Device) -> Result<Vec<(String, usize)>> {
    let log = dev.take_ranges();
    Ok(log.spans()?.into_iter().map(|s| (s.name.to_string(), s.depth)).collect())
}

fn owned(spans: &[(&str, usize)]) -> Vec<(String, usize)> {
    spans.iter().map(|(n, d)| (n.to_string(), *d)).collect()
}

/// One eager iteration of the stack through the offload manager's hook.
fn eager_offload_iteration(m: &Model, offload: &OffloadManager, x: &Tensor, dy: &Tensor) -> Result {
    let (_, ctx) = m.stack.forward(&Inputs::one(x), &offload.chunk(Chunk::default()), &m.s)?;
    m.stack.backward(ctx, &[dy], &m.s)?;
    Ok(offload.end_iteration(&m.s)?)
}

/// A training step of a graphed stack with offloading inside its graphs, replayed on a side
/// stream, and a graphed optimizer step: the eager offload copies, the capture (warmup passes,
/// each pass's capture with the copies it issues, instantiation) and two steps' replays.
pub fn ranges_name_every_pass_of_a_graphed_step(dev: &Device) -> Result {
    let m = Model::new(dev)?;
    let (side, ready) = (dev.stream()?, dev.event()?);
    let (x, dy) = m.data(0)?;
    // Groups of 64 elements or more leave the device; the last layer's stay (of two layers, one
    // kept).
    let offload = OffloadManager::new(&m.alloc, OffloadConfig::default().min_elements(64).margin(1))?;
    // The warmup iteration only records what is saved; ranges are not recorded yet.
    eager_offload_iteration(&m, &offload, &x, &dy)?;
    ensure!(dev.take_ranges().events.is_empty(), "recording is off until asked for");

    dev.record_ranges(true);
    eager_offload_iteration(&m, &offload, &x, &dy)?;
    let eager = [("offload h0.attn", 0), ("offload h0.mlp", 0), ("reload h0.attn", 0), ("reload h0.mlp", 0)];
    ensure!(take_spans(dev)? == owned(&eager), "eager offload ranges");

    let options = offload.graph_options(GraphOptions::default().sync_event(&ready).warmup_iters(2));
    let graphed = m.graph(options)?;
    let optimizer = make_graphed_fn(&m.alloc, |s| m.optimizer.step(s))?.with_name("optimizer step");
    let mut capture = vec![("graph capture", 0), ("warmup", 1)];
    for _ in 0..2 {
        // The warmup iterations, layer by layer; offloading is off in them.
        capture.extend(
            ["warmup h0.forward", "warmup h0.backward", "warmup h1.forward", "warmup h1.backward"].map(|n| (n, 2)),
        );
    }
    capture.extend([
        ("capture h0.forward", 1),
        // h0's groups leave in h1's forward graph, overlapping its compute, and come back in
        // h1's backward graph, ahead of h0's backward.
        ("capture h1.forward", 1),
        ("offload h0.attn", 2),
        ("offload h0.mlp", 2),
        ("capture h1.backward", 1),
        ("reload h0.attn", 2),
        ("reload h0.mlp", 2),
        ("capture h0.backward", 1),
        ("instantiate", 1),
        ("capture graphed fn", 0),
        ("optimizer step", 1),
    ]);
    ensure!(LAYERS == 2, "the expected names are those of a two-layer stack");
    let got = take_spans(dev)?;
    ensure!(got == owned(&capture), "capture ranges:\n{got:?}\nexpected\n{capture:?}");

    let step = [
        ("stack forward", 0),
        ("replay h0.forward", 1),
        ("replay h1.forward", 1),
        ("stack backward", 0),
        ("replay h1.backward", 1),
        ("replay h0.backward", 1),
        ("replay optimizer step", 0),
    ];
    for k in 0..2 {
        let (x, dy) = m.data(k)?;
        graphed.forward(&m.s, &x, Replay::side(&side))?;
        graphed.backward(&m.s, &dy)?;
        graphed.join(&m.s)?;
        optimizer.replay(&m.s)?;
        m.s.synchronize()?;
        let got = take_spans(dev)?;
        ensure!(got == owned(&step), "step {k}'s ranges:\n{got:?}\nexpected\n{step:?}");
    }
    dev.record_ranges(false);
    graphed.forward(&m.s, &x, Replay::side(&side))?;
    graphed.join(&m.s)?;
    ensure!(dev.take_ranges().events.is_empty(), "nothing is recorded once recording is off");
    Ok(())
}

/// One graph per (layer, microbatch) under interleaved 1F1B: each replay's range names its
/// microbatch, in the schedule's order.
pub fn scheduled_replay_ranges_name_the_microbatch(dev: &Device) -> Result {
    let m = Model::new(dev)?;
    // One rank, two virtual stages of one layer each, two microbatches.
    let schedule = Schedule::interleaved_1f1b(1, 0, 2, 2)?;
    let samples: Vec<Inputs> = (0..4).map(|i| Ok(Inputs::one(&m.data(i)?.0))).collect::<Result<_>>()?;
    let g = make_graphed_schedule(&m.alloc, &m.callables(), &schedule, &samples, GraphOptions::default())?;
    let (inputs, dys): (Vec<Tensor>, Vec<Tensor>) =
        (0..2).map(|j| m.data(j)).collect::<Result<Vec<_>>>()?.into_iter().unzip();
    dev.record_ranges(true);
    let mut head = |j: usize, _y: graphed::graph::StaticTensor| Ok(dys[j].clone());
    g.run(&m.s, &inputs, Some(&m.step), &mut head)?;
    let want = [
        "replay h0.forward mb0",
        "replay h1.forward mb0",
        "replay h1.backward mb0",
        "replay h0.forward mb1",
        "replay h0.backward mb0",
        "replay h1.forward mb1",
        "replay h1.backward mb1",
        "replay h0.backward mb1",
    ]
    .map(|n| (n, 0));
    let got = take_spans(dev)?;
    ensure!(got == owned(&want), "scheduled replay ranges:\n{got:?}\nexpected\n{want:?}");
    Ok(())
}
