//! GEMM, the one library call of the device layer: cuBLASLt on CUDA, a CPU loop on the simulator.
//!
//! A GEMM is declared like a kernel launch, so its accesses (the output, A, B, the addend, the
//! epilogue's vectors and matrices, and the hidden per-stream workspace cuBLASLt uses) reach the
//! simulator, the checker and graph summaries. The matrices are row-major views: their leading
//! dimensions and batch strides are read off the views' regions, so a head of an attention tensor
//! or a column block is passed without copying. f32 GEMMs compute in IEEE f32 (not TF32), bf16
//! GEMMs accumulate in f32. An [`Epilogue`] fuses a layer's bias, GELU and bias gradient into the
//! GEMM's store, as cuBLASLt's epilogues do.
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

use super::kernel::{Arg, Hidden, In, InOut, Kernel, Out};
use super::{DType, Elem, Region, View};
use crate::{Error, Result};

pub(crate) mod cpu;
mod fp8;

pub use fp8::{Fp8Gemm, Fp8Pair, FP8_ALIGN_BYTES, FP8_SCALE_ALIGN_BYTES};

/// Element types cuBLASLt multiplies here.
pub trait GemmElem: Elem {
    /// One kernel per epilogue kind (in `EpilogueKind::ALL` order), without and with an addend.
    #[doc(hidden)]
    const KERNELS: &'static [[Kernel; 2]; EpilogueKind::ALL.len()];
    #[doc(hidden)]
    fn to_f32(self) -> f32;
    #[doc(hidden)]
    fn from_f32(v: f32) -> Self;
}

impl GemmElem for f32 {
    const KERNELS: &'static [[Kernel; 2]; EpilogueKind::ALL.len()] = &GEMM_F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl GemmElem for bf16 {
    const KERNELS: &'static [[Kernel; 2]; EpilogueKind::ALL.len()] = &GEMM_BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// The kernels of one operand and output type: cuBLASLt has no CUDA entry point to name the
/// arguments [`GemmArgs::build`] passes, so each epilogue and addend gets its own name list (the
/// buffers first, in that order), its own name in reports, and the CPU path for its epilogue.
/// `[$($scales),*]` names the FP8 GEMMs' scale buffers, or nothing.
macro_rules! gemm_kernels {
    ($a:ty, $b:ty, $t:ty, $name:literal, $scaled:literal, [$($scales:literal),*]) => {
        [
            gemm_kernels!(@pair $a, $b, $t, $name, $scaled, [$($scales),*], "", EpilogueKind::None, []),
            gemm_kernels!(@pair $a, $b, $t, $name, $scaled, [$($scales),*], "_bias", EpilogueKind::Bias, ["bias"]),
            gemm_kernels!(@pair $a, $b, $t, $name, $scaled, [$($scales),*], "_bias_gelu_aux", EpilogueKind::BiasGeluAux, ["bias", "aux"]),
            gemm_kernels!(@pair $a, $b, $t, $name, $scaled, [$($scales),*], "_dgelu_bgrad", EpilogueKind::DGeluBGrad, ["aux", "bias_grad"]),
            gemm_kernels!(@pair $a, $b, $t, $name, $scaled, [$($scales),*], "_bgrad_a", EpilogueKind::BGradA, ["bias_grad"]),
            gemm_kernels!(@pair $a, $b, $t, $name, $scaled, [$($scales),*], "_dgelu", EpilogueKind::DGelu, ["aux"]),
        ]
    };
    (@pair $a:ty, $b:ty, $t:ty, $name:literal, $scaled:literal, [$($scales:literal),*], $epi:literal, $kind:expr, [$($buf:literal),*]) => {
        [
            Kernel {
                name: concat!($name, $epi),
                source: "",
                params: &["c", "a", "b", $($scales,)* $($buf,)* "workspace", "m", "n", "k", "batch", "flags", "alpha", "beta"],
                cpu: $crate::device::gemm::cpu::gemm_cpu::<$a, $b, $t, { $kind as usize }, false, $scaled>,
                strided: true,
            },
            Kernel {
                name: concat!($name, $epi, "_addend"),
                source: "",
                params: &["c", "addend", "a", "b", $($scales,)* $($buf,)* "workspace", "m", "n", "k", "batch", "flags", "alpha", "beta"],
                cpu: $crate::device::gemm::cpu::gemm_cpu::<$a, $b, $t, { $kind as usize }, true, $scaled>,
                strided: true,
            },
        ]
    };
}
pub(crate) use gemm_kernels;

static GEMM_F32: [[Kernel; 2]; EpilogueKind::ALL.len()] = gemm_kernels!(f32, f32, f32, "gemm_f32", false, []);
static GEMM_BF16: [[Kernel; 2]; EpilogueKind::ALL.len()] = gemm_kernels!(bf16, bf16, bf16, "gemm_bf16", false, []);

/// `D = alpha·op(A)·op(B) + beta·C`, then the epilogue, row-major, over `batch` matrices.
///
/// `c` (D) is `batch × m × n`, `a` is `batch × m × k` (`k × m` with `trans_a`), `b` is
/// `batch × k × n` (`n × k` with `trans_b`). C is `addend` if given, else `c`'s own contents.
pub struct Gemm<'a, T: GemmElem> {
    /// Output (cuBLASLt's D). Also C, read when `beta ≠ 0`, unless `addend` is given.
    pub c: View<'a, T>,
    /// Left operand.
    pub a: View<'a, T>,
    /// Right operand.
    pub b: View<'a, T>,
    /// A separate C (`batch × m × n`, declared read whenever given), so that one GEMM computes
    /// `h = x + y·W` into a third buffer (a residual add) with `addend = x`, `beta = 1`.
    pub addend: Option<View<'a, T>>,
    /// What is fused into the store (default: nothing).
    pub epilogue: Epilogue<'a, T>,
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
    /// Scales C (0: C is not read, and `c` is only written).
    pub beta: f32,
}

