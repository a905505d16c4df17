//! FP8 scaling (issue 34, item 3): `ops::fp8::amax` and `cast_transpose` against host references
//! (and `cast::quantize`), the delayed and current scaling updates against TransformerEngine's
//! formula computed on the host over several steps, refusals that write nothing, a graph that
//! replays the casts and the update with the scales of each replay; CUDA bitwise equal to the
//! simulator.

mod common;

use anyhow::ensure;
use float8::{F8E4M3, F8E5M2};
use graphed::device::{DType, Device, DeviceKind, Elem, Stream};
use graphed::graph::make_graphed_fn;
use graphed::memory::CachingAllocator;
use graphed::ops::cast::quantize;
use graphed::ops::fp8::{
    amax, cast_transpose, dgelu_cast_transpose, sum_tiles, tile_rows, Amax, AmaxAlgo, CurrentScaling, DelayedScaling,
    DelayedScalingConfig, Fp8Format, ScalingConfigError, SCALE_INV_STRIDE,
};
use graphed::ops::gelu::gelu_backward;
use graphed::tensor::Tensor;
use graphed::Error;
use half::bf16;

type Result<T = ()> = anyhow::Result<T>;

// ---- host references ------------------------------------------------------------------------------

/// The canonical NaN, as an amax holds it.
const NAN_BITS: u32 = 0x7fff_ffff;

/// max |x| as bits, NaN above everything (the definition the ops document).
fn host_amax(x: &[f32]) -> u32 {
    x.iter().map(|v| if v.is_nan() { NAN_BITS } else { v.abs().to_bits() }).max().unwrap_or(0)
}

