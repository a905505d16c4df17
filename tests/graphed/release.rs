//! Releasing static state: the pool's memory goes back to the device, later calls are refused
//! and change nothing, other graphs of the pool keep replaying, and held outputs stay readable.

use anyhow::ensure;
use graphed::device::Device;
use graphed::graph::{make_graphed_callables, make_graphed_stack, GraphOptions, GraphedErrorKind, Replay};
use graphed::memory::{AllocatorConfig, CachingAllocator};
use graphed::nn::{Builder, Inputs, Linear, ParamStore, Stack};
use graphed::tensor::Tensor;

use super::api::expect_kind;
use super::fixtures::{lcg, Model, Result};

fn released(k: &GraphedErrorKind) -> bool {
    matches!(k, GraphedErrorKind::Released)
}

/// What a refused call must leave as it was: parameters, gradients and the step counter.
fn observed(m: &Model) -> Result<(Vec<f32>, Vec<f32>, Vec<u64>)> {
    Ok((m.params()?, m.grads()?, m.step.to_vec::<u64>(&m.s)?))
}

/// After a step, a released stack's pool holds and reserves nothing and its graphs leave the
/// pool's order; every later call is refused with `Released` and changes nothing; releasing
/// again is fine; a stack captured again into the same pool matches eager.
pub fn release_gives_the_pool_back(dev: &Device) -> Result {
    let eager = Model::new(dev)?;
    let stack = Model::new(dev)?;
    let mut g = stack.graph(GraphOptions::default())?;
    let (x, dy) = stack.data(1)?;
    ensure!(stack.graphed(&g, &x, &dy, Replay::caller())? == eager.eager(&x, &dy)?, "first replay differs");
    let pool = g.pool().clone();
    let held = pool.stats();
    ensure!(held.allocated > 0 && held.reserved >= held.allocated, "the graphed stack holds no pool memory: {held:?}");
    g.release_static_state()?;
    let after = pool.stats();
    ensure!((after.allocated, after.reserved) == (0, 0), "released, the pool still holds {after:?}");
    ensure!(pool.order().is_empty(), "released graphs stayed in the pool's order");
    ensure!(g.layers().iter().all(|l| l.graphs().is_empty()), "released layers still list graphs");
    let before = observed(&stack)?;
    expect_kind(g.forward(&stack.s, &x, Replay::caller()), released)?;
    expect_kind(g.backward(&stack.s, &dy), released)?;
    expect_kind(g.backward_dw(&stack.s), released)?;
    expect_kind(g.static_input(), released)?;
    expect_kind(g.static_grad_output(), released)?;
    expect_kind(g.layers()[0].static_inputs(), released)?;
    expect_kind(g.layers()[1].static_grad_outputs(), released)?;
    expect_kind(g.layers()[0].report(), released)?;
    ensure!(observed(&stack)? == before, "a refused call changed the model");
    ensure!(pool.stats() == after, "a refused call allocated from the pool");
    g.release_static_state()?;
    ensure!(pool.stats() == after && pool.order().is_empty(), "releasing again changed the pool");
    let g = stack.graph(GraphOptions::default().pool(&pool))?;
    let (x, dy) = stack.data(2)?;
    ensure!(stack.graphed(&g, &x, &dy, Replay::caller())? == eager.eager(&x, &dy)?, "replay after recapture differs");
    Ok(())
}

/// Both kinds of segments go back: fixed segments whole, expandable ones by their free end.
pub fn release_returns_fixed_and_expandable_segments(dev: &Device) -> Result {
    for expandable in [false, true] {
        let s = dev.stream()?;
        let alloc = CachingAllocator::with_config(dev, AllocatorConfig::default().expandable(expandable))?;
        let store = ParamStore::new(&alloc, &s, 2 * (8 * 8 + 8))?;
        let vb = Builder::new(&store, &alloc, &s)?;
        let stack = Stack::new(vec![
            Linear::new(&vb.pp("fc0").with_seed(1), (8, 8))?,
            Linear::new(&vb.pp("fc1").with_seed(2), (8, 8))?,
        ]);
        let x = Tensor::from_host(&alloc, &s, &lcg(32, 1), &[4, 8])?;
        let mut g = make_graphed_stack(&alloc, &stack, &x, GraphOptions::default())?;
        let y = g.forward(&s, &x, Replay::caller())?.to_owned(&alloc, &s)?;
        let dx = g.backward(&s, &y)?;
        g.join(&s)?;
        drop(dx);
        let (pool, held) = (g.pool().clone(), g.pool().stats());
        ensure!(alloc.stats().expandable == expandable, "the allocator ignored its configuration");
        ensure!(held.reserved > 0, "expandable {expandable}: the pool reserved nothing: {held:?}");
        g.release_static_state()?;
        let after = pool.stats();
        ensure!((after.allocated, after.reserved) == (0, 0), "expandable {expandable}: the pool still holds {after:?}");
    }
    Ok(())
}

