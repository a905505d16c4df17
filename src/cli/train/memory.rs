//! Whether a run fits: the device memory it needs, estimated from the model's sizes before
//! anything is allocated, against what the device has free (`Device::memory_info`: the GPU's
//! free memory; on the simulator its configured memory within what the host has). A run that
//! cannot fit is refused with both numbers, instead of failing minutes later in an allocation,
//! or growing the host's memory past what it has.

use graphed::device::Device;
use graphed::memory::{MemoryStats, Stats};
use graphed::nn::{AttentionKind, GptConfig};

use crate::cli::args::TrainArgs;
use crate::cli::exit::refuse;

/// Bytes of device memory a run of `config` on batches of `batch` holds at its peak, about: the
/// parameters with their gradients and AdamW's f32 master weights and moments; per layer and
/// position, what the caching allocator was measured to hold at the peak of a second step, in
/// widths of the model's element type, and for the unfused attention its per-head rows over the
/// positions in f32; and the head's logits and probabilities. Unfused: 81 widths and 7 rows
/// eager, 15 and 4 graphed; fused: no rows (its log-sum-exp, one f32 per head and position, is
/// within the widths), 66 widths eager, 20 graphed (17 before the measured peak counted each
/// replay's pool at its capture peak beside what the cache holds then; 76 and 37 before its
/// kernels read and wrote the layer's rows in place and the capture kept the gradients' snapshot
/// on the host). Graphed
/// holds less than eager since its warmup runs layer by layer, waiting for the stream after each
/// layer, so that it holds one layer's activations and the blocks one layer frees are reused by
/// the next (before, with every forward before any backward, graphed held 36 and 4 unfused, 31
/// fused; before that, without the waits, 132 and 130 widths). The eager numbers were fitted to
/// the simulator's allocator statistics (fused: seven shapes, widths 32 to 128, 1 to 4 heads, 11
/// to 64 positions, two layers; eager measured between 56 and 67 widths), the graphed ones to the
/// four shapes of the test below (fused 18.4 and 22.5 widths; unfused 14.7 widths and 3.5 rows), which
/// the caching allocator shares with CUDA; the test keeps the fit honest: it fails when the
/// memory a step holds moves away from it. With `--recompute gelu` each layer keeps 4 widths
/// fewer, and one layer's backward holds them again (the same shapes fit at 0.82 to 0.99); with
/// `gelu-norm` one width more is held again (0.81 to 0.97).
pub fn estimate(config: &GptConfig, batch: usize, graphed: bool) -> u128 {
    let n = |v: usize| v as u128;
    let elem = n(config.dtype.size());
    let params = n(config.parameter_count()) * (2 * elem + 12);
    let positions = n(batch) * n(config.max_len);
    let (widths, rows) = match (config.attention, graphed) {
        (AttentionKind::Unfused, false) => (81, 7),
        (AttentionKind::Unfused, true) => (15, 4),
        (AttentionKind::Fused, false) => (66, 0),
        (AttentionKind::Fused, true) => (20, 0),
    };
    // The GELU output, 4 widths, is not kept from the forward to the backward, but the layer
    // whose backward recomputes it holds it again, and a recomputed LayerNorm output, 1 width,
    // with it. The LayerNorm outputs not kept (2 widths) are left in: at the fitted shapes'
    // two layers the recomputed ones raise the peak more than they lower it.
    let r = config.recompute;
    let (dropped, again) = (4 * u128::from(r.gelu()), 4 * u128::from(r.gelu()) + u128::from(r.norms()));
    let (widths, recomputed) = (widths - dropped, positions * again * n(config.dim) * elem);
    let per_layer = positions * (widths * n(config.dim) * elem + rows * n(config.heads) * n(config.max_len) * 4);
    let head = 2 * positions * n(config.vocab) * (4 + elem);
    params + n(config.layers) * per_layer + recomputed + head
}

/// Refuses the run when [`estimate`] exceeds what `dev` has free.
pub fn check(dev: &Device, config: &GptConfig, batch: usize, args: &TrainArgs) -> anyhow::Result<()> {
    let need = estimate(config, batch, !args.eager);
    let (free, _) = dev.memory_info()?;
    if need > free as u128 {
        let (where_, what) = match dev.kind() {
            graphed::device::DeviceKind::Cuda => ("the GPU has", "free"),
            graphed::device::DeviceKind::Sim => {
                ("the simulator has", "free (its configured memory, within what the host has)")
            }
        };
        refuse!(
            "this model and batch need about {} of device memory at their peak, but {where_} {} {what}; use a \
             smaller --batch, --dim, --layers or --context",
            gib(need),
            gib(free as u128)
        );
    }
    Ok(())
}

fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The line `train` ends with: the device memory the run held at its peak, allocated and
/// reserved, in total and per area (the cache outside pools, each graph pool).
pub fn summary(stats: &MemoryStats) -> String {
    let area = |name: String, s: &Stats| format!("{name} {} / {}", human(s.peak_allocated), human(s.peak_reserved));
    let mut areas = vec![area("cache".to_string(), &stats.default)];
    areas.extend(stats.pools.iter().map(|(id, s)| area(id.to_string(), s)));
    format!(
        "device memory: peak allocated {}, peak reserved {} ({}; {} segments)",
        human(stats.total.peak_allocated),
        human(stats.total.peak_reserved),
        areas.join(", "),
        if stats.expandable { "expandable" } else { "fixed" }
    )
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => gib(b as u128),
        b => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    }
}

#[cfg(test)]
mod tests {
    use graphed::device::DType;
    use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
    use graphed::memory::CachingAllocator;
    use graphed::nn::{AttentionBackend, Gpt, Recompute};
    use graphed::tensor::Tensor;

    use super::*;

    /// The peak bytes the allocator holds over two training steps of `config` on the simulator,
    /// eager or with the layers graphed as `train` graphs them.
    fn measured_peak(config: GptConfig, batch: usize, graphed: bool) -> anyhow::Result<u128> {
        let dev = Device::sim();
        let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
        let model = Gpt::new(&alloc, config, &s)?;
        let n = batch * config.max_len;
        let ids: Vec<u32> = (0..n).map(|i| (i % config.vocab) as u32).collect();
        let tokens = Tensor::from_host(&alloc, &s, &ids, &[batch, config.max_len])?;
        let targets = Tensor::from_host(&alloc, &s, &ids, &[n])?;
        let weights = Tensor::from_host(&alloc, &s, &vec![1.0 / n as f32; n], &[n])?;
        let x = Tensor::zeros(&alloc, &s, &[batch, config.max_len, config.dim], config.dtype)?;
        let stack =
            graphed.then(|| make_graphed_stack(&alloc, model.layers(), &x, GraphOptions::default())).transpose()?;
        for _ in 0..2 {
            match &stack {
                Some(stack) => {
                    let h = model.embed(&tokens, &s)?;
                    let y = stack.forward(&s, &h, Replay::caller())?;
                    let (_, head) = model.head(y.get()?, &targets, &s)?;
                    let dy = model.head_backward(head, &weights, &s)?;
                    let dx = stack.backward(&s, &dy)?.ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
                    model.embed_backward(&tokens, dx.get()?, &s)?;
                }
                None => {
                    let (_, ctx) = model.forward(&tokens, &targets, &s)?;
                    model.backward(ctx, &weights, &s)?;
                }
            }
        }
        s.synchronize()?;
        Ok(alloc.stats().total.peak_allocated as u128)
    }

    #[test]
    fn the_estimate_is_within_a_fifth_of_the_memory_a_step_holds() -> anyhow::Result<()> {
        let shapes = [
            (AttentionKind::Unfused, 64, 4, 11),
            (AttentionKind::Unfused, 32, 2, 48),
            (AttentionKind::Fused, 64, 2, 11),
            (AttentionKind::Fused, 32, 1, 48),
        ];
        let recomputes = [Recompute::Nothing, Recompute::Gelu, Recompute::GeluAndNorms];
        for ((attention, dim, heads, max_len), recompute) in shapes.into_iter().flat_map(|s| recomputes.map(|r| (s, r)))
        {
            let config = GptConfig {
                vocab: 12,
                max_len,
                dim,
                layers: 2,
                heads,
                attention,
                attention_backend: AttentionBackend::Auto,
                dropout: 0.0,
                seed: 1,
                dtype: DType::F32,
                recompute,
            };
            for graphed in [false, true] {
                let (peak, estimate) = (measured_peak(config, 32, graphed)?, estimate(&config, 32, graphed));
                let ratio = estimate as f64 / peak as f64;
                assert!(
                    (0.8..1.2).contains(&ratio),
                    "{config:?} graphed {graphed}: estimate {estimate} B, peak {peak} B"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn a_run_that_cannot_fit_is_refused_with_what_it_needs_and_what_there_is() -> anyhow::Result<()> {
        let dev = Device::sim();
        let (free, _) = dev.memory_info()?;
        let config = GptConfig {
            vocab: 12,
            max_len: 4096,
            dim: 4096,
            layers: 64,
            heads: 32,
            attention: AttentionKind::Fused,
            attention_backend: AttentionBackend::Auto,
            dropout: 0.0,
            seed: 1,
            dtype: DType::F32,
            recompute: Recompute::Nothing,
        };
        assert!(estimate(&config, 1024, true) > free as u128, "the host has more memory than the test assumes");
        let args = crate::cli::train::outputs::tests::train_args(&[]);
        let refusal = check(&dev, &config, 1024, &args).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refusal.contains("need about") && refusal.contains("the simulator has"), "{refusal}");
        Ok(())
    }
}
