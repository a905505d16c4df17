//! GEMM (cuBLASLt on CUDA, a CPU loop on the simulator) against a host reference.

use anyhow::ensure;
use graphed::device::{CaptureMode, Device, DeviceKind, Epilogue, Gemm, GemmElem, NodeKind};
use graphed::Error;
use half::bf16;

fn lcg(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            ((x >> 8) as f32 / (1u32 << 24) as f32) - 0.5
        })
        .collect()
}

/// Row-major reference in f64: `alpha·op(A)·op(B) + beta·C + bias`.
#[allow(clippy::too_many_arguments)]
fn reference(
    a: &[f32],
    b: &[f32],
    c: &[f32],
    bias: Option<&[f32]>,
    (m, n, k): (usize, usize, usize),
    ta: bool,
    tb: bool,
    alpha: f32,
    beta: f32,
) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for q in 0..k {
                let x = if ta { a[q * m + i] } else { a[i * k + q] };
                let y = if tb { b[j * k + q] } else { b[q * n + j] };
                acc += f64::from(x) * f64::from(y);
            }
            out[i * n + j] = f64::from(alpha) * acc
                + f64::from(beta) * f64::from(c[i * n + j])
                + bias.map_or(0.0, |b| f64::from(b[j]));
        }
    }
    out
}

fn close(got: &[f32], want: &[f64], tol: f64) -> anyhow::Result<()> {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        ensure!((f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()), "element {i}: {g} vs {w}");
    }
    Ok(())
}

fn f32_gemm_matches_the_reference(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = (5, 7, 3);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let (ha, hb, hc, hbias) = (lcg(m * k, 1), lcg(k * n, 2), lcg(m * n, 3), lcg(n, 4));
        let (a, b, c, bias) =
            (dev.alloc_from(&s, &ha)?, dev.alloc_from(&s, &hb)?, dev.alloc_from(&s, &hc)?, dev.alloc_from(&s, &hbias)?);
        let g = Gemm {
            epilogue: Epilogue::Bias(bias.view()),
            trans_a: ta,
            trans_b: tb,
            alpha: 0.5,
            beta: 2.0,
            ..Gemm::new(c.view(), a.view(), b.view(), (m, n, k))
        };
        s.gemm(g)?;
        // IEEE f32 (no TF32): only the summation order differs from the reference.
        close(&c.to_vec(&s)?, &reference(&ha, &hb, &hc, Some(&hbias), (m, n, k), ta, tb, 0.5, 2.0), 1e-5)?;
    }
    Ok(())
}

fn strided_batched_gemm_on_column_blocks(dev: &Device) -> anyhow::Result<()> {
    // Two heads of width 4 in a (6 x 8) activation: scores_h = Q_h · K_hᵀ, batched over heads
    // with each head a column block (leading dimension 8, batch stride 4).
    let s = dev.stream()?;
    let (t, d, heads) = (6, 4, 2);
    let (hq, hk) = (lcg(t * d * heads, 5), lcg(t * d * heads, 6));
    let (q, kk) = (dev.alloc_from(&s, &hq)?, dev.alloc_from(&s, &hk)?);
    let scores = dev.alloc::<f32>(heads * t * t)?;
    let view =
        |buf| graphed::device::DeviceBuffer::strided(buf, 0, &[(heads, d), (t, d * heads), (d, 1)]).expect("3 dims");
    let g = Gemm { batch: heads, trans_b: true, ..Gemm::new(scores.view(), view(&q), view(&kk), (t, t, d)) };
    s.gemm(g)?;
    let got = scores.to_vec(&s)?;
    for h in 0..heads {
        let pick = |src: &[f32]| {
            (0..t)
                .flat_map(|r| (0..d).map(move |c| (r, c)))
                .map(|(r, c)| src[r * d * heads + h * d + c])
                .collect::<Vec<_>>()
        };
        let want = reference(&pick(&hq), &pick(&hk), &vec![0.0; t * t], None, (t, t, d), false, true, 1.0, 0.0);
        close(&got[h * t * t..(h + 1) * t * t], &want, 1e-5)?;
    }
    Ok(())
}

