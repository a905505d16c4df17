//! Static outputs shared between microbatches under a schedule with buffer reuse: the pool's
//! peak drops by the bytes of the outputs and input gradients read only inside their chunk,
//! results stay bit for bit those without reuse, and reads that the sharing makes stale are
//! refused, naming the graph that overwrote them.

use anyhow::ensure;
use graphed::device::{AccessMode, DType, Device, Stream};
use graphed::graph::{
    make_graphed_callables, make_graphed_schedule, Callable, GraphOptions, GraphedErrorKind, GraphedSchedule, Replay,
    StaticTensor,
};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Inputs, Linear, Module, Param, ParamStore, SaveHook, Schedule};
use graphed::ops::cast::residual_add;
use graphed::ops::elementwise;
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;

use super::api::expect_kind;
use super::fixtures::{lcg, Model, Result, SHAPE};

/// The chain's activations: the fixture's data as rows of its width.
const ROWS: [usize; 2] = [SHAPE[0] * SHAPE[1], SHAPE[2]];

/// Linear layers of one width, without dropout: every output and input gradient has the bytes of
/// one activation, so the pool's peak can be computed from the shapes.
struct Chain {
    store: ParamStore,
    layers: Vec<Linear>,
    optimizer: AdamW,
}

impl Chain {
    /// `n` layers with the same parameters on every call.
    fn new(model: &Model, n: usize) -> Result<Chain> {
        let store = ParamStore::new(&model.alloc, &model.s, n * Linear::parameter_count((ROWS[1], ROWS[1])))?;
        let vb = Builder::new(&store, &model.alloc, &model.s)?;
        let layers = (0..n)
            .map(|i| Ok(Linear::new(&vb.pp(&format!("c{i}")).with_seed(60 + i as u64), (ROWS[1], ROWS[1]))?))
            .collect::<Result<_>>()?;
        let optimizer = AdamW::new(&model.alloc, &store, AdamWHyper::default(), LrSchedule::Constant(1e-2), &model.s)?;
        Ok(Chain { store, layers, optimizer })
    }

    /// Its layers captured for `schedule` over chunks of `per_chunk` layers, with or without
    /// buffer reuse.
    fn graph(&self, model: &Model, schedule: &Schedule, per_chunk: &[usize], reuse: bool) -> Result<GraphedSchedule> {
        let n = self.layers.len() * schedule.microbatches();
        let samples: Vec<Inputs> =
            (0..n).map(|i| Ok(Inputs::one(&model.data(i as u64)?.0.reshape(&ROWS)?))).collect::<Result<_>>()?;
        let callables: Vec<&dyn Callable> = self.layers.iter().map(|l| l as &dyn Callable).collect();
        let options = GraphOptions::default().reuse_buffers(reuse).layers_per_chunk(per_chunk);
        Ok(make_graphed_schedule(&model.alloc, &callables, schedule, &samples, options)?)
    }
}

/// One step of `g`: microbatch j's input is the fixture's data `10 · step + j`, its loss the mean
/// square of the last layer's output, whose gradient the head returns. Returns each
/// microbatch's loss and input gradient.
fn step(model: &Model, g: &GraphedSchedule, step: u64) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let m = g.schedule().microbatches();
    let inputs =
        (0..m).map(|j| Ok(model.data(10 * step + j as u64)?.0.reshape(&ROWS)?)).collect::<Result<Vec<Tensor>>>()?;
    let mut losses = vec![0.0; m];
    let mut head = |j: usize, y: StaticTensor| -> graphed::Result<Tensor> {
        let y = y.get()?.to_f32_vec(&model.s)?;
        let n = y.len() as f32;
        losses[j] = y.iter().map(|v| v * v).sum::<f32>() / n;
        let dy: Vec<f32> = y.iter().map(|v| 2.0 * v / n).collect();
        Tensor::from_f32(&model.alloc, &model.s, &dy, &ROWS, DType::F32)
    };
    let dxs = g.run(&model.s, &inputs, None, &mut head)?;
    let dxs = dxs.iter().map(|d| d.get()?.to_f32_vec(&model.s)).collect::<graphed::Result<_>>()?;
    Ok((losses, dxs))
}