/// Of two stacks sharing a pool, releasing the first takes its bytes and graphs out of the pool
/// and leaves the second replaying as eager; the pool reserves memory until the second is
/// released too.
pub fn releasing_one_stack_leaves_another_working(dev: &Device) -> Result {
    let eager = Model::new(dev)?;
    let stack = Model::new(dev)?;
    let pool = stack.alloc.new_pool();
    let mut first = stack.graph(GraphOptions::default().pool(&pool))?;
    let first_bytes = pool.stats().allocated;
    let mut second = stack.graph(GraphOptions::default().pool(&pool))?;
    let second_bytes = pool.stats().allocated - first_bytes;
    let mut order = pool.order();
    let second_graphs = order.split_off(order.len() / 2);
    ensure!(first_bytes > 0 && second_bytes > 0, "a stack holds no pool memory");
    for (k, g) in [(1, &first), (2, &second)] {
        let (x, dy) = stack.data(k)?;
        ensure!(stack.graphed(g, &x, &dy, Replay::caller())? == eager.eager(&x, &dy)?, "stack {k} differs");
    }
    first.release_static_state()?;
    let after = pool.stats();
    ensure!(
        after.allocated == second_bytes,
        "the pool holds {} bytes, the second stack {second_bytes}",
        after.allocated
    );
    ensure!(after.reserved >= second_bytes, "the pool gave back memory the second stack holds");
    ensure!(pool.order() == second_graphs, "the pool's order is not the second stack's graphs");
    for k in 3..5 {
        let (x, dy) = stack.data(k)?;
        ensure!(stack.graphed(&second, &x, &dy, Replay::caller())? == eager.eager(&x, &dy)?, "step {k} differs");
    }
    second.release_static_state()?;
    let last = pool.stats();
    ensure!((last.allocated, last.reserved) == (0, 0), "both released, the pool still holds {last:?}");
    Ok(())
}

/// An output and an input gradient held across release keep their buffers and the values of
/// the last replay (no replay can overwrite them any more); dropped, their bytes go back to the
/// pool, and to the device at `empty_cache`.
pub fn static_tensors_held_across_release_keep_their_values(dev: &Device) -> Result {
    let model = Model::new(dev)?;
    let (x0, _) = model.data(0)?;
    let mut g =
        make_graphed_callables(&model.alloc, &model.callables()[..1], &[Inputs::one(&x0)], GraphOptions::default())?;
    let (x, dy) = model.data(1)?;
    let (y, _t) = g[0].forward(&model.s, &Inputs::one(&x), Replay::caller())?;
    let (dx, _t) = g[0].backward(&model.s, &[&dy])?;
    let held = [y[0].clone(), dx[0].clone().ok_or_else(|| anyhow::anyhow!("no input gradient"))?];
    drop((y, dx));
    let read = |ts: &[graphed::graph::StaticTensor]| -> Result<Vec<Vec<f32>>> {
        ts.iter().map(|t| Ok(t.get()?.to_f32_vec(&model.s)?)).collect()
    };
    let values = read(&held)?;
    let pool = g[0].pool().clone();
    g[0].release_static_state()?;
    expect_kind(g[0].forward(&model.s, &Inputs::one(&x), Replay::caller()), released)?;
    ensure!(held.iter().all(|t| t.is_fresh()) && read(&held)? == values, "held outputs changed across release");
    let kept = pool.stats();
    let bytes: usize = held.iter().map(|t| t.get().map(Tensor::bytes)).sum::<graphed::Result<usize>>()?;
    ensure!(kept.allocated == bytes, "the pool holds {} bytes, the held tensors {bytes}", kept.allocated);
    drop(held);
    ensure!(pool.stats().allocated == 0, "dropped, the held tensors' bytes stayed allocated");
    model.alloc.empty_cache()?;
    ensure!(pool.stats().reserved == 0, "empty_cache left the released pool's memory reserved");
    Ok(())
}
