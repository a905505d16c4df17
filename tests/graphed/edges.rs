//! Typed edges between graphs (`GraphEdge`): a consumer replayed on another stream waits on its
//! producer's record inside the graphs, with no host wait; a consumer launched without its
//! producer, and edge ends taken twice, are refused before anything is enqueued.

use anyhow::ensure;
use graphed::device::{Device, DeviceKind};
use graphed::graph::{make_graphed_fn, make_graphed_fn_with_edges, Edges, GraphEdge, GraphedErrorKind};
use graphed::memory::CachingAllocator;
use graphed::ops::elementwise;
use graphed::tensor::Tensor;
use graphed::Error;

use super::fixtures::Result;

/// `x` of a few thousand elements, so that the simulator's scheduler can interleave the copy
/// with the doubling when nothing orders them.
const N: usize = 4096;

fn kind(r: graphed::Result<()>) -> Option<GraphedErrorKind> {
    match r {
        Err(Error::Graphed { kind, .. }) => Some(kind),
        _ => None,
    }
}

/// A producer doubling `x` on one stream and a consumer copying it into `y` on another, three
/// steps: the consumer sees each step's `x`, with no host wait between the streams.
pub fn an_edge_orders_a_consumer_on_another_stream(dev: &Device) -> Result {
    let (a, b) = (dev.stream()?, dev.stream()?);
    let alloc = CachingAllocator::new(dev);
    let x = Tensor::from_host(&alloc, &a, &vec![1.0f32; N], &[N])?;
    let y = Tensor::zeros(&alloc, &a, &[N], graphed::device::DType::F32)?;
    a.synchronize()?;
    let edge = GraphEdge::new(dev, "x doubled")?;
    let produce = Edges { signals: &[&edge], ..Edges::default() };
    let double =
        make_graphed_fn_with_edges(&alloc, produce, |s| elementwise::scale(x.view::<f32>()?, x.view()?, 2.0, s))?;
    let consume = Edges { waits_on: &[&edge], ..Edges::default() };
    let copy =
        make_graphed_fn_with_edges(&alloc, consume, |s| elementwise::scale(y.view::<f32>()?, x.view()?, 1.0, s))?;
    for step in 1..=3 {
        double.replay(&a)?;
        copy.replay(&b)?;
        // `b` waits for `a` only through the edge: the next doubling must wait for the copy.
        a.wait_stream(&b)?;
        let want = 2f32.powi(step);
        ensure!(y.to_vec::<f32>(&b)?.iter().all(|v| *v == want), "step {step}: the consumer read another step's x");
    }
    Ok(())
}

/// Without an edge the same consumer races its producer: the checker sees it (on the simulator,
/// which checks every operation).
pub fn without_the_edge_the_checker_sees_the_race(dev: &Device) -> Result {
    if dev.kind() == DeviceKind::Cuda {
        return Ok(());
    }
    let (a, b) = (dev.stream()?, dev.stream()?);
    let alloc = CachingAllocator::new(dev);
    let x = Tensor::from_host(&alloc, &a, &vec![1.0f32; N], &[N])?;
    let y = Tensor::zeros(&alloc, &a, &[N], graphed::device::DType::F32)?;
    a.synchronize()?;
    let double = make_graphed_fn(&alloc, |s| elementwise::scale(x.view::<f32>()?, x.view()?, 2.0, s))?;
    let copy = make_graphed_fn(&alloc, |s| elementwise::scale(y.view::<f32>()?, x.view()?, 1.0, s))?;
    double.replay(&a)?;
    copy.replay(&b)?;
    b.synchronize()?;
    a.synchronize()?;
    let checker = graphed::check::Checker::of(dev).expect("the simulator is checked");
    let hazards = checker.take_hazards();
    ensure!(!hazards.is_empty(), "the unordered copy was not reported");
    Ok(())
}