/// TransformerEngine's delayed-scaling update (`delayed_scaling.cu`) of one tensor's history
/// (`h[k]` = row k), in f32: returns the new scale.
/// `v` as the device holds it in `dtype` (f32 or bf16).
fn rounded(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn te_update(h: &mut [f32], scale: f32, algo: AmaxAlgo, fp8_max: f32, margin: i32) -> f32 {
    let last = h[0];
    let window_max = h.iter().fold(0.0f32, |m, &v| if v.is_nan() { m } else { m.max(v) });
    h.rotate_left(1);
    h[0] = 0.0;
    let amax = if algo == AmaxAlgo::MostRecent { last } else { window_max };
    let scaled_max = fp8_max * 2f32.powi(-margin);
    let s = if amax.is_finite() && amax > 0.0 { scaled_max / amax } else { scale };
    if s.is_finite() && amax.is_finite() && amax > 1e-30 {
        // The brief's (and TransformerEngine's PyTorch) order gives the same f32 where nothing
        // overflows: dividing by 2^margin is exact.
        assert_eq!(s.to_bits(), (fp8_max / amax / 2f32.powi(margin)).to_bits());
    }
    if s.is_infinite() {
        f32::MAX
    } else {
        s
    }
}

/// `n` values: `lcg` times `mag`, with `specials` written over the first elements.
fn values(n: usize, seed: u64, mag: f32, specials: &[f32]) -> Vec<f32> {
    let mut x: Vec<f32> = common::lcg(n, seed).iter().map(|v| v * mag).collect();
    x.iter_mut().zip(specials).for_each(|(v, s)| *v = *s);
    x
}

// ---- running the ops --------------------------------------------------------------------------------

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

    /// `x` rounded to `dtype` (f32 or bf16).
    fn input(&self, x: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor> {
        Ok(Tensor::from_f32(&self.alloc, &self.s, x, shape, dtype)?)
    }

    fn one(&self, v: f32) -> Result<Tensor> {
        self.put(&[v], &[1])
    }

    fn bits(&self, t: &Tensor) -> Result<Vec<u32>> {
        Ok(t.to_vec::<f32>(&self.s)?.iter().map(|v| v.to_bits()).collect())
    }

    fn bytes(&self, t: &Tensor) -> Result<Vec<u8>> {
        Ok(match t.dtype() {
            DType::F8E4M3 => t.to_vec::<F8E4M3>(&self.s)?.iter().map(F8E4M3::to_bits).collect(),
            _ => t.to_vec::<F8E5M2>(&self.s)?.iter().map(F8E5M2::to_bits).collect(),
        })
    }

    fn fp8(&self, shape: &[usize], format: DType) -> Result<Tensor> {
        Ok(Tensor::zeros(&self.alloc, &self.s, shape, format)?)
    }
}

/// `dev`'s results and, on CUDA, the simulator's for the same call.
fn on_both<T: PartialEq + std::fmt::Debug>(dev: &Device, f: impl Fn(&Env) -> Result<T>) -> Result<T> {
    let got = f(&Env::new(dev)?)?;
    if dev.kind() == DeviceKind::Cuda {
        let sim = f(&Env::new(&Device::sim())?)?;
        ensure!(sim == got, "CUDA differs from the simulator");
    }
    Ok(got)
}

// ---- amax ---------------------------------------------------------------------------------------------

/// f32 and bf16 inputs of several lengths (0, a tail only, chunks and tail, unaligned), with −0,
/// ∞ and NaN: the slot holds the reference's bits, overwritten or accumulated.
fn amax_matches_the_host_reference(dev: &Device) -> Result {
    let cases: [(&str, Vec<f32>); 6] = [
        ("empty", vec![]),
        ("-0", vec![-0.0; 5]),
        ("plain", values(4099, 1, 3.0, &[])),
        ("inf", values(70_000, 2, 1.0, &[0.5, f32::NEG_INFINITY])),
        ("nan", values(1000, 3, 1e30, &[f32::from_bits(0xffc0_0001)])),
        ("tiny", values(33, 4, 1e-39, &[])),
    ];
    for (name, x) in &cases {
        for dtype in [DType::F32, DType::BF16] {
            let rounded: Vec<f32> = x.iter().map(|&v| rounded(v, dtype)).collect();
            let want = host_amax(&rounded);
            for (mode, start) in [(Amax::Overwrite, 7.0f32), (Amax::Accumulate, 0.25)] {
                let got = on_both(dev, |env| {
                    let (slot, inp) = (env.one(start)?, env.input(x, &[x.len()], dtype)?);
                    amax(&slot, &inp, mode, &env.s)?;
                    Ok(env.bits(&slot)?[0])
                })?;
                let want = if mode == Amax::Accumulate { want.max(start.to_bits()) } else { want };
                ensure!(got == want, "{name} {dtype} {mode:?}: {got:#x}, want {want:#x}");
            }
        }
    }
    // An unaligned view takes the element-wise path.
    let x = values(1001, 5, 2.0, &[]);
    let got = on_both(dev, |env| {
        let slot = env.one(0.0)?;
        amax(&slot, &env.put(&x, &[1001])?.narrow(0, 1, 1000)?, Amax::Overwrite, &env.s)?;
        Ok(env.bits(&slot)?[0])
    })?;
    ensure!(got == host_amax(&x[1..]), "unaligned: {got:#x}");
    Ok(())
}

// ---- cast_transpose ---------------------------------------------------------------------------------

/// Which outputs a call asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outs {
    Both,
    Rows,
    Cols,
}

/// What one [`cast_transpose`] call wrote, beside [`quantize`]'s bytes for the same input.
#[derive(Debug, PartialEq)]
struct Cast {
    out: Vec<u8>,
    out_t: Vec<u8>,
    quantized: Vec<u8>,
    amax: u32,
    /// The reference amax of the input as the device holds it, accumulated onto 0.5.
    want_amax: u32,
}

