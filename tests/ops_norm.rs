//! LayerNorm, GELU and causal softmax: gradients, f32 and bf16 against references, CUDA vs
//! simulator, determinism, accumulation, masking, refusals.

mod common;

use anyhow::ensure;
use common::{ensure_close, lcg, numeric_grad};
use graphed::device::{CaptureMode, DType, Device, DeviceKind, Stream};
use graphed::memory::CachingAllocator;
use graphed::ops::layernorm::{self, LayerNormWorkspace, ResidualGrad};
use graphed::ops::{gelu, softmax};
use graphed::tensor::Tensor;
use graphed::Error;
use half::bf16;

/// Named outputs of one run of an op's forward and backward, compared across devices and runs
/// (bf16 values widened to f32, exactly).
type Outputs = Vec<(&'static str, Vec<f32>)>;

/// Finite differences: step, and tolerance `atol + rtol·|numeric|`. The forward runs in f32 and
/// the loss Σ out⊙r is summed in f64; its rounding (about 1e-7 relative) over the 2·FD_STEP span,
/// plus the O(FD_STEP²) truncation error of central differences, gave errors up to 1.1e-5 on
/// these inputs; the tolerance leaves a margin of about ten.
const FD_STEP: f32 = 1e-2;
const FD_ATOL: f64 = 1e-4;
const FD_RTOL: f64 = 1e-3;

/// CUDA against the simulator in f32: `|cuda − sim| ≤ 1e-5·(max |sim| over the output) +
/// 1e-5·|sim|`. The kernels compute the same formulas, but the CUDA reductions add in tree
/// order, NVRTC fuses multiply-adds, and `expf`/`tanhf` may differ from the host's by a few ulp;
/// such errors scale with the largest terms of a sum, hence the term relative to the output's
/// maximum. An f32 emulation of the tree order at the larger shapes below used at most 2% of this
/// tolerance.
const CUDA_TOL: f64 = 1e-5;

/// bf16 outputs: the simulator within 1 ulp of an f64 reference rounded once to bf16 (it computes
/// in f32 and rounds once, so it differs only where the f32 result and the exact one straddle a
/// rounding boundary). CUDA against the simulator: within 1 ulp plus [`CUDA_TOL`]·max — both round
/// f32 results once, and those may differ as much as the f32 bound allows (FMA contraction,
/// summation order), which near zero, after cancellation, is more than a bf16 ulp.
const BF16_ULPS: u32 = 1;

/// Deterministic pseudo-random inputs (a 64-bit LCG with Knuth's MMIX constants).
struct Lcg(u64);

impl Lcg {
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                lo + (hi - lo) * ((self.0 >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }
}

/// `v` rounded to `dtype` (and widened back), so that host references see exactly the device's
/// inputs.
fn round_to(dtype: DType, v: Vec<f32>) -> Vec<f32> {
    match dtype {
        DType::BF16 => v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect(),
        _ => v,
    }
}

/// A stream and a poisoning allocator: uninitialized tensors hold NaN, so an output element a
/// kernel fails to write shows up.
struct Ctx {
    s: Stream,
    alloc: CachingAllocator,
}

impl Ctx {
    fn new(dev: &Device) -> anyhow::Result<Ctx> {
        Ok(Ctx { s: dev.stream()?, alloc: CachingAllocator::with_poison(dev) })
    }

    fn t(&self, data: &[f32], shape: &[usize]) -> graphed::Result<Tensor> {
        Tensor::from_host(&self.alloc, &self.s, data, shape)
    }

    /// `data` as a tensor of `dtype` (f32 or bf16, rounded to nearest even).
    fn typed(&self, data: &[f32], shape: &[usize], dtype: DType) -> graphed::Result<Tensor> {
        match dtype {
            DType::BF16 => {
                let h: Vec<bf16> = data.iter().map(|v| bf16::from_f32(*v)).collect();
                Tensor::from_host(&self.alloc, &self.s, &h, shape)
            }
            _ => self.t(data, shape),
        }
    }

    fn uninit(&self, shape: &[usize]) -> graphed::Result<Tensor> {
        Tensor::uninit(&self.alloc, &self.s, shape, DType::F32)
    }

    fn uninit_of(&self, shape: &[usize], dtype: DType) -> graphed::Result<Tensor> {
        Tensor::uninit(&self.alloc, &self.s, shape, dtype)
    }

    fn zeros(&self, shape: &[usize]) -> graphed::Result<Tensor> {
        Tensor::zeros(&self.alloc, &self.s, shape, DType::F32)
    }

    fn read(&self, t: &Tensor) -> graphed::Result<Vec<f32>> {
        t.to_f32_vec(&self.s)
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|v| f64::from(*v)).collect()
}

fn bits(outputs: &Outputs) -> Vec<Vec<u32>> {
    outputs.iter().map(|(_, v)| v.iter().map(|x| x.to_bits()).collect()).collect()
}

/// bf16 values in an order where neighbours differ by 1 (both zeros are 0).
fn ordered(x: f32) -> i32 {
    let b = i32::from(bf16::from_f32(x).to_bits());
    if b & 0x8000 != 0 {
        -(b & 0x7fff)
    } else {
        b
    }
}

/// Fails unless every bf16 value of `got` is within [`BF16_ULPS`] of `want` rounded once to bf16,
/// or (where the f32 results may differ by more than a bf16 ulp) within `atol` plus 1 ulp.
fn ensure_ulps(what: &str, got: &[f32], want: &[f64], atol: f64) -> anyhow::Result<()> {
    ensure!(got.len() == want.len(), "{what}: {} values, expected {}", got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let w = bf16::from_f64(*w).to_f32();
        let wider = bf16::from_f32(g.abs().max(w.abs()));
        let ulp = f64::from(bf16::from_bits(wider.to_bits() + 1).to_f32() - wider.to_f32());
        let within =
            ordered(*g).abs_diff(ordered(w)) <= BF16_ULPS || (atol > 0.0 && f64::from(g - w).abs() <= atol + ulp);
        ensure!(within, "{what}[{i}]: {g} vs {w} (bf16 of the reference)");
    }
    Ok(())
}

/// The absolute term of a bf16 check against a reference: none on the simulator, the f32 bound
/// [`CUDA_TOL`]·max on CUDA.
fn cuda_floor(dev: &Device, want: &[f64]) -> f64 {
    match dev.kind() {
        DeviceKind::Sim => 0.0,
        _ => CUDA_TOL * want.iter().fold(0.0f64, |m, v| m.max(v.abs())),
    }
}

/// Outputs of f32 statistics among those of an op of another type.
fn is_f32_stat(name: &str) -> bool {
    matches!(name, "mean" | "rstd")
}

/// CUDA against the simulator: f32 outputs within [`CUDA_TOL`], bf16 ones within [`BF16_ULPS`].
fn compare(dtype: DType, got: &Outputs, want: &Outputs) -> anyhow::Result<()> {
    ensure!(got.len() == want.len(), "{} outputs, expected {}", got.len(), want.len());
    for ((name, got), (_, want)) in got.iter().zip(want) {
        let max = want.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        if dtype == DType::BF16 && !is_f32_stat(name) {
            ensure_ulps(name, got, &f64s(want), CUDA_TOL * max)?;
        } else {
            ensure_close(name, got, &f64s(want), CUDA_TOL * max, CUDA_TOL)?;
        }
    }
    Ok(())
}

/// The CUDA check of a case: `run` on `dev` against `run` on a fresh simulator.
fn against_sim(dev: &Device, run: impl Fn(&Device) -> anyhow::Result<Outputs>) -> anyhow::Result<()> {
    let (got, want) = (run(dev)?, run(&Device::sim())?);
    compare(DType::F32, &got, &want)
}

const BOTH: [DType; 2] = [DType::F32, DType::BF16];

// ---- LayerNorm ------------------------------------------------------------------------------

/// What the backward fuses of the residual stream.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Residual {
    No,
    /// Its gradient added into dinp.
    Add,
    /// Added, and its column sums accumulated into dcolsum.
    AddAndSum,
}

const RESIDUALS: [Residual; 3] = [Residual::No, Residual::Add, Residual::AddAndSum];

/// LayerNorm inputs of one element type (values representable in it), an upstream gradient, a
/// residual gradient and initial parameter gradients.
struct Ln {
    n: usize,
    c: usize,
    dtype: DType,
    x: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    dout: Vec<f32>,
    res: Vec<f32>,
    /// Initial dweight, dbias and dcolsum: the backward adds to them.
    grads0: [Vec<f32>; 3],
}

impl Ln {
    fn new(n: usize, c: usize, dtype: DType) -> Ln {
        let mut r = Lcg(1);
        let mut v = |len: usize, lo: f32, hi: f32| round_to(dtype, r.vec(len, lo, hi));
        let (x, w, b, dout, res) =
            (v(n * c, -2.0, 2.0), v(c, 0.5, 1.5), v(c, -0.5, 0.5), v(n * c, -1.0, 1.0), v(n * c, -1.0, 1.0));
        let grads0 = [v(c, -1.0, 1.0), v(c, -1.0, 1.0), v(c, -1.0, 1.0)];
        Ln { n, c, dtype, x, w, b, dout, res, grads0 }
    }

    /// Each row's mean and rstd, in f64, as f32: the same saved statistics on every device.
    fn stats(&self) -> (Vec<f32>, Vec<f32>) {
        self.x
            .chunks_exact(self.c)
            .map(|row| {
                let m = row.iter().map(|v| f64::from(*v)).sum::<f64>() / self.c as f64;
                let var = row.iter().map(|v| (f64::from(*v) - m).powi(2)).sum::<f64>() / self.c as f64;
                (m as f32, (1.0 / (var + 1e-5).sqrt()) as f32)
            })
            .unzip()
    }

    /// `[out, mean, rstd]` of the forward of `x` with parameters `w`, `b`.
    fn forward(&self, ctx: &Ctx, x: &[f32], w: &[f32], b: &[f32]) -> anyhow::Result<[Tensor; 3]> {
        let (n, c, dt) = (self.n, self.c, self.dtype);
        let inp = ctx.typed(x, &[n, c], dt)?;
        let [out, mean, rstd] = [ctx.uninit_of(&[n, c], dt)?, ctx.uninit(&[n])?, ctx.uninit(&[n])?];
        let (w, b) = (ctx.typed(w, &[c], dt)?, ctx.typed(b, &[c], dt)?);
        layernorm::layernorm_forward(&out, &mean, &rstd, &inp, &w, &b, 1e-5, &ctx.s)?;
        Ok([out, mean, rstd])
    }

    /// Σ out⊙dout, plus Σ (x + β)⊙res with the residual (β: the bias of a Linear whose output
    /// gradient is res, broadcast over rows): its gradients are what the backward computes.
    fn loss(
        &self,
        ctx: &Ctx,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        beta: &[f32],
        residual: Residual,
    ) -> anyhow::Result<f64> {
        let [out, ..] = self.forward(ctx, x, w, b)?;
        let mut loss = dot(&ctx.read(&out)?, &self.dout);
        if residual != Residual::No {
            let z: Vec<f32> = x.iter().enumerate().map(|(i, x)| x + beta[i % self.c]).collect();
            loss += dot(&z, &self.res);
        }
        Ok(loss)
    }

    /// The backward's tensors: `[dinp, dweight, dbias, dcolsum]` (the last three from
    /// `grads0`), then its inputs `[dout, inp, weight, mean, rstd, res]` (statistics from
    /// [`Ln::stats`]).
    fn backward_tensors(&self, ctx: &Ctx) -> anyhow::Result<([Tensor; 4], [Tensor; 6])> {
        let (n, c, dt) = (self.n, self.c, self.dtype);
        let (mean, rstd) = self.stats();
        let g = &self.grads0;
        let outs = [
            ctx.uninit_of(&[n, c], dt)?,
            ctx.typed(&g[0], &[c], dt)?,
            ctx.typed(&g[1], &[c], dt)?,
            ctx.typed(&g[2], &[c], dt)?,
        ];
        let ins = [
            ctx.typed(&self.dout, &[n, c], dt)?,
            ctx.typed(&self.x, &[n, c], dt)?,
            ctx.typed(&self.w, &[c], dt)?,
            ctx.t(&mean, &[n])?,
            ctx.t(&rstd, &[n])?,
            ctx.typed(&self.res, &[n, c], dt)?,
        ];
        Ok((outs, ins))
    }

    /// One backward launch on `outs` from `ins` (as [`Ln::backward_tensors`]).
    fn backward(
        ctx: &Ctx,
        outs: &[Tensor; 4],
        ins: &[Tensor; 6],
        residual: Residual,
        ws: &LayerNormWorkspace,
    ) -> graphed::Result<()> {
        let [dinp, dweight, dbias, dcolsum] = outs;
        let [dout, inp, weight, mean, rstd, res] = ins;
        let fused = match residual {
            Residual::No => None,
            Residual::Add => Some(ResidualGrad { grad: res, colsum: None }),
            Residual::AddAndSum => Some(ResidualGrad { grad: res, colsum: Some(dcolsum) }),
        };
        layernorm::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, fused, ws, &ctx.s)
    }

    /// The forward's outputs and the backward's (from the host statistics), on `dev`.
    fn run(&self, dev: &Device, residual: Residual) -> anyhow::Result<Outputs> {
        let ctx = Ctx::new(dev)?;
        let [out, mean, rstd] = self.forward(&ctx, &self.x, &self.w, &self.b)?;
        let (outs, ins) = self.backward_tensors(&ctx)?;
        Ln::backward(&ctx, &outs, &ins, residual, &LayerNormWorkspace::new(&ctx.alloc, &ctx.s, self.c)?)?;
        let mut got = vec![("out", ctx.read(&out)?), ("mean", ctx.read(&mean)?), ("rstd", ctx.read(&rstd)?)];
        for (name, t) in ["dinp", "dweight", "dbias", "dcolsum"].into_iter().zip(&outs) {
            got.push((name, ctx.read(t)?));
        }
        Ok(got)
    }

    /// [`Ln::run`]'s outputs in f64 from the same inputs (each value exact in the element type).
    fn reference(&self, residual: Residual) -> Vec<(&'static str, Vec<f64>)> {
        let (n, c) = (self.n, self.c);
        let (mean, rstd) = self.stats();
        let (mut out, mut dinp) = (vec![0.0; n * c], vec![0.0; n * c]);
        let mut sums = [vec![0.0f64; c], vec![0.0f64; c], vec![0.0f64; c]];
        let v = |a: &[f32], i: usize| f64::from(a[i]);
        for row in 0..n {
            let at = row * c;
            let xs = &self.x[at..at + c];
            let m = xs.iter().map(|v| f64::from(*v)).sum::<f64>() / c as f64;
            let var = xs.iter().map(|v| (f64::from(*v) - m).powi(2)).sum::<f64>() / c as f64;
            for col in 0..c {
                out[at + col] = (v(xs, col) - m) / (var + 1e-5).sqrt() * v(&self.w, col) + v(&self.b, col);
            }
            // The backward from the saved f32 statistics, as the kernels get them.
            let (m, r) = (f64::from(mean[row]), f64::from(rstd[row]));
            let norm: Vec<f64> = (0..c).map(|col| (v(xs, col) - m) * r).collect();
            let dn: Vec<f64> = (0..c).map(|col| v(&self.dout, at + col) * v(&self.w, col)).collect();
            let mean_dn = dn.iter().sum::<f64>() / c as f64;
            let mean_dn_norm = dn.iter().zip(&norm).map(|(d, x)| d * x).sum::<f64>() / c as f64;
            for col in 0..c {
                let res = if residual == Residual::No { 0.0 } else { v(&self.res, at + col) };
                dinp[at + col] = (dn[col] - mean_dn - norm[col] * mean_dn_norm) * r + res;
                sums[0][col] += v(&self.dout, at + col) * norm[col];
                sums[1][col] += v(&self.dout, at + col);
                sums[2][col] += if residual == Residual::AddAndSum { res } else { 0.0 };
            }
        }
        let stats = |s: &[f32]| s.iter().map(|v| f64::from(*v)).collect::<Vec<_>>();
        let grad = |k: usize| self.grads0[k].iter().zip(&sums[k]).map(|(g, s)| f64::from(*g) + s).collect();
        vec![
            ("out", out),
            ("mean", stats(&mean)),
            ("rstd", stats(&rstd)),
            ("dinp", dinp),
            ("dweight", grad(0)),
            ("dbias", grad(1)),
            ("dcolsum", grad(2)),
        ]
    }
}

