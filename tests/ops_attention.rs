//! Fused causal attention: forward and backward against an f64 reference, gradients against
//! finite differences, dropout drawing the unfused path's numbers, determinism, refusals; the
//! backend setting, and cuDNN's backend on the GPU (tests named `cudnn`).

mod common;

use anyhow::ensure;
use common::{ensure_close, lcg, numeric_grad};
use graphed::device::{DType, Device, Stream};
use graphed::memory::CachingAllocator;
use graphed::ops::attention::{self, AttentionBackend, AttentionDropout, AttentionRun, ForwardSaved};
use graphed::ops::rng;
use graphed::tensor::Tensor;
use graphed::Error;
use half::bf16;

/// f32 against the f64 reference: `|got − want| ≤ F32_TOL·(Σ |terms| of the element)`. Each
/// output element is a sum of products; f32 rounding (and `expf`, a few ulp) bounds its error by a
/// small multiple of 2^-24 times the sum of the terms' magnitudes, whatever order the tiles add
/// them in. 1e-5 is about 170 ulp of that sum: the kernels' error (in terms) is a few tens.
const F32_TOL: f64 = 1e-5;

/// bf16 against the f64 reference, in the same form. The inputs are exactly bf16; the kernels
/// round the probabilities and the score gradients to bf16 (2^-9 relative) before the tensor-core
/// products, and the outputs once: four such roundings on a path, 2^-7 of the terms' magnitude,
/// plus a factor of two of margin.
const BF16_TOL: f64 = 1.0 / 64.0;

/// The shape of one case: `pairs` (batch element, head) pairs of `seq` tokens of width `hd`.
#[derive(Clone, Copy, Debug)]
struct Case {
    pairs: usize,
    seq: usize,
    hd: usize,
    dtype: DType,
    p: f32,
}

/// Dropout's coordinates in the tests.
const SEED: u32 = 77;
const SITE: u32 = 5;
const STEP: u64 = 3;

/// The f64 reference of a case: outputs and, per element, the magnitude of its terms.
struct Reference {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// Σ |terms| of each element of out, dq, dk, dv.
    mag: [Vec<f64>; 4],
}

impl Case {
    fn shape(&self) -> [usize; 3] {
        [self.pairs, self.seq, self.hd]
    }

    fn elems(&self) -> usize {
        self.pairs * self.seq * self.hd
    }

    /// The inputs q, k, v and dout, rounded to the case's type. Scores spread over a few units
    /// so that the softmax is neither flat nor one-hot.
    fn inputs(&self, seed: u64) -> [Vec<f32>; 4] {
        let round = |v: Vec<f32>| -> Vec<f32> {
            match self.dtype {
                DType::BF16 => v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect(),
                _ => v,
            }
        };
        let n = self.elems();
        [
            round(lcg(n, seed).into_iter().map(|x| 2.0 * x).collect()),
            round(lcg(n, seed + 1).into_iter().map(|x| 2.0 * x).collect()),
            round(lcg(n, seed + 2)),
            round(lcg(n, seed + 3)),
        ]
    }

    /// The factor dropout applies to probability `(pair, i, j)`, from the host model of the
    /// kernels' numbers: element `(pair·T + i)·T + j` of a `(pairs, T, T)` tensor.
    fn keep(&self, pair: usize, i: usize, j: usize) -> f64 {
        if self.p == 0.0 {
            return 1.0;
        }
        let threshold = (f64::from(self.p) * 4_294_967_296.0).round() as u32;
        let n = ((pair * self.seq + i) * self.seq + j) as u64;
        if rng::random_u32(SEED, SITE, STEP, n) >= threshold {
            f64::from(1.0 / (1.0 - self.p))
        } else {
            0.0
        }
    }

