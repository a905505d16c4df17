//! FP8 GEMMs: FP8 operands, each with its per-tensor scale read from device memory, a bf16
//! output, and the bf16 GEMM's addend and epilogues but one (cuBLASLt's FP8 matmul on CUDA, the
//! simulator's one GEMM loop otherwise).
//!
//! What cuBLASLt 13.1 refused on the H200 (probed with every epilogue, with and without an
//! addend): `BGRADB` (our [`Epilogue::BGradA`]) is not supported, and D's amax
//! (`AMAX_D_POINTER`) is an invalid value when D is bf16. So an FP8 GEMM refuses `BGradA` on both
//! devices, and has no amax output: FP8 recipes take their amaxes from the casts that quantize.
//!
//! Hopper's FP8 tensor cores take both operands with `k` contiguous (cuBLASLt's "TN" layout), so
//! an FP8 GEMM is `D = A·Bᵀ` with A stored `m × k` and B stored `n × k`: the type has no
//! transpose flags. A training step therefore quantizes into the layout each GEMM reads (a
//! weight and its transpose, an activation and its transpose), as TransformerEngine's
//! cast-transpose does. Which FP8 formats may meet is a type rule too: [`Fp8Pair`] is E4M3 with
//! E4M3 or E5M2, never E5M2 with E5M2, which cuBLASLt refuses.

use float8::{F8E4M3, F8E5M2};
use half::bf16;

use super::{gemm_kernels, head, push_epilogue, push_tail, vector, Epilogue, EpilogueKind, GemmSpec, Matrices, Scaled};
use super::{shape, OP};
use crate::device::kernel::{Arg, In, Kernel};
use crate::device::{DType, Elem, Float8, View};
use crate::{Error, Result};

/// The FP8 operand formats cuBLASLt multiplies: `(A, B)` as E4M3 × E4M3, E4M3 × E5M2 (a
/// gradient in E5M2 on the right) or E5M2 × E4M3 (on the left).
///
/// Two E5M2 operands do not compile:
///
/// ```compile_fail
/// use float8::F8E5M2;
/// use graphed::device::{Device, Fp8Gemm};
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let x = dev.alloc::<F8E5M2>(256)?;
/// let (c, one) = (dev.alloc::<half::bf16>(256)?, dev.alloc::<f32>(1)?);
/// s.fp8_gemm(Fp8Gemm::new(c.view(), x.view(), x.view(), (one.view(), one.view()), (16, 16, 16)))?;
/// # Ok::<(), graphed::Error>(())
/// ```
pub trait Fp8Pair {
    /// The kernels of the pair, `[epilogue kind][addend]`.
    #[doc(hidden)]
    const KERNELS: &'static [[Kernel; 2]; EpilogueKind::ALL.len()];
}

macro_rules! fp8_pair {
    ($a:ty, $b:ty, $table:ident, $name:literal) => {
        static $table: [[Kernel; 2]; EpilogueKind::ALL.len()] =
            gemm_kernels!($a, $b, bf16, $name, true, ["a_scale", "b_scale"]);
        impl Fp8Pair for ($a, $b) {
            const KERNELS: &'static [[Kernel; 2]; EpilogueKind::ALL.len()] = &$table;
        }
    };
}

fp8_pair!(F8E4M3, F8E4M3, GEMM_E4M3_E4M3, "gemm_e4m3_e4m3_bf16");
fp8_pair!(F8E4M3, F8E5M2, GEMM_E4M3_E5M2, "gemm_e4m3_e5m2_bf16");
fp8_pair!(F8E5M2, F8E4M3, GEMM_E5M2_E4M3, "gemm_e5m2_e4m3_bf16");

/// Bytes to which cuBLASLt's FP8 GEMMs want every matrix's start and row stride aligned.
pub const FP8_ALIGN_BYTES: usize = 16;

/// Bytes to which an FP8 GEMM's scales are aligned. cuBLASLt documents no alignment for its
/// scale pointers; on the H200, cuBLASLt 13.1 refused scales 4 and 8 bytes into an allocation
/// with `CUBLAS_STATUS_NOT_SUPPORTED` at launch, and ran them at 256 bytes, which it assumes of
/// every pointer it is not told about. `ops::fp8`'s recipes keep their inverse scales this far
/// apart.
pub const FP8_SCALE_ALIGN_BYTES: usize = 256;

