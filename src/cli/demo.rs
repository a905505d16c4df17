//! `graphed demo`: a stack of elementwise layers stepped eagerly, then captured once and replayed
//! on a side stream whose caller resumes at an event recorded inside the graph; the two runs are
//! compared bitwise and their host time per step is reported.

use std::time::{Duration, Instant};

use anyhow::ensure;
use graphed::device::{CaptureMode, Device, DeviceBuffer, DeviceKind, PinnedBuffer, Stream};
use graphed::ops::elementwise;

use super::args::DemoArgs;

/// A layer of the demo: `y = k·x; y += x/2; y += b`.
struct Layer {
    k: f32,
    b: f32,
    out: DeviceBuffer<f32>,
}

struct Stack {
    input: DeviceBuffer<f32>,
    layers: Vec<Layer>,
}

impl Stack {
    fn new(dev: &Device, layers: usize, width: usize) -> graphed::Result<Stack> {
        let layers = (0..layers)
            .map(|l| Ok(Layer { k: 0.5 + 0.25 * (l % 3) as f32, b: -1.0 / (l + 2) as f32, out: dev.alloc(width)? }))
            .collect::<graphed::Result<_>>()?;
        Ok(Stack { input: dev.alloc(width)?, layers })
    }

    fn forward(&self, s: &Stream) -> graphed::Result<()> {
        let mut x = &self.input;
        for layer in &self.layers {
            elementwise::scale(layer.out.view(), x.view(), layer.k, s)?;
            elementwise::axpy(layer.out.view(), x.view(), 0.5, s)?;
            elementwise::add_scalar(layer.out.view(), layer.b, s)?;
            x = &layer.out;
        }
        Ok(())
    }

    fn output(&self) -> &DeviceBuffer<f32> {
        &self.layers.last().expect("at least one layer").out
    }
}

fn step_input(host: &PinnedBuffer<f32>, step: u32) -> graphed::Result<()> {
    let width = host.len();
    host.write(
        &(0..width).map(|i| ((i as u32 ^ step.wrapping_mul(2654435761)) % 1000) as f32 / 1000.0).collect::<Vec<_>>(),
    )
}

pub fn run(dev: &Device, args: &DemoArgs) -> anyhow::Result<()> {
    let on_gpu = dev.kind() == DeviceKind::Cuda;
    let layers = args.layers.unwrap_or(if on_gpu { 8 } else { 4 }) as usize;
    let width = args.width.unwrap_or(if on_gpu { 1 << 20 } else { 4096 }) as usize;
    let steps = args.steps.unwrap_or(if on_gpu { 50 } else { 5 });
    println!("device: {}", dev.name());
    println!("demo stack: {layers} layers x 3 kernels, {width} f32 per activation, {steps} steps");

    let main = dev.stream()?;
    let side = dev.stream()?;
    let stack = Stack::new(dev, layers, width)?;
    let host_in = dev.alloc_pinned::<f32>(width)?;

    // Eager: every kernel launched from the host each step.
    let mut eager = Vec::with_capacity(steps as usize);
    let mut eager_host = Duration::ZERO;
    for step in 0..steps {
        step_input(&host_in, step)?;
        let t = Instant::now();
        main.copy_h2d(host_in.view(), &stack.input)?;
        stack.forward(&main)?;
        eager_host += t.elapsed();
        eager.push(stack.output().to_vec(&main)?);
    }

    // Graphed: capture the stack once on the side stream, with an external event at its end.
    let t = Instant::now();
    let done = dev.event()?;
    let entry = dev.event()?;
    let cap = side.capture(CaptureMode::ThreadLocal)?;
    stack.forward(&side)?;
    side.record_external(&done)?;
    let graph = cap.finish()?;
    let exec = graph.instantiate()?;
    exec.upload(&side)?;
    let capture_time = t.elapsed();
    let counts = graph.node_counts()?;
    ensure!(graph.external_record_events()? == vec![done.id()], "the graph records the completion event");

    let mut graphed_host = Duration::ZERO;
    let mut mismatches = 0;
    for (step, expected) in (0..steps).zip(&eager) {
        step_input(&host_in, step)?;
        let t = Instant::now();
        main.copy_h2d(host_in.view(), &stack.input)?;
        main.record(&entry)?;
        side.wait(&entry)?;
        exec.launch(&side)?;
        main.wait(&done)?;
        graphed_host += t.elapsed();
        if stack.output().to_vec(&main)? != *expected {
            mismatches += 1;
        }
    }
    dev.synchronize()?;

    let per_step = |d: Duration| d.as_secs_f64() * 1e6 / steps as f64;
    println!("captured graph: {counts:?} (capture + instantiate + upload {:.2} ms)", capture_time.as_secs_f64() * 1e3);
    println!(
        "host time per step: eager {:.1} µs, graphed {:.1} µs ({:.1}x less)",
        per_step(eager_host),
        per_step(graphed_host),
        eager_host.as_secs_f64() / graphed_host.as_secs_f64().max(1e-12)
    );
    println!(
        "outputs: graphed replay on a side stream vs eager, bitwise: {}",
        if mismatches == 0 { "equal at every step".to_string() } else { format!("{mismatches} steps differ") }
    );
    ensure!(mismatches == 0, "graphed and eager outputs differ in {mismatches} of {steps} steps");
    Ok(())
}
