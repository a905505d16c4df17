//! Offloading changes no bit: eager with and without it, and graphed with it against eager with
//! it and graphed without it, on every replay mode; and the bytes it saves.

use anyhow::ensure;
use graphed::device::{DType, Device};
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, Replay};
use graphed::nn::{AttentionKind, Chunk, Inputs, KeepOnDevice};
use graphed::offload::{OffloadConfig, OffloadErrorKind, OffloadManager};

use super::fixtures::{config, Dims, Model, Result, DIMS};

const STEPS: u64 = 3;

/// Twin models, one eager as usual, one eager through the offload manager: outputs, input
/// gradients and accumulated parameter gradients are equal bit for bit, and bytes were copied.
fn eager_twins(dev: &Device, dtype: DType, attention: AttentionKind) -> Result {
    let dims = Dims { attention, ..DIMS };
    let plain = Model::new(dev, dims, dtype)?;
    let off = Model::new(dev, dims, dtype)?;
    plain.skip_first()?;
    let m = off.offload(config())?;
    let summary = m.summary().ok_or_else(|| anyhow::anyhow!("no summary"))?;
    // Units 0..3 offload the 6 default tensors of 512 elements; the margin keeps unit 3.
    let per_unit = 6 * 512 * dtype.size();
    ensure!(
        summary.offloaded_bytes() == 3 * per_unit,
        "offloaded {} bytes, not {}",
        summary.offloaded_bytes(),
        3 * per_unit
    );
    let layout = m.layout(Chunk::default());
    let saved: Vec<_> = layout.iter().flat_map(|g| &g.tensors).collect();
    // The unfused form saves the softmax matrix, which the default sites never offload; the
    // fused one saves none.
    let probs = saved.iter().filter(|t| t.name == "probs").count();
    let expected = if attention == AttentionKind::Unfused { DIMS.layers } else { 0 };
    ensure!(probs == expected, "{probs} saved softmax matrices, expected {expected}");
    ensure!(saved.iter().all(|t| t.name != "probs" || !t.offload), "the softmax matrix is never offloaded");
    let hook = m.chunk(Chunk::default());
    for k in 1..=STEPS {
        let before = m.stats().copied_out;
        ensure!(
            plain.eager(&KeepOnDevice, k)? == off.eager(&hook, k)?,
            "microbatch {k}: outputs or input gradients differ"
        );
        ensure!(plain.grads()? == off.grads()?, "microbatch {k}: parameter gradients differ");
        ensure!(m.stats().copied_out - before == 3 * per_unit, "microbatch {k}: not every selected tensor was copied");
        m.end_iteration(&off.s)?;
    }
    Ok(())
}

/// Candidate sites (`OffloadConfig::candidates`) that select nothing the model saves are
/// skipped, where the same list as sites is refused, naming the selector.
pub fn candidates_that_select_nothing_are_skipped(dev: &Device) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let sites = ["attn.qkv", "mlp.nothing"];
    let err = model.offload(config().sites(&sites)).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(err.contains("mlp.nothing"), "sites: {err}");
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = model.offload(config().candidates(&sites))?;
    let summary = m.summary().ok_or_else(|| anyhow::anyhow!("no summary"))?;
    ensure!(summary.offloaded_bytes() == 3 * 3 * 512 * 4, "qkv of units 0..3 offloaded: {summary}");
    Ok(())
}

pub fn eager_offload_is_bitwise_eager(dev: &Device) -> Result {
    eager_twins(dev, DType::F32, AttentionKind::Fused)
}

pub fn eager_offload_is_bitwise_eager_in_bf16(dev: &Device) -> Result {
    eager_twins(dev, DType::BF16, AttentionKind::Fused)
}

pub fn eager_offload_is_bitwise_eager_unfused(dev: &Device) -> Result {
    eager_twins(dev, DType::F32, AttentionKind::Unfused)
}

#[derive(Clone, Copy)]
enum How {
    Caller,
    Joined,
    Side,
}