/// `D = alpha·(a_scale_inv·b_scale_inv)·A·Bᵀ + beta·C`, then the epilogue, with A (`m × k`) and
/// B (`n × k`) in FP8 and D in bf16, row-major.
///
/// The scales are one-element f32 tensors on the device, read when the GEMM runs: the inverses
/// of the scales the operands were quantized with (`ops::cast::quantize`), so that a replayed
/// graph uses the scales a recipe wrote since. The f32 sums are exact products of FP8 values;
/// cuBLASLt's `fast_accum` keeps the whole sum in the tensor cores' accumulator, which is
/// faster and less precise (TransformerEngine uses it in the forward only). Every matrix starts
/// on, and strides by, a multiple of [`FP8_ALIGN_BYTES`] bytes, and each scale starts on a
/// multiple of [`FP8_SCALE_ALIGN_BYTES`].
///
/// ```
/// use float8::F8E4M3;
/// use graphed::device::{Device, Fp8Gemm};
/// use half::bf16;
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let (m, n, k) = (2, 8, 16);
/// let a = dev.alloc_from(&s, &vec![F8E4M3::from_f32(1.0); m * k])?;
/// let b = dev.alloc_from(&s, &vec![F8E4M3::from_f32(0.5); n * k])?;
/// let scale_inv = dev.alloc_from(&s, &[0.25f32])?;
/// let c = dev.alloc::<bf16>(m * n)?;
/// s.fp8_gemm(Fp8Gemm::new(c.view(), a.view(), b.view(), (scale_inv.view(), scale_inv.view()), (m, n, k)))?;
/// assert_eq!(c.to_vec(&s)?[0].to_f32(), 16.0 * 0.5 * 0.25 * 0.25);
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct Fp8Gemm<'a, A: Float8, B: Float8> {
    /// Output D, `m × n`. Also C, read when `beta ≠ 0`, unless `addend` is given.
    pub c: View<'a, bf16>,
    /// Left operand, `m × k`.
    pub a: View<'a, A>,
    /// Right operand, `n × k` (the product takes its transpose).
    pub b: View<'a, B>,
    /// A's dequantization factor (1 / its quantization scale), one f32.
    pub a_scale_inv: View<'a, f32>,
    /// B's dequantization factor, one f32.
    pub b_scale_inv: View<'a, f32>,
    /// A separate C, `m × n`, as [`super::Gemm::addend`].
    pub addend: Option<View<'a, bf16>>,
    /// What is fused into the store (default: nothing); any but [`Epilogue::BGradA`].
    pub epilogue: Epilogue<'a, bf16>,
    /// (m, n, k).
    pub dims: (usize, usize, usize),
    /// Scales the product.
    pub alpha: f32,
    /// Scales C (0: C is not read).
    pub beta: f32,
    /// Accumulate in the tensor cores' precision throughout (cuBLASLt's `FAST_ACCUM`).
    pub fast_accum: bool,
}

