//! `graphed bench layer`: one transformer layer of `BENCH.md`'s configurations, forward and
//! backward, eager, in bf16 on CUDA unless `--dtype` says otherwise; `bench/torch_reference.py
//! layer` times the same layer in PyTorch on the same GPU. After the timed repetitions, one more
//! forward and backward runs under a kernel profile (`Stream::profile`), which counts the
//! layer's kernels; with `--profile`, a table of its kernel classes says where the time goes,
//! against the H200's roofs, and for the fused attention its forward's and backward's TFLOP/s by
//! FlashAttention's convention (causal FLOPs counted as half; the backward's as 2.5 times the
//! forward's, over its three kernels' time). The input and the upstream gradient are uniform
//! random numbers in [-1, 1) from a fixed seed, as on PyTorch's side: a constant input makes
//! every LayerNorm output row its bias, and GEMMs over such data draw less power and clock
//! higher than over a real step's activations.

use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use anyhow::bail;
use graphed::device::{DType, Device, DeviceKind, KernelTime, Stream};
use graphed::memory::CachingAllocator;
use graphed::nn::{Builder, Fp8Training, Inputs, KeepOnDevice, Module, ParamStore, TransformerLayer};
use graphed::tensor::Tensor;
use serde::Serialize;

use super::{median, write_json, Report};
use crate::cli::args::{DeviceChoice, LayerBenchArgs};
use crate::cli::bench_model::Config;

/// A GPU's roofs (SXM datasheets) that a profile rates its kernels against.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Roofs {
    /// The GPU they are of.
    gpu: &'static str,
    /// HBM bandwidth, bytes/s.
    hbm_bytes_per_s: f64,
    /// Dense bf16 on the tensor cores, FLOP/s.
    bf16_flop_per_s: f64,
    /// Dense FP8 on the tensor cores, FLOP/s: the roof of the FP8 GEMMs.
    fp8_flop_per_s: f64,
    /// f32 FMA without TF32 (graphed's f32 GEMMs are IEEE f32), FLOP/s.
    f32_flop_per_s: f64,
}

impl Roofs {
    const H200: Roofs = Roofs {
        gpu: "NVIDIA H200",
        hbm_bytes_per_s: 4.8e12,
        bf16_flop_per_s: 989e12,
        fp8_flop_per_s: 1979e12,
        f32_flop_per_s: 67e12,
    };
    const H100: Roofs = Roofs {
        gpu: "NVIDIA H100 SXM",
        hbm_bytes_per_s: 3.35e12,
        bf16_flop_per_s: 989e12,
        fp8_flop_per_s: 1979e12,
        f32_flop_per_s: 67e12,
    };

    /// The roofs of the GPU `name` describes (`Device::name`): an H100 SXM's (80 GB of HBM3)
    /// or, for any other GPU, an H200's, which the printout then says are assumed.
    fn of(name: &str) -> (Roofs, bool) {
        if name.contains("H100 80GB HBM3") {
            (Roofs::H100, true)
        } else {
            (Roofs::H200, name.contains("H200"))
        }
    }
}

#[derive(Serialize, Debug)]
struct LayerRow {
    config: &'static str,
    dim: usize,
    batch: usize,
    seq: usize,
    dtype: String,
    /// `fused` or `unfused` (`--attention`).
    attention: &'static str,
    /// Between timing events; none on the simulator, which has no clock.
    gpu_ms: Option<f64>,
    host_ms: f64,
    /// Launches and GEMMs of one forward (memsets and copies are not counted).
    kernels_forward: usize,
    /// Launches and GEMMs of one backward.
    kernels_backward: usize,
    /// Where one forward and backward spend their time, per kernel class (with `--profile`).
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<Vec<ClassRow>>,
    /// The fused attention's rates by FlashAttention's convention (with `--profile`, fused).
    #[serde(skip_serializing_if = "Option::is_none")]
    attention_rates: Option<AttentionRates>,
    /// What ran the fused attention (`--attention-backend`), if the layer has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    attention_backends: Option<Backends>,
}

