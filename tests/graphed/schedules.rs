//! Pipeline schedules: one graph per (layer, microbatch), captured and replayed in the
//! schedule's order, against the same schedule run eagerly, bit for bit; the refusals.

use std::sync::{Arc, Mutex};

use anyhow::ensure;
use graphed::device::{DType, Device};
use graphed::graph::{
    make_graphed_callables, make_graphed_schedule, Callable, GraphOptions, GraphedCallable, GraphedErrorKind, Replay,
    StaticTensor,
};
use graphed::nn::{
    run_schedule, Builder, Chunk, EagerPasses, Handed, Inputs, KeepOnDevice, Linear, ParamStore, SaveHook, Schedule,
    ScheduleErrorKind, SchedulePasses, Step,
};
use graphed::tensor::Tensor;

use super::fixtures::{Model, Result, SHAPE};

/// Runs `schedule` through `passes` on microbatch j's input and upstream gradient from
/// `data(j)` (reshaped by `shape`), the model's dropout step counter advanced per forward step;
/// returns each microbatch's output and input gradient.
fn drive<P: SchedulePasses>(
    model: &Model,
    schedule: &Schedule,
    layers_per_chunk: &[usize],
    passes: &mut P,
    shape: &dyn Fn(Tensor) -> graphed::Result<Tensor>,
) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
    let m = schedule.microbatches();
    let data = (0..m).map(|j| model.data(j as u64)).collect::<Result<Vec<_>>>()?;
    let inputs = data.iter().map(|(x, _)| shape(x.clone())).collect::<graphed::Result<Vec<_>>>()?;
    let mut outputs = vec![Vec::new(); m];
    let mut head = |j: usize, y: P::Out| -> graphed::Result<Tensor> {
        outputs[j] = y.tensor()?.to_f32_vec(&model.s)?;
        shape(data[j].1.clone())
    };
    let dx = run_schedule(passes, schedule, layers_per_chunk, &inputs, Some(&model.step), &mut head)?;
    let dx = dx.iter().map(|d| d.tensor()?.to_f32_vec(&model.s)).collect::<graphed::Result<Vec<_>>>()?;
    Ok(outputs.into_iter().zip(dx).collect())
}

/// Twin models: the schedule eagerly and graphed (with and without buffer reuse), two steps,
/// everything equal bit for bit; returns the static bytes without and with reuse.
fn scheduled_twins(dev: &Device, schedule: &Schedule, dtype: DType) -> Result<(usize, usize)> {
    let without = scheduled_twin(dev, schedule, dtype, false)?;
    let with = scheduled_twin(dev, schedule, dtype, true)?;
    ensure!(with <= without, "{schedule}: reuse made {with} static bytes from {without}");
    Ok((without, with))
}

fn scheduled_twin(dev: &Device, schedule: &Schedule, dtype: DType, reuse: bool) -> Result<usize> {
    let eager = Model::with_dtype(dev, dtype)?;
    let graphed = Model::with_dtype(dev, dtype)?;
    let per_chunk = vec![graphed.layers().len() / schedule.chunks(); schedule.chunks()];
    let m = schedule.microbatches();
    let samples: Vec<Inputs> =
        (0..graphed.layers().len() * m).map(|i| Ok(Inputs::one(&graphed.data(i as u64)?.0))).collect::<Result<_>>()?;
    let options = GraphOptions::default().reuse_buffers(reuse);
    let g = make_graphed_schedule(&graphed.alloc, &graphed.callables(), schedule, &samples, options)?;
    ensure!(g.callables().len() == graphed.layers().len() * m, "one graphed callable per (layer, microbatch)");
    for step in 0..2 {
        let same = |t: Tensor| Ok(t);
        let passes = EagerPasses::new(eager.layers(), &KeepOnDevice, &eager.s);
        let want = drive(&eager, schedule, &per_chunk, &mut { passes }, &same)?;
        let got = drive(&graphed, schedule, &per_chunk, &mut g.passes(&graphed.s), &same)?;
        ensure!(got == want, "step {step} of {schedule}: outputs or input gradients differ");
        ensure!(graphed.grads()? == eager.grads()?, "step {step} of {schedule}: parameter gradients differ");
        eager.optimizer_step()?;
        graphed.optimizer_step()?;
    }
    Ok(graphed::graph::static_bytes(g.callables()))
}

/// All forwards before any backward: every input is in use at once, so nothing is shared but the
/// output gradients (one backward at a time).
pub fn all_forward_then_backward_matches_eager(dev: &Device) -> Result {
    let (without, with) = scheduled_twins(dev, &Schedule::all_forward_then_backward(2, 3)?, DType::F32)?;
    // 2 layers × 3 microbatches; inputs and output gradients of one [2, 4, 32] f32 tensor each.
    let each = SHAPE.iter().product::<usize>() * 4;
    ensure!(without == 12 * each && with == 6 * each + 2 * each, "static bytes {without} without reuse, {with} with");
    Ok(())
}

