//! Command-line arguments, validated by clap before any device is touched.

use clap::{Args, Parser, Subcommand, ValueEnum};
use graphed::device::{DType, Policy};
use graphed::nn::Stage;

use super::exit::Refused;

/// Capture training steps into CUDA graphs and replay them; with a CPU simulator of CUDA.
#[derive(Parser, Debug)]
#[command(name = "graphed", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the main job: train a small GPT on 3-digit addition with graphed transformer layers
    /// (or eagerly) and report loss, host and wall time per step and exact-match accuracy on
    /// held-out sums.
    Train(TrainArgs),
    /// A demo of capture and side-stream replay: a stack of layers stepped eagerly and as one
    /// captured graph, compared bitwise, with host time per step.
    Demo(DemoArgs),
    /// Benchmarks.
    Bench(BenchArgs),
    /// Graph a stack of transformer layers and print, for each graph, its node counts, pool
    /// memory, static surfaces and event records; write DOT files.
    Inspect(InspectArgs),
    /// Start one process per GPU of this host, each with torchrun's variables (RANK,
    /// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), running `graphed <ARGS>`: for example
    /// `graphed launch --gpus 2 -- train` trains data parallel. `graphed launch --gpus 2 -- train
    /// --device sim` trains two simulated ranks instead, threads of this process, on any machine.
    Launch(LaunchArgs),
    /// Regenerate the performance tables of the README and docs/benchmarks.md and the benchmarks'
    /// SVG plots from the newest results file of each benchmark (or, with `--check`, fail if they
    /// are not what it writes).
    Report(ReportArgs),
}

/// Arguments of `launch`.
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// How many processes on this host (one GPU each); with `train --device sim`, how many
    /// simulated ranks.
    #[arg(long, default_value_t = 2)]
    pub gpus: usize,
    /// How many hosts run a launcher with the same `--gpus` (torchrun's `--nnodes`).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This host's place among them: its ranks are `node_rank·gpus ..` (torchrun's `--node-rank`).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// The address of the host of rank 0 (node rank 0), reachable from every host; needed with
    /// several hosts.
    #[arg(long)]
    pub master_addr: Option<String>,
    /// The rendezvous port of rank 0.
    #[arg(long, default_value_t = 29500)]
    pub port: u16,
    /// Seconds the others may run on after one rank failed (their own timeouts usually end
    /// them sooner) before they are stopped.
    #[arg(long, default_value_t = 60)]
    pub grace: u64,
    /// The command each process runs, after `--`.
    #[arg(last = true, required = true)]
    pub args: Vec<String>,
}

#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Which device: the GPU when there is one, else the simulator (auto), or force one.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Simulator scheduling policy.
    #[arg(long = "sim-policy", value_enum, default_value_t = PolicyArg::Random)]
    pub policy: PolicyArg,
    /// Simulator scheduling seed.
    #[arg(long = "sim-seed", default_value_t = 0)]
    pub sim_seed: u64,
}

/// The element type of a model's weights and activations.
#[derive(Args, Debug, Clone, Copy)]
pub struct DTypeArgs {
    /// Element type of weights and activations (LayerNorm statistics, softmax and loss math and
    /// the optimizer's master weights stay f32). Default: bf16 on CUDA, f32 on the simulator.
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,
    /// With `--dtype fp8`, how tensors are scaled: `delayed` (TransformerEngine's default, from
    /// the amaxes of the last steps) or `current` (each tensor from its own amax, one more read
    /// of it).
    #[arg(long = "fp8-scaling", value_enum)]
    pub fp8_scaling: Option<Fp8ScalingArg>,
    /// With `--dtype fp8`, the gradients' format: `e5m2` (TransformerEngine's HYBRID, the
    /// default: more range) or `e4m3` (as the forward's tensors: one more bit of precision).
    #[arg(long = "fp8-gradients", value_enum)]
    pub fp8_gradients: Option<Fp8GradientsArg>,
}

impl DTypeArgs {
    /// The element type to run in on `dev`: as given, else bf16 on CUDA and f32 on the simulator
    /// (whose CPU kernels gain nothing from the narrower type).
    ///
    /// # Errors
    /// For `--dtype fp8`, which only `train`, `bench graphs` and `bench layer` run (they call
    /// [`DTypeArgs::storage`]).
    pub fn resolve(&self, dev: &graphed::device::Device) -> anyhow::Result<DType> {
        self.fp8_recipe()?;
        if self.fp8() {
            anyhow::bail!(
                "--dtype fp8 runs in `graphed train`, `graphed bench graphs` and `graphed bench layer`; pass --dtype bf16 here"
            );
        }
        Ok(self.storage(dev))
    }

    /// The element type of weights and activations: as [`DTypeArgs::resolve`], bf16 for
    /// `--dtype fp8`.
    pub fn storage(&self, dev: &graphed::device::Device) -> DType {
        match (self.dtype, dev.kind()) {
            (Some(DTypeArg::Bf16 | DTypeArg::Fp8), _) | (None, graphed::device::DeviceKind::Cuda) => DType::BF16,
            _ => DType::F32,
        }
    }

    /// Whether the Linear layers run their GEMMs in FP8 (`--dtype fp8`; the weights and
    /// activations are bf16).
    pub fn fp8(&self) -> bool {
        self.dtype == Some(DTypeArg::Fp8)
    }

