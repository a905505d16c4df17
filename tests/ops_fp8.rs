//! FP8 (issue 34, item 1): `cast::quantize` and `cast::dequantize` bit for bit against a reference
//! written here from the formats' definitions (not from the `float8` crate), on every bf16 value,
//! the edge cases of both formats and random f32 bit patterns; CUDA bitwise equal to the
//! simulator and to the GPU's own `cvt` instructions; the scale read at replay; refusals that
//! write nothing.

mod common;

use anyhow::ensure;
use float8::{F8E4M3, F8E5M2};
use graphed::device::{args, CpuArgs, DType, Device, DeviceKind, Elem, In, Kernel, LaunchDims, Out};
use graphed::graph::make_graphed_fn;
use graphed::memory::CachingAllocator;
use graphed::ops::cast::{dequantize, quantize};
use graphed::tensor::Tensor;
use graphed::Error;
use half::bf16;
use proptest::prelude::*;

type Result<T = ()> = anyhow::Result<T>;

// ---- the formats, from their definitions ------------------------------------------------------

/// An FP8 format as OCP's FP8 specification defines it (E4M3 without infinities, its one NaN
/// mantissa 111 at exponent 1111; E5M2 with IEEE's infinities and NaNs), with the conversion CUDA
/// does: round to nearest, ties to even; saturate to the largest finite value; NaN to `0x7f`.
#[derive(Clone, Copy, Debug)]
struct Format {
    dtype: DType,
    /// Mantissa bits.
    m: u32,
    bias: i32,
    /// The largest finite code.
    max: u8,
}

const E4M3: Format = Format { dtype: DType::F8E4M3, m: 3, bias: 7, max: 0x7e };
const E5M2: Format = Format { dtype: DType::F8E5M2, m: 2, bias: 15, max: 0x7b };
const FORMATS: [Format; 2] = [E4M3, E5M2];

impl Format {
    /// The value of a finite non-negative code: subnormal m·2^(1−bias−M), normal
    /// (2^M + m)·2^(E−bias−M).
    fn value(self, code: u8) -> f64 {
        let (e, mant) = (i32::from(code >> self.m), f64::from(code & ((1 << self.m) - 1)));
        let m = self.m as i32;
        match e {
            0 => mant * 2f64.powi(1 - self.bias - m),
            _ => (f64::from(1u32 << self.m) + mant) * 2f64.powi(e - self.bias - m),
        }
    }

    /// The values of the codes 0..=max, ascending.
    fn values(self) -> Vec<f64> {
        (0..=self.max).map(|c| self.value(c)).collect()
    }

    /// `x` as this format's code.
    fn narrow(self, values: &[f64], x: f32) -> u8 {
        if x.is_nan() {
            return 0x7f;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = f64::from(x.abs());
        if a >= values[self.max as usize] {
            return sign | self.max;
        }
        // The codes below and above `a`; both distances are exact in f64 near a tie.
        let lo = values.partition_point(|&v| v <= a) - 1;
        let (below, above) = (a - values[lo], values[lo + 1] - a);
        let code = if below < above || (below == above && lo % 2 == 0) { lo } else { lo + 1 };
        sign | code as u8
    }

    /// Any byte widened to f32: exact, NaNs as the canonical NaN.
    fn widen(self, b: u8) -> f32 {
        let mag = b & 0x7f;
        let v = match self.dtype {
            DType::F8E4M3 if mag == 0x7f => return f32::from_bits(0x7fff_ffff),
            DType::F8E5M2 if mag > 0x7c => return f32::from_bits(0x7fff_ffff),
            DType::F8E5M2 if mag == 0x7c => f32::INFINITY,
            _ => self.value(mag) as f32,
        };
        if b & 0x80 != 0 {
            -v
        } else {
            v
        }
    }
}

/// NaN as the GPU's f32 arithmetic returns it.
fn canonical(v: f32) -> f32 {
    if v.is_nan() {
        f32::from_bits(0x7fff_ffff)
    } else {
        v
    }
}

// ---- inputs -------------------------------------------------------------------------------------

/// Every bf16 value.
fn all_bf16() -> Vec<bf16> {
    (0..=u16::MAX).map(bf16::from_bits).collect()
}

/// Both formats' edge cases, both signs: every code's value and its f32 neighbours; every
/// midpoint between neighbouring codes (a tie at each exponent, subnormal ones included) and its
/// neighbours; the largest finite value ± 1 f32 ulp, the saturation threshold (max + half an ulp
/// of the format) ± 1 f32 ulp; zeros, f32 subnormals, f32::MAX, infinities, NaNs of several
/// payloads.
fn edges() -> Vec<f32> {
    let around = |v: f32| [f32::from_bits(v.to_bits() - 1), v, f32::from_bits(v.to_bits() + 1)];
    let mut out = vec![0.0, f32::from_bits(1), f32::MIN_POSITIVE, f32::MAX, f32::INFINITY, 1e30, 1e-30];
    for f in FORMATS {
        let values = f.values();
        let max = values[f.max as usize];
        let half_ulp = (max - values[f.max as usize - 1]) / 2.0;
        out.extend(around((max + half_ulp) as f32));
        for pair in values.windows(2) {
            out.extend(around(((pair[0] + pair[1]) / 2.0) as f32));
            out.extend(around(pair[1] as f32));
        }
    }
    let mut all: Vec<f32> = out.iter().flat_map(|&v| [v, -v]).collect();
    all.extend([0x7fc0_0000u32, 0xffc0_0000, 0x7f80_0001, 0xff80_0001, 0x7fff_ffff, 0xffff_ffff].map(f32::from_bits));
    all
}

/// `n` f32 bit patterns from a 64-bit LCG (`seed`): every class of value, NaNs included.
fn random_bits(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            f32::from_bits((x >> 32) as u32)
        })
        .collect()
}

