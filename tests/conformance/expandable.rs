//! Expandable segments of the caching allocator (Note [Expandable segments]): growth in place,
//! pages given back from a free end, graphs that stay valid while their pool grows, and the
//! fixed segments used where expandable ones are off.

use anyhow::ensure;
use graphed::device::{CaptureMode, Device, DeviceKind};
use graphed::memory::{AllocatorConfig, CachingAllocator};
use graphed::ops::elementwise;

const MIB: usize = 1 << 20;

fn allocator(dev: &Device, expandable: bool) -> anyhow::Result<CachingAllocator> {
    Ok(CachingAllocator::with_config(dev, AllocatorConfig::default().expandable(expandable))?)
}

/// Eight 12 MiB blocks freed inside one capture, then one 48 MiB block in the next capture of
/// the pool: the freed range serves it with expandable segments; fixed ones (a segment per
/// 12 MiB block) cannot, and the pool reserves the larger block on top.
fn freed_blocks_serve_a_larger_request_in_a_pool(dev: &Device) -> anyhow::Result<()> {
    const N: usize = 3 * MIB; // f32 elements: 12 MiB
    for expandable in [true, false] {
        let alloc = allocator(dev, expandable)?;
        let s = dev.stream()?;
        let out = dev.alloc::<f32>(2)?;
        let pool = alloc.new_pool();
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
        let small = (0..8).map(|_| alloc.alloc::<f32>(&s, N)).collect::<graphed::Result<Vec<_>>>()?;
        for (i, b) in small.iter().enumerate() {
            elementwise::fill(b.view(), i as f32, &s)?;
        }
        elementwise::scale(out.slice(0..1), small[7].slice(N - 1..), 1.0, &s)?;
        drop(small);
        let first = cap.finish()?.instantiate()?;
        let before = pool.stats();
        let largest = if expandable { 96 * MIB } else { 12 * MIB };
        ensure!(before.reserved == 96 * MIB && before.largest_free == largest, "expandable {expandable}: {before:?}");
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
        let big = alloc.alloc::<f32>(&s, 4 * N)?;
        elementwise::fill(big.view(), 5.0, &s)?;
        elementwise::scale(out.slice(1..2), big.slice(4 * N - 1..), 1.0, &s)?;
        drop(big);
        let second = cap.finish()?.instantiate()?;
        let after = pool.stats();
        match expandable {
            true => ensure!(after.reserved == before.reserved, "the freed range should serve 48 MiB: {after:?}"),
            false => ensure!(after.reserved == before.reserved + 48 * MIB, "fixed segments fragment: {after:?}"),
        }
        ensure!(after.peak_allocated == 96 * MIB && after.allocated == 0, "{after:?}");
        for _ in 0..2 {
            out.write_from(&s, &[0.0; 2])?;
            first.launch(&s)?;
            second.launch(&s)?;
            ensure!(out.to_vec(&s)? == vec![7.0, 5.0], "expandable {expandable}: replays read {:?}", out.to_vec(&s)?);
        }
    }
    Ok(())
}

/// Elements of an f32 buffer just above 1 MiB: the smallest that an expandable segment serves
/// (smaller requests take small segments, Note [Small segments]).
const JUST_LARGE: usize = MIB / 4 + 256;

/// A 20 MiB block after a 1 MiB one, freed: `empty_cache` unmaps the pages past the first one
/// and keeps the first one's page, whose contents stay.
fn the_free_end_of_the_cache_goes_back_to_the_device(dev: &Device) -> anyhow::Result<()> {
    let alloc = allocator(dev, true)?;
    let s = dev.stream()?;
    let a = alloc.alloc::<f32>(&s, JUST_LARGE)?;
    let b = alloc.alloc::<f32>(&s, 5 * MIB)?;
    elementwise::fill(a.view(), 3.0, &s)?;
    elementwise::fill(b.view(), 4.0, &s)?;
    let st = alloc.stats();
    ensure!(st.expandable && st.default.reserved == 22 * MIB, "a 2 MiB page, then 20 MiB after a's 1 MiB: {st:?}");
    let seg = |buf: &graphed::device::DeviceBuffer<f32>| alloc.block_of(buf.id()).map(|e| e.info.segment);
    ensure!(seg(&a) == seg(&b), "b extends the segment a is in");
    let (free_before, _) = dev.memory_info()?;
    drop(b);
    alloc.empty_cache()?;
    let st = alloc.stats().default;
    ensure!(
        st.reserved == 2 * MIB && st.largest_free == 2 * MIB - 4 * JUST_LARGE && st.peak_reserved == 22 * MIB,
        "{st:?}"
    );
    if dev.kind() == DeviceKind::Cuda {
        // The simulator's free memory also depends on the host's; the lib tests check it exactly.
        let (free_after, _) = dev.memory_info()?;
        ensure!(free_after >= free_before + 16 * MIB, "the driver got no pages back: {free_before} -> {free_after}");
    }
    ensure!(a.to_vec(&s)? == vec![3.0; JUST_LARGE], "the page kept mapped keeps its contents");
    drop(a);
    alloc.empty_cache()?;
    ensure!(alloc.stats().default.reserved == 0, "{:?}", alloc.stats());
    let c = alloc.alloc::<f32>(&s, JUST_LARGE)?;
    elementwise::fill(c.view(), 1.0, &s)?;
    ensure!(c.to_vec(&s)? == vec![1.0; JUST_LARGE], "pages map again where they were given back");
    Ok(())
}