/// The schedules the tests share, each with its layers per chunk: 1F1B (one chunk of three
/// layers, microbatches in flight at once), all forwards first (one chunk of three) and
/// interleaved 1F1B (two chunks of two).
fn schedules() -> Result<Vec<(Schedule, Vec<usize>)>> {
    Ok(vec![
        (Schedule::interleaved_1f1b(2, 0, 1, 4)?, vec![3]),
        (Schedule::all_forward_then_backward(1, 3)?, vec![3]),
        (Schedule::interleaved_1f1b(2, 0, 2, 4)?, vec![2, 2]),
    ])
}

/// With reuse, the pool's peak is lower than without by exactly the shared bytes: per chunk and
/// microbatch, the outputs of every layer but the chunk's last and the input gradients of every
/// layer but its first, one activation each (layers of one width). Which ones are shared shows
/// in the callables' reports.
pub fn shared_outputs_lower_the_pool_peak_by_their_bytes(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let activation = ROWS.iter().product::<usize>() * 4;
    for (schedule, per_chunk) in schedules()? {
        let n: usize = per_chunk.iter().sum();
        let (a, b) = (Chain::new(&model, n)?, Chain::new(&model, n)?);
        let without = a.graph(&model, &schedule, &per_chunk, false)?;
        let with = b.graph(&model, &schedule, &per_chunk, true)?;
        let peak = |g: &GraphedSchedule| g.callables()[0].pool().stats().peak_allocated;
        let m = schedule.microbatches();
        let shared = 2 * per_chunk.iter().map(|k| k - 1).sum::<usize>() * m;
        let (peak_without, peak_with) = (peak(&without), peak(&with));
        ensure!(
            peak_without - peak_with == shared * activation,
            "{schedule}: pool peak {peak_without} without reuse, {peak_with} with; expected {shared} activations of {activation} bytes less"
        );
        for (g, reuse) in [(&without, false), (&with, true)] {
            for (c, callable) in g.callables().iter().enumerate() {
                let report = callable.report()?;
                let (layer, j) = layer_of(&schedule, &per_chunk, c);
                let (first, last) = chunk_ends(&per_chunk, layer);
                let want = (reuse && layer != last, reuse && layer != first);
                ensure!(
                    (report.shared_outputs[..] == [want.0] && report.shared_grad_inputs[..] == [want.1]),
                    "{schedule}: layer {layer}, microbatch {j} (reuse {reuse}) shares {:?} and {:?}, expected {want:?}",
                    report.shared_outputs,
                    report.shared_grad_inputs
                );
            }
        }
    }
    Ok(())
}

/// Callable `c`'s (layer, microbatch) among one per pair, chunk by chunk, microbatch by
/// microbatch, layer by layer.
fn layer_of(schedule: &Schedule, per_chunk: &[usize], c: usize) -> (usize, usize) {
    let m = schedule.microbatches();
    let mut first = 0;
    for &n in per_chunk {
        if c < (first + n) * m {
            let k = c - first * m;
            return (first + k % n, k / n);
        }
        first += n;
    }
    unreachable!("callable {c} beyond the chunks {per_chunk:?}")
}

/// The first and last layer of `layer`'s chunk.
fn chunk_ends(per_chunk: &[usize], layer: usize) -> (usize, usize) {
    let mut first = 0;
    for &n in per_chunk {
        if layer < first + n {
            return (first, first + n - 1);
        }
        first += n;
    }
    unreachable!("layer {layer} beyond the chunks {per_chunk:?}")
}