/// What ran a fused attention's forward and backward: `cudnn` or `kernels`.
#[derive(Serialize, Debug)]
pub(super) struct Backends {
    pub(super) forward: String,
    pub(super) backward: String,
}

impl Backends {
    /// What `attn` ran, if it ran fused.
    pub(super) fn of(attn: &graphed::nn::CausalSelfAttention) -> Option<Backends> {
        Backends::of_layers([attn])
    }

    /// What the layers' attentions ran, if they ran fused: one name where all ran the same,
    /// else each layer's, in order (the automatic backend decides per call).
    pub(super) fn of_layers<'a>(
        attns: impl IntoIterator<Item = &'a graphed::nn::CausalSelfAttention>,
    ) -> Option<Backends> {
        let ran: Vec<_> = attns.into_iter().map(|a| a.backends_ran()).collect();
        let names = |pass: &dyn Fn(&graphed::nn::BackendsRan) -> Option<graphed::ops::attention::AttentionBackend>| {
            let names: Vec<String> = ran.iter().map(|r| pass(r).map(|b| b.to_string())).collect::<Option<_>>()?;
            match names.iter().all(|n| *n == names[0]) {
                true => names.first().cloned(),
                false => Some(format!("per layer {}", names.join(", "))),
            }
        };
        Some(Backends { forward: names(&|r| r.forward)?, backward: names(&|r| r.backward)? })
    }
}

/// The fused attention's kernels in a profiled forward and backward, rated as FlashAttention
/// rates its own: the forward's FLOPs are its two causal products, 4·pairs·T²·hd/2; the
/// backward's are counted as 2.5 times those (its five products, whatever the kernels
/// recompute), over the time of its kernels: graphed's three (delta, dk/dv, dq), or cuDNN's
/// one execution (the profile names each cuDNN call once, whatever kernels cuDNN runs in it).
#[derive(Serialize, Debug, PartialEq)]
struct AttentionRates {
    forward_flops: u64,
    forward_us: Option<f64>,
    /// The backward's time: graphed's delta, dk/dv and dq kernels, or cuDNN's execution.
    backward_us: Option<f64>,
    forward_tflop_per_s: Option<f64>,
    /// 2.5 × `forward_flops` over `backward_us`.
    backward_tflop_per_s: Option<f64>,
}

/// The fused attention's rates in `times`, if it ran.
fn attention_rates(times: &[KernelTime]) -> Option<AttentionRates> {
    let of =
        |prefixes: &[&str]| times.iter().filter(|t| prefixes.iter().any(|p| t.name.starts_with(p))).collect::<Vec<_>>();
    let forward = of(&["attention_forward_", "cudnn_sdpa_forward_"]);
    let backward = of(&["attention_delta_", "attention_backward_", "cudnn_sdpa_backward_"]);
    if forward.is_empty() {
        return None;
    }
    let forward_flops = forward.iter().filter_map(|t| t.flops).sum::<u64>();
    let forward_us = forward.iter().map(|t| t.elapsed_us).sum::<Option<f64>>();
    let backward_us =
        (!backward.is_empty()).then(|| backward.iter().map(|t| t.elapsed_us).sum::<Option<f64>>()).flatten();
    let rate = |flops: f64, us: Option<f64>| us.filter(|&us| us > 0.0).map(|us| flops / (us * 1e-6) / 1e12);
    Some(AttentionRates {
        forward_flops,
        forward_us,
        backward_us,
        forward_tflop_per_s: rate(forward_flops as f64, forward_us),
        backward_tflop_per_s: rate(2.5 * forward_flops as f64, backward_us),
    })
}