fn bf16_gemm_accumulates_in_f32(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = (8, 16, 64);
    let to = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let (ha, hb) = (to(lcg(m * k, 7)), to(lcg(k * n, 8)));
    let (a, b, c) = (dev.alloc_from(&s, &ha)?, dev.alloc_from(&s, &hb)?, dev.alloc::<bf16>(m * n)?);
    s.gemm(Gemm::new(c.view(), a.view(), b.view(), (m, n, k)))?;
    let back = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
    let want = reference(&back(&ha), &back(&hb), &vec![0.0; m * n], None, (m, n, k), false, false, 1.0, 0.0);
    // Output rounding to bf16 (8 bits of mantissa) dominates the error.
    close(&back(&c.to_vec(&s)?), &want, 1e-2)
}

fn gemm_is_captured_as_kernels(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = (4, 4, 4);
    let (ha, hb) = (lcg(m * k, 9), lcg(k * n, 10));
    let (a, b, c) = (dev.alloc_from(&s, &ha)?, dev.alloc_from(&s, &hb)?, dev.alloc::<f32>(m * n)?);
    s.gemm(Gemm::new(c.view(), a.view(), b.view(), (m, n, k)))?;
    s.synchronize()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    s.gemm(Gemm { alpha: 2.0, ..Gemm::new(c.view(), a.view(), b.view(), (m, n, k)) })?;
    let graph = cap.finish()?;
    let counts = graph.node_counts()?;
    ensure!(counts.keys().all(|k| *k == NodeKind::Kernel) && !counts.is_empty(), "{counts:?}");
    let exec = graph.instantiate()?;
    exec.launch(&s)?;
    close(&c.to_vec(&s)?, &reference(&ha, &hb, &[0.0; 16], None, (m, n, k), false, false, 2.0, 0.0), 1e-5)
}

fn mismatched_gemm_shapes_are_refused(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (a, b, c) = (dev.alloc::<f32>(12)?, dev.alloc::<f32>(12)?, dev.alloc::<f32>(9)?);
    ensure!(matches!(s.gemm(Gemm::new(c.view(), a.view(), b.view(), (3, 3, 5))), Err(Error::Shape { .. })));
    let wide = c.strided(0, &[(3, 3), (3, 2)]).expect("2 dims");
    ensure!(matches!(
        s.gemm(Gemm::new(wide, a.view(), b.view(), (3, 3, 4))),
        Err(Error::Shape { .. } | Error::OutOfBounds { .. })
    ));
    Ok(())
}

// ---- epilogues -----------------------------------------------------------------------------
// Each fused GEMM is compared with the unfused computation done here in f64 from the same
// (T-valued) inputs, at the transformer's shapes.

/// (m, n, k) of the epilogue cases: tokens × width × width, as in the benchmark layer.
const SHAPE: (usize, usize, usize) = (128, 96, 64);

/// A reference value and its scale: the sum of the magnitudes of the terms that made it, which
/// bounds the rounding error of any summation order (cancellation does not tighten it).
#[derive(Clone, Copy)]
struct Want {
    v: f64,
    scale: f64,
}

impl Want {
    fn plus(self, x: f64) -> Want {
        Want { v: self.v + x, scale: self.scale + x.abs() }
    }
}

/// `|got − want| ≤ rel·|want| + abs·scale`.
#[derive(Clone, Copy)]
struct Tol {
    rel: f64,
    abs: f64,
}

impl Tol {
    /// With `abs` more on CUDA only, where cuBLASLt's epilogue may compute differently from the
    /// simulator (each caller says how); the simulator keeps the tight bound.
    fn on_cuda(self, dev: &Device, abs: f64) -> Tol {
        if dev.kind() == DeviceKind::Cuda {
            Tol { abs: self.abs + abs, ..self }
        } else {
            self
        }
    }
}

/// cuBLASLt may evaluate GELU's tanh with the hardware approximation (`tanh.approx.f32`,
/// relative error about 2⁻¹¹), which moves gelu(x) by up to about 2.5e-4·|x| and gelu'(x) by up
/// to about 1e-3 for |x| ≤ 2; the simulator uses the precise tanh.
const CUDA_TANH_SLACK: f64 = 1e-3;

