//! `graphed bench gemm`: TFLOP/s of bf16 GEMMs through graphed (cuBLASLt with f32 accumulation),
//! timed with CUDA events back to back; `bench/torch_reference.py gemm` times PyTorch's.
//!
//! Without `--configs`, one `d × d × d` product. With it, the twelve GEMMs of one transformer
//! layer of each configuration, each in the layout and with the epilogue the layer runs it with
//! (`nn::Linear`) and again without its epilogue, so that a slow GEMM in `bench layer --profile`
//! can be told apart into the shape, the epilogue and the place in the layer (PyTorch runs the same
//! shapes with its own epilogues: bias in the GEMM, GELU and the bias gradient as kernels of their
//! own).

use float8::{F8E4M3, F8E5M2};
use graphed::device::{Device, DeviceBuffer, DeviceKind, Epilogue, Float8, Fp8Gemm, Gemm, Stream};
use half::bf16;
use serde::Serialize;

use super::{median, write_json, Report};
use crate::cli::args::GemmBenchArgs;
use crate::cli::bench_model::Config;

#[derive(Serialize, Debug)]
struct GemmRow {
    config: &'static str,
    /// Which GEMM of the layer (`square` without `--configs`).
    gemm: &'static str,
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    /// The epilogue as the layer runs it, or `none`.
    epilogue: &'static str,
    /// `bf16`, or the FP8 operand formats (`e4m3×e4m3`, `e5m2×e4m3`).
    dtype: &'static str,
    median_ms: f64,
    tflops: f64,
}

/// The epilogue of one of a layer's GEMMs (its buffers are made per shape).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fusion {
    None,
    Bias,
    BiasResidual,
    BiasGeluAux,
    DGelu,
    BGradA,
}

impl Fusion {
    fn name(self) -> &'static str {
        match self {
            Fusion::None => "none",
            Fusion::Bias => "bias",
            Fusion::BiasResidual => "bias+residual",
            Fusion::BiasGeluAux => "bias+gelu_aux",
            Fusion::DGelu => "dgelu",
            Fusion::BGradA => "bgrad_a",
        }
    }
}

/// One GEMM of the layer: its name, `(m, n, k)`, transposes and epilogue.
struct Shape {
    name: &'static str,
    dims: (usize, usize, usize),
    trans_a: bool,
    trans_b: bool,
    fusion: Fusion,
}

/// The twelve GEMMs of a `TransformerLayer`'s forward and backward at `tokens` rows and width
/// `d`, as `nn::Linear` calls them: weights `(out, in)`, so the forward is `x·Wᵀ`, the data
/// gradient `dy·W` and the weight gradient `dyᵀ·x`, accumulated; the bias gradients of QKV and
/// FC1 come from their weight-gradient epilogue, those of the output projections from the
/// LayerNorm backward (`nn::TransformerLayer`).
fn layer_shapes(tokens: usize, d: usize) -> Vec<Shape> {
    let forward =
        |name, out, inp, fusion| Shape { name, dims: (tokens, out, inp), trans_a: false, trans_b: true, fusion };
    let data =
        |name, out, inp, fusion| Shape { name, dims: (tokens, inp, out), trans_a: false, trans_b: false, fusion };
    let weight =
        |name, out, inp, fusion| Shape { name, dims: (out, inp, tokens), trans_a: true, trans_b: false, fusion };
    vec![
        forward("qkv", 3 * d, d, Fusion::Bias),
        forward("proj", d, d, Fusion::BiasResidual),
        forward("fc1", 4 * d, d, Fusion::BiasGeluAux),
        forward("fc2", d, 4 * d, Fusion::BiasResidual),
        data("fc2.dx", d, 4 * d, Fusion::DGelu),
        weight("fc2.dw", d, 4 * d, Fusion::None),
        data("fc1.dx", 4 * d, d, Fusion::None),
        weight("fc1.dw", 4 * d, d, Fusion::BGradA),
        data("proj.dx", d, d, Fusion::None),
        weight("proj.dw", d, d, Fusion::None),
        data("qkv.dx", 3 * d, d, Fusion::None),
        weight("qkv.dw", 3 * d, d, Fusion::BGradA),
    ]
}

