//! `graphed bench graphs`: a training step of `BENCH.md`'s model (every layer's forward, then
//! every backward in reverse from a fixed upstream gradient; no optimizer) run five ways:
//! eagerly, as one graphed callable per layer replayed on the caller's stream or on a side
//! stream, on a side stream with the default activation offloading inside the graphs, and as
//! one graph of the whole step (the floor: our kernels with no host gaps). Each variant gets a
//! fresh allocator and model, so that its memory is its own. In bf16 on CUDA unless `--dtype`
//! says otherwise.

use std::time::Instant;

use graphed::device::{CaptureMode, Device, DeviceKind, Event, Stream};
use graphed::graph::{make_graphed_callables, Callable, GraphOptions, GraphedStack, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::Inputs;
use graphed::offload::{OffloadConfig, OffloadManager};
use serde::Serialize;

use super::{spread, write_json, Case, MemoryRow, Report, Spread};
use crate::cli::args::{BenchInput, GraphsArgs, GraphsBenchArgs, GraphsVariant as Variant};
use crate::cli::bench_model::{BenchModel, Config};

/// One (configuration, variant): times per step, memory and capture cost.
#[derive(Serialize, Debug)]
struct GraphsRow {
    #[serde(flatten)]
    case: Case,
    /// Issue and `synchronize` of the main stream.
    wall_ms: Spread,
    /// Issue only: from the first call of the step to the last.
    host_us: Spread,
    /// Between timing events on the main stream; none on the simulator, which has no clock.
    gpu_ms: Option<Spread>,
    /// Median host time per graphed call or graph launch; none for eager.
    host_us_per_call: Option<f64>,
    /// Device memory the allocator holds after the timed steps, with the variant's graphs still
    /// alive (cache and graph pool together): the variant's steady footprint. The areas' peaks
    /// are not added up, as they do not coincide (the warmup's cache is emptied before capture).
    reserved_bytes: usize,
    /// The allocator's statistics after the timed steps, graphs alive, peaks included.
    memory: MemoryRow,
    /// Wall time of `make_graphed_callables` (its warmup iterations included) or of the floor's
    /// capture, instantiation and upload; none for eager.
    capture_ms: Option<f64>,
    /// Of the graphed variants' `capture_ms`: the warmup's, the recording's and the
    /// instantiation's share (issue 35's goal: the whole L step captured and instantiated in
    /// 200 ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    capture_phases_ms: Option<CapturePhases>,
    /// What ran the layers' fused attention (`--attention-backend`), if they have one.
    #[serde(skip_serializing_if = "Option::is_none")]
    attention_backends: Option<super::layer::Backends>,
    /// The step's input x (`--input`).
    input: BenchInput,
}

/// [`graphed::graph::CaptureTimes`] in milliseconds.
#[derive(Serialize, Debug, Clone, Copy)]
struct CapturePhases {
    warmup: f64,
    record: f64,
    instantiate: f64,
}

impl CapturePhases {
    fn of(t: graphed::graph::CaptureTimes) -> CapturePhases {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        CapturePhases { warmup: ms(t.warmup), record: ms(t.record), instantiate: ms(t.instantiate) }
    }
}

/// Per-step samples of one variant.
#[derive(Default)]
pub(super) struct Samples {
    pub(super) wall_ms: Vec<f64>,
    pub(super) host_us: Vec<f64>,
    pub(super) gpu_ms: Vec<f64>,
}

/// Runs every requested configuration through each variant asked for (every one by default).
pub fn run(GraphsArgs { bench: args, variants }: &GraphsArgs) -> anyhow::Result<()> {
    let dev = super::open_timing_device(&args.device, "graphs", "--configs tiny")?;
    let configs = args.configs(&dev)?;
    let dtype = args.dtype.storage(&dev);
    println!("{dtype} weights and activations; f32 statistics and GEMM accumulation");
    if let Some(recipe) = args.dtype.fp8_recipe()? {
        println!("the Linear layers' GEMMs in FP8: E4M3 forward, {recipe}");
    }
    let mut rows = Vec::new();
    for &config in &configs {
        println!("{config}");
        let first = rows.len();
        for &variant in Variant::asked(variants) {
            let row = run_variant(&dev, config, variant, args)?;
            print_row(&row);
            rows.push(row);
        }
        if let Some(ran) = rows[first..].iter().find_map(|r| r.attention_backends.as_ref()) {
            println!("  fused attention ran on: forward {}, backward {}", ran.forward, ran.backward);
        }
        print_ratios(&rows[first..]);
    }
    println!("{}", crate::cli::checker_summary(&dev));
    write_json(&args.json, &Report::new("graphs", &dev, args.steps, rows))
}

fn run_variant(dev: &Device, config: Config, variant: Variant, args: &GraphsBenchArgs) -> anyhow::Result<GraphsRow> {
    // Only the graphed stack lends its layers' gradients.
    let stack = matches!(variant, Variant::Graphed | Variant::Side | Variant::Offload);
    let config = config.with_lending(config.lend_gradients && stack);
    let alloc = CachingAllocator::new(dev);
    let main = dev.stream()?;
    let mut model = match args.dtype.fp8_recipe()? {
        Some(recipe) => BenchModel::with_fp8(&alloc, &main, config, recipe)?,
        None => BenchModel::new(&alloc, &main, config, args.dtype.storage(dev))?,
    };
    model.feed(&alloc, &main, args.input)?;
    // Each arm reads the allocator's statistics while its graphs are alive, so that the bytes
    // held are the step's footprint with its graph pool, as PyTorch's side measures its own.
    let held = || -> anyhow::Result<graphed::memory::MemoryStats> {
        alloc.synchronize()?;
        Ok(alloc.stats())
    };
    let (samples, capture_ms, calls, phases, stats) = match variant {
        Variant::Eager => {
            let samples = measure(dev, &main, (args.warmup, args.steps), &mut || Ok(model.eager_step(&main)?))?;
            (samples, None, None, None, held()?)
        }
        Variant::Graphed | Variant::Side | Variant::Offload => {
            let (side, event) = (dev.stream()?, dev.event()?);
            let offload = match variant {
                Variant::Offload => Some(OffloadManager::new(&alloc, OffloadConfig::default())?),
                _ => None,
            };
            let on_side = (variant != Variant::Graphed).then_some((&side, &event));
            let timed =
                time_graphed(dev, (&alloc, &main), &model, on_side, offload.as_ref(), (args.warmup, args.steps))?;
            let phases = CapturePhases::of(timed.graphed.capture_times());
            (timed.samples, Some(timed.capture_ms), Some(2 * config.layers), Some(phases), held()?)
        }
        Variant::Whole => {
            let began = Instant::now();
            let whole: [&dyn Callable; 1] = [&model.stack];
            let g = make_graphed_callables(&alloc, &whole, &[Inputs::one(&model.x)], GraphOptions::default())?;
            let g = g.into_iter().next().ok_or_else(|| anyhow::anyhow!("one callable graphed, none returned"))?;
            let capture_ms = began.elapsed().as_secs_f64() * 1e3;
            g.static_grad_outputs()?[0].copy_from(&model.dy, &main)?;
            let (x, dy) = (g.static_inputs()?[0].clone(), g.static_grad_outputs()?[0].clone());
            let step = &mut || -> anyhow::Result<()> {
                let (_, forward) = g.forward(&main, &Inputs::one(&x), Replay::caller())?;
                let (_, backward) = g.backward(&main, &[&dy])?;
                forward.join(&main)?;
                backward.join(&main)?;
                Ok(model.end_step_graphed(&main)?)
            };
            let samples = measure(dev, &main, (args.warmup, args.steps), step)?;
            (samples, Some(capture_ms), Some(2), Some(CapturePhases::of(g.capture_times())), held()?)
        }
        Variant::Floor => {
            // Warm up as make_graphed_callables does: the capture then sees a warm allocator
            // cache and loaded kernels.
            for _ in 0..2 {
                model.eager_step(&main)?;
            }
            let pool = alloc.new_pool();
            let began = Instant::now();
            let capture = alloc.capture(&main, CaptureMode::ThreadLocal, &pool)?;
            model.eager_step(&main)?;
            let graph = capture.finish()?;
            let exec = graph.instantiate()?;
            exec.upload(&main)?;
            main.synchronize()?;
            let capture_ms = began.elapsed().as_secs_f64() * 1e3;
            let samples = measure(dev, &main, (args.warmup, args.steps), &mut || Ok(exec.launch(&main)?))?;
            (samples, Some(capture_ms), Some(1), None, held()?)
        }
    };
    let host_us = spread(samples.host_us);
    Ok(GraphsRow {
        case: Case::new(config, args.dtype.label(dev), variant.name()),
        wall_ms: spread(samples.wall_ms),
        host_us,
        gpu_ms: (!samples.gpu_ms.is_empty()).then(|| spread(samples.gpu_ms)),
        host_us_per_call: calls.map(|n| host_us.median / n as f64),
        reserved_bytes: stats.total.reserved,
        memory: MemoryRow::of(&stats),
        capture_ms,
        capture_phases_ms: phases,
        attention_backends: super::layer::Backends::of_layers(model.stack.layers().iter().map(|l| &l.attn)),
        input: args.input,
    })
}

/// The benchmark model graphed one callable per layer, and timed.
pub(super) struct TimedGraphed {
    pub(super) graphed: GraphedStack,
    /// Wall time of `make_graphed_callables`, its warmup iterations included.
    pub(super) capture_ms: f64,
    pub(super) samples: Samples,
}

/// Graphs `model` (each graph recording the event of `side` and replayed there when given,
/// offloading through `manager`) and times `warmup` then `steps` steps of it. The static input
/// holds the sample, x, since capture; the upstream gradient goes into its static buffer once,
/// so that steps replay with no copy-in.
pub(super) fn time_graphed(
    dev: &Device,
    (alloc, main): (&CachingAllocator, &Stream),
    model: &BenchModel,
    side: Option<(&Stream, &Event)>,
    manager: Option<&OffloadManager>,
    (warmup, steps): (u32, u32),
) -> anyhow::Result<TimedGraphed> {
    let began = Instant::now();
    let graphed = model.graph(alloc, side.map(|(_, event)| event), manager)?;
    let capture_ms = began.elapsed().as_secs_f64() * 1e3;
    if let Some(static_dy) = graphed.static_grad_output()? {
        static_dy.copy_from(&model.dy, main)?;
    }
    let replay = side.map_or(Replay::caller(), |(s, _)| Replay::side(s));
    let samples = measure(dev, main, (warmup, steps), &mut || graphed_step(&graphed, model, main, replay))?;
    Ok(TimedGraphed { graphed, capture_ms, samples })
}

/// One step of the graphed stack: every forward, every backward, the tails joined into `main`.
/// The input and upstream gradient are the static buffers themselves (holding the model's `x`
/// and `dy`), so the host time is the replays' alone, without copy-ins, as the host-time goals
/// are stated.
pub(super) fn graphed_step(
    graphed: &GraphedStack,
    model: &BenchModel,
    main: &Stream,
    replay: Replay<'_>,
) -> anyhow::Result<()> {
    graphed.forward(main, graphed.static_input()?, replay)?;
    graphed.backward(main, graphed.static_grad_output()?.unwrap_or(&model.dy))?;
    graphed.join(main)?;
    // Where the optimizer would read the gradients (lent ones are checked whole here).
    graphed.take_gradients()?;
    Ok(model.end_step_graphed(main)?)
}

/// Runs `step` `warmup` times untimed, then `steps` times timed.
pub(super) fn measure(
    dev: &Device,
    main: &Stream,
    (warmup, steps): (u32, u32),
    step: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Samples> {
    let on_gpu = dev.kind() == DeviceKind::Cuda;
    let (start, end) = (dev.timing_event()?, dev.timing_event()?);
    let mut samples = Samples::default();
    for i in 0..warmup + steps {
        main.record(&start)?;
        let issued = Instant::now();
        step()?;
        let host = issued.elapsed();
        main.record(&end)?;
        main.synchronize()?;
        let wall = issued.elapsed();
        if i >= warmup {
            samples.wall_ms.push(wall.as_secs_f64() * 1e3);
            samples.host_us.push(host.as_secs_f64() * 1e6);
            if on_gpu {
                samples.gpu_ms.push(f64::from(start.elapsed_ms(&end)?));
            }
        }
    }
    Ok(samples)
}

fn print_row(r: &GraphsRow) {
    let range = |s: &Spread, unit: &str| format!("{:.3} {unit} [{:.3}–{:.3}]", s.median, s.min, s.max);
    let gpu = r.gpu_ms.as_ref().map_or_else(|| "-".to_string(), |s| range(s, "ms"));
    let per_call = r.host_us_per_call.map_or_else(|| "-".to_string(), |v| format!("{v:.2} µs"));
    let phases = r.capture_phases_ms.map_or_else(String::new, |p| {
        format!(" (warmup {:.1}, record {:.1}, instantiate {:.1})", p.warmup, p.record, p.instantiate)
    });
    let capture = r.capture_ms.map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms{phases}"));
    println!(
        "  {:<14} wall {}  host {}  gpu {}  host/call {}  reserved {:.1} MiB (peak {:.1})  capture {}",
        r.case.variant,
        range(&r.wall_ms, "ms"),
        range(&r.host_us, "µs"),
        gpu,
        per_call,
        r.reserved_bytes as f64 / (1 << 20) as f64,
        r.memory.total.peak_reserved_bytes as f64 / (1 << 20) as f64,
        capture
    );
}

/// Wall-time ratios of one configuration's rows: graphed against eager and against the floor.
fn print_ratios(rows: &[GraphsRow]) {
    let wall = |v: Variant| rows.iter().find(|r| r.case.variant == v.name()).map(|r| r.wall_ms.median);
    if let (Some(eager), Some(graphed), Some(floor)) =
        (wall(Variant::Eager), wall(Variant::Graphed), wall(Variant::Floor))
    {
        println!("  wall time: graphed/eager {:.2}x, graphed/floor {:.2}x", graphed / eager, graphed / floor);
    }
}
