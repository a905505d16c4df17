//! The benchmark model of `BENCH.md` for `bench graphs` and `inspect`: its configurations, and a
//! stack of transformer layers with one input and one upstream gradient, stepped eagerly or
//! graphed one callable per layer, in bf16 (`BENCH.md`'s type) or f32.

use graphed::device::DType;
use std::fmt;

use anyhow::bail;
use graphed::device::{Device, DeviceKind, Event, Stream};
use graphed::graph::{make_graphed_fn, make_graphed_stack, GraphOptions, GraphedFn, GraphedStack};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    AttentionBackend, AttentionKind, AttentionSpec, Builder, Fp8Recipe, Fp8Training, Inputs, KeepOnDevice, Layers,
    Module, ParamStore, Recompute, Stack, TransformerLayer,
};
use graphed::offload::OffloadManager;
use graphed::tensor::Tensor;

use crate::cli::args::BenchInput;

/// One model configuration: a `BENCH.md` row, or `tiny`, small enough for the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// `tiny`, `S`, `M` or `L`.
    pub name: &'static str,
    /// Model width.
    pub dim: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The form of the layers' attention (`--attention`; fused unless changed).
    pub attention: AttentionKind,
    /// What runs the fused attention (`--attention-backend`; automatic unless changed).
    pub attention_backend: AttentionBackend,
    /// What the layers' backward recomputes (`--recompute`; nothing unless changed).
    pub recompute: Recompute,
    /// Whether the graphed stack's layers lend their gradients' memory to its graph pool
    /// (`--lend-gradients`; not unless changed).
    pub lend_gradients: bool,
    /// The most bytes of `T × T` scratch cuDNN's deterministic attention backward keeps at once,
    /// in every layer (`--scratch-limit-mib`; the library's default unless changed).
    pub scratch_limit: Option<usize>,
}

/// Every configuration, smallest first; S, M and L are `BENCH.md`'s.
pub const CONFIGS: [Config; 4] = [
    Config {
        name: "tiny",
        dim: 64,
        layers: 2,
        batch: 2,
        seq: 16,
        attention: AttentionKind::Fused,
        attention_backend: AttentionBackend::Auto,
        recompute: Recompute::Nothing,
        lend_gradients: false,
        scratch_limit: None,
    },
    Config {
        name: "S",
        dim: 256,
        layers: 8,
        batch: 2,
        seq: 64,
        attention: AttentionKind::Fused,
        attention_backend: AttentionBackend::Auto,
        recompute: Recompute::Nothing,
        lend_gradients: false,
        scratch_limit: None,
    },
    Config {
        name: "M",
        dim: 1024,
        layers: 8,
        batch: 4,
        seq: 512,
        attention: AttentionKind::Fused,
        attention_backend: AttentionBackend::Auto,
        recompute: Recompute::Nothing,
        lend_gradients: false,
        scratch_limit: None,
    },
    Config {
        name: "L",
        dim: 4096,
        layers: 4,
        batch: 2,
        seq: 2048,
        attention: AttentionKind::Fused,
        attention_backend: AttentionBackend::Auto,
        recompute: Recompute::Nothing,
        lend_gradients: false,
        scratch_limit: None,
    },
];

/// The names clap accepts for a configuration (case-insensitively).
pub const CONFIG_NAMES: [&str; 4] = ["tiny", "S", "M", "L"];

impl Config {
    /// The configuration called `name`, in any case.
    pub fn named(name: &str) -> anyhow::Result<Config> {
        match CONFIGS.iter().find(|c| c.name.eq_ignore_ascii_case(name)) {
            Some(c) => Ok(*c),
            None => bail!("no configuration `{name}`; pick one of {}", CONFIG_NAMES.join(", ")),
        }
    }

    /// The same configuration with its attention as `attention` says (form and backend).
    pub fn with_attention(self, attention: crate::cli::args::AttentionArgs) -> Config {
        Config { attention: attention.kind(), attention_backend: attention.backend(), ..self }
    }

    /// The same configuration, its layers' backward recomputing what `recompute` names.
    pub fn with_recompute(self, recompute: Recompute) -> Config {
        Config { recompute, ..self }
    }

    /// The same configuration, its graphed stack's layers lending their gradients or not.
    pub fn with_lending(self, lend_gradients: bool) -> Config {
        Config { lend_gradients, ..self }
    }