/// Shapes for CUDA against the simulator: vector and scalar accesses (700 is a multiple of 4 but
/// not of 8; 4095 of neither), one to sixteen rows per block, the backward's small-N path (its
/// column split: (3, 8), (5, 700), (7, 4095)), its row path with a grid of 10 (one span), 63 (a
/// partial last span) and 132 blocks with several rows per row group, and the widest rows.
const LN_CUDA_SHAPES: [(usize, usize); 7] =
    [(3, 8), (5, 700), (150, 256), (1001, 256), (2500, 128), (300, 4096), (7, 4095)];

/// f32 gradients against finite differences on the simulator, with and without the fused
/// residual and its column sums; on CUDA, f32 and bf16 against the simulator.
fn layernorm_gradients(dev: &Device) -> anyhow::Result<()> {
    if dev.kind() != DeviceKind::Sim {
        for (dtype, (n, c), residual) in
            BOTH.into_iter().flat_map(|d| LN_CUDA_SHAPES.into_iter().flat_map(move |s| RESIDUALS.map(|r| (d, s, r))))
        {
            let ln = Ln::new(n, c, dtype);
            compare(dtype, &ln.run(dev, residual)?, &ln.run(&Device::sim(), residual)?)
                .map_err(|e| e.context(format!("{dtype} ({n}, {c}), residual {residual:?}")))?;
        }
        return Ok(());
    }
    let mut ln = Ln::new(3, 8, DType::F32);
    ln.grads0 = [vec![0.0; 8], vec![0.0; 8], vec![0.0; 8]];
    let ctx = Ctx::new(dev)?;
    let (x, w, b, beta) = (&ln.x, &ln.w, &ln.b, &vec![0.0f32; ln.c]);
    for residual in RESIDUALS {
        // [out, mean, rstd, dinp, dweight, dbias, dcolsum]
        let got = ln.run(dev, residual)?;
        let loss = |x: &[f32], w: &[f32], b: &[f32], beta: &[f32]| ln.loss(&ctx, x, w, b, beta, residual);
        let checks = [
            ("dinp", &got[3].1, numeric_grad(|p| loss(p, w, b, beta), x, FD_STEP)?),
            ("dweight", &got[4].1, numeric_grad(|p| loss(x, p, b, beta), w, FD_STEP)?),
            ("dbias", &got[5].1, numeric_grad(|p| loss(x, w, p, beta), b, FD_STEP)?),
        ];
        for (name, got, want) in checks {
            ensure_close(name, got, &want, FD_ATOL, FD_RTOL).map_err(|e| e.context(format!("{residual:?}")))?;
        }
        let dcolsum = &got[6].1;
        if residual == Residual::AddAndSum {
            ensure_close("dcolsum", dcolsum, &numeric_grad(|p| loss(x, w, b, p), beta, FD_STEP)?, FD_ATOL, FD_RTOL)?;
        } else {
            ensure!(dcolsum.iter().all(|v| *v == 0.0), "{residual:?}: dcolsum changed without being given");
        }
    }
    Ok(())
}