    /// The FP8 recipe with `--dtype fp8` (`--fp8-scaling`, delayed by default, and
    /// `--fp8-gradients`, E5M2 by default), else `None`.
    ///
    /// # Errors
    /// `--fp8-scaling` or `--fp8-gradients` without `--dtype fp8`, where it would change nothing.
    pub fn fp8_recipe(&self) -> anyhow::Result<Option<graphed::nn::Fp8Recipe>> {
        use graphed::nn::{Fp8Recipe, Fp8Scaling};
        use graphed::ops::fp8::Fp8Format;
        if !self.fp8() {
            if self.fp8_scaling.is_some() || self.fp8_gradients.is_some() {
                let flag = if self.fp8_scaling.is_some() { "--fp8-scaling" } else { "--fp8-gradients" };
                anyhow::bail!("{flag} sets how FP8 tensors are made; pass --dtype fp8 with it, or drop it");
            }
            return Ok(None);
        }
        let scaling = match self.fp8_scaling {
            None | Some(Fp8ScalingArg::Delayed) => Fp8Scaling::default(),
            Some(Fp8ScalingArg::Current) => Fp8Scaling::Current,
        };
        let gradients = match self.fp8_gradients {
            None | Some(Fp8GradientsArg::E5m2) => Fp8Format::E5M2,
            Some(Fp8GradientsArg::E4m3) => Fp8Format::E4M3,
        };
        Ok(Some(Fp8Recipe { scaling, gradients }))
    }

    /// The name of the precision in reports: `fp8`, with `-current` under current scaling and
    /// `-e4m3g` with E4M3 gradients; else the element type.
    pub fn label(&self, dev: &graphed::device::Device) -> String {
        if !self.fp8() {
            return self.storage(dev).to_string();
        }
        let current = if self.fp8_scaling == Some(Fp8ScalingArg::Current) { "-current" } else { "" };
        let e4m3 = if self.fp8_gradients == Some(Fp8GradientsArg::E4m3) { "-e4m3g" } else { "" };
        format!("fp8{current}{e4m3}")
    }
}

/// The form of the layers' attention.
#[derive(Args, Debug, Clone, Copy)]
pub struct AttentionArgs {
    /// How the layers compute attention: `fused` (FlashAttention-2-style kernels, no T×T tensor,
    /// heads of 32, 64 or 128 features) or `unfused` (GEMMs around a causal softmax, saving the
    /// T×T probabilities; any head width, sequences of at most 8192).
    #[arg(long, value_enum, default_value_t = AttentionArg::Fused)]
    pub attention: AttentionArg,
    /// What runs the fused attention: `auto` (cuDNN where it is available and runs the call:
    /// bf16 on CUDA, heads of 64 or 128 features, sequences a multiple of 128, no attention
    /// dropout; else graphed's kernels), `cudnn` (refuse what cuDNN cannot run) or `kernels`
    /// (graphed's own).
    #[arg(long = "attention-backend", value_enum, default_value_t = AttentionBackendArg::Auto)]
    pub backend: AttentionBackendArg,
}

impl AttentionArgs {
    /// The form, as the library names it.
    pub fn kind(&self) -> graphed::nn::AttentionKind {
        match self.attention {
            AttentionArg::Fused => graphed::nn::AttentionKind::Fused,
            AttentionArg::Unfused => graphed::nn::AttentionKind::Unfused,
        }
    }

    /// The fused attention's backend, as the library names it.
    pub fn backend(&self) -> graphed::nn::AttentionBackend {
        self.backend.backend()
    }
}

/// `--attention-backend`'s values.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionBackendArg {
    /// cuDNN where it runs the call, else graphed's kernels (the default).
    Auto,
    /// cuDNN, refusing calls it cannot run.
    Cudnn,
    /// graphed's own fused kernels.
    Kernels,
    /// cuDNN, its backward free to take a nondeterministic engine (PyTorch's default): faster,
    /// no T×T scratch, but gradients not bitwise reproducible and graphed no longer equal to
    /// eager bit for bit.
    CudnnNondeterministic,
}

impl AttentionBackendArg {
    /// The setting, as the library names it.
    pub fn backend(self) -> graphed::nn::AttentionBackend {
        match self {
            AttentionBackendArg::Auto => graphed::nn::AttentionBackend::Auto,
            AttentionBackendArg::Cudnn => graphed::nn::AttentionBackend::Cudnn,
            AttentionBackendArg::Kernels => graphed::nn::AttentionBackend::Kernels,
            AttentionBackendArg::CudnnNondeterministic => graphed::nn::AttentionBackend::CudnnNondeterministic,
        }
    }
}

/// What the layers' backward recomputes instead of saving it from the forward.
#[derive(Args, Debug, Clone, Copy)]
pub struct RecomputeArgs {
    /// What the layers' backward recomputes instead of keeping it from the forward: `none`,
    /// `gelu` (the MLP's GELU output, a quarter of what a layer saves, recomputed from its input
    /// by one memory-bound pass), `norm` (the two LayerNorm outputs, an eighth, each recomputed
    /// by the LayerNorm's forward kernel, with the same bits) or `gelu-norm` (both); not with
    /// `--dtype fp8`.
    #[arg(long, value_enum, default_value_t = RecomputeArg::None)]
    pub recompute: RecomputeArg,
}

impl RecomputeArgs {
    /// The setting, as the library names it.
    pub fn recompute(&self) -> graphed::nn::Recompute {
        match self.recompute {
            RecomputeArg::None => graphed::nn::Recompute::Nothing,
            RecomputeArg::Gelu => graphed::nn::Recompute::Gelu,
            RecomputeArg::Norm => graphed::nn::Recompute::Norms,
            RecomputeArg::GeluNorm => graphed::nn::Recompute::GeluAndNorms,
        }
    }
}

/// Whether a graphed stack's layers lend their gradients' memory to its graph pool.
#[derive(Args, Debug, Clone, Copy)]
pub struct LendArgs {
    /// Let each graphed layer lend its parameters' gradient memory to the graph pool while the
    /// gradients hold nothing (from the optimizer to the layer's backward), for the activations
    /// of the layers above it: a smaller pool, each backward starting its layer's gradients
    /// from zero (docs/design.md, "Where a step's memory goes"). The graphed stack's variants
    /// only (of `bench graphs`: graphed, graphed-side and graphed-offload).
    #[arg(long)]
    pub lend_gradients: bool,
}