/// The launches of one kernel class (one kernel name: its dtype and epilogue included) in a
/// profiled forward and backward.
#[derive(Serialize, Debug)]
struct ClassRow {
    class: &'static str,
    count: usize,
    /// Declared by the launches' arguments (see `KernelTime::bytes`), not measured.
    bytes: u64,
    /// For GEMMs, 2·m·n·k·batch summed; for the fused attention's kernels, the products they
    /// execute (causal: half of each `T × T` product), as their launches declare.
    flops: Option<u64>,
    /// GPU µs summed; none on the simulator.
    total_us: Option<f64>,
    /// `total_us` over the layer's median GPU time.
    share: Option<f64>,
    gb_per_s: Option<f64>,
    tflop_per_s: Option<f64>,
    /// The roof that bounds the class: HBM, or the GEMM peak of the layer's dtype when its FLOPs
    /// take longer at that peak than its bytes at HBM speed.
    roof: &'static str,
    /// That bound's time over the measured time.
    of_roof: Option<f64>,
}

pub fn run(args: &LayerBenchArgs) -> anyhow::Result<()> {
    let dev = super::super::open_device(&args.device)?;
    if dev.kind() != DeviceKind::Cuda && args.device.device != DeviceChoice::Sim {
        bail!(
            "bench layer times GPU work; run it on a CUDA device (or smoke-test it with `--device sim --configs tiny`)"
        );
    }
    let configs = args.configs.resolve(&dev, args.attention)?;
    let dtype = args.dtype.storage(&dev);
    let label = args.dtype.label(&dev);
    let roofs = Roofs::of(&dev.name());
    let s = dev.stream()?;
    let mut rows = Vec::new();
    for config in configs {
        let row = run_config(&dev, &s, (config, dtype, roofs.0), args)?;
        let gpu =
            row.gpu_ms.map_or_else(|| "no GPU time (the simulator has no clock)".into(), |ms| format!("{ms:.3} ms"));
        println!(
            "{}: d={} batch={} seq={} {label}: {gpu} per forward+backward, {:.3} ms host; kernels: {} forward, {} backward",
            row.config, row.dim, row.batch, row.seq, row.host_ms, row.kernels_forward, row.kernels_backward
        );
        if let Some(classes) = &row.profile {
            print_classes(classes, row.gpu_ms, dtype, roofs);
        }
        if let Some(ran) = &row.attention_backends {
            println!("  fused attention ran on: forward {}, backward {}", ran.forward, ran.backward);
        }
        if let Some(a) = &row.attention_rates {
            let opt = |v: Option<f64>, unit: &str| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1} {unit}"));
            println!(
                "  fused attention, FlashAttention's convention (causal FLOPs halved; backward = 2.5 × forward's {:.3} \
                 GFLOP): forward {} in {}, backward {} in {}",
                a.forward_flops as f64 / 1e9,
                opt(a.forward_tflop_per_s, "TFLOP/s"),
                opt(a.forward_us, "µs"),
                opt(a.backward_tflop_per_s, "TFLOP/s"),
                opt(a.backward_us, "µs"),
            );
        }
        rows.push(row);
    }
    write_json(&args.json, &Report::new("layer", &dev, args.reps, rows))
}