/// Interleaved 1F1B on one rank (v = 2): a microbatch's buffers are reused by a later one.
pub fn interleaved_1f1b_matches_eager(dev: &Device) -> Result {
    let (without, with) = scheduled_twins(dev, &Schedule::interleaved_1f1b(1, 0, 2, 4)?, DType::F32)?;
    ensure!(with < without, "interleaved 1F1B shares buffers: {with} of {without} bytes");
    scheduled_twins(dev, &Schedule::interleaved_1f1b(2, 0, 2, 4)?, DType::BF16)?;
    Ok(())
}

pub fn one_f_one_b_matches_eager(dev: &Device) -> Result {
    scheduled_twins(dev, &Schedule::interleaved_1f1b(2, 0, 1, 3)?, DType::BF16)?;
    Ok(())
}

pub fn transformer_engine_order_matches_eager(dev: &Device) -> Result {
    let order = [1.0, 2.0, 1.0, 2.0, -2.0, -1.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0];
    scheduled_twins(dev, &Schedule::from_te_order(&order)?, DType::F32)?;
    Ok(())
}

/// Two Linear layers in one chunk, the first splitting its weight gradients out when `split.0`,
/// the second when `split.1`, their parameters in `store`.
fn linears(model: &Model, store: &ParamStore, split: (bool, bool)) -> Result<Vec<Linear>> {
    let vb = Builder::new(store, &model.alloc, &model.s)?;
    let mut layers = Vec::new();
    for (i, split) in [split.0, split.1].into_iter().enumerate() {
        let mut lin = Linear::new(&vb.pp(&format!("zb{i}")).with_seed(40 + i as u64), (SHAPE[2], SHAPE[2]))?;
        lin.set_split_dw(split);
        layers.push(lin);
    }
    Ok(layers)
}

/// Zero bubble: a chunk of a Linear layer with split weight gradients and one without, whose
/// weight-gradient graphs are captured and replayed where the schedule puts them (the other's
/// weight-gradient steps run nothing).
pub fn zero_bubble_with_split_weight_grads_matches_eager(dev: &Device) -> Result {
    let schedule = Schedule::zero_bubble(2, 0, 4)?;
    let model = Model::new(dev)?;
    let count = 2 * Linear::parameter_count((SHAPE[2], SHAPE[2]));
    let eager_store = ParamStore::new(&model.alloc, &model.s, count)?;
    let graphed_store = ParamStore::new(&model.alloc, &model.s, count)?;
    let eager = linears(&model, &eager_store, (true, false))?;
    let graphed = linears(&model, &graphed_store, (true, false))?;
    let rows = [SHAPE[0] * SHAPE[1], SHAPE[2]];
    let samples: Vec<Inputs> =
        (0..8).map(|i| Ok(Inputs::one(&model.data(i)?.0.reshape(&rows)?))).collect::<Result<_>>()?;
    let callables: Vec<&dyn Callable> = graphed.iter().map(|l| l as &dyn Callable).collect();
    // Buffer reuse on: an output gradient is in use until the weight-gradient pass reads it.
    let options = GraphOptions::default().reuse_buffers(true);
    let g = make_graphed_schedule(&model.alloc, &callables, &schedule, &samples, options)?;
    let reshaped = |t: Tensor| t.reshape(&rows);
    let want = drive(&model, &schedule, &[2], &mut EagerPasses::new(&eager, &KeepOnDevice, &model.s), &reshaped)?;
    let got = drive(&model, &schedule, &[2], &mut g.passes(&model.s), &reshaped)?;
    ensure!(got == want, "zero bubble: outputs or input gradients differ");
    ensure!(
        eager_store.grads()?.to_f32_vec(&model.s)? == graphed_store.grads()?.to_f32_vec(&model.s)?,
        "zero bubble: parameter gradients differ"
    );
    Ok(())
}