    fn reference(&self, [q, k, v, g]: &[Vec<f32>; 4]) -> Reference {
        let (t, hd) = (self.seq, self.hd);
        let scale = 1.0 / (hd as f64).sqrt();
        let row = |x: &[f32], pair: usize, i: usize| -> Vec<f64> {
            x[(pair * t + i) * hd..(pair * t + i + 1) * hd].iter().map(|&x| f64::from(x)).collect()
        };
        let dot = |a: &[f64], b: &[f64]| -> f64 { a.iter().zip(b).map(|(a, b)| a * b).sum() };
        let n = self.elems();
        let mut r = Reference {
            out: vec![0.0; n],
            lse: vec![0.0; self.pairs * t],
            dq: vec![0.0; n],
            dk: vec![0.0; n],
            dv: vec![0.0; n],
            mag: std::array::from_fn(|_| vec![0.0; n]),
        };
        for pair in 0..self.pairs {
            for i in 0..t {
                let (qi, gi) = (row(q, pair, i), row(g, pair, i));
                let s: Vec<f64> = (0..=i).map(|j| scale * dot(&qi, &row(k, pair, j))).collect();
                let m = s.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
                let lse = m + s.iter().map(|s| (s - m).exp()).sum::<f64>().ln();
                r.lse[pair * t + i] = lse;
                let p: Vec<f64> = s.iter().map(|s| (s - lse).exp()).collect();
                let kept: Vec<f64> = (0..=i).map(|j| p[j] * self.keep(pair, i, j)).collect();
                let at = (pair * t + i) * hd;
                for (j, w) in kept.iter().enumerate() {
                    let vj = row(v, pair, j);
                    for (d, &v) in vj.iter().enumerate().take(hd) {
                        r.out[at + d] += w * v;
                        r.mag[0][at + d] += (w * v).abs();
                    }
                }
                let out_i = &r.out[at..at + hd];
                let delta = dot(&gi, out_i);
                let delta_mag: f64 = gi.iter().zip(out_i).map(|(g, o)| (g * o).abs()).sum();
                for j in 0..=i {
                    let (kj, vj) = (row(k, pair, j), row(v, pair, j));
                    let dp = self.keep(pair, i, j) * dot(&gi, &vj);
                    let dp_mag = self.keep(pair, i, j) * gi.iter().zip(&vj).map(|(g, v)| (g * v).abs()).sum::<f64>();
                    let ds = p[j] * (dp - delta);
                    let ds_mag = p[j] * (dp_mag + delta_mag);
                    let bt = (pair * t + j) * hd;
                    for d in 0..hd {
                        r.dq[at + d] += scale * ds * kj[d];
                        r.mag[1][at + d] += scale * ds_mag * kj[d].abs();
                        r.dk[bt + d] += scale * ds * qi[d];
                        r.mag[2][bt + d] += scale * ds_mag * qi[d].abs();
                        r.dv[bt + d] += kept[j] * gi[d];
                        r.mag[3][bt + d] += (kept[j] * gi[d]).abs();
                    }
                }
            }
        }
        r
    }
}

/// A stream, a poisoning allocator (an output element a kernel fails to write stays NaN) and
/// the attention backend the runs ask for.
struct Ctx {
    s: Stream,
    alloc: CachingAllocator,
    backend: AttentionBackend,
    /// The limit on cuDNN's backward scratch, if not the default.
    scratch_limit: Option<usize>,
}

/// What one run of the op on a device gives: out, lse, dq, dk, dv (bf16 widened exactly).
type Run = [Vec<f32>; 5];

impl Ctx {
    fn new(dev: &Device) -> anyhow::Result<Ctx> {
        Ctx::on(dev, AttentionBackend::Auto)
    }

    fn on(dev: &Device, backend: AttentionBackend) -> anyhow::Result<Ctx> {
        Ok(Ctx { s: dev.stream()?, alloc: CachingAllocator::with_poison(dev), backend, scratch_limit: None })
    }

    fn attn(&self) -> AttentionRun<'_> {
        AttentionRun { scratch_limit: self.scratch_limit, ..AttentionRun::new(self.backend, &self.alloc) }
    }

    fn tensor(&self, data: &[f32], shape: &[usize], dtype: DType) -> graphed::Result<Tensor> {
        Tensor::from_f32(&self.alloc, &self.s, data, shape, dtype)
    }

    fn read(&self, t: &Tensor) -> graphed::Result<Vec<f32>> {
        t.to_f32_vec(&self.s)
    }

    fn step(&self) -> graphed::Result<Tensor> {
        let step = Tensor::zeros(&self.alloc, &self.s, &[1], DType::U64)?;
        rng::step_write(&step, STEP, &self.s)?;
        Ok(step)
    }

    /// The forward and backward of `case` on `inputs`.
    fn run(&self, case: Case, inputs: &[Vec<f32>; 4]) -> anyhow::Result<Run> {
        let o = self.operands(case, inputs)?;
        self.compute(&o, case)?;
        self.results(&o)
    }

    /// A case's inputs on the device, its outputs allocated.
    fn operands(&self, case: Case, inputs: &[Vec<f32>; 4]) -> anyhow::Result<Operands> {
        let shape = case.shape();
        let [q, k, v, g] = inputs.each_ref().map(|x| self.tensor(x, &shape, case.dtype));
        let rows = [case.pairs, case.seq];
        let grad = || Tensor::uninit(&self.alloc, &self.s, &shape, case.dtype);
        let per_row = || Tensor::uninit(&self.alloc, &self.s, &rows, DType::F32);
        Ok(Operands {
            qkv: [q?, k?, v?],
            g: g?,
            out: grad()?,
            lse: per_row()?,
            delta: per_row()?,
            grads: [grad()?, grad()?, grad()?],
            step: self.step()?,
        })
    }

    /// The forward, then the backward; what ran each.
    fn compute(&self, o: &Operands, case: Case) -> graphed::Result<[AttentionBackend; 2]> {
        let [q, k, v] = &o.qkv;
        let [dq, dk, dv] = &o.grads;
        let dropout = Some(AttentionDropout { p: case.p, seed: SEED, site: SITE, step: &o.step });
        let forward = attention::attention_forward(&o.out, &o.lse, (q, k, v), dropout, self.attn(), &self.s)?;
        let saved = ForwardSaved { q, k, v, out: &o.out, lse: &o.lse };
        let backward =
            attention::attention_backward((dq, dk, dv), &o.g, saved, &o.delta, dropout, self.attn(), &self.s)?;
        Ok([forward, backward])
    }

    fn results(&self, o: &Operands) -> anyhow::Result<Run> {
        let [dq, dk, dv] = &o.grads;
        Ok([self.read(&o.out)?, self.read(&o.lse)?, self.read(dq)?, self.read(dk)?, self.read(dv)?])
    }
}