impl<'a, T: GemmElem> Gemm<'a, T> {
    /// `C = A·B` for `(m, n, k)`: no batch, no transposes, no addend, no epilogue.
    pub fn new(c: View<'a, T>, a: View<'a, T>, b: View<'a, T>, dims: (usize, usize, usize)) -> Gemm<'a, T> {
        Gemm {
            c,
            a,
            b,
            addend: None,
            epilogue: Epilogue::None,
            dims,
            batch: 1,
            trans_a: false,
            trans_b: false,
            alpha: 1.0,
            beta: 0.0,
        }
    }
}

/// Elementwise work fused into a GEMM's store (cuBLASLt's epilogues), so that a layer's bias,
/// GELU and bias gradient cost no pass of their own over memory.
///
/// Below, `pre = alpha·op(A)·op(B) + beta·C` is the `m × n` row-major result before the epilogue
/// and `gelu` is GELU's tanh form, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`. Vectors are
/// contiguous; `aux` is an `m × n` row-major matrix whose row stride is a multiple of 8 elements
/// (cuBLASLt's requirement on its leading dimension). A bias gradient is written, never
/// accumulated, also when `beta = 1` accumulates into the output. The GELU and bias-gradient
/// epilogues take `batch = 1`.
///
/// ```
/// use graphed::device::{Device, Epilogue, Gemm};
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// // h = x + y·Wᵀ + b, the residual add after a projection, as one GEMM (m, n, k) = (1, 2, 2).
/// let x = dev.alloc_from(&s, &[10.0f32, 20.0])?;
/// let y = dev.alloc_from(&s, &[1.0f32, 2.0])?;
/// let w = dev.alloc_from(&s, &[1.0f32, 0.0, 0.0, 1.0])?;
/// let b = dev.alloc_from(&s, &[0.5f32, 0.25])?;
/// let h = dev.alloc::<f32>(2)?;
/// s.gemm(Gemm {
///     addend: Some(x.view()),
///     beta: 1.0,
///     trans_b: true,
///     epilogue: Epilogue::Bias(b.view()),
///     ..Gemm::new(h.view(), y.view(), w.view(), (1, 2, 2))
/// })?;
/// assert_eq!(h.to_vec(&s)?, vec![11.5, 22.25]);
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone, Copy)]
pub enum Epilogue<'a, T: GemmElem> {
    /// `D = pre`.
    None,
    /// `D = pre + bias`, the bias (`n`) added to every row: a linear layer's forward (cuBLASLt's
    /// `BIAS`).
    Bias(View<'a, T>),
    /// `aux = pre + bias` and `D = gelu(pre + bias)`: the forward of `gelu(x·Wᵀ + b)`, saving
    /// GELU's input for the backward (cuBLASLt's `GELU_AUX_BIAS`). D's GELU is taken of the f32
    /// value, not of the rounded `aux`.
    BiasGeluAux {
        /// `n` elements, read.
        bias: View<'a, T>,
        /// `m × n`, written.
        aux: View<'a, T>,
    },
    /// `D = pre ⊙ gelu'(aux)` and `bias_grad = Σ_rows D`: the data gradient of the GEMM after
    /// a GELU, fused with GELU's backward and with the bias gradient of the layer before the
    /// GELU (cuBLASLt's `DGELU_BGRAD`).
    DGeluBGrad {
        /// `m × n`, read: GELU's input, as [`Epilogue::BiasGeluAux`] saved it.
        aux: View<'a, T>,
        /// `n` elements, written: D's column sums.
        bias_grad: View<'a, T>,
    },
    /// `D = pre` and `bias_grad = op(A)`'s row sums (over `k`): with the weight gradient
    /// `dW = dyᵀ·x` (`a = dy`, `trans_a`, dims `(out, in, tokens)`), the bias gradient `Σ dy`
    /// over the tokens, for free (cuBLASLt's `BGRADB`: our row-major A is its B).
    BGradA {
        /// `m` elements, written.
        bias_grad: View<'a, T>,
    },
    /// `D = pre ⊙ gelu'(aux)`: GELU's backward without the bias gradient (cuBLASLt's `DGELU`),
    /// for shapes where `DGELU_BGRAD`'s reduction costs more than a `BGRADB` on the next
    /// weight-gradient GEMM.
    DGelu {
        /// `m × n`, read: GELU's input, as [`Epilogue::BiasGeluAux`] saved it.
        aux: View<'a, T>,
    },
}

