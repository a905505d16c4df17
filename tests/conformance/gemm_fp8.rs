//! FP8 GEMMs against the bf16 GEMM of the same values: every FP8 value is a bf16 value and every
//! product of two is exact in f32, so on the simulator an FP8 GEMM equals the bf16 GEMM of its
//! dequantized operands (scales folded into alpha) bit for bit, and on CUDA within the output's
//! rounding.

use anyhow::ensure;
use float8::{F8E4M3, F8E5M2};
use graphed::device::{
    CaptureMode, Device, DeviceBuffer, DeviceKind, Epilogue, Float8, Fp8Gemm, Fp8Pair, Gemm, FP8_SCALE_ALIGN_BYTES,
};
use graphed::Error;
use half::bf16;

fn lcg(n: usize, seed: u32, range: f32) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (((x >> 8) as f32 / (1u32 << 24) as f32) - 0.5) * range
        })
        .collect()
}

/// `n` FP8 values spread over `range` (quantized on the host), and the same values in bf16.
fn operand<F: Float8>(n: usize, seed: u32, range: f32) -> (Vec<F>, Vec<bf16>) {
    let q: Vec<F> = lcg(n, seed, range).into_iter().map(F::from_f32).collect();
    let wide = q.iter().map(|v| bf16::from_f32(v.to_f32())).collect();
    (q, wide)
}

/// (m, n, k): tokens × width × width at the layer's proportions, k a multiple of 16 bytes.
const SHAPE: (usize, usize, usize) = (64, 96, 128);

/// Within the output's rounding on CUDA (its sums run in another order, and its GELU may use the
/// hardware tanh); equal on the simulator.
fn agree(dev: &Device, what: &str, got: &[bf16], want: &[bf16]) -> anyhow::Result<()> {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f32(), w.to_f32());
        let ok = if dev.kind() == DeviceKind::Cuda {
            (g - w).abs() <= 2e-2 * (1.0 + w.abs())
        } else {
            g.to_bits() == w.to_bits()
        };
        ensure!(ok, "{what}: element {i}: {g} vs the bf16 GEMM's {w}");
    }
    Ok(())
}

/// Epilogue `kind` (in `EpilogueKind` order) over the given bias, aux input, aux output and bias
/// gradient.
fn epilogue<'a>(
    kind: usize,
    (bias, aux, aux_out, grad): (
        &'a DeviceBuffer<bf16>,
        &'a DeviceBuffer<bf16>,
        &'a DeviceBuffer<bf16>,
        &'a DeviceBuffer<bf16>,
    ),
    (m, n): (usize, usize),
) -> Epilogue<'a, bf16> {
    match kind {
        0 => Epilogue::None,
        1 => Epilogue::Bias(bias.slice(0..n)),
        2 => Epilogue::BiasGeluAux { bias: bias.slice(0..n), aux: aux_out.view() },
        3 => Epilogue::DGeluBGrad { aux: aux.view(), bias_grad: grad.slice(0..n) },
        4 => Epilogue::BGradA { bias_grad: grad.slice(0..m) },
        _ => Epilogue::DGelu { aux: aux.view() },
    }
}