/// `--recompute`'s values.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecomputeArg {
    /// Keep everything the backward reads (the default).
    None,
    /// Recompute the MLP's GELU output.
    Gelu,
    /// Recompute the LayerNorms' outputs.
    Norm,
    /// Recompute both.
    GeluNorm,
}

/// `--attention`'s values.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionArg {
    /// Fused kernels (the default).
    Fused,
    /// GEMMs and a softmax kernel.
    Unfused,
}

/// Activation offloading to host memory, inside the graphs.
#[derive(Args, Debug, Clone)]
pub struct OffloadArgs {
    /// Offload saved activations to host memory, inside the graphs (eagerly with `--eager`): the
    /// listed sites, or those the automatic policy picks from the layers' and copies' timings
    /// (CUDA only).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "listed")]
    pub offload: Option<OffloadPolicyArg>,
    /// Saved tensors to offload (or to pick from, with `auto`), as `module.tensor` or
    /// `module.*`, comma-separated (default: attn.input,attn.qkv,attn.att,mlp.input, with the
    /// unfused attention attn.q,attn.k,attn.v for attn.qkv; with `auto`, also
    /// mlp.pre,mlp.act,ln2.input).
    #[arg(long = "offload-sites", value_delimiter = ',', requires = "offload")]
    pub sites: Option<Vec<String>>,
    /// Tensors with fewer elements stay on the device (default: 65536 on CUDA, 1024 on the
    /// simulator, whose default models are small).
    #[arg(long = "offload-min-elements", requires = "offload")]
    pub min_elements: Option<usize>,
    /// The last layers keep their activations on the device (two: the next-to-last layer's copy
    /// would save nothing, since the backward prefetches it while the last layer's are there).
    #[arg(long = "offload-margin", default_value_t = 2, requires = "offload")]
    pub margin: usize,
}

/// How offloaded tensors are chosen.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadPolicyArg {
    /// Every eligible tensor of the sites.
    Listed,
    /// The largest tensors whose copies hide under the next layer's measured time.
    Auto,
}

impl OffloadArgs {
    /// The manager's configuration, if offloading was asked for.
    pub fn config(&self, dev: &graphed::device::Device) -> Option<graphed::offload::OffloadConfig> {
        use graphed::offload::{OffloadConfig, Policy, AUTO_CANDIDATES, DEFAULT_SITES};
        let policy = match self.offload? {
            OffloadPolicyArg::Listed => Policy::Listed,
            OffloadPolicyArg::Auto => Policy::Auto,
        };
        let config = OffloadConfig::default().policy(policy);
        // Sites the user names must each select something; the built-in lists need not (a
        // recomputed GELU or LayerNorm output is not saved).
        let config = match (&self.sites, policy) {
            (Some(s), _) => config.sites(&s.iter().map(String::as_str).collect::<Vec<_>>()),
            (None, Policy::Auto) => config.candidates(&AUTO_CANDIDATES),
            (None, Policy::Listed) => config.candidates(&DEFAULT_SITES),
        };
        let on_gpu = dev.kind() == graphed::device::DeviceKind::Cuda;
        let min = self.min_elements.unwrap_or(if on_gpu { 1 << 16 } else { 1024 });
        Some(config.min_elements(min).margin(self.margin))
    }
}

/// The BENCH.md configurations a benchmark runs.
#[derive(Args, Debug, Clone)]
pub struct ConfigsArgs {
    /// BENCH.md configurations to run, or `tiny` (the only one the simulator runs).
    #[arg(
        long,
        value_delimiter = ',',
        ignore_case = true,
        value_parser = super::bench_model::CONFIG_NAMES,
        default_values_t = ["S".to_string(), "M".to_string(), "L".to_string()]
    )]
    pub configs: Vec<String>,
}

impl ConfigsArgs {
    /// The configurations, with their attention in `attention`'s form, every one refused before
    /// any runs unless `dev` can run it, so that a refusal does not come after minutes of timing.
    pub fn resolve(
        &self,
        dev: &graphed::device::Device,
        attention: AttentionArgs,
    ) -> anyhow::Result<Vec<super::bench_model::Config>> {
        let configs = self
            .configs
            .iter()
            .map(|name| super::bench_model::Config::named(name).map(|c| c.with_attention(attention)));
        let configs = configs.collect::<anyhow::Result<Vec<_>>>()?;
        for config in &configs {
            config.check_device(dev, "--configs")?;
        }
        Ok(configs)
    }
}

/// What `train` does with a step whose gradients are not finite.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonFiniteArg {
    /// Stop with an error naming the step; the parameters stay those of the last good step.
    Stop,
    /// Skip the step's update, count it, and go on.
    Skip,
}

/// How `train`'s ranks combine their gradients (`graphed::dist::GradReduction`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradReduceArg {
    /// Averaged over the ranks; each rank's loss is its own batch's mean.
    Mean,
    /// Summed over the ranks; each rank's loss is weighed by the whole batch.
    Sum,
}

impl From<GradReduceArg> for graphed::dist::GradReduction {
    fn from(r: GradReduceArg) -> graphed::dist::GradReduction {
        match r {
            GradReduceArg::Mean => graphed::dist::GradReduction::Mean,
            GradReduceArg::Sum => graphed::dist::GradReduction::Sum,
        }
    }
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeArg {
    Bf16,
    F32,
    /// bf16 weights and activations, the Linear layers' GEMMs in FP8 (E4M3 forward, gradients
    /// as `--fp8-gradients` says, E5M2 by default), scaled as `--fp8-scaling` says.
    Fp8,
}

/// How FP8 tensors are scaled (`graphed::nn::Fp8Recipe`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8ScalingArg {
    /// TransformerEngine's delayed scaling: each scale from the amaxes of the last 1024 steps.
    Delayed,
    /// Each tensor's scale from its own amax, taken just before its cast.
    Current,
}

