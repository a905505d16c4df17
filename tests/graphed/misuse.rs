//! Misuse fuzzing: random sequences of captures (stacks, single layers, a pipeline schedule's
//! callables), replays in every mode (with good, misshapen and foreign inputs, foreign streams
//! and pools), whole schedule runs (`GraphedSchedule::run`, on good, misshapen and
//! foreign inputs and streams), reads of what earlier schedule runs handed out (stale after a
//! later run), joins (into streams of this and of another device), releases, drops and optimizer
//! steps over the public API. Activation offloading too: offload managers made with good and refused
//! configurations (a malformed site selector, refused at `OffloadManager::new`; a selector that
//! selects nothing the model saves, refused when the policy freezes), eager iterations through
//! a manager's chunk hook (forward and backward as separate calls, with and without
//! `end_iteration`, on a chunk the recording saw or not), captures with the manager's graph
//! options (whose warmup records the policy if it is not frozen yet), whose stacks and
//! callables take part in every act above, and a check that an offloading stack's replay (in any mode) gives the values of the
//! same step eagerly without offloading. Properties: nothing panics; a refusal is a typed misuse
//! error (of the graph or the offload layer); a refused call changes nothing observable
//! (parameters, gradients, the RNG step counter, every static input and output gradient, every
//! pool's order, the manager's frozen policy and copied bytes); at the end the device kept no
//! error and the checker reported nothing.

use anyhow::ensure;
use graphed::device::DType;
use graphed::device::{Device, DeviceKind, GraphId};
use graphed::graph::{
    make_graphed_callables, make_graphed_schedule, Callable, GraphOptions, GraphedCallable, GraphedSchedule,
    GraphedStack, Replay, StaticTensor, Tails,
};
use graphed::memory::{CachingAllocator, GraphPool};
use graphed::nn::{Chunk, Inputs, Module, Schedule, StackCtx, TransformerLayer};
use graphed::offload::{OffloadConfig, OffloadErrorKind, OffloadManager};
use graphed::tensor::Tensor;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use super::fixtures::{Model, Result, LAYERS};

/// Which pool a capture uses.
#[derive(Debug, Clone, Copy)]
enum PoolPick {
    New,
    /// The pool of the target at this index, if any.
    Shared(usize),
    /// A pool of another allocator.
    Foreign,
    /// A pool per layer.
    PerLayer,
}

/// How a replay is asked for.
#[derive(Debug, Clone, Copy)]
enum ReplayPick {
    Caller,
    Joined,
    Side,
    /// A side stream that is the caller's.
    SideOnCaller,
    /// The caller's stream of another device.
    ForeignCaller,
    /// A side stream of another device.
    ForeignSide,
}

/// What is passed as input or upstream gradient.
#[derive(Debug, Clone, Copy)]
enum InputPick {
    Good,
    /// The static buffer itself (no copy-in).
    Static,
    WrongShape,
    /// A tensor of another device.
    Foreign,
}

/// What a capture graphs.
#[derive(Debug, Clone, Copy)]
enum Shape {
    Stack,
    /// The first layer on its own.
    Layer,
    /// Every layer, once per microbatch of interleaved 1F1B over 2 microbatches in `chunks`
    /// chunks, with or without buffer reuse.
    Schedule {
        chunks: usize,
        reuse: bool,
    },
}

/// The configuration of a new offload manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConfigPick {
    /// The default sites (tensors of at least 64 elements).
    Good,
    /// As `Good`, eager commits delayed until the next graph launch.
    Delayed,
    /// Every tensor of the MLPs (`mlp.*`).
    Wildcard,
    /// A selector that is not `module.tensor`: refused by `OffloadManager::new`.
    Malformed,
    /// A selector that selects nothing the model saves: refused when the policy is frozen.
    Unmatched,
}

impl ConfigPick {
    fn config(self) -> OffloadConfig {
        let c = OffloadConfig::default().min_elements(64);
        match self {
            ConfigPick::Good => c,
            ConfigPick::Delayed => c.delay_eager_commits(true),
            ConfigPick::Wildcard => c.sites(&["mlp.*"]),
            ConfigPick::Malformed => c.sites(&["attn.qkv", "attn"]),
            ConfigPick::Unmatched => c.sites(&["attn.qkv", "attn.nothing"]),
        }
    }
}

