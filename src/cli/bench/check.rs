//! `graphed bench check`: what the stream-safety checker costs on CUDA (host µs per launch with
//! it off and on), and a planted race run many times, without and with its fix, counting the
//! runs whose result is corrupted, with the checker's report of the race.

use std::time::Instant;

use graphed::check::Checker;
use graphed::device::{CaptureMode, Device, DeviceKind};
use graphed::ops::elementwise;
use serde::Serialize;

use super::{median, write_json, Report};
use crate::cli::args::CheckBenchArgs;

#[derive(Serialize, Debug)]
struct CheckRow {
    checked: bool,
    eager_host_us: f64,
    graph_launch_host_us: f64,
}

#[derive(Serialize, Debug)]
struct RaceRow {
    fixed: bool,
    trials: u32,
    corrupted: u32,
    report: Option<String>,
}

#[derive(Serialize, Debug)]
#[serde(untagged)]
enum Row {
    Overhead(CheckRow),
    Race(RaceRow),
}

pub fn run(args: &CheckBenchArgs) -> anyhow::Result<()> {
    let dev = super::super::open_device(&args.device)?;
    let mut rows = Vec::new();
    if dev.kind() == DeviceKind::Cuda {
        for checked in [false, true] {
            let d = if checked { Device::cuda_checked(0)? } else { Device::cuda(0)? };
            let (eager, graph) = overhead(&d, args.n, args.reps)?;
            println!(
                "checker {}: {eager:.3} µs host per eager launch, {graph:.3} µs per graph launch of {} kernels",
                if checked { "on " } else { "off" },
                args.n
            );
            rows.push(Row::Overhead(CheckRow { checked, eager_host_us: eager, graph_launch_host_us: graph }));
        }
    }
    let race_dev = if dev.kind() == DeviceKind::Cuda { Device::cuda_checked(0)? } else { dev.clone() };
    for fixed in [false, true] {
        let (corrupted, report) = race(&race_dev, fixed, args.trials)?;
        println!(
            "planted race {}: {corrupted}/{} runs corrupted",
            if fixed { "with its fix" } else { "without fix " },
            args.trials
        );
        if let Some(r) = &report {
            println!("  checker: {r}");
        }
        rows.push(Row::Race(RaceRow { fixed, trials: args.trials, corrupted, report }));
    }
    write_json(&args.json, &Report::new("check", &dev, args.reps, rows))
}

/// Host µs per eager launch and per launch of a graph of `n` kernels.
fn overhead(dev: &Device, n: usize, reps: u32) -> anyhow::Result<(f64, f64)> {
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[0.0f32])?;
    let mut eager = Vec::new();
    for _ in 0..=reps {
        let t = Instant::now();
        for _ in 0..n {
            elementwise::add_scalar(x.view(), 1.0, &s)?;
        }
        eager.push(t.elapsed().as_secs_f64() * 1e6 / n as f64);
        dev.synchronize()?;
    }
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    for _ in 0..n {
        elementwise::add_scalar(x.view(), 1.0, &s)?;
    }
    let exec = cap.finish()?.instantiate()?;
    exec.upload(&s)?;
    let mut graph = Vec::new();
    for _ in 0..=reps {
        let t = Instant::now();
        exec.launch(&s)?;
        graph.push(t.elapsed().as_secs_f64() * 1e6);
        dev.synchronize()?;
    }
    Ok((median(eager), median(graph)))
}

/// A producer stream accumulates into `x` with many kernels; a consumer stream copies `x`
/// without waiting (or, fixed, after waiting on an event recorded after the producer).
fn race(dev: &Device, fixed: bool, trials: u32) -> anyhow::Result<(u32, Option<String>)> {
    // On the GPU each producer kernel must take longer than the host takes to issue the next,
    // or the producer is done before the consumer starts and the race never shows.
    let n: usize = if dev.kind() == DeviceKind::Cuda { 1 << 26 } else { 1 << 12 };
    const STEPS: usize = 64;
    let (producer, consumer) = (dev.stream()?, dev.stream()?);
    let (x, y) = (dev.alloc::<f32>(n)?, dev.alloc::<f32>(n)?);
    let done = dev.event()?;
    let checker = Checker::of(dev);
    let mut corrupted = 0;
    let mut report = None;
    for trial in 0..trials {
        let base = (trial * 1000) as f32;
        elementwise::fill(x.view(), base, &producer)?;
        for _ in 0..STEPS {
            elementwise::add_scalar(x.view(), 1.0, &producer)?;
        }
        producer.record(&done)?;
        if fixed {
            consumer.wait(&done)?;
        }
        elementwise::scale(y.view(), x.view(), 1.0, &consumer)?;
        dev.synchronize()?;
        if y.to_vec(&consumer)?.iter().any(|v| *v != base + STEPS as f32) {
            corrupted += 1;
        }
        if let Some(c) = &checker {
            let hazards = c.take_hazards();
            if report.is_none() {
                report = hazards.first().map(|h| h.to_string());
            }
        }
    }
    Ok((corrupted, report))
}