/// Three twins: eager with offloading, graphed without, graphed with (its policy recorded by
/// the capture's warmup); all equal bit for bit, and both managers decided alike.
fn graphed_twins(dev: &Device, how: How, dtype: DType) -> Result {
    let eager = Model::new(dev, DIMS, dtype)?;
    let plain = Model::new(dev, DIMS, dtype)?;
    let off = Model::new(dev, DIMS, dtype)?;
    let me = eager.offload(config())?;
    let mo = OffloadManager::new(&off.alloc, config())?;
    plain.skip_first()?;
    off.skip_first()?;
    let (side, e1, e2) = (dev.stream()?, dev.event()?, dev.event()?);
    let options = |e| match how {
        How::Side => GraphOptions::default().sync_event(e),
        _ => GraphOptions::default(),
    };
    let gp = plain.graph(options(&e1))?;
    let go = off.graph(mo.graph_options(options(&e2)))?;
    ensure!(mo.layout(Chunk::default()) == me.layout(Chunk::default()), "the capture recorded another layout");
    let replay = match how {
        How::Caller => Replay::caller(),
        How::Joined => Replay::joined(&side),
        How::Side => Replay::side(&side),
    };
    let hook = me.chunk(Chunk::default());
    for k in 1..=STEPS {
        let want = eager.eager(&hook, k)?;
        ensure!(plain.graphed(&gp, k, replay)? == want, "microbatch {k}: graphed differs from eager with offloading");
        ensure!(off.graphed(&go, k, replay)? == want, "microbatch {k}: graphed with offloading differs");
        let grads = eager.grads()?;
        ensure!(plain.grads()? == grads && off.grads()? == grads, "microbatch {k}: parameter gradients differ");
        me.end_iteration(&eager.s)?;
    }
    Ok(())
}

pub fn graphed_offload_on_caller_matches(dev: &Device) -> Result {
    graphed_twins(dev, How::Caller, DType::F32)
}

pub fn graphed_offload_joined_matches(dev: &Device) -> Result {
    graphed_twins(dev, How::Joined, DType::F32)
}

pub fn graphed_offload_side_stream_matches(dev: &Device) -> Result {
    graphed_twins(dev, How::Side, DType::F32)
}

pub fn graphed_offload_side_stream_matches_in_bf16(dev: &Device) -> Result {
    graphed_twins(dev, How::Side, DType::BF16)
}

/// Offloading with lent gradients (`GraphOptions::lend_gradients`), on a side stream: the
/// copies out in the forwards' tails read activations that live in the gradients of the layers
/// below, which the sync-point rules accept as pool memory, and every microbatch equals eager
/// with offloading bit for bit, its gradients those of that microbatch alone (each backward
/// zeroes its layer's gradients first).
pub fn graphed_offload_with_lent_gradients_matches(dev: &Device) -> Result {
    let eager = Model::new(dev, DIMS, DType::BF16)?;
    let off = Model::new(dev, DIMS, DType::BF16)?;
    let me = eager.offload(config())?;
    let mo = OffloadManager::new(&off.alloc, config())?;
    off.skip_first()?;
    let (side, event) = (dev.stream()?, dev.event()?);
    let go = off.graph(mo.graph_options(GraphOptions::default().sync_event(&event).lend_gradients(true)))?;
    ensure!(off.alloc.blocks().iter().any(|b| b.lent), "no layer lent its gradients");
    let hook = me.chunk(Chunk::default());
    for k in 1..=STEPS {
        eager.store.grads()?.zero(&eager.s)?;
        let want = eager.eager(&hook, k)?;
        ensure!(off.graphed(&go, k, Replay::side(&side))? == want, "microbatch {k}: outputs or input gradients differ");
        ensure!(off.grads()? == eager.grads()?, "microbatch {k}: parameter gradients differ");
        go.take_gradients()?;
        me.end_iteration(&eager.s)?;
    }
    Ok(())
}