/// bf16: every output within 1 ulp of the f64 reference rounded once to bf16 (on CUDA, plus the
/// f32 bound: see [`BF16_ULPS`]), the statistics (f32) within 1e-6 relative; f32 within 1e-5.
fn layernorm_matches_an_f64_reference(dev: &Device) -> anyhow::Result<()> {
    for (dtype, residual) in BOTH.into_iter().flat_map(|d| RESIDUALS.map(|r| (d, r))) {
        let ln = Ln::new(37, 96, dtype);
        ensure_reference(&ln, residual, &ln.run(dev, residual)?, |want| cuda_floor(dev, want), "")?;
    }
    Ok(())
}

/// [`Ln::run`]'s outputs `got` against [`Ln::reference`], with the tolerances of
/// [`layernorm_matches_an_f64_reference`], bf16 outputs also within `floor` of the reference (an
/// absolute term from the output's reference values); errors start with `what`.
fn ensure_reference(
    ln: &Ln,
    residual: Residual,
    got: &Outputs,
    floor: impl Fn(&[f64]) -> f64,
    what: &str,
) -> anyhow::Result<()> {
    let dtype = ln.dtype;
    for ((name, got), (_, want)) in got.iter().zip(ln.reference(residual)) {
        let what = format!("{what}{dtype} {residual:?} {name}");
        if dtype == DType::BF16 && !is_f32_stat(name) {
            ensure_ulps(&what, got, &want, floor(&want))?;
        } else {
            let tol: f64 = if is_f32_stat(name) { 1e-6 } else { 1e-5 };
            ensure_close(&what, got, &want, tol, tol)?;
        }
    }
    Ok(())
}

