//! GEMM, the one library call of the device layer: cuBLASLt on CUDA, a CPU loop on the simulator.
//!
//! A GEMM is declared like a kernel launch, so its accesses (C, A, B, the bias, and the hidden
//! per-stream workspace cuBLASLt uses) reach the simulator, the checker and graph summaries. The
//! matrices are row-major views: their leading dimensions and batch strides are read off the
//! views' regions, so a head of an attention tensor or a column block is passed without copying.
//! f32 GEMMs compute in IEEE f32 (not TF32), bf16 GEMMs accumulate in f32.
//!
//! ```
//! use graphed::device::{Device, Gemm};
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let a = dev.alloc_from(&s, &[1.0f32, 2.0, 3.0, 4.0])?; // 2x2
//! let b = dev.alloc_from(&s, &[1.0f32, 0.0, 0.0, 1.0])?; // identity
//! let c = dev.alloc::<f32>(4)?;
//! s.gemm(Gemm::new(c.view(), a.view(), b.view(), (2, 2, 2)))?;
//! assert_eq!(c.to_vec(&s)?, vec![1.0, 2.0, 3.0, 4.0]);
//! # Ok::<(), graphed::Error>(())
//! ```

use half::bf16;

use super::kernel::{Arg, CpuArgs, Hidden, In, InOut, Kernel, Out};
use super::{DType, Elem, Region, View};
use crate::{Error, Result};

/// Element types cuBLASLt multiplies here.
pub trait GemmElem: Elem {
    #[doc(hidden)]
    const PLAIN: &'static Kernel;
    #[doc(hidden)]
    const WITH_BIAS: &'static Kernel;
    #[doc(hidden)]
    fn to_f32(self) -> f32;
    #[doc(hidden)]
    fn from_f32(v: f32) -> Self;
}

impl GemmElem for f32 {
    const PLAIN: &'static Kernel = &GEMM_F32;
    const WITH_BIAS: &'static Kernel = &GEMM_F32_BIAS;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl GemmElem for bf16 {
    const PLAIN: &'static Kernel = &GEMM_BF16;
    const WITH_BIAS: &'static Kernel = &GEMM_BF16_BIAS;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// The arguments [`Gemm::args`] passes: cuBLASLt has no CUDA entry point to name them.
const PARAMS: &[&str] = &["c", "a", "b", "workspace", "m", "n", "k", "batch", "flags", "alpha", "beta"];
const PARAMS_BIAS: &[&str] = &["c", "a", "b", "bias", "workspace", "m", "n", "k", "batch", "flags", "alpha", "beta"];

static GEMM_F32: Kernel =
    Kernel { name: "gemm_f32", source: "", params: PARAMS, cpu: gemm_cpu::<f32, false>, strided: true };
static GEMM_F32_BIAS: Kernel =
    Kernel { name: "gemm_f32_bias", source: "", params: PARAMS_BIAS, cpu: gemm_cpu::<f32, true>, strided: true };
static GEMM_BF16: Kernel =
    Kernel { name: "gemm_bf16", source: "", params: PARAMS, cpu: gemm_cpu::<bf16, false>, strided: true };
static GEMM_BF16_BIAS: Kernel =
    Kernel { name: "gemm_bf16_bias", source: "", params: PARAMS_BIAS, cpu: gemm_cpu::<bf16, true>, strided: true };

/// `C = alpha·op(A)·op(B) + beta·C (+ bias)`, row-major, over `batch` matrices.
///
/// `c` is `batch × m × n`, `a` is `batch × m × k` (`k × m` with `trans_a`), `b` is
/// `batch × k × n` (`n × k` with `trans_b`), `bias` has `n` elements added to every row.
pub struct Gemm<'a, T: GemmElem> {
    /// Output.
    pub c: View<'a, T>,
    /// Left operand.
    pub a: View<'a, T>,
    /// Right operand.
    pub b: View<'a, T>,
    /// Added to every row of the result (cuBLASLt's bias epilogue).
    pub bias: Option<View<'a, T>>,
    /// (m, n, k).
    pub dims: (usize, usize, usize),
    /// Number of matrices (strided batched).
    pub batch: usize,
    /// Use Aᵀ.
    pub trans_a: bool,
    /// Use Bᵀ.
    pub trans_b: bool,
    /// Scales the product.
    pub alpha: f32,
    /// Scales C's previous contents (0: C is only written).
    pub beta: f32,
}