/// A layer that splits its weight gradients out, under a schedule without weight-gradient steps,
/// is refused before anything runs, graphed and eagerly: nothing would run its weight gradients.
pub fn split_weight_grads_without_their_steps_are_refused(dev: &Device) -> Result {
    let schedule = Schedule::interleaved_1f1b(1, 0, 1, 2)?;
    let model = Model::new(dev)?;
    let store = ParamStore::new(&model.alloc, &model.s, 2 * Linear::parameter_count((SHAPE[2], SHAPE[2])))?;
    let layers = linears(&model, &store, (false, true))?;
    let unrun = |e: Option<graphed::Error>| {
        matches!(e, Some(graphed::Error::Schedule(ScheduleErrorKind::UnrunWeightGrads { layer: 1, chunk: 0 })))
    };
    let rows = [SHAPE[0] * SHAPE[1], SHAPE[2]];
    let samples: Vec<Inputs> =
        (0..4).map(|i| Ok(Inputs::one(&model.data(i)?.0.reshape(&rows)?))).collect::<Result<_>>()?;
    let callables: Vec<&dyn Callable> = layers.iter().map(|l| l as &dyn Callable).collect();
    let order = model.alloc.new_pool();
    let options = GraphOptions::default().schedule(&schedule).pool(&order);
    let r = make_graphed_callables(&model.alloc, &callables, &samples, options);
    ensure!(unrun(r.err()), "graphed: UnrunWeightGrads for layer 1");
    ensure!(order.order().is_empty(), "nothing was captured");
    let inputs = (0..2).map(|j| model.data(j)?.0.reshape(&rows).map_err(Into::into)).collect::<Result<Vec<_>>>()?;
    let mut heads = 0;
    let mut head = |_: usize, y: Tensor| -> graphed::Result<Tensor> {
        heads += 1;
        Ok(y)
    };
    let mut passes = EagerPasses::new(&layers, &KeepOnDevice, &model.s);
    ensure!(unrun(run_schedule(&mut passes, &schedule, &[2], &inputs, None, &mut head).err()), "eager");
    ensure!(heads == 0, "no forward reached the head");
    ensure!(store.grads()?.to_f32_vec(&model.s)?.iter().all(|g| *g == 0.0), "no gradient was accumulated");
    Ok(())
}

/// A replay out of the schedule's order is refused, naming the graph expected.
pub fn out_of_schedule_replay_is_refused(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let schedule = Schedule::interleaved_1f1b(1, 0, 2, 2)?;
    let samples: Vec<Inputs> = (0..4).map(|i| Ok(Inputs::one(&model.data(i)?.0))).collect::<Result<_>>()?;
    let g = make_graphed_callables(
        &model.alloc,
        &model.callables(),
        &samples,
        GraphOptions::default().schedule(&schedule),
    )?;
    // The schedule starts with chunk 0's forward of microbatch 0 (instance 0); chunk 1's (instance 2) is refused.
    let (x, _) = model.data(0)?;
    match g[2].forward(&model.s, &Inputs::one(&x), Replay::caller()) {
        Err(e) if matches!(e.refused_by(), Some(graphed::Error::PoolOrder { .. })) => {}
        other => anyhow::bail!("expected PoolOrder, got {:?}", other.map(|_| ())),
    }
    let _tail = g[0].forward(&model.s, &Inputs::one(&x), Replay::caller())?;
    Ok(())
}

/// Samples or layers that do not fit the schedule are refused before anything runs.
pub fn schedule_shapes_are_checked(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let schedule = Schedule::all_forward_then_backward(2, 2)?;
    let (x, _) = model.data(0)?;
    let shape = |r: graphed::Result<Vec<GraphedCallable>>, want: fn(&GraphedErrorKind) -> bool| {
        r.map(|_| ()).err().is_some_and(|e| e.graphed_kind().is_some_and(want))
    };
    let three: Vec<Inputs> = (0..3).map(|_| Inputs::one(&x)).collect();
    let options = || GraphOptions::default().schedule(&schedule);
    ensure!(
        shape(make_graphed_callables(&model.alloc, &model.callables(), &three, options()), |k| matches!(
            k,
            GraphedErrorKind::ScheduleSamples { samples: 3, callables: 2, microbatches: 2 }
        )),
        "3 samples for 2 layers × 2 microbatches"
    );
    let four: Vec<Inputs> = (0..4).map(|_| Inputs::one(&x)).collect();
    ensure!(
        shape(
            make_graphed_callables(&model.alloc, &model.callables(), &four, options().layers_per_chunk(&[2, 0])),
            |k| matches!(k, GraphedErrorKind::LayersPerChunk { chunks: 2, callables: 2, .. })
        ),
        "an empty chunk"
    );
    ensure!(
        shape(make_graphed_callables(&model.alloc, &model.callables()[..1], &four[..2], options()), |k| matches!(
            k,
            GraphedErrorKind::UnevenChunks { callables: 1, chunks: 2 }
        )),
        "1 layer into 2 chunks"
    );
    let (x0, _) = model.data(0)?;
    let stack = graphed::graph::make_graphed_stack(&model.alloc, &model.stack, &x0, options());
    ensure!(
        shape(stack.map(|_| Vec::new()), |k| matches!(k, GraphedErrorKind::ScheduleForStack)),
        "a stack with a schedule"
    );
    // A weight-gradient step for layers that split none out is refused before any capture.
    let w = Schedule::from_te_order(&[1.0, -1.0, -1.5])?;
    let order = model.alloc.new_pool();
    let r = make_graphed_callables(
        &model.alloc,
        &model.callables(),
        &four[..2],
        GraphOptions::default().schedule(&w).pool(&order),
    );
    ensure!(
        matches!(r.map(|_| ()).err(), Some(graphed::Error::Schedule(ScheduleErrorKind::NothingToSplit { chunk: 0 }))),
        "NothingToSplit"
    );
    ensure!(order.order().is_empty(), "nothing was captured");
    // A schedule runs backwards: inference is refused.
    let r = make_graphed_callables(&model.alloc, &model.callables(), &four, options().inference());
    ensure!(shape(r, |k| matches!(k, GraphedErrorKind::ScheduleInInference)), "a schedule in inference");
    Ok(())
}

