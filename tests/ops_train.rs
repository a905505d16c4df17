//! Training kernels (cross-entropy, embedding, AdamW, dropout and its RNG, casts): gradients
//! against finite differences and host references on the simulator, CUDA against the simulator,
//! graph replays, determinism and shape errors. Every case runs on each device.

mod common;

use anyhow::{ensure, Context};
use common::{adamw_f64, ensure_close, numeric_grad};
use graphed::device::{CaptureMode, Device, DeviceKind, Elem, Stream};
use graphed::memory::CachingAllocator;
use graphed::ops::{adamw, cast, dropout, elementwise, embedding, loss, rng};
use graphed::tensor::Tensor;
use graphed::Error;
use half::bf16;

type Result<T = ()> = anyhow::Result<T>;

/// Deterministic inputs: Knuth's MMIX linear congruential generator.
struct Lcg(u64);

impl Lcg {
    fn next_u32(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 32) as u32
    }

    /// `n` values uniform in `[-scale, scale)`.
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * ((self.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0)).collect()
    }

    /// `n` values below `bound`.
    fn below(&mut self, n: usize, bound: u32) -> Vec<u32> {
        (0..n).map(|_| self.next_u32() % bound).collect()
    }
}

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

    fn zeros<T: Elem>(&self, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::zeros(&self.alloc, &self.s, shape, T::DTYPE)?)
    }
}

