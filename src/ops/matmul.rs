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

use half::bf16;

use crate::device::{DType, Gemm, GemmElem, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// `C = alpha·op(A)·op(B) + beta·C (+ bias)` on tensors; the fields mean what [`Gemm`]'s do.
#[derive(Clone, Copy)]
pub struct Matmul<'t> {
    /// Output, `batch × m × n`.
    pub c: &'t Tensor,
    /// Left operand.
    pub a: &'t Tensor,
    /// Right operand.
    pub b: &'t Tensor,
    /// `n` elements added to every row.
    pub bias: Option<&'t Tensor>,
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

impl<'t> Matmul<'t> {
    /// `C = A·B` for `(m, n, k)`.
    pub fn new(c: &'t Tensor, a: &'t Tensor, b: &'t Tensor, dims: (usize, usize, usize)) -> Matmul<'t> {
        Matmul { c, a, b, bias: None, dims, batch: 1, trans_a: false, trans_b: false, alpha: 1.0, beta: 0.0 }
    }

    fn typed<T: GemmElem>(&self, stream: &Stream) -> Result<()> {
        let bias = self.bias.map(Tensor::view::<T>).transpose()?;
        stream.gemm(Gemm {
            bias,
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
    for t in [Some(m.a), Some(m.b), m.bias].into_iter().flatten() {
        t.expect_dtype(OP, dtype)?;
    }
    match dtype {
        DType::F32 => m.typed::<f32>(stream),
        DType::BF16 => m.typed::<bf16>(stream),
        dtype => Err(Error::UnsupportedDType { op: OP, dtype, supported: "f32 or bf16" }),
    }
}
