//! GEMMs on tensors: the element type read off the operands at run time, checked to agree, and
//! dispatched to the device layer's typed [`Gemm`] (cuBLASLt on CUDA).
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::matmul::{matmul, Matmul};
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let a = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! let eye = Tensor::from_host(&alloc, &s, &[1.0f32, 0.0, 0.0, 1.0], &[2, 2])?;
//! let c = Tensor::zeros(&alloc, &s, &[2, 2], a.dtype())?;
//! matmul(Matmul::new(&c, &a, &eye, (2, 2, 2)), &s)?;
//! assert_eq!(c.to_vec::<f32>(&s)?, vec![1.0, 2.0, 3.0, 4.0]);
//! # Ok::<(), graphed::Error>(())
//! ```

use float8::{F8E4M3, F8E5M2};
use half::bf16;

use crate::device::{DType, Epilogue, Float8, Fp8Gemm, Fp8Pair, Gemm, GemmElem, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// What the GEMM's store does besides writing the product: [`Epilogue`] on tensors.
#[derive(Clone, Copy, Default)]
pub enum Fused<'t> {
    /// Nothing.
    #[default]
    None,
    /// Adds `n` elements to every row.
    Bias(&'t Tensor),
    /// Adds the bias, keeps the pre-activation in `aux` (for the backward), stores GELU(tanh) of it.
    BiasGeluAux {
        /// `n` elements.
        bias: &'t Tensor,
        /// `m × n`, written.
        aux: &'t Tensor,
    },
    /// Multiplies the product by GELU′(`aux`) and writes the result's column sums to `bias_grad`:
    /// the GELU backward and the bias gradient of the layer before it.
    DGeluBGrad {
        /// The forward's pre-activation, `m × n`.
        aux: &'t Tensor,
        /// `n` elements, written.
        bias_grad: &'t Tensor,
    },
    /// Multiplies the product by GELU′(`aux`): GELU's backward alone.
    DGelu {
        /// The forward's pre-activation, `m × n`.
        aux: &'t Tensor,
    },
    /// Writes the row sums of op(A) over k to `bias_grad` (`m` elements): a weight-gradient GEMM
    /// `dW = dyᵀ·x` that also yields the bias gradient `Σ dy`.
    BGradA {
        /// `m` elements, written.
        bias_grad: &'t Tensor,
    },
}

impl<'t> Fused<'t> {
    fn tensors(&self) -> Vec<&'t Tensor> {
        match *self {
            Fused::None => vec![],
            Fused::Bias(b) => vec![b],
            Fused::BiasGeluAux { bias, aux } => vec![bias, aux],
            Fused::DGeluBGrad { aux, bias_grad } => vec![aux, bias_grad],
            Fused::BGradA { bias_grad } => vec![bias_grad],
            Fused::DGelu { aux } => vec![aux],
        }
    }

    fn typed<T: GemmElem>(&self) -> Result<Epilogue<'t, T>> {
        Ok(match *self {
            Fused::None => Epilogue::None,
            Fused::Bias(b) => Epilogue::Bias(b.view()?),
            Fused::BiasGeluAux { bias, aux } => Epilogue::BiasGeluAux { bias: bias.view()?, aux: aux.view()? },
            Fused::DGeluBGrad { aux, bias_grad } => {
                Epilogue::DGeluBGrad { aux: aux.view()?, bias_grad: bias_grad.view()? }
            }
            Fused::BGradA { bias_grad } => Epilogue::BGradA { bias_grad: bias_grad.view()? },
            Fused::DGelu { aux } => Epilogue::DGelu { aux: aux.view()? },
        })
    }
}