/// The FP8 gradients' format (`graphed::nn::Fp8Recipe::gradients`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8GradientsArg {
    /// TransformerEngine's HYBRID: E5M2 gradients, more range.
    E5m2,
    /// E4M3 gradients, as the forward's tensors: one more bit of precision.
    E4m3,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cuda,
    Sim,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyArg {
    InOrder,
    Random,
    Adversarial,
}

impl From<PolicyArg> for Policy {
    fn from(p: PolicyArg) -> Policy {
        match p {
            PolicyArg::InOrder => Policy::InOrder,
            PolicyArg::Random => Policy::Random,
            PolicyArg::Adversarial => Policy::Adversarial,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    #[command(flatten)]
    pub recompute: RecomputeArgs,
    /// Transformer layers (default: 2).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub layers: Option<u32>,
    /// Model width (default: 128 on CUDA, 32 on the simulator).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=8192))]
    pub dim: Option<u32>,
    /// Attention heads (default: heads of 32 features, width / 32, one below 64: 4 at CUDA's
    /// default width, 1 at the simulator's); must divide the width, into heads of 32, 64 or 128
    /// features with `--attention fused`.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub heads: Option<u32>,
    /// Sums per batch (default: 256 on CUDA, 64 on the simulator).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub batch: Option<u32>,
    /// Run the model eagerly, kernel by kernel, instead of replaying graphed layers.
    #[arg(long)]
    pub eager: bool,
    /// Replay the graphed layers on a side stream, resuming the main stream at the event each
    /// graph records.
    #[arg(long, conflicts_with = "eager")]
    pub side_stream: bool,
    /// Give each layer its own graph pool instead of one pool shared by all layers (more memory;
    /// the layers' graphs may then replay in any relative order).
    #[arg(long, conflicts_with = "eager")]
    pub pool_per_layer: bool,
    #[command(flatten)]
    pub offload: OffloadArgs,
    /// Split each batch into microbatches and the layers into virtual pipeline stages, and step
    /// them under interleaved 1F1B on this GPU: one graph per (layer, microbatch) captured and
    /// replayed in the schedule's order, with buffer reuse (eagerly with `--eager`).
    #[arg(long, conflicts_with_all = ["side_stream", "pool_per_layer", "offload"])]
    pub schedule: bool,
    #[command(flatten)]
    pub schedule_args: ScheduleArgs,
    /// Let each graphed layer lend its parameters' gradient memory to the graph pool while the
    /// gradients hold nothing (from the optimizer to the layer's backward), for the activations
    /// of the layers above it: a smaller pool, each backward starting its layer's gradients
    /// from zero (docs/design.md, "Where a step's memory goes").
    #[arg(long, conflicts_with_all = ["eager", "pool_per_layer", "schedule", "whole_step"])]
    pub lend_gradients: bool,
    /// Capture the whole step (embedding, layers, head and loss) as one forward graph and one
    /// backward graph, the gradients' data-parallel reduction inside the backward, instead of a
    /// graph per layer with the embedding and head eager (the optimizer step is a graph of its
    /// own either way); with `--offload`, the copies inside those two graphs; with
    /// `--side-stream`, replayed on a side stream.
    #[arg(long, conflicts_with_all = ["eager", "pool_per_layer", "schedule"])]
    pub whole_step: bool,
    /// Launched as several ranks (`graphed launch --gpus N`): split them into Megatron-LM's grid
    /// of this many pipeline stages × N / P data-parallel replicas. Each stage holds its chunks
    /// of the layers (the first the embedding, the last the head and the loss) and runs the
    /// `--schedule` (1F1B, or interleaved with `--virtual-stages` above 1) with the stages
    /// before and after it; each stage's gradients are reduced over its replicas
    /// (`--grad-reduce`). Must divide the ranks, and its stages × `--virtual-stages` the layers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub pipeline: u32,
    /// Optimizer steps (default: 1000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub steps: Option<u32>,
    /// Peak learning rate, cosine decay after a warmup (default: 3e-3 on CUDA, 5e-3 on the
    /// simulator).
    #[arg(long)]
    pub lr: Option<f32>,
    /// Dropout probability.
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f32,
    /// Train a byte-level language model of this local text file instead of the addition task
    /// (90% trains, 10% is held out for the validation loss; a sample is written at the end).
    #[arg(long, value_name = "FILE")]
    pub data: Option<std::path::PathBuf>,
    /// Bytes of context per window with `--data`.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(2..=4096))]
    pub context: u32,
    /// Save the model, the optimizer and the data position to `DIR/checkpoint.safetensors` at the
    /// end, and when interrupted (written whole, then renamed over the previous one). Checked
    /// writable before the first step.
    #[arg(long, value_name = "DIR")]
    pub save: Option<std::path::PathBuf>,
    /// Also save every N steps (with `--save`), so that a killed run loses at most N steps.
    #[arg(long = "save-every", value_name = "N", requires = "save", value_parser = clap::value_parser!(u32).range(1..))]
    pub save_every: Option<u32>,
    /// Continue the run saved in `DIR` (started with the same settings) from where it stopped,
    /// bit for bit as if it had not.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<std::path::PathBuf>,
    /// With `--resume`: accept a `--data` file whose size or contents differ from the one the
    /// checkpoint was trained on (refused otherwise).
    #[arg(long = "accept-changed-data", requires_all = ["resume", "data"])]
    pub accept_changed_data: bool,
    /// Write each reported loss as a JSON line (`{"step", "loss", "seconds"}`) to this file, each
    /// line flushed as it is reported; a resumed run appends to it (dropping the lines of steps
    /// after the checkpoint).
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<std::path::PathBuf>,
    /// Draw the loss curve as an SVG chart to this file at the end (and when interrupted).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<std::path::PathBuf>,
    /// Stop after this many of the planned `--steps` (with `--save`, to continue later with
    /// `--resume`).
    #[arg(long = "stop-at", value_name = "STEP", value_parser = clap::value_parser!(u32).range(1..))]
    pub stop_at: Option<u32>,
    /// What a step whose gradients are not finite (NaN or infinite) does: stop the run with an
    /// error naming it (keeping the last good parameters, never saving the bad ones), or skip its
    /// update and go on.
    #[arg(long = "on-nonfinite", value_enum, default_value_t = NonFiniteArg::Stop)]
    pub on_nonfinite: NonFiniteArg,
    /// Launched as several ranks: average the gradients over the ranks (each rank's loss the
    /// mean over its own batch, as PyTorch's DDP), or sum them (each rank's loss weighed by the
    /// whole batch, as Megatron-LM's per-token loss). Either way the step is the whole batch's
    /// mean loss, the loss `train` prints; the sum is the exact one for a number of ranks that is
    /// not a power of two (docs/several-gpus.md).
    #[arg(long = "grad-reduce", value_enum, default_value_t = GradReduceArg::Mean)]
    pub grad_reduce: GradReduceArg,
    /// Held-out sums to evaluate on (default: 1000 on CUDA, 100 on the simulator; the addition
    /// task only).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000), conflicts_with = "data")]
    pub eval: Option<u32>,
    /// Seed of the data, initialization and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Launched as several ranks: seconds a rank waits for the others (joining the group, and
    /// for a step whose collectives a stalled rank never completes) before it ends with an error
    /// naming the graph, the collective and the ranks (PyTorch's process-group timeout).
    #[arg(long = "comm-timeout", value_name = "SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub comm_timeout: u64,
}

impl TrainArgs {
    /// The group's options from `--comm-timeout`.
    pub fn comm_options(&self) -> graphed::device::CommOptions {
        graphed::device::CommOptions { timeout: std::time::Duration::from_secs(self.comm_timeout) }
    }
}

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Layers in the demo stack (default: 8 on CUDA, 4 on the simulator).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=512))]
    pub layers: Option<u32>,
    /// Elements per activation (default: 1Mi on CUDA, 4096 on the simulator).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub width: Option<u32>,
    /// Steps to run each way (default: 50 on CUDA, 5 on the simulator).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub steps: Option<u32>,
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub which: BenchCommand,
}