impl<'a, T: GemmElem> Gemm<'a, T> {
    /// `C = A·B` for `(m, n, k)`, no batch, no transposes, no bias.
    pub fn new(c: View<'a, T>, a: View<'a, T>, b: View<'a, T>, dims: (usize, usize, usize)) -> Gemm<'a, T> {
        Gemm { c, a, b, bias: None, dims, batch: 1, trans_a: false, trans_b: false, alpha: 1.0, beta: 0.0 }
    }
}

/// One operand as cuBLASLt sees it: leading dimension and batch stride, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Operand {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) ld: usize,
    pub(crate) batch_stride: usize,
}

/// The layout of a GEMM, the key under which CUDA caches its algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GemmSpec {
    pub(crate) dtype: DType,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) batch: usize,
    pub(crate) trans_a: bool,
    pub(crate) trans_b: bool,
    pub(crate) a: Operand,
    pub(crate) b: Operand,
    pub(crate) c: Operand,
    pub(crate) bias: bool,
}

/// Leading dimension and batch stride of a `batch × rows × cols` row-major matrix stored in
/// `region`, or `None` if the region is not such a matrix with unit column stride.
fn operand(region: &Region, batch: usize, rows: usize, cols: usize) -> Option<Operand> {
    let dims: Vec<(usize, usize)> = region.dims().iter().filter(|d| d.count > 1).map(|d| (d.count, d.stride)).collect();
    let (ld, batch_stride) = match dims.as_slice() {
        _ if region.len() != batch * rows * cols => return None,
        _ if region.is_contiguous() => (cols, rows * cols),
        [(r, ld), (c, 1)] if *c == cols && *r == rows && batch == 1 => (*ld, 0),
        [(br, ld), (c, 1)] if *c == cols && *br == batch * rows => (*ld, rows * ld),
        [(b, bs), (r, ld), (c, 1)] if *b == batch && *r == rows && *c == cols => (*ld, *bs),
        [(b, bs), (r, ld)] if cols == 1 && *b == batch && *r == rows => (*ld, *bs),
        _ => return None,
    };
    Some(Operand { rows, cols, ld: ld.max(cols), batch_stride })
}

impl<T: GemmElem> Gemm<'_, T> {
    /// Checks the views against the dimensions and derives the layout.
    pub(crate) fn spec(&self) -> Result<GemmSpec> {
        const OP: &str = "Stream::gemm";
        let (m, n, k) = self.dims;
        let batch = self.batch.max(1);
        let (a_rows, a_cols) = if self.trans_a { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if self.trans_b { (n, k) } else { (k, n) };
        let bad = |what: &str, v: &View<'_, T>, rows, cols| Error::Shape {
            op: OP,
            expected: format!("{what} as {batch} row-major {rows}x{cols} matrices with unit column stride"),
            found: v.region().dims().iter().map(|d| d.count).collect(),
        };
        let a = operand(&self.a.region(), batch, a_rows, a_cols).ok_or_else(|| bad("A", &self.a, a_rows, a_cols))?;
        let b = operand(&self.b.region(), batch, b_rows, b_cols).ok_or_else(|| bad("B", &self.b, b_rows, b_cols))?;
        let c = operand(&self.c.region(), batch, m, n).ok_or_else(|| bad("C", &self.c, m, n))?;
        if let Some(bias) = &self.bias {
            if bias.len() != n || !bias.region().is_contiguous() {
                return Err(bad("bias", bias, 1, n));
            }
        }
        Ok(GemmSpec {
            dtype: T::DTYPE,
            m,
            n,
            k,
            batch,
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            a,
            b,
            c,
            bias: self.bias.is_some(),
        })
    }

    /// The launch arguments, one per name of [`PARAMS`] (or [`PARAMS_BIAS`] with a bias).
    pub(crate) fn args<'w>(&'w self, spec: &GemmSpec, workspace: View<'w, u8>) -> Vec<Arg<'w>> {
        let c: Arg<'_> = if self.beta == 0.0 { Out(self.c).into() } else { InOut(self.c).into() };
        let mut args = vec![c, In(self.a).into(), In(self.b).into()];
        if let Some(bias) = self.bias {
            args.push(In(bias).into());
        }
        args.push(Hidden("gemm workspace", workspace).into());
        let flags = u32::from(spec.trans_a) | u32::from(spec.trans_b) << 1;
        for v in [spec.m, spec.n, spec.k, spec.batch] {
            args.push(Arg::from(v as u64));
        }
        args.push(flags.into());
        args.push(self.alpha.into());
        args.push(self.beta.into());
        args
    }

    pub(crate) fn kernel(&self) -> &'static Kernel {
        if self.bias.is_some() {
            T::WITH_BIAS
        } else {
            T::PLAIN
        }
    }
}

