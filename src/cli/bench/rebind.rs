//! `graphed bench rebind`: one transformer layer of `BENCH.md`'s configurations graphed, its
//! forward replayed with the input copied into the static buffer against read in place
//! (`forward_in_place`): the bytes copied, the host time of the replay call when the input stays
//! the same tensor and when it changes every replay (which rebinds the nodes that read it), the
//! host time per rebound node, the GPU time of the forward, and whether both give the same bits.
//!
//! Each configuration runs without dropout (BENCH.md's layer) and with it (`--dropout`): without,
//! the residual add rides in the output projection's cuBLASLt epilogue, whose arguments graphed
//! does not lay out, so the input is copied in; with it, the add is graphed's own kernel and the
//! input is read in place.
//!
//! Then the rebind call's scaling: graphs of more and more kernels, then device-to-device copies,
//! reading one buffer, whose slope is the host cost of one more patched node (issue 35's goal is
//! stated per node; an offload switch moves copies).

use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use graphed::device::{DType, Device, DeviceKind, GraphExec, Stream};
use graphed::graph::{make_graphed_callables, make_graphed_fn, Callable, GraphOptions, GraphedCallable, Pass, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Inputs, ParamStore, TransformerLayer};
use graphed::ops::elementwise;
use graphed::tensor::Tensor;
use serde::Serialize;

use super::{median, write_json, Report};
use crate::cli::args::RebindBenchArgs;
use crate::cli::bench_model::Config;

#[derive(Serialize, Debug)]
struct RebindRow {
    config: &'static str,
    dtype: String,
    /// The layer's dropout probability.
    dropout: f32,
    /// Whether the layer's input qualifies to be read in place (its readers are our kernels).
    input_in_place: bool,
    /// Bytes a forward replay copies into its static input: copying in, and in place.
    copy_in_bytes: usize,
    in_place_bytes: usize,
    /// Host µs of the forward replay call (medians).
    copy_in_host_us: f64,
    in_place_same_host_us: f64,
    in_place_moving_host_us: f64,
    /// Nodes rebound by a replay whose input changed.
    nodes_rebound: usize,
    /// (moving − same) / nodes: the host cost of rebinding one node.
    host_us_per_node: Option<f64>,
    /// `GraphExec::rebind` alone, per node moved: another executable of the forward graph with
    /// its input rebound to two tensors in turn, nothing launched. What `host_us_per_node` adds
    /// beyond it is the launch after an update, and the backward's executable.
    rebind_call_us_per_node: Option<f64>,
    /// GPU µs of the forward (medians); none on the simulator, which has no clock.
    copy_in_gpu_us: Option<f64>,
    in_place_gpu_us: Option<f64>,
    /// Whether the in-place forward's output equals the copy-in forward's bit for bit.
    bitwise_equal: bool,
}

pub fn run(args: &RebindBenchArgs) -> anyhow::Result<()> {
    let dev = super::open_timing_device(&args.device, "rebind", "--configs tiny")?;
    let configs = args.configs.resolve(&dev, args.attention)?;
    let dtype = args.dtype.storage(&dev);
    let s = dev.stream()?;
    let mut rows = Vec::new();
    let cases = configs.into_iter().flat_map(|c| args.dropout.iter().map(move |p| (c, *p)));
    for (config, dropout) in cases {
        let row = run_config(&dev, &s, config, dtype, dropout, args.reps)?;
        let gpu = |us: Option<f64>| us.map_or_else(|| "-".to_string(), |us| format!("{us:.1} µs GPU"));
        println!(
            "{} {} dropout {}: input read in place: {}; copy-in {} B, {:.2} µs host, {}; in place {} B, {:.2} µs host \
             (same tensor), {:.2} µs (new tensor: {} nodes rebound, {}; the rebind call alone {}), {}; bit for bit: {}",
            row.config,
            row.dtype,
            row.dropout,
            row.input_in_place,
            row.copy_in_bytes,
            row.copy_in_host_us,
            gpu(row.copy_in_gpu_us),
            row.in_place_bytes,
            row.in_place_same_host_us,
            row.in_place_moving_host_us,
            row.nodes_rebound,
            row.host_us_per_node.map_or_else(|| "-".into(), |us| format!("{us:.3} µs per node")),
            row.rebind_call_us_per_node.map_or_else(|| "-".into(), |us| format!("{us:.3} µs per node")),
            gpu(row.in_place_gpu_us),
            row.bitwise_equal,
        );
        rows.push(Row::Layer(row));
    }
    for reader in [Reader::Kernel, Reader::Copy] {
        let scaling = rebind_scaling(&dev, &s, reader, args.reps)?;
        let per_call = |us: &[f64]| -> String {
            let calls: Vec<String> =
                scaling.nodes.iter().zip(us).map(|(n, us)| format!("{n} nodes {us:.2} µs")).collect();
            calls.join(", ")
        };
        println!(
            "GraphExec::rebind of one buffer read by n {}, per call: {}; {:.3} µs per added node",
            scaling.reader,
            per_call(&scaling.call_us),
            scaling.us_per_added_node
        );
        println!(
            "GraphExec::set_enabled of the same nodes, per call: {}; {:.3} µs per added node",
            per_call(&scaling.set_enabled_call_us),
            scaling.set_enabled_us_per_added_node
        );
        rows.push(Row::Scaling(scaling));
    }
    write_json(&args.json, &Report::new("rebind", &dev, args.reps, rows))
}