    /// The same configuration, cuDNN's attention backward keeping at most `bytes` of scratch.
    pub fn with_scratch_limit(self, bytes: Option<usize>) -> Config {
        Config { scratch_limit: bytes, ..self }
    }

    /// The layers' attention: form, backend, heads of [`Config::heads`], scratch limit.
    pub fn attention_spec(&self) -> AttentionSpec {
        let spec = AttentionSpec::new(self.dim, self.heads()).kind(self.attention).backend(self.attention_backend);
        self.scratch_limit.map_or(spec, |bytes| spec.scratch_limit(bytes))
    }

    /// Heads of 64 features, as `BENCH.md` says (one for a model narrower than that).
    pub fn heads(&self) -> usize {
        (self.dim / 64).max(1)
    }

    /// Refuses any configuration but `tiny` on the simulator, whose CPU kernels would take
    /// minutes to hours on S, M and L; `flag` names the option that picks the configuration.
    pub fn check_device(&self, dev: &Device, flag: &str) -> anyhow::Result<()> {
        if dev.kind() != DeviceKind::Cuda && self.name != "tiny" {
            bail!(
                "configuration {} is too large for the simulator, which runs kernels on the CPU; pass `{flag} tiny` \
                 or run on a CUDA device",
                self.name
            );
        }
        Ok(())
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: d={} heads={} layers={} batch={} seq={} attention={}",
            self.name,
            self.dim,
            self.heads(),
            self.layers,
            self.batch,
            self.seq,
            self.attention
        )?;
        if self.recompute != Recompute::Nothing {
            write!(f, " recompute={}", self.recompute.name())?;
        }
        if self.lend_gradients {
            write!(f, " lend-gradients")?;
        }
        match self.scratch_limit {
            Some(bytes) => write!(f, " scratch-limit={}MiB", bytes >> 20),
            None => Ok(()),
        }
    }
}

/// A configuration's layers over one parameter store, with the input and upstream gradient of a
/// step.
pub struct BenchModel {
    /// The layers, in forward order; dropout is off (p = 0) as in `BENCH.md`'s benchmarks.
    pub stack: Stack<TransformerLayer>,
    /// The input, `(batch, seq, dim)`, deterministic so that runs compare.
    pub x: Tensor,
    /// The fixed upstream gradient of the last layer's output: ones.
    pub dy: Tensor,
    /// The layers' parameters and gradients.
    pub store: ParamStore,
    /// With `--dtype fp8`, the model's FP8 state, stepped at the end of every step.
    pub fp8: Option<Fp8Training>,
    /// With `--dtype fp8`, the FP8 step captured as a graph, which graphed steps replay (a
    /// training step's runs in its optimizer's graph).
    fp8_step: Option<GraphedFn>,
    /// Whether [`BenchModel::graph`] lends the layers' gradients to the pool.
    lend_gradients: bool,
}

impl BenchModel {
    /// Builds `config`'s layers, input and upstream gradient from `alloc`, on `stream`.
    pub fn new(alloc: &CachingAllocator, stream: &Stream, config: Config, dtype: DType) -> graphed::Result<BenchModel> {
        BenchModel::with_layers(alloc, stream, config, dtype, &(0..config.layers).collect::<Vec<_>>())
    }

    /// Feeds the step `input` (see [`BenchInput`]): the varied x it was built with, or every
    /// element 0.5.
    pub fn feed(&mut self, alloc: &CachingAllocator, stream: &Stream, input: BenchInput) -> graphed::Result<()> {
        if input == BenchInput::Constant {
            let constant = vec![0.5; self.x.numel()];
            self.x = Tensor::from_f32(alloc, stream, &constant, self.x.shape(), self.x.dtype())?;
        }
        Ok(())
    }

    /// As [`BenchModel::new`] in bf16, the layers' GEMMs in FP8 with `recipe` (started).
    pub fn with_fp8(
        alloc: &CachingAllocator,
        stream: &Stream,
        config: Config,
        recipe: Fp8Recipe,
    ) -> graphed::Result<BenchModel> {
        let fp8 = Fp8Training::new(alloc, recipe);
        let global = (0..config.layers).collect::<Vec<_>>();
        let mut model = BenchModel::build(alloc, stream, (config, DType::BF16), &global, Some(fp8.clone()))?;
        fp8.start(stream)?;
        model.fp8_step = Some(make_graphed_fn(alloc, |s| fp8.step(s))?.with_name("fp8 step"));
        Ok(model)
    }