/// The simulator's GEMM: f32 accumulation over `k` in index order for every element (the loop
/// runs row by row over op(B)'s contiguous rows, so that it vectorizes; the order of each sum is
/// unchanged).
fn gemm_cpu<T: GemmElem, const BIAS: bool>(args: &CpuArgs) -> Result<()> {
    let [m, n, k, batch] = ["m", "n", "k", "batch"].map(|p| args.u64(p).map(|v| v as usize));
    let (m, n, k, batch) = (m?, n?, k?, batch?);
    let flags = args.u32("flags")?;
    let (alpha, beta) = (args.f32("alpha")?, args.f32("beta")?);
    let (trans_a, trans_b) = (flags & 1 != 0, flags & 2 != 0);
    let a = args.input::<T>("a")?;
    let b = args.input::<T>("b")?;
    let bias: Option<Vec<f32>> =
        if BIAS { Some(args.input::<T>("bias")?.iter().map(|v| v.to_f32()).collect()) } else { None };
    let mut c = args.output::<T>("c")?;
    let mut op_a = vec![0.0f32; m * k];
    let mut op_b = vec![0.0f32; k * n];
    let mut acc = vec![0.0f32; n];
    for p in 0..batch {
        let (a, b) = (&a[p * m * k..(p + 1) * m * k], &b[p * k * n..(p + 1) * k * n]);
        for i in 0..m {
            for q in 0..k {
                op_a[i * k + q] = if trans_a { a[q * m + i] } else { a[i * k + q] }.to_f32();
            }
        }
        for q in 0..k {
            for j in 0..n {
                op_b[q * n + j] = if trans_b { b[j * k + q] } else { b[q * n + j] }.to_f32();
            }
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
                let out = &mut c[p * m * n + i * n + j];
                let mut v = alpha * sum;
                if beta != 0.0 {
                    v += beta * out.to_f32();
                }
                if let Some(bias) = &bias {
                    v += bias[j];
                }
                *out = T::from_f32(v);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    fn one_argument_per_param<T: GemmElem>(dev: &Device) {
        let (x, workspace) = (dev.alloc::<T>(4).unwrap(), dev.alloc::<u8>(8).unwrap());
        for bias in [None, Some(x.slice(0..2))] {
            let g = Gemm { bias, ..Gemm::new(x.view(), x.view(), x.view(), (2, 2, 2)) };
            let args = g.args(&g.spec().unwrap(), workspace.view());
            assert_eq!(args.len(), g.kernel().params.len(), "{}", g.kernel().name);
        }
    }

    #[test]
    fn every_gemm_kernel_has_one_param_per_argument() {
        let dev = Device::sim();
        one_argument_per_param::<f32>(&dev);
        one_argument_per_param::<bf16>(&dev);
    }
}