/// A scheduled run with reuse gives the losses, input gradients, parameter gradients and
/// parameters of the run without, bit for bit, over two optimizer steps.
pub fn shared_outputs_change_no_result(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    for (schedule, per_chunk) in schedules()? {
        let n: usize = per_chunk.iter().sum();
        let (a, b) = (Chain::new(&model, n)?, Chain::new(&model, n)?);
        let without = a.graph(&model, &schedule, &per_chunk, false)?;
        let with = b.graph(&model, &schedule, &per_chunk, true)?;
        for s in 0..2 {
            let (want, got) = (step(&model, &without, s)?, step(&model, &with, s)?);
            ensure!(got == want, "{schedule}, step {s}: losses or input gradients differ with reuse");
            let grads = |c: &Chain| c.store.grads().and_then(|g| g.to_f32_vec(&model.s));
            ensure!(grads(&b)? == grads(&a)?, "{schedule}, step {s}: parameter gradients differ with reuse");
            a.optimizer.step(&model.s)?;
            b.optimizer.step(&model.s)?;
        }
        let params = |c: &Chain| c.store.values().and_then(|v| v.to_f32_vec(&model.s));
        ensure!(params(&b)? == params(&a)?, "{schedule}: parameters differ with reuse after two steps");
    }
    Ok(())
}

/// A layer's output shared with the next layer of its chunk is valid until that layer's forward
/// replays over its memory: a read after it is refused with `StaleOutput` naming that graph,
/// with the pool's order check on or off, and a replay of the next layer before the first is
/// refused by the pool's order (`PoolOrder`, naming both graphs). Released, a shared output
/// refuses reads (`OutputReleased`); an output the callable owns keeps its values.
pub fn stale_reads_of_shared_outputs_are_refused(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let schedule = Schedule::all_forward_then_backward(1, 2)?;
    let x = model.data(0)?.0.reshape(&ROWS)?;
    for guarded in [true, false] {
        let chain = Chain::new(&model, 2)?;
        let mut g = chain.graph(&model, &schedule, &[2], true)?;
        // Layers 0 and 1 of microbatch 0, then of microbatch 1.
        let c = g.callables();
        if guarded {
            match c[1].forward(&model.s, &Inputs::one(&x), Replay::caller()) {
                Err(e) if matches!(e.refused_by(), Some(graphed::Error::PoolOrder { .. })) => {
                    let text = e.to_string();
                    ensure!(text.contains(c[0].name()) && text.contains(c[1].name()), "PoolOrder names both: {text}");
                }
                other => anyhow::bail!("expected PoolOrder, got {:?}", other.map(|_| ())),
            }
        } else {
            c[0].pool().disable_order_check();
        }
        let (y, _tail) = c[0].forward(&model.s, &Inputs::one(&x), Replay::caller())?;
        ensure!(c[0].report()?.shared_outputs == [true], "layer 0's output is shared");
        // The next graph of the pool's order: layer 1's forward, whose output takes that memory.
        let (_, _tail) = c[1].forward(&model.s, &Inputs::one(y[0].get()?), Replay::caller())?;
        let text = match y[0].get() {
            Err(e) if e.graphed_kind().is_some_and(|k| matches!(k, GraphedErrorKind::StaleOutput { .. })) => {
                e.to_string()
            }
            other => anyhow::bail!("order check {guarded}: expected StaleOutput, got {:?}", other.map(|_| ())),
        };
        ensure!(text.contains(&format!("{} Forward", c[1].name())), "names the graph that overwrote it: {text}");
        ensure!(!y[0].is_fresh(), "a stale shared output reads as fresh");
        if guarded {
            let (y, _tail) = c[2].forward(&model.s, &Inputs::one(&x), Replay::caller())?;
            let (last, _tail) = c[3].forward(&model.s, &Inputs::one(y[0].get()?), Replay::caller())?;
            let want = last[0].get()?.to_f32_vec(&model.s)?;
            g.release_static_state()?;
            expect_kind(y[0].get(), |k| matches!(k, GraphedErrorKind::OutputReleased { .. }))?;
            ensure!(last[0].get()?.to_f32_vec(&model.s)? == want, "an owned output keeps its values after release");
        }
    }
    Ok(())
}

/// Flat tensors of `2 · HALF` or `HALF` elements: `y = 2 · x[..HALF]` when `halves`, else
/// `y = (2 · x, 2 · x)`. Halving keeps one more tensor of `HALF` elements for its backward,
/// allocated after its output, so that the output's memory, once shared, is not at the pool's
/// free end: the layers' sizes then leave it free when the capture ends.
struct Halve {
    alloc: CachingAllocator,
    halves: bool,
}