/// Each epilogue, with and without an addend, for the operand pair `(A, B)`.
fn fp8_gemm_equals_the_bf16_gemm_of_its_values<A: Float8, B: Float8>(dev: &Device) -> anyhow::Result<()>
where
    (A, B): Fp8Pair,
{
    let s = dev.stream()?;
    let (m, n, k) = SHAPE;
    let (qa, wa) = operand::<A>(m * k, 1, 4.0);
    let (qb, wb) = operand::<B>(n * k, 2, 1.0);
    let (a, b) = (dev.alloc_from(&s, &qa)?, dev.alloc_from(&s, &qb)?);
    let (wa, wb) = (dev.alloc_from(&s, &wa)?, dev.alloc_from(&s, &wb)?);
    let (sa, sb) = (0.5f32, 0.125f32);
    let (scale_a, scale_b) = (dev.alloc_from(&s, &[sa])?, dev.alloc_from(&s, &[sb])?);
    let bf = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let (addend, bias, aux) = (
        dev.alloc_from(&s, &bf(lcg(m * n, 3, 2.0)))?,
        dev.alloc_from(&s, &bf(lcg(n.max(m), 4, 1.0)))?,
        dev.alloc_from(&s, &bf(lcg(m * n, 5, 4.0)))?,
    );
    let outputs = [0; 4].map(|_| dev.alloc::<bf16>(m * n));
    let [c, c_ref, aux_out, aux_ref] = outputs;
    let (c, c_ref, aux_out, aux_ref) = (c?, c_ref?, aux_out?, aux_ref?);
    let (grad, grad_ref) = (dev.alloc::<bf16>(n.max(m))?, dev.alloc::<bf16>(n.max(m))?);
    for kind in 0..6 {
        let epilogues = |aux_o, g| epilogue(kind, (&bias, &aux, aux_o, g), (m, n));
        for with_addend in [false, true] {
            let what = format!("{}×{} epilogue {kind}, addend {with_addend}", A::DTYPE, B::DTYPE);
            let addend_view = with_addend.then(|| addend.view());
            let beta = if with_addend { 1.0 } else { 0.0 };
            let g = Fp8Gemm {
                addend: addend_view,
                beta,
                alpha: 0.75,
                epilogue: epilogues(&aux_out, &grad),
                ..Fp8Gemm::new(c.view(), a.view(), b.view(), (scale_a.view(), scale_b.view()), (m, n, k))
            };
            let r = s.fp8_gemm(g);
            if kind == 4 {
                // cuBLASLt has no FP8 BGRADB: refused on both devices, before anything runs.
                ensure!(matches!(r, Err(Error::Unsupported { .. })), "{what}: {r:?}");
                continue;
            }
            r?;
            let r = Gemm {
                addend: addend_view,
                beta,
                alpha: 0.75 * (sa * sb),
                trans_b: true,
                epilogue: epilogues(&aux_ref, &grad_ref),
                ..Gemm::new(c_ref.view(), wa.view(), wb.view(), (m, n, k))
            };
            s.gemm(r)?;
            agree(dev, &what, &c.to_vec(&s)?, &c_ref.to_vec(&s)?)?;
            if kind == 2 {
                agree(dev, &format!("{what}, aux"), &aux_out.to_vec(&s)?, &aux_ref.to_vec(&s)?)?;
            }
            if kind == 3 {
                agree(dev, &format!("{what}, bias gradient"), &grad.to_vec(&s)?, &grad_ref.to_vec(&s)?)?;
            }
        }
    }
    Ok(())
}

fn e4m3_e4m3_gemm_equals_bf16(dev: &Device) -> anyhow::Result<()> {
    fp8_gemm_equals_the_bf16_gemm_of_its_values::<F8E4M3, F8E4M3>(dev)
}

fn e4m3_e5m2_gemm_equals_bf16(dev: &Device) -> anyhow::Result<()> {
    fp8_gemm_equals_the_bf16_gemm_of_its_values::<F8E4M3, F8E5M2>(dev)
}

fn e5m2_e4m3_gemm_equals_bf16(dev: &Device) -> anyhow::Result<()> {
    fp8_gemm_equals_the_bf16_gemm_of_its_values::<F8E5M2, F8E4M3>(dev)
}

