//! The gradient-work protocol (`GraphOptions::grad_sync`) as the capture tells it, for stacks and
//! schedules, with weight gradients whole or split: each callable's gradients are told complete
//! once, in the last captured pass that accumulates them, after that work; every such pass
//! begins the gradient work and no other does; the capture's last such pass finishes it.

use std::sync::{Arc, Mutex};

use anyhow::ensure;
use graphed::device::{BufferId, Device, Stream};
use graphed::graph::{make_graphed_callables, Callable, GradSync, GraphOptions};
use graphed::nn::{Builder, Inputs, Linear, LinearCtx, Module, Param, ParamStore, SaveHook, Schedule};
use graphed::tensor::Tensor;
use proptest::prelude::*;

use super::fixtures::{Model, Result, SHAPE};

/// What the capture did, in order: a layer's work (`Backward`, `WeightGrad`, logged by the
/// layer itself) and what the gradient work was told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Told {
    Backward(usize),
    WeightGrad(usize),
    Begin,
    Final(usize),
    Complete(usize),
    Finish,
    EndPass,
}

type Log = Arc<Mutex<Vec<Told>>>;

fn push(log: &Log, t: Told) {
    log.lock().expect("log").push(t);
}

/// A linear layer that logs its backward and weight-gradient work.
struct Logged {
    inner: Linear,
    layer: usize,
    log: Log,
}

impl Module for Logged {
    type Ctx = LinearCtx;

    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, LinearCtx)> {
        self.inner.forward(inputs, hook, s)
    }

    fn backward(&self, ctx: LinearCtx, dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        push(&self.log, Told::Backward(self.layer));
        self.inner.backward(ctx, dys, s)
    }

    fn backward_dw(&self, s: &Stream) -> graphed::Result<()> {
        push(&self.log, Told::WeightGrad(self.layer));
        self.inner.backward_dw(s)
    }

    fn splits_dw(&self) -> bool {
        self.inner.splits_dw()
    }

    fn parameters(&self) -> Vec<&Param> {
        self.inner.parameters()
    }

    fn set_training(&mut self, training: bool) {
        self.inner.set_training(training)
    }
}

/// Gradient work that only logs what it is told.
struct Recorder(Log);

impl GradSync for Recorder {
    fn begin_grad_pass(&self, _: &Stream) -> graphed::Result<()> {
        push(&self.0, Told::Begin);
        Ok(())
    }
    fn grads_final(&self, callable: usize, _: &[&Param], _: &Stream) -> graphed::Result<()> {
        push(&self.0, Told::Final(callable));
        Ok(())
    }
    fn grads_complete(&self, callable: usize, _: &Stream) -> graphed::Result<()> {
        push(&self.0, Told::Complete(callable));
        Ok(())
    }
    fn finish(&self, _: &Stream) -> graphed::Result<()> {
        push(&self.0, Told::Finish);
        Ok(())
    }
    fn end_pass(&self, _: &Stream) -> graphed::Result<()> {
        push(&self.0, Told::EndPass);
        Ok(())
    }
    fn tail_memory(&self) -> Vec<BufferId> {
        Vec::new()
    }
    fn abandon(&self) {}
}

/// Stacks and schedules of linear layers (a schedule's layers over its chunks), weight gradients
/// whole or split, each captured with a recorder: the protocol holds in every capture.
pub fn grad_sync_is_told_each_callables_gradients_once_where_complete(dev: &Device) -> Result {
    let cases = [
        ("stack", None, 3, false),
        ("stack, split", None, 3, true),
        ("1F1B", Some(Schedule::interleaved_1f1b(2, 0, 1, 3)?), 2, false),
        ("interleaved", Some(Schedule::interleaved_1f1b(2, 1, 2, 4)?), 2, false),
        ("zero bubble", Some(Schedule::zero_bubble(2, 0, 3)?), 2, true),
    ];
    let model = Model::new(dev)?;
    for (what, schedule, layers, split) in cases {
        capture_follows_protocol(&model, schedule.as_ref(), layers, split)
            .map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
    }
    Ok(())
}

