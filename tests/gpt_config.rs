//! `GptConfig::validate` accepts exactly what the kernels run: for small shapes on the simulator,
//! a transformer layer built and stepped without the check succeeds exactly when the check
//! accepts its width, heads and attention form, and a whole model of an accepted configuration
//! trains a step.

use graphed::device::{DType, Device};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    AttentionBackend, AttentionKind, AttentionSpec, Builder, Gpt, GptConfig, Inputs, KeepOnDevice, Module, ParamStore,
    Recompute, TransformerLayer,
};
use graphed::tensor::Tensor;
use proptest::prelude::*;

/// One forward and backward of a transformer layer of `dim` features and `heads` heads, its
/// attention `kind`, on a `(batch, seq, dim)` input, built directly (no configuration check).
fn layer_step(dim: usize, heads: usize, kind: AttentionKind, batch: usize, seq: usize) -> graphed::Result<()> {
    let dev = Device::sim();
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
    let store = ParamStore::new(&alloc, &s, TransformerLayer::parameter_count(dim))?;
    let vb = Builder::new(&store, &alloc, &s)?.with_seed(3).pp("h0");
    let layer = TransformerLayer::new(&vb, AttentionSpec::new(dim, heads).kind(kind))?;
    let n = batch * seq * dim;
    let x = Tensor::from_host(&alloc, &s, &vec![0.25f32; n], &[batch, seq, dim])?;
    let (y, ctx) = layer.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
    layer.backward(ctx, &[&y[0]], &s)?;
    s.synchronize()
}

fn config(dim: usize, heads: usize, max_len: usize) -> GptConfig {
    GptConfig {
        vocab: 7,
        max_len,
        dim,
        layers: 1,
        heads,
        attention: AttentionKind::Fused,
        attention_backend: AttentionBackend::Auto,
        dropout: 0.0,
        seed: 3,
        dtype: DType::F32,
        recompute: Recompute::Nothing,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn validate_accepts_exactly_the_layers_the_kernels_run(
        dim in 1usize..=40,
        heads in 1usize..=8,
        seq in 1usize..=5,
        unfused in any::<bool>(),
    ) {
        let kind = if unfused { AttentionKind::Unfused } else { AttentionKind::Fused };
        let config = GptConfig { attention: kind, ..config(dim, heads, seq) };
        let accepted = config.validate();
        let ran = layer_step(dim, heads, kind, 2, seq);
        prop_assert_eq!(accepted.is_ok(), ran.is_ok(), "validate {:?}, layer {:?}", accepted, ran.err());
        if accepted.is_ok() {
            let dev = Device::sim();
            let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
            let model = Gpt::new(&alloc, config, &s)?;
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
    let limit = config(64, 2, 64).validate_batch(1 << 24).err().map(|l| l.field);
    assert_eq!(limit, Some("batch"));
}

/// A head width the fused attention does not run is refused with the way out: the unfused form
/// or another head count; the unfused form takes it; and only the unfused form has the softmax's
/// sequence limit and the scores' batch limit.
#[test]
fn the_attention_forms_limits_are_refused_with_the_way_out() {
    let narrow = config(96, 2, 8); // heads of 48 features
    let limit = narrow.validate().expect_err("fused attention has no 48-wide heads");
    assert_eq!((limit.field, limit.value), ("heads", 2));
    assert!(limit.why.contains("--attention unfused") && limit.why.contains("(3 here)"), "{}", limit.why);
    assert!(GptConfig { attention: AttentionKind::Unfused, ..narrow }.validate().is_ok());
    let long = config(64, 2, graphed::ops::softmax::MAX_SEQ + 1);
    assert!(long.validate().is_ok(), "the fused attention runs any length");
    let limit = GptConfig { attention: AttentionKind::Unfused, ..long }.validate().expect_err("past the softmax");
    assert!(limit.field == "max_len" && limit.why.contains("--attention fused"), "{}", limit.why);
    // 2^32 / (heads · T²) sequences overflow the unfused scores, not the fused model.
    let scores = config(64, 2, 1024);
    assert!(scores.validate_batch(2048).is_ok());
    let limit = GptConfig { attention: AttentionKind::Unfused, ..scores }.validate_batch(2048).expect_err("scores");
    assert!(limit.why.contains("attention scores") && limit.why.contains("--attention fused"), "{}", limit.why);
    // A layer built directly says the same.
    let dev = Device::sim();
    let (s, alloc) = (dev.stream().unwrap(), CachingAllocator::new(&dev));
    let store = ParamStore::new(&alloc, &s, TransformerLayer::parameter_count(96)).unwrap();
    match TransformerLayer::new(&Builder::new(&store, &alloc, &s).unwrap().pp("h0"), (96, 2)) {
        Err(graphed::Error::Unsupported { why, .. }) => assert!(why.contains("--attention unfused"), "{why}"),
        other => panic!("a fused layer with 48-wide heads: {:?}", other.err()),
    }
}