/// Fast accumulation changes only how the tensor cores sum: still within the output's rounding
/// at k = 128.
fn fast_accumulation_stays_within_rounding(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = SHAPE;
    let (qa, wa) = operand::<F8E4M3>(m * k, 6, 8.0);
    let (qb, wb) = operand::<F8E4M3>(n * k, 7, 8.0);
    let (a, b, wa, wb) =
        (dev.alloc_from(&s, &qa)?, dev.alloc_from(&s, &qb)?, dev.alloc_from(&s, &wa)?, dev.alloc_from(&s, &wb)?);
    let one = dev.alloc_from(&s, &[1.0f32])?;
    let (c, c_ref) = (dev.alloc::<bf16>(m * n)?, dev.alloc::<bf16>(m * n)?);
    s.fp8_gemm(Fp8Gemm {
        fast_accum: true,
        ..Fp8Gemm::new(c.view(), a.view(), b.view(), (one.view(), one.view()), (m, n, k))
    })?;
    s.gemm(Gemm { trans_b: true, ..Gemm::new(c_ref.view(), wa.view(), wb.view(), (m, n, k)) })?;
    agree(dev, "fast accumulation", &c.to_vec(&s)?, &c_ref.to_vec(&s)?)
}

/// A captured FP8 GEMM reads its scales when the graph runs: a recipe's new scale reaches the
/// next replay without a recapture.
fn a_replay_reads_the_scales_written_since_capture(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = (16, 16, 32);
    let one = F8E4M3::from_f32(1.0);
    let (a, b) = (dev.alloc_from(&s, &vec![one; m * k])?, dev.alloc_from(&s, &vec![one; n * k])?);
    let (sa, sb) = (dev.alloc_from(&s, &[1.0f32])?, dev.alloc_from(&s, &[1.0f32])?);
    let c = dev.alloc::<bf16>(m * n)?;
    let g = || Fp8Gemm::new(c.view(), a.view(), b.view(), (sa.view(), sb.view()), (m, n, k));
    s.fp8_gemm(g())?;
    s.synchronize()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    s.fp8_gemm(g())?;
    let exec = cap.finish()?.instantiate()?;
    exec.launch(&s)?;
    ensure!(c.to_vec(&s)?.iter().all(|v| v.to_f32() == k as f32), "first replay");
    sa.write_from(&s, &[0.25f32])?;
    exec.launch(&s)?;
    ensure!(c.to_vec(&s)?.iter().all(|v| v.to_f32() == k as f32 / 4.0), "the replay did not read the new scale");
    Ok(())
}

/// Misaligned matrices and malformed scales are refused before anything is enqueued.
fn misaligned_or_malformed_fp8_gemms_are_refused(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let zero = F8E4M3::from_f32(0.0);
    let (a, b) = (dev.alloc_from(&s, &vec![zero; 64 * 48])?, dev.alloc_from(&s, &vec![zero; 64 * 48])?);
    let scales = dev.alloc_from(&s, &[1.0f32, 1.0])?;
    let c = dev.alloc_from(&s, &vec![bf16::from_f32(3.0); 64 * 64])?;
    let one = (scales.slice(0..1), scales.slice(0..1));
    let refusals = [
        // k = 8: rows of 8 bytes.
        Fp8Gemm::new(c.slice(0..16 * 16), a.slice(0..16 * 8), b.slice(0..16 * 8), one, (16, 16, 8)),
        // A starts 8 bytes into its allocation.
        Fp8Gemm::new(c.slice(0..16 * 16), a.slice(8..8 + 16 * 16), b.slice(0..16 * 16), one, (16, 16, 16)),
        // D's rows of 4 bf16 (8 bytes).
        Fp8Gemm::new(c.slice(0..16 * 4), a.slice(0..16 * 16), b.slice(0..4 * 16), one, (16, 4, 16)),
        // A's scale of two elements.
        Fp8Gemm::new(
            c.slice(0..16 * 16),
            a.slice(0..16 * 16),
            b.slice(0..16 * 16),
            (scales.view(), scales.slice(0..1)),
            (16, 16, 16),
        ),
        // B of the wrong size.
        Fp8Gemm::new(c.slice(0..16 * 16), a.slice(0..16 * 16), b.slice(0..16 * 15), one, (16, 16, 16)),
    ];
    for (i, g) in refusals.into_iter().enumerate() {
        let r = s.fp8_gemm(g);
        ensure!(matches!(r, Err(Error::Shape { .. })), "case {i}: {r:?}");
    }
    ensure!(c.to_vec(&s)?.iter().all(|v| v.to_f32() == 3.0), "the output was written");
    Ok(())
}