/// One run's tensors: inputs q, k, v and the output gradient, outputs, scratch, step counter.
struct Operands {
    qkv: [Tensor; 3],
    g: Tensor,
    out: Tensor,
    lse: Tensor,
    delta: Tensor,
    grads: [Tensor; 3],
    step: Tensor,
}

impl Ctx {
    /// [`Ctx::run`] with every operand a `(B, H, T, hd)` view of `(B·T, 4C)` rows, as a layer
    /// keeps them: q, k and v in parts 0 to 2 of one matrix, their gradients likewise in another,
    /// out and dout in part 0 of matrices of their own; every element outside the views is 7.
    /// Returns the run and whether every element outside the written views is still 7.
    fn run_rows(&self, case: Case, batch: usize, inputs: &[Vec<f32>; 4]) -> anyhow::Result<(Run, bool)> {
        let (t, hd, heads) = (case.seq, case.hd, case.pairs / batch);
        let c = heads * hd;
        let shape = [batch * t, 4 * c];
        let rows_of = |parts: &[&Vec<f32>]| {
            let mut m = vec![7.0f32; batch * t * 4 * c];
            for (j, x) in parts.iter().enumerate() {
                for (pair, rows) in x.chunks_exact(t * hd).enumerate() {
                    let (b, h) = (pair / heads, pair % heads);
                    for (i, row) in rows.chunks_exact(hd).enumerate() {
                        let at = (b * t + i) * 4 * c + j * c + h * hd;
                        m[at..at + hd].copy_from_slice(row);
                    }
                }
            }
            m
        };
        let view = |m: &Tensor, j: usize| m.reshape(&[batch, t, 4, heads, hd])?.select(2, j)?.transpose(1, 2);
        let qkv = self.tensor(&rows_of(&[&inputs[0], &inputs[1], &inputs[2]]), &shape, case.dtype)?;
        let g_rows = self.tensor(&rows_of(&[&inputs[3]]), &shape, case.dtype)?;
        let sevens = vec![7.0f32; batch * t * 4 * c];
        let (out_rows, grad_rows) =
            (self.tensor(&sevens, &shape, case.dtype)?, self.tensor(&sevens, &shape, case.dtype)?);
        let (q, k, v, g) = (view(&qkv, 0)?, view(&qkv, 1)?, view(&qkv, 2)?, view(&g_rows, 0)?);
        let (out, dq, dk, dv) = (view(&out_rows, 0)?, view(&grad_rows, 0)?, view(&grad_rows, 1)?, view(&grad_rows, 2)?);
        let step = self.step()?;
        let dropout = Some(AttentionDropout { p: case.p, seed: SEED, site: SITE, step: &step });
        let per_row = [batch, heads, t];
        let lse = Tensor::uninit(&self.alloc, &self.s, &per_row, DType::F32)?;
        let delta = Tensor::uninit(&self.alloc, &self.s, &per_row, DType::F32)?;
        attention::attention_forward(&out, &lse, (&q, &k, &v), dropout, self.attn(), &self.s)?;
        let saved = ForwardSaved { q: &q, k: &k, v: &v, out: &out, lse: &lse };
        attention::attention_backward((&dq, &dk, &dv), &g, saved, &delta, dropout, self.attn(), &self.s)?;
        let run = [self.read(&out)?, self.read(&lse)?, self.read(&dq)?, self.read(&dk)?, self.read(&dv)?];
        let (outs, grads) = (self.read(&out_rows)?, self.read(&grad_rows)?);
        let untouched = (0..batch * t).all(|r| {
            let row = |m: &[f32], from: usize| m[r * 4 * c + from..(r + 1) * 4 * c].iter().all(|x| *x == 7.0);
            row(&outs, c) && row(&grads, 3 * c)
        });
        Ok((run, untouched))
    }
}

/// Fails unless every element is within `tol` of its terms' magnitude (plus the output's
/// rounding to bf16, for bf16).
fn ensure_within(what: &str, case: Case, got: &[f32], want: &[f64], mag: &[f64], tol: f64) -> anyhow::Result<()> {
    ensure!(got.len() == want.len(), "{what}: {} values, expected {}", got.len(), want.len());
    let ulp = if case.dtype == DType::BF16 { 1.0 / 256.0 } else { 0.0 };
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (f64::from(*g) - w).abs();
        ensure!(err <= tol * m + ulp * w.abs() + 1e-30, "{case:?} {what}[{i}]: {g} vs {w} (terms {m:.3e})");
    }
    Ok(())
}

