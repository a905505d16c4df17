//! The capture's eager peak: its warmup, which also records the offload policy, runs layer by
//! layer and holds one layer's activations at a time, so that the peak memory of
//! `make_graphed_stack` grows with the layers only by what the graphs keep; and the automatic
//! policy's window probe after the warmup, which times the layers' graphs and gives back their
//! memory before the capture.

use anyhow::{anyhow, bail, ensure};
use graphed::device::{DType, Device};
use graphed::graph::{GraphOptions, Replay};
use graphed::nn::Chunk;
use graphed::offload::{OffloadErrorKind, OffloadManager, Policy, Windows, AUTO_CANDIDATES};

use super::fixtures::{config, Dims, Model, Result, DIMS};

/// A stack of `layers` layers captured with offloading on the default sites: the bytes allocated
/// at the capture's peak (the allocator's cache and the graph pool together) above those
/// allocated before it, and one layer's saved bytes.
fn capture_peak(dev: &Device, layers: usize) -> Result<(usize, usize)> {
    // Activations large against the parameters, so that the capture sets the allocator's peak.
    let model = Model::new(dev, Dims { layers, batch: 4, seq: 32, ..DIMS }, DType::F32)?;
    let m = OffloadManager::new(&model.alloc, config())?;
    model.alloc.synchronize()?;
    let before = model.alloc.stats().total;
    let _g = model.graph(m.graph_options(GraphOptions::default()))?;
    let after = model.alloc.stats().total;
    ensure!(after.peak_allocated > before.peak_allocated, "the capture did not set the peak: {before:?}, {after:?}");
    let layout = m.layout(Chunk::default());
    let saved = layout.iter().filter(|g| g.pass == 0).flat_map(|g| &g.tensors).map(|t| t.bytes()).sum();
    Ok((after.peak_allocated - before.allocated, saved))
}

/// From 2 to 6 layers, the capture's peak grows by less than one layer's saved activations per
/// layer: a warmup of every forward before any backward holds them all at once (and more: the
/// outputs), where a graph keeps only the ones it does not offload.
pub fn capture_peak_grows_by_less_than_each_layers_activations(dev: &Device) -> Result {
    let (two, saved) = capture_peak(dev, 2)?;
    let (six, _) = capture_peak(dev, 6)?;
    ensure!(saved > 0, "the layers saved nothing");
    ensure!(
        six.saturating_sub(two) < 4 * saved,
        "the capture's peak grew from {two} B (2 layers) to {six} B (6 layers), {} B per layer; one layer saves \
         {saved} B",
        six.saturating_sub(two) / 4
    );
    Ok(())
}

/// The automatic policy decides from the window probe after the warmup: each layer's forward and
/// backward captured without offloading, replayed as graphs in a pool of their own, which gives
/// back all it held before the capture. On CUDA every layer but the last has a window timed in
/// graph replays; on the simulator the probe runs its graphs but cannot time them, and the
/// capture is refused with nothing changed.
pub fn auto_policy_windows_come_from_graph_replays(dev: &Device) -> Result {
    let model = Model::new(dev, DIMS, DType::F32)?;
    let m = OffloadManager::new(&model.alloc, config().policy(Policy::Auto).candidates(&AUTO_CANDIDATES))?;
    let grads = model.grads()?;
    let captured = model.graph(m.graph_options(GraphOptions::default()));
    let kept = captured.as_ref().ok().map(|g| g.pool().id());
    let others: Vec<_> = model.alloc.stats().pools.into_iter().filter(|(id, _)| Some(*id) != kept).collect();
    ensure!(others.iter().any(|(_, s)| s.peak_allocated > 0), "no probe graph held memory: {others:?}");
    ensure!(others.iter().all(|(_, s)| s.allocated == 0 && s.reserved == 0), "the probe kept memory: {others:?}");
    if !dev.has_clock() {
        let kind = captured.as_ref().err().and_then(|e| e.downcast_ref::<graphed::Error>()?.offload_kind());
        ensure!(matches!(kind, Some(OffloadErrorKind::NoClock)), "expected NoClock, got {:?}", captured.map(drop));
        ensure!(m.summary().is_none() && m.layout(Chunk::default()).is_empty(), "the refused capture kept a policy");
        ensure!(model.grads()? == grads, "the refused capture changed the gradients");
        return Ok(());
    }
    let g = captured?;
    let s = m.summary().ok_or_else(|| anyhow!("the capture froze no policy"))?;
    ensure!(matches!(s.windows, Some(Windows::Graphs { .. })), "windows not from graph replays:\n{s}");
    for r in s.rows.iter().filter(|r| r.pass + 1 < DIMS.layers) {
        if !r.window_ms.is_some_and(|w| w > 0.0) {
            bail!("unit {} has no window:\n{s}", r.pass);
        }
    }
    model.graphed(&g, 1, Replay::caller())?;
    Ok(())
}

/// Where the stack lends its gradients, the window probe's pool borrows them as the warmup does
/// (every layer's but the probed one's): its own peak is lower than the same probe's without
/// lending, it holds nothing afterwards, the gradients come back as they were, and the capture
/// then lends to its own pool (on the simulator, which has no clock, the capture is refused
/// after the probe with nothing changed).
pub fn the_probe_of_a_lending_stack_borrows_the_gradients(dev: &Device) -> Result {
    // Activations large against the parameters, so that lent memory matters.
    let dims = Dims { batch: 4, seq: 32, ..DIMS };
    let probe_peak = |lend: bool| -> Result<usize> {
        let model = Model::new(dev, dims, DType::F32)?;
        let m = OffloadManager::new(&model.alloc, config().policy(Policy::Auto).candidates(&AUTO_CANDIDATES))?;
        let grads = model.grads()?;
        let captured = model.graph(m.graph_options(GraphOptions::default().lend_gradients(lend)));
        let kept = captured.as_ref().ok().map(|g| g.pool().id());
        let others: Vec<_> = model.alloc.stats().pools.into_iter().filter(|(id, _)| Some(*id) != kept).collect();
        ensure!(others.iter().all(|(_, s)| s.allocated == 0 && s.reserved == 0), "the probe kept memory: {others:?}");
        if captured.is_err() {
            ensure!(model.grads()? == grads, "the refused capture changed the gradients (lending {lend})");
            ensure!(!model.alloc.blocks().iter().any(|b| b.lent), "lent memory still lent after a refused capture");
        }
        Ok(others.iter().map(|(_, s)| s.peak_allocated).max().unwrap_or(0))
    };
    let (plain, lent) = (probe_peak(false)?, probe_peak(true)?);
    ensure!(plain > 0, "no probe ran");
    ensure!(lent < plain, "the probe of a lending stack held {lent} B of its own, {plain} B without lending");
    Ok(())
}