/// What the nodes of [`rebind_scaling`]'s graphs are: each reads the rebound buffer.
#[derive(Clone, Copy)]
enum Reader {
    /// A kernel of graphed's (its pointer argument patched).
    Kernel,
    /// A device-to-device copy (a memcpy node's source moved, as an offload switch moves its
    /// device copies').
    Copy,
}

impl Reader {
    fn name(self) -> &'static str {
        match self {
            Reader::Kernel => "kernels",
            Reader::Copy => "device-to-device copies",
        }
    }
}

/// A row of the report: a layer's, or the rebind call's scaling.
#[derive(Serialize, Debug)]
#[serde(untagged)]
enum Row {
    Layer(RebindRow),
    Scaling(ScalingRow),
}

/// The host cost of [`GraphExec::rebind`](graphed::device::GraphExec::rebind) as a graph has
/// more nodes to patch: a layer's input has a few readers, whose per-node figure carries the
/// call's fixed cost; the slope over graphs of many readers is the cost of one more node. The
/// same for [`GraphExec::set_enabled`](graphed::device::GraphExec::set_enabled) turning those
/// nodes off and on.
#[derive(Serialize, Debug)]
struct ScalingRow {
    /// What reads the rebound buffer: `kernels` or `device-to-device copies`.
    reader: &'static str,
    /// Nodes reading the rebound buffer, per graph.
    nodes: Vec<usize>,
    /// Host µs of one rebind call (median), per graph.
    call_us: Vec<f64>,
    /// The slope between the two largest graphs.
    us_per_added_node: f64,
    /// Host µs of one `set_enabled` call (median), per graph.
    set_enabled_call_us: Vec<f64>,
    /// Its slope between the two largest graphs.
    set_enabled_us_per_added_node: f64,
}

/// Graphs of 1, 16 and 128 `reader` nodes that each read one buffer (and write their own), each
/// instantiated and the buffer rebound to two others in turn, then the nodes turned off and on
/// in turn, nothing launched: the median host µs of a call, `reps` calls of each per graph.
fn rebind_scaling(dev: &Device, s: &Stream, reader: Reader, reps: u32) -> anyhow::Result<ScalingRow> {
    const NODES: [usize; 3] = [1, 16, 128];
    let alloc = CachingAllocator::new(dev);
    let buffer = || Tensor::zeros(&alloc, s, &[4096], DType::F32);
    let (x, a, b) = (buffer()?, buffer()?, buffer()?);
    let (mut call_us, mut set_enabled_call_us) = (Vec::new(), Vec::new());
    for n in NODES {
        let outs = (0..n).map(|_| buffer()).collect::<graphed::Result<Vec<_>>>()?;
        let g = make_graphed_fn(&alloc, |st| {
            outs.iter().try_for_each(|y| match reader {
                Reader::Kernel => elementwise::scale(y.view::<f32>()?, x.view()?, 2.0, st),
                Reader::Copy => y.copy_from(&x, st),
            })
        })?;
        let exec = g.graph().instantiate()?;
        let (us, moved) = time_rebinds(&exec, &x, (&a, &b), reps)?;
        anyhow::ensure!(moved == n, "the rebind moved {moved} of {n} nodes");
        call_us.push(us);
        let (us, toggled) = time_toggles(&exec, &x, reps)?;
        anyhow::ensure!(toggled == n, "set_enabled changed {toggled} of {n} nodes");
        set_enabled_call_us.push(us);
    }
    let slope = |us: &[f64]| (us[2] - us[1]) / (NODES[2] - NODES[1]) as f64;
    Ok(ScalingRow {
        reader: reader.name(),
        nodes: NODES.to_vec(),
        us_per_added_node: slope(&call_us),
        call_us,
        set_enabled_us_per_added_node: slope(&set_enabled_call_us),
        set_enabled_call_us,
    })
}