/// Elements of a [`Halve`]'s narrow side.
const HALF: usize = 256;

impl Module for Halve {
    type Ctx = Option<Tensor>;

    fn forward(&self, inputs: &Inputs, _hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, Self::Ctx)> {
        let x = &inputs.iter().next().expect("one input").tensor;
        if self.halves {
            let y = Tensor::uninit(&self.alloc, s, &[HALF], DType::F32)?;
            elementwise::scale(y.view::<f32>()?, x.narrow(0, 0, HALF)?.view::<f32>()?, 2.0, s)?;
            let kept = Tensor::zeros(&self.alloc, s, &[HALF], DType::F32)?;
            return Ok((vec![y], Some(kept)));
        }
        let y = Tensor::uninit(&self.alloc, s, &[2 * HALF], DType::F32)?;
        for k in 0..2 {
            elementwise::scale(y.narrow(0, k * HALF, HALF)?.view::<f32>()?, x.view::<f32>()?, 2.0, s)?;
        }
        Ok((vec![y], None))
    }

    fn backward(&self, _kept: Self::Ctx, dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        let dy = dys[0];
        if self.halves {
            let dx = Tensor::zeros(&self.alloc, s, &[2 * HALF], DType::F32)?;
            elementwise::scale(dx.narrow(0, 0, HALF)?.view::<f32>()?, dy.view::<f32>()?, 2.0, s)?;
            return Ok(vec![Some(dx)]);
        }
        let dx = Tensor::uninit(&self.alloc, s, &[HALF], DType::F32)?;
        residual_add(&dx, &dy.narrow(0, 0, HALF)?, &dy.narrow(0, HALF, HALF)?, s)?;
        Ok(vec![Some(dx)])
    }

    fn parameters(&self) -> Vec<&Param> {
        Vec::new()
    }

    fn set_training(&mut self, _training: bool) {}
}

/// A graph captured into the pool after the schedule may be given the memory of a shared output
/// that the schedule's graphs left free: it counts as a writer, so a read after its replay is
/// refused (`StaleOutput`, naming it) even though no checker summary of the schedule's capture
/// names it.
pub fn later_captures_into_the_pool_count_as_writers_of_shared_outputs(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let halve = |halves| Halve { alloc: model.alloc.clone(), halves };
    let layers = [halve(true), halve(false)];
    let callables: Vec<&dyn Callable> = layers.iter().map(|l| l as &dyn Callable).collect();
    let x = Tensor::from_f32(&model.alloc, &model.s, &lcg(2 * HALF, 3), &[2 * HALF], DType::F32)?;
    let h = Tensor::zeros(&model.alloc, &model.s, &[HALF], DType::F32)?;
    let schedule = Schedule::all_forward_then_backward(1, 1)?;
    let options = GraphOptions::default().reuse_buffers(true);
    let g = make_graphed_schedule(&model.alloc, &callables, &schedule, &[Inputs::one(&x), Inputs::one(&h)], options)?;
    let pool = g.callables()[0].pool().clone();
    let later = halve(true);
    let options = GraphOptions::default().pool(&pool);
    let later = make_graphed_callables(&model.alloc, &[&later as &dyn Callable], &[Inputs::one(&x)], options)?;
    pool.disable_order_check();
    let (y, _tail) = g.callables()[0].forward(&model.s, &Inputs::one(&x), Replay::caller())?;
    let place = |t: &Tensor| t.access(AccessMode::Read).map(|a| (a.memory, a.at));
    let shared_at = place(y[0].get()?)?;
    let (z, _tail) = later[0].forward(&model.s, &Inputs::one(&x), Replay::caller())?;
    ensure!(place(z[0].get()?)? == shared_at, "the later capture was given the shared output's memory");
    let text = match y[0].get() {
        Err(e) if e.graphed_kind().is_some_and(|k| matches!(k, GraphedErrorKind::StaleOutput { .. })) => e.to_string(),
        other => anyhow::bail!("expected StaleOutput, got {:?}", other.map(|_| ())),
    };
    ensure!(text.contains(&format!("{} Forward", later[0].name())), "names the later graph: {text}");
    Ok(())
}