/// The f32 inputs of the device checks: the edges, every bf16 value widened, random patterns.
fn f32_inputs() -> Vec<f32> {
    let mut x = edges();
    x.extend(all_bf16().iter().map(|h| h.to_f32()));
    x.extend(random_bits(1 << 16, 34));
    x
}

/// Scales of the checks: exact, one that rounds, tiny and huge powers of two (products leave
/// the format at both ends), and a huge non-power (products overflow f32).
const SCALES: [f32; 5] = [1.0, 0.375, 1.0 / 1024.0, 65536.0, 3.0e35];

// ---- running the ops ----------------------------------------------------------------------------

/// A stream and an allocator of one device.
struct Env {
    s: graphed::device::Stream,
    alloc: CachingAllocator,
}

impl Env {
    fn new(dev: &Device) -> Result<Env> {
        Ok(Env { s: dev.stream()?, alloc: CachingAllocator::new(dev) })
    }

    fn put<T: Elem>(&self, data: &[T]) -> Result<Tensor> {
        Ok(Tensor::from_host(&self.alloc, &self.s, data, &[data.len()])?)
    }

    fn scale(&self, v: f32) -> Result<Tensor> {
        Ok(Tensor::from_host(&self.alloc, &self.s, &[v], &[1])?)
    }

    /// The bytes of an FP8 tensor.
    fn bytes(&self, t: &Tensor) -> Result<Vec<u8>> {
        Ok(match t.dtype() {
            DType::F8E4M3 => t.to_vec::<F8E4M3>(&self.s)?.iter().map(F8E4M3::to_bits).collect(),
            _ => t.to_vec::<F8E5M2>(&self.s)?.iter().map(F8E5M2::to_bits).collect(),
        })
    }

    /// `quantize(x · scale)` into `f`, as bytes.
    fn quantized<T: Elem>(&self, f: Format, x: &[T], scale: f32) -> Result<Vec<u8>> {
        let out = Tensor::zeros(&self.alloc, &self.s, &[x.len()], f.dtype)?;
        quantize(&out, &self.put(x)?, &self.scale(scale)?, &self.s)?;
        self.bytes(&out)
    }

    /// `dequantize(codes) · scale_inv` to `dtype`, as the bits of the f32 (or bf16) values.
    fn dequantized(&self, f: Format, codes: &[u8], dtype: DType, scale_inv: f32) -> Result<Vec<u32>> {
        let inp = match f.dtype {
            DType::F8E4M3 => self.put(&codes.iter().map(|&b| F8E4M3::from_bits(b)).collect::<Vec<_>>())?,
            _ => self.put(&codes.iter().map(|&b| F8E5M2::from_bits(b)).collect::<Vec<_>>())?,
        };
        let out = Tensor::zeros(&self.alloc, &self.s, &[codes.len()], dtype)?;
        dequantize(&out, &inp, &self.scale(scale_inv)?, &self.s)?;
        Ok(match dtype {
            DType::BF16 => out.to_vec::<bf16>(&self.s)?.iter().map(|h| u32::from(h.to_bits())).collect(),
            _ => out.to_vec::<f32>(&self.s)?.iter().map(|v| v.to_bits()).collect(),
        })
    }
}