fn check_case(dev: &Device, case: Case) -> anyhow::Result<()> {
    check_case_on(dev, AttentionBackend::Auto, case)
}

/// [`check_case`] with the runs asking for `backend`.
fn check_case_on(dev: &Device, backend: AttentionBackend, case: Case) -> anyhow::Result<()> {
    let inputs = case.inputs(case.seq as u64 * 31 + case.hd as u64);
    let r = case.reference(&inputs);
    check_run(&format!("{case:?} on {backend}"), case, &Ctx::on(dev, backend)?.run(case, &inputs)?, &r)
}

/// Checks one run against the reference; prints each output's worst error relative to its
/// terms (what the tolerance bounds) to stderr, so a failing GPU run says how far off it was.
fn check_run(what: &str, case: Case, [out, lse, dq, dk, dv]: &Run, r: &Reference) -> anyhow::Result<()> {
    let tol = if case.dtype == DType::BF16 { BF16_TOL } else { F32_TOL };
    // The log-sum-exp is f32 in both types; its terms are O(1) numbers of the scores' size.
    let lse_mag: Vec<f64> = r.lse.iter().map(|l| 1.0 + l.abs()).collect();
    let worst = |got: &[f32], want: &[f64], mag: &[f64]| {
        got.iter().zip(want).zip(mag).map(|((g, w), m)| (f64::from(*g) - w).abs() / (m + 1e-30)).fold(0.0, f64::max)
    };
    eprintln!(
        "{what}: worst |error| / terms: out {:.2e}, lse {:.2e}, dq {:.2e}, dk {:.2e}, dv {:.2e} (tolerance {tol:.2e})",
        worst(out, &r.out, &r.mag[0]),
        worst(lse, &r.lse, &lse_mag),
        worst(dq, &r.dq, &r.mag[1]),
        worst(dk, &r.dk, &r.mag[2]),
        worst(dv, &r.dv, &r.mag[3]),
    );
    ensure_within("out", case, out, &r.out, &r.mag[0], tol)?;
    ensure_within("lse", Case { dtype: DType::F32, ..case }, lse, &r.lse, &lse_mag, F32_TOL)?;
    ensure_within("dq", case, dq, &r.dq, &r.mag[1], tol)?;
    ensure_within("dk", case, dk, &r.dk, &r.mag[2], tol)?;
    ensure_within("dv", case, dv, &r.dv, &r.mag[3], tol)
}

/// Every width and type, on sequences of one token, of less than a tile, and across tile
/// boundaries (tiles are 64 or 128 rows on CUDA), with and without dropout.
fn attention_matches_an_f64_reference(dev: &Device) -> anyhow::Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        for hd in attention::HEAD_DIMS {
            for (pairs, seq, p) in [(3, 1, 0.0), (2, 67, 0.0), (1, 130, 0.25)] {
                check_case(dev, Case { pairs, seq, hd, dtype, p })?;
            }
        }
    }
    Ok(())
}

/// Long sequences on the GPU only (the simulator's O(T²) loops would take minutes): every tile
/// of a 1000-token sequence, in both types.
fn attention_matches_the_reference_on_long_sequences(dev: &Device) -> anyhow::Result<()> {
    if dev.kind() == graphed::device::DeviceKind::Sim {
        return Ok(());
    }
    for dtype in [DType::F32, DType::BF16] {
        check_case(dev, Case { pairs: 2, seq: 1000, hd: 64, dtype, p: 0.1 })?;
    }
    Ok(())
}

/// The f32 gradients against central differences of the device's own forward: the loss
/// Σ out ⊙ g in f64, each input element moved by ±`STEP`.
fn attention_gradients_match_finite_differences(dev: &Device) -> anyhow::Result<()> {
    const STEP: f32 = 1e-2;
    for p in [0.0, 0.3] {
        let case = Case { pairs: 2, seq: 5, hd: 32, dtype: DType::F32, p };
        let inputs = case.inputs(9);
        let ctx = Ctx::new(dev)?;
        let [_, _, dq, dk, dv] = ctx.run(case, &inputs)?;
        for (which, grad) in [(0, dq), (1, dk), (2, dv)] {
            let loss = |x: &[f32]| -> anyhow::Result<f64> {
                let mut moved = inputs.clone();
                moved[which] = x.to_vec();
                let out = ctx.run(case, &moved)?[0].clone();
                Ok(out.iter().zip(&inputs[3]).map(|(o, g)| f64::from(*o) * f64::from(*g)).sum())
            };
            let numeric = numeric_grad(loss, &inputs[which], STEP)?;
            // f32 forward, f64 loss: rounding over the 2·STEP span plus the O(STEP²)
            // truncation of central differences stays below 1e-4 absolute here.
            ensure_close(&format!("p = {p}, gradient {which}"), &grad, &numeric, 2e-4, 2e-3)?;
        }
    }
    Ok(())
}