/// The element types of the epilogue cases, with the tolerance of a value stored once.
trait Host: GemmElem {
    fn of(v: f32) -> Self;
    fn back(self) -> f32;
    /// f32: both devices sum in IEEE f32 and differ only in order, at most about (terms)·2⁻²⁴
    /// of the scale, under 1e-5 for the 64-term products and 128-term bias gradients here.
    /// bf16: the same f32 sums, then one rounding to bf16 (half an ulp); two ulps (an ulp is at
    /// most 2⁻⁷·|want|) leave room for cuBLASLt's own sums and GELU.
    const STORED: Tol;
}

impl Host for f32 {
    fn of(v: f32) -> Self {
        v
    }
    fn back(self) -> f32 {
        self
    }
    const STORED: Tol = Tol { rel: 1e-5, abs: 1e-5 };
}

impl Host for bf16 {
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn back(self) -> f32 {
        self.to_f32()
    }
    const STORED: Tol = Tol { rel: 2.0 / 128.0, abs: 1e-5 };
}

/// `n` values in `[-0.5·spread, 0.5·spread)` as `T`, and the same values as f32.
fn input<T: Host>(n: usize, seed: u32, spread: f32) -> (Vec<T>, Vec<f32>) {
    let t: Vec<T> = lcg(n, seed).into_iter().map(|v| T::of(v * spread)).collect();
    let f = t.iter().map(|v| v.back()).collect();
    (t, f)
}

fn back<T: Host>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.back()).collect()
}

fn check(what: &str, got: &[f32], want: &[Want], tol: Tol) -> anyhow::Result<()> {
    ensure!(got.len() == want.len(), "{what}: {} values, expected {}", got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(*g) - w.v).abs();
        ensure!(err <= tol.rel * w.v.abs() + tol.abs * w.scale, "{what}[{i}]: {g} vs {} (scale {})", w.v, w.scale);
    }
    Ok(())
}

/// `alpha·op(A)·op(B)`, row-major `m × n`, in f64.
fn product(a: &[f32], b: &[f32], (m, n, k): (usize, usize, usize), ta: bool, tb: bool, alpha: f64) -> Vec<Want> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let (mut v, mut scale) = (0.0f64, 0.0f64);
            for q in 0..k {
                let x = f64::from(if ta { a[q * m + i] } else { a[i * k + q] });
                let y = f64::from(if tb { b[j * k + q] } else { b[q * n + j] });
                v += x * y;
                scale += (x * y).abs();
            }
            out.push(Want { v: alpha * v, scale: alpha.abs() * scale });
        }
    }
    out
}

const GELU_K: f64 = 0.797_884_560_802_865_4; // √(2/π)

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + (GELU_K * (x + 0.044715 * x * x * x)).tanh())
}

fn gelu_grad(x: f64) -> f64 {
    let t = (GELU_K * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * 0.044715 * x * x)
}

/// `y = x·Wᵀ + b`, a linear layer's forward.
fn bias_case<T: Host>(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = SHAPE;
    let ((x, hx), (w, hw), (b, hb)) = (input::<T>(m * k, 11, 1.0), input::<T>(n * k, 12, 1.0), input::<T>(n, 13, 1.0));
    let (x, w, b, y) =
        (dev.alloc_from(&s, &x)?, dev.alloc_from(&s, &w)?, dev.alloc_from(&s, &b)?, dev.alloc::<T>(m * n)?);
    s.gemm(Gemm {
        trans_b: true,
        epilogue: Epilogue::Bias(b.view()),
        ..Gemm::new(y.view(), x.view(), w.view(), (m, n, k))
    })?;
    let want: Vec<Want> = product(&hx, &hw, (m, n, k), false, true, 1.0)
        .iter()
        .enumerate()
        .map(|(i, p)| p.plus(hb[i % n].into()))
        .collect();
    check("y", &back(&y.to_vec(&s)?), &want, T::STORED)
}

fn bias_epilogue_matches_unfused(dev: &Device) -> anyhow::Result<()> {
    bias_case::<f32>(dev)?;
    bias_case::<bf16>(dev)
}

