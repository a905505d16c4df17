//! `graphed demo`: a stack of elementwise layers stepped eagerly, then graphed (for inference) and
//! replayed on a side stream whose caller resumes at the event recorded inside each graph; the two
//! runs are compared bitwise and their host time per step is reported.

use graphed::device::DType;
use std::time::{Duration, Instant};

use anyhow::ensure;
use graphed::device::{Device, DeviceKind, PinnedBuffer, Stream};
use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{Inputs, KeepOnDevice, Module, Param, SaveHook, Stack};
use graphed::ops::elementwise;
use graphed::tensor::Tensor;

use super::args::DemoArgs;

/// A layer of the demo: `y = k·x + x/2 + b`, three kernels.
struct Affine {
    alloc: CachingAllocator,
    k: f32,
    b: f32,
}

impl Module for Affine {
    type Ctx = ();

    fn forward(&self, inputs: &Inputs, _hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, ())> {
        let x = inputs.only("Affine::forward")?;
        let y = Tensor::uninit(&self.alloc, s, x.shape(), x.dtype())?;
        elementwise::scale(y.view::<f32>()?, x.view()?, self.k, s)?;
        elementwise::axpy(y.view::<f32>()?, x.view()?, 0.5, s)?;
        elementwise::add_scalar(y.view::<f32>()?, self.b, s)?;
        Ok((vec![y], ()))
    }

    fn backward(&self, (): (), dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        let dy =
            dys.first().ok_or(graphed::Error::MissingGradient { op: "Affine::backward", what: "output 0".into() })?;
        let dx = Tensor::uninit(&self.alloc, s, dy.shape(), dy.dtype())?;
        elementwise::scale(dx.view::<f32>()?, dy.view()?, self.k + 0.5, s)?;
        Ok(vec![Some(dx)])
    }

    fn parameters(&self) -> Vec<&Param> {
        Vec::new()
    }

    fn set_training(&mut self, _training: bool) {}
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
    let alloc = CachingAllocator::new(dev);
    let stack = Stack::new(
        (0..layers)
            .map(|l| Affine { alloc: alloc.clone(), k: 0.5 + 0.25 * (l % 3) as f32, b: -1.0 / (l + 2) as f32 })
            .collect(),
    );
    let x = Tensor::zeros(&alloc, &main, &[width], DType::F32)?;
    let host_in = dev.alloc_pinned::<f32>(width)?;

    // Eager: every kernel launched from the host each step.
    let mut eager = Vec::with_capacity(steps as usize);
    let mut eager_host = Duration::ZERO;
    for step in 0..steps {
        step_input(&host_in, step)?;
        let t = Instant::now();
        main.copy_h2d(host_in.view(), x.view()?)?;
        let (y, _) = stack.forward(&Inputs::one(&x), &KeepOnDevice, &main)?;
        eager_host += t.elapsed();
        eager.push(y[0].to_f32_vec(&main)?);
    }

    // Graphed: the stack captured for inference, each layer's graph recording an event that the
    // caller resumes at, replayed on the side stream.
    let t = Instant::now();
    let done = dev.event()?;
    let graphed = make_graphed_stack(&alloc, &stack, &x, GraphOptions::default().inference().sync_event(&done))?;
    let capture_time = t.elapsed();
    let counts = graphed.layers()[0].report()?.graphs[0].nodes.clone();

    let mut graphed_host = Duration::ZERO;
    let mut mismatches = 0;
    for (step, expected) in (0..steps).zip(&eager) {
        step_input(&host_in, step)?;
        let t = Instant::now();
        main.copy_h2d(host_in.view(), graphed.static_input()?.view()?)?;
        let y = graphed.forward(&main, graphed.static_input()?, Replay::side(&side))?;
        graphed_host += t.elapsed();
        if y.get()?.to_vec::<f32>(&main)? != *expected {
            mismatches += 1;
        }
    }
    graphed.join(&main)?;
    dev.synchronize()?;

    let per_step = |d: Duration| d.as_secs_f64() * 1e6 / steps as f64;
    println!(
        "captured {layers} graphs, each {counts:?} (warmup, capture, instantiate and upload {:.2} ms)",
        capture_time.as_secs_f64() * 1e3
    );
    println!(
        "host time per step: eager {:.1} µs, graphed {:.1} µs ({})",
        per_step(eager_host),
        per_step(graphed_host),
        host_ratio(eager_host, graphed_host)
    );
    println!(
        "outputs: graphed replay on a side stream vs eager, bitwise: {}",
        if mismatches == 0 { "equal at every step".to_string() } else { format!("{mismatches} steps differ") }
    );
    ensure!(mismatches == 0, "graphed and eager outputs differ in {mismatches} of {steps} steps");
    Ok(())
}

/// How the graphed replay's host time compares with eager's, in words that stay true either way
/// (on the simulator the replay's bookkeeping can cost more than the eager launches it saves).
fn host_ratio(eager: Duration, graphed: Duration) -> String {
    let (e, g) = (eager.as_secs_f64(), graphed.as_secs_f64());
    match e / g.max(1e-12) {
        r if r >= 1.05 => format!("{r:.1}x less"),
        r if r > 1.0 / 1.05 => "about the same".into(),
        _ => format!("{:.1}x more", g / e.max(1e-12)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_time_ratio_says_which_way_it_goes() {
        let us = Duration::from_micros;
        assert_eq!(host_ratio(us(300), us(100)), "3.0x less");
        assert_eq!(host_ratio(us(100), us(100)), "about the same");
        assert_eq!(host_ratio(us(100), us(250)), "2.5x more");
    }
}