/// Two runs on one device are bitwise equal (no atomics: graphed and eager runs compare
/// bitwise), and a different step draws a different dropout mask.
fn attention_is_deterministic(dev: &Device) -> anyhow::Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        let case = Case { pairs: 2, seq: 150, hd: 64, dtype, p: 0.2 };
        let inputs = case.inputs(4);
        let ctx = Ctx::new(dev)?;
        let bits = |r: Run| r.map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>());
        ensure!(bits(ctx.run(case, &inputs)?) == bits(ctx.run(case, &inputs)?), "{dtype}: two runs differ");
    }
    Ok(())
}

/// Operands as views of the rows a layer keeps them in (Note [Attention operand layouts]) give
/// the same bits as contiguous heads, on several batch elements and heads and across tiles, and
/// nothing outside the views is written.
fn attention_reads_and_writes_row_layouts(dev: &Device) -> anyhow::Result<()> {
    let batch = 2;
    for dtype in [DType::F32, DType::BF16] {
        let case = Case { pairs: batch * 3, seq: 150, hd: 64, dtype, p: 0.2 };
        let inputs = case.inputs(9);
        let ctx = Ctx::new(dev)?;
        let want = ctx.run(case, &inputs)?;
        let (got, untouched) = ctx.run_rows(case, batch, &inputs)?;
        for (name, (g, w)) in ["out", "lse", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let same = g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
            ensure!(same, "{dtype}: {name} from row views differs from contiguous heads");
        }
        ensure!(untouched, "{dtype}: the kernels wrote outside their views");
    }
    Ok(())
}

/// Refusals happen before anything is enqueued and leave the outputs untouched.
fn attention_refuses_bad_calls(dev: &Device) -> anyhow::Result<()> {
    let ctx = Ctx::new(dev)?;
    let s = &ctx.s;
    let t = |shape: &[usize], dtype| ctx.tensor(&vec![0.5; shape.iter().product()], shape, dtype);
    let (q, q48, short) = (t(&[2, 4, 32], DType::F32)?, t(&[2, 4, 48], DType::F32)?, t(&[2, 3, 32], DType::F32)?);
    let (qb, lse, lse_bad) = (t(&[2, 4, 32], DType::BF16)?, t(&[2, 4], DType::F32)?, t(&[2, 3], DType::F32)?);
    let (one_d, q16) = (t(&[32], DType::F32)?, t(&[2, 4, 32], DType::F16)?);
    let out = t(&[2, 4, 32], DType::F32)?;
    let step = ctx.step()?;
    let half = Some(AttentionDropout { p: 1.0, seed: 0, site: 0, step: &step });
    let fwd = |out: &Tensor, lse: &Tensor, q: &Tensor, k: &Tensor, d| {
        attention::attention_forward(out, lse, (q, k, q), d, ctx.attn(), s)
    };
    type Refusal<'a> = (&'a str, graphed::Result<AttentionBackend>, fn(&Error) -> bool);
    let (q4, lse4) = (t(&[1, 2, 4, 32], DType::F32)?, t(&[1, 2, 4], DType::F32)?);
    let k4 = t(&[1, 4, 2, 32], DType::F32)?.transpose(1, 2)?;
    let cases: [Refusal; 8] = [
        ("k laid out unlike q", fwd(&q4, &lse4, &q4, &k4, None), |e| matches!(e, Error::Shape { .. })),
        ("head width 48", fwd(&q48, &lse, &q48, &q48, None), |e| matches!(e, Error::Unsupported { .. })),
        ("k of another shape", fwd(&out, &lse, &q, &short, None), |e| matches!(e, Error::Shape { .. })),
        ("lse of another shape", fwd(&out, &lse_bad, &q, &q, None), |e| matches!(e, Error::Shape { .. })),
        ("1-D heads", fwd(&one_d, &lse, &one_d, &one_d, None), |e| matches!(e, Error::Shape { .. })),
        ("bf16 k with f32 q", fwd(&out, &lse, &q, &qb, None), |e| matches!(e, Error::DTypeMismatch { .. })),
        ("f16 heads", fwd(&q16, &lse, &q16, &q16, None), |e| matches!(e, Error::UnsupportedDType { .. })),
        ("p = 1", fwd(&out, &lse, &q, &q, half), |e| matches!(e, Error::Unsupported { .. })),
    ];
    for (what, result, expected) in cases {
        match result {
            Err(e) if expected(&e) => {}
            other => anyhow::bail!("{what}: {other:?}"),
        }
    }
    ensure!(ctx.read(&out)?.iter().all(|&x| x == 0.5), "a refused call wrote its output");
    Ok(())
}