#[derive(Subcommand, Debug, Clone)]
pub enum BenchCommand {
    /// N tiny kernels launched eagerly against one graph of N, with raw cudarc as the baseline.
    Launch(LaunchBenchArgs),
    /// Host cost of allocating and freeing through the caching allocator against plain device
    /// allocation.
    Alloc(AllocBenchArgs),
    /// The stream-safety checker: its host cost on CUDA, and a planted race with and without
    /// its fix (how often it corrupts data, and the checker's report).
    Check(CheckBenchArgs),
    /// TFLOP/s of a d×d×d bf16 GEMM (compare with `bench/torch_reference.py gemm`).
    Gemm(GemmBenchArgs),
    /// The fused causal attention alone, forward and backward, in ms and TFLOP/s with causal
    /// FLOPs counted as half of the full product (compare with `bench/torch_reference.py
    /// attention`).
    Attention(AttentionBenchArgs),
    /// One transformer layer's forward and backward, eager, bf16 on CUDA unless `--dtype` says
    /// otherwise (compare with `bench/torch_reference.py layer`); `--profile` says where the time
    /// goes per kernel class.
    Layer(LayerBenchArgs),
    /// Per-layer graphed training step against eager and a whole-step graph (BENCH.md's
    /// configurations).
    Graphs(GraphsArgs),
    /// Activation offloading inside the graphs: device memory saved, step-time overhead against
    /// graphed-side, copy rates against the pinned peak, how early the caller resumes (BENCH.md's
    /// configurations; M and L are the ones the goals name).
    Offload(OffloadBenchArgs),
    /// The largest batch, and separately the largest layer count, whose training step fits a
    /// device-memory budget (peak reserved bytes, graph pools and cache together), graphed with
    /// and without activation offloading, each with its step time (compare with
    /// `bench/torch_reference.py memory`).
    Memory(MemoryBenchArgs),
    /// A pipeline schedule on one GPU (all stages local): one graph per (layer, microbatch)
    /// captured and replayed in the schedule's order, with and without buffer reuse, against the
    /// same schedule run eagerly.
    Schedule(ScheduleBenchArgs),
    /// Data and pipeline parallelism over the GPUs of `graphed launch --gpus N -- bench
    /// parallel`: per configuration, one GPU alone, then every GPU with the gradients reduced
    /// eagerly after the backward, then inside the backward graphs (replayed on a side stream);
    /// then pipelines of a stage per GPU (1F1B, interleaved; eager, graphed, graphed with the
    /// exchanges overlapping the passes) with their bubbles,
    /// and their stages timed alone (two on one GPU); throughput and speedup over one GPU.
    Parallel(ParallelBenchArgs),
    /// One step of the `graphs` benchmark model on fixed inputs (eager, which the graphed stack
    /// equals bit for bit), written with its weights, output and gradients to a safetensors
    /// file, for `bench/torch_reference.py parity` to check PyTorch's module against.
    Parity(ParityBenchArgs),
    /// One transformer layer graphed, its forward replayed with the input copied in against
    /// read in place (`forward_in_place`): bytes copied, host time per replay and per rebound
    /// node, GPU time, and whether both give the same bits.
    Rebind(RebindBenchArgs),
}