pub fn run(args: &GemmBenchArgs) -> anyhow::Result<()> {
    let dev = super::super::open_device(&args.device)?;
    anyhow::ensure!(dev.kind() == DeviceKind::Cuda, "bench gemm times GPU kernels; run it on a CUDA device");
    let configs = args.configs.iter().map(|name| Config::named(name)).collect::<anyhow::Result<Vec<_>>>()?;
    let s = dev.stream()?;
    let mut rows = Vec::new();
    if configs.is_empty() {
        let d = args.d;
        let square = Shape { name: "square", dims: (d, d, d), trans_a: false, trans_b: false, fusion: Fusion::None };
        let operands = Operands::new(&dev, &s, square.dims)?;
        rows.push(time(&dev, &s, "-", &square, &operands, args.reps)?);
        if args.fp8 {
            let fp8 = Fp8Operands::new(&dev, &s, square.dims)?;
            rows.push(time_fp8(&dev, &s, "-", &square, (&fp8, &operands.c), args.reps)?);
        }
    }
    for config in &configs {
        println!(
            "{}: d={} tokens={} (batch {} × seq {})",
            config.name,
            config.dim,
            config.batch * config.seq,
            config.batch,
            config.seq
        );
        for shape in layer_shapes(config.batch * config.seq, config.dim) {
            let operands = Operands::new(&dev, &s, shape.dims)?;
            rows.push(time(&dev, &s, config.name, &shape, &operands, args.reps)?);
            let plain = Shape { fusion: Fusion::None, ..shape };
            if shape.fusion != Fusion::None {
                rows.push(time(&dev, &s, config.name, &plain, &operands, args.reps)?);
            }
            if args.fp8 {
                let fp8 = Fp8Operands::new(&dev, &s, shape.dims)?;
                rows.push(time_fp8(&dev, &s, config.name, &plain, (&fp8, &operands.c), args.reps)?);
            }
        }
    }
    write_json(&args.json, &Report::new("gemm", &dev, args.reps, rows))
}

/// Operands of one shape, filled with small values so that nothing overflows.
struct Operands {
    a: DeviceBuffer<bf16>,
    b: DeviceBuffer<bf16>,
    c: DeviceBuffer<bf16>,
    /// The residual or GELU's saved input, `m × n`.
    side: DeviceBuffer<bf16>,
    /// The bias (`n`) or the bias gradient (`m`).
    vector: DeviceBuffer<bf16>,
}

/// Small values that nothing overflows with, the same for every operand and type.
fn values(len: usize) -> impl Iterator<Item = f32> {
    (0..len).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
}

/// The FP8 operands of one shape, made only with `--fp8`: A (`m × k`) in E4M3 and in E5M2 (a
/// gradient), B (`n × k`, the layout an FP8 GEMM reads) in E4M3, and a scale of one.
struct Fp8Operands {
    a: DeviceBuffer<F8E4M3>,
    grad: DeviceBuffer<F8E5M2>,
    b: DeviceBuffer<F8E4M3>,
    one: DeviceBuffer<f32>,
}

impl Fp8Operands {
    fn new(dev: &Device, s: &Stream, (m, n, k): (usize, usize, usize)) -> anyhow::Result<Fp8Operands> {
        fn quantized<F: Float8>(len: usize) -> Vec<F> {
            values(len).map(F::from_f32).collect()
        }
        Ok(Fp8Operands {
            a: dev.alloc_from(s, &quantized(m * k))?,
            grad: dev.alloc_from(s, &quantized(m * k))?,
            b: dev.alloc_from(s, &quantized(n * k))?,
            one: dev.alloc_from(s, &[1.0f32])?,
        })
    }

    /// The FP8 GEMM of `shape`'s dimensions into `c` as an FP8 training step runs it (see
    /// [`fp8_formats`]), the forward's with fast accumulation, as TransformerEngine's.
    fn gemm(&self, s: &Stream, c: &DeviceBuffer<bf16>, shape: &Shape) -> graphed::Result<()> {
        let scales = (self.one.view(), self.one.view());
        if is_forward(shape) {
            let g = Fp8Gemm::new(c.view(), self.a.view(), self.b.view(), scales, shape.dims);
            return s.fp8_gemm(Fp8Gemm { fast_accum: true, ..g });
        }
        s.fp8_gemm(Fp8Gemm::new(c.view(), self.grad.view(), self.b.view(), scales, shape.dims))
    }
}

/// Whether `shape` is a forward GEMM (`x·Wᵀ`).
fn is_forward(shape: &Shape) -> bool {
    !shape.trans_a && shape.trans_b
}

/// The FP8 formats a training step multiplies `shape` in: E4M3 × E4M3 in the forward, an E5M2
/// gradient times E4M3 in the backward.
fn fp8_formats(shape: &Shape) -> &'static str {
    if is_forward(shape) {
        "e4m3×e4m3"
    } else {
        "e5m2×e4m3"
    }
}