/// The simulator to compare a CUDA run against; `None` when `dev` is the simulator.
fn reference(dev: &Device) -> Option<Device> {
    (dev.kind() == DeviceKind::Cuda).then(Device::sim)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

// ---- cross-entropy -----------------------------------------------------------------------------

struct Ce {
    losses: Vec<f32>,
    probs: Vec<f32>,
    dlogits: Vec<f32>,
}

/// Forward and backward of cross-entropy over `(N, v)` logits.
fn cross_entropy(env: &Env, logits: &[f32], targets: &[u32], dlosses: &[f32], v: usize) -> Result<Ce> {
    let n = targets.len();
    let (x, t, dl) = (env.put(logits, &[n, v])?, env.put(targets, &[n])?, env.put(dlosses, &[n])?);
    let (losses, probs, dx) = (env.zeros::<f32>(&[n])?, env.zeros::<f32>(&[n, v])?, env.zeros::<f32>(&[n, v])?);
    loss::cross_entropy_forward(&losses, &probs, &x, &t, &env.s)?;
    loss::cross_entropy_backward(&dx, &probs, &t, &dl, &env.s)?;
    Ok(Ce { losses: losses.to_vec(&env.s)?, probs: probs.to_vec(&env.s)?, dlogits: dx.to_vec(&env.s)? })
}

/// `−log softmax(x)[t]` per row, in f64.
fn cross_entropy_f64(logits: &[f32], targets: &[u32], v: usize) -> Vec<f64> {
    logits
        .chunks(v)
        .zip(targets)
        .map(|(x, &t)| {
            let max = x.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
            let sum: f64 = x.iter().map(|&x| (f64::from(x) - max).exp()).sum();
            sum.ln() - (f64::from(x[t as usize]) - max)
        })
        .collect()
}

/// On the simulator: losses against f64, stability under a large shift, and the gradient of
/// `Σ dlosses·losses` against central differences (eps 1e-2; f32 losses make the quotient good
/// to about 1e-5, the truncation error is below 1e-4). On CUDA: within 1e-4·|x| plus 1e-5
/// (losses) or 1e-6 (probabilities, gradients) of the simulator, as expf, logf and the block's
/// summation order differ from the CPU path by a few ulps; one row is longer than a block.
fn cross_entropy_matches_finite_differences_and_the_simulator(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let mut lcg = Lcg(1);
    if let Some(sim) = reference(dev) {
        let sim = Env::new(&sim)?;
        for (n, v) in [(3, 7), (5, 1000)] {
            let (x, t, dl) = (lcg.vec(n * v, 4.0), lcg.below(n, v as u32), lcg.vec(n, 1.0));
            let (got, want) = (cross_entropy(&env, &x, &t, &dl, v)?, cross_entropy(&sim, &x, &t, &dl, v)?);
            ensure_close("losses", &got.losses, &widen(&want.losses), 1e-5, 1e-4)?;
            ensure_close("probs", &got.probs, &widen(&want.probs), 1e-6, 1e-4)?;
            ensure_close("dlogits", &got.dlogits, &widen(&want.dlogits), 1e-6, 1e-4)?;
        }
        return Ok(());
    }
    let (n, v) = (3, 7);
    let (x, t, dl) = (lcg.vec(n * v, 4.0), lcg.below(n, v as u32), lcg.vec(n, 1.0));
    let got = cross_entropy(&env, &x, &t, &dl, v)?;
    ensure_close("losses", &got.losses, &cross_entropy_f64(&x, &t, v), 1e-6, 1e-5)?;
    let shifted: Vec<f32> = x.iter().map(|x| x + 1000.0).collect();
    let far = cross_entropy(&env, &shifted, &t, &dl, v)?;
    ensure_close("losses of logits + 1000", &far.losses, &widen(&got.losses), 1e-4, 0.0)?;
    let weighted = |x: &[f32]| -> Result<f64> {
        let ce = cross_entropy(&env, x, &t, &dl, v)?;
        Ok(ce.losses.iter().zip(&dl).map(|(&l, &w)| f64::from(l) * f64::from(w)).sum())
    };
    let numeric = numeric_grad(weighted, &x, 1e-2)?;
    ensure_close("dlogits", &got.dlogits, &numeric, 5e-4, 1e-3)
}

// ---- embedding ---------------------------------------------------------------------------------

/// Sizes of an embedding case.
#[derive(Clone, Copy)]
struct EmbDims {
    b: usize,
    t: usize,
    c: usize,
    v: usize,
    t_max: usize,
}

struct EmbCase {
    tokens: Vec<u32>,
    wte: Vec<f32>,
    wpe: Vec<f32>,
    dout: Vec<f32>,
    dwte0: Vec<f32>,
    dwpe0: Vec<f32>,
}

impl EmbCase {
    fn new(d: EmbDims, lcg: &mut Lcg) -> EmbCase {
        EmbCase {
            tokens: lcg.below(d.b * d.t, d.v as u32),
            wte: lcg.vec(d.v * d.c, 1.0),
            wpe: lcg.vec(d.t_max * d.c, 1.0),
            dout: lcg.vec(d.b * d.t * d.c, 1.0),
            dwte0: lcg.vec(d.v * d.c, 1.0),
            dwpe0: lcg.vec(d.t_max * d.c, 1.0),
        }
    }
}

struct Emb {
    out: Vec<f32>,
    dwte: Vec<f32>,
    dwpe: Vec<f32>,
}

/// Forward, then backward accumulating into `dwte0` and `dwpe0`.
fn embed(env: &Env, d: EmbDims, e: &EmbCase) -> Result<Emb> {
    let tokens = env.put(&e.tokens, &[d.b, d.t])?;
    let (wte, wpe) = (env.put(&e.wte, &[d.v, d.c])?, env.put(&e.wpe, &[d.t_max, d.c])?);
    let (dwte, dwpe) = (env.put(&e.dwte0, &[d.v, d.c])?, env.put(&e.dwpe0, &[d.t_max, d.c])?);
    let (out, dout) = (env.zeros::<f32>(&[d.b, d.t, d.c])?, env.put(&e.dout, &[d.b, d.t, d.c])?);
    embedding::embedding_forward(&out, &tokens, &wte, &wpe, &env.s)?;
    embedding::embedding_backward(&dwte, &dwpe, &dout, &tokens, &env.s)?;
    Ok(Emb { out: out.to_vec(&env.s)?, dwte: dwte.to_vec(&env.s)?, dwpe: dwpe.to_vec(&env.s)? })
}

/// On the simulator: the forward exactly, and the gradients of `Σ dout·out` with respect to
/// both tables against central differences (the loss is linear, so only rounding remains),
/// accumulated onto nonzero gradients. On CUDA: bitwise equal to the simulator (both sum in
/// position order), with positions beyond one block and a vocabulary of several blocks.
fn embedding_matches_finite_differences_and_the_simulator(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let mut lcg = Lcg(2);
    if let Some(sim) = reference(dev) {
        let d = EmbDims { b: 4, t: 70, c: 48, v: 50, t_max: 80 };
        let case = EmbCase::new(d, &mut lcg);
        let (got, want) = (embed(&env, d, &case)?, embed(&Env::new(&sim)?, d, &case)?);
        ensure!(bits(&got.out) == bits(&want.out), "forward differs from the simulator");
        ensure!(bits(&got.dwte) == bits(&want.dwte), "dwte differs from the simulator");
        ensure!(bits(&got.dwpe) == bits(&want.dwpe), "dwpe differs from the simulator");
        return Ok(());
    }
    let d = EmbDims { b: 2, t: 3, c: 3, v: 5, t_max: 4 };
    let mut case = EmbCase::new(d, &mut lcg);
    case.tokens[4] = case.tokens[0]; // a repeated token sums two positions
    let got = embed(&env, d, &case)?;
    for (p, &tok) in case.tokens.iter().enumerate() {
        for c in 0..d.c {
            let want = case.wte[tok as usize * d.c + c] + case.wpe[(p % d.t) * d.c + c];
            ensure!(got.out[p * d.c + c] == want, "out[{p}, {c}]");
        }
    }
    let split = d.v * d.c;
    let tables: Vec<f32> = case.wte.iter().chain(&case.wpe).copied().collect();
    let objective = |x: &[f32]| -> Result<f64> {
        let tokens = env.put(&case.tokens, &[d.b, d.t])?;
        let (wte, wpe) = (env.put(&x[..split], &[d.v, d.c])?, env.put(&x[split..], &[d.t_max, d.c])?);
        let out = env.zeros::<f32>(&[d.b, d.t, d.c])?;
        embedding::embedding_forward(&out, &tokens, &wte, &wpe, &env.s)?;
        Ok(out.to_vec::<f32>(&env.s)?.iter().zip(&case.dout).map(|(&y, &g)| f64::from(y) * f64::from(g)).sum())
    };
    let numeric = numeric_grad(objective, &tables, 1e-2)?;
    let want_dwte: Vec<f64> = case.dwte0.iter().zip(&numeric[..split]).map(|(&a, g)| f64::from(a) + g).collect();
    let want_dwpe: Vec<f64> = case.dwpe0.iter().zip(&numeric[split..]).map(|(&a, g)| f64::from(a) + g).collect();
    ensure_close("dwte", &got.dwte, &want_dwte, 1e-4, 1e-4)?;
    ensure_close("dwpe", &got.dwpe, &want_dwpe, 1e-4, 1e-4)?;
    ensure!(got.dwpe[d.t * d.c..] == case.dwpe0[d.t * d.c..], "rows of wpe beyond T get no gradient");
    Ok(())
}

/// A token not below V: the simulator fails the launch at the next synchronizing call; CUDA
/// skips it (zero token embedding forward, no gradient backward).
fn embedding_out_of_range_tokens_fail_on_the_simulator_and_are_skipped_on_cuda(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let d = EmbDims { b: 1, t: 2, c: 2, v: 3, t_max: 2 };
    let mut case = EmbCase::new(d, &mut Lcg(3));
    case.tokens = vec![1, 3];
    if dev.kind() == DeviceKind::Sim {
        let tokens = env.put(&case.tokens, &[1, 2])?;
        let (wte, wpe) = (env.put(&case.wte, &[3, 2])?, env.put(&case.wpe, &[2, 2])?);
        let out = env.zeros::<f32>(&[1, 2, 2])?;
        embedding::embedding_forward(&out, &tokens, &wte, &wpe, &env.s)?;
        let failed = out.to_vec::<f32>(&env.s);
        ensure!(matches!(failed, Err(Error::KernelFailed { .. })), "forward: {failed:?}");
        embedding::embedding_backward(&wte, &wpe, &out, &tokens, &env.s)?;
        let failed = wte.to_vec::<f32>(&env.s);
        ensure!(matches!(failed, Err(Error::KernelFailed { .. })), "backward: {failed:?}");
        return Ok(());
    }
    let got = embed(&env, d, &case)?;
    ensure!(got.out[2..] == case.wpe[2..], "the skipped token's position gets only wpe");
    let mut want_dwte = case.dwte0.clone();
    want_dwte[2] += case.dout[0];
    want_dwte[3] += case.dout[1];
    ensure!(got.dwte == want_dwte, "only token 1 gets gradient: {:?} vs {want_dwte:?}", got.dwte);
    Ok(())
}

// ---- AdamW -------------------------------------------------------------------------------------

/// Three replays of one captured optimizer graph (advance t, then step), with new gradients
/// and a new learning rate written before each, against the f64 reference within
/// 1e-6 + 1e-5·|x| (f32 arithmetic; CUDA's powf and FMAs round differently from the CPU path).
fn adamw_matches_pytorch_over_three_replays_of_one_graph(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let n = 1000;
    let mut lcg = Lcg(4);
    let hyper = adamw::AdamWHyper { weight_decay: 0.1, ..adamw::AdamWHyper::default() };
    let p0 = lcg.vec(n, 1.0);
    let params = env.put(&p0, &[n])?;
    let (grads, m, v) = (env.zeros::<f32>(&[n])?, env.zeros::<f32>(&[n])?, env.zeros::<f32>(&[n])?);
    let (lr, t) = (env.zeros::<f32>(&[1])?, env.zeros::<u64>(&[1])?);
    let guard = adamw::nonfinite_guard(&env.alloc, &env.s)?;
    let cap = env.s.capture(CaptureMode::ThreadLocal)?;
    rng::step_add(&t, 1, &env.s)?;
    adamw::adamw_step(&params, None, &grads, &m, &v, &lr, &t, &guard, &hyper, &env.s)?;
    let exec = cap.finish()?.instantiate()?;
    let (mut p_ref, mut m_ref, mut v_ref) = (widen(&p0), vec![0.0; n], vec![0.0; n]);
    for (step, rate) in [(1, 1e-2f32), (2, 5e-3), (3, 2e-3)] {
        let g = lcg.vec(n, 0.5);
        grads.buffer("test")?.write_from(&env.s, &g)?;
        elementwise::fill(lr.view::<f32>()?, rate, &env.s)?;
        exec.launch(&env.s)?;
        adamw_f64(&mut p_ref, &mut m_ref, &mut v_ref, &g, f64::from(rate), step, &hyper);
        ensure!(t.to_vec::<u64>(&env.s)? == vec![step as u64], "the graph advances t");
        ensure_close(&format!("params after step {step}"), &params.to_vec(&env.s)?, &p_ref, 1e-6, 1e-5)?;
        ensure_close(&format!("m after step {step}"), &m.to_vec(&env.s)?, &m_ref, 1e-7, 1e-5)?;
        ensure_close(&format!("v after step {step}"), &v.to_vec(&env.s)?, &v_ref, 1e-9, 1e-5)?;
    }
    Ok(())
}

// ---- dropout and random bits -------------------------------------------------------------------

struct Dropped {
    out: Vec<f32>,
    mask: Vec<u8>,
}

fn drop_eager(env: &Env, x: &[f32], p: f32, seed: u32, site: u32, step: u64) -> Result<Dropped> {
    let shape = [x.len()];
    let (inp, out, mask) = (env.put(x, &shape)?, env.zeros::<f32>(&shape)?, env.zeros::<u8>(&shape)?);
    let step_buf = env.zeros::<u64>(&[1])?;
    rng::step_write(&step_buf, step, &env.s)?;
    dropout::dropout_forward(&out, &mask, &inp, p, seed, site, &step_buf, &env.s)?;
    Ok(Dropped { out: out.to_vec(&env.s)?, mask: mask.to_vec(&env.s)? })
}

/// p = 0.25 over 2^16 elements keeps 0.75 ± 0.01 (over 5 standard deviations); kept values are
/// exactly `x·(1/(1 − p))`, dropped ones 0, and the backward applies the same mask and scale;
/// p = 0 is the identity.
fn dropout_keeps_about_1_minus_p_and_scales_kept_values(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let n = 1 << 16;
    let mut lcg = Lcg(5);
    let (x, dy) = (lcg.vec(n, 2.0), lcg.vec(n, 2.0));
    let (p, scale) = (0.25f32, 1.0 / (1.0 - 0.25f32));
    let fwd = drop_eager(&env, &x, p, 7, 0, 1)?;
    let kept = fwd.mask.iter().filter(|&&m| m == 1).count() as f64 / n as f64;
    ensure!((kept - 0.75).abs() < 0.01, "kept fraction {kept}");
    ensure!(fwd.mask.iter().all(|&m| m <= 1), "mask values are 0 or 1");
    for (i, ((&y, &m), &x)) in fwd.out.iter().zip(&fwd.mask).zip(&x).enumerate() {
        let want = if m == 1 { x * scale } else { 0.0 };
        ensure!(y.to_bits() == want.to_bits(), "out[{i}] = {y} vs {want}");
    }
    let (dout, mask, dinp) = (env.put(&dy, &[n])?, env.put(&fwd.mask, &[n])?, env.zeros::<f32>(&[n])?);
    dropout::dropout_backward(&dinp, &dout, &mask, p, &env.s)?;
    let dinp = dinp.to_vec::<f32>(&env.s)?;
    for (i, ((&dx, &m), &dy)) in dinp.iter().zip(&fwd.mask).zip(&dy).enumerate() {
        let want = if m == 1 { dy * scale } else { 0.0 };
        ensure!(dx.to_bits() == want.to_bits(), "dinp[{i}] = {dx} vs {want}");
    }
    let identity = drop_eager(&env, &x[..1000], 0.0, 7, 0, 1)?;
    ensure!(bits(&identity.out) == bits(&x[..1000]) && identity.mask.iter().all(|&m| m == 1), "p = 0");
    Ok(())
}

/// Random bits equal the host Philox (Random123's all-zero known answer in the first block) and
/// dropout's masks and outputs equal the simulator's, bit for bit.
fn random_bits_and_dropout_are_bitwise_equal_to_the_host_and_the_simulator(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let step = env.zeros::<u64>(&[1])?;
    let out = env.zeros::<u32>(&[1003])?;
    rng::random_bits(&out, 0, 0, &step, &env.s)?;
    let zero = out.to_vec::<u32>(&env.s)?;
    ensure!(zero[..4] == [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8], "Philox KAT: {:x?}", &zero[..4]);
    rng::step_write(&step, 0x1_0000_0002, &env.s)?;
    rng::random_bits(&out, 0xdead_beef, 17, &step, &env.s)?;
    let got = out.to_vec::<u32>(&env.s)?;
    for (i, &g) in got.iter().enumerate() {
        ensure!(g == rng::random_u32(0xdead_beef, 17, 0x1_0000_0002, i as u64), "bits[{i}]");
    }
    let sim = reference(dev).unwrap_or_else(Device::sim);
    let sim = Env::new(&sim)?;
    let x = Lcg(6).vec(4099, 1.0);
    for (p, site, step) in [(0.1, 0, 1), (0.5, 3, 2), (0.9, 3, u64::MAX)] {
        let (got, want) = (drop_eager(&env, &x, p, 99, site, step)?, drop_eager(&sim, &x, p, 99, site, step)?);
        ensure!(got.mask == want.mask, "masks differ at p {p}, site {site}, step {step}");
        ensure!(bits(&got.out) == bits(&want.out), "outputs differ at p {p}, site {site}, step {step}");
    }
    Ok(())
}

/// A captured dropout draws the numbers of the step written before each replay: new numbers for
/// a new step, the same for the same step, and those of an eager launch at that step. Another
/// site draws other numbers.
fn dropout_in_a_graph_draws_the_numbers_of_the_written_step(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let n = 4096;
    let x = Lcg(7).vec(n, 1.0);
    let (inp, out, mask) = (env.put(&x, &[n])?, env.zeros::<f32>(&[n])?, env.zeros::<u8>(&[n])?);
    let step = env.zeros::<u64>(&[1])?;
    let cap = env.s.capture(CaptureMode::ThreadLocal)?;
    dropout::dropout_forward(&out, &mask, &inp, 0.5, 11, 2, &step, &env.s)?;
    let exec = cap.finish()?.instantiate()?;
    let replay = |at: u64| -> Result<Vec<u8>> {
        rng::step_write(&step, at, &env.s)?;
        exec.launch(&env.s)?;
        Ok(mask.to_vec(&env.s)?)
    };
    let (first, second, again) = (replay(5)?, replay(6)?, replay(5)?);
    let differ = first.iter().zip(&second).filter(|(a, b)| a != b).count();
    ensure!(differ > n / 4, "steps 5 and 6 share {} of {n} mask values", n - differ);
    ensure!(first == again, "the same step draws the same numbers");
    ensure!(drop_eager(&env, &x, 0.5, 11, 2, 6)?.mask == second, "a replay draws as an eager launch");
    ensure!(drop_eager(&env, &x, 0.5, 11, 3, 5)?.mask != first, "another site draws other numbers");
    Ok(())
}

// ---- casts and residual add --------------------------------------------------------------------

/// f32 → bf16 equals `half::bf16::from_f32` bit for bit on specials, ties, subnormals and random
/// bit patterns; every bf16 → f32 equals `to_f32`, and back gives the same bf16 (NaNs: quieted,
/// as `half`). `residual_add` is the f32 sum exactly.
fn casts_are_bitwise_equal_to_half(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let special: [u32; 16] = [
        0x0000_0000,
        0x8000_0000,
        0x3f80_0000,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0x7f80_0001,
        0xff81_2345,
        0x7f7f_ffff,
        0x0000_0001,
        0x807f_ffff,
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_8001,
        0x3f80_7fff,
        0x7f7f_8000,
    ];
    let mut lcg = Lcg(8);
    let x: Vec<f32> = special.iter().copied().chain((0..4096).map(|_| lcg.next_u32())).map(f32::from_bits).collect();
    let (inp, half_out) = (env.put(&x, &[x.len()])?, env.zeros::<bf16>(&[x.len()])?);
    cast::cast(&half_out, &inp, &env.s)?;
    for (i, (got, &x)) in half_out.to_vec::<bf16>(&env.s)?.iter().zip(&x).enumerate() {
        let want = bf16::from_f32(x);
        ensure!(
            got.to_bits() == want.to_bits(),
            "[{i}] {:#010x}: {:#06x} vs {:#06x}",
            x.to_bits(),
            got.to_bits(),
            want.to_bits()
        );
    }
    let every: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let (h, wide, back) =
        (env.put(&every, &[every.len()])?, env.zeros::<f32>(&[every.len()])?, env.zeros::<bf16>(&[every.len()])?);
    cast::cast(&wide, &h, &env.s)?;
    cast::cast(&back, &wide, &env.s)?;
    let (wide, back) = (wide.to_vec::<f32>(&env.s)?, back.to_vec::<bf16>(&env.s)?);
    for (i, h) in every.iter().enumerate() {
        ensure!(wide[i].to_bits() == h.to_f32().to_bits(), "to f32 of {:#06x}", h.to_bits());
        let want = if h.is_nan() { h.to_bits() | 0x0040 } else { h.to_bits() };
        ensure!(back[i].to_bits() == want, "round trip of {:#06x}: {:#06x}", h.to_bits(), back[i].to_bits());
    }
    let (a, b) = (lcg.vec(300, 10.0), lcg.vec(300, 10.0));
    let (ta, tb, sum) = (env.put(&a, &[3, 100])?, env.put(&b, &[3, 100])?, env.zeros::<f32>(&[3, 100])?);
    cast::residual_add(&sum, &ta, &tb, &env.s)?;
    let want: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
    ensure!(bits(&sum.to_vec(&env.s)?) == bits(&want), "residual_add");
    Ok(())
}

// ---- determinism and errors --------------------------------------------------------------------

/// The reducing kernels give bitwise equal results when run twice.
fn reductions_are_deterministic(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let mut lcg = Lcg(9);
    let (n, v) = (6, 777);
    let (x, t, dl) = (lcg.vec(n * v, 5.0), lcg.below(n, v as u32), lcg.vec(n, 1.0));
    let (first, second) = (cross_entropy(&env, &x, &t, &dl, v)?, cross_entropy(&env, &x, &t, &dl, v)?);
    ensure!(bits(&first.losses) == bits(&second.losses), "cross-entropy losses");
    ensure!(bits(&first.probs) == bits(&second.probs), "cross-entropy probs");
    ensure!(bits(&first.dlogits) == bits(&second.dlogits), "cross-entropy dlogits");
    let d = EmbDims { b: 3, t: 40, c: 16, v: 30, t_max: 40 };
    let case = EmbCase::new(d, &mut lcg);
    let (first, second) = (embed(&env, d, &case)?, embed(&env, d, &case)?);
    ensure!(bits(&first.dwte) == bits(&second.dwte) && bits(&first.dwpe) == bits(&second.dwpe), "embedding");
    Ok(())
}

fn expect_shape<T: std::fmt::Debug>(what: &str, r: graphed::Result<T>) -> Result {
    ensure!(matches!(r, Err(Error::Shape { .. })), "{what}: expected Error::Shape, got {r:?}");
    Ok(())
}

/// Wrong shapes give `Error::Shape` before anything is enqueued; a strided tensor gives
/// `Error::NotContiguous`, a drop probability of 1 `Error::Unsupported`.
fn bad_shapes_are_refused(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let s = &env.s;
    let f = |shape: &[usize]| env.zeros::<f32>(shape);
    let u = |shape: &[usize]| env.zeros::<u32>(shape);
    let (logits, t3) = (f(&[3, 5])?, u(&[3])?);
    expect_shape("probs", loss::cross_entropy_forward(&f(&[3])?, &f(&[3, 4])?, &logits, &t3, s))?;
    expect_shape("1-D logits", loss::cross_entropy_forward(&f(&[3])?, &f(&[3, 5])?, &f(&[15])?, &t3, s))?;
    expect_shape("targets", loss::cross_entropy_forward(&f(&[3])?, &f(&[3, 5])?, &logits, &u(&[4])?, s))?;
    expect_shape("dlosses", loss::cross_entropy_backward(&f(&[3, 5])?, &logits, &t3, &f(&[2])?, s))?;
    let (tokens, wte, wpe) = (u(&[2, 4])?, f(&[10, 8])?, f(&[6, 8])?);
    expect_shape("out", embedding::embedding_forward(&f(&[2, 4, 7])?, &tokens, &wte, &wpe, s))?;
    expect_shape("Tmax < T", embedding::embedding_forward(&f(&[2, 4, 8])?, &tokens, &wte, &f(&[3, 8])?, s))?;
    expect_shape("wpe's C", embedding::embedding_forward(&f(&[2, 4, 8])?, &tokens, &wte, &f(&[6, 9])?, s))?;
    expect_shape("1-D tokens", embedding::embedding_forward(&f(&[2, 4, 8])?, &u(&[8])?, &wte, &wpe, s))?;
    expect_shape("dout", embedding::embedding_backward(&wte, &wpe, &f(&[2, 5, 8])?, &tokens, s))?;
    let (p, lr, t) = (f(&[10])?, f(&[1])?, env.zeros::<u64>(&[1])?);
    let (h, g) = (adamw::AdamWHyper::default(), adamw::nonfinite_guard(&env.alloc, s)?);
    expect_shape("m", adamw::adamw_step(&p, None, &p, &f(&[9])?, &p, &lr, &t, &g, &h, s))?;
    expect_shape("lr", adamw::adamw_step(&p, None, &p, &p, &p, &f(&[2])?, &t, &g, &h, s))?;
    expect_shape("t", adamw::adamw_step(&p, None, &p, &p, &p, &lr, &env.zeros::<u64>(&[2])?, &g, &h, s))?;
    expect_shape("guard", adamw::adamw_step(&p, None, &p, &p, &p, &lr, &t, &env.zeros::<u64>(&[3])?, &h, s))?;
    let mask = env.zeros::<u8>(&[10])?;
    expect_shape("mask", dropout::dropout_forward(&p, &env.zeros::<u8>(&[11])?, &p, 0.5, 1, 0, &t, s))?;
    expect_shape("step", dropout::dropout_forward(&p, &mask, &p, 0.5, 1, 0, &env.zeros::<u64>(&[2])?, s))?;
    expect_shape("dinp", dropout::dropout_backward(&f(&[2, 5])?, &p, &mask, 0.5, s))?;
    expect_shape("step_write", rng::step_write(&env.zeros::<u64>(&[2])?, 1, s))?;
    expect_shape("cast", cast::cast(&env.zeros::<bf16>(&[2, 5])?, &p, s))?;
    expect_shape("residual", cast::residual_add(&p, &p, &f(&[2, 5])?, s))?;
    let r = dropout::dropout_forward(&p, &mask, &p, 1.0, 1, 0, &t, s);
    ensure!(matches!(r, Err(Error::Unsupported { .. })), "p = 1: {r:?}");
    let strided = f(&[5, 2])?.transpose(0, 1)?;
    let r = cast::residual_add(&f(&[2, 5])?, &strided, &f(&[2, 5])?, s);
    ensure!(matches!(r, Err(Error::NotContiguous { .. })), "strided input: {r:?}");
    s.synchronize().context("nothing was enqueued to fail")?;
    Ok(())
}

// ---- learning-rate schedule and the AdamW optimizer object ---------------------------------------

/// The schedule kernel writes, step after step, the rate the host formula gives (bit for bit:
/// both compute in double and round once) and counts the steps; a graph of the optimizer step
/// follows the schedule on every replay.
fn schedule_follows_the_host_formula_in_a_graph(dev: &Device) -> Result {
    use graphed::graph::make_graphed_fn;
    use graphed::nn::ParamStore;
    use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
    let env = Env::new(dev)?;
    let schedule = LrSchedule::WarmupCosine { peak: 3e-3, warmup: 3, total: 10, floor: 0.1 };
    let store = ParamStore::new(&env.alloc, &env.s, 4)?;
    let p = store.add("p", &[4], &[0.5, -0.5, 1.0, -1.0], &env.s)?;
    let opt = AdamW::new(&env.alloc, &store, AdamWHyper::default(), schedule, &env.s)?;
    let graph = make_graphed_fn(&env.alloc, |s| opt.step(s))?;
    ensure!(opt.steps(&env.s)? == 0, "capturing the step ran it");
    for step in 0..12u64 {
        elementwise::fill(p.grad.view::<f32>()?, 0.25, &env.s)?;
        graph.replay(&env.s)?;
        ensure!(opt.steps(&env.s)? == step + 1, "step {step}: the counter");
        let (got, want) = (opt.learning_rate(&env.s)?, schedule.rate(step));
        ensure!(got.to_bits() == want.to_bits(), "step {step}: rate {got} on the device, {want} on the host");
        ensure!(p.grad.to_vec::<f32>(&env.s)? == vec![0.0; 4], "step {step}: the gradients were zeroed");
    }
    ensure!(schedule.rate(0) < schedule.rate(2) && schedule.rate(11) == schedule.rate(10), "warmup, then the floor");
    let zero_warmup = LrSchedule::WarmupCosine { peak: 1.0, warmup: 0, total: 10, floor: 0.1 };
    let bad = AdamW::new(&env.alloc, &store, AdamWHyper::default(), zero_warmup, &env.s)?;
    ensure!(matches!(bad.step(&env.s), Err(Error::Unsupported { .. })), "a warmup of 0 steps is refused");
    Ok(())
}

// ---- non-finite gradients (issue 30) ---------------------------------------------------------------

/// Steps of a planted run, and the steps whose gradients it plants non-finite values in: at step
/// 3 a NaN in `a`'s last element (flat index 299) and +inf in `b`'s element 600 (index 900), so
/// the lowest index is `a`'s; at step 5 −inf in `b`'s first element.
const PLANTED_STEPS: u64 = 6;
const BAD_STEPS: [u64; 2] = [3, 5];

/// How a planted run steps its optimizer.
#[derive(Clone, Copy, PartialEq)]
enum Drive {
    /// `AdamW::step`.
    Eager,
    /// Replays of one graph of `AdamW::step` (`graph::make_graphed_fn`).
    Graphed,
    /// `AdamW::step`, except that a bad step only advances the step counter, with clean
    /// gradients: what a skipped step must equal.
    CounterOnly,
}

/// A planted run: the optimizer's whole state (store values, master weights, moments, as bits)
/// before the first step and after each, and after each step `check_finite`'s verdict and the
/// skipped count.
struct Planted {
    opt: graphed::optim::AdamW,
    states: Vec<Vec<u32>>,
    finite: Vec<bool>,
    skipped: Vec<u64>,
}

fn planted_run(env: &Env, dtype: graphed::device::DType, nonfinite: adamw::NonFinite, drive: Drive) -> Result<Planted> {
    use graphed::graph::make_graphed_fn;
    use graphed::nn::ParamStore;
    use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
    let s = &env.s;
    let mut lcg = Lcg(30);
    let store = ParamStore::with_dtype(&env.alloc, s, 1000, dtype)?;
    store.add("a", &[300], &lcg.vec(300, 1.0), s)?;
    store.add("b", &[7, 100], &lcg.vec(700, 1.0), s)?;
    let hyper = AdamWHyper { weight_decay: 0.1, nonfinite, ..AdamWHyper::default() };
    let opt = AdamW::new(&env.alloc, &store, hyper, LrSchedule::Constant(1e-2), s)?;
    let graph = match drive {
        Drive::Graphed => Some(make_graphed_fn(&env.alloc, |s| opt.step(s))?),
        _ => None,
    };
    let (grads, values) = (store.grads()?, store.values()?);
    let state = || -> Result<Vec<u32>> {
        let (m, v) = opt.moments();
        let mut bits = Vec::new();
        for t in [&values, opt.master(), m, v] {
            bits.extend(t.to_f32_vec(s)?.into_iter().map(f32::to_bits));
        }
        Ok(bits)
    };
    let (mut states, mut finite, mut skipped) = (vec![state()?], Vec::new(), Vec::new());
    for step in 1..=PLANTED_STEPS {
        let mut g = lcg.vec(1000, 0.5);
        let bad = BAD_STEPS.contains(&step);
        if bad && drive != Drive::CounterOnly {
            if step == BAD_STEPS[0] {
                (g[299], g[900]) = (f32::NAN, f32::INFINITY);
            } else {
                g[300] = f32::NEG_INFINITY;
            }
        }
        grads.copy_from(&Tensor::from_f32(&env.alloc, s, &g, &[1000], dtype)?, s)?;
        match (&graph, drive) {
            (Some(graph), _) => graph.replay(s)?,
            (None, Drive::CounterOnly) if bad => {
                let counter = opt.state().into_iter().find(|(name, _)| *name == "step").context("no step counter")?.1;
                rng::step_add(counter, 1, s)?;
                grads.zero(s)?;
            }
            (None, _) => opt.step(s)?,
        }
        states.push(state()?);
        finite.push(opt.check_finite(s).is_ok());
        skipped.push(opt.skipped_steps(s)?);
    }
    ensure!(opt.steps(s)? == PLANTED_STEPS, "every step advances the counter, skipped or not");
    drop(graph);
    Ok(Planted { opt, states, finite, skipped })
}

/// Under `NonFinite::Stop` (the default) the step with a non-finite gradient and every later one
/// update nothing, and `check_finite` names that step and the parameter of its lowest
/// non-finite gradient; in f32 and in bf16 (whose scan reads bf16 gradients).
fn a_nonfinite_gradient_stops_updates_at_its_step(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    for dtype in [graphed::device::DType::F32, graphed::device::DType::BF16] {
        let run = planted_run(&env, dtype, adamw::NonFinite::Stop, Drive::Eager)?;
        let bad = BAD_STEPS[0] as usize;
        ensure!(run.states[bad - 1] != run.states[bad - 2], "{dtype}: the steps before it update");
        for after in bad..run.states.len() {
            ensure!(
                run.states[after] == run.states[bad - 1],
                "{dtype}: step {after} changed the state of step {}",
                bad - 1
            );
        }
        ensure!(run.finite == [true, true, false, false, false, false], "{dtype}: check_finite {:?}", run.finite);
        ensure!(run.skipped == [0, 0, 1, 2, 3, 4], "{dtype}: skipped {:?}", run.skipped);
        match run.opt.check_finite(&env.s) {
            Err(Error::NonFinite { step: 3, param, skipped: 4 }) if param == "a" => {}
            other => anyhow::bail!("{dtype}: expected step 3 in `a`, 4 skipped: {other:?}"),
        }
    }
    Ok(())
}

/// Under `NonFinite::Skip` only the steps with a non-finite gradient update nothing: the run
/// equals, bit for bit, one whose bad steps only advanced the step counter.
fn a_nonfinite_gradient_skips_only_its_step(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    for dtype in [graphed::device::DType::F32, graphed::device::DType::BF16] {
        let run = planted_run(&env, dtype, adamw::NonFinite::Skip, Drive::Eager)?;
        let reference = planted_run(&env, dtype, adamw::NonFinite::Skip, Drive::CounterOnly)?;
        for step in 1..run.states.len() {
            let skipped = BAD_STEPS.contains(&(step as u64));
            ensure!((run.states[step] == run.states[step - 1]) == skipped, "{dtype}: step {step} skipped: {skipped}");
            ensure!(run.states[step] == reference.states[step], "{dtype}: step {step} differs from the reference");
        }
        ensure!(run.finite.iter().all(|&f| f), "{dtype}: check_finite passes under Skip");
        ensure!(run.skipped == [0, 0, 1, 1, 2, 2], "{dtype}: skipped {:?}", run.skipped);
        ensure!(reference.skipped == [0; 6], "{dtype}: the reference skipped nothing");
    }
    Ok(())
}

/// A graph of the optimizer step (its scan, its guard and the skipped update included) does what
/// the eager step does, bit for bit, under both policies.
fn a_graphed_optimizer_step_guards_as_the_eager_one(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    for dtype in [graphed::device::DType::F32, graphed::device::DType::BF16] {
        for policy in [adamw::NonFinite::Stop, adamw::NonFinite::Skip] {
            let eager = planted_run(&env, dtype, policy, Drive::Eager)?;
            let graphed = planted_run(&env, dtype, policy, Drive::Graphed)?;
            ensure!(graphed.states == eager.states, "{dtype} {policy:?}: graphed and eager states differ");
            ensure!((&graphed.finite, &graphed.skipped) == (&eager.finite, &eager.skipped), "{dtype} {policy:?}");
            let verdict = |r: &Planted| r.opt.check_finite(&env.s).map_err(|e| e.to_string());
            ensure!(verdict(&graphed) == verdict(&eager), "{dtype} {policy:?}: {:?}", verdict(&graphed));
        }
    }
    Ok(())
}

per_device!(
    schedule_follows_the_host_formula_in_a_graph,
    cross_entropy_matches_finite_differences_and_the_simulator,
    embedding_matches_finite_differences_and_the_simulator,
    embedding_out_of_range_tokens_fail_on_the_simulator_and_are_skipped_on_cuda,
    adamw_matches_pytorch_over_three_replays_of_one_graph,
    dropout_keeps_about_1_minus_p_and_scales_kept_values,
    random_bits_and_dropout_are_bitwise_equal_to_the_host_and_the_simulator,
    dropout_in_a_graph_draws_the_numbers_of_the_written_step,
    casts_are_bitwise_equal_to_half,
    reductions_are_deterministic,
    bad_shapes_are_refused,
    a_nonfinite_gradient_stops_updates_at_its_step,
    a_nonfinite_gradient_skips_only_its_step,
    a_graphed_optimizer_step_guards_as_the_eager_one,
);