/// Which epilogue, without its buffers: part of the plan cache key and of the kernel's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum EpilogueKind {
    None,
    Bias,
    BiasGeluAux,
    DGeluBGrad,
    BGradA,
    DGelu,
}

impl EpilogueKind {
    /// Every kind, each at the index of its discriminant.
    pub(crate) const ALL: [EpilogueKind; 6] = [
        EpilogueKind::None,
        EpilogueKind::Bias,
        EpilogueKind::BiasGeluAux,
        EpilogueKind::DGeluBGrad,
        EpilogueKind::BGradA,
        EpilogueKind::DGelu,
    ];

    /// Whether the epilogue writes per-GEMM data (an aux matrix, a bias gradient), which
    /// graphed does not batch.
    fn per_matrix(self) -> bool {
        matches!(
            self,
            EpilogueKind::BiasGeluAux | EpilogueKind::DGeluBGrad | EpilogueKind::BGradA | EpilogueKind::DGelu
        )
    }
}

impl<'a, T: GemmElem> Epilogue<'a, T> {
    /// The kind, without the buffers.
    pub(crate) fn kind(&self) -> EpilogueKind {
        match self {
            Epilogue::None => EpilogueKind::None,
            Epilogue::Bias(_) => EpilogueKind::Bias,
            Epilogue::BiasGeluAux { .. } => EpilogueKind::BiasGeluAux,
            Epilogue::DGeluBGrad { .. } => EpilogueKind::DGeluBGrad,
            Epilogue::BGradA { .. } => EpilogueKind::BGradA,
            Epilogue::DGelu { .. } => EpilogueKind::DGelu,
        }
    }