/// `C = alpha·op(A)·op(B) + beta·(addend or C)`, then the epilogue, on tensors; the fields mean
/// what [`Gemm`]'s do.
#[derive(Clone, Copy)]
pub struct Matmul<'t> {
    /// Output, `batch × m × n`.
    pub c: &'t Tensor,
    /// Left operand.
    pub a: &'t Tensor,
    /// Right operand.
    pub b: &'t Tensor,
    /// A separate C, `batch × m × n` (a residual added with `beta = 1`).
    pub addend: Option<&'t Tensor>,
    /// What the store fuses.
    pub fused: Fused<'t>,
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
    /// Scales C's previous contents or the addend (0: C is only written).
    pub beta: f32,
}

impl<'t> Matmul<'t> {
    /// `C = A·B` for `(m, n, k)`.
    pub fn new(c: &'t Tensor, a: &'t Tensor, b: &'t Tensor, dims: (usize, usize, usize)) -> Matmul<'t> {
        Matmul {
            c,
            a,
            b,
            addend: None,
            fused: Fused::None,
            dims,
            batch: 1,
            trans_a: false,
            trans_b: false,
            alpha: 1.0,
            beta: 0.0,
        }
    }

    fn typed<T: GemmElem>(&self, stream: &Stream) -> Result<()> {
        stream.gemm(Gemm {
            addend: self.addend.map(Tensor::view::<T>).transpose()?,
            epilogue: self.fused.typed()?,
            batch: self.batch,
            trans_a: self.trans_a,
            trans_b: self.trans_b,
            alpha: self.alpha,
            beta: self.beta,
            ..Gemm::new(self.c.view::<T>()?, self.a.view()?, self.b.view()?, self.dims)
        })
    }
}

/// Runs `m` on `stream`.
///
/// # Errors
/// [`Error::DTypeMismatch`] unless every operand has C's element type;
/// [`Error::UnsupportedDType`] unless that is f32 or bf16; as [`Stream::gemm`] otherwise.
pub fn matmul(m: Matmul<'_>, stream: &Stream) -> Result<()> {
    const OP: &str = "matmul";
    let dtype = m.c.dtype();
    for t in [m.a, m.b].into_iter().chain(m.addend).chain(m.fused.tensors()) {
        t.expect_dtype(OP, dtype)?;
    }
    super::with_float!(OP, dtype, T => m.typed::<T>(stream))
}

/// An FP8 GEMM on tensors (the device layer's [`Fp8Gemm`]): `C = alpha·(a_scale_inv·b_scale_inv)·
/// A·Bᵀ + beta·C'`, then the epilogue, with A (`m × k`) and B (`n × k`) in FP8, C, the addend and
/// the epilogue's tensors in bf16, the scales one f32 each.
pub struct Fp8Matmul<'t> {
    /// Output, bf16 `m × n`.
    pub c: &'t Tensor,
    /// Left operand, `m × k`, E4M3 or E5M2.
    pub a: &'t Tensor,
    /// Right operand, `n × k`, E4M3 or E5M2 (not both E5M2).
    pub b: &'t Tensor,
    /// A's dequantization factor.
    pub a_scale_inv: &'t Tensor,
    /// B's dequantization factor.
    pub b_scale_inv: &'t Tensor,
    /// A separate C.
    pub addend: Option<&'t Tensor>,
    /// The epilogue (not [`Fused::BGradA`]).
    pub fused: Fused<'t>,
    /// (m, n, k).
    pub dims: (usize, usize, usize),
    /// Scales C's previous contents or the addend.
    pub beta: f32,
    /// Accumulate in the tensor cores' precision throughout (the forward's GEMMs).
    pub fast_accum: bool,
}