#[derive(Debug, Clone)]
enum Act {
    Capture {
        shape: Shape,
        event: bool,
        pool: PoolPick,
        /// With the offload manager's graph options, if there is a manager.
        offload: bool,
    },
    Forward {
        at: usize,
        replay: ReplayPick,
        input: InputPick,
    },
    Backward {
        at: usize,
        grad: InputPick,
    },
    /// A whole step of a schedule's callables, on the caller's stream or one of another device,
    /// every microbatch's input as `input` says.
    RunSchedule {
        at: usize,
        foreign_caller: bool,
        input: InputPick,
    },
    /// Reads the `k`-th tensor the target's last schedule run handed out.
    ReadHanded {
        at: usize,
        k: usize,
    },
    Join {
        at: usize,
        foreign: bool,
    },
    Release {
        at: usize,
    },
    Drop {
        at: usize,
    },
    OptimizerStep,
    /// Replaces the offload manager (graphs keep theirs).
    NewManager {
        config: ConfigPick,
    },
    /// The stack's eager forward through the manager's hook of chunk 0 (or of chunk 1, which
    /// the warmup iteration did not see); the context is kept for `EagerBackward`.
    EagerForward {
        other_chunk: bool,
    },
    /// The eager backward of the kept context.
    EagerBackward,
    EndIteration,
    /// An offloading stack's forward and backward, replayed as `replay` says (`Caller`,
    /// `Joined` or `Side`), against the same step eagerly without offloading.
    CheckOffload {
        at: usize,
        replay: ReplayPick,
    },
}

fn act() -> impl Strategy<Value = Act> {
    let pool = prop_oneof![
        Just(PoolPick::New),
        (0..3usize).prop_map(PoolPick::Shared),
        Just(PoolPick::Foreign),
        Just(PoolPick::PerLayer)
    ];
    let replay = prop_oneof![
        3 => Just(ReplayPick::Caller),
        2 => Just(ReplayPick::Joined),
        3 => Just(ReplayPick::Side),
        1 => Just(ReplayPick::SideOnCaller),
        1 => Just(ReplayPick::ForeignCaller),
        1 => Just(ReplayPick::ForeignSide)
    ];
    let input = prop_oneof![
        4 => Just(InputPick::Good),
        2 => Just(InputPick::Static),
        1 => Just(InputPick::WrongShape),
        1 => Just(InputPick::Foreign)
    ];
    let shape = prop_oneof![
        2 => Just(Shape::Stack),
        1 => Just(Shape::Layer),
        1 => (1..=2usize, any::<bool>()).prop_map(|(chunks, reuse)| Shape::Schedule { chunks, reuse })
    ];
    prop_oneof![
        3 => (shape, any::<bool>(), pool, prop::bool::weighted(0.7))
            .prop_map(|(shape, event, pool, offload)| Act::Capture { shape, event, pool, offload }),
        5 => (0..3usize, replay, input.clone()).prop_map(|(at, replay, input)| Act::Forward { at, replay, input }),
        4 => (0..3usize, input.clone()).prop_map(|(at, grad)| Act::Backward { at, grad }),
        3 => (0..3usize, prop::bool::weighted(0.2), input)
            .prop_map(|(at, foreign_caller, input)| Act::RunSchedule { at, foreign_caller, input }),
        2 => (0..3usize, 0..8usize).prop_map(|(at, k)| Act::ReadHanded { at, k }),
        2 => (0..3usize, prop::bool::weighted(0.3)).prop_map(|(at, foreign)| Act::Join { at, foreign }),
        1 => (0..3usize).prop_map(|at| Act::Release { at }),
        1 => (0..3usize).prop_map(|at| Act::Drop { at }),
        1 => Just(Act::OptimizerStep),
        1 => prop_oneof![
            4 => Just(ConfigPick::Good),
            1 => Just(ConfigPick::Delayed),
            1 => Just(ConfigPick::Wildcard),
            1 => Just(ConfigPick::Malformed),
            1 => Just(ConfigPick::Unmatched)
        ]
        .prop_map(|config| Act::NewManager { config }),
        2 => prop::bool::weighted(0.1).prop_map(|other_chunk| Act::EagerForward { other_chunk }),
        2 => Just(Act::EagerBackward),
        2 => Just(Act::EndIteration),
        3 => (0..3usize, prop_oneof![Just(ReplayPick::Caller), Just(ReplayPick::Joined), Just(ReplayPick::Side)])
            .prop_map(|(at, replay)| Act::CheckOffload { at, replay }),
    ]
}

