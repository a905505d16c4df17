//! From what the capture recorded to graphed callables: the sync event verified against every
//! static surface (R2, R3, R7), executables instantiated and uploaded, outputs' origins computed.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::graphed::{CaptureTimes, Captured, GraphedCallable, Pass, Shared, Slot, StaticState};
use super::in_place::{readers, Readers};
use super::lend::Lending;
use super::options::GraphOptions;
use super::output::StaticOutput;
use super::plan::Plan;
use super::record::Recorded;
use super::replay::{Origin, Route};
use super::verify::{verify_sync_point, Surface, TailMemory};
use crate::check::Checker;
use crate::device::{AccessMode, GraphId, RangeName};
use crate::memory::GraphPool;
use crate::tensor::Tensor;
use crate::Result;

/// Verifies the recorded graphs and makes one graphed callable per callable.
/// `times` holds the warmup's and the recording's; the instantiation's is measured here;
/// `lending` says which gradients each graph may have used as pool memory.
pub(crate) fn build(
    plan: &Plan<'_>,
    pools: &[GraphPool],
    options: &GraphOptions,
    recorded: Recorded,
    mut times: CaptureTimes,
    lending: Option<&Lending>,
) -> Result<Vec<GraphedCallable>> {
    let began = Instant::now();
    verify(plan, pools, options, &recorded, lending)?;
    let (stream, dev) = (plan.stream, plan.stream.device());
    let _range = dev.range_with(|| "instantiate".into());
    let Recorded { graphs, inputs, outputs, grad_outputs, grad_inputs } = recorded;
    let mut out = Vec::with_capacity(plan.len());
    let mut executables = Vec::with_capacity(graphs.len());
    for (i, mine) in graphs.into_iter().enumerate() {
        let mut captured = Vec::with_capacity(mine.len());
        for (pass, graph) in mine {
            let name = format!("{} {pass:?}", plan.names[i]);
            // Named in the pool's errors and in the reports of the collectives it holds.
            graph.graph().set_name(&name);
            pools[i].name_graph(graph.graph().id(), name);
            let exec = graph.instantiate()?;
            exec.upload(stream)?;
            let edges = options.edges_of(i, pass).map(|e| (e.edge.clone(), e.end)).collect();
            captured.push(Captured { pass, graph, exec, edges });
        }
        executables.push(captured);
    }
    times.instantiate = began.elapsed();
    let all: Vec<Vec<(Pass, &crate::device::Graph)>> =
        executables.iter().map(|mine| mine.iter().map(|c| (c.pass, c.graph.graph())).collect()).collect();
    let input_readers: Vec<Vec<Readers>> = (inputs.iter().enumerate())
        .map(|(i, xs)| {
            let fed = plan.statics[i].is_none();
            xs.iter().map(|x| if fed { None } else { readers(&all, i, &x.tensor) }).collect()
        })
        .collect();
    let grad_readers: Vec<Vec<Readers>> =
        (grad_outputs.iter().enumerate()).map(|(i, dys)| dys.iter().map(|d| readers(&all, i, d)).collect()).collect();
    drop(all);
    let shared = Arc::new(Shared { sync_event: options.sync_event.clone(), mode: options.mode, times });
    let per_callable = executables.into_iter().zip(inputs).zip(outputs).zip(grad_outputs.into_iter().zip(grad_inputs));
    let readers = input_readers.into_iter().zip(grad_readers);
    for (i, ((((captured, inputs), outputs), (dys, dxs)), (input_readers, grad_readers))) in
        per_callable.zip(readers).enumerate()
    {
        let pool = &pools[i];
        let fed = plan.statics[i].is_none();
        let slots = (inputs.iter().zip(input_readers))
            .map(|(x, readers)| Slot { input: x.clone(), chained: fed, readers })
            .collect();
        let name = &plan.names[i];
        let callable: Arc<str> = name.as_str().into();
        // Every graph of the pool so far: a later capture into the pool may be given what is
        // shared, and no checker summary of this capture names it.
        let known: Arc<[GraphId]> = pool.order().into();
        let origin = |what: String, t: Option<&StaticOutput>| Origin {
            callable: callable.clone(),
            what: what.into(),
            writers: t.map_or_else(|| Arc::from([]), |t| writers_of(pool, t.tensor())),
            known: t.filter(|t| t.is_shared()).map(|_| known.clone()),
        };
        let output_origins = outputs.iter().enumerate().map(|(k, y)| origin(format!("output {k}"), Some(y))).collect();
        let grad_origins = (dxs.iter().zip(inputs.iter()).enumerate())
            .map(|(k, (d, x))| origin(format!("gradient of {}", x.label(k)), d.as_ref()))
            .collect();
        out.push(GraphedCallable {
            name: callable.clone(),
            draws: None,
            shared: shared.clone(),
            pool: pool.clone(),
            positional: inputs.positional_inputs().len(),
            state: Some(StaticState {
                graphs: captured,
                inputs: slots,
                outputs,
                grad_outputs: dys,
                grad_readers,
                grad_inputs: dxs,
                output_origins,
                grad_origins,
                hook: plan.hooks[i].clone(),
            }),
            in_stack: false,
            route: Mutex::new(Route::Caller),
            done: dev.event()?,
            ranges: Pass::ALL.map(|pass| RangeName::new(&plan.ranges[i].name("replay", pass))),
            rebound: Default::default(),
        });
    }
    for e in &options.edges {
        e.edge.claim(e.end);
    }
    Ok(out)
}