impl<'a, A: Float8, B: Float8> Fp8Gemm<'a, A, B>
where
    (A, B): Fp8Pair,
{
    /// `C = (a_scale_inv·b_scale_inv)·A·Bᵀ` for `(m, n, k)`: no addend, no epilogue, precise
    /// accumulation.
    pub fn new(
        c: View<'a, bf16>,
        a: View<'a, A>,
        b: View<'a, B>,
        (a_scale_inv, b_scale_inv): (View<'a, f32>, View<'a, f32>),
        dims: (usize, usize, usize),
    ) -> Fp8Gemm<'a, A, B> {
        Fp8Gemm {
            c,
            a,
            b,
            a_scale_inv,
            b_scale_inv,
            addend: None,
            epilogue: Epilogue::None,
            dims,
            alpha: 1.0,
            beta: 0.0,
            fast_accum: false,
        }
    }

    /// Checks the views against the dimensions, the epilogue and FP8's alignment, and derives
    /// the layout.
    pub(crate) fn spec(&self) -> Result<GemmSpec> {
        if let Epilogue::BGradA { .. } = self.epilogue {
            return Err(Error::Unsupported {
                op: OP,
                backend: "any",
                why: "cuBLASLt's FP8 GEMMs have no BGradA epilogue (its BGRADB); sum the gradient's rows with the cast that quantizes it, or run this GEMM in bf16",
            });
        }
        let matrices = Matrices {
            c: self.c.region(),
            a: self.a.region(),
            b: self.b.region(),
            addend: self.addend.map(|v| v.region()),
            dims: self.dims,
            batch: 1,
            trans: (false, true),
        };
        let mut spec = matrices.spec(DType::BF16, [A::DTYPE, B::DTYPE], &self.epilogue)?;
        for (what, scale) in [("A's scale", &self.a_scale_inv), ("B's scale", &self.b_scale_inv)] {
            vector(what, scale, 1)?;
            scale_aligned(what, scale)?;
        }
        aligned("A", &self.a, spec.a.ld)?;
        aligned("B", &self.b, spec.b.ld)?;
        aligned("C", &self.c, spec.c.ld)?;
        if let (Some(addend), Some(o)) = (&self.addend, spec.addend) {
            aligned("the addend", addend, o.ld)?;
        }
        spec.scaled = Some(Scaled { fast_accum: self.fast_accum });
        Ok(spec)
    }

    /// The launch arguments, one per name of [`Fp8Gemm::kernel`]'s params.
    pub(crate) fn args<'w>(&'w self, spec: &GemmSpec, workspace: View<'w, u8>) -> Vec<Arg<'w>> {
        let mut args = head(self.c, self.addend, [In(self.a).into(), In(self.b).into()], self.beta);
        args.extend([In(self.a_scale_inv).into(), In(self.b_scale_inv).into()]);
        push_epilogue(&mut args, &self.epilogue);
        push_tail(&mut args, workspace, spec, (self.alpha, self.beta));
        args
    }

    pub(crate) fn kernel(&self) -> &'static Kernel {
        &<(A, B)>::KERNELS[self.epilogue.kind() as usize][usize::from(self.addend.is_some())]
    }
}

/// Checks that the scale `v`, named `what`, starts on an [`FP8_SCALE_ALIGN_BYTES`] boundary of
/// its allocation.
fn scale_aligned(what: &str, v: &View<'_, f32>) -> Result<()> {
    let start = v.absolute().offset() * 4;
    if start.is_multiple_of(FP8_SCALE_ALIGN_BYTES) {
        return Ok(());
    }
    Err(Error::Shape {
        op: OP,
        expected: format!(
            "{what} of an FP8 GEMM starting at a multiple of {FP8_SCALE_ALIGN_BYTES} bytes of its allocation (it starts at byte {start}), as cuBLASLt needs: keep scales {} f32s apart, as ops::fp8's recipes do",
            FP8_SCALE_ALIGN_BYTES / 4
        ),
        found: shape(&v.region()),
    })
}

/// Checks that `v`, named `what`, starts on an [`FP8_ALIGN_BYTES`] boundary of its allocation
/// and has a row stride (`ld` elements) that is a multiple of it.
fn aligned<T: Elem>(what: &str, v: &View<'_, T>, ld: usize) -> Result<()> {
    let size = T::DTYPE.size();
    let start = v.absolute().offset() * size;
    if start.is_multiple_of(FP8_ALIGN_BYTES) && (ld * size).is_multiple_of(FP8_ALIGN_BYTES) {
        return Ok(());
    }
    Err(Error::Shape {
        op: OP,
        expected: format!(
            "{what} of an FP8 GEMM starting at a multiple of {FP8_ALIGN_BYTES} bytes of its allocation (it starts at byte {start}) with a row stride of a multiple of {FP8_ALIGN_BYTES} bytes (it is {} bytes): pad k (and n for bf16 matrices) to a multiple of {}",
            ld * size,
            FP8_ALIGN_BYTES / size
        ),
        found: shape(&v.region()),
    })
}
