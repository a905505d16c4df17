//! GEMM (cuBLASLt on CUDA, a CPU loop on the simulator) against a host reference.

use anyhow::ensure;
use graphed::device::{CaptureMode, Device, Gemm, NodeKind};
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
            bias: Some(bias.view()),
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

crate::per_device!(
    f32_gemm_matches_the_reference,
    strided_batched_gemm_on_column_blocks,
    bf16_gemm_accumulates_in_f32,
    gemm_is_captured_as_kernels,
    mismatched_gemm_shapes_are_refused,
);