impl Operands {
    fn new(dev: &Device, s: &Stream, (m, n, k): (usize, usize, usize)) -> anyhow::Result<Operands> {
        let fill = |len: usize| -> Vec<bf16> { values(len).map(bf16::from_f32).collect() };
        Ok(Operands {
            a: dev.alloc_from(s, &fill(m * k))?,
            b: dev.alloc_from(s, &fill(k * n))?,
            c: dev.alloc_from(s, &fill(m * n))?,
            side: dev.alloc_from(s, &fill(m * n))?,
            vector: dev.alloc_from(s, &fill(m.max(n)))?,
        })
    }

    fn gemm(&self, shape: &Shape) -> Gemm<'_, bf16> {
        let (m, n, _) = shape.dims;
        let plain = Gemm {
            trans_a: shape.trans_a,
            trans_b: shape.trans_b,
            ..Gemm::new(self.c.view(), self.a.view(), self.b.view(), shape.dims)
        };
        match shape.fusion {
            Fusion::None => plain,
            Fusion::Bias => Gemm { epilogue: Epilogue::Bias(self.vector.slice(0..n)), ..plain },
            Fusion::BiasResidual => Gemm {
                epilogue: Epilogue::Bias(self.vector.slice(0..n)),
                addend: Some(self.side.view()),
                beta: 1.0,
                ..plain
            },
            Fusion::BiasGeluAux => Gemm {
                epilogue: Epilogue::BiasGeluAux { bias: self.vector.slice(0..n), aux: self.side.view() },
                ..plain
            },
            Fusion::DGelu => Gemm { epilogue: Epilogue::DGelu { aux: self.side.view() }, ..plain },
            Fusion::BGradA => {
                Gemm { epilogue: Epilogue::BGradA { bias_grad: self.vector.slice(0..m) }, beta: 1.0, ..plain }
            }
        }
    }
}

/// The median time of `shape` on `operands` over `reps` calls, each between two events, after
/// five untimed.
fn time(
    dev: &Device,
    s: &Stream,
    config: &'static str,
    shape: &Shape,
    operands: &Operands,
    reps: u32,
) -> anyhow::Result<GemmRow> {
    let ms = median_ms(dev, s, reps, || s.gemm(operands.gemm(shape)))?;
    Ok(row(config, shape, layout(shape), "bf16", ms))
}

/// As [`time`], the FP8 GEMM of `shape`'s dimensions into `c` (see [`Fp8Operands::gemm`]),
/// without epilogue, in FP8's one layout (`NT`).
fn time_fp8(
    dev: &Device,
    s: &Stream,
    config: &'static str,
    shape: &Shape,
    (fp8, c): (&Fp8Operands, &DeviceBuffer<bf16>),
    reps: u32,
) -> anyhow::Result<GemmRow> {
    let ms = median_ms(dev, s, reps, || fp8.gemm(s, c, shape))?;
    Ok(row(config, &Shape { trans_a: false, trans_b: true, ..*shape }, "NT", fp8_formats(shape), ms))
}

/// The median of `reps` timings of `enqueue`, each between two events, after five untimed.
fn median_ms(dev: &Device, s: &Stream, reps: u32, enqueue: impl Fn() -> graphed::Result<()>) -> anyhow::Result<f64> {
    let (start, end) = (dev.timing_event()?, dev.timing_event()?);
    for _ in 0..5 {
        enqueue()?;
    }
    s.synchronize()?;
    let mut times = Vec::new();
    for _ in 0..reps {
        s.record(&start)?;
        enqueue()?;
        s.record(&end)?;
        end.synchronize()?;
        times.push(f64::from(start.elapsed_ms(&end)?));
    }
    Ok(median(times))
}

/// One row, printed as it is made.
fn row(config: &'static str, shape: &Shape, layout: &str, dtype: &'static str, ms: f64) -> GemmRow {
    let (m, n, k) = shape.dims;
    let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
    let epilogue = shape.fusion.name();
    println!(
        "  {:<8} {m:>6}×{n:<6}×{k:<6} {layout:<3} {dtype:<9} {epilogue:<14} {ms:>8.3} ms {tflops:>7.1} TFLOP/s",
        shape.name,
    );
    GemmRow {
        config,
        gemm: shape.name,
        m,
        n,
        k,
        trans_a: shape.trans_a,
        trans_b: shape.trans_b,
        epilogue,
        dtype,
        median_ms: ms,
        tflops,
    }
}

/// `NN`, `NT`, `TN` or `TT`, as row-major `op(A)·op(B)`.
fn layout(shape: &Shape) -> &'static str {
    match (shape.trans_a, shape.trans_b) {
        (false, false) => "NN",
        (false, true) => "NT",
        (true, false) => "TN",
        (true, true) => "TT",
    }
}