/// The first index where `got` and `want` differ, with the input, for a failure message.
fn first_difference<T: std::fmt::Debug, V: PartialEq + std::fmt::Debug>(inputs: &[T], got: &[V], want: &[V]) -> String {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        Some(i) => format!("first at {i}: input {:?}, got {:?}, want {:?}", inputs[i], got[i], want[i]),
        None => format!("lengths {} and {}", got.len(), want.len()),
    }
}

/// `dev`'s results and, on CUDA, the simulator's for the same call: CUDA must equal both the
/// reference and the simulator.
fn on_both<T>(dev: &Device, f: impl Fn(&Env) -> Result<T>) -> Result<(T, Option<T>)> {
    let sim = match dev.kind() {
        DeviceKind::Cuda => Some(f(&Env::new(&Device::sim())?)?),
        _ => None,
    };
    Ok((f(&Env::new(dev)?)?, sim))
}

// ---- cases on every device ----------------------------------------------------------------------

/// f32 inputs (edges, every bf16 value, random patterns) times each scale, to both formats: the
/// codes the definition gives, and on CUDA the simulator's.
fn quantize_f32_rounds_as_the_formats_define(dev: &Device) -> Result {
    let x = f32_inputs();
    for f in FORMATS {
        let values = f.values();
        for scale in SCALES {
            let want: Vec<u8> = x.iter().map(|&v| f.narrow(&values, v * scale)).collect();
            let (got, sim) = on_both(dev, |env| env.quantized(f, &x, scale))?;
            ensure!(got == want, "{f:?} × {scale}: {}", first_difference(&x, &got, &want));
            ensure!(sim.is_none_or(|sim| sim == got), "{f:?} × {scale}: CUDA differs from the simulator");
        }
    }
    Ok(())
}

/// Every bf16 value times each scale, to both formats.
fn quantize_bf16_rounds_as_the_formats_define(dev: &Device) -> Result {
    let x = all_bf16();
    for f in FORMATS {
        let values = f.values();
        for scale in SCALES {
            let want: Vec<u8> = x.iter().map(|&v| f.narrow(&values, v.to_f32() * scale)).collect();
            let (got, sim) = on_both(dev, |env| env.quantized(f, &x, scale))?;
            ensure!(got == want, "{f:?} × {scale}: {}", first_difference(&x, &got, &want));
            ensure!(sim.is_none_or(|sim| sim == got), "{f:?} × {scale}: CUDA differs from the simulator");
        }
    }
    Ok(())
}

/// Every code of both formats, to f32 and bf16, times each inverse scale (0 included: ∞ · 0 is
/// NaN): the definition's value times the scale in f32, NaNs canonical, bf16 rounded once.
fn dequantize_widens_as_the_formats_define(dev: &Device) -> Result {
    let codes: Vec<u8> = (0..=255).collect();
    for f in FORMATS {
        for scale_inv in [1.0, 0.375, 1.0 / 1024.0, 3.0e35, 0.0] {
            let wide: Vec<f32> = codes.iter().map(|&b| canonical(f.widen(b) * scale_inv)).collect();
            for dtype in [DType::F32, DType::BF16] {
                let want: Vec<u32> = match dtype {
                    DType::BF16 => wide.iter().map(|&v| u32::from(bf16::from_f32(v).to_bits())).collect(),
                    _ => wide.iter().map(|v| v.to_bits()).collect(),
                };
                let (got, sim) = on_both(dev, |env| env.dequantized(f, &codes, dtype, scale_inv))?;
                ensure!(got == want, "{f:?} → {dtype} × {scale_inv}: {}", first_difference(&codes, &got, &want));
                ensure!(sim.is_none_or(|sim| sim == got), "{f:?} → {dtype}: CUDA differs from the simulator");
            }
        }
    }
    Ok(())
}

/// A captured quantize reads its scale at each replay: a new scale written to the device between
/// replays changes the output, with nothing passed from the host to the graph.
fn a_replayed_quantize_reads_the_scale_of_its_replay(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let (x, scale) = (env.put(&[1.0f32, -3.0, 100.0, 0.3])?, env.scale(1.0)?);
    let out = Tensor::zeros(&env.alloc, &env.s, &[4], DType::F8E4M3)?;
    let graph = make_graphed_fn(&env.alloc, |c| quantize(&out, &x, &scale, c))?;
    let values = E4M3.values();
    for s in [1.0f32, 8.0, 0.5] {
        scale.copy_from(&env.scale(s)?, &env.s)?;
        graph.replay(&env.s)?;
        let want: Vec<u8> = [1.0f32, -3.0, 100.0, 0.3].iter().map(|&v| E4M3.narrow(&values, v * s)).collect();
        ensure!(env.bytes(&out)? == want, "scale {s}");
    }
    Ok(())
}

