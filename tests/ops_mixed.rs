//! Mixed precision (issue 13): the f32 and bf16 variants of the elementwise ops, casts, residual
//! add, dropout, head permutes, embedding, cross-entropy and AdamW against host references on the
//! simulator, CUDA against the simulator (bitwise for the exact ops), and the refusal of element
//! types an op does not take. Every case runs on each device.

mod common;

use anyhow::ensure;
use common::{adamw_f64, ensure_close, lcg};
use graphed::device::{DType, Device, DeviceKind, Elem, Float, Stream};
use graphed::graph::make_graphed_fn;
use graphed::memory::CachingAllocator;
use graphed::nn::ParamStore;
use graphed::ops::{adamw, cast, copy, dropout, elementwise, embedding, heads, loss, rng};
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;
use graphed::Error;
use half::bf16;

type Result<T = ()> = anyhow::Result<T>;

/// A stream and an allocator of one device.
struct Env {
    s: Stream,
    alloc: CachingAllocator,
}

impl Env {
    fn new(dev: &Device) -> Result<Env> {
        Ok(Env { s: dev.stream()?, alloc: CachingAllocator::new(dev) })
    }

    fn put<T: Elem>(&self, data: &[T], shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_host(&self.alloc, &self.s, data, shape)?)
    }

    /// `data` rounded to `dtype` (f32 or bf16).
    fn put_as(&self, dtype: DType, data: &[f32], shape: &[usize]) -> Result<Tensor> {
        match dtype {
            DType::BF16 => self.put(&round(data), shape),
            _ => self.put(data, shape),
        }
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Ok(Tensor::zeros(&self.alloc, &self.s, shape, dtype)?)
    }

    /// The elements widened to f32, as bits (exact for f32 and bf16 values without NaNs).
    fn bits(&self, t: &Tensor) -> Result<Vec<u32>> {
        Ok(t.to_f32_vec(&self.s)?.iter().map(|v| v.to_bits()).collect())
    }
}

/// The simulator to compare a CUDA run against; `None` when `dev` is the simulator.
fn reference(dev: &Device) -> Option<Device> {
    (dev.kind() == DeviceKind::Cuda).then(Device::sim)
}