/// The backward on both sides of its small-N threshold (`backward_column_path_rows`: at most
/// that many rows take the column split, one more the row path), at C = 8, 256 (the benchmark's
/// config S has 128 rows of 256, the threshold), 700 and 4095 (scalar accesses) and 4096, with
/// the residual and its column sums, f32 and bf16: on the simulator against the f64 reference,
/// on CUDA against the simulator; and two runs bitwise identical. Against the reference, bf16
/// outputs get the f32 bound [`CUDA_TOL`]·max on the simulator too: with this many rows, some
/// f32 result near zero after cancellation (out = (x − m)·rstd·w + b at (129, 256)) is off by
/// more than a bf16 ulp before it is rounded.
fn layernorm_backward_small_n_path(dev: &Device) -> anyhow::Result<()> {
    let residual = Residual::AddAndSum;
    for c in [8, 256, 700, 4095, 4096] {
        let limit = layernorm::backward_column_path_rows(c);
        for (n, dtype) in [1, limit, limit + 1].into_iter().flat_map(|n| BOTH.map(|d| (n, d))) {
            let ln = Ln::new(n, c, dtype);
            let what = format!("({n}, {c}), small-N path up to {limit} rows: ");
            let got = ln.run(dev, residual)?;
            if dev.kind() == DeviceKind::Sim {
                let floor = |want: &[f64]| CUDA_TOL * want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                ensure_reference(&ln, residual, &got, floor, &what)?;
            } else {
                compare(dtype, &got, &ln.run(&Device::sim(), residual)?).map_err(|e| e.context(what.clone()))?;
            }
            ensure!(bits(&got) == bits(&ln.run(dev, residual)?), "{what}{dtype}: two runs differ");
        }
    }
    Ok(())
}

/// The parameter gradients as views into one larger tensor, as a model's gradient store holds
/// them: on both of the backward's paths (one row; many rows, whose column sums take a second
/// kernel) only their elements change, and to the same bits as gradients of their own.
fn layernorm_gradients_into_views(dev: &Device) -> anyhow::Result<()> {
    let c = 256;
    for n in [1, layernorm::backward_column_path_rows(c) + 1, 1000] {
        for dtype in BOTH {
            let ln = Ln::new(n, c, dtype);
            let ctx = Ctx::new(dev)?;
            let ws = LayerNormWorkspace::new(&ctx.alloc, &ctx.s, c)?;
            let (outs, ins) = ln.backward_tensors(&ctx)?;
            // Gradient i at [(2i + 1)c, (2i + 2)c), fenced by c sevens on each side.
            let mut flat = vec![7.0f32; 7 * c];
            for (i, g) in ln.grads0.iter().enumerate() {
                flat[(2 * i + 1) * c..(2 * i + 2) * c].copy_from_slice(g);
            }
            let store = ctx.typed(&flat, &[7 * c], dtype)?;
            let view = |i: usize| store.narrow(0, (2 * i + 1) * c, c);
            let into_views = [outs[0].clone(), view(0)?, view(1)?, view(2)?];
            Ln::backward(&ctx, &into_views, &ins, Residual::AddAndSum, &ws)?;
            Ln::backward(&ctx, &outs, &ins, Residual::AddAndSum, &ws)?;
            let got = ctx.read(&store)?;
            for (i, own) in outs[1..].iter().enumerate() {
                let range = (2 * i + 1) * c..(2 * i + 2) * c;
                let same = got[range].iter().zip(ctx.read(own)?).all(|(a, b)| a.to_bits() == b.to_bits());
                ensure!(same, "({n}, {c}) {dtype}: gradient {i} as a view differs from its own tensor's");
            }
            let fences = (0..4).flat_map(|k| got[2 * k * c..(2 * k + 1) * c].iter());
            ensure!(fences.into_iter().all(|v| *v == 7.0), "({n}, {c}) {dtype}: the backward wrote outside the views");
        }
    }
    Ok(())
}

// ---- causal softmax ---------------------------------------------------------------------------

/// Attention scores `(B·H, T, T)` of one element type, an upstream gradient, and probabilities
/// to feed the backward (the f64 softmax of the scores, rounded to the type).
struct Sm {
    shape: [usize; 3],
    dtype: DType,
    scores: Vec<f32>,
    dprobs: Vec<f32>,
}

impl Sm {
    fn new(bh: usize, t: usize, dtype: DType) -> Sm {
        let mut r = Lcg(3);
        let n = bh * t * t;
        let (scores, dprobs) = (round_to(dtype, r.vec(n, -4.0, 4.0)), round_to(dtype, r.vec(n, -1.0, 1.0)));
        Sm { shape: [bh, t, t], dtype, scores, dprobs }
    }

    fn t(&self) -> usize {
        self.shape[2]
    }

    /// The causal softmax of `scores` in f64.
    fn softmax(&self, scores: &[f32]) -> Vec<f64> {
        let t = self.t();
        let mut p = vec![0.0; scores.len()];
        for (row, (p, z)) in p.chunks_exact_mut(t).zip(scores.chunks_exact(t)).enumerate() {
            let z = &z[..row % t + 1];
            let m = z.iter().fold(f64::NEG_INFINITY, |m, z| m.max(f64::from(*z)));
            let sum = z.iter().map(|z| (f64::from(*z) - m).exp()).sum::<f64>();
            p.iter_mut().zip(z).for_each(|(p, z)| *p = (f64::from(*z) - m).exp() / sum);
        }
        p
    }

    /// The probabilities the backward is given: the reference's, rounded to the element type.
    fn probs(&self) -> Vec<f32> {
        round_to(self.dtype, self.softmax(&self.scores).into_iter().map(|p| p as f32).collect())
    }

    fn forward(&self, ctx: &Ctx, scores: &[f32]) -> anyhow::Result<Tensor> {
        let probs = ctx.uninit_of(&self.shape, self.dtype)?;
        softmax::softmax_causal_forward(&probs, &ctx.typed(scores, &self.shape, self.dtype)?, &ctx.s)?;
        Ok(probs)
    }

    fn loss(&self, ctx: &Ctx, scores: &[f32]) -> anyhow::Result<f64> {
        Ok(dot(&ctx.read(&self.forward(ctx, scores)?)?, &self.dprobs))
    }

    /// `[probs, dscores]`: the forward of `scores`, and the backward of `dprobs` from `probs`.
    fn run_with(&self, dev: &Device, scores: &[f32], probs: &[f32], dprobs: &[f32]) -> anyhow::Result<Outputs> {
        let (ctx, (shape, dt)) = (Ctx::new(dev)?, (&self.shape, self.dtype));
        let (out, dscores) = (self.forward(&ctx, scores)?, ctx.uninit_of(shape, dt)?);
        let (probs, dprobs) = (ctx.typed(probs, shape, dt)?, ctx.typed(dprobs, shape, dt)?);
        softmax::softmax_causal_backward(&dscores, &probs, &dprobs, &ctx.s)?;
        Ok(vec![("probs", ctx.read(&out)?), ("dscores", ctx.read(&dscores)?)])
    }

    fn run(&self, dev: &Device) -> anyhow::Result<Outputs> {
        self.run_with(dev, &self.scores, &self.probs(), &self.dprobs)
    }

    /// `[probs, dscores]` in f64 from the same inputs.
    fn reference(&self) -> [Vec<f64>; 2] {
        let (t, probs) = (self.t(), self.probs());
        let mut ds = vec![0.0; probs.len()];
        for (row, (ds, (p, dp))) in
            ds.chunks_exact_mut(t).zip(probs.chunks_exact(t).zip(self.dprobs.chunks_exact(t))).enumerate()
        {
            let k = row % t + 1;
            let dot = p[..k].iter().zip(&dp[..k]).map(|(p, dp)| f64::from(*p) * f64::from(*dp)).sum::<f64>();
            for j in 0..k {
                ds[j] = f64::from(p[j]) * (f64::from(dp[j]) - dot);
            }
        }
        [self.softmax(&self.scores), ds]
    }