/// `x` as `[rows, cols]` of `dtype`, cast to `format` with scale 1.75 into the outputs `outs`,
/// the amax slot holding 0.5 before.
fn cast_once(
    env: &Env,
    x: &[f32],
    (rows, cols): (usize, usize),
    dtype: DType,
    format: DType,
    outs: Outs,
) -> Result<Cast> {
    let (inp, scale, slot) = (env.input(x, &[rows, cols], dtype)?, env.one(1.75)?, env.one(0.5)?);
    let (out, out_t, want) =
        (env.fp8(&[rows, cols], format)?, env.fp8(&[cols, rows], format)?, env.fp8(&[rows, cols], format)?);
    let o = (outs != Outs::Cols).then_some(&out);
    let t = (outs != Outs::Rows).then_some(&out_t);
    cast_transpose(o, t, &slot, &inp, &scale, &env.s)?;
    quantize(&want, &inp, &scale, &env.s)?;
    Ok(Cast {
        out: env.bytes(&out)?,
        out_t: env.bytes(&out_t)?,
        quantized: env.bytes(&want)?,
        amax: env.bits(&slot)?[0],
        want_amax: host_amax(&inp.to_f32_vec(&env.s)?).max(0.5f32.to_bits()),
    })
}

/// Odd shapes, both input types, both formats, each choice of outputs: the row-major output is
/// `quantize`'s bytes, the transposed one their host transpose, and the amax (accumulated onto
/// 0.5) the reference's. `[200, 264]` has whole tiles, which take the wide accesses, beside edge
/// tiles, which do not.
fn cast_transpose_equals_quantize_and_a_host_transpose(dev: &Device) -> Result {
    for (rows, cols) in [(1, 1), (33, 65), (128, 256), (1000, 3), (64, 68), (200, 264)] {
        let x = values(rows * cols, (rows * 7 + cols) as u64, 300.0, &[-0.0, f32::INFINITY, 1e-3, f32::NAN]);
        for dtype in [DType::F32, DType::BF16] {
            for format in [DType::F8E4M3, DType::F8E5M2] {
                for outs in [Outs::Both, Outs::Rows, Outs::Cols] {
                    let what = format!("[{rows}, {cols}] {dtype} → {format} {outs:?}");
                    let c = on_both(dev, |env| cast_once(env, &x, (rows, cols), dtype, format, outs))?;
                    let zeros = vec![0u8; rows * cols];
                    let transposed: Vec<u8> =
                        (0..rows * cols).map(|k| c.quantized[k % rows * cols + k / rows]).collect();
                    ensure!(
                        c.out == if outs == Outs::Cols { zeros.clone() } else { c.quantized.clone() },
                        "{what}: row-major"
                    );
                    ensure!(
                        c.out_t == if outs == Outs::Rows { zeros } else { transposed },
                        "{what}: transposed output"
                    );
                    ensure!(c.amax == c.want_amax, "{what}: amax {:#x}", c.amax);
                }
            }
        }
    }
    Ok(())
}

// ---- GELU's backward, cast ------------------------------------------------------------------------------

/// Column `c`'s sum over the tile of 64 rows from `r0`, in the order `cast_transpose.cu` states:
/// each of a block's 256 threads (8 per tile row, so 32 rows at a time) adds its rows `first`,
/// `first + 32` from 0; the 4 threads of a warp that share a column combine as a butterfly; the
/// 8 warps are added in order from 0.
fn host_tile_sum(g: &[f32], (rows, cols): (usize, usize), r0: usize, c: usize) -> f32 {
    let thread = |first: usize| {
        [first, first + 32].iter().filter(|&&r| r0 + r < rows).fold(0.0f32, |s, r| s + g[(r0 + r) * cols + c])
    };
    (0..8).fold(0.0f32, |total, warp| {
        let v: Vec<f32> = (0..4).map(|j| thread(4 * warp + j)).collect();
        let v: Vec<f32> = (0..4).map(|j| v[j] + v[j ^ 1]).collect();
        total + (v[0] + v[2])
    })
}

