//! The caching allocator and graph pools (replay contract R5), on both devices.

use anyhow::ensure;
use graphed::device::{CaptureMode, CaptureStatus, Device};
use graphed::memory::{CachingAllocator, PoolExec};
use graphed::ops::elementwise;
use graphed::Error;

fn a_block_is_reused_by_its_stream_and_by_others_after_an_ordering(dev: &Device) -> anyhow::Result<()> {
    let alloc = CachingAllocator::new(dev);
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    let at =
        |buf: &graphed::device::DeviceBuffer<f32>| alloc.block_of(buf.id()).map(|b| (b.info.segment, b.info.offset));
    let a = alloc.alloc::<f32>(&s1, 1000)?;
    elementwise::fill(a.view(), 1.0, &s1)?;
    let a_at = at(&a);
    ensure!(a_at.is_some());
    s1.synchronize()?;
    drop(a);
    let b = alloc.alloc::<f32>(&s2, 1000)?;
    ensure!(at(&b) != a_at, "another stream must not reuse the block before an ordering");
    let c = alloc.alloc::<f32>(&s1, 1000)?;
    ensure!(at(&c) == a_at, "the stream that freed the block reuses it at once");
    let st = alloc.stats();
    ensure!(st.default.allocated == 8192 && st.default.reserved == 2 << 20, "one segment serves both: {st:?}");
    elementwise::fill(b.view(), 2.0, &s2)?;
    drop((b, c));
    alloc.synchronize()?;
    let d = alloc.alloc::<f32>(&s2, 1000)?;
    ensure!(at(&d) == a_at, "after synchronize any stream reuses it (best fit, lowest address)");
    elementwise::fill(d.view(), 3.0, &s2)?;
    ensure!(d.to_vec(&s2)? == vec![3.0; 1000]);
    ensure!(alloc.stats().default.peak_allocated == 8192);
    drop(d);
    alloc.empty_cache()?;
    ensure!(alloc.stats().default.reserved == 0, "empty_cache gives segments back: {:?}", alloc.stats());
    Ok(())
}

fn poisoned_blocks_read_as_nan(dev: &Device) -> anyhow::Result<()> {
    let alloc = CachingAllocator::with_poison(dev);
    let s = dev.stream()?;
    let x = alloc.alloc::<f32>(&s, 64)?;
    ensure!(x.to_vec(&s)?.iter().all(|v| v.is_nan()));
    elementwise::fill(x.view(), 3.0, &s)?;
    drop(x);
    let y = alloc.alloc::<f32>(&s, 64)?;
    ensure!(y.to_vec(&s)?.iter().all(|v| v.is_nan()), "a reused block is poisoned again");
    Ok(())
}

fn allocating_in_a_foreign_capture_is_refused(dev: &Device) -> anyhow::Result<()> {
    let alloc = CachingAllocator::new(dev);
    let s = dev.stream()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    ensure!(matches!(alloc.alloc::<f32>(&s, 4), Err(Error::NoCapturePool { .. })));
    cap.finish()?;
    Ok(())
}

/// Forward and backward graphs of two layers, captured in execution order into one pool:
/// F1, F2 save activations; B2 frees act2, whose block B1's scratch then reuses.
struct TwoLayers {
    f1: PoolExec,
    f2: PoolExec,
    b2: PoolExec,
    b1: PoolExec,
    out1: graphed::device::DeviceBuffer<f32>,
    out2: graphed::device::DeviceBuffer<f32>,
    pool: graphed::memory::GraphPool,
}

