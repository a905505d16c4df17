//! LayerNorm, GELU and causal softmax: gradients, CUDA vs simulator, determinism, masking, shapes.

mod common;

use anyhow::ensure;
use common::{ensure_close, numeric_grad};
use graphed::device::DType;
use graphed::device::{Device, DeviceKind, Stream};
use graphed::memory::CachingAllocator;
use graphed::ops::{gelu, layernorm, softmax};
use graphed::tensor::Tensor;
use graphed::Error;

/// Named outputs of one run of an op's forward and backward, compared across devices and runs.
type Outputs = Vec<(&'static str, Vec<f32>)>;

/// Finite differences: step, and tolerance `atol + rtol·|numeric|`. The forward runs in f32 and
/// the loss Σ out⊙r is summed in f64; its rounding (about 1e-7 relative) over the 2·FD_STEP span,
/// plus the O(FD_STEP²) truncation error of central differences, gave errors up to 1.1e-5 on
/// these inputs; the tolerance leaves a margin of about ten.
const FD_STEP: f32 = 1e-2;
const FD_ATOL: f64 = 1e-4;
const FD_RTOL: f64 = 1e-3;

/// CUDA against the simulator: `|cuda − sim| ≤ 1e-5·(max |sim| over the output) + 1e-5·|sim|`.
/// The kernels compute the same formulas, but the CUDA reductions add in tree order, NVRTC fuses
/// multiply-adds, and `expf`/`tanhf` may differ from the host's by a few ulp; such errors scale
/// with the largest terms of a sum, hence the term relative to the output's maximum. An f32
/// emulation of the tree order at the larger shapes below used at most 2% of this tolerance.
const CUDA_TOL: f64 = 1e-5;

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

    fn uninit(&self, shape: &[usize]) -> graphed::Result<Tensor> {
        Tensor::uninit(&self.alloc, &self.s, shape, DType::F32)
    }

    fn zeros(&self, shape: &[usize]) -> graphed::Result<Tensor> {
        Tensor::zeros(&self.alloc, &self.s, shape, DType::F32)
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

/// The CUDA check of a gradient case: `run` on `dev` against `run` on a fresh simulator.
fn against_sim(dev: &Device, run: impl Fn(&Device) -> anyhow::Result<Outputs>) -> anyhow::Result<()> {
    let (got, want) = (run(dev)?, run(&Device::sim())?);
    for ((name, got), (_, want)) in got.iter().zip(&want) {
        let max = want.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        ensure_close(name, got, &f64s(want), CUDA_TOL * max, CUDA_TOL)?;
    }
    Ok(())
}

// ---- LayerNorm ------------------------------------------------------------------------------

struct Ln {
    n: usize,
    c: usize,
    x: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    dout: Vec<f32>,
}

impl Ln {
    fn new(n: usize, c: usize) -> Ln {
        let mut r = Lcg(1);
        let (x, w, b) = (r.vec(n * c, -2.0, 2.0), r.vec(c, 0.5, 1.5), r.vec(c, -0.5, 0.5));
        Ln { n, c, x, w, b, dout: r.vec(n * c, -1.0, 1.0) }
    }

    /// `[out, mean, rstd]` of the forward of `x` with parameters `w`, `b`.
    fn forward(&self, ctx: &Ctx, x: &[f32], w: &[f32], b: &[f32]) -> anyhow::Result<[Tensor; 4]> {
        let (n, c) = (self.n, self.c);
        let inp = ctx.t(x, &[n, c])?;
        let [out, mean, rstd] = [ctx.uninit(&[n, c])?, ctx.uninit(&[n])?, ctx.uninit(&[n])?];
        layernorm::layernorm_forward(&out, &mean, &rstd, &inp, &ctx.t(w, &[c])?, &ctx.t(b, &[c])?, 1e-5, &ctx.s)?;
        Ok([out, mean, rstd, inp])
    }

    /// Σ out⊙dout: its gradients are what the backward computes from `dout`.
    fn loss(&self, ctx: &Ctx, x: &[f32], w: &[f32], b: &[f32]) -> anyhow::Result<f64> {
        let [out, ..] = self.forward(ctx, x, w, b)?;
        Ok(dot(&out.to_vec(&ctx.s)?, &self.dout))
    }

    fn run(&self, dev: &Device) -> anyhow::Result<Outputs> {
        let (ctx, (n, c)) = (Ctx::new(dev)?, (self.n, self.c));
        let [out, mean, rstd, inp] = self.forward(&ctx, &self.x, &self.w, &self.b)?;
        let (dinp, dweight, dbias) = (ctx.uninit(&[n, c])?, ctx.zeros(&[c])?, ctx.zeros(&[c])?);
        let (dout, weight) = (ctx.t(&self.dout, &[n, c])?, ctx.t(&self.w, &[c])?);
        layernorm::layernorm_backward(&dinp, &dweight, &dbias, &dout, &inp, &weight, &mean, &rstd, &ctx.s)?;
        let s = &ctx.s;
        Ok(vec![
            ("out", out.to_vec(s)?),
            ("mean", mean.to_vec(s)?),
            ("rstd", rstd.to_vec(s)?),
            ("dinp", dinp.to_vec(s)?),
            ("dweight", dweight.to_vec(s)?),
            ("dbias", dbias.to_vec(s)?),
        ])
    }
}

fn layernorm_gradients(dev: &Device) -> anyhow::Result<()> {
    if dev.kind() != DeviceKind::Sim {
        // C = 700 makes each of the 256 threads of a row loop over several columns.
        return [(3, 8), (5, 700)].into_iter().try_for_each(|(n, c)| against_sim(dev, |d| Ln::new(n, c).run(d)));
    }
    let ln = Ln::new(3, 8);
    let got = ln.run(dev)?;
    let ctx = Ctx::new(dev)?;
    let (x, w, b) = (&ln.x, &ln.w, &ln.b);
    ensure_close("dinp", &got[3].1, &numeric_grad(|p| ln.loss(&ctx, p, w, b), x, FD_STEP)?, FD_ATOL, FD_RTOL)?;
    ensure_close("dweight", &got[4].1, &numeric_grad(|p| ln.loss(&ctx, x, p, b), w, FD_STEP)?, FD_ATOL, FD_RTOL)?;
    ensure_close("dbias", &got[5].1, &numeric_grad(|p| ln.loss(&ctx, x, w, p), b, FD_STEP)?, FD_ATOL, FD_RTOL)
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

// ---- causal softmax ---------------------------------------------------------------------------

const SCALE: f32 = 0.5;

struct Sm {
    shape: [usize; 4],
    scores: Vec<f32>,
    dprobs: Vec<f32>,
}

impl Sm {
    fn new(b: usize, h: usize, t: usize) -> Sm {
        let mut r = Lcg(3);
        let n = b * h * t * t;
        Sm { shape: [b, h, t, t], scores: r.vec(n, -4.0, 4.0), dprobs: r.vec(n, -1.0, 1.0) }
    }

    fn t(&self) -> usize {
        self.shape[3]
    }

    fn forward(&self, ctx: &Ctx, scores: &[f32]) -> anyhow::Result<Tensor> {
        let probs = ctx.uninit(&self.shape)?;
        softmax::softmax_causal_forward(&probs, &ctx.t(scores, &self.shape)?, SCALE, &ctx.s)?;
        Ok(probs)
    }

    fn loss(&self, ctx: &Ctx, scores: &[f32]) -> anyhow::Result<f64> {
        Ok(dot(&self.forward(ctx, scores)?.to_vec(&ctx.s)?, &self.dprobs))
    }

    /// `[probs, dscores]` of `scores` and `dprobs`.
    fn run_with(&self, dev: &Device, scores: &[f32], dprobs: &[f32]) -> anyhow::Result<Outputs> {
        let ctx = Ctx::new(dev)?;
        let (probs, dscores) = (self.forward(&ctx, scores)?, ctx.uninit(&self.shape)?);
        softmax::softmax_causal_backward(&dscores, &probs, &ctx.t(dprobs, &self.shape)?, SCALE, &ctx.s)?;
        Ok(vec![("probs", probs.to_vec(&ctx.s)?), ("dscores", dscores.to_vec(&ctx.s)?)])
    }

    fn run(&self, dev: &Device) -> anyhow::Result<Outputs> {
        self.run_with(dev, &self.scores, &self.dprobs)
    }

    /// `v` with every element above the diagonal replaced by `fill`.
    fn above_diagonal(&self, v: &[f32], fill: f32) -> Vec<f32> {
        let t = self.t();
        v.iter().enumerate().map(|(k, &x)| if k % t > (k / t) % t { fill } else { x }).collect()
    }
}

fn softmax_gradients(dev: &Device) -> anyhow::Result<()> {
    if dev.kind() != DeviceKind::Sim {
        // T = 300 makes each of the 256 threads of a late row loop over several keys.
        let cases = [(1, 2, 5), (2, 1, 300)];
        return cases.into_iter().try_for_each(|(b, h, t)| against_sim(dev, |d| Sm::new(b, h, t).run(d)));
    }
    let sm = Sm::new(1, 2, 5);
    let got = sm.run(dev)?;
    let ctx = Ctx::new(dev)?;
    ensure_close("dscores", &got[1].1, &numeric_grad(|p| sm.loss(&ctx, p), &sm.scores, FD_STEP)?, FD_ATOL, FD_RTOL)
}

/// Probabilities above the diagonal are exactly 0 and rows sum to 1; masked inputs (even NaN) are
/// never read; scores far beyond exp's range do not overflow.
fn causal_mask_and_row_sums(dev: &Device) -> anyhow::Result<()> {
    let sm = Sm::new(1, 2, 300);
    let t = sm.t();
    let out = sm.run(dev)?;
    let (probs, dscores) = (&out[0].1, &out[1].1);
    ensure!(sm.above_diagonal(probs, 0.0) == *probs, "probabilities above the diagonal are not 0");
    ensure!(sm.above_diagonal(dscores, 0.0) == *dscores, "score gradients above the diagonal are not 0");
    for (r, row) in probs.chunks_exact(t).enumerate() {
        let sum: f64 = row.iter().map(|p| f64::from(*p)).sum();
        ensure!((sum - 1.0).abs() < 1e-5, "row {r} sums to {sum}");
    }

    let masked_nan =
        sm.run_with(dev, &sm.above_diagonal(&sm.scores, f32::NAN), &sm.above_diagonal(&sm.dprobs, f32::NAN))?;
    ensure!(bits(&masked_nan) == bits(&out), "values above the diagonal changed the result");

    let huge: Vec<f32> = sm.scores.iter().map(|s| s + 1e4).collect();
    let shifted = sm.run_with(dev, &huge, &sm.dprobs)?;
    for (r, row) in shifted[0].1.chunks_exact(t).enumerate() {
        let sum: f64 = row.iter().map(|p| f64::from(*p)).sum();
        ensure!(
            row.iter().all(|p| p.is_finite()) && (sum - 1.0).abs() < 1e-5,
            "row {r} of shifted scores sums to {sum}; it starts {:?}",
            &row[..row.len().min(4)]
        );
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

fn parameter_gradients_accumulate(dev: &Device) -> anyhow::Result<()> {
    let ctx = Ctx::new(dev)?;
    let s = &ctx.s;
    let ln = Ln::new(3, 8);
    let [_, mean, rstd, inp] = ln.forward(&ctx, &ln.x, &ln.w, &ln.b)?;
    let (dout, weight) = (ctx.t(&ln.dout, &[3, 8])?, ctx.t(&ln.w, &[8])?);
    let (dinp, dweight, dbias) = (ctx.uninit(&[3, 8])?, ctx.zeros(&[8])?, ctx.zeros(&[8])?);
    accumulates("layernorm", || {
        layernorm::layernorm_backward(&dinp, &dweight, &dbias, &dout, &inp, &weight, &mean, &rstd, s)?;
        Ok((dinp.to_vec(s)?, vec![dweight.to_vec(s)?, dbias.to_vec(s)?]))
    })?;
    let g = Gelu::new(3, 8);
    let (x, bias, dout) = (ctx.t(&g.x, &[3, 8])?, ctx.t(&g.bias, &[8])?, ctx.t(&g.dout, &[3, 8])?);
    let (dinp, dbias) = (ctx.uninit(&[3, 8])?, ctx.zeros(&[8])?);
    accumulates("bias_gelu", || {
        gelu::bias_gelu_backward(&dinp, &dbias, &x, &bias, &dout, s)?;
        Ok((dinp.to_vec(s)?, vec![dbias.to_vec(s)?]))
    })
}

/// Two runs of every op give bitwise identical results (on CUDA: the fixed-order reductions).
fn two_runs_are_bitwise_identical(dev: &Device) -> anyhow::Result<()> {
    let (ln, g, sm) = (Ln::new(5, 700), Gelu::new(5, 700), Sm::new(2, 1, 300));
    let runs: [&dyn Fn() -> anyhow::Result<Outputs>; 4] =
        [&|| ln.run(dev), &|| g.run(dev), &|| g.run_bias(dev), &|| sm.run(dev)];
    for (op, run) in ["layernorm", "gelu", "bias_gelu", "softmax"].into_iter().zip(runs) {
        ensure!(bits(&run()?) == bits(&run()?), "{op}: two runs differ");
    }
    Ok(())
}

/// Every launcher names itself in the `Error::Shape` of a wrong shape, before anything is launched;
/// a strided tensor is `Error::NotContiguous`.
fn bad_shapes_give_shape_errors(dev: &Device) -> anyhow::Result<()> {
    let ctx = Ctx::new(dev)?;
    let s = &ctx.s;
    let m = |shape: &[usize]| ctx.zeros(shape);
    let (x, x9, v3, v8, v9) = (m(&[3, 8])?, m(&[3, 9])?, m(&[3])?, m(&[8])?, m(&[9])?);
    let (sc, sc_other, not_square, three_d) = (m(&[1, 2, 4, 4])?, m(&[1, 2, 5, 5])?, m(&[1, 2, 4, 5])?, m(&[2, 4, 4])?);
    // (op, the argument that is wrong, the result)
    let calls: Vec<(&str, &str, graphed::Result<()>)> = vec![
        ("layernorm_forward", "weight", layernorm::layernorm_forward(&x, &v3, &v3, &x, &v9, &v8, 1e-5, s)),
        ("layernorm_forward", "inp (1-D)", layernorm::layernorm_forward(&v8, &v3, &v3, &v8, &v8, &v8, 1e-5, s)),
        ("layernorm_forward", "out", layernorm::layernorm_forward(&x9, &v3, &v3, &x, &v8, &v8, 1e-5, s)),
        ("layernorm_backward", "mean", layernorm::layernorm_backward(&x, &v8, &v8, &x, &x, &v8, &v8, &v3, s)),
        ("layernorm_backward", "dweight", layernorm::layernorm_backward(&x, &v9, &v8, &x, &x, &v8, &v3, &v3, s)),
        ("gelu_forward", "out", gelu::gelu_forward(&x9, &x, s)),
        ("gelu_backward", "dout", gelu::gelu_backward(&x, &x, &x9, s)),
        ("bias_gelu_forward", "bias", gelu::bias_gelu_forward(&x, &x, &v9, s)),
        ("bias_gelu_forward", "inp (1-D)", gelu::bias_gelu_forward(&v8, &v8, &v8, s)),
        ("bias_gelu_backward", "dbias", gelu::bias_gelu_backward(&x, &v9, &x, &v8, &x, s)),
        ("softmax_causal_forward", "scores (4×5)", softmax::softmax_causal_forward(&not_square, &not_square, SCALE, s)),
        ("softmax_causal_forward", "scores (3-D)", softmax::softmax_causal_forward(&three_d, &three_d, SCALE, s)),
        ("softmax_causal_forward", "probs", softmax::softmax_causal_forward(&sc_other, &sc, SCALE, s)),
        ("softmax_causal_backward", "dprobs", softmax::softmax_causal_backward(&sc, &sc, &sc_other, SCALE, s)),
    ];
    for (op, wrong, r) in calls {
        ensure!(matches!(&r, Err(Error::Shape { op: o, .. }) if *o == op), "{op} with a bad {wrong} gave {r:?}");
    }
    let strided = x.transpose(0, 1)?;
    let r = gelu::gelu_forward(&m(&[8, 3])?, &strided, s);
    ensure!(matches!(r, Err(Error::NotContiguous { op: "gelu_forward", .. })), "a strided input gave {r:?}");
    Ok(())
}

crate::per_device!(
    layernorm_gradients,
    gelu_gradients,
    bias_gelu_gradients,
    bias_gelu_matches_its_composition,
    softmax_gradients,
    causal_mask_and_row_sums,
    parameter_gradients_accumulate,
    two_runs_are_bitwise_identical,
    bad_shapes_give_shape_errors,
);