fn round(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// `v` as the element type `dtype` stores it (f32: unchanged; bf16: rounded to nearest even).
fn stored(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn stored_bits(dtype: DType, v: impl IntoIterator<Item = f32>) -> Vec<u32> {
    v.into_iter().map(|v| stored(dtype, v).to_bits()).collect()
}

/// Values of all magnitudes, with many exact bf16 ties (low 16 bits 0x8000) to check the
/// rounding of results that land on them.
fn values(n: usize, seed: u64) -> Vec<f32> {
    lcg(n, seed)
        .iter()
        .enumerate()
        .map(|(i, &u)| match i % 5 {
            0 => f32::from_bits((u.to_bits() & 0xffff_0000) | 0x8000),
            1 => u * 1e-3,
            2 => u * 300.0,
            _ => u,
        })
        .collect()
}

// ---- elementwise, casts and the residual add -----------------------------------------------------

/// Every elementwise op, the residual add and the casts on one device, for element type `T`:
/// the outputs as f32 bits, with the name of each.
fn elementwise_outputs<T: Float>(
    env: &Env,
    x: &[f32],
    y: &[f32],
    offset: usize,
) -> Result<Vec<(&'static str, Vec<u32>)>> {
    let (n, dtype) = (x.len(), T::DTYPE);
    // Views that start `offset` elements into their buffers: offset 1 is not 16-byte aligned, so
    // CUDA takes the one-element path; offset 0 takes 16-byte chunks and a tail.
    let at = |data: &[f32]| -> Result<Tensor> {
        let mut padded = vec![0.0; offset];
        padded.extend_from_slice(data);
        Ok(env.put_as(dtype, &padded, &[offset + n])?.narrow(0, offset, n)?)
    };
    let mut out = Vec::new();
    let t = at(y)?;
    elementwise::fill(t.view::<T>()?, x[0], &env.s)?;
    out.push(("fill", env.bits(&t)?));
    let t = at(y)?;
    elementwise::scale(t.view::<T>()?, at(x)?.view::<T>()?, 0.7, &env.s)?;
    out.push(("scale", env.bits(&t)?));
    let t = at(y)?;
    elementwise::axpy(t.view::<T>()?, at(x)?.view::<T>()?, -1.3, &env.s)?;
    out.push(("axpy", env.bits(&t)?));
    let t = at(y)?;
    elementwise::add_scalar(t.view::<T>()?, 0.375, &env.s)?;
    out.push(("add_scalar", env.bits(&t)?));
    let t = at(y)?;
    elementwise::accumulate(&t, &at(x)?, &env.s)?;
    out.push(("accumulate", env.bits(&t)?));
    let t = at(y)?;
    cast::residual_add(&t, &at(x)?, &at(y)?, &env.s)?;
    out.push(("residual_add", env.bits(&t)?));
    let other = if dtype == DType::F32 { DType::BF16 } else { DType::F32 };
    let wide = env.zeros(&[offset + n], other)?.narrow(0, offset, n)?;
    cast::cast(&wide, &at(x)?, &env.s)?;
    out.push(("cast", env.bits(&wide)?));
    let same = env.zeros(&[n], dtype)?;
    cast::cast(&same, &at(x)?, &env.s)?;
    out.push(("cast to the same type", env.bits(&same)?));
    Ok(out)
}

/// The host reference of [`elementwise_outputs`]: the f32 computation on the stored operands,
/// rounded once to the element type.
fn elementwise_reference(dtype: DType, x: &[f32], y: &[f32]) -> Vec<(&'static str, Vec<u32>)> {
    let (x, y): (Vec<f32>, Vec<f32>) =
        (x.iter().map(|&v| stored(dtype, v)).collect(), y.iter().map(|&v| stored(dtype, v)).collect());
    let pairs = || x.iter().zip(&y);
    let other = if dtype == DType::F32 { DType::BF16 } else { DType::F32 };
    vec![
        ("fill", stored_bits(dtype, y.iter().map(|_| x[0]))),
        ("scale", stored_bits(dtype, x.iter().map(|&x| 0.7 * x))),
        ("axpy", stored_bits(dtype, pairs().map(|(&x, &y)| (-1.3f32).mul_add(x, y)))),
        ("add_scalar", stored_bits(dtype, y.iter().map(|&y| y + 0.375))),
        ("accumulate", stored_bits(dtype, pairs().map(|(&x, &y)| y + x))),
        ("residual_add", stored_bits(dtype, pairs().map(|(&x, &y)| x + y))),
        ("cast", stored_bits(other, x.iter().copied())),
        ("cast to the same type", stored_bits(dtype, x.iter().copied())),
    ]
}

/// fill, scale, axpy, add_scalar, accumulate, residual_add and the casts, in f32 and bf16, on
/// 16-byte aligned views (chunks and a tail of 3) and views one element in (unaligned): bitwise
/// equal to `bf16::from_f32` (or f32) of the f32 computation on the stored operands, on either
/// device; on CUDA also bitwise equal to the simulator.
fn elementwise_ops_round_once_and_match_the_simulator(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let sim = reference(dev).map(|d| Env::new(&d)).transpose()?;
    for (seed, (offset, n)) in [(0, 1003), (1, 1001), (0, 5)].into_iter().enumerate() {
        let (x, y) = (values(n, 10 + seed as u64), values(n, 20 + seed as u64));
        for dtype in [DType::F32, DType::BF16] {
            let got = match dtype {
                DType::F32 => elementwise_outputs::<f32>(&env, &x, &y, offset)?,
                _ => elementwise_outputs::<bf16>(&env, &x, &y, offset)?,
            };
            for ((name, got), (_, want)) in got.iter().zip(elementwise_reference(dtype, &x, &y)) {
                let bad = got.iter().zip(&want).position(|(g, w)| g != w);
                ensure!(bad.is_none(), "{name} in {dtype}, offset {offset}, n {n}: first difference at {bad:?}");
            }
            if let Some(sim) = &sim {
                let want = match dtype {
                    DType::F32 => elementwise_outputs::<f32>(sim, &x, &y, offset)?,
                    _ => elementwise_outputs::<bf16>(sim, &x, &y, offset)?,
                };
                for ((name, got), (_, want)) in got.iter().zip(want) {
                    ensure!(*got == want, "{name} in {dtype}, offset {offset}: CUDA differs from the simulator");
                }
            }
        }
    }
    Ok(())
}

// ---- dropout -----------------------------------------------------------------------------------

struct Dropped {
    out: Vec<u32>,
    mask: Vec<u8>,
    dinp: Vec<u32>,
}

/// Forward at (seed 5, site 1, step 3) and backward of `dy`, in `dtype`, on views `offset` in.
fn drop_both(env: &Env, dtype: DType, x: &[f32], dy: &[f32], p: f32, offset: usize) -> Result<Dropped> {
    let n = x.len();
    let at = |data: &[f32]| -> Result<Tensor> {
        let mut padded = vec![0.0; offset];
        padded.extend_from_slice(data);
        Ok(env.put_as(dtype, &padded, &[offset + n])?.narrow(0, offset, n)?)
    };
    let (inp, out, dinp) = (at(x)?, at(x)?, at(x)?);
    let mask = env.zeros(&[offset + n], DType::U8)?.narrow(0, offset, n)?;
    let step = env.zeros(&[1], DType::U64)?;
    rng::step_write(&step, 3, &env.s)?;
    dropout::dropout_forward(&out, &mask, &inp, p, 5, 1, &step, &env.s)?;
    dropout::dropout_backward(&dinp, &at(dy)?, &mask, p, &env.s)?;
    Ok(Dropped { out: env.bits(&out)?, mask: mask.to_vec(&env.s)?, dinp: env.bits(&dinp)? })
}

/// bf16 dropout draws the f32 mask (the same random numbers), its kept values are
/// `bf16(x·(1/(1 − p)))` and dropped ones 0, and the backward applies mask and scale the same way;
/// on 16-byte aligned views (two Philox calls per chunk of 8) and unaligned ones (one group of 4
/// per thread), with a tail. On CUDA: outputs, masks and gradients equal the simulator's bitwise.
fn dropout_in_bf16_draws_the_f32_mask_and_rounds_kept_values(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let sim = reference(dev).map(|d| Env::new(&d)).transpose()?;
    let (p, scale) = (0.3f32, 1.0 / (1.0 - 0.3f32));
    for (offset, n) in [(0, 4099), (1, 4097)] {
        let (x, dy) = (values(n, 30), values(n, 31));
        let wide = drop_both(&env, DType::F32, &x, &dy, p, offset)?;
        let half = drop_both(&env, DType::BF16, &x, &dy, p, offset)?;
        ensure!(half.mask == wide.mask, "offset {offset}: the bf16 mask differs from the f32 one");
        let kept = half.mask.iter().filter(|&&m| m == 1).count() as f64 / n as f64;
        ensure!((kept - 0.7).abs() < 0.03, "offset {offset}: kept fraction {kept}");
        let apply = |v: &[f32]| {
            stored_bits(
                DType::BF16,
                v.iter().zip(&half.mask).map(|(&v, &m)| if m == 1 { stored(DType::BF16, v) * scale } else { 0.0 }),
            )
        };
        ensure!(half.out == apply(&x), "offset {offset}: bf16 forward");
        ensure!(half.dinp == apply(&dy), "offset {offset}: bf16 backward");
        if let Some(sim) = &sim {
            for dtype in [DType::F32, DType::BF16] {
                let (got, want) =
                    (drop_both(&env, dtype, &x, &dy, p, offset)?, drop_both(sim, dtype, &x, &dy, p, offset)?);
                ensure!(got.mask == want.mask, "{dtype}, offset {offset}: masks differ from the simulator");
                ensure!(got.out == want.out, "{dtype}, offset {offset}: outputs differ from the simulator");
                ensure!(got.dinp == want.dinp, "{dtype}, offset {offset}: gradients differ from the simulator");
            }
        }
    }
    Ok(())
}

// ---- attention heads ---------------------------------------------------------------------------

/// `[q, k, v]` of a `(B·T, 3C)` matrix, and the one-block copies of its blocks 0 and 2, moved back
/// into zeroed row matrices by merge_qkv and rows_from_heads; all as f32 bits.
fn permuted(
    env: &Env,
    dtype: DType,
    data: &[f32],
    (b, h, t, hd): (usize, usize, usize, usize),
) -> Result<Vec<Vec<u32>>> {
    let qkv = env.put_as(dtype, data, &[b * t, 3 * h * hd])?;
    let head = || env.zeros(&[b, h, t, hd], dtype);
    let (q, k, v, k1) = (head()?, head()?, head()?, head()?);
    heads::split_qkv(&q, &k, &v, &qkv, &env.s)?;
    heads::heads_from_rows(&k1, &qkv, 2, &env.s)?;
    let (merged, one) = (env.zeros(qkv.shape(), dtype)?, env.zeros(qkv.shape(), dtype)?);
    heads::merge_qkv(&merged, &q, &k, &v, &env.s)?;
    heads::rows_from_heads(&one, 0, &q, &env.s)?;
    [&q, &k, &v, &k1, &merged, &one].iter().map(|t| env.bits(t)).collect()
}

/// split_qkv, merge_qkv, heads_from_rows and rows_from_heads in f32 and bf16, with head widths
/// that are whole 16-byte chunks (hd 8 and 16) and one that is not (hd 3): the host permutation
/// exactly, and on CUDA the simulator's bitwise.
fn head_permutes_are_exact_in_both_types(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let sim = reference(dev).map(|d| Env::new(&d)).transpose()?;
    for dims @ (b, h, t, hd) in [(2, 3, 5, 8), (1, 2, 7, 3), (2, 2, 3, 16)] {
        let c = h * hd;
        let data = values(b * t * 3 * c, 40 + hd as u64);
        for dtype in [DType::F32, DType::BF16] {
            let got = permuted(&env, dtype, &data, dims)?;
            let block = |p: usize| -> Vec<u32> {
                let mut out = Vec::new();
                for (bb, hh, tt, d) in (0..b).flat_map(|bb| {
                    (0..h).flat_map(move |hh| (0..t).flat_map(move |tt| (0..hd).map(move |d| (bb, hh, tt, d))))
                }) {
                    out.push(stored(dtype, data[(bb * t + tt) * 3 * c + p * c + hh * hd + d]).to_bits());
                }
                out
            };
            let all = stored_bits(dtype, data.iter().copied());
            let first: Vec<u32> = all.iter().enumerate().map(|(i, &v)| if i % (3 * c) < c { v } else { 0 }).collect();
            let want = [block(0), block(1), block(2), block(2), all, first];
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                ensure!(g == w, "{dtype}, hd {hd}: output {i} of [q, k, v, k by block, merged, block 0 back]");
            }
            if let Some(sim) = &sim {
                ensure!(got == permuted(sim, dtype, &data, dims)?, "{dtype}, hd {hd}: CUDA differs from the simulator");
            }
        }
    }
    Ok(())
}

// ---- embedding ---------------------------------------------------------------------------------

/// Forward, then backward into gradients that start as `g0`; as f32 bits.
fn embed(
    env: &Env,
    dtype: DType,
    (b, t, c, v): (usize, usize, usize, usize),
    tokens: &[u32],
    tables: [&[f32]; 3],
    g0: [&[f32]; 2],
) -> Result<[Vec<u32>; 3]> {
    let [wte, wpe, dout] = tables;
    let tok = env.put(tokens, &[b, t])?;
    let (wte, wpe) = (env.put_as(dtype, wte, &[v, c])?, env.put_as(dtype, wpe, &[t + 1, c])?);
    let (dwte, dwpe) = (env.put_as(dtype, g0[0], &[v, c])?, env.put_as(dtype, g0[1], &[t + 1, c])?);
    let out = env.zeros(&[b, t, c], dtype)?;
    embedding::embedding_forward(&out, &tok, &wte, &wpe, &env.s)?;
    embedding::embedding_backward(&dwte, &dwpe, &env.put_as(dtype, dout, &[b, t, c])?, &tok, &env.s)?;
    Ok([env.bits(&out)?, env.bits(&dwte)?, env.bits(&dwpe)?])
}

/// bf16 embedding: the forward is `bf16(wte + wpe)` and each gradient element is its f32 sum over
/// positions in order, added to the old value and rounded once (host references, bitwise), and
/// within one bf16 rounding of the f64 sum; C a multiple of 8 (16-byte chunks) and not. On CUDA:
/// forward and gradients bitwise equal to the simulator's, in both types.
fn embedding_in_bf16_rounds_once_and_matches_the_simulator(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let sim = reference(dev).map(|d| Env::new(&d)).transpose()?;
    for dims @ (b, t, c, v) in [(3, 20, 16, 11), (2, 9, 5, 4)] {
        let tokens: Vec<u32> = lcg(b * t, 50).iter().map(|&u| ((u + 1.0) * 1000.0) as u32 % v as u32).collect();
        let (wte, wpe, dout) = (values(v * c, 51), values((t + 1) * c, 52), values(b * t * c, 53));
        let (g_wte, g_wpe) = (values(v * c, 54), values((t + 1) * c, 55));
        let got = embed(&env, DType::BF16, dims, &tokens, [&wte, &wpe, &dout], [&g_wte, &g_wpe])?;
        let s = |x: f32| stored(DType::BF16, x);
        let fwd: Vec<u32> = (0..b * t * c)
            .map(|i| s(s(wte[tokens[i / c] as usize * c + i % c]) + s(wpe[(i / c % t) * c + i % c])).to_bits())
            .collect();
        ensure!(got[0] == fwd, "forward {dims:?}");
        let (mut acc_te, mut acc_pe, mut exact_te) =
            (vec![0.0f32; v * c], vec![0.0f32; (t + 1) * c], vec![0.0f64; v * c]);
        for (p, &tok) in tokens.iter().enumerate() {
            for j in 0..c {
                let d = s(dout[p * c + j]);
                acc_te[tok as usize * c + j] += d;
                exact_te[tok as usize * c + j] += f64::from(d);
            }
        }
        for bb in 0..b {
            for i in 0..t * c {
                acc_pe[i] += s(dout[bb * t * c + i]);
            }
        }
        let dwte: Vec<u32> = g_wte.iter().zip(&acc_te).map(|(&g, &a)| s(s(g) + a).to_bits()).collect();
        let dwpe: Vec<u32> = g_wpe.iter().zip(&acc_pe).map(|(&g, &a)| s(s(g) + a).to_bits()).collect();
        ensure!(got[1] == dwte, "dwte {dims:?}");
        ensure!(got[2] == dwpe, "dwpe {dims:?}");
        let exact: Vec<f64> = g_wte.iter().zip(&exact_te).map(|(&g, &a)| f64::from(s(g)) + a).collect();
        let widened: Vec<f32> = got[1].iter().map(|&b| f32::from_bits(b)).collect();
        ensure_close("dwte against f64", &widened, &exact, 1e-4, 1.0 / 128.0)?;
        if let Some(sim) = &sim {
            for dtype in [DType::F32, DType::BF16] {
                let (got, want) = (
                    embed(&env, dtype, dims, &tokens, [&wte, &wpe, &dout], [&g_wte, &g_wpe])?,
                    embed(sim, dtype, dims, &tokens, [&wte, &wpe, &dout], [&g_wte, &g_wpe])?,
                );
                ensure!(got == want, "{dtype} {dims:?}: CUDA differs from the simulator");
            }
        }
    }
    Ok(())
}

// ---- cross-entropy -----------------------------------------------------------------------------

struct Ce {
    losses: Vec<f32>,
    probs: Vec<f32>,
    dlogits: Vec<f32>,
}

fn cross_entropy(env: &Env, dtype: DType, logits: &[f32], targets: &[u32], dlosses: &[f32], v: usize) -> Result<Ce> {
    let n = targets.len();
    let (x, t, dl) = (env.put_as(dtype, logits, &[n, v])?, env.put(targets, &[n])?, env.put(dlosses, &[n])?);
    let (losses, probs, dx) =
        (env.zeros(&[n], DType::F32)?, env.zeros(&[n, v], DType::F32)?, env.zeros(&[n, v], dtype)?);
    loss::cross_entropy_forward(&losses, &probs, &x, &t, &env.s)?;
    loss::cross_entropy_backward(&dx, &probs, &t, &dl, &env.s)?;
    Ok(Ce { losses: losses.to_vec(&env.s)?, probs: probs.to_vec(&env.s)?, dlogits: dx.to_f32_vec(&env.s)? })
}

/// bf16 logits: losses and probabilities (f32) bitwise equal to those of the same values as f32
/// logits (the widening is exact and the math f32), the losses within 1e-6 + 1e-5·|x| of f64,
/// and the bf16 gradient `bf16((p − onehot)·dl)` of the probabilities it saved, bitwise. On
/// CUDA (a row longer than a block): within 1e-5 + 1e-4·|x| of the simulator for losses and
/// probabilities (expf, logf and the block's order differ by a few ulps), and the bf16 gradient
/// within one bf16 rounding (2⁻⁸·|x|) plus 1e-6 of the simulator's.
fn cross_entropy_of_bf16_logits_is_the_f32_loss_of_their_values(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let (n, v) = (4, 1000);
    let logits: Vec<f32> =
        round(&values(n * v, 60).iter().map(|x| x * 0.02).collect::<Vec<_>>()).iter().map(|h| h.to_f32()).collect();
    let targets: Vec<u32> = (0..n as u32).map(|i| i * 241 % v as u32).collect();
    let dl = lcg(n, 61);
    let half = cross_entropy(&env, DType::BF16, &logits, &targets, &dl, v)?;
    if let Some(sim) = reference(dev) {
        let want = cross_entropy(&Env::new(&sim)?, DType::BF16, &logits, &targets, &dl, v)?;
        let widen = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
        ensure_close("losses", &half.losses, &widen(&want.losses), 1e-5, 1e-4)?;
        ensure_close("probs", &half.probs, &widen(&want.probs), 1e-6, 1e-4)?;
        return ensure_close("dlogits", &half.dlogits, &widen(&want.dlogits), 1e-6, 1.0 / 256.0);
    }
    let wide = cross_entropy(&env, DType::F32, &logits, &targets, &dl, v)?;
    ensure!(half.losses == wide.losses && half.probs == wide.probs, "bf16 logits differ from their f32 values");
    let exact: Vec<f64> = logits
        .chunks(v)
        .zip(&targets)
        .map(|(x, &t)| {
            let max = x.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
            let sum: f64 = x.iter().map(|&x| (f64::from(x) - max).exp()).sum();
            sum.ln() - (f64::from(x[t as usize]) - max)
        })
        .collect();
    ensure_close("losses against f64", &half.losses, &exact, 1e-6, 1e-5)?;
    for (i, (&got, &p)) in half.dlogits.iter().zip(&half.probs).enumerate() {
        let onehot = if i % v == targets[i / v] as usize { 1.0 } else { 0.0 };
        let want = stored(DType::BF16, (p - onehot) * dl[i / v]);
        ensure!(got.to_bits() == want.to_bits(), "dlogits[{i}]: {got} vs {want}");
    }
    Ok(())
}

// ---- mixed-precision AdamW -----------------------------------------------------------------------

/// An optimizer over one parameter of `init` in a store of `dtype`, stepped by one graph.
struct Run {
    p: graphed::nn::Param,
    opt: AdamW,
    graph: graphed::graph::GraphedFn,
}

fn run(env: &Env, dtype: DType, init: &[f32], hyper: AdamWHyper, lr: f32) -> Result<Run> {
    let store = ParamStore::with_dtype(&env.alloc, &env.s, init.len(), dtype)?;
    let p = store.add("p", &[init.len()], init, &env.s)?;
    let opt = AdamW::new(&env.alloc, &store, hyper, LrSchedule::Constant(lr), &env.s)?;
    let graph = make_graphed_fn(&env.alloc, |s| opt.step(s))?;
    Ok(Run { p, opt, graph })
}

impl Run {
    /// Writes `g` (rounded to the store's type) into the gradient and replays the step.
    fn step(&self, env: &Env, g: &[f32]) -> Result<()> {
        self.p.grad.copy_from(&env.put_as(self.p.grad.dtype(), g, self.p.grad.shape())?, &env.s)?;
        Ok(self.graph.replay(&env.s)?)
    }
}

/// A bf16 store's optimizer, stepped by a replayed graph five times: its master weights start at
/// the store's values widened (the initial values here are bf16-exact), its bf16 weights equal bf16(master)
/// bitwise after every step, the master follows PyTorch's AdamW in f64 on the bf16 gradients
/// within 1e-6 + 1e-5·|x| and an all-f32 run on the unrounded gradients within
/// 5·lr·2⁻⁶ = 7.8e-5 (each step's update moves by about 2⁻⁸·lr for gradients rounded by 2⁻⁹
/// relative, well below the 2⁻⁹·|p| that a rounded start would cost). On CUDA: the master within
/// 1e-6 + 1e-5·|x| of the simulator's, the weights its rounding bitwise.
fn mixed_precision_adamw_tracks_f32_and_keeps_the_weights_rounded(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let (n, lr, steps) = (1000, 1e-3f32, 5);
    let hyper = AdamWHyper { weight_decay: 0.1, ..AdamWHyper::default() };
    // Values bf16 holds exactly: the bf16 model's master starts from them widened.
    let init: Vec<f32> =
        round(&lcg(n, 70).iter().map(|x| x * 0.5).collect::<Vec<_>>()).iter().map(|h| h.to_f32()).collect();
    let (half, wide) = (run(&env, DType::BF16, &init, hyper, lr)?, run(&env, DType::F32, &init, hyper, lr)?);
    ensure!(half.opt.master().dtype() == DType::F32 && half.p.value.dtype() == DType::BF16, "types");
    ensure!(half.opt.master().to_vec::<f32>(&env.s)? == init, "the master starts at the f32 initial values");
    let sim = reference(dev).map(|d| -> Result<(Env, Run)> {
        let env = Env::new(&d)?;
        let r = run(&env, DType::BF16, &init, hyper, lr)?;
        Ok((env, r))
    });
    let sim = sim.transpose()?;
    let (mut p_ref, mut m_ref, mut v_ref) =
        (init.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(), vec![0.0; n], vec![0.0; n]);
    let mut drift = 0.0f64;
    for step in 1..=steps {
        let g: Vec<f32> = lcg(n, 80 + step as u64).iter().map(|x| x * 0.1).collect();
        half.step(&env, &g)?;
        wide.step(&env, &g)?;
        let master = half.opt.master().to_vec::<f32>(&env.s)?;
        let weights = half.p.value.to_vec::<bf16>(&env.s)?;
        let rounded = round(&master);
        ensure!(
            weights.iter().map(|w| w.to_bits()).eq(rounded.iter().map(|w| w.to_bits())),
            "step {step}: weights are not bf16(master)"
        );
        if let Some((sim_env, sim_run)) = &sim {
            sim_run.step(sim_env, &g)?;
            let want = sim_run.opt.master().to_vec::<f32>(&sim_env.s)?;
            ensure_close(
                &format!("master after step {step}"),
                &master,
                &want.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
                1e-6,
                1e-5,
            )?;
            continue;
        }
        let g16: Vec<f32> = round(&g).iter().map(|h| h.to_f32()).collect();
        adamw_f64(&mut p_ref, &mut m_ref, &mut v_ref, &g16, f64::from(lr), step, &hyper);
        ensure_close(&format!("master after step {step} against f64"), &master, &p_ref, 1e-6, 1e-5)?;
        let all_f32 = wide.p.value.to_vec::<f32>(&env.s)?;
        drift = master.iter().zip(&all_f32).map(|(a, b)| f64::from((a - b).abs())).fold(drift, f64::max);
    }
    let bound = f64::from(steps as f32 * lr / 64.0);
    ensure!(drift <= bound, "the bf16 model's master drifted {drift} from the all-f32 run (bound {bound})");
    ensure!(half.opt.steps(&env.s)? == steps as u64, "every replay stepped");
    Ok(())
}

// ---- copies ------------------------------------------------------------------------------------

/// `copy::bytes` (the kernel that switchable offload graphs capture for their device copies)
/// copies every bit of any element type: NaN payloads, lengths off the 16-byte chunks, views that
/// start off a chunk's alignment (the byte loop), and nothing outside the destination view. A
/// length mismatch is refused before anything is enqueued.
fn copy_bytes_copies_every_bit_of_any_element_type(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let s = &env.s;
    for n in [1usize, 15, 16, 17, 1000, 4099] {
        let x: Vec<u8> = lcg(n + 3, n as u64).iter().map(|v| (v.to_bits() >> 7) as u8).collect();
        for (at_x, at_y) in [(0, 0), (1, 0), (3, 2)] {
            let (xb, yb) = (dev.alloc_from(s, &x)?, dev.alloc_from(s, &vec![0xA5u8; n + 3])?);
            copy::bytes(yb.slice(at_y..at_y + n), xb.slice(at_x..at_x + n), s)?;
            let y = yb.to_vec(s)?;
            ensure!(y[at_y..at_y + n] == x[at_x..at_x + n], "u8, {n} bytes at {at_x} -> {at_y}");
            ensure!(y[..at_y].iter().chain(&y[at_y + n..]).all(|&b| b == 0xA5), "bytes outside were written");
        }
    }
    // f32 NaNs with payloads and signs, and bf16 signalling NaNs: no arithmetic touches them.
    let f: Vec<f32> = [0x7fc0_0001u32, 0xff80_0002, 0x7f80_0000, 0x8000_0000, 0x3f80_0001]
        .iter()
        .map(|&b| f32::from_bits(b))
        .collect();
    let (fx, fy) = (dev.alloc_from(s, &f)?, dev.alloc::<f32>(f.len())?);
    copy::bytes(fy.view(), fx.view(), s)?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    ensure!(bits(&fy.to_vec(s)?) == bits(&f), "f32 bits");
    let h: Vec<bf16> = [0x7f81u16, 0xffc1, 0x0001, 0x8000].iter().map(|&b| bf16::from_bits(b)).collect();
    let (hx, hy) = (dev.alloc_from(s, &h)?, dev.alloc::<bf16>(h.len())?);
    copy::bytes(hy.view(), hx.view(), s)?;
    ensure!(hy.to_vec(s)?.iter().map(|v| v.to_bits()).eq(h.iter().map(|v| v.to_bits())), "bf16 bits");
    let (kept, four) = (dev.alloc_from(s, &[9u8; 4])?, dev.alloc_from(s, &[1u8; 4])?);
    let r = copy::bytes(kept.slice(..3), four.view(), s);
    ensure!(matches!(r, Err(Error::LengthMismatch { .. })), "unequal lengths: {r:?}");
    ensure!(kept.to_vec(s)? == vec![9u8; 4], "a refused copy wrote");
    Ok(())
}

// ---- refusals ----------------------------------------------------------------------------------

fn expect_dtype_error<T: std::fmt::Debug>(what: &str, op: &str, r: graphed::Result<T>) -> Result {
    match r {
        Err(Error::UnsupportedDType { op: o, .. } | Error::DTypeMismatch { op: o, .. }) if o == op => Ok(()),
        other => anyhow::bail!("{what}: expected a dtype error naming {op}, got {other:?}"),
    }
}

/// Every launcher refuses an element type it does not take (f16, integers) with
/// `UnsupportedDType` and operands that disagree with `DTypeMismatch`, naming its op, before
/// anything is enqueued: the outputs keep their contents and the stream has nothing to fail.
fn wrong_element_types_are_refused_before_anything_runs(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let s = &env.s;
    let filled = |shape: &[usize], dtype: DType| -> Result<Tensor> {
        env.put_as(dtype, &vec![7.0; shape.iter().product()], shape)
    };
    let (f, h) = (filled(&[8], DType::F32)?, filled(&[8], DType::BF16)?);
    let h16 = env.put(&[half::f16::ONE; 8], &[8])?;
    let u = env.zeros(&[8], DType::U32)?;
    let f16_buf = dev.alloc::<half::f16>(8)?;
    expect_dtype_error("fill f16", "fill", elementwise::fill(f16_buf.view(), 1.0, s))?;
    expect_dtype_error("scale f16", "scale", elementwise::scale(f16_buf.view(), f16_buf.view(), 1.0, s))?;
    expect_dtype_error("accumulate mixed", "accumulate", elementwise::accumulate(&f, &h, s))?;
    expect_dtype_error("accumulate u32", "accumulate", elementwise::accumulate(&u, &u, s))?;
    expect_dtype_error("residual_add mixed", "residual_add", cast::residual_add(&h, &f, &h, s))?;
    expect_dtype_error("residual_add f16", "residual_add", cast::residual_add(&h16, &h16, &h16, s))?;
    expect_dtype_error("cast f16", "cast", cast::cast(&f, &h16, s))?;
    expect_dtype_error("cast to u32", "cast", cast::cast(&u, &f, s))?;
    let (mask, step) = (env.zeros(&[8], DType::U8)?, env.zeros(&[1], DType::U64)?);
    expect_dtype_error(
        "dropout mixed",
        "dropout_forward",
        dropout::dropout_forward(&h, &mask, &f, 0.5, 1, 0, &step, s),
    )?;
    expect_dtype_error(
        "dropout f16",
        "dropout_forward",
        dropout::dropout_forward(&h16, &mask, &h16, 0.5, 1, 0, &step, s),
    )?;
    expect_dtype_error("dropout mask", "dropout_forward", dropout::dropout_forward(&f, &u, &f, 0.5, 1, 0, &step, s))?;
    expect_dtype_error("dropout backward", "dropout_backward", dropout::dropout_backward(&f, &h, &mask, 0.5, s))?;
    let qkv = filled(&[2, 6], DType::BF16)?;
    let hf = || filled(&[1, 1, 2, 2], DType::F32);
    let hh = || filled(&[1, 1, 2, 2], DType::BF16);
    expect_dtype_error("split mixed", "split_qkv", heads::split_qkv(&hh()?, &hf()?, &hh()?, &qkv, s))?;
    expect_dtype_error("merge mixed", "merge_qkv", heads::merge_qkv(&qkv, &hh()?, &hh()?, &hf()?, s))?;
    expect_dtype_error("heads_from_rows", "heads_from_rows", heads::heads_from_rows(&hf()?, &qkv, 0, s))?;
    expect_dtype_error("rows_from_heads", "rows_from_heads", heads::rows_from_heads(&qkv, 1, &hf()?, s))?;
    let tokens = env.put(&[0u32, 1], &[1, 2])?;
    let (wte, wpe, out) =
        (filled(&[4, 4], DType::BF16)?, filled(&[2, 4], DType::F32)?, filled(&[1, 2, 4], DType::BF16)?);
    expect_dtype_error(
        "embedding tables",
        "embedding_forward",
        embedding::embedding_forward(&out, &tokens, &wte, &wpe, s),
    )?;
    let wpe_h = filled(&[2, 4], DType::BF16)?;
    let out_f = filled(&[1, 2, 4], DType::F32)?;
    expect_dtype_error(
        "embedding out",
        "embedding_forward",
        embedding::embedding_forward(&out_f, &tokens, &wte, &wpe_h, s),
    )?;
    expect_dtype_error(
        "embedding backward",
        "embedding_backward",
        embedding::embedding_backward(&wte, &wpe_h, &out_f, &tokens, s),
    )?;
    let logits = filled(&[2, 4], DType::BF16)?;
    let (losses, probs, t2) = (filled(&[2], DType::F32)?, filled(&[2, 4], DType::F32)?, env.zeros(&[2], DType::U32)?);
    let probs_h = filled(&[2, 4], DType::BF16)?;
    expect_dtype_error(
        "bf16 probs",
        "cross_entropy_forward",
        loss::cross_entropy_forward(&losses, &probs_h, &logits, &t2, s),
    )?;
    let logits16 = env.put(&[half::f16::ONE; 8], &[2, 4])?;
    expect_dtype_error(
        "f16 logits",
        "cross_entropy_forward",
        loss::cross_entropy_forward(&losses, &probs, &logits16, &t2, s),
    )?;
    expect_dtype_error(
        "f16 dlogits",
        "cross_entropy_backward",
        loss::cross_entropy_backward(&logits16, &probs, &t2, &losses, s),
    )?;
    let (lr, t) = (filled(&[1], DType::F32)?, env.zeros(&[1], DType::U64)?);
    let (hyper, g) = (AdamWHyper::default(), adamw::nonfinite_guard(&env.alloc, s)?);
    expect_dtype_error(
        "bf16 grads of an f32 model",
        "adamw_step",
        adamw::adamw_step(&f, None, &h, &f, &f, &lr, &t, &g, &hyper, s),
    )?;
    expect_dtype_error(
        "f32 grads of a bf16 model",
        "adamw_step",
        adamw::adamw_step(&f, Some(&h), &f, &f, &f, &lr, &t, &g, &hyper, s),
    )?;
    expect_dtype_error(
        "f32 weights",
        "adamw_step",
        adamw::adamw_step(&f, Some(&f), &f, &f, &f, &lr, &t, &g, &hyper, s),
    )?;
    expect_dtype_error(
        "bf16 master",
        "adamw_step",
        adamw::adamw_step(&h, Some(&h), &h, &f, &f, &lr, &t, &g, &hyper, s),
    )?;
    expect_dtype_error(
        "bf16 moments",
        "adamw_step",
        adamw::adamw_step(&f, Some(&h), &h, &h, &f, &lr, &t, &g, &hyper, s),
    )?;
    let r = ParamStore::with_dtype(&env.alloc, s, 4, DType::F16);
    ensure!(matches!(r, Err(Error::UnsupportedDType { dtype: DType::F16, .. })), "an f16 store: {:?}", r.err());
    s.synchronize()?;
    for (name, t) in [
        ("f", &f),
        ("h", &h),
        ("qkv", &qkv),
        ("out", &out),
        ("out_f", &out_f),
        ("probs", &probs),
        ("losses", &losses),
        ("wte", &wte),
    ] {
        ensure!(t.to_f32_vec(s)?.iter().all(|&v| v == 7.0), "{name} was written");
    }
    ensure!(mask.to_vec::<u8>(s)? == vec![0; 8], "the mask was written");
    Ok(())
}

per_device!(
    elementwise_ops_round_once_and_match_the_simulator,
    dropout_in_bf16_draws_the_f32_mask_and_rounds_kept_values,
    head_permutes_are_exact_in_both_types,
    embedding_in_bf16_rounds_once_and_matches_the_simulator,
    cross_entropy_of_bf16_logits_is_the_f32_loss_of_their_values,
    mixed_precision_adamw_tracks_f32_and_keeps_the_weights_rounded,
    wrong_element_types_are_refused_before_anything_runs,
    copy_bytes_copies_every_bit_of_any_element_type,
);