    /// The epilogue's buffers, in [`Gemm::args`] order.
    fn views(&self) -> [Option<&View<'a, T>>; 2] {
        match self {
            Epilogue::None => [None, None],
            Epilogue::Bias(bias) => [Some(bias), None],
            Epilogue::BiasGeluAux { bias, aux } => [Some(bias), Some(aux)],
            Epilogue::DGeluBGrad { aux, bias_grad } => [Some(aux), Some(bias_grad)],
            Epilogue::BGradA { bias_grad } => [Some(bias_grad), None],
            Epilogue::DGelu { aux } => [Some(aux), None],
        }
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
    /// The output, D.
    pub(crate) c: Operand,
    /// C when it is not D.
    pub(crate) addend: Option<Operand>,
    pub(crate) epilogue: EpilogueKind,
    /// The aux matrix's leading dimension, with the GELU epilogues.
    pub(crate) aux_ld: Option<usize>,
    /// A's and B's element types (`dtype` for every GEMM but the FP8 ones).
    pub(crate) inputs: [DType; 2],
    /// How an FP8 GEMM scales and accumulates.
    pub(crate) scaled: Option<Scaled>,
}

/// What an FP8 GEMM adds to its layout: part of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Scaled {
    /// cuBLASLt's `FAST_ACCUM`: accumulate in the tensor cores' own precision throughout.
    pub(crate) fast_accum: bool,
}

/// cuBLASLt's requirement on an epilogue's aux leading dimension, in elements.
pub const AUX_LD_MULTIPLE: usize = 8;

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

impl<'a, T: GemmElem> Gemm<'a, T> {
    /// Every buffer the GEMM names: the output, A, B, the addend, the epilogue's.
    pub(crate) fn views(&self) -> impl Iterator<Item = &View<'a, T>> {
        [Some(&self.c), Some(&self.a), Some(&self.b), self.addend.as_ref()]
            .into_iter()
            .chain(self.epilogue.views())
            .flatten()
    }

    /// Checks the views against the dimensions and the epilogue, and derives the layout.
    pub(crate) fn spec(&self) -> Result<GemmSpec> {
        let matrices = Matrices {
            c: self.c.region(),
            a: self.a.region(),
            b: self.b.region(),
            addend: self.addend.map(|v| v.region()),
            dims: self.dims,
            batch: self.batch.max(1),
            trans: (self.trans_a, self.trans_b),
        };
        matrices.spec(T::DTYPE, [T::DTYPE; 2], &self.epilogue)
    }

    /// The launch arguments, one per name of [`Gemm::kernel`]'s params.
    pub(crate) fn args<'w>(&'w self, spec: &GemmSpec, workspace: View<'w, u8>) -> Vec<Arg<'w>> {
        let mut args = head(self.c, self.addend, [In(self.a).into(), In(self.b).into()], self.beta);
        push_epilogue(&mut args, &self.epilogue);
        push_tail(&mut args, workspace, spec, (self.alpha, self.beta));
        args
    }

    pub(crate) fn kernel(&self) -> &'static Kernel {
        &T::KERNELS[self.epilogue.kind() as usize][usize::from(self.addend.is_some())]
    }
}

/// A GEMM's matrices as regions, whatever their element types: what its layout is checked
/// against and derived from.
struct Matrices {
    c: Region,
    a: Region,
    b: Region,
    addend: Option<Region>,
    dims: (usize, usize, usize),
    batch: usize,
    /// (`trans_a`, `trans_b`).
    trans: (bool, bool),
}