/// A count shared between a hook and the test.
type Counter = Arc<Mutex<usize>>;

/// A save hook that counts its forwards.
struct Counting(Counter);

impl SaveHook for Counting {
    fn begin_forward(&self, _s: &graphed::device::Stream) -> graphed::Result<()> {
        *self.0.lock().unwrap() += 1;
        Ok(())
    }
}

/// The chunk handler is called once per chunk, in the order the schedule first runs each, and
/// each chunk's graphs are captured with its hook.
pub fn chunk_handler_runs_once_per_chunk_in_schedule_order(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let schedule = Schedule::interleaved_1f1b(1, 0, 2, 2)?;
    let samples: Vec<Inputs> = (0..4).map(|i| Ok(Inputs::one(&model.data(i)?.0))).collect::<Result<_>>()?;
    let calls: Arc<Mutex<Vec<(Chunk, Counter)>>> = Arc::default();
    let seen = calls.clone();
    let options = GraphOptions::default().schedule(&schedule).init_chunk_handler(move |chunk| {
        let count = Arc::new(Mutex::new(0));
        seen.lock().unwrap().push((chunk, count.clone()));
        Ok(Arc::new(Counting(count)) as Arc<dyn SaveHook>)
    });
    make_graphed_callables(&model.alloc, &model.callables(), &samples, options)?;
    let calls = calls.lock().unwrap();
    let order: Vec<(usize, usize)> = calls.iter().map(|(c, _)| (c.stage, c.microbatch)).collect();
    let first_forwards: Vec<(usize, usize)> = (schedule.with_microbatches().into_iter())
        .filter_map(|(s, j)| if let Step::Forward(k) = s { Some((k, j)) } else { None })
        .collect();
    ensure!(order == first_forwards, "chunks {order:?}, schedule's forwards {first_forwards:?}");
    // Each chunk's hook saw its layer's warmup forwards and its one captured forward.
    let counts: Vec<usize> = calls.iter().map(|(_, n)| *n.lock().unwrap()).collect();
    ensure!(counts.iter().all(|n| *n == counts[0] && *n > 1), "forwards per chunk hook: {counts:?}");
    Ok(())
}

/// A schedule hands out static tensors as a stack does: the head's outputs and the input
/// gradients a step returns refuse to be read once the next step's replays overwrote them
/// (`StaleOutput`), and a copy made before keeps its values.
pub fn schedule_outputs_refuse_stale_reads(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let schedule = Schedule::interleaved_1f1b(1, 0, 2, 2)?;
    let samples: Vec<Inputs> = (0..4).map(|i| Ok(Inputs::one(&model.data(i)?.0))).collect::<Result<_>>()?;
    let g = make_graphed_schedule(&model.alloc, &model.callables(), &schedule, &samples, GraphOptions::default())?;
    let data = (0..2).map(|j| model.data(j)).collect::<Result<Vec<_>>>()?;
    let inputs: Vec<Tensor> = data.iter().map(|(x, _)| x.clone()).collect();
    let step = |kept: &mut Vec<StaticTensor>| -> Result<Vec<StaticTensor>> {
        let mut head = |j: usize, y: StaticTensor| -> graphed::Result<Tensor> {
            kept.push(y);
            Ok(data[j].1.clone())
        };
        Ok(g.run(&model.s, &inputs, Some(&model.step), &mut head)?)
    };
    let mut ys = Vec::new();
    let dxs = step(&mut ys)?;
    ensure!(ys.len() == 2 && ys.iter().chain(&dxs).all(StaticTensor::is_fresh), "fresh after their own step");
    let want = dxs[0].get()?.to_f32_vec(&model.s)?;
    let copy = dxs[0].to_owned(&model.alloc, &model.s)?;
    step(&mut Vec::new())?;
    for t in ys.iter().chain(&dxs) {
        super::api::expect_kind(t.get(), |k| matches!(k, GraphedErrorKind::StaleOutput { .. }))?;
    }
    ensure!(copy.to_f32_vec(&model.s)? == want, "the copy kept the first step's input gradient");
    Ok(())
}