/// One configuration's layer timed (and profiled against `roofs` with `--profile`).
fn run_config(
    dev: &Device,
    s: &Stream,
    (config, dtype, roofs): (Config, DType, Roofs),
    args: &LayerBenchArgs,
) -> anyhow::Result<LayerRow> {
    let Config { dim: d, batch: b, seq: t, .. } = config;
    let alloc = CachingAllocator::new(dev);
    let store = ParamStore::with_dtype(&alloc, s, TransformerLayer::parameter_count(d), dtype)?;
    let vb = Builder::new(&store, &alloc, s)?.with_seed(1).pp("layer");
    // With `--dtype fp8`, the Linear layers' GEMMs in FP8; the recipe's step is not timed (a
    // training step runs it once, in its optimizer's graph).
    let fp8 = args.dtype.fp8_recipe()?.map(|recipe| Fp8Training::new(&alloc, recipe));
    let vb = match &fp8 {
        Some(f) => vb.with_fp8(f),
        None => vb,
    };
    let layer = TransformerLayer::new(&vb, config.attention_spec())?;
    if let Some(f) = &fp8 {
        f.start(s)?;
    }
    let mut rng = SmallRng::seed_from_u64(0);
    let mut random = || (0..b * t * d).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>();
    let x = Tensor::from_f32(&alloc, s, &random(), &[b, t, d], dtype)?;
    let dy = Tensor::from_f32(&alloc, s, &random(), &[b, t, d], dtype)?;
    let on_gpu = dev.kind() == DeviceKind::Cuda;
    let (start, end) = (dev.timing_event()?, dev.timing_event()?);
    let (mut gpu, mut host) = (Vec::new(), Vec::new());
    for rep in 0..args.reps + 3 {
        s.record(&start)?;
        let issued = Instant::now();
        let (_, ctx) = layer.forward(&Inputs::one(&x), &KeepOnDevice, s)?;
        layer.backward(ctx, &[&dy], s)?;
        let h = issued.elapsed().as_secs_f64() * 1e3;
        s.record(&end)?;
        end.synchronize()?;
        if rep >= 3 {
            if on_gpu {
                gpu.push(f64::from(start.elapsed_ms(&end)?));
            }
            host.push(h);
        }
    }
    let gpu_ms = (!gpu.is_empty()).then(|| median(gpu));
    let profile = s.profile()?;
    let (_, ctx) = layer.forward(&Inputs::one(&x), &KeepOnDevice, s)?;
    let forward = profile.finish()?;
    let profile = s.profile()?;
    layer.backward(ctx, &[&dy], s)?;
    let backward = profile.finish()?;
    let (kernels_forward, kernels_backward) = (forward.len(), backward.len());
    let times = [forward, backward].concat();
    let profile = args.profile.then(|| classes(&times, gpu_ms.map(|ms| ms * 1e3), dtype, roofs));
    let attention_rates = args.profile.then(|| attention_rates(&times)).flatten();
    Ok(LayerRow {
        config: config.name,
        dim: d,
        batch: b,
        seq: t,
        dtype: dtype.to_string(),
        attention: config.attention.name(),
        gpu_ms,
        host_ms: median(host),
        kernels_forward,
        kernels_backward,
        profile,
        attention_rates,
        attention_backends: Backends::of(&layer.attn),
    })
}

/// The launches grouped by kernel name, the longest first (in first-launch order without a
/// clock); `layer_us` is the layer's GPU time that shares are of.
fn classes(times: &[KernelTime], layer_us: Option<f64>, dtype: DType, roofs: Roofs) -> Vec<ClassRow> {
    let (peak_name, peak) = match dtype {
        DType::BF16 => ("bf16 TC", roofs.bf16_flop_per_s),
        _ => ("f32", roofs.f32_flop_per_s),
    };
    let mut names: Vec<&'static str> = Vec::new();
    for t in times {
        if !names.contains(&t.name) {
            names.push(t.name);
        }
    }
    let mut rows: Vec<ClassRow> = names
        .into_iter()
        .map(|class| {
            let launches: Vec<&KernelTime> = times.iter().filter(|t| t.name == class).collect();
            let bytes = launches.iter().map(|t| t.bytes).sum::<u64>();
            let flops = launches.iter().filter_map(|t| t.flops).reduce(|a, b| a + b);
            let total_us = launches.iter().map(|t| t.elapsed_us).sum::<Option<f64>>();
            // The roofline: the longer of the bytes at HBM speed and the FLOPs at the peak.
            let hbm_s = bytes as f64 / roofs.hbm_bytes_per_s;
            // FP8 GEMMs (named by their operands' formats) against the FP8 peak.
            let (peak_name, peak) = match class.starts_with("gemm_e4m3") || class.starts_with("gemm_e5m2") {
                true => ("fp8 TC", roofs.fp8_flop_per_s),
                false => (peak_name, peak),
            };
            let compute_s = flops.map_or(0.0, |f| f as f64 / peak);
            let (roof, bound_s) = if compute_s > hbm_s { (peak_name, compute_s) } else { ("HBM", hbm_s) };
            let per_s = |amount: f64| total_us.map(|us| amount / (us * 1e-6));
            ClassRow {
                class,
                count: launches.len(),
                bytes,
                flops,
                total_us,
                share: total_us.zip(layer_us).map(|(us, layer)| us / layer),
                gb_per_s: per_s(bytes as f64 / 1e9),
                tflop_per_s: flops.and_then(|f| per_s(f as f64 / 1e12)),
                roof,
                of_roof: total_us.map(|us| bound_s / (us * 1e-6)),
            }
        })
        .collect();
    rows.sort_by(|a, b| b.total_us.unwrap_or(0.0).total_cmp(&a.total_us.unwrap_or(0.0)));
    rows
}