/// The graphs of `pool` that write memory of `t` (all of them if the device's checker did not see
/// their captures, which cannot happen for captures made through the allocator).
fn writers_of(pool: &GraphPool, t: &Tensor) -> Arc<[GraphId]> {
    let order = pool.order();
    let (Some(checker), Ok(access)) = (Checker::of(pool.device()), t.access(AccessMode::Write)) else {
        return order.into();
    };
    order.into_iter().filter(|g| checker.graph_writes(*g, &access).unwrap_or(true)).collect()
}

/// Checks every graph's sync event against the static surfaces (R2, R3, R7).
fn verify(
    plan: &Plan<'_>,
    pools: &[GraphPool],
    options: &GraphOptions,
    recorded: &Recorded,
    lending: Option<&Lending>,
) -> Result<()> {
    let Some(event) = &options.sync_event else { return Ok(()) };
    let mut tail_memory: Vec<_> = plan.hooks.iter().flat_map(|h| h.tail_memory()).collect();
    tail_memory.extend(options.grad_sync.iter().flat_map(|g| g.tail_memory()));
    tail_memory.sort_unstable();
    tail_memory.dedup();
    let graph_of =
        |i: usize, pass: Pass| recorded.graphs.get(i)?.iter().find(|(p, _)| *p == pass).map(|(_, g)| g.graph().id());
    let mut surfaces: Vec<Surface<'_>> = Vec::new();
    for (i, inputs) in recorded.inputs.iter().enumerate() {
        let name = &plan.names[i];
        let (fwd, bwd) = (graph_of(i, Pass::Forward), graph_of(i, Pass::Backward));
        let mut add = |what: String, tensor, owner, gradient| surfaces.push(Surface { what, tensor, owner, gradient });
        // An input fed by the previous callable is that callable's output: its forward makes it.
        let input_owner =
            if plan.statics[i].is_none() { i.checked_sub(1).and_then(|p| graph_of(p, Pass::Forward)) } else { None };
        for (k, x) in inputs.iter().enumerate() {
            add(format!("{name} {}", x.label(k)), &x.tensor, input_owner, false);
        }
        for (k, y) in recorded.outputs[i].iter().enumerate() {
            add(format!("{name} output {k}"), y.tensor(), fwd, false);
        }
        let grad_owner = if plan.feeds_next(i) { graph_of(i + 1, Pass::Backward) } else { None };
        for (k, d) in recorded.grad_outputs[i].iter().enumerate() {
            add(format!("{name} output gradient {k}"), d, grad_owner, false);
        }
        for (k, d) in recorded.grad_inputs[i].iter().enumerate() {
            if let Some(d) = d {
                add(format!("{name} gradient of input {k}"), d.tensor(), bwd, false);
            }
        }
        for p in plan.callables[i].parameters_dyn() {
            add(format!("parameter {}", p.name), &p.value, None, false);
            // With gradient work in the tail, gradients are complete only after the join (R4).
            if options.grad_sync.is_none() {
                add(format!("gradient of {}", p.name), &p.grad, None, true);
            }
        }
    }
    let edge_events: Vec<_> = options.edges.iter().map(|e| e.edge.event().id()).collect();
    for (i, mine) in recorded.graphs.iter().enumerate() {
        for (pass, g) in mine {
            let lent = lending.map(|l| pools[i].lent_memory(&l.lenders(i, *pass))).unwrap_or_default();
            let tail = TailMemory { hook: &tail_memory, lent: &lent };
            verify_sync_point(plan.alloc, &pools[i], g.graph(), event, &surfaces, tail, &edge_events)
                .map_err(|kind| plan.err(i, kind))?;
        }
    }
    Ok(())
}
