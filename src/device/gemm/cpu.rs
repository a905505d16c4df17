//! The simulator's GEMM, one loop for every element type: operands are widened to f32 (exactly:
//! every bf16 and FP8 value is an f32, and the product of two FP8 or two bf16 values is exact in
//! f32), summed in f32 over `k` in index order for every element, then scaled, the addend and
//! the epilogue applied in f32, and every stored value (D, aux, a bias gradient) rounded to the
//! output type once.

use float8::{F8E4M3, F8E5M2};
use half::bf16;

use super::{EpilogueKind, GemmElem};
use crate::device::kernel::CpuArgs;
use crate::device::{Elem, Float8};
use crate::Result;

/// An element a GEMM reads as an operand: widened to f32 exactly.
pub(crate) trait GemmInput: Elem {
    fn widen(self) -> f32;
}

impl GemmInput for f32 {
    fn widen(self) -> f32 {
        self
    }
}

impl GemmInput for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl GemmInput for F8E4M3 {
    fn widen(self) -> f32 {
        Float8::to_f32(self)
    }
}

impl GemmInput for F8E5M2 {
    fn widen(self) -> f32 {
        Float8::to_f32(self)
    }
}

/// √(2/π) as f32, as `ops/gelu.rs` (the device layer does not use the ops layer).
const GELU_K: f32 = 0.797_884_6;
const GELU_CUBE: f32 = 0.044715;
/// 3·`GELU_CUBE`.
const GELU_CUBE3: f32 = 0.134145;

pub(super) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (GELU_K * (x + GELU_CUBE * x * x * x)).tanh())
}

/// d gelu/dx, with sech² = 1 − tanh².
pub(super) fn gelu_grad(x: f32) -> f32 {
    let t = (GELU_K * (x + GELU_CUBE * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + GELU_CUBE3 * x * x)
}

/// The simulator's GEMM of `A`×`B` operands into `T`: the loop runs row by row over op(B)'s
/// contiguous rows, so that it vectorizes; the order of each sum is unchanged. A bias gradient
/// is summed in f32 in index order (rows of D, or `k` for op(A)) from the unrounded values.
///
/// `SCALED` (the FP8 GEMMs) multiplies the product by `alpha·(a_scale·b_scale)`, the scales read
/// from device memory.
pub(super) fn gemm_cpu<
    A: GemmInput,
    B: GemmInput,
    T: GemmElem,
    const KIND: usize,
    const ADDEND: bool,
    const SCALED: bool,
>(
    args: &CpuArgs,
) -> Result<()> {
    let kind = const { EpilogueKind::ALL[KIND] };
    let [m, n, k, batch] = ["m", "n", "k", "batch"].map(|p| args.u64(p).map(|v| v as usize));
    let (m, n, k, batch) = (m?, n?, k?, batch?);
    let flags = args.u32("flags")?;
    let (alpha, beta) = (scaled_alpha::<SCALED>(args)?, args.f32("beta")?);
    let (trans_a, trans_b) = (flags & 1 != 0, flags & 2 != 0);
    let a = args.input::<A>("a")?;
    let b = args.input::<B>("b")?;
    let f32s = |p: &str| -> Result<Vec<f32>> { Ok(args.input::<T>(p)?.iter().map(|v| v.to_f32()).collect()) };
    let bias = if matches!(kind, EpilogueKind::Bias | EpilogueKind::BiasGeluAux) { Some(f32s("bias")?) } else { None };
    let aux_in = if matches!(kind, EpilogueKind::DGeluBGrad | EpilogueKind::DGelu) { Some(f32s("aux")?) } else { None };
    let addend = if ADDEND { Some(args.input::<T>("addend")?) } else { None };
    let mut aux_out = if kind == EpilogueKind::BiasGeluAux { Some(args.output::<T>("aux")?) } else { None };
    let sums = match kind {
        EpilogueKind::DGeluBGrad => n,
        EpilogueKind::BGradA => m,
        _ => 0,
    };
    let mut grad = vec![0.0f32; sums];
    let mut c = args.output::<T>("c")?;
    let mut op_a = vec![0.0f32; m * k];
    let mut op_b = vec![0.0f32; k * n];
    let mut acc = vec![0.0f32; n];
    for p in 0..batch {
        let (a, b) = (&a[p * m * k..(p + 1) * m * k], &b[p * k * n..(p + 1) * k * n]);
        op_into(&mut op_a, a, (m, k), trans_a);
        op_into(&mut op_b, b, (k, n), trans_b);
        if kind == EpilogueKind::BGradA {
            // `per_matrix` epilogues have batch 1: the sums are this matrix's.
            row_sums(&mut grad, &op_a, k);
        }
        for i in 0..m {
            acc.fill(0.0);
            for q in 0..k {
                let x = op_a[i * k + q];
                for (acc, y) in acc.iter_mut().zip(&op_b[q * n..(q + 1) * n]) {
                    *acc += x * y;
                }
            }
            for (j, sum) in acc.iter().enumerate() {
                let at = p * m * n + i * n + j;
                let mut v = alpha * sum;
                if beta != 0.0 {
                    v += beta * addend.as_ref().map_or(c[at], |x| x[at]).to_f32();
                }
                if let Some(bias) = &bias {
                    v += bias[j];
                }
                if let Some(aux) = aux_out.as_mut() {
                    aux[at] = T::from_f32(v);
                    v = gelu(v);
                } else if let Some(aux) = &aux_in {
                    v *= gelu_grad(aux[at]);
                    if let Some(g) = grad.get_mut(j) {
                        *g += v;
                    }
                }
                c[at] = T::from_f32(v);
            }
        }
    }
    if !grad.is_empty() {
        for (out, g) in args.output::<T>("bias_grad")?.iter_mut().zip(&grad) {
            *out = T::from_f32(*g);
        }
    }
    Ok(())
}

/// `alpha`, times A's and B's scales when `SCALED`.
fn scaled_alpha<const SCALED: bool>(args: &CpuArgs) -> Result<f32> {
    let alpha = args.f32("alpha")?;
    if !SCALED {
        return Ok(alpha);
    }
    let scale = |p: &str| -> Result<f32> { Ok(args.input::<f32>(p)?[0]) };
    Ok(alpha * (scale("a_scale")? * scale("b_scale")?))
}

/// `sums[i]` = the sum of row `i` of the row-major `rows × k` matrix `m`, in index order.
fn row_sums(sums: &mut [f32], m: &[f32], k: usize) {
    for (g, row) in sums.iter_mut().zip(m.chunks_exact(k)) {
        *g = row.iter().fold(0.0, |s, x| s + x);
    }
}

/// `op(src)`, a `rows`×`cols` matrix that `src` stores transposed when `trans`, into `dst` as
/// row-major f32.
fn op_into<T: GemmInput>(dst: &mut [f32], src: &[T], (rows, cols): (usize, usize), trans: bool) {
    for i in 0..rows {
        for j in 0..cols {
            dst[i * cols + j] = if trans { src[j * rows + i] } else { src[i * cols + j] }.widen();
        }
    }
}