impl Matrices {
    /// Checks the regions against the dimensions and `epilogue`, and derives the layout of a
    /// GEMM of `inputs` (A's and B's element types) into `dtype`.
    fn spec<T: GemmElem>(&self, dtype: DType, inputs: [DType; 2], epilogue: &Epilogue<'_, T>) -> Result<GemmSpec> {
        let ((m, n, k), batch, (trans_a, trans_b)) = (self.dims, self.batch, self.trans);
        let (a_rows, a_cols) = if trans_a { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if trans_b { (n, k) } else { (k, n) };
        let matrix = |what: &str, r: &Region, rows, cols| {
            operand(r, batch, rows, cols).ok_or_else(|| bad_matrix(what, r, batch, rows, cols))
        };
        let a = matrix("A", &self.a, a_rows, a_cols)?;
        let b = matrix("B", &self.b, b_rows, b_cols)?;
        let c = matrix("C", &self.c, m, n)?;
        let addend = self.addend.as_ref().map(|r| matrix("the addend", r, m, n)).transpose()?;
        let kind = epilogue.kind();
        if kind.per_matrix() && batch > 1 {
            return Err(Error::Shape {
                op: OP,
                expected: format!("batch 1 with the {kind:?} epilogue (its aux matrix or bias gradient belongs to one GEMM); enqueue one GEMM per matrix"),
                found: vec![batch],
            });
        }
        let aux_ld = epilogue_aux_ld(epilogue, m, n)?;
        Ok(GemmSpec {
            dtype,
            inputs,
            m,
            n,
            k,
            batch,
            trans_a,
            trans_b,
            a,
            b,
            c,
            addend,
            epilogue: kind,
            aux_ld,
            scaled: None,
        })
    }
}

/// Checks the epilogue's bias (or bias gradient) and aux matrix against the `m`×`n` output;
/// the aux matrix's leading dimension, if it has one.
fn epilogue_aux_ld<T: GemmElem>(epilogue: &Epilogue<'_, T>, m: usize, n: usize) -> Result<Option<usize>> {
    let aux_ld = |aux: &View<'_, T>| {
        let r = aux.region();
        let ld = operand(&r, 1, m, n).ok_or_else(|| bad_matrix("aux", &r, 1, m, n))?.ld;
        if ld % AUX_LD_MULTIPLE != 0 {
            return Err(Error::Shape {
                op: OP,
                expected: format!("aux as a row-major {m}x{n} matrix whose row stride is a multiple of {AUX_LD_MULTIPLE} elements (cuBLASLt's aux leading dimension), not {ld}: pad its rows to a multiple of {AUX_LD_MULTIPLE}"),
                found: shape(&r),
            });
        }
        Ok(ld)
    };
    Ok(match epilogue {
        Epilogue::None => None,
        Epilogue::Bias(bias) => {
            vector("the bias", bias, n)?;
            None
        }
        Epilogue::BiasGeluAux { bias, aux } => {
            vector("the bias", bias, n)?;
            Some(aux_ld(aux)?)
        }
        Epilogue::DGeluBGrad { aux, bias_grad } => {
            vector("the bias gradient (one per column of D)", bias_grad, n)?;
            Some(aux_ld(aux)?)
        }
        Epilogue::DGelu { aux } => Some(aux_ld(aux)?),
        Epilogue::BGradA { bias_grad } => {
            vector("the bias gradient (one per row of op(A))", bias_grad, m)?;
            None
        }
    })
}

/// The first launch arguments of every GEMM: D (also read when `beta ≠ 0` without an addend),
/// the addend, A and B.
fn head<'w, T: GemmElem>(c: View<'w, T>, addend: Option<View<'w, T>>, ab: [Arg<'w>; 2], beta: f32) -> Vec<Arg<'w>> {
    let reads_c = beta != 0.0 && addend.is_none();
    let mut args: Vec<Arg<'_>> = vec![if reads_c { InOut(c).into() } else { Out(c).into() }];
    args.extend(addend.map(|x| In(x).into()));
    args.extend(ab);
    args
}

/// The epilogue's buffers, read or written.
fn push_epilogue<'w, T: GemmElem>(args: &mut Vec<Arg<'w>>, epilogue: &Epilogue<'w, T>) {
    match *epilogue {
        Epilogue::None => {}
        Epilogue::Bias(bias) => args.push(In(bias).into()),
        Epilogue::BiasGeluAux { bias, aux } => args.extend([In(bias).into(), Out(aux).into()]),
        Epilogue::DGeluBGrad { aux, bias_grad } => args.extend([In(aux).into(), Out(bias_grad).into()]),
        Epilogue::BGradA { bias_grad } => args.push(Out(bias_grad).into()),
        Epilogue::DGelu { aux } => args.push(In(aux).into()),
    }
}

/// The last launch arguments of every GEMM: the workspace and the scalars.
fn push_tail<'w>(args: &mut Vec<Arg<'w>>, workspace: View<'w, u8>, spec: &GemmSpec, (alpha, beta): (f32, f32)) {
    args.push(Hidden("gemm workspace", workspace).into());
    let flags = u32::from(spec.trans_a) | u32::from(spec.trans_b) << 1;
    for v in [spec.m, spec.n, spec.k, spec.batch] {
        args.push(Arg::from(v as u64));
    }
    args.push(flags.into());
    args.push(alpha.into());
    args.push(beta.into());
}

/// The GEMM's name in its errors.
const OP: &str = "Stream::gemm";