/// The whole stack as one graphed callable: every unit's copies and copies back are in one
/// forward and one backward graph, so a copy back and its use meet in one capture and are
/// joined there (H5).
pub fn whole_stack_graph_with_offload_matches(dev: &Device) -> Result {
    // Without dropout: a stack graphed as one callable draws from its step counter in the warmup.
    let dims = Dims { dropout: 0.0, ..DIMS };
    let eager = Model::new(dev, dims, DType::F32)?;
    let off = Model::new(dev, dims, DType::F32)?;
    let m = OffloadManager::new(&off.alloc, config())?;
    let (x0, _) = off.data(0)?;
    let e = dev.event()?;
    let options = m.graph_options(GraphOptions::default().sync_event(&e));
    let g = make_graphed_callables(&off.alloc, &[&off.stack as &dyn Callable], &[Inputs::one(&x0)], options)?;
    let side = dev.stream()?;
    for k in 1..=STEPS {
        let want = eager.eager(&KeepOnDevice, k)?;
        let (x, dy) = off.data(k)?;
        let (y, t1) = g[0].forward(&off.s, &Inputs::one(&x), Replay::side(&side))?;
        let y = y[0].get()?.to_f32_vec(&off.s)?;
        let (dx, t2) = g[0].backward(&off.s, &[&dy])?;
        let dx = dx[0].as_ref().ok_or_else(|| anyhow::anyhow!("no input gradient"))?.get()?.to_f32_vec(&off.s)?;
        t1.join(&off.s)?;
        t2.join(&off.s)?;
        ensure!((y, dx) == want, "microbatch {k}: the whole-stack graph with offloading differs");
        ensure!(eager.grads()? == off.grads()?, "microbatch {k}: parameter gradients differ");
    }
    Ok(())
}

/// The graph pool's peak with offloading is lower than without by the summary's expected
/// saving, within 10%, for 4 and 6 layers: with the default margin (two kept), one or three
/// kept, and byte budgets that offload part of a layer. The default saves at least 90% of the
/// bytes it copies out.
pub fn peak_memory_falls_by_the_offloaded_bytes(dev: &Device) -> Result {
    let peak = |model: &Model, pool: graphed::memory::PoolId| {
        model.alloc.stats().pools.iter().find(|(id, _)| *id == pool).map(|(_, s)| s.peak_allocated).unwrap_or(0)
    };
    // A unit's default sites hold 6 tensors of 512 f32: 12 KiB.
    let cases = [
        ("the default margin", OffloadConfig::default().min_elements(256)),
        ("one kept", config()),
        ("three kept", config().margin(3)),
        ("a budget of 3/4 unit", config().max_bytes(9 * 2048)),
        ("a budget of 5/4 units", config().max_bytes(15 * 2048)),
    ];
    for layers in [4, 6] {
        let dims = Dims { layers, ..DIMS };
        let plain = Model::new(dev, dims, DType::F32)?;
        let gp = plain.graph(GraphOptions::default())?;
        let base = peak(&plain, gp.pool().id());
        for (name, config) in &cases {
            let off = Model::new(dev, dims, DType::F32)?;
            let m = OffloadManager::new(&off.alloc, config.clone())?;
            let go = off.graph(m.graph_options(GraphOptions::default()))?;
            let with = peak(&off, go.pool().id());
            let saved = base as f64 - with as f64;
            let summary = m.summary().ok_or_else(|| anyhow::anyhow!("no summary"))?;
            let (expected, offloaded) = (summary.expected_peak_saving() as f64, summary.offloaded_bytes() as f64);
            let case = format!("{layers} layers, {name}: peak {base} B without offloading, {with} B with");
            ensure!(expected > 0.0, "{case}: nothing expected to be saved");
            ensure!((saved - expected).abs() <= 0.1 * expected, "{case}: saved {saved} B, expected {expected} B");
            if *name == "the default margin" {
                ensure!(saved >= 0.9 * offloaded, "{case}: saved {saved} B of the {offloaded} B copied out");
            }
        }
    }
    Ok(())
}