/// How a sequence starts, so that sequences reach the frozen policy and offloading graphs
/// often: with nothing in a quarter of them; else with a manager and an offloading stack
/// captured with a sync event, whose warmup records the policy (as `graphed train --offload
/// --side-stream` does), or with an eager recording iteration (forward, backward,
/// `end_iteration`), then, in half of them, that capture.
fn prefix() -> impl Strategy<Value = Vec<Act>> {
    let config = prop_oneof![
        3 => Just(ConfigPick::Good),
        1 => Just(ConfigPick::Delayed),
        1 => Just(ConfigPick::Wildcard),
        1 => Just(ConfigPick::Unmatched)
    ];
    let warm = (config, any::<bool>(), any::<bool>()).prop_map(|(config, eager, capture)| {
        let mut acts = vec![Act::NewManager { config }];
        if eager {
            acts.extend([Act::EagerForward { other_chunk: false }, Act::EagerBackward, Act::EndIteration]);
        }
        if capture || !eager {
            acts.push(Act::Capture { shape: Shape::Stack, event: true, pool: PoolPick::New, offload: true });
        }
        acts
    });
    prop_oneof![1 => Just(Vec::new()), 3 => warm]
}

/// A graphed stack, or graphed callables: the first layer on its own, or every layer per
/// microbatch of a schedule. Single replays go to the first callable, with the tails they return;
/// schedule runs to all of them, keeping what the last run handed out.
enum Target {
    Stack(GraphedStack),
    Callables { g: Made, tails: Tails, handed: Vec<StaticTensor> },
}

/// Callables graphed on their own, or for a schedule that owns them.
enum Made {
    Alone(Vec<GraphedCallable>),
    Schedule(GraphedSchedule),
}

impl std::ops::Deref for Made {
    type Target = [GraphedCallable];

    fn deref(&self) -> &[GraphedCallable] {
        match self {
            Made::Alone(g) => g,
            Made::Schedule(g) => g.callables(),
        }
    }
}

impl Target {
    fn pool(&self) -> &GraphPool {
        match self {
            Target::Stack(g) => g.pool(),
            Target::Callables { g, .. } => g[0].pool(),
        }
    }

    /// Joins its tails into `s` (R4).
    fn join(&mut self, s: &graphed::device::Stream) -> graphed::Result<()> {
        match self {
            Target::Stack(g) => g.join(s),
            Target::Callables { tails, .. } => tails.join(s),
        }
    }

    fn statics(&self) -> Vec<&Tensor> {
        let layers = match self {
            Target::Stack(g) => g.layers(),
            Target::Callables { g, .. } => &g[..],
        };
        layers
            .iter()
            .flat_map(|l| l.static_inputs().into_iter().flatten().chain(l.static_grad_outputs().into_iter().flatten()))
            .collect()
    }
}

/// Everything a refused call must leave as it was.
#[derive(PartialEq, Debug)]
struct Observed {
    params: Vec<f32>,
    grads: Vec<f32>,
    step: Vec<u64>,
    statics: Vec<Vec<f32>>,
    orders: Vec<Vec<GraphId>>,
    /// The manager's policy frozen, and its bytes copied out.
    offload: Option<(bool, usize)>,
}

impl Observed {
    /// What differs from `other`, by name.
    fn differences(&self, other: &Observed) -> String {
        let mut what = Vec::new();
        let mut differs = |name: &str, yes: bool| {
            if yes {
                what.push(name.to_string())
            }
        };
        differs("the parameters", self.params != other.params);
        differs("the gradients", self.grads != other.grads);
        differs(&format!("the RNG step counter ({:?} to {:?})", self.step, other.step), self.step != other.step);
        differs("a static input or output gradient", self.statics != other.statics);
        differs("a pool's order", self.orders != other.orders);
        differs(
            &format!("the offload manager ({:?} to {:?})", self.offload, other.offload),
            self.offload != other.offload,
        );
        what.join(", ")
    }
}

