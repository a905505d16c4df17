//! The capture's eager peak: its warmup, which also records the offload policy, runs layer by
//! layer and holds one layer's activations at a time, so that the peak memory of
//! `make_graphed_stack` grows with the layers only by what the graphs keep.

use anyhow::ensure;
use graphed::device::{DType, Device};
use graphed::graph::GraphOptions;
use graphed::nn::Chunk;
use graphed::offload::OffloadManager;

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
