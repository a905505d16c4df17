//! `bench parallel`'s pipeline variants: the model split into one stage per rank, under 1F1B
//! and under interleaved 1F1B with two chunks per rank, eagerly or graphed (the layers' passes
//! and the exchanges between stages), graphed with the exchanges overlapping the passes
//! (`-overlap`), and the bubble each leaves against the schedule's; and
//! each stage timed alone, without peers, which tells the cost of splitting the model from that
//! of exchanging and waiting.

use graphed::device::{Communicator, DType, Device};
use graphed::dist::P2pLinks;
use graphed::graph::GraphOptions;
use graphed::memory::CachingAllocator;
use graphed::nn::{Schedule, Stage, StageLinks};
use graphed::tensor::Tensor;

use super::graphs::{measure, Samples};
use crate::cli::bench_model::{BenchModel, Config};
use crate::cli::scheduled::ScheduledLayers;

/// A pipeline variant: its name (and that of its stages timed alone, unless they are another
/// variant's), model chunks per rank, whether it is graphed, and whether its exchanges overlap
/// the passes (`P2pLinks::overlapped`).
pub(super) struct Variant {
    pub(super) name: &'static str,
    pub(super) alone: Option<&'static str>,
    pub(super) chunks: usize,
    pub(super) graphed: bool,
    pub(super) overlap: bool,
}

/// Every pipeline variant, in report order.
pub(super) const VARIANTS: [Variant; 6] = [
    Variant { name: "pp-1f1b-eager", alone: Some("pp-1f1b-eager-alone"), chunks: 1, graphed: false, overlap: false },
    Variant { name: "pp-1f1b-graphed", alone: Some("pp-1f1b-graphed-alone"), chunks: 1, graphed: true, overlap: false },
    Variant { name: "pp-1f1b-overlap", alone: None, chunks: 1, graphed: true, overlap: true },
    Variant {
        name: "pp-interleaved-eager",
        alone: Some("pp-interleaved-eager-alone"),
        chunks: 2,
        graphed: false,
        overlap: false,
    },
    Variant {
        name: "pp-interleaved-graphed",
        alone: Some("pp-interleaved-graphed-alone"),
        chunks: 2,
        graphed: true,
        overlap: false,
    },
    Variant { name: "pp-interleaved-overlap", alone: None, chunks: 2, graphed: true, overlap: true },
];

/// Whom a timed stage exchanges with.
#[derive(Clone, Copy)]
pub(super) enum Peers<'a> {
    /// Every stage, one per rank of the communicator; this rank's stage is its rank.
    Ranks(&'a Communicator),
    /// No one: the stage runs alone, each receive filled from a buffer of the boundary's shape
    /// that no peer writes, each send dropped. Its step is then its compute alone, without
    /// exchanges or waits: the slowest stage's is the pipeline's bound.
    Alone(Stage),
}

/// The links of a stage that runs alone (see [`Peers::Alone`]).
struct AloneLinks(Tensor);

impl StageLinks for AloneLinks {
    fn exchange(&mut self, _: usize, _: &[(usize, Tensor)], recvs: &[usize]) -> graphed::Result<Vec<Tensor>> {
        Ok(recvs.iter().map(|_| self.0.clone()).collect())
    }
}

/// The fraction of a step the schedule leaves idle when every pass takes its share of the
/// one-GPU time: (P − 1)/V of the M + (P − 1)/V microbatch slots (Megatron-LM's count).
pub(super) fn theoretical_bubble(stages: usize, chunks: usize, microbatches: usize) -> f64 {
    let idle = (stages - 1) as f64 / chunks as f64;
    idle / (microbatches as f64 + idle)
}

/// The fraction of a measured step of `microbatches` that is not the ideal split of the one-GPU
/// time of a microbatch (`one_gpu_ms`, the whole model's forward and backward) over `stages`.
pub(super) fn measured_bubble(one_gpu_ms: f64, stages: usize, microbatches: usize, step_ms: f64) -> f64 {
    1.0 - microbatches as f64 * one_gpu_ms / (stages as f64 * step_ms)
}

/// Times `variant` of `config` on this rank's GPU, as the stage `peers` say; `None` when the
/// layers do not split evenly into the stages' chunks.
pub(super) fn time_variant(
    dev: &Device,
    peers: Peers<'_>,
    (config, dtype): (Config, DType),
    variant: &Variant,
    microbatches: usize,
    warmup_and_steps: (u32, u32),
) -> anyhow::Result<Option<Samples>> {
    let stage = match peers {
        Peers::Ranks(comm) => Stage::new(comm.rank(), comm.size())?,
        Peers::Alone(stage) => stage,
    };
    let chunks = variant.chunks;
    let parts = stage.count() * chunks;
    if !config.layers.is_multiple_of(parts) {
        return Ok(None);
    }
    let per_chunk = config.layers / parts;
    let global = stage.model_layers(chunks, per_chunk);
    let alloc = CachingAllocator::new(dev);
    let main = dev.stream()?;
    let model = BenchModel::with_layers(&alloc, &main, config, dtype, &global)?;
    let schedule = Schedule::interleaved_1f1b(stage.count(), stage.index(), chunks, microbatches)?;
    let layers = model.stack.layers();
    let plan = (schedule, vec![per_chunk; chunks]);
    let capture = variant.graphed.then(|| GraphOptions::default().reuse_buffers(true));
    let scheduled = ScheduledLayers::new(&alloc, layers, plan, &model.x, capture)?;
    let shape = model.x.shape().to_vec();
    let mut links: Box<dyn StageLinks> = match peers {
        Peers::Ranks(comm) => {
            let links = match variant.graphed {
                true => P2pLinks::graphed(comm, &alloc, &main, &shape, dtype),
                false => P2pLinks::eager(comm, &alloc, &main, &shape, dtype),
            };
            Box::new(if variant.overlap { links.overlapped()? } else { links })
        }
        Peers::Alone(_) => Box::new(AloneLinks(model.x.clone())),
    };
    let inputs = match stage.index() {
        0 => vec![model.x.clone(); microbatches],
        _ => Vec::new(),
    };
    let mut head = |_: usize, _: Tensor| Ok(model.dy.clone());
    let samples = measure(dev, &main, warmup_and_steps, &mut || {
        scheduled.run(layers, &main, &inputs, None, &mut head, Some((stage, links.as_mut())))?;
        Ok(())
    })?;
    Ok(Some(samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bubbles_follow_megatrons_count_and_the_ideal_split() {
        // 2 stages, 8 microbatches: one idle slot of 9; interleaving halves it.
        assert!((theoretical_bubble(2, 1, 8) - 1.0 / 9.0).abs() < 1e-12);
        assert!((theoretical_bubble(2, 2, 8) - 0.5 / 8.5).abs() < 1e-12);
        assert_eq!(theoretical_bubble(1, 1, 8), 0.0);
        // A step of 8 microbatches of 10 ms over 2 stages takes 40 ms ideally; 50 ms is 20% idle.
        assert!((measured_bubble(10.0, 2, 8, 50.0) - 0.2).abs() < 1e-12);
    }
}