/// The cuDNN backend refuses, before anything is enqueued, what it cannot run: attention
/// dropout (its masks are not graphed's numbers), sequences that are not multiples of 128, f32,
/// other head widths; and, on the simulator, everything. Both cuDNN settings refuse alike.
fn attention_cudnn_refuses_what_it_cannot_run(dev: &Device) -> anyhow::Result<()> {
    for backend in [AttentionBackend::Cudnn, AttentionBackend::CudnnNondeterministic] {
        cudnn_refuses_on(dev, backend)?;
    }
    Ok(())
}

fn cudnn_refuses_on(dev: &Device, backend: AttentionBackend) -> anyhow::Result<()> {
    let ctx = Ctx::on(dev, backend)?;
    let supported = Case { pairs: 2, seq: 128, hd: 64, dtype: DType::BF16, p: 0.0 };
    let mut cases = vec![
        ("dropout", Case { p: 0.1, ..supported }),
        ("a sequence of 130", Case { seq: 130, ..supported }),
        ("f32", Case { dtype: DType::F32, ..supported }),
        ("head width 32", Case { hd: 32, ..supported }),
    ];
    if dev.kind() == graphed::device::DeviceKind::Sim {
        cases.push(("the simulator", supported));
    }
    for (what, case) in cases {
        let o = ctx.operands(case, &case.inputs(1))?;
        o.out.zero(&ctx.s)?;
        match ctx.compute(&o, case) {
            Err(Error::CudnnUnavailable { why, .. }) => eprintln!("{what} on {backend}: refused: {why}"),
            other => anyhow::bail!("{what} on {backend}: {other:?}"),
        }
        ensure!(ctx.read(&o.out)?.iter().all(|&x| x == 0.0), "{what} on {backend}: a refused call wrote its output");
    }
    Ok(())
}

per_device!(
    attention_matches_an_f64_reference,
    attention_reads_and_writes_row_layouts,
    attention_matches_the_reference_on_long_sequences,
    attention_gradients_match_finite_differences,
    attention_is_deterministic,
    attention_refuses_bad_calls,
    attention_cudnn_refuses_what_it_cannot_run,
);

#[test]
fn attention_backends_are_named_as_the_command_line_spells_them() {
    for backend in AttentionBackend::ALL {
        assert_eq!(AttentionBackend::named(backend.name()), Some(backend));
        assert_eq!(backend.to_string(), backend.name());
    }
    assert_eq!(AttentionBackend::default(), AttentionBackend::Auto);
    assert_eq!(AttentionBackend::named("flash"), None);
}

/// On the simulator `Auto` means graphed's kernels: the same bits as asking for them, at a
/// shape cuDNN would run on a GPU.
#[test]
fn attention_auto_runs_the_kernels_on_the_simulator() -> anyhow::Result<()> {
    let dev = Device::sim();
    let case = Case { pairs: 1, seq: 128, hd: 64, dtype: DType::BF16, p: 0.0 };
    let inputs = case.inputs(5);
    let auto = Ctx::on(&dev, AttentionBackend::Auto)?.run(case, &inputs)?;
    let kernels = Ctx::on(&dev, AttentionBackend::Kernels)?.run(case, &inputs)?;
    let bits = |r: &Run| r.iter().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>();
    ensure!(bits(&auto) == bits(&kernels), "Auto and Kernels differ on the simulator");
    Ok(())
}

/// cuDNN's backend on the GPU; each prints the plan cuDNN chose (engine, notes, workspace) and
/// its errors to stderr.
mod cudnn_cuda {
    use super::*;
    use graphed::device::CaptureMode;

    /// cuDNN logs its plans through `tracing`: show them on stderr.
    fn show_cudnn_plans() {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
            .try_init();
    }

    fn gpu() -> Device {
        show_cudnn_plans();
        Device::cuda_checked(0).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Forward and backward against the f64 reference at shapes cuDNN runs: 2 to 4 (batch
    /// element, head) pairs, 128 and 256 tokens, head widths 64 and 128, on contiguous heads and
    /// on the strided row views a layer keeps (nothing outside them written).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cudnn_matches_an_f64_reference() -> anyhow::Result<()> {
        let dev = gpu();
        for hd in attention::CUDNN_HEAD_DIMS {
            for (pairs, seq) in [(2, 128), (3, 256), (4, 128)] {
                check_case_on(&dev, AttentionBackend::Cudnn, Case { pairs, seq, hd, dtype: DType::BF16, p: 0.0 })?;
            }
            let case = Case { pairs: 4, seq: 256, hd, dtype: DType::BF16, p: 0.0 };
            let inputs = case.inputs(11);
            let (run, untouched) = Ctx::on(&dev, AttentionBackend::Cudnn)?.run_rows(case, 2, &inputs)?;
            check_run(&format!("{case:?} on cudnn, row views"), case, &run, &case.reference(&inputs))?;
            ensure!(untouched, "hd {hd}: cuDNN wrote outside the row views");
        }
        Ok(())
    }

    /// The opt-in nondeterministic setting: the same math within the same tolerance, at the
    /// shapes of the deterministic test and at a longer sequence (where the deterministic engine
    /// keeps its `T × T` scratch); the backward says it ran nondeterministic.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cudnn_nondeterministic_matches_an_f64_reference() -> anyhow::Result<()> {
        let dev = gpu();
        let backend = AttentionBackend::CudnnNondeterministic;
        for hd in attention::CUDNN_HEAD_DIMS {
            for (pairs, seq) in [(2, 128), (3, 256), (2, 1024)] {
                check_case_on(&dev, backend, Case { pairs, seq, hd, dtype: DType::BF16, p: 0.0 })?;
            }
            let case = Case { pairs: 2, seq: 256, hd, dtype: DType::BF16, p: 0.0 };
            let ctx = Ctx::on(&dev, backend)?;
            let ran = ctx.compute(&ctx.operands(case, &case.inputs(4))?, case)?;
            ensure!(ran == [AttentionBackend::Cudnn, backend], "hd {hd}: ran {ran:?}");
        }
        Ok(())
    }