/// The offload manager, with the configuration it was made with.
struct Manager {
    m: OffloadManager,
    config: ConfigPick,
}

struct World<'d> {
    dev: &'d Device,
    model: Model,
    other: Device,
    other_alloc: CachingAllocator,
    side: graphed::device::Stream,
    event: graphed::device::Event,
    targets: Vec<Target>,
    /// Whether each target was captured with the manager's graph options.
    offloading: Vec<bool>,
    manager: Option<Manager>,
    /// The context of the last eager forward through the manager's hook.
    eager: Option<StackCtx<<TransformerLayer as Module>::Ctx>>,
    /// Counts eager microbatches, for fresh inputs.
    microbatch: u64,
}

impl World<'_> {
    fn observe(&self) -> graphed::Result<Observed> {
        let s = &self.model.s;
        let mut statics = Vec::new();
        for t in &self.targets {
            for x in t.statics() {
                statics.push(x.to_vec(s)?);
            }
        }
        Ok(Observed {
            params: self.model.store.values()?.to_vec(s)?,
            grads: self.model.store.grads()?.to_vec(s)?,
            step: self.model.step.to_vec(s)?,
            statics,
            orders: self.targets.iter().map(|t| t.pool().order()).collect(),
            offload: self.manager.as_ref().map(|m| (m.m.summary().is_some(), m.m.stats().copied_out)),
        })
    }

    fn apply(&mut self, act: &Act) -> graphed::Result<()> {
        let s = self.model.s.clone();
        let other_stream = self.other.stream()?;
        let n = self.targets.len();
        // Targets are picked modulo their count, so that every act lands on one.
        let at = |i: usize| i % n.max(1);
        match *act {
            Act::Capture { shape, event, pool, offload } => {
                let mut options = GraphOptions::default();
                if event {
                    options = options.sync_event(&self.event);
                }
                let offload = offload && self.manager.is_some();
                if let (true, Some(m)) = (offload, &self.manager) {
                    options = m.m.graph_options(options);
                }
                options = match pool {
                    PoolPick::New => options,
                    PoolPick::Shared(i) if i < n => options.pool(self.targets[i].pool()),
                    PoolPick::Shared(_) => options,
                    PoolPick::Foreign => options.pool(&self.other_alloc.new_pool()),
                    PoolPick::PerLayer => options.pool_per_callable(true),
                };
                let (x0, _) = self.model.data(0).map_err(to_graphed)?;
                let callables = |g| Target::Callables { g, tails: Tails::new(), handed: Vec::new() };
                let target = match shape {
                    Shape::Stack => Target::Stack(self.model.graph(options).map_err(to_graphed)?),
                    Shape::Layer => {
                        let layer: Vec<&dyn Callable> = self.model.callables()[..1].to_vec();
                        callables(Made::Alone(make_graphed_callables(
                            &self.model.alloc,
                            &layer,
                            &[Inputs::one(&x0)],
                            options,
                        )?))
                    }
                    Shape::Schedule { chunks, reuse } => {
                        let schedule = Schedule::interleaved_1f1b(1, 0, chunks, 2)?;
                        let samples: Vec<Inputs> = (0..LAYERS * 2).map(|_| Inputs::one(&x0)).collect();
                        // One warmup iteration: enough for the properties, and the fuzzer stays fast.
                        let options = options.reuse_buffers(reuse).warmup_iters(1);
                        let layers = self.model.callables();
                        callables(Made::Schedule(make_graphed_schedule(
                            &self.model.alloc,
                            &layers,
                            &schedule,
                            &samples,
                            options,
                        )?))
                    }
                };
                self.targets.push(target);
                self.offloading.push(offload);
                Ok(())
            }
            Act::Forward { .. }
            | Act::Backward { .. }
            | Act::RunSchedule { .. }
            | Act::ReadHanded { .. }
            | Act::Join { .. }
            | Act::Release { .. }
            | Act::Drop { .. }
            | Act::CheckOffload { .. }
                if n == 0 =>
            {
                Ok(())
            }
            Act::Forward { at: i, replay, input: pick } => {
                let at = at(i);
                let (caller, replay) = match replay {
                    ReplayPick::Caller => (&s, Replay::caller()),
                    ReplayPick::Joined => (&s, Replay::joined(&self.side)),
                    ReplayPick::Side => (&s, Replay::side(&self.side)),
                    ReplayPick::SideOnCaller => (&s, Replay::side(&s)),
                    ReplayPick::ForeignCaller => (&other_stream, Replay::caller()),
                    ReplayPick::ForeignSide => (&s, Replay::side(&other_stream)),
                };
                let (model, foreign) = (&self.model, &self.other_alloc);
                match &mut self.targets[at] {
                    Target::Stack(g) => {
                        let x = input(model, foreign, pick, g.static_input().ok())?;
                        g.forward(caller, &x, replay).map(|_| ())
                    }
                    Target::Callables { g, tails, .. } => {
                        let x =
                            input(model, foreign, pick, g[0].static_inputs().ok().and_then(|v| v.first().copied()))?;
                        let (_, tail) = g[0].forward(caller, &Inputs::one(&x), replay)?;
                        tails.push(tail);
                        Ok(())
                    }
                }
            }
            Act::Backward { at: i, grad } => match &mut self.targets[at(i)] {
                Target::Stack(g) => {
                    let dy = input(&self.model, &self.other_alloc, grad, g.static_grad_output().ok().flatten())?;
                    g.backward(&s, &dy).map(|_| ())
                }
                Target::Callables { g, tails, .. } => {
                    let dy = input(
                        &self.model,
                        &self.other_alloc,
                        grad,
                        g[0].static_grad_outputs().ok().and_then(|d| d.first()),
                    )?;
                    let (_, tail) = g[0].backward(&s, &[&dy])?;
                    tails.push(tail);
                    Ok(())
                }
            },
            Act::RunSchedule { at: i, foreign_caller, input: pick } => {
                let Target::Callables { g: Made::Schedule(g), handed, .. } = &mut self.targets[at(i)] else {
                    return Ok(());
                };
                let caller = if foreign_caller { &other_stream } else { &s };
                // Every microbatch gets the same kind of input, so that a refusal comes from the
                // first pass, before anything ran; no dropout counter, so that nothing is
                // enqueued before it either.
                let x = input(
                    &self.model,
                    &self.other_alloc,
                    pick,
                    g.callables()[0].static_inputs().ok().and_then(|v| v.first().copied()),
                )?;
                let inputs = vec![x; g.schedule().microbatches()];
                let (_, dy) = self.model.data(8).map_err(to_graphed)?;
                let mut ys = Vec::new();
                let mut head = |_: usize, y: StaticTensor| -> graphed::Result<Tensor> {
                    ys.push(y);
                    Ok(dy.clone())
                };
                let dxs = g.run(caller, &inputs, None, &mut head)?;
                *handed = ys.into_iter().chain(dxs).collect();
                Ok(())
            }
            Act::ReadHanded { at: i, k } => match &self.targets[at(i)] {
                Target::Callables { handed, .. } if !handed.is_empty() => {
                    let t = &handed[k % handed.len()];
                    let fresh = t.is_fresh();
                    match t.get() {
                        Ok(t) => t.to_vec::<f32>(&s).map(|_| ()),
                        // A stale read is refused, and only a stale one.
                        Err(e) if !fresh => Err(e),
                        Err(e) => {
                            Err(graphed::Error::Cuda { op: "fuzzer", message: format!("fresh but refused: {e}") })
                        }
                    }
                }
                _ => Ok(()),
            },
            Act::Join { at: i, foreign } => self.targets[at(i)].join(if foreign { &other_stream } else { &s }),
            Act::Release { at: i } => match &mut self.targets[at(i)] {
                Target::Stack(g) => g.release_static_state(),
                Target::Callables { g, tails, .. } => {
                    tails.join(&s)?;
                    match g {
                        Made::Alone(g) => g.iter_mut().try_for_each(GraphedCallable::release_static_state),
                        Made::Schedule(g) => g.release_static_state(),
                    }
                }
            },
            Act::Drop { at: i } => {
                drop(self.targets.remove(at(i)));
                self.offloading.remove(at(i));
                Ok(())
            }
            Act::OptimizerStep => {
                // The optimizer reads every gradient: the tails first (R4), as a user must.
                self.targets.iter_mut().try_for_each(|t| t.join(&s))?;
                self.model.optimizer.step(&s)
            }
            Act::NewManager { config } => match (config, OffloadManager::new(&self.model.alloc, config.config())) {
                (ConfigPick::Malformed, Err(e))
                    if matches!(e.offload_kind(), Some(OffloadErrorKind::BadSelector { .. })) =>
                {
                    Err(e)
                }
                (ConfigPick::Malformed, r) => Err(fuzzer(format!("a malformed selector gave {:?}", r.map(|_| ())))),
                (_, Err(e)) => Err(fuzzer(format!("{config:?} refused: {e}"))),
                (_, Ok(m)) => {
                    self.eager = None;
                    self.manager = Some(Manager { m, config });
                    Ok(())
                }
            },
            Act::EagerForward { other_chunk } => {
                let Some(m) = &self.manager else { return Ok(()) };
                let chunk = Chunk { microbatch: usize::from(other_chunk), stage: 0 };
                self.microbatch += 1;
                let (x, _) = self.model.data(300 + self.microbatch).map_err(to_graphed)?;
                let (_, ctx) = self.model.stack.forward(&Inputs::one(&x), &m.m.chunk(chunk), &s)?;
                self.eager = Some(ctx);
                Ok(())
            }
            Act::EagerBackward => {
                let Some(ctx) = self.eager.take() else { return Ok(()) };
                let (_, dy) = self.model.data(400 + self.microbatch).map_err(to_graphed)?;
                self.model.stack.backward(ctx, &[&dy], &s).map(|_| ())
            }
            Act::EndIteration => {
                let Some(m) = &self.manager else { return Ok(()) };
                let frozen = m.m.summary().is_some();
                m.m.end_iteration(&s)?;
                if !frozen && m.m.summary().is_some() && m.config == ConfigPick::Unmatched {
                    return Err(fuzzer("a selector that selects nothing was frozen into the policy".into()));
                }
                Ok(())
            }
            Act::CheckOffload { at: i, replay } => {
                // The `i`-th offloading stack.
                let stacks: Vec<&GraphedStack> = (self.targets.iter().zip(&self.offloading))
                    .filter_map(|(t, off)| match t {
                        Target::Stack(g) if *off => Some(g),
                        _ => None,
                    })
                    .collect();
                let Some(g) = stacks.get(i % stacks.len().max(1)) else { return Ok(()) };
                let replay = match replay {
                    ReplayPick::Joined => Replay::joined(&self.side),
                    ReplayPick::Side => Replay::side(&self.side),
                    _ => Replay::caller(),
                };
                let model = &self.model;
                self.microbatch += 1;
                let (x, dy) = model.data(500 + self.microbatch).map_err(to_graphed)?;
                let step = model.step.to_vec::<u64>(&s)?;
                let grads = model.store.grads()?.to_vec::<f32>(&s)?;
                // A refused forward changes nothing; a backward right after it is not refused.
                let y = g.forward(&s, &x, replay)?.get()?.to_f32_vec(&s)?;
                let dx = g.backward(&s, &dy)?.ok_or_else(|| fuzzer("no input gradient".into()))?;
                let dx = dx.get()?.to_f32_vec(&s)?;
                g.join(&s)?;
                let got = (y, dx, model.store.grads()?.to_vec::<f32>(&s)?);
                model.step.copy_from(&Tensor::from_host(&model.alloc, &s, &step, &[1])?, &s)?;
                model.store.grads()?.copy_from(&Tensor::from_host(&model.alloc, &s, &grads, &[grads.len()])?, &s)?;
                let (y, dx) = model.eager(&x, &dy).map_err(to_graphed)?;
                if got != (y, dx, model.store.grads()?.to_vec::<f32>(&s)?) {
                    return Err(fuzzer("an offloading replay differs from the same step eagerly".into()));
                }
                Ok(())
            }
        }
    }
}