impl BenchCommand {
    /// Where the benchmark writes its results, and the flag that says so (`--json`, or parity's
    /// `--out`), if anywhere.
    pub fn output(&self) -> Option<(&'static str, &std::path::Path)> {
        let json = match self {
            BenchCommand::Launch(a) => &a.json,
            BenchCommand::Alloc(a) => &a.json,
            BenchCommand::Check(a) => &a.json,
            BenchCommand::Gemm(a) => &a.json,
            BenchCommand::Attention(a) => &a.json,
            BenchCommand::Layer(a) => &a.json,
            BenchCommand::Graphs(a) => &a.bench.json,
            BenchCommand::Offload(a) => &a.bench.json,
            BenchCommand::Memory(a) => &a.json,
            BenchCommand::Schedule(a) => &a.json,
            BenchCommand::Parallel(a) => &a.json,
            BenchCommand::Rebind(a) => &a.json,
            BenchCommand::Parity(a) => return Some(("--out", &a.out)),
        };
        json.as_deref().map(|path| ("--json", path))
    }
}

/// Arguments of `bench graphs`.
#[derive(Args, Debug, Clone)]
pub struct GraphsBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    #[command(flatten)]
    pub recompute: RecomputeArgs,
    #[command(flatten)]
    pub lend: LendArgs,
    #[command(flatten)]
    pub configs: ConfigsArgs,
    #[command(flatten)]
    pub scratch: ScratchArgs,
    /// Timed steps per variant (median, min and max are reported).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub steps: u32,
    /// Untimed steps per variant before the timed ones.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub warmup: u32,
    /// The step's input x: `varied` (element i is (i·7919 mod 1000)/1000 − 0.5), or `constant`
    /// (every element 0.5, which LayerNorm turns into zeros: the GEMMs then read degenerate data,
    /// which draws less power; for comparing with runs that used it).
    #[arg(long, value_enum, default_value_t = BenchInput::Varied)]
    pub input: BenchInput,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// `bench offload`: the step with and without offloading, and the automatic policy under each
/// budget asked for.
#[derive(Args, Debug, Clone)]
pub struct OffloadBenchArgs {
    #[command(flatten)]
    pub bench: GraphsBenchArgs,
    /// More variants of the automatic policy, comma-separated, one per budget: the most step time
    /// its copies may cost, in percent of the measured step (`OffloadConfig::max_overhead`; the
    /// `graphed-offload-auto` variant's is the default, 1). They are captured and timed with the
    /// others, in the same rounds.
    #[arg(long = "max-overhead", value_delimiter = ',', value_parser = parse_percent)]
    pub max_overhead: Vec<f64>,
}

/// The scratch of cuDNN's attention backward in the models the benchmarks build.
#[derive(Args, Debug, Clone, Copy)]
pub struct ScratchArgs {
    /// The most MiB of `T × T` scratch cuDNN's deterministic attention backward keeps at once,
    /// in every layer; 0 runs every attention backward on graphed's kernels under the automatic
    /// backend (default: the call's operands' size, at least 64 MiB and at most 1 GiB, or the
    /// memory free below the allocator's peak at the call where that is more; a limit given is
    /// kept).
    #[arg(long = "scratch-limit-mib", value_parser = clap::value_parser!(u32).range(0..=1 << 20))]
    pub scratch_limit_mib: Option<u32>,
}

impl ScratchArgs {
    /// The limit in bytes, if one was given.
    pub fn bytes(&self) -> Option<usize> {
        self.scratch_limit_mib.map(|mib| (mib as usize) << 20)
    }
}

/// `bench graphs`: the step of each configuration in each variant asked for.
#[derive(Args, Debug, Clone)]
pub struct GraphsArgs {
    #[command(flatten)]
    pub bench: GraphsBenchArgs,
    /// The variants to time, comma-separated, in the order given (default: all six, as below).
    /// Fewer variants make a comparison of two settings cheaper on a GPU.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub variants: Vec<GraphsVariant>,
}

/// How `bench graphs` runs a step; named as in BENCH.md.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphsVariant {
    /// Module by module, kernel by kernel, on the main stream.
    #[value(name = "graphed-eager")]
    Eager,
    /// One graphed callable per layer, replayed on the main stream.
    #[value(name = "graphed")]
    Graphed,
    /// One graphed callable per layer, replayed on a side stream; the main stream resumes at
    /// the event each graph records.
    #[value(name = "graphed-side")]
    Side,
    /// As `graphed-side`, with the default activation offloading inside the graphs.
    #[value(name = "graphed-offload")]
    Offload,
    /// The whole stack graphed as one callable: one forward and one backward graph, with the
    /// replay contract's checks (`train --whole-step`'s form).
    #[value(name = "graphed-whole")]
    Whole,
    /// The whole eager step captured as one graph.
    #[value(name = "graphed-floor")]
    Floor,
}

impl GraphsVariant {
    /// Its name in BENCH.md and the results.
    pub fn name(self) -> &'static str {
        match self {
            GraphsVariant::Eager => "graphed-eager",
            GraphsVariant::Graphed => "graphed",
            GraphsVariant::Side => "graphed-side",
            GraphsVariant::Offload => "graphed-offload",
            GraphsVariant::Whole => "graphed-whole",
            GraphsVariant::Floor => "graphed-floor",
        }
    }

    /// The variants `asked` names, or every one where it names none.
    pub fn asked(asked: &[GraphsVariant]) -> &[GraphsVariant] {
        match asked {
            [] => GraphsVariant::value_variants(),
            some => some,
        }
    }
}

impl GraphsBenchArgs {
    /// The configurations `bench graphs` and `bench offload` run, with the attention and
    /// recompute settings given ([`ConfigsArgs::resolve`]'s refusals included).
    pub fn configs(&self, dev: &graphed::device::Device) -> anyhow::Result<Vec<super::bench_model::Config>> {
        let (recompute, lend) = (self.recompute.recompute(), self.lend.lend_gradients);
        let configs = self.configs.resolve(dev, self.attention)?;
        Ok(configs
            .into_iter()
            .map(|c| c.with_recompute(recompute).with_lending(lend).with_scratch_limit(self.scratch.bytes()))
            .collect())
    }
}

/// The input x of the step `bench graphs` and `bench offload` time.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchInput {
    /// Varied values, as every other benchmark feeds.
    Varied,
    /// Every element 0.5.
    Constant,
}