impl<'t> Fp8Matmul<'t> {
    /// `C = (a_scale_inv·b_scale_inv)·A·Bᵀ` for `(m, n, k)`.
    pub fn new(
        c: &'t Tensor,
        (a, b): (&'t Tensor, &'t Tensor),
        (a_scale_inv, b_scale_inv): (&'t Tensor, &'t Tensor),
        dims: (usize, usize, usize),
    ) -> Fp8Matmul<'t> {
        Fp8Matmul {
            c,
            a,
            b,
            a_scale_inv,
            b_scale_inv,
            addend: None,
            fused: Fused::None,
            dims,
            beta: 0.0,
            fast_accum: false,
        }
    }

    fn typed<A: Float8, B: Float8>(&self, stream: &Stream) -> Result<()>
    where
        (A, B): Fp8Pair,
    {
        stream.fp8_gemm(Fp8Gemm {
            addend: self.addend.map(Tensor::view::<bf16>).transpose()?,
            epilogue: self.fused.typed()?,
            beta: self.beta,
            fast_accum: self.fast_accum,
            ..Fp8Gemm::new(
                self.c.view()?,
                self.a.view()?,
                self.b.view()?,
                (self.a_scale_inv.view()?, self.b_scale_inv.view()?),
                self.dims,
            )
        })
    }
}

/// Runs `m` on `stream`.
///
/// # Errors
/// [`Error::DTypeMismatch`] unless C, the addend and the epilogue's tensors are bf16 and the
/// scales f32; [`Error::UnsupportedDType`] unless A and B are E4M3 × E4M3, E4M3 × E5M2 or
/// E5M2 × E4M3; as [`Stream::fp8_gemm`] otherwise.
pub fn fp8_matmul(m: Fp8Matmul<'_>, stream: &Stream) -> Result<()> {
    const OP: &str = "fp8_matmul";
    for t in [m.c].into_iter().chain(m.addend).chain(m.fused.tensors()) {
        t.expect_dtype(OP, DType::BF16)?;
    }
    for t in [m.a_scale_inv, m.b_scale_inv] {
        t.expect_dtype(OP, DType::F32)?;
    }
    match (m.a.dtype(), m.b.dtype()) {
        (DType::F8E4M3, DType::F8E4M3) => m.typed::<F8E4M3, F8E4M3>(stream),
        (DType::F8E4M3, DType::F8E5M2) => m.typed::<F8E4M3, F8E5M2>(stream),
        (DType::F8E5M2, DType::F8E4M3) => m.typed::<F8E5M2, F8E4M3>(stream),
        (a, b) => Err(Error::UnsupportedDType {
            op: OP,
            dtype: if matches!(a, DType::F8E4M3 | DType::F8E5M2) { b } else { a },
            supported: "f8e4m3 × f8e4m3, f8e4m3 × f8e5m2 or f8e5m2 × f8e4m3",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DType, Device};
    use crate::memory::CachingAllocator;
    use crate::Error;

    #[test]
    fn operands_of_another_or_an_unsupported_type_are_refused_before_anything_runs() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let c = Tensor::from_host(&alloc, &s, &[7.0f32; 4], &[2, 2]).unwrap();
        let a = Tensor::from_host(&alloc, &s, &[1.0f32; 4], &[2, 2]).unwrap();
        let b16 = Tensor::zeros(&alloc, &s, &[2, 2], DType::BF16).unwrap();
        let r = matmul(Matmul::new(&c, &a, &b16, (2, 2, 2)), &s);
        assert!(
            matches!(r, Err(Error::DTypeMismatch { op: "matmul", expected: DType::F32, found: DType::BF16 })),
            "{r:?}"
        );
        let bias = Tensor::zeros(&alloc, &s, &[2], DType::BF16).unwrap();
        let r = matmul(Matmul { fused: Fused::Bias(&bias), ..Matmul::new(&c, &a, &a, (2, 2, 2)) }, &s);
        assert!(matches!(r, Err(Error::DTypeMismatch { op: "matmul", .. })), "{r:?}");
        let h = Tensor::zeros(&alloc, &s, &[2, 2], DType::F16).unwrap();
        let r = matmul(Matmul::new(&h, &h, &h, (2, 2, 2)), &s);
        assert!(matches!(r, Err(Error::UnsupportedDType { op: "matmul", dtype: DType::F16, .. })), "{r:?}");
        assert_eq!(c.to_vec::<f32>(&s).unwrap(), vec![7.0; 4], "nothing ran");
    }
}