/// A failure of the fuzzer's own checks: not a misuse refusal, so that it fails the run.
fn fuzzer(message: String) -> graphed::Error {
    graphed::Error::Cuda { op: "fuzzer", message }
}

/// The tensor `pick` asks for: `fallback` is the static buffer, when there is one.
fn input(
    model: &Model,
    foreign: &CachingAllocator,
    pick: InputPick,
    fallback: Option<&Tensor>,
) -> graphed::Result<Tensor> {
    match (pick, fallback) {
        (InputPick::Static, Some(t)) => Ok(t.clone()),
        (InputPick::WrongShape, _) => Tensor::zeros(&model.alloc, &model.s, &[3, 5], DType::F32),
        (InputPick::Foreign, _) => {
            Tensor::zeros(foreign, &foreign.device().stream()?, &super::fixtures::SHAPE, DType::F32)
        }
        _ => Ok(model.data(7).map_err(to_graphed)?.0),
    }
}

fn to_graphed(e: anyhow::Error) -> graphed::Error {
    match e.downcast::<graphed::Error>() {
        Ok(e) => e,
        Err(e) => graphed::Error::Cuda { op: "fixture", message: e.to_string() },
    }
}

/// A refusal of misuse, in the graph layer's one shape (`Error::Graphed`) or the offload layer's
/// (`Error::Offload`): not a driver failure, a bug, or an error of a lower layer.
fn is_misuse_refusal(e: &graphed::Error) -> bool {
    e.graphed_kind().is_some() || e.offload_kind().is_some()
}