/// Arguments of `bench parity`.
#[derive(Args, Debug, Clone)]
pub struct ParityBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// BENCH.md configuration, or `tiny` (the simulator runs tiny and S).
    #[arg(long, ignore_case = true, value_parser = super::bench_model::CONFIG_NAMES, default_value = "S")]
    pub config: String,
    /// The safetensors file to write.
    #[arg(long, value_name = "FILE")]
    pub out: std::path::PathBuf,
}

/// Arguments of `inspect`.
#[derive(Args, Debug, Clone)]
pub struct InspectArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// BENCH.md configuration, or `tiny` (default: S on CUDA, tiny on the simulator, the only
    /// one it runs).
    #[arg(long, ignore_case = true, value_parser = super::bench_model::CONFIG_NAMES)]
    pub config: Option<String>,
    /// Write each graph as Graphviz DOT to `<callable>-<pass>.dot` in this directory.
    #[arg(long)]
    pub dot: Option<std::path::PathBuf>,
    /// Capture with a sync event, as for side-stream replay, so that each graph records it.
    #[arg(long)]
    pub side_stream: bool,
    #[command(flatten)]
    pub offload: OffloadArgs,
}

/// A pipeline schedule to run: interleaved 1F1B (1F1B with one virtual stage) for one pipeline
/// stage, all its chunks on this GPU: the only stage, or one of `train --pipeline`'s.
#[derive(Args, Debug, Clone)]
pub struct ScheduleArgs {
    /// Microbatches per step (default: 8).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub microbatches: Option<u32>,
    /// Model chunks (virtual pipeline stages) the layers are split into; must divide the layers
    /// (default: 2).
    #[arg(long = "virtual-stages", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub virtual_stages: Option<u32>,
}

impl ScheduleArgs {
    /// Microbatches per step, as given or the default.
    pub fn microbatches(&self) -> usize {
        self.microbatches.unwrap_or(8) as usize
    }

    /// Virtual stages, as given or the default.
    pub fn virtual_stages(&self) -> usize {
        self.virtual_stages.unwrap_or(2) as usize
    }

    /// Whether either was given (they mean nothing without a schedule).
    pub fn given(&self) -> bool {
        self.microbatches.is_some() || self.virtual_stages.is_some()
    }

    /// Pipeline stage `stage`'s schedule, and the layers of each of its chunks, for a model of
    /// `layers` layers split into `stage.count()` stages of `--virtual-stages` chunks each.
    pub fn resolve(&self, layers: usize, stage: Stage) -> anyhow::Result<(graphed::nn::Schedule, Vec<usize>)> {
        let (v, m, p) = (self.virtual_stages(), self.microbatches(), stage.count());
        if !layers.is_multiple_of(v * p) {
            let flags =
                if p > 1 { format!("--pipeline {p} × --virtual-stages {v}") } else { format!("{v} virtual stages") };
            return Err(Refused::error(format!(
                "{layers} layers do not split into {flags} chunks of equal layers; pass --layers or --virtual-stages to fit"
            )));
        }
        if v > 1 && !m.is_multiple_of(p) {
            return Err(Refused::error(format!(
                "interleaving ({v} virtual stages) runs microbatches in groups of the --pipeline {p} stages: --microbatches \
                 {m} is not a multiple of {p}; pass a multiple, or --virtual-stages 1"
            )));
        }
        let schedule = graphed::nn::Schedule::interleaved_1f1b(p, stage.index(), v, m)?;
        Ok((schedule, vec![layers / (v * p); v]))
    }
}

/// Arguments of `bench memory`.
#[derive(Args, Debug, Clone)]
pub struct MemoryBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    #[command(flatten)]
    pub lend: LendArgs,
    #[command(flatten)]
    pub scratch: ScratchArgs,
    /// The BENCH.md configuration whose width and sequence length the searches keep (`tiny` on
    /// the simulator).
    #[arg(long, ignore_case = true, value_parser = super::bench_model::CONFIG_NAMES, default_value = "L")]
    pub config: String,
    /// Device memory a step may reserve at its peak: a number of bytes with a unit, `24GiB`,
    /// `512MiB` (KiB, MiB, GiB, TiB; B or none for bytes).
    #[arg(long, default_value = "24GiB", value_parser = parse_bytes)]
    pub budget: usize,
    /// What to search: the batch (the configuration's layer count kept), the layer count (its
    /// batch kept), or both.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [MemorySearch::Batch, MemorySearch::Layers])]
    pub search: Vec<MemorySearch>,
    /// The variants searched, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [MemoryVariant::Graphed, MemoryVariant::GraphedOffload, MemoryVariant::GraphedOffloadAuto, MemoryVariant::GraphedRecompute])]
    pub variants: Vec<MemoryVariant>,
    /// Timed steps per probe (the step time is their median).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub steps: u32,
    /// Untimed steps per probe before the timed ones.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub warmup: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// What `bench memory` searches.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemorySearch {
    /// Sequences per batch.
    Batch,
    /// Transformer layers.
    Layers,
}

/// A variant of `bench memory`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryVariant {
    /// Per-layer graphs, every activation on the device.
    Graphed,
    /// The default sites offloaded inside the graphs.
    GraphedOffload,
    /// The automatic offload policy (CUDA only: it times the layers).
    GraphedOffloadAuto,
    /// Per-layer graphs, the MLPs' GELU output recomputed in the backward (`--recompute gelu`).
    GraphedRecompute,
    /// The GELU output recomputed, and the automatic offload policy.
    GraphedRecomputeOffloadAuto,
}

/// A percentage from 0 to 100, as a share (`1.5` is 0.015).
fn parse_percent(text: &str) -> Result<f64, String> {
    match text.trim().trim_end_matches('%').parse::<f64>() {
        Ok(p) if (0.0..=100.0).contains(&p) => Ok(p / 100.0),
        _ => Err(format!("`{text}` is not a percentage from 0 to 100 (say 1.5 or 1.5%)")),
    }
}