/// A consumer launched with no producer replay since its last one, an edge end taken twice, and
/// both ends in one capture are refused, and a refused replay enqueues nothing; a failed capture
/// takes no edge.
pub fn edge_misuse_is_refused(dev: &Device) -> Result {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let x = Tensor::from_host(&alloc, &s, &vec![1.0f32; N], &[N])?;
    let y = Tensor::zeros(&alloc, &s, &[N], graphed::device::DType::F32)?;
    s.synchronize()?;
    let edge = GraphEdge::new(dev, "e")?;
    let double = |s: &graphed::device::Stream| elementwise::scale(x.view::<f32>()?, x.view()?, 2.0, s);
    let copy = |s: &graphed::device::Stream| elementwise::scale(y.view::<f32>()?, x.view()?, 1.0, s);
    // A capture that fails takes no end of the edge.
    let failing = make_graphed_fn_with_edges(&alloc, Edges { signals: &[&edge], ..Edges::default() }, |_| {
        Err(Error::Unsupported { op: "test", backend: "any", why: "fails on purpose" })
    });
    ensure!(failing.is_err(), "the failing capture failed");
    let producer = make_graphed_fn_with_edges(&alloc, Edges { signals: &[&edge], ..Edges::default() }, double)?;
    let again = make_graphed_fn_with_edges(&alloc, Edges { signals: &[&edge], ..Edges::default() }, double);
    ensure!(matches!(kind(again.map(|_| ())), Some(GraphedErrorKind::EdgeTaken { .. })), "a second producer");
    let both = Edges { waits_on: &[&edge], signals: &[&edge] };
    let looped = make_graphed_fn_with_edges(&alloc, both, copy);
    ensure!(matches!(kind(looped.map(|_| ())), Some(GraphedErrorKind::EdgeTaken { .. })), "both ends in one graph");
    let consumer = make_graphed_fn_with_edges(&alloc, Edges { waits_on: &[&edge], ..Edges::default() }, copy)?;
    let alone = consumer.replay(&s);
    ensure!(matches!(kind(alone), Some(GraphedErrorKind::EdgeNotProduced { .. })), "a consumer launched alone");
    ensure!(y.to_vec::<f32>(&s)?.iter().all(|v| *v == 0.0), "the refused replay enqueued its work");
    producer.replay(&s)?;
    consumer.replay(&s)?;
    let twice = consumer.replay(&s);
    ensure!(matches!(kind(twice), Some(GraphedErrorKind::EdgeNotProduced { .. })), "a consumer launched twice");
    ensure!(y.to_vec::<f32>(&s)?.iter().all(|v| *v == 2.0), "one produced step, one consumed");
    Ok(())
}

/// Two transformer layers graphed as callables, each in a pool of its own, replayed on two
/// streams as a pipeline's stages would be: layer 0 on one stream, layer 1 on the other reading
/// layer 0's output in place, ordered by an edge from layer 0's forward; and back, layer 0's
/// backward reading layer 1's input gradient in place after an edge from layer 1's backward.
/// No host wait between the streams, results bit for bit eager's, and the checker sees no race.
/// A consumer's replay before its producer's is refused, and edges given to passes the capture
/// does not make are refused before anything runs.
pub fn edges_order_callables_on_two_streams(dev: &Device) -> Result {
    use graphed::graph::{make_graphed_callables, GraphOptions, Pass, Replay};
    use graphed::nn::Inputs;

    use super::api::expect_kind;
    use super::fixtures::Model;

    let (eager, model) = (Model::new(dev)?, Model::new(dev)?);
    let (s0, s1) = (model.s.clone(), dev.stream()?);
    let (forward, backward) = (GraphEdge::new(dev, "h0 forward")?, GraphEdge::new(dev, "h1 backward")?);
    let (x0, _) = model.data(0)?;
    let samples = [Inputs::one(&x0), Inputs::one(&x0)];
    let options = || {
        GraphOptions::default()
            .pool_per_callable(true)
            .signals(0, Pass::Forward, &forward)
            .waits_on(1, Pass::Forward, &forward)
            .signals(1, Pass::Backward, &backward)
            .waits_on(0, Pass::Backward, &backward)
    };
    let unmade = make_graphed_callables(&model.alloc, &model.callables(), &samples, options().inference());
    expect_kind(unmade, |k| matches!(k, GraphedErrorKind::EdgePass { .. }))?;
    let g = make_graphed_callables(&model.alloc, &model.callables(), &samples, options())?;
    ensure!(g[1].in_place_inputs()? == [true] && g[0].in_place_grad_outputs()? == [true], "fed in place");
    let (x, dy) = model.data(1)?;
    let refused = g[1].forward_in_place(&s1, &Inputs::one(&x), Replay::caller());
    expect_kind(refused, |k| matches!(k, GraphedErrorKind::EdgeNotProduced { .. }))?;
    for k in 1..4 {
        let (x, dy) = if k == 1 { (x.clone(), dy.clone()) } else { model.data(k)? };
        let (y0, _t) = g[0].forward(&s0, &Inputs::one(&x), Replay::caller())?;
        let (y1, _t) = g[1].forward_in_place(&s1, &Inputs::one(y0[0].get()?), Replay::caller())?;
        let (dx1, _t) = g[1].backward(&s1, &[&dy])?;
        let dx1 = dx1[0].as_ref().expect("an input gradient");
        let (dx0, _t) = g[0].backward_in_place(&s0, &[dx1.get()?])?;
        let (y, dx) =
            (y1[0].get()?.to_f32_vec(&s1)?, dx0[0].as_ref().expect("an input gradient").get()?.to_f32_vec(&s0)?);
        let (ex, edy) = eager.data(k)?;
        ensure!(eager.eager(&ex, &edy)? == (y, dx), "step {k}: the two-stream replay differs from eager");
    }
    ensure!(eager.grads()? == model.grads()?, "accumulated parameter gradients differ");
    Ok(())
}