fn two_layers(dev: &Device, alloc: &CachingAllocator, s: &graphed::device::Stream) -> anyhow::Result<TwoLayers> {
    const N: usize = 256;
    let x = alloc.alloc::<f32>(s, N)?;
    elementwise::fill(x.view(), 1.0, s)?;
    let out1 = dev.alloc::<f32>(N)?;
    let out2 = dev.alloc::<f32>(N)?;
    let pool = alloc.new_pool();
    let cap = alloc.capture(s, CaptureMode::ThreadLocal, &pool)?;
    let act1 = alloc.alloc::<f32>(s, N)?;
    elementwise::scale(act1.view(), x.view(), 1.0, s)?;
    let f1 = cap.finish()?;
    let cap = alloc.capture(s, CaptureMode::ThreadLocal, &pool)?;
    let act2 = alloc.alloc::<f32>(s, N)?;
    elementwise::scale(act2.view(), x.view(), 2.0, s)?;
    let f2 = cap.finish()?;
    let cap = alloc.capture(s, CaptureMode::ThreadLocal, &pool)?;
    elementwise::scale(out2.view(), act2.view(), 10.0, s)?;
    drop(act2);
    let b2 = cap.finish()?;
    let cap = alloc.capture(s, CaptureMode::ThreadLocal, &pool)?;
    let scratch = alloc.alloc::<f32>(s, N)?;
    elementwise::fill(scratch.view(), 99.0, s)?;
    elementwise::scale(out1.view(), act1.view(), 10.0, s)?;
    drop((scratch, act1));
    let b1 = cap.finish()?;
    let reserved = alloc.stats().pools[0].1.reserved;
    ensure!(reserved == 2 << 20, "the four graphs share one segment: {reserved}");
    Ok(TwoLayers {
        f1: f1.instantiate()?,
        f2: f2.instantiate()?,
        b2: b2.instantiate()?,
        b1: b1.instantiate()?,
        out1,
        out2,
        pool,
    })
}

fn pool_graphs_replay_in_capture_order(dev: &Device) -> anyhow::Result<()> {
    let alloc = CachingAllocator::new(dev);
    let s = dev.stream()?;
    let g = two_layers(dev, &alloc, &s)?;
    for _ in 0..3 {
        for exec in [&g.f1, &g.f2, &g.b2, &g.b1] {
            exec.launch(&s)?;
        }
        ensure!(g.out2.to_vec(&s)? == vec![20.0; 256] && g.out1.to_vec(&s)? == vec![10.0; 256]);
    }
    Ok(())
}

fn out_of_order_replay_is_refused_and_corrupts_unchecked(dev: &Device) -> anyhow::Result<()> {
    let alloc = CachingAllocator::new(dev);
    let s = dev.stream()?;
    let g = two_layers(dev, &alloc, &s)?;
    g.f1.launch(&s)?;
    g.f2.launch(&s)?;
    match g.b1.launch(&s) {
        Err(Error::PoolOrder { graph, expected, .. }) => ensure!(graph == g.b1.id() && expected == g.b2.id()),
        other => anyhow::bail!("expected PoolOrder, got {other:?}"),
    }
    g.pool.disable_order_check();
    g.b1.launch(&s)?;
    g.b2.launch(&s)?;
    let out2 = g.out2.to_vec(&s)?;
    ensure!(out2 == vec![990.0; 256], "B1's scratch overwrote the activation B2 reads: {:?}", &out2[..2]);
    Ok(())
}

fn concurrent_replay_is_refused_until_joined(dev: &Device) -> anyhow::Result<()> {
    let alloc = CachingAllocator::new(dev);
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    let g = two_layers(dev, &alloc, &s1)?;
    g.f1.launch(&s1)?;
    match g.f2.launch(&s2) {
        Err(Error::PoolConcurrent { graph, previous, stream, previous_stream, .. }) => {
            ensure!((graph, previous, stream, previous_stream) == (g.f2.id(), g.f1.id(), s2.id(), s1.id()))
        }
        other => anyhow::bail!("expected PoolConcurrent, got {other:?}"),
    }
    g.pool.join(&s2)?;
    g.f2.launch(&s2)?;
    g.b2.launch(&s2)?;
    g.b1.launch(&s2)?;
    ensure!(g.out2.to_vec(&s2)? == vec![20.0; 256] && g.out1.to_vec(&s2)? == vec![10.0; 256]);
    Ok(())
}

/// `launch_on` makes the replay stream wait for the caller's and tells the pool, so a replay on a
/// side stream follows one on the caller's without a join; an out-of-order launch is refused
/// before its wait is enqueued: inside a capture of the caller's stream, the side stream does not
/// join the capture and the captured graph is empty.
fn an_out_of_order_launch_on_a_side_stream_is_refused_before_anything_is_enqueued(dev: &Device) -> anyhow::Result<()> {
    let alloc = CachingAllocator::new(dev);
    let (caller, side) = (dev.stream()?, dev.stream()?);
    let g = two_layers(dev, &alloc, &caller)?;
    g.f1.launch(&caller)?;
    let cap = caller.capture(CaptureMode::ThreadLocal)?;
    match g.b1.launch_on(&side, &caller) {
        Err(Error::PoolOrder { graph, expected, .. }) => ensure!(graph == g.b1.id() && expected == g.f2.id()),
        other => anyhow::bail!("expected PoolOrder, got {other:?}"),
    }
    ensure!(side.capture_status()? == CaptureStatus::None, "the refused launch made the side stream wait");
    ensure!(cap.finish()?.nodes()?.is_empty(), "the refused launch enqueued work on the caller's stream");
    g.f2.launch_on(&side, &caller)?;
    g.b2.launch_on(&side, &caller)?;
    g.b1.launch_on(&side, &caller)?;
    g.pool.join(&caller)?;
    ensure!(g.out2.to_vec(&caller)? == vec![20.0; 256] && g.out1.to_vec(&caller)? == vec![10.0; 256]);
    Ok(())
}