    /// `v` with every element above the diagonal replaced by `fill`.
    fn above_diagonal(&self, v: &[f32], fill: f32) -> Vec<f32> {
        let t = self.t();
        v.iter().enumerate().map(|(k, &x)| if k % t > (k / t) % t { fill } else { x }).collect()
    }
}

/// Shapes for CUDA against the simulator: vector and scalar accesses (300 is a multiple of 4 but
/// not of 8), eight rows per block down to one row group of 128 threads (T = 2048).
const SM_CUDA_SHAPES: [(usize, usize); 4] = [(2, 5), (3, 300), (2, 1024), (1, 2048)];

/// f32 score gradients against finite differences on the simulator; on CUDA, f32 and bf16 against
/// the simulator.
fn softmax_gradients(dev: &Device) -> anyhow::Result<()> {
    if dev.kind() != DeviceKind::Sim {
        for (dtype, (bh, t)) in BOTH.into_iter().flat_map(|d| SM_CUDA_SHAPES.map(|s| (d, s))) {
            let sm = Sm::new(bh, t, dtype);
            compare(dtype, &sm.run(dev)?, &sm.run(&Device::sim())?)
                .map_err(|e| e.context(format!("{dtype} ({bh}, {t}, {t})")))?;
        }
        return Ok(());
    }
    let sm = Sm::new(2, 5, DType::F32);
    let ctx = Ctx::new(dev)?;
    let probs = ctx.read(&sm.forward(&ctx, &sm.scores)?)?;
    let got = sm.run_with(dev, &sm.scores, &probs, &sm.dprobs)?;
    ensure_close("dscores", &got[1].1, &numeric_grad(|p| sm.loss(&ctx, p), &sm.scores, FD_STEP)?, FD_ATOL, FD_RTOL)
}

/// Probabilities and score gradients within 1 ulp of the f64 reference rounded once to bf16 (on
/// CUDA, plus the f32 bound: see [`BF16_ULPS`]), and within 1e-6 of it in f32.
fn softmax_matches_an_f64_reference(dev: &Device) -> anyhow::Result<()> {
    for dtype in BOTH {
        let sm = Sm::new(3, 40, dtype);
        let got = sm.run(dev)?;
        for ((name, got), want) in got.iter().zip(sm.reference()) {
            match dtype {
                DType::BF16 => ensure_ulps(name, got, &want, cuda_floor(dev, &want))?,
                _ => ensure_close(name, got, &want, 1e-6, 1e-6)?,
            }
        }
    }
    Ok(())
}

/// Both element types: outputs above the diagonal are exactly 0 and rows sum to 1; NaN above
/// the diagonal of every input changes nothing (it is never read); scores far beyond exp's range
/// do not overflow.
fn causal_mask_and_row_sums(dev: &Device) -> anyhow::Result<()> {
    for dtype in BOTH {
        let sm = Sm::new(2, 300, dtype);
        let t = sm.t();
        let out = sm.run(dev)?;
        let (probs, dscores) = (&out[0].1, &out[1].1);
        ensure!(sm.above_diagonal(probs, 0.0) == *probs, "{dtype}: probabilities above the diagonal are not 0");
        ensure!(sm.above_diagonal(dscores, 0.0) == *dscores, "{dtype}: score gradients above the diagonal are not 0");
        let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
        for (r, row) in probs.chunks_exact(t).enumerate() {
            let sum: f64 = row.iter().map(|p| f64::from(*p)).sum();
            ensure!((sum - 1.0).abs() < tol, "{dtype}: row {r} sums to {sum}");
        }

        let nan = |v: &[f32]| sm.above_diagonal(v, f32::NAN);
        let masked = sm.run_with(dev, &nan(&sm.scores), &nan(&sm.probs()), &nan(&sm.dprobs))?;
        ensure!(masked.iter().all(|(_, v)| v.iter().all(|x| x.is_finite())), "{dtype}: NaN above the diagonal leaked");
        ensure!(bits(&masked) == bits(&out), "{dtype}: values above the diagonal changed the result");

        let huge: Vec<f32> = round_to(dtype, sm.scores.iter().map(|s| s + 1e4).collect());
        let shifted = sm.run_with(dev, &huge, &sm.probs(), &sm.dprobs)?;
        for (r, row) in shifted[0].1.chunks_exact(t).enumerate() {
            let sum: f64 = row.iter().map(|p| f64::from(*p)).sum();
            ensure!(
                row.iter().all(|p| p.is_finite()) && (sum - 1.0).abs() < tol,
                "{dtype}: row {r} of shifted scores sums to {sum}; it starts {:?}",
                &row[..row.len().min(4)]
            );
        }
    }
    Ok(())
}

// ---- GELU -------------------------------------------------------------------------------------

/// GELU inputs: a pre-activation (N, C) spanning both tails and the bend, its bias and an
/// upstream gradient.
struct Gelu {
    n: usize,
    c: usize,
    x: Vec<f32>,
    bias: Vec<f32>,
    dout: Vec<f32>,
}

impl Gelu {
    fn new(n: usize, c: usize) -> Gelu {
        let mut r = Lcg(2);
        let (x, bias) = (r.vec(n * c, -4.0, 4.0), r.vec(c, -1.0, 1.0));
        Gelu { n, c, x, bias, dout: r.vec(n * c, -1.0, 1.0) }
    }

    fn gelu_loss(&self, ctx: &Ctx, x: &[f32]) -> anyhow::Result<f64> {
        let (inp, out) = (ctx.t(x, &[self.n, self.c])?, ctx.uninit(&[self.n, self.c])?);
        gelu::gelu_forward(&out, &inp, &ctx.s)?;
        Ok(dot(&out.to_vec(&ctx.s)?, &self.dout))
    }

    fn bias_gelu_loss(&self, ctx: &Ctx, x: &[f32], bias: &[f32]) -> anyhow::Result<f64> {
        let (inp, out) = (ctx.t(x, &[self.n, self.c])?, ctx.uninit(&[self.n, self.c])?);
        gelu::bias_gelu_forward(&out, &inp, &ctx.t(bias, &[self.c])?, &ctx.s)?;
        Ok(dot(&out.to_vec(&ctx.s)?, &self.dout))
    }

    fn run(&self, dev: &Device) -> anyhow::Result<Outputs> {
        let (ctx, shape) = (Ctx::new(dev)?, [self.n, self.c]);
        let (inp, dout) = (ctx.t(&self.x, &shape)?, ctx.t(&self.dout, &shape)?);
        let (out, dinp) = (ctx.uninit(&shape)?, ctx.uninit(&shape)?);
        gelu::gelu_forward(&out, &inp, &ctx.s)?;
        gelu::gelu_backward(&dinp, &inp, &dout, &ctx.s)?;
        Ok(vec![("out", out.to_vec(&ctx.s)?), ("dinp", dinp.to_vec(&ctx.s)?)])
    }

    fn run_bias(&self, dev: &Device) -> anyhow::Result<Outputs> {
        let (ctx, shape) = (Ctx::new(dev)?, [self.n, self.c]);
        let (inp, bias, dout) = (ctx.t(&self.x, &shape)?, ctx.t(&self.bias, &[self.c])?, ctx.t(&self.dout, &shape)?);
        let (out, dinp, dbias) = (ctx.uninit(&shape)?, ctx.uninit(&shape)?, ctx.zeros(&[self.c])?);
        gelu::bias_gelu_forward(&out, &inp, &bias, &ctx.s)?;
        gelu::bias_gelu_backward(&dinp, &dbias, &inp, &bias, &dout, &ctx.s)?;
        let s = &ctx.s;
        Ok(vec![("out", out.to_vec(s)?), ("dinp", dinp.to_vec(s)?), ("dbias", dbias.to_vec(s)?)])
    }