/// A region's dimensions, for an error.
fn shape(r: &Region) -> Vec<usize> {
    r.dims().iter().map(|d| d.count).collect()
}

/// The error of `r`, named `what`, that is not `batch` matrices of `rows`×`cols`.
fn bad_matrix(what: &str, r: &Region, batch: usize, rows: usize, cols: usize) -> Error {
    Error::Shape {
        op: OP,
        expected: format!("{what} as {batch} row-major {rows}x{cols} matrices with unit column stride"),
        found: shape(r),
    }
}

/// Checks that `v`, named `what`, is `len` contiguous elements.
fn vector<T: Elem>(what: &str, v: &View<'_, T>, len: usize) -> Result<()> {
    if v.len() == len && v.region().is_contiguous() {
        return Ok(());
    }
    Err(Error::Shape { op: OP, expected: format!("{what} as {len} contiguous elements"), found: shape(&v.region()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    fn one_argument_per_param<T: GemmElem>(dev: &Device) {
        let (x, workspace) = (dev.alloc::<T>(64).unwrap(), dev.alloc::<u8>(8).unwrap());
        let (v, vec) = (x.slice(0..64), x.slice(0..8));
        let epilogues = [
            Epilogue::None,
            Epilogue::Bias(vec),
            Epilogue::BiasGeluAux { bias: vec, aux: v },
            Epilogue::DGeluBGrad { aux: v, bias_grad: vec },
            Epilogue::BGradA { bias_grad: vec },
        ];
        for epilogue in epilogues {
            for addend in [None, Some(v)] {
                let g = Gemm { epilogue, addend, ..Gemm::new(v, v, v, (8, 8, 8)) };
                let args = g.args(&g.spec().unwrap(), workspace.view());
                let kernel = g.kernel();
                assert_eq!(args.len(), kernel.params.len(), "{}", kernel.name);
                let buffers = args.iter().filter(|a| matches!(a, Arg::Buf(_))).count();
                assert_eq!(buffers, 1 + g.views().count(), "{}: one buffer per view and the workspace", kernel.name);
            }
        }
    }

    #[test]
    fn every_gemm_kernel_has_one_param_per_argument() {
        let dev = Device::sim();
        one_argument_per_param::<f32>(&dev);
        one_argument_per_param::<bf16>(&dev);
    }

    #[test]
    fn epilogue_kinds_index_their_kernels() {
        for (i, kind) in EpilogueKind::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, i);
        }
        let names: Vec<&str> = GEMM_BF16.iter().flatten().map(|k| k.name).collect();
        assert_eq!(names[4], "gemm_bf16_bias_gelu_aux");
        assert_eq!(names[9], "gemm_bf16_bgrad_a_addend");
    }

    #[test]
    fn the_plan_key_tells_epilogues_and_addends_apart() {
        let dev = Device::sim();
        let x = dev.alloc::<f32>(64).unwrap();
        let (v, vec) = (x.view(), x.slice(0..8));
        let plain = Gemm::new(v, v, v, (8, 8, 8));
        let specs = [
            plain.spec().unwrap(),
            Gemm { addend: Some(v), ..Gemm::new(v, v, v, (8, 8, 8)) }.spec().unwrap(),
            Gemm { epilogue: Epilogue::BGradA { bias_grad: vec }, ..Gemm::new(v, v, v, (8, 8, 8)) }.spec().unwrap(),
            Gemm { epilogue: Epilogue::DGeluBGrad { aux: v, bias_grad: vec }, ..Gemm::new(v, v, v, (8, 8, 8)) }
                .spec()
                .unwrap(),
        ];
        for (i, s) in specs.iter().enumerate() {
            assert!(specs[i + 1..].iter().all(|t| t != s), "spec {i} repeats");
        }
    }

    #[test]
    fn gelu_grad_is_the_derivative_of_gelu() {
        use cpu::{gelu, gelu_grad};
        for x in [-3.0f32, -1.0, -0.25, 0.0, 0.5, 2.0] {
            let h = 1e-2;
            let numeric = (gelu(x + h) - gelu(x - h)) / (2.0 * h);
            assert!((numeric - gelu_grad(x)).abs() < 1e-3, "x = {x}: {numeric} vs {}", gelu_grad(x));
        }
    }
}