/// A byte count with an optional binary unit (`24GiB`, `512MiB`, `4096`): a `--budget`.
fn parse_bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        other => return Err(format!("unknown unit `{other}`: write the size as 24GiB, 512MiB, 64KiB or plain bytes")),
    };
    let value: f64 =
        number.parse().map_err(|_| format!("`{text}` is not a size: write it as 24GiB, 512MiB or plain bytes"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !(bytes >= 1.0 && bytes < usize::MAX as f64) {
        return Err(format!("`{text}` is not a positive size that fits in memory"));
    }
    Ok(bytes as usize)
}

/// Arguments of `bench parallel`.
#[derive(Args, Debug, Clone)]
pub struct ParallelBenchArgs {
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// BENCH.md configurations.
    #[arg(long, value_delimiter = ',', ignore_case = true, value_parser = super::bench_model::CONFIG_NAMES, default_values_t = ["M".to_string(), "L".to_string()])]
    pub configs: Vec<String>,
    /// Timed steps per variant (median, min and max are reported).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub steps: u32,
    /// Untimed steps per variant before the timed ones.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub warmup: u32,
    /// Microbatches per step of the pipeline variants (a multiple of the GPUs, for interleaving).
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    pub microbatches: usize,
    /// Also write the results as JSON to this file (rank 0).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// Arguments of `bench schedule`.
#[derive(Args, Debug, Clone)]
pub struct ScheduleBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// BENCH.md configuration, or `tiny` (default: M on CUDA, tiny on the simulator).
    #[arg(long, ignore_case = true, value_parser = super::bench_model::CONFIG_NAMES)]
    pub config: Option<String>,
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Timed steps per variant (median, min and max are reported).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub steps: u32,
    /// Untimed steps per variant before the timed ones.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub warmup: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct LayerBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    #[command(flatten)]
    pub configs: ConfigsArgs,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub reps: u32,
    /// After the timed repetitions, profile one forward and backward and print where the time
    /// goes, per kernel class: count, GPU time, share, GB/s, TFLOP/s and fraction of the H200's
    /// roofs (also in the JSON).
    #[arg(long)]
    pub profile: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// Arguments of `bench rebind`.
#[derive(Args, Debug, Clone)]
pub struct RebindBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    #[command(flatten)]
    pub configs: ConfigsArgs,
    /// Dropout probabilities of the layer, each a row per configuration.
    #[arg(long, value_delimiter = ',', default_values_t = [0.0, 0.1])]
    pub dropout: Vec<f32>,
    /// Timed replays per way of feeding the input (the median is reported).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub reps: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct GemmBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Matrix size of the square product (without `--configs`).
    #[arg(long, default_value_t = 4096)]
    pub d: usize,
    /// Instead of the square product, the twelve GEMMs of one transformer layer of each of these
    /// BENCH.md configurations, with and without their epilogues.
    #[arg(long, value_delimiter = ',', ignore_case = true, value_parser = super::bench_model::CONFIG_NAMES)]
    pub configs: Vec<String>,
    /// Also time each GEMM in FP8 (`Fp8Gemm`): E4M3 × E4M3 for the forward's shapes, an E5M2
    /// gradient × E4M3 for the backward's, in FP8's one layout, without epilogue.
    #[arg(long)]
    pub fp8: bool,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub reps: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct AttentionBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Sequences.
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
    /// Heads.
    #[arg(long, default_value_t = 64)]
    pub heads: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    pub seq: usize,
    /// Features per head (32, 64 or 128).
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// What runs it: `auto` (cuDNN where it runs the call, else graphed's kernels), `cudnn` or
    /// `kernels`.
    #[arg(long = "attention-backend", value_enum, default_value_t = AttentionBackendArg::Auto)]
    pub backend: AttentionBackendArg,
    /// The most MiB of `T × T` scratch cuDNN's deterministic backward keeps at once; more runs
    /// as several executions over groups of (batch element, head) pairs (default: the call's
    /// operands' size, at least 64 MiB and at most 1 GiB, or the memory free below the
    /// allocator's peak at the call where that is more; a limit given is kept).
    #[arg(long = "scratch-limit-mib", value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub scratch_limit_mib: Option<u32>,
    #[command(flatten)]
    pub dtype: DTypeArgs,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub reps: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct CheckBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Kernels per timed batch.
    #[arg(long, default_value_t = 1000)]
    pub n: usize,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub reps: u32,
    /// Runs of the planted race, each way.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub trials: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct AllocBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Allocation sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = [4096, 1 << 20, 64 << 20])]
    pub sizes: Vec<usize>,
    /// Alloc/free pairs per size.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub pairs: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct LaunchBenchArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Kernel counts to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [10, 100, 1000])]
    pub n: Vec<usize>,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub reps: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// Arguments of `report`.
#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// The results folder. Each benchmark's newest file is the one whose commit (the end of its
    /// name) comes first in `git rev-list HEAD` of the repository holding the folder; the plots
    /// go to its `plots/`.
    #[arg(long, value_name = "DIR", default_value = "bench/results")]
    pub results: std::path::PathBuf,
    /// A page whose blocks between `<!-- report:<bench> -->` and `<!-- /report:<bench> -->` are
    /// rewritten (nothing else in it is); repeat for several. Each benchmark's table goes into
    /// every page that has its block, and each benchmark needs a block in one page at least. The
    /// pages must lie in the repository that holds the results folder.
    #[arg(long = "page", value_name = "FILE", default_values = ["README.md", "docs/benchmarks.md"])]
    pub pages: Vec<std::path::PathBuf>,
    /// Write nothing; fail, naming each block and plot that differs, unless the pages and the
    /// plots are what `report` would write.
    #[arg(long)]
    pub check: bool,
}