    /// The fused op composed from primitives (candle's `rms_norm_slow` idea): the bias added on
    /// the host, plain GELU forward and backward on the device, the bias gradient summed on the
    /// host over rows in order.
    fn run_bias_slow(&self, dev: &Device) -> anyhow::Result<Outputs> {
        let (ctx, shape) = (Ctx::new(dev)?, [self.n, self.c]);
        let biased: Vec<f32> = self.x.iter().enumerate().map(|(i, x)| x + self.bias[i % self.c]).collect();
        let (inp, dout) = (ctx.t(&biased, &shape)?, ctx.t(&self.dout, &shape)?);
        let (out, dinp) = (ctx.uninit(&shape)?, ctx.uninit(&shape)?);
        gelu::gelu_forward(&out, &inp, &ctx.s)?;
        gelu::gelu_backward(&dinp, &inp, &dout, &ctx.s)?;
        let dinp = dinp.to_vec(&ctx.s)?;
        let mut dbias = vec![0.0f32; self.c];
        for row in dinp.chunks_exact(self.c) {
            dbias.iter_mut().zip(row).for_each(|(acc, v)| *acc += v);
        }
        Ok(vec![("out", out.to_vec(&ctx.s)?), ("dinp", dinp), ("dbias", dbias)])
    }
}

fn gelu_gradients(dev: &Device) -> anyhow::Result<()> {
    if dev.kind() != DeviceKind::Sim {
        return [(3, 8), (5, 700)].into_iter().try_for_each(|(n, c)| against_sim(dev, |d| Gelu::new(n, c).run(d)));
    }
    let g = Gelu::new(3, 8);
    let got = g.run(dev)?;
    let ctx = Ctx::new(dev)?;
    ensure_close("dinp", &got[1].1, &numeric_grad(|p| g.gelu_loss(&ctx, p), &g.x, FD_STEP)?, FD_ATOL, FD_RTOL)
}

/// In bf16, GELU's backward is the f32 one of the widened values, rounded once, on each device.
fn gelu_backward_in_bf16_is_the_f32_product_rounded_once(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let alloc = CachingAllocator::new(dev);
    let n = 4099;
    let widen = |v: Vec<f32>| v.into_iter().map(|x| half::bf16::from_f32(x).to_f32()).collect::<Vec<_>>();
    let (x, g) = (widen(lcg(n, 3).iter().map(|v| 8.0 * v).collect()), widen(lcg(n, 4)));
    let bf = |v: &[f32]| Tensor::from_f32(&alloc, &s, v, &[n], DType::BF16);
    let f = |v: &[f32]| Tensor::from_host(&alloc, &s, v, &[n]);
    let (d16, d32) = (Tensor::zeros(&alloc, &s, &[n], DType::BF16)?, Tensor::zeros(&alloc, &s, &[n], DType::F32)?);
    gelu::gelu_backward(&d16, &bf(&x)?, &bf(&g)?, &s)?;
    gelu::gelu_backward(&d32, &f(&x)?, &f(&g)?, &s)?;
    let want: Vec<u16> = d32.to_vec::<f32>(&s)?.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
    let got: Vec<u16> = d16.to_vec::<half::bf16>(&s)?.iter().map(|v| v.to_bits()).collect();
    ensure!(got == want, "bf16 GELU backward differs from the f32 one rounded");
    Ok(())
}

fn bias_gelu_gradients(dev: &Device) -> anyhow::Result<()> {
    if dev.kind() != DeviceKind::Sim {
        let cases = [(3, 8), (5, 700)];
        return cases.into_iter().try_for_each(|(n, c)| against_sim(dev, |d| Gelu::new(n, c).run_bias(d)));
    }
    let g = Gelu::new(3, 8);
    let got = g.run_bias(dev)?;
    let ctx = Ctx::new(dev)?;
    let dinp = numeric_grad(|p| g.bias_gelu_loss(&ctx, p, &g.bias), &g.x, FD_STEP)?;
    let dbias = numeric_grad(|p| g.bias_gelu_loss(&ctx, &g.x, p), &g.bias, FD_STEP)?;
    ensure_close("dinp", &got[1].1, &dinp, FD_ATOL, FD_RTOL)?;
    ensure_close("dbias", &got[2].1, &dbias, FD_ATOL, FD_RTOL)
}

/// The fused kernels against their composition. Both evaluate the same f32 expressions on the
/// same f32 values, so they agree to rounding (1e-6; the simulator is exact).
fn bias_gelu_matches_its_composition(dev: &Device) -> anyhow::Result<()> {
    let g = Gelu::new(4, 300);
    let (fused, slow) = (g.run_bias(dev)?, g.run_bias_slow(dev)?);
    for ((name, got), (_, want)) in fused.iter().zip(&slow) {
        ensure_close(name, got, &f64s(want), 1e-6, 1e-6)?;
    }
    Ok(())
}

// ---- all ops ----------------------------------------------------------------------------------

/// `dinp` and the parameter gradients after one call of a backward.
type Grads = (Vec<f32>, Vec<Vec<f32>>);

/// Parameter gradients `+=`, activation gradients `=`: a second call of `backward` doubles every
/// parameter gradient exactly (0 + g, then g + g) and rewrites the same `dinp`.
fn accumulates(op: &str, mut backward: impl FnMut() -> anyhow::Result<Grads>) -> anyhow::Result<()> {
    let ((dinp1, params1), (dinp2, params2)) = (backward()?, backward()?);
    ensure!(dinp1 == dinp2, "{op}: the second backward changed dinp");
    for (p1, p2) in params1.iter().zip(&params2) {
        ensure!(p1.iter().all(|v| *v != 0.0), "{op}: a parameter gradient has zeros");
        ensure!(p1.iter().map(|v| 2.0 * v).eq(p2.iter().copied()), "{op}: the second backward did not double it");
    }
    Ok(())
}

/// The LayerNorm backward's tensors (f32) with zero parameter gradients, for accumulation.
fn zeroed_ln_backward(ctx: &Ctx, ln: &Ln) -> anyhow::Result<([Tensor; 4], [Tensor; 6])> {
    let (outs, ins) = ln.backward_tensors(ctx)?;
    for g in &outs[1..] {
        g.zero(&ctx.s)?;
    }
    Ok((outs, ins))
}

