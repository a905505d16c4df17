//! `graphed bench layer`: one transformer layer of `BENCH.md`'s configurations, forward and
//! backward, eager, in f32 (the dtype graphed's modules have today); `bench/torch_reference.py
//! layer` times the same layer in PyTorch on the same GPU.

use graphed::device::DType;
use std::time::Instant;

use graphed::device::DeviceKind;
use graphed::memory::CachingAllocator;
use graphed::nn::{DropoutSpec, Inputs, KeepOnDevice, Module, ParamStore, TransformerLayer};
use graphed::tensor::Tensor;
use serde::Serialize;

use super::{median, write_json, Report};
use crate::cli::args::LayerBenchArgs;

#[derive(Serialize, Debug)]
struct LayerRow {
    config: String,
    dim: usize,
    batch: usize,
    seq: usize,
    gpu_ms: f64,
    host_ms: f64,
}

/// (name, d, batch, seq) of `BENCH.md`.
const CONFIGS: [(&str, usize, usize, usize); 3] = [("S", 256, 2, 64), ("M", 1024, 4, 512), ("L", 4096, 2, 2048)];

pub fn run(args: &LayerBenchArgs) -> anyhow::Result<()> {
    let dev = super::super::open_device(&args.device)?;
    anyhow::ensure!(dev.kind() == DeviceKind::Cuda, "bench layer times GPU work; run it on a CUDA device");
    let s = dev.stream()?;
    let mut rows = Vec::new();
    for &(name, d, b, t) in CONFIGS.iter().filter(|c| args.configs.iter().any(|n| n.eq_ignore_ascii_case(c.0))) {
        let alloc = CachingAllocator::new(&dev);
        let mut store = ParamStore::new(&alloc, &s, TransformerLayer::parameter_count(d))?;
        let step = Tensor::zeros(&alloc, &s, &[1], DType::U64)?;
        let spec = DropoutSpec { p: 0.0, seed: 0, site: 0, step };
        let layer = TransformerLayer::new(&mut store, &alloc, "layer", (d, d / 64), &spec, 1, &s)?;
        let x = Tensor::from_host(&alloc, &s, &vec![0.5f32; b * t * d], &[b, t, d])?;
        let dy = Tensor::from_host(&alloc, &s, &vec![1.0f32; b * t * d], &[b, t, d])?;
        let (start, end) = (dev.timing_event()?, dev.timing_event()?);
        let (mut gpu, mut host) = (Vec::new(), Vec::new());
        for rep in 0..args.reps + 3 {
            s.record(&start)?;
            let issued = Instant::now();
            let (_, ctx) = layer.forward(&Inputs::one(&x), &KeepOnDevice, &s)?;
            layer.backward(ctx, &[&dy], &s)?;
            let h = issued.elapsed().as_secs_f64() * 1e3;
            s.record(&end)?;
            end.synchronize()?;
            if rep >= 3 {
                gpu.push(f64::from(start.elapsed_ms(&end)?));
                host.push(h);
            }
        }
        let row =
            LayerRow { config: name.into(), dim: d, batch: b, seq: t, gpu_ms: median(gpu), host_ms: median(host) };
        println!(
            "{name}: d={d} batch={b} seq={t}: {:.3} ms per forward+backward (GPU), {:.3} ms host",
            row.gpu_ms, row.host_ms
        );
        rows.push(row);
    }
    write_json(&args.json, &Report::new("layer", &dev, args.reps, rows))
}