    /// Only the layers `global` of `config` (as numbered in the whole model, each initialised
    /// as there): a pipeline stage's part.
    pub fn with_layers(
        alloc: &CachingAllocator,
        stream: &Stream,
        config: Config,
        dtype: DType,
        global: &[usize],
    ) -> graphed::Result<BenchModel> {
        BenchModel::build(alloc, stream, (config, dtype), global, None)
    }

    fn build(
        alloc: &CachingAllocator,
        stream: &Stream,
        (config, dtype): (Config, DType),
        global: &[usize],
        fp8: Option<Fp8Training>,
    ) -> graphed::Result<BenchModel> {
        let Config { dim, batch, seq, .. } = config;
        let count = global.len() * TransformerLayer::parameter_count(dim);
        let store = ParamStore::with_dtype(alloc, stream, count, dtype)?;
        let vb = Builder::new(&store, alloc, stream)?.with_seed(1).with_recompute(config.recompute);
        let vb = match &fp8 {
            Some(f) => vb.with_fp8(f),
            None => vb,
        };
        // Init seeds four apart: each layer seeds its linear layers from `seed` to `seed + 3`.
        let layers = TransformerLayer::stack(
            &vb,
            config.attention_spec(),
            &Layers::of(global.iter().copied()).named("layer").seed_stride(4),
        )?;
        let numel = batch * seq * dim;
        let x: Vec<f32> = (0..numel).map(|i| (i * 7919 % 1000) as f32 / 1000.0 - 0.5).collect();
        let x = Tensor::from_f32(alloc, stream, &x, &[batch, seq, dim], dtype)?;
        let dy = Tensor::from_f32(alloc, stream, &vec![1.0f32; numel], &[batch, seq, dim], dtype)?;
        let lend_gradients = config.lend_gradients;
        Ok(BenchModel { stack: Stack::new(layers), x, dy, store, fp8, fp8_step: None, lend_gradients })
    }

    /// One eager step on `stream`: every forward in order, then every backward in reverse from
    /// `dy`; parameter gradients accumulate. Then [`BenchModel::end_step`].
    pub fn eager_step(&self, stream: &Stream) -> graphed::Result<()> {
        let (_, ctx) = self.stack.forward(&Inputs::one(&self.x), &KeepOnDevice, stream)?;
        self.stack.backward(ctx, &[&self.dy], stream)?;
        self.end_step(stream)
    }

    /// What ends a step besides the passes (the benchmark has no optimizer): FP8's scale update
    /// and weight quantization, which a training step runs after its optimizer.
    pub fn end_step(&self, stream: &Stream) -> graphed::Result<()> {
        self.fp8.as_ref().map_or(Ok(()), |f| f.step(stream))
    }

    /// [`BenchModel::end_step`] replayed as its graph, for the graphed steps.
    pub fn end_step_graphed(&self, stream: &Stream) -> graphed::Result<()> {
        self.fp8_step.as_ref().map_or(Ok(()), |g| g.replay(stream))
    }

    /// Graphs the stack into one pool, its layers chained so that they replay with no copies
    /// between them; with `sync_event`, every graph records it for side-stream replay; with
    /// `offload`, activations go to host memory inside the graphs (the capture's warmup records
    /// the manager's policy if it is not frozen yet); with the configuration's
    /// `lend_gradients`, the layers lend their gradients to the pool (the benchmark's step has
    /// one backward and no optimizer, which the contract allows).
    pub fn graph(
        &self,
        alloc: &CachingAllocator,
        sync_event: Option<&Event>,
        offload: Option<&OffloadManager>,
    ) -> graphed::Result<GraphedStack> {
        let mut options = GraphOptions::default().lend_gradients(self.lend_gradients);
        if let Some(event) = sync_event {
            options = options.sync_event(event);
        }
        if let Some(m) = offload {
            options = m.graph_options(options);
        }
        self.graph_with(alloc, options)
    }

    /// Graphs the stack into one pool with `options`.
    pub fn graph_with(&self, alloc: &CachingAllocator, options: GraphOptions) -> graphed::Result<GraphedStack> {
        make_graphed_stack(alloc, &self.stack, &self.x, options)
    }
}