/// Two backwards double the parameter gradients (dcolsum too); on CUDA, a wide grid (132 blocks,
/// 11 spans) whose second launch finds its ticket counters reset by the first.
fn parameter_gradients_accumulate(dev: &Device) -> anyhow::Result<()> {
    let ctx = Ctx::new(dev)?;
    let s = &ctx.s;
    let shape = if dev.kind() == DeviceKind::Sim { (3, 8) } else { (2500, 128) };
    let ln = Ln::new(shape.0, shape.1, DType::F32);
    let ws = LayerNormWorkspace::new(&ctx.alloc, s, ln.c)?;
    let (outs, ins) = zeroed_ln_backward(&ctx, &ln)?;
    accumulates("layernorm", || {
        Ln::backward(&ctx, &outs, &ins, Residual::AddAndSum, &ws)?;
        Ok((ctx.read(&outs[0])?, vec![ctx.read(&outs[1])?, ctx.read(&outs[2])?, ctx.read(&outs[3])?]))
    })?;
    let g = Gelu::new(3, 8);
    let (x, bias, dout) = (ctx.t(&g.x, &[3, 8])?, ctx.t(&g.bias, &[8])?, ctx.t(&g.dout, &[3, 8])?);
    let (dinp, dbias) = (ctx.uninit(&[3, 8])?, ctx.zeros(&[8])?);
    accumulates("bias_gelu", || {
        gelu::bias_gelu_backward(&dinp, &dbias, &x, &bias, &dout, s)?;
        Ok((dinp.to_vec(s)?, vec![dbias.to_vec(s)?]))
    })
}

/// A LayerNorm backward captured once and replayed three times: the parameter gradients are 3×
/// one eager launch's, bitwise (every replay starts from reset counters), and dinp is the eager one.
fn layernorm_backward_replays_in_a_graph(dev: &Device) -> anyhow::Result<()> {
    let ctx = Ctx::new(dev)?;
    let ln = Ln::new(300, 512, DType::F32);
    let ws = LayerNormWorkspace::new(&ctx.alloc, &ctx.s, ln.c)?;
    let (outs, ins) = zeroed_ln_backward(&ctx, &ln)?;
    Ln::backward(&ctx, &outs, &ins, Residual::AddAndSum, &ws)?;
    let eager: Vec<Vec<f32>> = outs.iter().map(|t| ctx.read(t)).collect::<graphed::Result<_>>()?;
    for g in &outs[1..] {
        g.zero(&ctx.s)?;
    }
    let capture = ctx.s.capture(CaptureMode::ThreadLocal)?;
    Ln::backward(&ctx, &outs, &ins, Residual::AddAndSum, &ws)?;
    let exec = capture.finish()?.instantiate()?;
    for _ in 0..3 {
        exec.launch(&ctx.s)?;
    }
    let replayed: Vec<Vec<f32>> = outs.iter().map(|t| ctx.read(t)).collect::<graphed::Result<_>>()?;
    ensure!(replayed[0] == eager[0], "the replayed dinp differs from the eager one");
    for (name, (got, once)) in ["dweight", "dbias", "dcolsum"].into_iter().zip(replayed[1..].iter().zip(&eager[1..])) {
        ensure!(
            got.iter().zip(once).all(|(g, o)| g.to_bits() == (3.0 * o).to_bits()),
            "{name}: 3 replays did not triple it"
        );
    }
    Ok(())
}

/// Two runs of every op give bitwise identical results (on CUDA: the fixed-order reductions), in
/// both element types.
fn two_runs_are_bitwise_identical(dev: &Device) -> anyhow::Result<()> {
    let big = dev.kind() != DeviceKind::Sim;
    let (g, ln_shape, sm_shape) =
        if big { (Gelu::new(5, 700), (2500, 128), (2, 1024)) } else { (Gelu::new(5, 70), (60, 70), (2, 30)) };
    for run in [&|| g.run(dev), &|| g.run_bias(dev)] as [&dyn Fn() -> anyhow::Result<Outputs>; 2] {
        ensure!(bits(&run()?) == bits(&run()?), "gelu: two runs differ");
    }
    for dtype in BOTH {
        let (ln, sm) = (Ln::new(ln_shape.0, ln_shape.1, dtype), Sm::new(sm_shape.0, sm_shape.1, dtype));
        let (a, b) = (ln.run(dev, Residual::AddAndSum)?, ln.run(dev, Residual::AddAndSum)?);
        ensure!(bits(&a) == bits(&b), "layernorm {dtype}: two runs differ");
        ensure!(bits(&sm.run(dev)?) == bits(&sm.run(dev)?), "softmax {dtype}: two runs differ");
        if big {
            // Several launches on one workspace, too: the grid and so the order are the same.
            let ctx = Ctx::new(dev)?;
            let ws = LayerNormWorkspace::new(&ctx.alloc, &ctx.s, ln.c)?;
            let mut runs = Vec::new();
            for _ in 0..2 {
                let (outs, ins) = ln.backward_tensors(&ctx)?;
                Ln::backward(&ctx, &outs, &ins, Residual::AddAndSum, &ws)?;
                runs.push(outs.iter().map(|t| ctx.read(t)).collect::<graphed::Result<Vec<_>>>()?);
            }
            ensure!(runs[0] == runs[1], "layernorm {dtype}: two launches on one workspace differ");
        }
    }
    Ok(())
}

/// Every launcher names itself in the `Error::Shape` of a wrong shape, before anything is launched.
fn bad_shapes_give_shape_errors(dev: &Device) -> anyhow::Result<()> {
    let ctx = Ctx::new(dev)?;
    let s = &ctx.s;
    let m = |shape: &[usize]| ctx.zeros(shape);
    let (x, x9, v3, v8, v9) = (m(&[3, 8])?, m(&[3, 9])?, m(&[3])?, m(&[8])?, m(&[9])?);
    let (sc, sc_other, not_square, one_d) = (m(&[1, 2, 4, 4])?, m(&[1, 2, 5, 5])?, m(&[1, 2, 4, 5])?, m(&[4])?);
    let (ws, ws9) = (LayerNormWorkspace::new(&ctx.alloc, s, 8)?, LayerNormWorkspace::new(&ctx.alloc, s, 9)?);
    let with = |grad, colsum| Some(ResidualGrad { grad, colsum });
    let lnb = |dinp, dw, dout, mean, res, ws| {
        layernorm::layernorm_backward(dinp, dw, &v8, dout, &x, &v8, mean, &v3, res, ws, s)
    };
    // (op, the argument that is wrong, the result)
    let calls: Vec<(&str, &str, graphed::Result<()>)> = vec![
        ("layernorm_forward", "weight", layernorm::layernorm_forward(&x, &v3, &v3, &x, &v9, &v8, 1e-5, s)),
        ("layernorm_forward", "inp (1-D)", layernorm::layernorm_forward(&v8, &v3, &v3, &v8, &v8, &v8, 1e-5, s)),
        ("layernorm_forward", "out", layernorm::layernorm_forward(&x9, &v3, &v3, &x, &v8, &v8, 1e-5, s)),
        ("layernorm_backward", "mean", lnb(&x, &v8, &x, &v8, None, &ws)),
        ("layernorm_backward", "dweight", lnb(&x, &v9, &x, &v3, None, &ws)),
        ("layernorm_backward", "dinp", lnb(&x9, &v8, &x, &v3, None, &ws)),
        ("layernorm_backward", "residual", lnb(&x, &v8, &x, &v3, with(&x9, None), &ws)),
        ("layernorm_backward", "dcolsum", lnb(&x, &v8, &x, &v3, with(&x, Some(&v9)), &ws)),
        ("layernorm_backward", "workspace", lnb(&x, &v8, &x, &v3, None, &ws9)),
        ("gelu_forward", "out", gelu::gelu_forward(&x9, &x, s)),
        ("gelu_backward", "dout", gelu::gelu_backward(&x, &x, &x9, s)),
        ("bias_gelu_forward", "bias", gelu::bias_gelu_forward(&x, &x, &v9, s)),
        ("bias_gelu_forward", "inp (1-D)", gelu::bias_gelu_forward(&v8, &v8, &v8, s)),
        ("bias_gelu_backward", "dbias", gelu::bias_gelu_backward(&x, &v9, &x, &v8, &x, s)),
        ("softmax_causal_forward", "scores (4×5)", softmax::softmax_causal_forward(&not_square, &not_square, s)),
        ("softmax_causal_forward", "scores (1-D)", softmax::softmax_causal_forward(&one_d, &one_d, s)),
        ("softmax_causal_forward", "probs", softmax::softmax_causal_forward(&sc_other, &sc, s)),
        ("softmax_causal_backward", "dprobs", softmax::softmax_causal_backward(&sc, &sc, &sc_other, s)),
    ];
    for (op, wrong, r) in calls {
        ensure!(matches!(&r, Err(Error::Shape { op: o, .. }) if *o == op), "{op} with a bad {wrong} gave {r:?}");
    }
    Ok(())
}

