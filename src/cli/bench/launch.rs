//! `graphed bench launch`: host and GPU cost of launching N tiny kernels eagerly against one
//! graph of N, on our launch path and (on CUDA) on raw cudarc in the same run.

use std::time::Instant;

use graphed::device::{CaptureMode, DeviceKind};
use graphed::ops::elementwise;
use serde::Serialize;

use super::{median, write_json, Report};
use crate::cli::args::LaunchBenchArgs;

/// One row of results: per kernel unless named per launch.
#[derive(Serialize, Debug)]
struct LaunchRow {
    n: usize,
    eager_host_us: f64,
    eager_gpu_us: Option<f64>,
    graph_launch_host_us: f64,
    graph_gpu_us: Option<f64>,
    raw_eager_host_us: Option<f64>,
    raw_eager_gpu_us: Option<f64>,
    raw_graph_launch_host_us: Option<f64>,
    raw_graph_gpu_us: Option<f64>,
}

pub fn run(args: &LaunchBenchArgs) -> anyhow::Result<()> {
    let dev = super::super::open_device(&args.device)?;
    let on_gpu = dev.kind() == DeviceKind::Cuda;
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[0.0f32])?;
    let (start, end) = (dev.timing_event()?, dev.timing_event()?);
    let mut rows = Vec::new();
    for &n in &args.n {
        // Warm up: compile and load the kernel, fault in the stream.
        elementwise::add_scalar(x.view(), 1.0, &s)?;
        s.synchronize()?;

        let mut host = Vec::new();
        let mut gpu = Vec::new();
        for _ in 0..args.reps {
            s.record(&start)?;
            let t = Instant::now();
            for _ in 0..n {
                elementwise::add_scalar(x.view(), 1.0, &s)?;
            }
            host.push(t.elapsed().as_secs_f64() * 1e6 / n as f64);
            s.record(&end)?;
            dev.synchronize()?;
            if on_gpu {
                gpu.push(start.elapsed_ms(&end)? as f64 * 1e3 / n as f64);
            }
        }

        let cap = s.capture(CaptureMode::ThreadLocal)?;
        for _ in 0..n {
            elementwise::add_scalar(x.view(), 1.0, &s)?;
        }
        let exec = cap.finish()?.instantiate()?;
        exec.upload(&s)?;
        exec.launch(&s)?;
        s.synchronize()?;
        let mut graph_host = Vec::new();
        let mut graph_gpu = Vec::new();
        for _ in 0..args.reps {
            s.record(&start)?;
            let t = Instant::now();
            exec.launch(&s)?;
            graph_host.push(t.elapsed().as_secs_f64() * 1e6);
            s.record(&end)?;
            dev.synchronize()?;
            if on_gpu {
                graph_gpu.push(start.elapsed_ms(&end)? as f64 * 1e3 / n as f64);
            }
        }
        let raw = if on_gpu {
            Some(graphed::device::baseline::raw_launch_baseline(0, &elementwise::ADD_SCALAR, n, args.reps as usize)?)
        } else {
            None
        };
        rows.push(LaunchRow {
            n,
            eager_host_us: median(host),
            eager_gpu_us: on_gpu.then(|| median(gpu)),
            graph_launch_host_us: median(graph_host),
            graph_gpu_us: on_gpu.then(|| median(graph_gpu)),
            raw_eager_host_us: raw.as_ref().map(|r| r.eager_host_us),
            raw_eager_gpu_us: raw.as_ref().map(|r| r.eager_gpu_us),
            raw_graph_launch_host_us: raw.as_ref().map(|r| r.graph_launch_host_us),
            raw_graph_gpu_us: raw.as_ref().map(|r| r.graph_gpu_us),
        });
    }
    print_table(&rows);
    write_json(&args.json, &Report::new("launch", &dev, args.reps, rows))
}

fn print_table(rows: &[LaunchRow]) {
    let f = |v: Option<f64>| v.map(|v| format!("{v:8.3}")).unwrap_or_else(|| "       -".into());
    println!(
        "{:>6} | {:>8} {:>8} {:>8} | {:>8} {:>8} {:>8} | {:>8}",
        "n", "eager", "raw", "gpu/k", "g.launch", "raw", "gpu/k", "speedup"
    );
    println!("{:>6} | {:>26} | {:>26} |", "", "host µs per kernel", "host µs per graph launch");
    for r in rows {
        let speedup = r.eager_host_us * r.n as f64 / r.graph_launch_host_us;
        println!(
            "{:>6} | {:8.3} {} {} | {:8.3} {} {} | {:7.1}x",
            r.n,
            r.eager_host_us,
            f(r.raw_eager_host_us),
            f(r.eager_gpu_us),
            r.graph_launch_host_us,
            f(r.raw_graph_launch_host_us),
            f(r.graph_gpu_us),
            speedup
        );
    }
}
