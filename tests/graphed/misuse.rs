//! Misuse fuzzing: random sequences of captures, replays in every mode (with good, misshapen and
//! foreign inputs, foreign streams and pools), joins, resets, drops and optimizer steps over the
//! public API. Properties: nothing panics; a refusal is a typed misuse error; a refused call
//! changes nothing observable (parameters, gradients, the RNG step counter, every static input and
//! output gradient, every pool's order); at the end the device kept no error and the checker
//! reported nothing.

use anyhow::ensure;
use graphed::device::DType;
use graphed::device::{Device, DeviceKind, GraphId};
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, GraphedCallable, GraphedStack, Replay, Tails};
use graphed::memory::{CachingAllocator, GraphPool};
use graphed::nn::Inputs;
use graphed::tensor::Tensor;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use super::fixtures::{Model, Result};

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

#[derive(Debug, Clone)]
enum Act {
    Capture { stack: bool, event: bool, pool: PoolPick },
    Forward { at: usize, replay: ReplayPick, input: InputPick },
    Backward { at: usize, grad: InputPick },
    Join { at: usize },
    Reset { at: usize },
    Drop { at: usize },
    OptimizerStep,
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
    prop_oneof![
        2 => (any::<bool>(), any::<bool>(), pool).prop_map(|(stack, event, pool)| Act::Capture { stack, event, pool }),
        5 => (0..3usize, replay, input.clone()).prop_map(|(at, replay, input)| Act::Forward { at, replay, input }),
        4 => (0..3usize, input).prop_map(|(at, grad)| Act::Backward { at, grad }),
        2 => (0..3usize).prop_map(|at| Act::Join { at }),
        1 => (0..3usize).prop_map(|at| Act::Reset { at }),
        1 => (0..3usize).prop_map(|at| Act::Drop { at }),
        1 => Just(Act::OptimizerStep),
    ]
}

/// A graphed stack, or the first layer graphed on its own with the tails its replays returned.
enum Target {
    Stack(GraphedStack),
    Layer(Vec<GraphedCallable>, Tails),
}

impl Target {
    fn pool(&self) -> &GraphPool {
        match self {
            Target::Stack(g) => g.pool(),
            Target::Layer(g, _) => g[0].pool(),
        }
    }

    /// Joins its tails into `s` (R4).
    fn join(&mut self, s: &graphed::device::Stream) -> graphed::Result<()> {
        match self {
            Target::Stack(g) => g.join(s),
            Target::Layer(_, tails) => tails.join(s),
        }
    }

    fn statics(&self) -> Vec<&Tensor> {
        match self {
            Target::Stack(g) => {
                g.layers().iter().flat_map(|l| l.static_inputs().into_iter().chain(l.static_grad_outputs())).collect()
            }
            Target::Layer(g, _) => g[0].static_inputs().into_iter().chain(g[0].static_grad_outputs()).collect(),
        }
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
}

struct World<'d> {
    dev: &'d Device,
    model: Model,
    other: Device,
    other_alloc: CachingAllocator,
    side: graphed::device::Stream,
    event: graphed::device::Event,
    targets: Vec<Target>,
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
        })
    }

    fn apply(&mut self, act: &Act) -> graphed::Result<()> {
        let s = self.model.s.clone();
        let other_stream = self.other.stream()?;
        let n = self.targets.len();
        // Targets are picked modulo their count, so that every act lands on one.
        let at = |i: usize| i % n.max(1);
        match *act {
            Act::Capture { stack, event, pool } => {
                let mut options = GraphOptions::default();
                if event {
                    options = options.sync_event(&self.event);
                }
                options = match pool {
                    PoolPick::New => options,
                    PoolPick::Shared(i) if i < n => options.pool(self.targets[i].pool()),
                    PoolPick::Shared(_) => options,
                    PoolPick::Foreign => options.pool(&self.other_alloc.new_pool()),
                    PoolPick::PerLayer => options.pool_per_callable(true),
                };
                let target = match stack {
                    true => Target::Stack(self.model.graph(options).map_err(to_graphed)?),
                    false => {
                        let (x0, _) = self.model.data(0).map_err(to_graphed)?;
                        let layer: Vec<&dyn Callable> = self.model.callables()[..1].to_vec();
                        Target::Layer(
                            make_graphed_callables(&self.model.alloc, &layer, &[Inputs::one(&x0)], options)?,
                            Tails::new(),
                        )
                    }
                };
                self.targets.push(target);
                Ok(())
            }
            Act::Forward { .. } | Act::Backward { .. } | Act::Join { .. } | Act::Reset { .. } | Act::Drop { .. }
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
                        let x = input(model, foreign, pick, Some(g.static_input()))?;
                        g.forward(caller, &x, replay).map(|_| ())
                    }
                    Target::Layer(g, tails) => {
                        let x = input(model, foreign, pick, g[0].static_inputs().first().copied())?;
                        let (_, tail) = g[0].forward(caller, &Inputs::one(&x), replay)?;
                        tails.push(tail);
                        Ok(())
                    }
                }
            }
            Act::Backward { at: i, grad } => match &mut self.targets[at(i)] {
                Target::Stack(g) => {
                    let dy = input(&self.model, &self.other_alloc, grad, g.static_grad_output())?;
                    g.backward(&s, &dy).map(|_| ())
                }
                Target::Layer(g, tails) => {
                    let dy = input(&self.model, &self.other_alloc, grad, g[0].static_grad_outputs().first())?;
                    let (_, tail) = g[0].backward(&s, &[&dy])?;
                    tails.push(tail);
                    Ok(())
                }
            },
            Act::Join { at: i } => self.targets[at(i)].join(&s),
            Act::Reset { at: i } => match &mut self.targets[at(i)] {
                Target::Stack(g) => g.reset(),
                Target::Layer(g, tails) => {
                    tails.join(&s)?;
                    g[0].reset()
                }
            },
            Act::Drop { at: i } => {
                drop(self.targets.remove(at(i)));
                Ok(())
            }
            Act::OptimizerStep => {
                // The optimizer reads every gradient: the tails first (R4), as a user must.
                self.targets.iter_mut().try_for_each(|t| t.join(&s))?;
                self.model.optimizer.step(&s)
            }
        }
    }
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

/// A refusal of misuse, in the graph layer's one shape (`Error::Graphed`): not a driver failure,
/// a bug, or an error of a lower layer.
fn is_misuse_refusal(e: &graphed::Error) -> bool {
    e.graphed_kind().is_some()
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
    };
    for (k, act) in acts.iter().enumerate() {
        let before = world.observe()?;
        if let Err(e) = world.apply(act) {
            ensure!(is_misuse_refusal(&e), "step {k} {act:?}: not a misuse refusal: {e}");
            let after = world.observe()?;
            ensure!(before == after, "step {k} {act:?} was refused ({e}) but changed state");
        }
    }
    let s = world.model.s.clone();
    world.targets.iter_mut().try_for_each(|t| t.join(&s))?;
    world.targets.clear();
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
        .run(&proptest::collection::vec(act(), 1..24), |acts| {
            run_sequence(dev, &acts).map_err(|e| TestCaseError::fail(format!("{e:#}")))
        })
        .map_err(|e| anyhow::anyhow!("{e}"))
}