/// `layers` linear layers (weight gradients split out when `split`), captured as a stack or under
/// `schedule` with a recorder: the protocol holds.
fn capture_follows_protocol(model: &Model, schedule: Option<&Schedule>, layers: usize, split: bool) -> Result {
    let (c, rows) = (SHAPE[2], [SHAPE[0] * SHAPE[1], SHAPE[2]]);
    let log: Log = Arc::default();
    let store = ParamStore::new(&model.alloc, &model.s, layers * Linear::parameter_count((c, c)))?;
    let vb = Builder::new(&store, &model.alloc, &model.s)?;
    let mut modules = Vec::new();
    for l in 0..layers {
        let mut inner = Linear::new(&vb.pp(&format!("fc{l}")).with_seed(3 + l as u64), (c, c))?;
        inner.set_split_dw(split);
        modules.push(Logged { inner, layer: l, log: log.clone() });
    }
    let callables: Vec<&dyn Callable> = modules.iter().map(|m| m as &dyn Callable).collect();
    let instances = layers * schedule.map_or(1, Schedule::microbatches);
    let samples: Vec<Inputs> =
        (0..instances).map(|i| Ok(Inputs::one(&model.data(i as u64)?.0.reshape(&rows)?))).collect::<Result<_>>()?;
    let warmed = log.clone();
    let mut options = GraphOptions::default().grad_sync(Arc::new(Recorder(log.clone()))).post_warmup(move |_| {
        warmed.lock().expect("log").clear();
        Ok(())
    });
    if let Some(schedule) = schedule {
        options = options.schedule(schedule);
    }
    make_graphed_callables(&model.alloc, &callables, &samples, options)?;
    let told = log.lock().expect("log").clone();
    follows_protocol(&told, layers).map_err(|e| anyhow::anyhow!("{e}; the capture told {told:?}"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any rank of any interleaved 1F1B schedule (weight gradients whole) or zero-bubble one
    /// (split): the protocol holds (on the simulator).
    #[test]
    fn grad_sync_protocol_holds_under_any_schedule(
        (stages, rank) in (1usize..4).prop_flat_map(|p| (Just(p), 0..p)),
        chunks in 1usize..4,
        rounds in 1usize..3,
        per_chunk in 1usize..3,
        split in proptest::bool::ANY,
    ) {
        let microbatches = stages * rounds;
        // Split weight gradients run in a zero-bubble schedule's weight-gradient steps.
        let (schedule, chunks) = match split {
            true => (Schedule::zero_bubble(stages, rank, microbatches), 1),
            false => (Schedule::interleaved_1f1b(stages, rank, chunks, microbatches), chunks),
        };
        let schedule = schedule.map_err(|e| TestCaseError::fail(e.to_string()))?;
        let model = Model::new(&Device::sim()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let outcome = capture_follows_protocol(&model, Some(&schedule), chunks * per_chunk, split);
        prop_assert!(outcome.is_ok(), "{}: {:?}", schedule, outcome.err());
    }
}

/// The protocol over one capture's log, pass by pass (a pass ends at `EndPass`).
fn follows_protocol(told: &[Told], layers: usize) -> Result {
    let mut passes: Vec<&[Told]> = told.split(|t| *t == Told::EndPass).collect();
    ensure!(passes.pop() == Some(&[][..]), "the log ends with a pass's end");
    let work_of = |l: usize| move |t: &Told| matches!(*t, Told::Backward(x) | Told::WeightGrad(x) if x == l);
    let works = |p: &[Told]| p.iter().any(|t| matches!(t, Told::Backward(_) | Told::WeightGrad(_)));
    let last_work = passes.iter().rposition(|p| works(p));
    for (n, p) in passes.iter().enumerate() {
        ensure!(works(p) == (p.first() == Some(&Told::Begin)), "pass {n} begins the gradient work iff it accumulates");
        ensure!(p.iter().filter(|t| **t == Told::Begin).count() <= 1, "pass {n} begins once");
        for l in 0..layers {
            let last = passes.iter().rposition(|q| q.iter().any(work_of(l)));
            let complete = p.iter().position(|t| *t == Told::Complete(l));
            ensure!(complete.is_some() == (last == Some(n)), "layer {l} is told complete in pass {n} iff its last");
            ensure!(p.iter().filter(|t| **t == Told::Complete(l)).count() <= 1, "layer {l} is told once in pass {n}");
            if let (Some(at), Some(work)) = (complete, p.iter().rposition(work_of(l))) {
                ensure!(at > work, "layer {l} is told complete after its work in pass {n}");
            }
        }
        let finish = p.iter().position(|t| *t == Told::Finish);
        ensure!(finish.is_some() == (last_work == Some(n)), "pass {n} finishes iff it is the last to accumulate");
        if let Some(at) = finish {
            ensure!(at + 1 == p.len(), "pass {n} finishes after everything else it tells");
        }
        ensure!(!p.iter().any(|t| matches!(t, Told::Final(_))), "a linear layer tells nothing early");
    }
    Ok(())
}