/// Wrong element types (output, input, scale), a scale that is not one element, unequal shapes
/// and a strided input: typed errors, and the output keeps every byte it had.
fn refusals_write_nothing(dev: &Device) -> Result {
    let env = Env::new(dev)?;
    let fill = vec![F8E4M3::from_bits(0x5a); 4];
    let (out, x, scale) = (env.put(&fill)?, env.put(&[1.0f32; 4])?, env.scale(1.0)?);
    let wide = env.put(&[7.0f32; 4])?;
    let strided = env.put(&[1.0f32; 8])?.reshape(&[4, 2])?.select(1, 0)?;
    let cases: Vec<(&str, graphed::Result<()>)> = vec![
        ("f32 output", quantize(&wide, &x, &scale, &env.s)),
        ("f16 input", quantize(&out, &env.put(&[half::f16::ONE; 4])?, &scale, &env.s)),
        ("fp8 input", quantize(&out, &env.put(&fill)?, &scale, &env.s)),
        ("bf16 scale", quantize(&out, &x, &env.put(&[bf16::ONE])?, &env.s)),
        ("two scales", quantize(&out, &x, &env.put(&[1.0f32; 2])?, &env.s)),
        ("no scale", quantize(&out, &x, &env.put(&[1.0f32; 2])?.narrow(0, 0, 0)?, &env.s)),
        ("shapes", quantize(&out, &env.put(&[1.0f32; 5])?, &scale, &env.s)),
        ("strided", quantize(&out, &strided, &scale, &env.s)),
        ("dequantize to fp8", dequantize(&out, &out, &scale, &env.s)),
        ("dequantize from f32", dequantize(&wide, &x, &scale, &env.s)),
        ("dequantize to u8", dequantize(&env.put(&[0u8; 4])?, &out, &scale, &env.s)),
        ("dequantize with a u32 scale", dequantize(&wide, &out, &env.put(&[1u32])?, &env.s)),
        ("dequantize shapes", dequantize(&env.put(&[0.0f32; 3])?, &out, &scale, &env.s)),
    ];
    for (name, r) in cases {
        let ok = matches!(
            r,
            Err(Error::UnsupportedDType { .. }
                | Error::DTypeMismatch { .. }
                | Error::Shape { .. }
                | Error::NotContiguous { .. })
        );
        ensure!(ok, "{name}: expected a typed refusal, got {r:?}");
    }
    ensure!(env.bytes(&out)? == vec![0x5a; 4], "a refused quantize wrote its output");
    ensure!(wide.to_vec::<f32>(&env.s)? == vec![7.0; 4], "a refused dequantize wrote its output");
    Ok(())
}

per_device!(
    quantize_f32_rounds_as_the_formats_define,
    quantize_bf16_rounds_as_the_formats_define,
    dequantize_widens_as_the_formats_define,
    a_replayed_quantize_reads_the_scale_of_its_replay,
    refusals_write_nothing,
);

// ---- the simulator on random bit patterns --------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random f32 bit patterns times a random scale (any bits: NaN, ∞, subnormal), to both
    /// formats, on the simulator: the definition's codes.
    #[test]
    fn sim_quantize_matches_the_definition_on_random_bits(
        bits in prop::collection::vec(any::<u32>(), 1..2048),
        scale in prop_oneof![Just(1.0f32), any::<u32>().prop_map(f32::from_bits)],
    ) {
        let env = Env::new(&Device::sim()).unwrap();
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        for f in FORMATS {
            let values = f.values();
            let want: Vec<u8> = x.iter().map(|&v| f.narrow(&values, v * scale)).collect();
            let got = env.quantized(f, &x, scale).unwrap();
            prop_assert!(got == want, "{:?} × {}: {}", f, scale, first_difference(&x, &got, &want));
        }
    }
}

// ---- the GPU's own conversion instructions ------------------------------------------------------

