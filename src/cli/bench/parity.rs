//! `graphed bench parity`: one step of the benchmark model (every layer's forward, then every
//! backward from a fixed upstream gradient) on fixed inputs, written with the weights to one
//! safetensors file, so that `bench/torch_reference.py parity` can run PyTorch's module on the
//! same weights and inputs and compare outputs and gradients before anything is timed. The step
//! runs eagerly: the graphed stack equals it bit for bit.
//!
//! The file holds every parameter under its module's name (`layer0.attn.qkv.weight`, the names
//! PyTorch's module gives its own), `input`, `output`, `grad.output` (the upstream gradient),
//! `grad.input` and `grad.<parameter>`; its metadata gives the configuration, the element type and
//! the layouts and constants PyTorch's side must share, and the attention form it ran
//! (`attention_form`: `fused` or `unfused`, from `--attention`), which PyTorch's side matches.

use graphed::checkpoint::Checkpoint;
use graphed::device::DeviceKind;
use graphed::memory::CachingAllocator;
use graphed::nn::{Inputs, KeepOnDevice, Module};
use graphed::tensor::Tensor;

use crate::cli::args::ParityBenchArgs;
use crate::cli::bench_model::{BenchModel, Config};

/// What PyTorch's module must share with graphed's, as the file's metadata states it.
const CONVENTIONS: [(&str, &str); 4] = [
    // `nn::Linear`: `y = x·Wᵀ + b`, as `torch.nn.Linear`, so weights load without a transpose.
    ("linear_weight", "[out, in]"),
    // `nn::CausalSelfAttention`: q, k and v are column blocks of the QKV projection's output,
    // head h in columns h·hd..(h+1)·hd of each; scores are scaled by 1/√hd.
    ("attention", "qkv column blocks q|k|v, head-major within each; causal; scale 1/sqrt(head_dim)"),
    ("layernorm_eps", "1e-5"),
    ("gelu", "tanh"),
];

/// Runs the step and writes the file.
pub fn run(args: &ParityBenchArgs) -> anyhow::Result<()> {
    let dev = crate::cli::open_device(&args.device)?;
    let config = Config::named(&args.config)?.with_attention(args.attention);
    // One step of S takes seconds on the simulator, of M or L hours.
    if dev.kind() != DeviceKind::Cuda && !matches!(config.name, "tiny" | "S") {
        anyhow::bail!(
            "configuration {} is too large for the simulator, which runs kernels on the CPU; pass `--config S` or \
             `--config tiny`, or run on a CUDA device",
            config.name
        );
    }
    let dtype = args.dtype.resolve(&dev)?;
    let alloc = CachingAllocator::new(&dev);
    let s = dev.stream()?;
    let model = BenchModel::new(&alloc, &s, config, dtype)?;
    // A varied upstream gradient: the benchmark's ones would make some sums cancel and check less.
    let numel = model.x.shape().iter().product::<usize>();
    let dy: Vec<f32> = (0..numel).map(|i| (i * 4099 % 1000) as f32 / 500.0 - 1.0).collect();
    let dy = Tensor::from_f32(&alloc, &s, &dy, model.x.shape(), dtype)?;
    let (y, ctx) = model.stack.forward(&Inputs::one(&model.x), &KeepOnDevice, &s)?;
    let dx = model.stack.backward(ctx, &[&dy], &s)?;
    let (Some(y), Some(Some(dx))) = (y.first(), dx.first()) else {
        anyhow::bail!("the benchmark model gave no output or no input gradient");
    };
    let mut file = Checkpoint::new();
    for p in model.stack.parameters() {
        file.put(&p.name, &p.value, &s)?;
        file.put(&format!("grad.{}", p.name), &p.grad, &s)?;
    }
    for (name, t) in [("input", &model.x), ("output", y), ("grad.output", &dy), ("grad.input", dx)] {
        file.put(name, t, &s)?;
    }
    let Config { name, dim, layers, batch, seq, attention, .. } = config;
    let run = [
        ("config", name.to_string()),
        // `fused` or `unfused`: PyTorch's side runs the same form (SDPA with `is_causal` for
        // fused, GEMM, masked softmax, GEMM for unfused).
        ("attention_form", attention.name().to_string()),
        ("dim", dim.to_string()),
        ("layers", layers.to_string()),
        ("heads", config.heads().to_string()),
        ("batch", batch.to_string()),
        ("seq", seq.to_string()),
        ("dtype", dtype.to_string()),
        ("device", dev.name()),
    ];
    for (key, value) in run {
        file.set_meta(key, value);
    }
    for (key, value) in CONVENTIONS {
        file.set_meta(key, value);
    }
    file.save(&args.out)?;
    println!(
        "wrote {}: {config}, {dtype}, {} parameters with their gradients, the input, output and their gradients",
        args.out.display(),
        model.stack.parameters().len()
    );
    Ok(())
}