/// `h = x + att·Wᵀ + b`, the residual add after the attention projection: `h` is only written.
fn addend_case<T: Host>(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = SHAPE;
    let ((att, ha), (w, hw)) = (input::<T>(m * k, 21, 1.0), input::<T>(n * k, 22, 1.0));
    let ((b, hb), (x, hx)) = (input::<T>(n, 23, 1.0), input::<T>(m * n, 24, 4.0));
    let (att, w, b) = (dev.alloc_from(&s, &att)?, dev.alloc_from(&s, &w)?, dev.alloc_from(&s, &b)?);
    let x_dev = dev.alloc_from(&s, &x)?;
    let h = dev.alloc_from(&s, &vec![T::of(1000.0); m * n])?;
    s.gemm(Gemm {
        addend: Some(x_dev.view()),
        beta: 1.0,
        trans_b: true,
        epilogue: Epilogue::Bias(b.view()),
        ..Gemm::new(h.view(), att.view(), w.view(), (m, n, k))
    })?;
    let want: Vec<Want> = product(&ha, &hw, (m, n, k), false, true, 1.0)
        .iter()
        .enumerate()
        .map(|(i, p)| p.plus(hx[i].into()).plus(hb[i % n].into()))
        .collect();
    check("h", &back(&h.to_vec(&s)?), &want, T::STORED)?;
    ensure!(back(&x_dev.to_vec(&s)?) == hx, "the addend was modified");
    Ok(())
}

fn addend_is_read_and_the_output_only_written(dev: &Device) -> anyhow::Result<()> {
    addend_case::<f32>(dev)?;
    addend_case::<bf16>(dev)
}

/// `u = gelu(x·W1ᵀ + b1)`, saving GELU's input in an aux matrix with padded rows.
fn bias_gelu_aux_case<T: Host>(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = SHAPE;
    let (ld, alpha) = (n + 8, 1.5);
    let ((x, hx), (w, hw), (b, hb)) = (input::<T>(m * k, 31, 1.0), input::<T>(n * k, 32, 1.0), input::<T>(n, 33, 1.0));
    let (x, w, b, u) =
        (dev.alloc_from(&s, &x)?, dev.alloc_from(&s, &w)?, dev.alloc_from(&s, &b)?, dev.alloc::<T>(m * n)?);
    let pad = T::of(7.0);
    let aux = dev.alloc_from(&s, &vec![pad; m * ld])?;
    let aux_view = aux.strided(0, &[(m, ld), (n, 1)]).expect("2 dims");
    s.gemm(Gemm {
        alpha,
        trans_b: true,
        epilogue: Epilogue::BiasGeluAux { bias: b.view(), aux: aux_view },
        ..Gemm::new(u.view(), x.view(), w.view(), (m, n, k))
    })?;
    let pre: Vec<Want> = product(&hx, &hw, (m, n, k), false, true, f64::from(alpha))
        .iter()
        .enumerate()
        .map(|(i, p)| p.plus(hb[i % n].into()))
        .collect();
    // |gelu'| ≤ 1.13 carries pre's error into u.
    let want_u: Vec<Want> = pre.iter().map(|p| Want { v: gelu(p.v), scale: 1.13 * p.scale }).collect();
    check("u", &back(&u.to_vec(&s)?), &want_u, T::STORED.on_cuda(dev, CUDA_TANH_SLACK))?;
    let aux_host = aux.to_vec(&s)?;
    let rows: Vec<T> = (0..m).flat_map(|i| aux_host[i * ld..i * ld + n].iter().copied()).collect();
    check("aux", &back(&rows), &pre, T::STORED)?;
    ensure!((0..m).all(|i| aux_host[i * ld + n..(i + 1) * ld].iter().all(|v| v.back() == 7.0)), "aux padding written");
    Ok(())
}

fn bias_gelu_aux_epilogue_matches_unfused(dev: &Device) -> anyhow::Result<()> {
    bias_gelu_aux_case::<f32>(dev)?;
    bias_gelu_aux_case::<bf16>(dev)
}

