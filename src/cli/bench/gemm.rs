//! `graphed bench gemm`: TFLOP/s of a d×d×d bf16 GEMM through graphed (cuBLASLt with f32
//! accumulation), timed with CUDA events; `bench/torch_reference.py gemm` times PyTorch's.

use graphed::device::{DeviceKind, Gemm};
use half::bf16;
use serde::Serialize;

use super::{median, write_json, Report};
use crate::cli::args::GemmBenchArgs;

#[derive(Serialize, Debug)]
struct GemmRow {
    d: usize,
    median_ms: f64,
    tflops: f64,
}

pub fn run(args: &GemmBenchArgs) -> anyhow::Result<()> {
    let dev = super::super::open_device(&args.device)?;
    anyhow::ensure!(dev.kind() == DeviceKind::Cuda, "bench gemm times GPU kernels; run it on a CUDA device");
    let s = dev.stream()?;
    let d = args.d;
    let fill: Vec<bf16> = (0..d * d).map(|i| bf16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5)).collect();
    let (a, b, c) = (dev.alloc_from(&s, &fill)?, dev.alloc_from(&s, &fill)?, dev.alloc::<bf16>(d * d)?);
    let (start, end) = (dev.timing_event()?, dev.timing_event()?);
    for _ in 0..5 {
        s.gemm(Gemm::new(c.view(), a.view(), b.view(), (d, d, d)))?;
    }
    s.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..args.reps {
        s.record(&start)?;
        s.gemm(Gemm::new(c.view(), a.view(), b.view(), (d, d, d)))?;
        s.record(&end)?;
        end.synchronize()?;
        times.push(f64::from(start.elapsed_ms(&end)?));
    }
    let ms = median(times);
    let tflops = 2.0 * (d as f64).powi(3) / (ms * 1e-3) / 1e12;
    println!("graphed bf16 GEMM d={d}: {ms:.3} ms, {tflops:.1} TFLOP/s");
    write_json(&args.json, &Report::new("gemm", &dev, args.reps, vec![GemmRow { d, median_ms: ms, tflops }]))
}