/// Wrong element types, strided tensors and sizes past the kernels' limits are refused before
/// anything runs: every output keeps its contents.
fn bad_types_and_layouts_are_refused_before_anything_runs(dev: &Device) -> anyhow::Result<()> {
    let ctx = Ctx::new(dev)?;
    let s = &ctx.s;
    let (n, c) = (3, 8);
    let sentinel = |shape: &[usize], dtype| ctx.typed(&vec![7.0; shape.iter().product()], shape, dtype);
    let (f, h) = (DType::F32, DType::BF16);
    let ln_args = |dtype| -> graphed::Result<[Tensor; 4]> {
        Ok([sentinel(&[n, c], dtype)?, sentinel(&[n, c], dtype)?, sentinel(&[c], dtype)?, sentinel(&[c], dtype)?])
    };
    // [out or dinp, inp or dout, weight, bias or dweight] of each type; statistics in f32.
    let ([of, xf, wf, bf], [oh, xh, wh, bh]) = (ln_args(f)?, ln_args(h)?);
    let (stat, stat_h) = (sentinel(&[n], f)?, sentinel(&[n], h)?);
    let x16 = Tensor::zeros(&ctx.alloc, s, &[n, c], DType::F16)?;
    let strided = sentinel(&[c, n], f)?.transpose(0, 1)?;
    let wide = Tensor::uninit(&ctx.alloc, s, &[0, 4097], f)?;
    let ws = LayerNormWorkspace::new(&ctx.alloc, s, c)?;
    let res = |grad, colsum| Some(ResidualGrad { grad, colsum });
    let fwd = |out, mean, inp, w| layernorm::layernorm_forward(out, mean, &stat, inp, w, &bf, 1e-5, s);
    let bwd =
        |dinp, dout, mean, r| layernorm::layernorm_backward(dinp, &wf, &bf, dout, &xf, &wf, mean, &stat, r, &ws, s);
    let sc = |dtype| sentinel(&[2, 4, 4], dtype);
    let (sf, sh, s16) = (sc(f)?, sc(h)?, Tensor::zeros(&ctx.alloc, s, &[2, 4, 4], DType::F16)?);
    let long = Tensor::uninit(&ctx.alloc, s, &[0, 8193, 8193], f)?;
    type Check = fn(&graphed::Error) -> bool;
    let unsupported_dtype: Check = |e| matches!(e, Error::UnsupportedDType { dtype: DType::F16, .. });
    let mismatch: Check = |e| matches!(e, Error::DTypeMismatch { .. });
    let strided_err: Check = |e| matches!(e, Error::NotContiguous { .. });
    let too_big: Check = |e| matches!(e, Error::Unsupported { .. });
    let calls: Vec<(&str, graphed::Result<()>, Check)> = vec![
        ("layernorm_forward of f16", fwd(&of, &stat, &x16, &wf), unsupported_dtype),
        ("layernorm_forward, bf16 inp, f32 weight", fwd(&oh, &stat, &xh, &wf), mismatch),
        (
            "layernorm_forward, bf16 mean",
            layernorm::layernorm_forward(&oh, &stat_h, &stat, &xh, &wh, &bh, 1e-5, s),
            mismatch,
        ),
        (
            "layernorm_forward, f32 out of bf16",
            layernorm::layernorm_forward(&of, &stat, &stat, &xh, &wh, &bh, 1e-5, s),
            mismatch,
        ),
        ("layernorm_forward, strided inp", fwd(&of, &stat, &strided, &wf), strided_err),
        (
            "layernorm_forward, 4097 features",
            layernorm::layernorm_forward(&wide, &stat, &stat, &wide, &wf, &bf, 1e-5, s),
            too_big,
        ),
        ("layernorm_backward of f16", bwd(&of, &x16, &stat, None), unsupported_dtype),
        ("layernorm_backward, bf16 dinp", bwd(&oh, &xf, &stat, None), mismatch),
        ("layernorm_backward, bf16 mean", bwd(&of, &xf, &stat_h, None), mismatch),
        ("layernorm_backward, bf16 residual", bwd(&of, &xf, &stat, res(&xh, None)), mismatch),
        ("layernorm_backward, bf16 dcolsum", bwd(&of, &xf, &stat, res(&xf, Some(&bh))), mismatch),
        ("layernorm_backward, strided dout", bwd(&of, &strided, &stat, None), strided_err),
        ("layernorm_backward, strided residual", bwd(&of, &xf, &stat, res(&strided, None)), strided_err),
        ("softmax_causal_forward of f16", softmax::softmax_causal_forward(&sf, &s16, s), unsupported_dtype),
        ("softmax_causal_forward, bf16 probs", softmax::softmax_causal_forward(&sh, &sf, s), mismatch),
        ("softmax_causal_forward, T = 8193", softmax::softmax_causal_forward(&long, &long, s), too_big),
        ("softmax_causal_backward of f16", softmax::softmax_causal_backward(&sf, &s16, &s16, s), unsupported_dtype),
        ("softmax_causal_backward, f32 dprobs", softmax::softmax_causal_backward(&sh, &sh, &sf, s), mismatch),
        (
            "softmax_causal_backward, strided",
            softmax::softmax_causal_backward(&sf, &sf.transpose(1, 2)?, &sf, s),
            strided_err,
        ),
    ];
    for (what, r, check) in calls {
        ensure!(r.as_ref().err().is_some_and(check), "{what} gave {r:?}");
    }
    ensure!(LayerNormWorkspace::new(&ctx.alloc, s, 4097).is_err(), "a workspace for 4097 features");
    for t in [&of, &oh, &wf, &bf, &stat, &sf, &sh] {
        ensure!(ctx.read(t)?.iter().all(|v| *v == 7.0), "a refused call changed an output");
    }
    Ok(())
}

crate::per_device!(
    gelu_backward_in_bf16_is_the_f32_product_rounded_once,
    layernorm_gradients,
    layernorm_matches_an_f64_reference,
    layernorm_backward_small_n_path,
    layernorm_gradients_into_views,
    gelu_gradients,
    bias_gelu_gradients,
    bias_gelu_matches_its_composition,
    softmax_gradients,
    softmax_matches_an_f64_reference,
    causal_mask_and_row_sums,
    parameter_gradients_accumulate,
    layernorm_backward_replays_in_a_graph,
    two_runs_are_bitwise_identical,
    bad_shapes_give_shape_errors,
    bad_types_and_layouts_are_refused_before_anything_runs,
);