/// FC2's data gradient fused with GELU's backward and FC1's bias gradient:
/// `dpre = (dy·W2) ⊙ gelu'(pre)`, `db1 = Σ_rows dpre`.
/// GELU's backward in the data-gradient GEMM, with (`DGELU_BGRAD`) or without (`DGELU`) the
/// bias gradient of the layer before.
fn dgelu_case<T: Host>(dev: &Device, with_bias_grad: bool) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = SHAPE;
    let ((dy, hdy), (w, hw), (pre, hpre)) =
        (input::<T>(m * k, 41, 1.0), input::<T>(k * n, 42, 1.0), input::<T>(m * n, 43, 4.0));
    let (dy, w, pre) = (dev.alloc_from(&s, &dy)?, dev.alloc_from(&s, &w)?, dev.alloc_from(&s, &pre)?);
    let dpre = dev.alloc::<T>(m * n)?;
    let db = dev.alloc_from(&s, &vec![T::of(1000.0); n])?;
    let epilogue = if with_bias_grad {
        Epilogue::DGeluBGrad { aux: pre.view(), bias_grad: db.view() }
    } else {
        Epilogue::DGelu { aux: pre.view() }
    };
    s.gemm(Gemm { epilogue, ..Gemm::new(dpre.view(), dy.view(), w.view(), (m, n, k)) })?;
    let want: Vec<Want> = product(&hdy, &hw, (m, n, k), false, false, 1.0)
        .iter()
        .zip(&hpre)
        // gelu' is a sum of terms of magnitude up to about 1.2 that cancel near x ≈ −0.75: its
        // f32 value errs relative to them, not to the sum.
        .map(|(g, x)| Want { v: g.v * gelu_grad(f64::from(*x)), scale: 1.2 * g.scale })
        .collect();
    let gelu_tol = T::STORED.on_cuda(dev, CUDA_TANH_SLACK);
    check("dpre", &back(&dpre.to_vec(&s)?), &want, gelu_tol)?;
    if !with_bias_grad {
        ensure!(db.to_vec(&s)?.iter().all(|v| v.back() == 1000.0), "DGELU wrote a bias gradient");
        return Ok(());
    }
    let sums: Vec<Want> = (0..n)
        .map(|j| {
            (0..m)
                .map(|i| want[i * n + j])
                .fold(Want { v: 0.0, scale: 0.0 }, |a, w| Want { v: a.v + w.v, scale: a.scale + w.scale })
        })
        .collect();
    // cuBLASLt may sum D after its rounding to T: half an ulp of each term, at most 2⁻⁸ of it
    // for bf16 (a rounding error f32 has no room for at this bound's scale).
    let rounded_terms = if T::DTYPE == graphed::device::DType::BF16 { 1.0 / 256.0 } else { 0.0 };
    check("db1", &back(&db.to_vec(&s)?), &sums, gelu_tol.on_cuda(dev, rounded_terms))
}

fn dgelu_bgrad_epilogue_matches_unfused(dev: &Device) -> anyhow::Result<()> {
    dgelu_case::<f32>(dev, true)?;
    dgelu_case::<bf16>(dev, true)
}

fn dgelu_epilogue_matches_unfused(dev: &Device) -> anyhow::Result<()> {
    dgelu_case::<f32>(dev, false)?;
    dgelu_case::<bf16>(dev, false)
}

/// `dW += dyᵀ·x` with `db = Σ_tokens dy` written (not accumulated): dims (out, in, tokens).
fn bgrad_case<T: Host>(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (tokens, width, out) = SHAPE;
    let (m, n, k) = (out, width, tokens);
    let ((dy, hdy), (x, hx), (dw0, hdw0)) =
        (input::<T>(k * m, 51, 1.0), input::<T>(k * n, 52, 1.0), input::<T>(m * n, 53, 1.0));
    let (dy, x, dw) = (dev.alloc_from(&s, &dy)?, dev.alloc_from(&s, &x)?, dev.alloc_from(&s, &dw0)?);
    let db = dev.alloc_from(&s, &vec![T::of(1000.0); m])?;
    s.gemm(Gemm {
        trans_a: true,
        beta: 1.0,
        epilogue: Epilogue::BGradA { bias_grad: db.view() },
        ..Gemm::new(dw.view(), dy.view(), x.view(), (m, n, k))
    })?;
    let want: Vec<Want> =
        product(&hdy, &hx, (m, n, k), true, false, 1.0).iter().zip(&hdw0).map(|(p, c)| p.plus((*c).into())).collect();
    // On the H200, cuBLASLt's bf16 BGRADB kernel with beta = 1 lands up to 8 ulps off where the
    // product and C cancel (seen: -0.015625 for -0.01515, scale 8.5): it rounds a partial result
    // to bf16 before adding C, an error of one bf16 rounding of the terms' scale.
    let accumulated = if T::DTYPE == graphed::device::DType::BF16 { 1.0 / 256.0 } else { 0.0 };
    check("dW", &back(&dw.to_vec(&s)?), &want, T::STORED.on_cuda(dev, accumulated))?;
    let sums: Vec<Want> = (0..m)
        .map(|i| {
            let col = (0..k).map(|q| f64::from(hdy[q * m + i]));
            col.fold(Want { v: 0.0, scale: 0.0 }, |a, v| a.plus(v))
        })
        .collect();
    check("db", &back(&db.to_vec(&s)?), &sums, T::STORED)
}