/// A forward graph saves an activation in the pool; a second capture needs 24 MiB more and the
/// pool grows after the activation; a third graph reads the activation. Replays see the right
/// data (addresses did not move), and the pool keeps its pages while its graphs can run.
fn a_pool_that_grows_between_captures_keeps_earlier_graphs_valid(dev: &Device) -> anyhow::Result<()> {
    const N: usize = JUST_LARGE;
    const BIG: usize = 6 * MIB;
    let alloc = allocator(dev, true)?;
    let s = dev.stream()?;
    let x = dev.alloc::<f32>(N)?;
    let out = dev.alloc::<f32>(N)?;
    let pool = alloc.new_pool();
    let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
    let act = alloc.alloc::<f32>(&s, N)?;
    elementwise::scale(act.view(), x.view(), 2.0, &s)?;
    let forward = cap.finish()?;
    let act_at = alloc.block_of(act.id()).map(|e| (e.info.segment, e.info.offset));
    ensure!(pool.stats().reserved == 2 * MIB);
    let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
    let big = alloc.alloc::<f32>(&s, BIG)?;
    elementwise::fill(big.view(), 1.0, &s)?;
    elementwise::scale(out.view(), act.view(), 10.0, &s)?;
    elementwise::axpy(out.view(), big.slice(BIG - N..), 1.0, &s)?;
    drop(big);
    let middle = cap.finish()?;
    ensure!(pool.stats().reserved == 26 * MIB, "the pool grew in place: {:?}", pool.stats());
    ensure!(alloc.pool_segments(&pool).len() == 1, "one address range serves the pool");
    ensure!(alloc.block_of(act.id()).map(|e| (e.info.segment, e.info.offset)) == act_at, "the activation did not move");
    let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
    elementwise::axpy(out.view(), act.view(), 1.0, &s)?;
    drop(act);
    let backward = cap.finish()?;
    let mut execs = [forward.instantiate()?, middle.instantiate()?, backward.instantiate()?];
    for step in 1..=3 {
        let v = step as f32;
        x.write_from(&s, &vec![v; N])?;
        for exec in &execs {
            exec.launch(&s)?;
        }
        ensure!(out.to_vec(&s)? == vec![22.0 * v + 1.0; N], "step {step}: {:?}", &out.to_vec(&s)?[..2]);
    }
    alloc.empty_cache()?;
    ensure!(pool.stats().reserved == 26 * MIB, "pages stay while the pool's graphs can run: {:?}", pool.stats());
    for exec in &mut execs {
        exec.reset()?;
    }
    alloc.empty_cache()?;
    ensure!(pool.stats().reserved == 0, "an idle pool gives its free pages back: {:?}", pool.stats());
    Ok(())
}

/// A pool's first growth (reserving its range, mapping pages) happens inside a global-mode
/// capture, which forbids synchronous calls on every thread: the allocator grows in relaxed
/// mode, and the capture stays valid.
fn a_pool_grows_inside_a_global_capture(dev: &Device) -> anyhow::Result<()> {
    const N: usize = 4 * MIB;
    let alloc = allocator(dev, true)?;
    let s = dev.stream()?;
    let out = dev.alloc::<f32>(1)?;
    let pool = alloc.new_pool();
    let cap = alloc.capture(&s, CaptureMode::Global, &pool)?;
    let tmp = alloc.alloc::<f32>(&s, N)?;
    elementwise::fill(tmp.view(), 6.0, &s)?;
    elementwise::scale(out.view(), tmp.slice(N - 1..), 0.5, &s)?;
    drop(tmp);
    let exec = cap.finish()?.instantiate()?;
    ensure!(pool.stats().reserved == 16 * MIB, "{:?}", pool.stats());
    exec.launch(&s)?;
    ensure!(out.to_vec(&s)? == vec![3.0]);
    Ok(())
}