/// `dgelu_cast_transpose` against `gelu_backward` then `cast_transpose` on the same device: the
/// same E5M2 (and E4M3) bytes in both layouts and the same amax, bit for bit; its tile sums are
/// the host's sums of the device's GELU backward in the kernel's order, bit for bit, and `sum_tiles` adds
/// them in tile order, within bf16's rounding of the exact column sums. Odd shapes (partial
/// tiles, narrow columns), a scale that saturates some values, and pre-activations far out on
/// both sides. (The devices' `tanhf` differ in the last bits, so each is compared with itself.)
fn dgelu_cast_transpose_equals_gelu_backward_then_cast(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let shapes = [(1, 8), (33, 72), (64, 64), (130, 264), (200, 68), (256, 512)];
    let cases = shapes.iter().flat_map(|&s| [(s, DType::F8E5M2, 20_000.0f32), (s, DType::F8E4M3, 100.0)]);
    for ((rows, cols), format, scale) in cases {
        let what = format!("[{rows}, {cols}] {format}");
        let n = rows * cols;
        let pre = env.input(&values(n, n as u64, 4.0, &[-0.0, 30.0, -30.0, 1e-3]), &[rows, cols], DType::BF16)?;
        let dout = env.input(&values(n, n as u64 + 1, 2.0, &[]), &[rows, cols], DType::BF16)?;
        let scale = env.one(scale)?;
        let g = env.input(&vec![0.0; n], &[rows, cols], DType::BF16)?;
        gelu_backward(&g, &pre, &dout, &env.s)?;
        let (want, want_t, want_amax) =
            (env.fp8(&[rows, cols], format)?, env.fp8(&[cols, rows], format)?, env.one(0.5)?);
        cast_transpose(Some(&want), Some(&want_t), &want_amax, &g, &scale, &env.s)?;
        let (out, out_t, amax) = (env.fp8(&[rows, cols], format)?, env.fp8(&[cols, rows], format)?, env.one(0.5)?);
        let tiles = env.put(&vec![f32::NAN; tile_rows(rows) * cols], &[tile_rows(rows), cols])?;
        dgelu_cast_transpose((&out, &out_t), &amax, &tiles, (&dout, &pre), &scale, &env.s)?;
        ensure!(env.bytes(&out)? == env.bytes(&want)?, "{what}: row-major bytes");
        ensure!(env.bytes(&out_t)? == env.bytes(&want_t)?, "{what}: transposed bytes");
        ensure!(env.bits(&amax)? == env.bits(&want_amax)?, "{what}: amax");
        let gh = g.to_f32_vec(&env.s)?;
        let want_tiles: Vec<u32> = (0..tile_rows(rows))
            .flat_map(|t| (0..cols).map(move |c| (t, c)))
            .map(|(t, c)| host_tile_sum(&gh, (rows, cols), 64 * t, c).to_bits())
            .collect();
        ensure!(env.bits(&tiles)? == want_tiles, "{what}: tile sums");
        let db = env.input(&vec![f32::NAN; cols], &[cols], DType::BF16)?;
        sum_tiles(&db, &tiles, &env.s)?;
        let tiles = tiles.to_vec::<f32>(&env.s)?;
        for (c, got) in db.to_f32_vec(&env.s)?.iter().enumerate() {
            let summed = (0..tile_rows(rows)).fold(0.0f32, |s, t| s + tiles[t * cols + c]);
            ensure!(got.to_bits() == bf16::from_f32(summed).to_f32().to_bits(), "{what}: column {c} {got} of {summed}");
            let exact: f64 = (0..rows).map(|r| f64::from(gh[r * cols + c])).sum();
            let magnitude: f64 = (0..rows).map(|r| f64::from(gh[r * cols + c].abs())).sum();
            ensure!((f64::from(*got) - exact).abs() <= exact.abs() / 256.0 + magnitude * 1e-6, "{what}: column {c}");
        }
    }
    Ok(())
}

// ---- recipes ------------------------------------------------------------------------------------------