/// The median host µs of `exec.set_enabled` turning the nodes that name `x` off and on in turn
/// (`reps` calls after three untimed ones, ending on), nothing launched; and the nodes a call
/// changed.
fn time_toggles(exec: &GraphExec, x: &Tensor, reps: u32) -> anyhow::Result<(f64, usize)> {
    let (mut us, mut nodes) = (Vec::new(), 0);
    for rep in 0..(reps + 4) & !1 {
        let issued = Instant::now();
        nodes = exec.set_enabled(&[x.id()], rep % 2 == 1)?;
        let elapsed = issued.elapsed().as_secs_f64() * 1e6;
        if rep >= 3 {
            us.push(elapsed);
        }
    }
    Ok((median(us), nodes))
}

/// How a timed forward is fed.
#[derive(Clone, Copy, PartialEq)]
enum Feed {
    CopyIn,
    InPlaceSame,
    InPlaceMoving,
}

fn run_config(
    dev: &Device,
    s: &Stream,
    config: Config,
    dtype: DType,
    dropout: f32,
    reps: u32,
) -> anyhow::Result<RebindRow> {
    let Config { dim: d, batch: b, seq: t, .. } = config;
    let alloc = CachingAllocator::new(dev);
    let mut rng = SmallRng::seed_from_u64(0);
    let mut random = || -> graphed::Result<Tensor> {
        let v: Vec<f32> = (0..b * t * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Tensor::from_f32(&alloc, s, &v, &[b, t, d], dtype)
    };
    let (x0, xa, xb, dy) = (random()?, random()?, random()?, random()?);
    // Twins with the same parameters and dropout masks: one copies its input in, one reads it in
    // place, and their first forwards of `xb` (at the same step of the dropout counter) match.
    let layer = || -> graphed::Result<(ParamStore, TransformerLayer)> {
        let store = ParamStore::with_dtype(&alloc, s, TransformerLayer::parameter_count(d), dtype)?;
        let vb = Builder::new(&store, &alloc, s)?.with_seed(1).with_dropout(dropout, 7).pp("layer");
        let layer = TransformerLayer::new(&vb, config.attention_spec())?;
        Ok((store, layer))
    };
    let (twin, mine) = (layer()?, layer()?);
    let graph = |l: &TransformerLayer| {
        make_graphed_callables(&alloc, &[l as &dyn Callable], &[Inputs::one(&x0)], GraphOptions::default())
    };
    let (copying, g) = (graph(&twin.1)?, graph(&mine.1)?);
    let (copying, g) = (&copying[0], &g[0]);
    let bitwise_equal = output(copying, s, &xb, &dy, false)? == output(g, s, &xb, &dy, true)?;
    let input_in_place = g.in_place_inputs()?[0];
    let bytes = x0.numel() * dtype.size();
    let on_gpu = dev.kind() == DeviceKind::Cuda;
    let (start, end) = (dev.timing_event()?, dev.timing_event()?);
    let mut nodes_rebound = 0;
    let mut time = |feed: Feed| -> anyhow::Result<(f64, Option<f64>)> {
        let (mut host, mut gpu) = (Vec::new(), Vec::new());
        for rep in 0..reps + 3 {
            let x = if feed == Feed::InPlaceMoving && rep % 2 == 1 { &xb } else { &xa };
            s.synchronize()?;
            s.record(&start)?;
            let issued = Instant::now();
            let (_y, _tail) = match feed {
                Feed::CopyIn => copying.forward(s, &Inputs::one(x), Replay::caller())?,
                _ => g.forward_in_place(s, &Inputs::one(x), Replay::caller())?,
            };
            let h = issued.elapsed().as_secs_f64() * 1e6;
            s.record(&end)?;
            if feed == Feed::InPlaceMoving && rep >= 1 {
                nodes_rebound = nodes_rebound.max(g.rebound_nodes());
            }
            let replayed = if feed == Feed::CopyIn { copying } else { g };
            let (_dx, _tail) = replayed.backward(s, &[&dy])?;
            end.synchronize()?;
            if rep >= 3 {
                host.push(h);
                if on_gpu {
                    gpu.push(f64::from(start.elapsed_ms(&end)?) * 1e3);
                }
            }
        }
        Ok((median(host), (!gpu.is_empty()).then(|| median(gpu))))
    };
    let (copy_in_host_us, copy_in_gpu_us) = time(Feed::CopyIn)?;
    let (in_place_same_host_us, in_place_gpu_us) = time(Feed::InPlaceSame)?;
    let (in_place_moving_host_us, _) = time(Feed::InPlaceMoving)?;
    let host_us_per_node =
        (nodes_rebound > 0).then(|| (in_place_moving_host_us - in_place_same_host_us) / nodes_rebound as f64);
    let rebind_call_us_per_node = match input_in_place {
        true => Some(rebind_call_us(g, (&xa, &xb), reps)?),
        false => None,
    };
    Ok(RebindRow {
        config: config.name,
        dtype: dtype.to_string(),
        dropout,
        input_in_place,
        copy_in_bytes: bytes,
        in_place_bytes: if input_in_place { 0 } else { bytes },
        copy_in_host_us,
        in_place_same_host_us,
        in_place_moving_host_us,
        nodes_rebound,
        host_us_per_node,
        rebind_call_us_per_node,
        copy_in_gpu_us,
        in_place_gpu_us,
        bitwise_equal,
    })
}

/// Host µs per node moved of [`GraphExec::rebind`](graphed::device::GraphExec::rebind) alone:
/// the forward graph instantiated once more, its static input rebound to `a` and `b` in turn,
/// nothing launched (the median of `reps` calls).
fn rebind_call_us(g: &GraphedCallable, (a, b): (&Tensor, &Tensor), reps: u32) -> anyhow::Result<f64> {
    let graphs = g.graphs();
    let Some((_, graph)) = graphs.iter().find(|(p, _)| *p == Pass::Forward) else {
        anyhow::bail!("the layer has no forward graph")
    };
    let (us, nodes) = time_rebinds(&graph.instantiate()?, g.static_inputs()?[0], (a, b), reps)?;
    anyhow::ensure!(nodes > 0, "the rebind moved no node");
    Ok(us / nodes as f64)
}

/// The median host µs of `exec.rebind` moving `x` to `a` and `b` in turn (`reps` calls after
/// three untimed ones), nothing launched; and the nodes a call moved.
fn time_rebinds(exec: &GraphExec, x: &Tensor, (a, b): (&Tensor, &Tensor), reps: u32) -> anyhow::Result<(f64, usize)> {
    let (mut us, mut nodes) = (Vec::new(), 0);
    for rep in 0..reps + 3 {
        let to = if rep % 2 == 0 { a } else { b };
        let issued = Instant::now();
        nodes = exec.rebind(&[x.rebind_to(to)?])?;
        let elapsed = issued.elapsed().as_secs_f64() * 1e6;
        if rep >= 3 {
            us.push(elapsed);
        }
    }
    Ok((median(us), nodes))
}

/// The forward's output for `x`, copied in or read in place (exactly, as f32), with the backward
/// of `dy` replayed after it to keep the pool's order.
fn output(g: &GraphedCallable, s: &Stream, x: &Tensor, dy: &Tensor, in_place: bool) -> anyhow::Result<Vec<f32>> {
    let (y, _tail) = match in_place {
        true => g.forward_in_place(s, &Inputs::one(x), Replay::caller())?,
        false => g.forward(s, &Inputs::one(x), Replay::caller())?,
    };
    let out = y[0].get()?.to_f32_vec(s)?;
    let (_dx, _tail) = g.backward(s, &[dy])?;
    Ok(out)
}