/// With the layers' gradients lent to the pool (Note [Offloading lent memory] in
/// `offload/saving.rs`): where every layer's activations but the first's fit in the memory lent
/// by the layers below, offloading saves nothing of the pool's own memory and the summary
/// expects nothing; where they overflow it, the pool's own peak falls by the expected saving
/// within 10%, which is less than the bytes copied out. Between the two, where the passes'
/// transients decide the peak, the expectation is above the measured saving (docs/offload.md).
pub fn lent_peak_falls_by_the_expected_saving(dev: &Device) -> Result {
    let peak = |model: &Model, pool: graphed::memory::PoolId| {
        model.alloc.stats().pools.iter().find(|(id, _)| *id == pool).map(|(_, s)| s.peak_allocated).unwrap_or(0)
    };
    for (batch, seq, overflows) in [(2, 8, false), (8, 32, true)] {
        let dims = Dims { batch, seq, dropout: 0.0, ..DIMS };
        let plain = Model::new(dev, dims, DType::F32)?;
        let gp = plain.graph(GraphOptions::default().lend_gradients(true))?;
        let base = peak(&plain, gp.pool().id());
        for (name, config) in [("one kept", config()), ("no margin", config().margin(0))] {
            let off = Model::new(dev, dims, DType::F32)?;
            let m = OffloadManager::new(&off.alloc, config)?;
            let go = off.graph(m.graph_options(GraphOptions::default().lend_gradients(true)))?;
            let with = peak(&off, go.pool().id());
            let saved = base as f64 - with as f64;
            let summary = m.summary().ok_or_else(|| anyhow::anyhow!("no summary"))?;
            let (expected, offloaded) = (summary.expected_peak_saving() as f64, summary.offloaded_bytes() as f64);
            let case = format!("batch {batch}, {seq} tokens, {name}: pool peak {base} B without offloading, {with} B with, {offloaded} B copied out");
            ensure!(summary.lent && offloaded > 0.0, "{case}: nothing offloaded, or lending not seen:\n{summary}");
            if overflows {
                ensure!(expected > 0.0 && expected < offloaded, "{case}: expected {expected} B");
                ensure!((saved - expected).abs() <= 0.1 * expected, "{case}: saved {saved} B, expected {expected} B");
            } else {
                ensure!(expected <= 0.0 && saved <= 0.0, "{case}: saved {saved} B, expected {expected} B");
            }
        }
    }
    Ok(())
}