    /// `Auto` runs cuDNN, forward and backward, where it supports the call (a deterministic
    /// backward engine exists), and graphed's kernels with dropout.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cudnn_is_what_auto_runs_where_it_can() -> anyhow::Result<()> {
        let dev = gpu();
        let ctx = Ctx::on(&dev, AttentionBackend::Auto)?;
        for hd in attention::CUDNN_HEAD_DIMS {
            let case = Case { pairs: 2, seq: 128, hd, dtype: DType::BF16, p: 0.0 };
            let ran = ctx.compute(&ctx.operands(case, &case.inputs(2))?, case)?;
            eprintln!("{case:?}: Auto ran {ran:?}");
            ensure!(ran == [AttentionBackend::Cudnn; 2], "hd {hd}: Auto ran {ran:?}");
            let dropped = Case { p: 0.1, ..case };
            let ran = ctx.compute(&ctx.operands(dropped, &dropped.inputs(2))?, dropped)?;
            ensure!(ran == [AttentionBackend::Kernels; 2], "hd {hd} with dropout: Auto ran {ran:?}");
        }
        Ok(())
    }

    /// cuDNN's deterministic backward in chunks, with a limit of one or two pairs' `T × T`
    /// scratch: against the f64 reference on contiguous heads (chunks of pairs) and on the row
    /// views a layer keeps (whole batch elements, and ranges of heads of one), one cuDNN
    /// execution per chunk; `Auto` runs the kernels where not even one pair's scratch fits.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cudnn_backward_runs_in_chunks_within_its_scratch_limit() -> anyhow::Result<()> {
        let dev = gpu();
        let (seq, hd) = (256, 64);
        let pair = seq * seq * 2;
        for (pairs, batch, limit, executions) in
            [(4, None, pair, 4), (6, None, 2 * pair, 3), (4, Some(2), 2 * pair, 2), (8, Some(2), 2 * pair, 4)]
        {
            let case = Case { pairs, seq, hd, dtype: DType::BF16, p: 0.0 };
            let inputs = case.inputs(pairs as u64 + 5);
            let ctx = Ctx { scratch_limit: Some(limit), ..Ctx::on(&dev, AttentionBackend::Cudnn)? };
            let profile = ctx.s.profile()?;
            let (run, untouched) = match batch {
                None => (ctx.run(case, &inputs)?, true),
                Some(batch) => ctx.run_rows(case, batch, &inputs)?,
            };
            let ran = profile.finish()?.iter().filter(|k| k.name == "cudnn_sdpa_backward_bf16").count();
            let what = format!("{case:?} in batches of {batch:?}, scratch limit {limit} bytes");
            check_run(&what, case, &run, &case.reference(&inputs))?;
            ensure!(untouched, "{what}: cuDNN wrote outside the row views");
            ensure!(ran == executions, "{what}: {ran} cuDNN backward executions, expected {executions}");
        }
        let case = Case { pairs: 2, seq, hd, dtype: DType::BF16, p: 0.0 };
        let ctx = Ctx { scratch_limit: Some(pair - 1), ..Ctx::on(&dev, AttentionBackend::Auto)? };
        let ran = ctx.compute(&ctx.operands(case, &case.inputs(9))?, case)?;
        ensure!(ran == [AttentionBackend::Cudnn, AttentionBackend::Kernels], "no pair fits: Auto ran {ran:?}");
        Ok(())
    }

    /// cuDNN's deterministic backward gives the same bits however its pairs are chunked: one
    /// execution over every pair, or several over whole batch elements or ranges of one's heads
    /// (the layer's row views), at a short and at L's sequence length. A scratch limit may then
    /// follow the memory free at the call without changing a bit of training.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cudnn_backward_bits_do_not_depend_on_its_chunks() -> anyhow::Result<()> {
        let dev = gpu();
        let bits = |r: &Run| r.iter().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>();
        for seq in [256, 2048] {
            let (pairs, batch, hd) = (8, 2, 64);
            let pair = seq * seq * 2;
            let case = Case { pairs, seq, hd, dtype: DType::BF16, p: 0.0 };
            let inputs = case.inputs(seq as u64 + 11);
            let mut first: Option<(usize, Vec<Vec<u32>>)> = None;
            for (limit, executions) in [(pairs * pair, 1), (4 * pair, 2), (2 * pair, 4), (pair, 8)] {
                let ctx = Ctx { scratch_limit: Some(limit), ..Ctx::on(&dev, AttentionBackend::Cudnn)? };
                let profile = ctx.s.profile()?;
                let (run, _) = ctx.run_rows(case, batch, &inputs)?;
                let ran = profile.finish()?.iter().filter(|k| k.name == "cudnn_sdpa_backward_bf16").count();
                ensure!(
                    ran == executions,
                    "T = {seq}: {ran} executions at a limit of {limit} B, expected {executions}"
                );
                let got = bits(&run);
                match &first {
                    None => first = Some((executions, got)),
                    Some((one, want)) => {
                        for (name, (g, w)) in ["out", "lse", "dq", "dk", "dv"].iter().zip(got.iter().zip(want)) {
                            let differ = g.iter().zip(w).filter(|(a, b)| a != b).count();
                            ensure!(
                                differ == 0,
                                "T = {seq}: {name} in {executions} executions differs from {one} in {differ} of {} values",
                                g.len()
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Under the default limit, cuDNN's backward runs in fewer executions where its allocator
    /// already holds the scratch free below its peak (a lower layer's backward, once the layers
    /// above have freed their activations), with the same bits and no memory added; where it
    /// holds no more than the last backward kept, a repeat runs as the first did.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cudnn_backward_takes_the_room_its_allocator_already_holds() -> anyhow::Result<()> {
        let dev = gpu();
        // 32 pairs of 2048 tokens: 256 MiB of scratch, four executions within the default
        // 64 MiB (the operands' size), one in the room of a freed 512 MiB block.
        let (case, batch) = (Case { pairs: 32, seq: 2048, hd: 64, dtype: DType::BF16, p: 0.0 }, 2);
        let inputs = case.inputs(5);
        let ctx = Ctx::on(&dev, AttentionBackend::Cudnn)?;
        let executions = || -> anyhow::Result<(usize, Vec<Vec<u32>>)> {
            let profile = ctx.s.profile()?;
            let (run, _) = ctx.run_rows(case, batch, &inputs)?;
            let ran = profile.finish()?.iter().filter(|k| k.name == "cudnn_sdpa_backward_bf16").count();
            Ok((ran, run.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect()))
        };
        let (first, want) = executions()?;
        ensure!(first == 4, "{first} executions in a new allocator, expected the default's 4");
        let (again, _) = executions()?;
        ensure!(again == 4, "{again} executions on a repeat: the room grew by itself");
        drop(ctx.alloc.alloc::<u8>(&ctx.s, 512 << 20)?);
        let before = ctx.alloc.stats().total;
        let (roomy, got) = executions()?;
        let after = ctx.alloc.stats().total;
        ensure!(roomy == 1, "{roomy} executions with 512 MiB free below the peak, expected 1");
        ensure!(got == want, "one execution differs from four");
        ensure!(
            (after.reserved, after.peak_allocated) == (before.reserved, before.peak_allocated),
            "the room cost memory: {before:?} then {after:?}"
        );
        Ok(())
    }

    /// Two eager runs are bitwise equal, and a graph capturing the forward and backward
    /// (its scratch from the graph's pool) replays them bit for bit, twice.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cudnn_captured_equals_eager_bitwise() -> anyhow::Result<()> {
        let dev = gpu();
        let ctx = Ctx::on(&dev, AttentionBackend::Cudnn)?;
        let case = Case { pairs: 4, seq: 256, hd: 64, dtype: DType::BF16, p: 0.0 };
        let o = ctx.operands(case, &case.inputs(3))?;
        let bits = |r: Run| r.map(|v| v.into_iter().map(f32::to_bits).collect::<Vec<_>>());
        ctx.compute(&o, case)?;
        let eager = bits(ctx.results(&o)?);
        ctx.compute(&o, case)?;
        ensure!(bits(ctx.results(&o)?) == eager, "two eager runs differ");
        let pool = ctx.alloc.new_pool();
        let cap = ctx.alloc.capture(&ctx.s, CaptureMode::ThreadLocal, &pool)?;
        ctx.compute(&o, case)?;
        let exec = cap.finish()?.instantiate()?;
        for replay in 0..2 {
            for t in [&o.out, &o.lse, &o.grads[0], &o.grads[1], &o.grads[2]] {
                t.zero(&ctx.s)?;
            }
            exec.launch(&ctx.s)?;
            ensure!(bits(ctx.results(&o)?) == eager, "replay {replay} differs from eager");
        }
        Ok(())
    }
}