/// The layouts a training step hands an FP8 GEMM: scales in slots 256 bytes apart (a recipe's
/// scale vector), the weight gradient accumulated in place (`beta = 1`, C = D), fast
/// accumulation with the bias epilogue, and the bias gradient's bf16 GEMV; scales 4 bytes apart,
/// which cuBLASLt refuses at launch, are refused before.
fn fp8_gemms_in_a_training_steps_layouts(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (m, n, k) = (32, 64, 48);
    let one = F8E4M3::from_f32(0.5);
    let (a, b) = (dev.alloc_from(&s, &vec![one; m * k])?, dev.alloc_from(&s, &vec![one; n * k])?);
    let slots: Vec<f32> = (0..4 * FP8_SCALE_ALIGN).map(|i| (1 << (i / FP8_SCALE_ALIGN)) as f32).collect();
    let scales = dev.alloc_from(&s, &slots)?;
    let slot = |i: usize| scales.slice(i * FP8_SCALE_ALIGN..i * FP8_SCALE_ALIGN + 1);
    let c = dev.alloc_from(&s, &vec![bf16::from_f32(1.0); m * n])?;
    let bias = dev.alloc_from(&s, &vec![bf16::from_f32(0.5); n])?;
    let g = |sa: usize, sb: usize| Fp8Gemm::new(c.view(), a.view(), b.view(), (slot(sa), slot(sb)), (m, n, k));
    let cases: [(&str, Fp8Gemm<'_, F8E4M3, F8E4M3>, f32); 4] = [
        ("scales in slots 1 and 2", g(1, 2), 12.0 * 8.0),
        ("in place, beta 1", Fp8Gemm { beta: 1.0, ..g(0, 0) }, 13.0),
        (
            "fast accumulation with a bias",
            Fp8Gemm { fast_accum: true, epilogue: Epilogue::Bias(bias.view()), ..g(0, 0) },
            12.5,
        ),
        (
            "fast accumulation with a bias, scales in slots",
            Fp8Gemm { fast_accum: true, epilogue: Epilogue::Bias(bias.view()), ..g(3, 0) },
            12.0 * 8.0 + 0.5,
        ),
    ];
    for (what, gemm, want) in cases {
        c.write_from(&s, &vec![bf16::from_f32(1.0); m * n])?;
        s.fp8_gemm(gemm).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
        let got = c.to_vec(&s)?[0].to_f32();
        ensure!(got == want, "{what}: {got}, want {want}");
    }
    let packed = Fp8Gemm::new(c.view(), a.view(), b.view(), (scales.slice(1..2), slot(0)), (m, n, k));
    let r = s.fp8_gemm(packed);
    ensure!(matches!(r, Err(Error::Shape { .. })), "a scale 4 bytes into its allocation: {r:?}");
    let ones = dev.alloc_from(&s, &vec![bf16::from_f32(1.0); m])?;
    let dy = dev.alloc_from(&s, &vec![bf16::from_f32(0.25); m * n])?;
    let db = dev.alloc::<bf16>(n)?;
    s.gemm(Gemm::new(db.view(), ones.view(), dy.view(), (1, n, m)))?;
    ensure!(db.to_vec(&s)?[0].to_f32() == 8.0, "the bias gradient's GEMV");
    Ok(())
}

/// f32s between two aligned scales.
const FP8_SCALE_ALIGN: usize = FP8_SCALE_ALIGN_BYTES / 4;

crate::per_device!(
    e4m3_e4m3_gemm_equals_bf16,
    e4m3_e5m2_gemm_equals_bf16,
    e5m2_e4m3_gemm_equals_bf16,
    fast_accumulation_stays_within_rounding,
    a_replay_reads_the_scales_written_since_capture,
    misaligned_or_malformed_fp8_gemms_are_refused,
    fp8_gemms_in_a_training_steps_layouts,
);