fn bgrad_a_epilogue_writes_the_bias_gradient_of_an_accumulated_weight_gradient(dev: &Device) -> anyhow::Result<()> {
    bgrad_case::<f32>(dev)?;
    bgrad_case::<bf16>(dev)
}

fn epilogue_arguments_are_refused_before_enqueue(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = (16, 96, 8);
    // Room for a batch of two.
    let (a, b) = (dev.alloc_from(&s, &vec![1.0f32; 2 * m * k])?, dev.alloc_from(&s, &vec![1.0f32; 2 * k * n])?);
    let c = dev.alloc_from(&s, &vec![3.0f32; 2 * m * n])?;
    let aux = dev.alloc_from(&s, &vec![5.0f32; 2 * m * 100])?;
    let vector = dev.alloc_from(&s, &vec![9.0f32; 2 * n])?;
    let new = || Gemm::new(c.slice(0..m * n), a.slice(0..m * k), b.slice(0..k * n), (m, n, k));
    let (bias, aux_ok) = (vector.slice(0..n), aux.slice(0..m * n));
    let refusals = [
        // Row stride 100: not a multiple of 8 elements.
        Gemm {
            epilogue: Epilogue::BiasGeluAux { bias, aux: aux.strided(0, &[(m, 100), (n, 1)]).expect("2 dims") },
            ..new()
        },
        Gemm {
            epilogue: Epilogue::DGeluBGrad {
                aux: aux.strided(0, &[(m, 100), (n, 1)]).expect("2 dims"),
                bias_grad: bias,
            },
            ..new()
        },
        // Bias gradients of the wrong length: n + 1 for D's columns, n for op(A)'s m rows.
        Gemm { epilogue: Epilogue::DGeluBGrad { aux: aux_ok, bias_grad: vector.slice(0..n + 1) }, ..new() },
        Gemm { epilogue: Epilogue::BGradA { bias_grad: bias }, ..new() },
        Gemm { epilogue: Epilogue::Bias(vector.slice(0..n - 1)), ..new() },
        // An addend that is not m x n.
        Gemm { addend: Some(aux.slice(0..m * n - 1)), beta: 1.0, ..new() },
        // A batch with an epilogue whose outputs belong to one GEMM.
        Gemm {
            batch: 2,
            epilogue: Epilogue::BGradA { bias_grad: vector.slice(0..m) },
            ..Gemm::new(c.view(), a.view(), b.view(), (m, n, k))
        },
    ];
    for (i, g) in refusals.into_iter().enumerate() {
        let r = s.gemm(g);
        ensure!(matches!(r, Err(Error::Shape { .. })), "case {i}: {r:?}");
    }
    ensure!(c.to_vec(&s)?.iter().all(|v| *v == 3.0), "the output was written");
    ensure!(aux.to_vec(&s)?.iter().all(|v| *v == 5.0), "aux was written");
    ensure!(vector.to_vec(&s)?.iter().all(|v| *v == 9.0), "a vector was written");
    Ok(())
}

crate::per_device!(
    f32_gemm_matches_the_reference,
    strided_batched_gemm_on_column_blocks,
    bf16_gemm_accumulates_in_f32,
    gemm_is_captured_as_kernels,
    mismatched_gemm_shapes_are_refused,
    bias_epilogue_matches_unfused,
    addend_is_read_and_the_output_only_written,
    bias_gelu_aux_epilogue_matches_unfused,
    dgelu_bgrad_epilogue_matches_unfused,
    dgelu_epilogue_matches_unfused,
    bgrad_a_epilogue_writes_the_bias_gradient_of_an_accumulated_weight_gradient,
    epilogue_arguments_are_refused_before_enqueue,
);