fn print_classes(rows: &[ClassRow], gpu_ms: Option<f64>, dtype: DType, (roofs, known): (Roofs, bool)) {
    let opt = |v: Option<f64>, prec: usize| v.map_or_else(|| "-".to_string(), |v| format!("{v:.prec$}"));
    let pct = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{:.1}%", 100.0 * v));
    let w = rows.iter().map(|r| r.class.len()).max().unwrap_or(0).max("all kernels".len());
    println!(
        "  {:<w$} {:>4} {:>9} {:>8} {:>10} {:>6} {:>8} {:>8}  {:<7} {:>7}",
        "class", "n", "MB", "GFLOP", "total µs", "share", "GB/s", "TFLOP/s", "roof", "of roof"
    );
    for r in rows {
        println!(
            "  {:<w$} {:>4} {:>9.3} {:>8} {:>10} {:>6} {:>8} {:>8}  {:<7} {:>7}",
            r.class,
            r.count,
            r.bytes as f64 / 1e6,
            opt(r.flops.map(|f| f as f64 / 1e9), 3),
            opt(r.total_us, 1),
            pct(r.share),
            opt(r.gb_per_s, 0),
            opt(r.tflop_per_s, 1),
            r.roof,
            pct(r.of_roof),
        );
    }
    let total_us = rows.iter().map(|r| r.total_us).sum::<Option<f64>>();
    let share = total_us.zip(gpu_ms).map(|(us, ms)| us / (ms * 1e3));
    println!(
        "  {:<w$} {:>4} {:>9.3} {:>8} {:>10} {:>6}  (the rest: gaps between kernels, memsets, copies)",
        "all kernels",
        rows.iter().map(|r| r.count).sum::<usize>(),
        rows.iter().map(|r| r.bytes).sum::<u64>() as f64 / 1e6,
        opt(Some(rows.iter().filter_map(|r| r.flops).sum::<u64>() as f64 / 1e9), 3),
        opt(total_us, 1),
        pct(share),
    );
    println!(
        "  roofs ({}{}): HBM {:.2} TB/s; dense bf16 tensor core {:.0} TFLOP/s; dense FP8 {:.0} TFLOP/s; f32 without \
         TF32 {:.0} TFLOP/s",
        roofs.gpu,
        if known { "" } else { "'s, assumed: this GPU's are not known here" },
        roofs.hbm_bytes_per_s / 1e12,
        roofs.bf16_flop_per_s / 1e12,
        roofs.fp8_flop_per_s / 1e12,
        roofs.f32_flop_per_s / 1e12,
    );
    println!(
        "  of roof: the roofline's bound (declared bytes at HBM speed, or declared FLOPs (GEMMs, fused attention) at \
         the {dtype} peak, the FP8 one for FP8 GEMMs, whichever is longer) over the measured time; shares are of the \
         median GPU time above"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_roofs_are_the_gpus_the_profile_ran_on() {
        assert_eq!(Roofs::of("NVIDIA H100 80GB HBM3 (sm_90, driver 13.0)"), (Roofs::H100, true));
        assert_eq!(Roofs::of("NVIDIA H200 (sm_90, driver 13.0)"), (Roofs::H200, true));
        assert_eq!(Roofs::of("the simulator"), (Roofs::H200, false));
    }

    #[test]
    fn classes_group_by_name_and_pick_the_binding_roof() {
        let t = |name, bytes, flops, us| KernelTime { name, bytes, flops, elapsed_us: Some(us) };
        let times = [
            t("gemm_bf16_bias", 1_000_000, Some(989_000_000_000), 1000.0),
            t("layernorm_forward_bf16", 2_400_000, None, 1.0),
            t("gemm_bf16_bias", 1_000_000, Some(989_000_000_000), 1000.0),
            t("gemm_bf16", 4_800_000_000, Some(1_000), 2000.0),
            t("gemm_e4m3_e4m3_bf16_bias", 1_000_000, Some(1_979_000_000_000), 1500.0),
        ];
        let rows = classes(&times, Some(5000.0), DType::BF16, Roofs::H200);
        let summary: Vec<_> = rows.iter().map(|r| (r.class, r.count, r.bytes, r.flops, r.roof)).collect();
        assert_eq!(
            summary,
            vec![
                ("gemm_bf16_bias", 2, 2_000_000, Some(1_978_000_000_000), "bf16 TC"),
                ("gemm_bf16", 1, 4_800_000_000, Some(1_000), "HBM"),
                ("gemm_e4m3_e4m3_bf16_bias", 1, 1_000_000, Some(1_979_000_000_000), "fp8 TC"),
                ("layernorm_forward_bf16", 1, 2_400_000, None, "HBM"),
            ],
            "longest first; a GEMM whose bytes take longer than its FLOPs is bound by HBM"
        );
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9 * b.abs().max(1.0));
        // 1.978 PFLOP in 2 ms at 989 TFLOP/s takes 2 ms: at the roof.
        assert!(close(rows[0].tflop_per_s, 989.0) && close(rows[0].of_roof, 1.0) && close(rows[0].share, 0.4));
        // 4.8 GB in 2 ms: 2400 GB/s, half of HBM's 4.8 TB/s.
        assert!(close(rows[1].gb_per_s, 2400.0) && close(rows[1].of_roof, 0.5));
        // 1.979 PFLOP in 1.5 ms against FP8's 1979 TFLOP/s: two thirds of its roof.
        assert!(close(rows[2].of_roof, 1.0 / 1.5));
        assert!(close(rows[3].gb_per_s, 2400.0) && rows[3].tflop_per_s.is_none());
    }

    #[test]
    fn attention_rates_follow_flashattentions_convention() {
        let t = |name, flops, us| KernelTime { name, bytes: 0, flops, elapsed_us: Some(us) };
        let times = [
            t("gemm_bf16", Some(1), 5.0),
            t("attention_forward_bf16_d64", Some(400_000_000), 1.0),
            t("attention_delta_bf16_d64", None, 0.5),
            t("attention_backward_dkdv_bf16_d64", Some(800_000_000), 2.0),
            t("attention_backward_dq_bf16_d64", Some(600_000_000), 2.5),
        ];
        let a = attention_rates(&times).expect("the fused attention ran");
        assert_eq!((a.forward_flops, a.forward_us, a.backward_us), (400_000_000, Some(1.0), Some(5.0)));
        // 0.4 GFLOP in 1 µs: 400 TFLOP/s; 2.5 × 0.4 GFLOP in 5 µs: 200 TFLOP/s.
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9 * b);
        assert!(close(a.forward_tflop_per_s, 400.0) && close(a.backward_tflop_per_s, 200.0), "{a:?}");
        assert_eq!(attention_rates(&times[..1]), None, "no fused attention, no rates");
        let cudnn = [
            t("cudnn_sdpa_forward_bf16", Some(400_000_000), 1.0),
            t("cudnn_sdpa_backward_bf16", Some(1_000_000_000), 4.0),
        ];
        let a = attention_rates(&cudnn).expect("cuDNN's fused attention ran");
        assert_eq!((a.forward_us, a.backward_us), (Some(1.0), Some(4.0)));
        assert!(close(a.forward_tflop_per_s, 400.0) && close(a.backward_tflop_per_s, 250.0), "{a:?}");
    }
}