/// The GPU's conversions, as cuda_fp8.h issues them on sm_89 and later: `cvt.rn.satfinite` of
/// (0, x) to a pair of FP8 codes (x in the low byte), and back through f16 (`cvt.rn.f16x2`) to f32.
const HARDWARE: &str = r#"
#define NARROW(name, format)                                                                   \
    extern "C" __global__ void name(unsigned char* out, const float* inp, unsigned n) {        \
        unsigned i = blockIdx.x * blockDim.x + threadIdx.x;                                    \
        if (i >= n) return;                                                                    \
        unsigned short pair;                                                                   \
        asm("cvt.rn.satfinite." format "x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(inp[i])); \
        out[i] = (unsigned char)(pair & 0xff);                                                 \
    }
#define WIDEN(name, format)                                                                    \
    extern "C" __global__ void name(float* out, const unsigned char* inp, unsigned n) {        \
        unsigned i = blockIdx.x * blockDim.x + threadIdx.x;                                    \
        if (i >= n) return;                                                                    \
        unsigned halves;                                                                       \
        unsigned short code = inp[i];                                                          \
        asm("cvt.rn.f16x2." format "x2 %0, %1;" : "=r"(halves) : "h"(code));                   \
        asm("cvt.f32.f16 %0, %1;" : "=f"(out[i]) : "h"((unsigned short)(halves & 0xffff)));   \
    }
NARROW(hw_narrow_e4m3, "e4m3")
NARROW(hw_narrow_e5m2, "e5m2")
WIDEN(hw_widen_e4m3, "e4m3")
WIDEN(hw_widen_e5m2, "e5m2")
"#;

fn no_cpu_path(_: &CpuArgs) -> graphed::Result<()> {
    Err(Error::Unsupported { op: "hw_cvt", backend: "sim", why: "the GPU's own instruction has no CPU path" })
}

/// One kernel of [`HARDWARE`].
const fn hardware(name: &'static str) -> Kernel {
    Kernel { name, source: HARDWARE, params: &["out", "inp", "n"], cpu: no_cpu_path, strided: false }
}

static HW_NARROW: [Kernel; 2] = [hardware("hw_narrow_e4m3"), hardware("hw_narrow_e5m2")];
static HW_WIDEN: [Kernel; 2] = [hardware("hw_widen_e4m3"), hardware("hw_widen_e5m2")];

/// Launches a kernel of [`HARDWARE`] over `inp`, one thread per element.
fn launch<O: Elem, I: Elem>(env: &Env, k: &'static Kernel, out: &Tensor, inp: &Tensor) -> graphed::Result<()> {
    let n = u32::try_from(inp.numel()).expect("the inputs are small");
    env.s.launch(k, LaunchDims::for_elems(inp.numel()), &args![Out(out.view::<O>()?), In(inp.view::<I>()?), n])
}

/// On the GPU: `quantize` (scale 1) equals the `cvt.rn.satfinite` instruction bit for bit on the
/// f32 inputs of the device checks, NaNs included, and `dequantize` (scale 1) equals the
/// instructions' widening on every code (a NaN compared as NaN: ours is canonical).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_conversions_equal_the_gpu_cvt_instructions() {
    let dev = Device::cuda_checked(0).unwrap_or_else(|e| panic!("{e}"));
    let env = Env::new(&dev).unwrap();
    let (x, codes): (Vec<f32>, Vec<u8>) = (f32_inputs(), (0..=255).collect());
    for (f, (narrow, widen)) in FORMATS.iter().zip(HW_NARROW.iter().zip(&HW_WIDEN)) {
        let hw = env.put(&vec![0u8; x.len()]).unwrap();
        launch::<u8, f32>(&env, narrow, &hw, &env.put(&x).unwrap()).unwrap();
        let (hw, ours) = (hw.to_vec::<u8>(&env.s).unwrap(), env.quantized(*f, &x, 1.0).unwrap());
        assert!(hw == ours, "{f:?}: quantize differs from cvt.rn.satfinite, {}", first_difference(&x, &ours, &hw));
        let wide = env.put(&vec![0.0f32; 256]).unwrap();
        launch::<f32, u8>(&env, widen, &wide, &env.put(&codes).unwrap()).unwrap();
        let hw: Vec<u32> = wide.to_vec::<f32>(&env.s).unwrap().iter().map(|v| canonical(*v).to_bits()).collect();
        let ours = env.dequantized(*f, &codes, DType::F32, 1.0).unwrap();
        assert!(hw == ours, "{f:?}: dequantize differs from cvt.rn.f16x2, {}", first_difference(&codes, &ours, &hw));
    }
}