/// Offloading switched without a new capture (`OffloadConfig::switchable`): the graphs with
/// offloading equal those without it bit for bit on every step, offloaded, with every offloaded
/// tensor kept resident on the third step, one of them on the fourth, and none from the fifth;
/// kept resident, the tensors' bytes are allocated on the device (in one block), and offloaded
/// again they are given back (once the work queued on the stream is done: the graphs read them
/// before; the one kept on the fourth step moves out of that block). Before the seventh step it
/// switches back and forth with nothing launched between (a benchmark's loop): each table upload
/// writes its pinned staging buffer only once the upload that read it before has (the checker
/// sees every host write). A switch between a forward and its backward is refused with nothing
/// changed, and graphs captured without the setting refuse any switch.
pub fn graphed_offload_switches_to_resident_and_back(dev: &Device) -> Result {
    let plain = Model::new(dev, DIMS, DType::F32)?;
    let off = Model::new(dev, DIMS, DType::F32)?;
    let mo = OffloadManager::new(&off.alloc, config().switchable(true))?;
    plain.skip_first()?;
    off.skip_first()?;
    let (side, e1, e2) = (dev.stream()?, dev.event()?, dev.event()?);
    let gp = plain.graph(GraphOptions::default().sync_event(&e1))?;
    let go = off.graph(mo.graph_options(GraphOptions::default().sync_event(&e2)))?;
    let offloaded = mo.summary().ok_or_else(|| anyhow::anyhow!("no summary"))?.offloaded_bytes();
    ensure!(offloaded > 0, "nothing offloaded");
    let refusal = |e: graphed::Error| match e {
        graphed::Error::Offload(kind) => Ok(kind),
        other => Err(anyhow::anyhow!("expected an offload refusal, got {other}")),
    };
    // Memory given back after the work queued on the stream (the graphs used it on the side
    // stream too): counted once that work is done.
    let allocated = || -> anyhow::Result<usize> {
        off.s.synchronize()?;
        Ok(off.alloc.stats().total.allocated)
    };
    // The copies turned off across the graphs: none while offloading (the device copies copy
    // nothing, as their table says), the host copies while kept resident.
    let turned_off = || -> anyhow::Result<Vec<&'static str>> {
        let mut ops = Vec::new();
        for layer in go.layers() {
            ops.extend(layer.report()?.graphs.into_iter().flat_map(|g| g.disabled));
        }
        ops.sort_unstable();
        ops.dedup();
        Ok(ops)
    };
    ensure!(turned_off()?.is_empty(), "offloading: {:?} off", turned_off()?);
    let mut held = 0;
    for k in 1..=8 {
        match k {
            3 => {
                // The first layer's graphs copy nothing (a layer's tensors are copied out and
                // back by the graphs of the layer above): nothing of theirs switches. Mid-step:
                // refused. Then between steps, every graph.
                ensure!(mo.keep_resident(&go.layers()[..1], &off.s, |_, _| true)?.tensors == 0);
                let (x, _) = off.data(k)?;
                let (y, _) = (go.forward(&off.s, &x, Replay::side(&side))?, ());
                let mid = refusal(mo.keep_resident(go.layers(), &off.s, |_, _| true).unwrap_err())?;
                ensure!(matches!(mid, OffloadErrorKind::SwitchMidStep { .. }), "{mid}");
                drop(y);
                let (_, dy) = off.data(k)?;
                go.backward(&off.s, &dy)?;
                go.join(&off.s)?;
                plain.graphed(&gp, k, Replay::side(&side))?;
                let (before, handed_out) =
                    (allocated()?, || off.alloc.blocks().iter().filter(|b| b.buffer.is_some()).count());
                let blocks = handed_out();
                let kept = mo.keep_resident(go.layers(), &off.s, |_, _| true)?;
                ensure!(kept.bytes == offloaded, "{} B kept of {offloaded} B offloaded", kept.bytes);
                ensure!(allocated()? >= before + offloaded, "the kept tensors' memory is allocated");
                let more = handed_out() - blocks;
                ensure!(kept.tensors > 1 && more == 1, "{} tensors kept in {more} new blocks, not one", kept.tensors);
                ensure!(turned_off()? == ["memcpy_d2h", "memcpy_h2d"], "kept resident: {:?} off", turned_off()?);
                continue;
            }
            4 => {
                // All but one offloaded again, their memory given back: this step runs so.
                let (first, before) = (std::cell::Cell::new(true), allocated()?);
                let one = mo.keep_resident(go.layers(), &off.s, |_, _| first.replace(false))?;
                ensure!(one.tensors == 1 && allocated()? + offloaded - one.bytes <= before, "{one:?}");
                held = one.bytes;
                let ops = turned_off()?;
                ensure!(ops == ["memcpy_d2h", "memcpy_h2d"], "one kept resident: {ops:?} off");
            }
            5 => {
                let before = allocated()?;
                ensure!(mo.keep_resident(go.layers(), &off.s, |_, _| false)?.tensors == 0);
                ensure!(allocated()? + held <= before, "offloaded again, its memory is given back");
                ensure!(turned_off()?.is_empty(), "offloaded again: {:?} off", turned_off()?);
            }
            7 => {
                for resident in [true, false, true, false, true, false, true] {
                    let now = mo.keep_resident(go.layers(), &off.s, |_, _| resident)?;
                    ensure!((now.tensors > 0) == resident, "{now:?} after asking for resident: {resident}");
                }
            }
            _ => {}
        }
        let want = plain.graphed(&gp, k, Replay::side(&side))?;
        ensure!(off.graphed(&go, k, Replay::side(&side))? == want, "step {k}: graphed with offloading differs");
        ensure!(off.grads()? == plain.grads()?, "step {k}: parameter gradients differ");
    }
    // Captured without the setting: nothing to switch to.
    let other = Model::new(dev, DIMS, DType::F32)?;
    let m = OffloadManager::new(&other.alloc, config())?;
    other.skip_first()?;
    let g = other.graph(m.graph_options(GraphOptions::default().sync_event(&e1)))?;
    let not = refusal(m.keep_resident(g.layers(), &other.s, |_, _| true).unwrap_err())?;
    ensure!(matches!(not, OffloadErrorKind::NotSwitchable), "{not}");
    Ok(())
}

