//! `GptConfig::validate` accepts exactly what the kernels run: for small shapes on the simulator,
//! a transformer layer built and stepped without the check succeeds exactly when the check
//! accepts its width and heads, and a whole model of an accepted configuration trains a step.

use graphed::device::{DType, Device};
use graphed::memory::CachingAllocator;
use graphed::nn::{DropoutSpec, Gpt, GptConfig, Inputs, KeepOnDevice, Module, ParamStore, TransformerLayer};
use graphed::tensor::Tensor;
use proptest::prelude::*;

/// One forward and backward of a transformer layer of `dim` features and `heads` heads on a
/// `(batch, seq, dim)` input, built directly (no configuration check).
fn layer_step(dim: usize, heads: usize, batch: usize, seq: usize) -> graphed::Result<()> {
    let dev = Device::sim();
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
    let mut store = ParamStore::new(&alloc, &s, TransformerLayer::parameter_count(dim))?;
    let step = Tensor::zeros(&alloc, &s, &[1], DType::U64)?;
    let spec = DropoutSpec { p: 0.0, seed: 1, site: 0, step };
    let layer = TransformerLayer::new(&mut store, &alloc, "h0", (dim, heads), &spec, 3, &s)?;
    let n = batch * seq * dim;
    let x = Tensor::from_host(&alloc, &s, &vec![0.25f32; n], &[batch, seq, dim])?;
    let (y, ctx) = layer.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
    layer.backward(ctx, &[&y[0]], &s)?;
    s.synchronize()
}

fn config(dim: usize, heads: usize, max_len: usize) -> GptConfig {
    GptConfig { vocab: 7, max_len, dim, layers: 1, heads, dropout: 0.0, seed: 3, dtype: DType::F32 }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn validate_accepts_exactly_the_layers_the_kernels_run(dim in 1usize..=40, heads in 1usize..=8, seq in 1usize..=5) {
        let accepted = config(dim, heads, seq).validate();
        let ran = layer_step(dim, heads, 2, seq);
        prop_assert_eq!(accepted.is_ok(), ran.is_ok(), "validate {:?}, layer {:?}", accepted, ran.err());
        if accepted.is_ok() {
            let dev = Device::sim();
            let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
            let model = Gpt::new(&alloc, config(dim, heads, seq), &s)?;
            let tokens = Tensor::from_host(&alloc, &s, &vec![1u32; 2 * seq], &[2, seq])?;
            let targets = Tensor::from_host(&alloc, &s, &vec![2u32; 2 * seq], &[2 * seq])?;
            let weights = Tensor::from_host(&alloc, &s, &vec![0.5f32; 2 * seq], &[2 * seq])?;
            let (_, ctx) = model.forward(&tokens, &targets, &s)?;
            model.backward(ctx, &weights, &s)?;
        }
    }
}

/// Past LayerNorm's rows the model is refused before anything is allocated, naming the width.
#[test]
fn a_width_past_layernorm_is_refused_before_any_allocation() {
    let dev = Device::sim();
    let (s, alloc) = (dev.stream().unwrap(), CachingAllocator::new(&dev));
    let err = Gpt::new(&alloc, config(8192, 8, 4), &s).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("dim = 8192") && err.contains("4096"), "{err}");
    assert_eq!(alloc.stats().total.peak_allocated, 0);
    let limit = config(64, 4, 64).validate_batch(1 << 24).err().map(|l| l.field);
    assert_eq!(limit, Some("batch"));
}