fn run_sequence(dev: &Device, acts: &[Act]) -> Result {
    let other = Device::sim();
    let mut world = World {
        dev,
        model: Model::new(dev)?,
        other_alloc: CachingAllocator::new(&other),
        other,
        side: dev.stream()?,
        event: dev.event()?,
        targets: Vec::new(),
        offloading: Vec::new(),
        manager: None,
        eager: None,
        microbatch: 0,
    };
    for (k, act) in acts.iter().enumerate() {
        let before = world.observe()?;
        let r = world.apply(act);
        if let Err(e) = r {
            ensure!(is_misuse_refusal(&e), "step {k} {act:?}: not a misuse refusal: {e}");
            let mut after = world.observe()?;
            // Known: the copies a refused capture made stay counted in the manager's
            // `stats().copied_out` (the manager is not told that the capture failed).
            if let (Act::Capture { .. }, Some(a), Some(b)) = (act, &mut after.offload, &before.offload) {
                a.1 = b.1;
            }
            ensure!(before == after, "step {k} {act:?} was refused ({e}) but changed {}", before.differences(&after));
        }
    }
    let s = world.model.s.clone();
    world.targets.iter_mut().try_for_each(|t| t.join(&s))?;
    world.targets.clear();
    world.eager = None;
    world.manager = None;
    world.dev.synchronize()?;
    ensure!(world.dev.take_error().is_none(), "a drop failed");
    Ok(())
}

/// Sequences per device configuration (the simulator runs every case under six schedules);
/// `GRAPHED_FUZZ_CASES` overrides it for a longer hunt.
fn cases(dev: &Device) -> u32 {
    if let Some(n) = std::env::var("GRAPHED_FUZZ_CASES").ok().and_then(|v| v.parse().ok()) {
        return n;
    }
    match dev.kind() {
        DeviceKind::Cuda => 64,
        _ => 64,
    }
}

pub fn misuse_refusals_change_nothing(dev: &Device) -> Result {
    let config = Config { cases: cases(dev), failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(
        config,
        proptest::test_runner::TestRng::deterministic_rng(proptest::test_runner::RngAlgorithm::ChaCha),
    );
    runner
        .run(&(prefix(), proptest::collection::vec(act(), 1..24)), |(prefix, acts)| {
            let acts: Vec<Act> = prefix.into_iter().chain(acts).collect();
            run_sequence(dev, &acts).map_err(|e| TestCaseError::fail(format!("{e:#}")))
        })
        .map_err(|e| anyhow::anyhow!("{e}"))
}
