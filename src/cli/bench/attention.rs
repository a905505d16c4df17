//! `graphed bench attention`: the fused causal attention alone (`ops::attention`) at one shape,
//! forward and backward timed with CUDA events, in ms and TFLOP/s. FLOPs follow FlashAttention's
//! convention, which `bench/torch_reference.py attention` uses too: the forward's two products,
//! 4·b·h·s²·d, halved for the causal mask; the backward 2.5 times that.

use graphed::device::{DType, DeviceKind};
use graphed::memory::CachingAllocator;
use graphed::ops::attention::{self, AttentionBackend, AttentionRun, ForwardSaved};
use graphed::tensor::Tensor;
use serde::Serialize;

use super::{median, write_json, Report};
use crate::cli::args::AttentionBenchArgs;

#[derive(Serialize, Debug)]
struct AttentionRow {
    batch: usize,
    heads: usize,
    seq: usize,
    head_dim: usize,
    dtype: String,
    /// What ran the forward and the backward: `cudnn` or `kernels`.
    forward_backend: String,
    backward_backend: String,
    forward_ms: f64,
    forward_tflops: f64,
    backward_ms: f64,
    backward_tflops: f64,
    /// The limit on cuDNN's backward scratch the run had, MiB.
    scratch_limit_mib: u64,
}

pub fn run(args: &AttentionBenchArgs) -> anyhow::Result<()> {
    let dev = super::super::open_device(&args.device)?;
    anyhow::ensure!(dev.kind() == DeviceKind::Cuda, "bench attention times GPU kernels; run it on a CUDA device");
    let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
    let dtype = args.dtype.resolve(&dev)?;
    let heads = [args.batch, args.heads, args.seq, args.head_dim];
    let rows = [args.batch, args.heads, args.seq];
    let n: usize = heads.iter().product();
    // Scores of a few units, so that the softmax is neither flat nor one-hot.
    let fill =
        |k: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7919 + k * 104_729) % 2001) as f32 / 1000.0 - 1.0).collect() };
    let input = |k| Tensor::from_f32(&alloc, &s, &fill(k), &heads, dtype);
    let (q, k, v, dout) = (input(0)?, input(1)?, input(2)?, input(3)?);
    let head = || Tensor::uninit(&alloc, &s, &heads, dtype);
    let (out, dq, dk, dv) = (head()?, head()?, head()?, head()?);
    let (lse, delta) = (Tensor::uninit(&alloc, &s, &rows, DType::F32)?, Tensor::uninit(&alloc, &s, &rows, DType::F32)?);
    let run = AttentionRun {
        scratch_limit: args.scratch_limit_mib.map(|mib| (mib as usize) << 20),
        ..AttentionRun::new(args.backend.backend(), &alloc)
    };
    let scratch_limit_mib = (run.scratch_limit_for(args.batch * args.heads, args.seq, args.head_dim) >> 20) as u64;
    let forward = || attention::attention_forward(&out, &lse, (&q, &k, &v), None, run, &s);
    let saved = ForwardSaved { q: &q, k: &k, v: &v, out: &out, lse: &lse };
    let backward = || attention::attention_backward((&dq, &dk, &dv), &dout, saved, &delta, None, run, &s);
    let (start, end) = (dev.timing_event()?, dev.timing_event()?);
    let time = |f: &dyn Fn() -> graphed::Result<AttentionBackend>| -> anyhow::Result<(f64, AttentionBackend)> {
        let mut ran = f()?;
        for _ in 0..4 {
            ran = f()?;
        }
        let mut times = Vec::new();
        for _ in 0..args.reps {
            s.record(&start)?;
            f()?;
            s.record(&end)?;
            end.synchronize()?;
            times.push(f64::from(start.elapsed_ms(&end)?));
        }
        Ok((median(times), ran))
    };
    let ((forward_ms, forward_backend), (backward_ms, backward_backend)) = (time(&forward)?, time(&backward)?);
    let flops = 4.0 * (args.batch * args.heads * args.head_dim) as f64 * (args.seq as f64).powi(2) / 2.0;
    let row = AttentionRow {
        batch: args.batch,
        heads: args.heads,
        seq: args.seq,
        head_dim: args.head_dim,
        dtype: dtype.to_string(),
        forward_backend: forward_backend.to_string(),
        backward_backend: backward_backend.to_string(),
        forward_ms,
        forward_tflops: flops / (forward_ms * 1e-3) / 1e12,
        backward_ms,
        backward_tflops: 2.5 * flops / (backward_ms * 1e-3) / 1e12,
        scratch_limit_mib,
    };
    println!(
        "graphed fused attention {dtype} b={} h={} s={} d={}: forward {:.3} ms ({:.0} TFLOP/s), backward {:.3} ms ({:.0} TFLOP/s)",
        row.batch, row.heads, row.seq, row.head_dim, row.forward_ms, row.forward_tflops, row.backward_ms, row.backward_tflops
    );
    println!(
        "attention backend: forward on {forward_backend}, backward on {backward_backend} (cuDNN's backward scratch at most {scratch_limit_mib} MiB)"
    );
    write_json(&args.json, &Report::new("attention", &dev, args.reps, vec![row]))
}