/// A switchable capture costs the eager cache its scratch and no more: the cache's reservation
/// after the capture exceeds that of the same capture without the setting by at most the extra
/// bytes allocated and one chunk of rounding. (Allocated when the policy froze, during the
/// warmup, on another stream than the warmup's, the scratch grew the cache above the warmup's
/// memory and kept it from being given back: on the simulator, 18 MiB more for 3 allocated.)
pub fn switchable_capture_reserves_only_its_scratch(dev: &Device) -> Result {
    let dims = Dims { batch: 2, seq: 128, dim: 128, layers: 3, dropout: 0.0, ..DIMS };
    let (mut cache, mut chunk) = (Vec::new(), 0);
    for switchable in [false, true] {
        let m = Model::new(dev, dims, DType::F32)?;
        let mo = OffloadManager::new(&m.alloc, config().switchable(switchable))?;
        m.skip_first()?;
        let ready = dev.event()?;
        let _g = m.graph(mo.graph_options(GraphOptions::default().sync_event(&ready)))?;
        let st = m.alloc.stats().default;
        cache.push((st.reserved, st.allocated));
        // The cache's rounding: a mapping's bytes (expandable segments), else a segment's.
        chunk = m.alloc.page_bytes().unwrap_or(20 << 20);
    }
    let [(plain_reserved, plain_allocated), (reserved, allocated)] = cache[..] else {
        anyhow::bail!("two captures measured")
    };
    ensure!(
        reserved <= plain_reserved + (allocated - plain_allocated) + chunk,
        "switchable: {reserved} B reserved for {allocated} B; without the setting {plain_reserved} B for {plain_allocated} B"
    );
    Ok(())
}

/// Switched back and forth between steps whose graphs run on a side stream, the tensors kept
/// resident reuse the memory given back at the last switch: the reserved bytes stay those of the
/// first switch (memory one stream used, freed without an ordering, would wait for a
/// synchronize of the device, and every switch would reserve more). Tensors large enough that
/// what a switch leaves unused cannot hide in a segment's free space.
pub fn switching_again_reuses_the_memory_given_back(dev: &Device) -> Result {
    let dims = Dims { batch: 4, seq: 128, dim: 128, layers: 3, dropout: 0.0, ..DIMS };
    let off = Model::new(dev, dims, DType::F32)?;
    let mo = OffloadManager::new(&off.alloc, config().switchable(true))?;
    off.skip_first()?;
    let (side, ready) = (dev.stream()?, dev.event()?);
    let go = off.graph(mo.graph_options(GraphOptions::default().sync_event(&ready)))?;
    let reserved = || off.alloc.stats().total.reserved;
    // The tensors, of 128 KiB each, share small segments (Note [Small segments]) with the step's
    // own small blocks, and which blocks are back in the allocator at a switch depends on when
    // the device's last references to them dropped: one small segment more is that order's,
    // not a switch reserving the tensors anew (each would add all of their bytes).
    const SLACK: usize = 2 << 20;
    let mut first = None;
    for k in 1..=4 {
        let kept = mo.keep_resident(go.layers(), &off.s, |_, _| true)?;
        ensure!(kept.bytes > SLACK, "{} B kept resident: too little to test", kept.bytes);
        let now = reserved();
        let first = *first.get_or_insert(now);
        ensure!(now <= first + SLACK, "switch {k}: {now} B reserved, {first} B at the first");
        off.graphed(&go, k, Replay::side(&side))?;
        ensure!(mo.keep_resident(go.layers(), &off.s, |_, _| false)?.tensors == 0);
        off.graphed(&go, k, Replay::side(&side))?;
    }
    Ok(())
}