/// A pool belongs to the allocator that made it: capturing into another allocator's pool (which
/// may have the same id as one of this allocator's) is refused before the capture begins, and
/// changes nothing; each allocator still captures into its own pool.
fn a_pool_of_another_allocator_is_refused(dev: &Device) -> anyhow::Result<()> {
    let (a, b) = (CachingAllocator::new(dev), CachingAllocator::new(dev));
    let (own, foreign) = (a.new_pool(), b.new_pool());
    ensure!(own.id() == foreign.id(), "pool ids count from 1 in every allocator");
    let s = dev.stream()?;
    match a.capture(&s, CaptureMode::ThreadLocal, &foreign) {
        Err(Error::ForeignPool { pool, .. }) if pool == foreign.id() => {}
        other => anyhow::bail!("a capture into another allocator's pool: {:?}", other.map(|_| ())),
    }
    ensure!(s.capture_id()?.is_none(), "the refused capture began");
    ensure!(own.order().is_empty() && foreign.order().is_empty(), "the refusal changed a pool's order");
    for (alloc, pool) in [(&a, &own), (&b, &foreign)] {
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, pool)?;
        let x = alloc.alloc::<f32>(&s, 4)?;
        elementwise::fill(x.view(), 1.0, &s)?;
        drop(x);
        cap.finish()?;
        ensure!(pool.order().len() == 1, "a capture into the allocator's own pool");
    }
    Ok(())
}

/// `headroom` is the largest request its stream's arena serves without reserving more or
/// raising its allocated peak: the cache's outside captures, the pool's within one.
fn headroom_is_what_a_request_takes_without_growing_the_arena(dev: &Device) -> anyhow::Result<()> {
    const MIB: usize = 1 << 20;
    let alloc = CachingAllocator::new(dev);
    let s = dev.stream()?;
    ensure!(alloc.headroom(&s)? == 0, "a new allocator holds nothing");
    let a = alloc.alloc::<u8>(&s, 4 * MIB)?;
    let b = alloc.alloc::<u8>(&s, 4 * MIB)?;
    ensure!(alloc.headroom(&s)? == 0, "at its peak, any request would raise it");
    drop(a);
    ensure!(alloc.headroom(&s)? == 4 * MIB, "the freed block, which is the peak's margin too");
    let before = alloc.stats().total;
    let c = alloc.alloc::<u8>(&s, alloc.headroom(&s)?)?;
    let after = alloc.stats().total;
    ensure!(
        (after.reserved, after.peak_allocated) == (before.reserved, before.peak_allocated),
        "taking the headroom grew the allocator: {before:?} then {after:?}"
    );
    ensure!(alloc.headroom(&s)? == 0);
    let pool = alloc.new_pool();
    let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
    ensure!(alloc.headroom(&s)? == 0, "a capture asks its pool, which holds nothing yet");
    let x = alloc.alloc::<f32>(&s, MIB)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    drop(x);
    ensure!(alloc.headroom(&s)? == 4 * MIB, "the pool's freed block");
    cap.finish()?;
    let foreign = s.capture(CaptureMode::ThreadLocal)?;
    ensure!(matches!(alloc.headroom(&s), Err(Error::NoCapturePool { .. })));
    foreign.finish()?;
    drop((b, c));
    Ok(())
}

crate::per_device!(
    headroom_is_what_a_request_takes_without_growing_the_arena,
    a_pool_of_another_allocator_is_refused,
    a_block_is_reused_by_its_stream_and_by_others_after_an_ordering,
    poisoned_blocks_read_as_nan,
    allocating_in_a_foreign_capture_is_refused,
    pool_graphs_replay_in_capture_order,
    out_of_order_replay_is_refused_and_corrupts_unchecked,
    concurrent_replay_is_refused_until_joined,
    an_out_of_order_launch_on_a_side_stream_is_refused_before_anything_is_enqueued,
);