/// Delayed scaling over 7 steps for 3 tensors (one all zeros, one with a NaN at step 3 and ∞ at
/// step 5), for several configurations (history shorter and longer than a block of 256, both
/// algorithms, margins, both formats): the history, scales and inverses equal TransformerEngine's
/// formula computed on the host, bit for bit, step by step.
fn delayed_scaling_follows_transformer_engine(dev: &Device) -> Result {
    let configs = [
        DelayedScalingConfig { history_len: 4, ..DelayedScalingConfig::default() },
        DelayedScalingConfig { history_len: 1, algo: AmaxAlgo::MostRecent, margin: 2, format: Fp8Format::E5M2 },
        DelayedScalingConfig { history_len: 300, margin: 1, ..DelayedScalingConfig::default() },
        DelayedScalingConfig { history_len: 3, algo: AmaxAlgo::MostRecent, ..DelayedScalingConfig::default() },
    ];
    for config in configs {
        let run = |env: &Env| -> Result<Vec<[Vec<u32>; 4]>> {
            let recipe = DelayedScaling::new(&env.alloc, &env.s, config, 3)?;
            let mut steps = Vec::new();
            for step in 0..7u64 {
                for i in 0..3 {
                    let mut x = values(40 * 24, step * 3 + i as u64, 10f32.powi(step as i32 - 3), &[]);
                    match (i, step) {
                        (1, _) => x.iter_mut().for_each(|v| *v = 0.0),
                        (2, 3) => x[17] = f32::NAN,
                        (2, 5) => x[3] = f32::INFINITY,
                        _ => {}
                    }
                    let out_t = env.fp8(&[24, 40], config.format.dtype())?;
                    let inp = env.put(&x, &[40, 24])?;
                    cast_transpose(None, Some(&out_t), &recipe.amax(i)?, &inp, &recipe.scale(i)?, &env.s)?;
                }
                let before = env.bits(recipe.history())?;
                recipe.update(&env.s)?;
                let after = env.bits(recipe.history())?;
                steps.push([before, after, env.bits(recipe.scales())?, env.bits(recipe.scale_invs())?]);
            }
            Ok(steps)
        };
        let steps = on_both(dev, run)?;
        let (len, n) = (config.history_len, 3);
        let mut scales = [1.0f32; 3];
        for (step, [before, after, got_scale, got_inv]) in steps.iter().enumerate() {
            for i in 0..n {
                let mut h: Vec<f32> = (0..len).map(|k| f32::from_bits(before[k * n + i])).collect();
                scales[i] = te_update(&mut h, scales[i], config.algo, config.format.max(), config.margin);
                let what = format!("{config:?} step {step} tensor {i}");
                ensure!(
                    got_scale[i] == scales[i].to_bits(),
                    "{what}: scale {} want {}",
                    f32::from_bits(got_scale[i]),
                    scales[i]
                );
                ensure!(got_inv[i * SCALE_INV_STRIDE] == (1.0 / scales[i]).to_bits(), "{what}: scale_inv");
                let rolled: Vec<u32> = (0..len).map(|k| after[k * n + i]).collect();
                ensure!(rolled == h.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{what}: history");
            }
        }
        ensure!(steps[6][2][1] == 1.0f32.to_bits(), "{config:?}: an all-zero tensor keeps its scale");
    }
    Ok(())
}

/// Current scaling for 4 tensors over 3 steps, the amaxes and scales written by `amax` then
/// `update`, and by `measure` (one launch each, f32 and bf16): each scale is `fp8_max / amax` of
/// this step, the previous (computed) scale where the amax is 0 (tensor 1 at step 1) or not
/// finite (tensor 2 at step 1), `f32::MAX` where the division overflows (tensor 3, a subnormal
/// amax). Tensor 0 spans many blocks, and its amax falls at step 2: `measure` keeps nothing of
/// an earlier launch.
fn current_scaling_scales_from_this_steps_amax(dev: &Device) -> Result {
    let steps = [
        [values(300_000, 1, 5.0, &[]), values(10, 2, 2.0, &[]), values(10, 3, 1.0, &[]), vec![1e-39; 3]],
        [values(300_000, 4, 9.0, &[]), vec![0.0; 10], values(10, 5, 1.0, &[f32::INFINITY]), vec![-1e-39; 3]],
        [values(200_003, 6, 0.5, &[]), values(10, 7, 2.0, &[]), values(10, 8, 1.0, &[]), vec![1e-39; 3]],
    ];
    for (format, dtype, measure) in [
        (Fp8Format::E4M3, DType::F32, false),
        (Fp8Format::E5M2, DType::F32, false),
        (Fp8Format::E4M3, DType::F32, true),
        (Fp8Format::E5M2, DType::BF16, true),
    ] {
        let steps: Vec<Vec<Vec<f32>>> = (steps.iter())
            .map(|inputs| inputs.iter().map(|x| x.iter().map(|&v| rounded(v, dtype)).collect()).collect())
            .collect();
        let run = |env: &Env| -> Result<Vec<[Vec<u32>; 3]>> {
            let recipe = CurrentScaling::new(&env.alloc, &env.s, format, 4)?;
            let mut out = Vec::new();
            for inputs in &steps {
                for (i, x) in inputs.iter().enumerate() {
                    let x = env.input(x, &[x.len()], dtype)?;
                    match measure {
                        true => recipe.measure(i, &x, &env.s)?,
                        false => amax(&recipe.amax(i)?, &x, Amax::Overwrite, &env.s)?,
                    }
                }
                if !measure {
                    recipe.update(&env.s)?;
                }
                let inv: Vec<u32> =
                    (0..4).map(|i| env.bits(&recipe.scale_inv(i)?).map(|b| b[0])).collect::<Result<_>>()?;
                out.push([
                    env.bits(recipe.amaxes())?,
                    (0..4).map(|i| env.bits(&recipe.scale(i)?).map(|b| b[0])).collect::<Result<_>>()?,
                    inv,
                ]);
            }
            Ok(out)
        };
        let mut scales = [1.0f32; 4];
        let case = format!("{format:?} {dtype}{}", if measure { " measure" } else { "" });
        for (step, ([amaxes, got, inv], inputs)) in on_both(dev, run)?.iter().zip(&steps).enumerate() {
            for i in 0..4 {
                let m = f32::from_bits(host_amax(&inputs[i]));
                ensure!(amaxes[i] == m.to_bits(), "{case} step {step} tensor {i}: amax");
                if m.is_finite() && m > 0.0 {
                    scales[i] = format.max() / m;
                }
                if scales[i].is_infinite() {
                    scales[i] = f32::MAX;
                }
                ensure!(
                    got[i] == scales[i].to_bits(),
                    "{case} step {step} tensor {i}: {}, want {}",
                    f32::from_bits(got[i]),
                    scales[i]
                );
                ensure!(inv[i] == (1.0 / scales[i]).to_bits(), "{case} step {step} tensor {i}: scale_inv");
            }
        }
        ensure!(scales[3] == f32::MAX && scales[1] == format.max() / f32::from_bits(host_amax(&steps[2][1])), "{case}");
    }
    Ok(())
}

// ---- refusals -----------------------------------------------------------------------------------------

/// Wrong element types, shapes, scales and amax slots, no output, a strided input, bad recipe
/// configurations: typed errors, and nothing written.
fn refusals_write_nothing(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let fill = vec![F8E4M3::from_bits(0x5a); 6];
    let (out, out_t) = (env.put(&fill, &[2, 3])?, env.put(&fill, &[3, 2])?);
    let (x, scale, slot) = (env.put(&[1.0f32; 6], &[2, 3])?, env.one(1.0)?, env.one(0.5)?);
    let e5 = env.put(&[F8E5M2::from_bits(0x11); 6], &[3, 2])?;
    let strided = env.put(&[1.0f32; 12], &[2, 6])?.narrow(1, 0, 3)?;
    let two = env.put(&[1.0f32; 2], &[2])?;
    let (g, g_t) = (env.put(&[bf16::ONE; 6], &[2, 3])?, env.put(&[bf16::ONE; 6], &[3, 2])?);
    let (e5_rows, tiles) = (env.put(&[F8E5M2::from_bits(0x11); 6], &[2, 3])?, env.put(&[0.25f32; 3], &[1, 3])?);
    let current = CurrentScaling::new(&env.alloc, &env.s, Fp8Format::E4M3, 1)?;
    let ct = |o: Option<&Tensor>, t: Option<&Tensor>, a: &Tensor, i: &Tensor, s: &Tensor| {
        cast_transpose(o, t, a, i, s, &env.s)
    };
    let cases: Vec<(&str, graphed::Result<()>)> = vec![
        ("amax of f16", amax(&slot, &env.put(&[half::f16::ONE; 4], &[4])?, Amax::Overwrite, &env.s)),
        ("amax of fp8", amax(&slot, &out, Amax::Overwrite, &env.s)),
        ("amax into bf16", amax(&env.put(&[bf16::ONE], &[1])?, &x, Amax::Accumulate, &env.s)),
        ("amax into two", amax(&two, &x, Amax::Overwrite, &env.s)),
        ("amax of strided", amax(&slot, &strided, Amax::Overwrite, &env.s)),
        ("no output", ct(None, None, &slot, &x, &scale)),
        ("1-D input", ct(Some(&out), None, &slot, &x.reshape(&[6])?, &scale)),
        ("row-major shape", ct(Some(&out_t), None, &slot, &x, &scale)),
        ("transposed shape", ct(Some(&out), Some(&out), &slot, &x, &scale)),
        ("two formats", ct(Some(&out), Some(&e5), &slot, &x, &scale)),
        ("f32 output", ct(Some(&x), None, &slot, &x, &scale)),
        ("fp8 input", ct(Some(&out), None, &slot, &out, &scale)),
        ("two scales", ct(Some(&out), Some(&out_t), &slot, &x, &two)),
        ("bf16 scale", ct(Some(&out), Some(&out_t), &slot, &x, &env.put(&[bf16::ONE], &[1])?)),
        ("two amaxes", ct(Some(&out), Some(&out_t), &two, &x, &scale)),
        ("strided input", ct(Some(&out), Some(&out_t), &slot, &strided, &scale)),
        ("dgelu of f32", dgelu_cast_transpose((&e5_rows, &e5), &slot, &tiles, (&x, &x), &scale, &env.s)),
        ("dgelu to f32", dgelu_cast_transpose((&x, &x), &slot, &tiles, (&g, &g), &scale, &env.s)),
        ("dgelu two formats", dgelu_cast_transpose((&out, &e5), &slot, &tiles, (&g, &g), &scale, &env.s)),
        ("dgelu tile rows", dgelu_cast_transpose((&e5_rows, &e5), &slot, &two, (&g, &g), &scale, &env.s)),
        ("dgelu pre shape", dgelu_cast_transpose((&e5_rows, &e5), &slot, &tiles, (&g, &g_t), &scale, &env.s)),
        ("sum_tiles to f32", sum_tiles(&x.reshape(&[6])?.narrow(0, 0, 3)?, &tiles, &env.s)),
        ("sum_tiles width", sum_tiles(&env.put(&[bf16::ONE; 2], &[2])?, &tiles, &env.s)),
        ("measure of fp8", current.measure(0, &out, &env.s)),
        ("measure of strided", current.measure(0, &strided, &env.s)),
        ("measure past the tensors", current.measure(1, &x, &env.s)),
    ];
    for (name, r) in cases {
        let ok = matches!(
            r,
            Err(Error::UnsupportedDType { .. }
                | Error::DTypeMismatch { .. }
                | Error::Shape { .. }
                | Error::NotContiguous { .. }
                | Error::Unsupported { .. })
        );
        ensure!(ok, "{name}: expected a typed refusal, got {r:?}");
    }
    ensure!(env.bytes(&out)? == vec![0x5a; 6] && env.bytes(&out_t)? == vec![0x5a; 6], "a refused cast wrote");
    ensure!(env.bits(&slot)? == vec![0.5f32.to_bits()], "a refused call wrote the amax slot");
    ensure!(env.bytes(&e5_rows)? == vec![0x11; 6] && env.bytes(&e5)? == vec![0x11; 6], "a refused dgelu cast wrote");
    ensure!(env.bits(&tiles)? == vec![0.25f32.to_bits(); 3], "a refused call wrote the tile sums");
    ensure!(
        env.bits(current.amaxes())? == vec![0] && env.bits(current.scales())? == vec![1.0f32.to_bits()],
        "a refused measure wrote"
    );

    let config = DelayedScalingConfig::default();
    let refused = [
        (DelayedScalingConfig { history_len: 0, ..config }, 1, ScalingConfigError::NoHistory),
        (DelayedScalingConfig { margin: -1, ..config }, 1, ScalingConfigError::Margin(-1)),
        (DelayedScalingConfig { margin: 127, ..config }, 1, ScalingConfigError::Margin(127)),
        (config, 0, ScalingConfigError::NoTensors),
        (config, usize::MAX / 2, ScalingConfigError::TooLarge { tensors: usize::MAX / 2, history_len: 1024 }),
    ];
    for (config, tensors, want) in refused {
        let got = DelayedScaling::new(&env.alloc, &env.s, config, tensors);
        ensure!(matches!(&got, Err(Error::Scaling(e)) if *e == want), "{config:?} × {tensors}: {got:?}");
    }
    let none = CurrentScaling::new(&env.alloc, &env.s, Fp8Format::E4M3, 0);
    ensure!(matches!(none, Err(Error::Scaling(ScalingConfigError::NoTensors))), "{none:?}");
    let recipe = DelayedScaling::new(&env.alloc, &env.s, config, 2)?;
    for r in [recipe.scale(2), recipe.scale_inv(2), recipe.amax(2)] {
        ensure!(matches!(r, Err(Error::Shape { .. })), "index past the tensors: {r:?}");
    }
    Ok(())
}

// ---- graphs -------------------------------------------------------------------------------------------

/// A captured step (cast of a static input with tensor 0's scale, then the update) replayed
/// with new inputs: each replay's cast uses the scale the previous replay's update wrote.
fn a_replayed_step_uses_the_scale_of_the_previous_update(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let config = DelayedScalingConfig { history_len: 2, ..DelayedScalingConfig::default() };
    let recipe = DelayedScaling::new(&env.alloc, &env.s, config, 1)?;
    let (x, out_t) = (env.put(&[0.0f32; 6], &[2, 3])?, env.fp8(&[3, 2], DType::F8E4M3)?);
    let graph = make_graphed_fn(&env.alloc, |c| {
        cast_transpose(None, Some(&out_t), &recipe.amax(0)?, &x, &recipe.scale(0)?, c)?;
        recipe.update(c)
    })?;
    let inputs =
        [[1.0f32, -2.0, 4.0, 0.5, 3.0, -1.0], [7.0, 0.25, -3.0, 1.0, -0.5, 2.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]];
    let mut scale = 1.0f32;
    let mut window = [0.0f32; 2];
    for (replay, host) in inputs.iter().enumerate() {
        x.copy_from(&env.put(host, &[2, 3])?, &env.s)?;
        graph.replay(&env.s)?;
        let want = env.fp8(&[2, 3], DType::F8E4M3)?;
        quantize(&want, &env.put(host, &[2, 3])?, &env.one(scale)?, &env.s)?;
        let want = env.bytes(&want)?;
        let transposed: Vec<u8> = (0..6).map(|k| want[k % 2 * 3 + k / 2]).collect();
        ensure!(env.bytes(&out_t)? == transposed, "replay {replay} cast with another scale than {scale}");
        window = [window[1], f32::from_bits(host_amax(host))];
        scale = 448.0 / window[0].max(window[1]);
        ensure!(recipe.scale(0)?.to_vec::<f32>(&env.s)? == vec![scale], "replay {replay}: scale");
    }
    Ok(())
}

per_device!(
    amax_matches_the_host_reference,
    cast_transpose_equals_quantize_and_a_host_transpose,
    dgelu_cast_transpose_equals_gelu_backward_then_cast,
    delayed_scaling_follows_transformer_engine,
    current_scaling_scales_from_this_steps_amax,
    refusals_write_nothing,
    a_replayed_step_uses_the_scale_of_the_previous_update,
);