/// A 32 MiB activation freed in one capture of a pool, below a 4 MiB block that stays, then two
/// 1 MiB requests and a 32 MiB one in the next capture (what an offloading pool does at L): the
/// small requests take a 2 MiB small segment and the freed 32 MiB serves the larger request
/// whole, so the pool reserves 38 MiB, not the 68 it did when the small requests split the freed
/// block and the 32 MiB went past the block that stays (Note [Small segments]). The replays read
/// what each capture wrote.
fn small_requests_leave_a_freed_large_block_whole(dev: &Device) -> anyhow::Result<()> {
    const ACT: usize = 8 * MIB; // f32 elements: 32 MiB
    const ONE: usize = MIB / 4; // 1 MiB
    let alloc = allocator(dev, true)?;
    let s = dev.stream()?;
    let out = dev.alloc::<f32>(3)?;
    let pool = alloc.new_pool();
    let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
    let (act, kept) = (alloc.alloc::<f32>(&s, ACT)?, alloc.alloc::<f32>(&s, MIB)?);
    elementwise::fill(act.view(), 2.0, &s)?;
    elementwise::fill(kept.view(), 0.0, &s)?;
    elementwise::scale(out.slice(0..1), act.slice(ACT - 1..), 1.0, &s)?;
    drop(act);
    let first = cap.finish()?.instantiate()?;
    let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
    let (one, two) = (alloc.alloc::<f32>(&s, ONE)?, alloc.alloc::<f32>(&s, ONE)?);
    let next = alloc.alloc::<f32>(&s, ACT)?;
    elementwise::fill(one.view(), 3.0, &s)?;
    elementwise::fill(two.view(), 4.0, &s)?;
    elementwise::fill(next.view(), 5.0, &s)?;
    elementwise::scale(out.slice(1..2), one.slice(ONE - 1..), 1.0, &s)?;
    elementwise::axpy(out.slice(1..2), two.slice(ONE - 1..), 1.0, &s)?;
    elementwise::scale(out.slice(2..3), next.slice(ACT - 1..), 1.0, &s)?;
    let same = alloc.block_of(next.id()).map(|e| e.info.offset) == Some(0);
    drop((one, two, next, kept));
    let second = cap.finish()?.instantiate()?;
    let st = pool.stats();
    ensure!(same && st.reserved == 38 * MIB, "the freed 32 MiB should serve the next 32 MiB: {st:?}");
    first.launch(&s)?;
    second.launch(&s)?;
    ensure!(out.to_vec(&s)? == vec![2.0, 7.0, 5.0], "replays read {:?}", out.to_vec(&s)?);
    Ok(())
}

/// With expandable segments off, segments are fixed device allocations as before: sized by
/// request class, reused, and given back whole.
fn fixed_segments_serve_as_before_when_expandable_is_off(dev: &Device) -> anyhow::Result<()> {
    let alloc = allocator(dev, false)?;
    let s = dev.stream()?;
    ensure!(!alloc.stats().expandable);
    let a = alloc.alloc::<f32>(&s, 1000)?;
    let b = alloc.alloc::<f32>(&s, 3 * MIB / 4)?;
    elementwise::fill(a.view(), 1.0, &s)?;
    elementwise::fill(b.view(), 2.0, &s)?;
    ensure!(alloc.stats().default.reserved == 22 * MIB, "a 2 MiB and a 20 MiB segment: {:?}", alloc.stats());
    drop((a, b));
    alloc.empty_cache()?;
    ensure!(alloc.stats().default.reserved == 0);
    let out = dev.alloc::<f32>(256)?;
    let pool = alloc.new_pool();
    let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
    let small = alloc.alloc::<f32>(&s, 256)?;
    let large = alloc.alloc::<f32>(&s, 3 * MIB)?;
    elementwise::fill(small.view(), 1.0, &s)?;
    elementwise::fill(large.view(), 2.0, &s)?;
    elementwise::scale(out.view(), small.view(), 3.0, &s)?;
    elementwise::axpy(out.view(), large.slice(..256), 1.0, &s)?;
    drop((small, large));
    let exec = cap.finish()?.instantiate()?;
    ensure!(alloc.pool_segments(&pool).len() == 2 && pool.stats().reserved == 14 * MIB, "{:?}", pool.stats());
    exec.launch(&s)?;
    ensure!(out.to_vec(&s)? == vec![5.0; 256]);
    Ok(())
}

crate::per_device!(
    freed_blocks_serve_a_larger_request_in_a_pool,
    the_free_end_of_the_cache_goes_back_to_the_device,
    small_requests_leave_a_freed_large_block_whole,
    a_pool_that_grows_between_captures_keeps_earlier_graphs_valid,
    a_pool_grows_inside_a_global_capture,
    fixed_segments_serve_as_before_when_expandable_is_off,
);
