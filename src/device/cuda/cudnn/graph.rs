//! The operation graphs of fused causal attention, op for op as cudnn-frontend 1.23 expands its
//! composite SDPA nodes for cuDNN below 9.21 (`CompositeSDPANode`, `CompositeSDPABackwardNode`,
//! `CompositeDiagonalBandMaskNode`, `CompositeSoftmaxNode`): cuDNN's fused attention engines
//! recognise these patterns, not the math, so the op order, the virtual flags, the fp32
//! intermediates and the strides below follow the frontend's (notes/attention.md §2.3, §2.4).
//!
//! Logical dimensions are `[b, h, s, d]`; layouts are strides only. The matmuls take Kᵀ and Vᵀ,
//! the same memory with the last two dimensions and strides swapped. Scalars (the scale, −∞,
//! 1) are by-value f32 tensors of rank 4, their values given at execution.

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as K, cudnnDataType_t as D,
    cudnnPointwiseMode_t as P, cudnnReduceTensorOp_t as R,
};

use super::descriptor::Descriptor;
use crate::device::sdpa::{SdpaPass, SdpaSpec, Strides};
use crate::Result;

/// The unique ids of the tensors that the execution binds to memory or values (FE's samples'
/// numbering for the operands).
pub(super) mod uid {
    pub(in super::super) const Q: i64 = 1;
    pub(in super::super) const K: i64 = 2;
    pub(in super::super) const V: i64 = 3;
    pub(in super::super) const O: i64 = 4;
    pub(in super::super) const STATS: i64 = 5;
    pub(in super::super) const SCALE: i64 = 6;
    pub(in super::super) const NEG_INF: i64 = 7;
    pub(in super::super) const ONE: i64 = 8;
    pub(in super::super) const DO: i64 = 101;
    pub(in super::super) const DQ: i64 = 102;
    pub(in super::super) const DK: i64 = 103;
    pub(in super::super) const DV: i64 = 104;
    pub(in super::super) const SOFTMAX_SUM: i64 = 105;
    pub(in super::super) const DQ_ACCUMULATOR: i64 = 106;
    /// The first id of the virtual tensors.
    pub(in super::super) const FIRST_VIRTUAL: i64 = 1000;
}

/// The byte alignment declared for every tensor: FE's default. bf16 operands are 16-byte aligned
/// (`ops::attention` checks), allocations more.
const ALIGNMENT: i64 = 16;

/// Which backward graph: FE's deterministic Hopper form writes `dS·K` straight into dQ; the
/// other accumulates it into an fp32 buffer, then copies (IDENTITY) into dQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Variant {
    Forward,
    BackwardDirect,
    BackwardAccumulated,
}

impl Variant {
    /// The graphs to try for `spec`, in order of preference: a nondeterministic backward tries
    /// the accumulated form first, whose engines add into dQ with atomics and need no `T × T`
    /// scratch.
    pub(super) fn for_spec(spec: &SdpaSpec) -> &'static [Variant] {
        match (spec.pass, spec.deterministic) {
            (SdpaPass::Forward, _) => &[Variant::Forward],
            (SdpaPass::Backward, true) => &[Variant::BackwardDirect, Variant::BackwardAccumulated],
            (SdpaPass::Backward, false) => &[Variant::BackwardAccumulated, Variant::BackwardDirect],
        }
    }
}

/// A tensor of the graph: the index of its descriptor, and its shape.
#[derive(Clone, Copy)]
struct T {
    at: usize,
    dims: [i64; 4],
    strides: [i64; 4],
}

/// A finalized operation graph, with every descriptor it was made of (kept alive with it).
pub(super) struct OpGraph {
    pub(super) graph: Descriptor,
    _parts: Vec<Descriptor>,
}

/// Builds one graph: tensors and operations in the order they are added.
struct Builder {
    tensors: Vec<Descriptor>,
    ops: Vec<Descriptor>,
    /// Pointwise, matmul and reduction descriptors the operations point to.
    inner: Vec<Descriptor>,
    next_virtual: i64,
}

fn rows(s: Strides) -> [i64; 4] {
    [s[0] as i64, s[1] as i64, s[2] as i64, 1]
}

/// The same memory with the last two dimensions (and strides) swapped: Kᵀ of K.
fn transposed(s: Strides) -> [i64; 4] {
    [s[0] as i64, s[1] as i64, 1, s[2] as i64]
}

impl Builder {
    fn new() -> Builder {
        Builder { tensors: Vec::new(), ops: Vec::new(), inner: Vec::new(), next_virtual: uid::FIRST_VIRTUAL }
    }

    fn tensor(&mut self, uid: i64, dims: [i64; 4], strides: [i64; 4], ty: D, virt: bool, by_value: bool) -> Result<T> {
        let mut d = Descriptor::new(K::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set_data_type(A::CUDNN_ATTR_TENSOR_DATA_TYPE, ty)?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
        d.set_i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT])?;
        if virt {
            d.set_bool(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, true)?;
        }
        if by_value {
            d.set_bool(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
        }
        d.finalize()?;
        self.tensors.push(d);
        Ok(T { at: self.tensors.len() - 1, dims, strides })
    }

    /// A tensor the execution binds to memory.
    fn io(&mut self, uid: i64, dims: [i64; 4], strides: [i64; 4], ty: D) -> Result<T> {
        self.tensor(uid, dims, strides, ty, false, false)
    }

    /// An f32 scalar given by value at execution.
    fn scalar(&mut self, uid: i64) -> Result<T> {
        self.tensor(uid, [1; 4], [1; 4], D::CUDNN_DATA_FLOAT, false, true)
    }

    /// An intermediate that never reaches memory.
    fn virt(&mut self, dims: [i64; 4], strides: [i64; 4], ty: D) -> Result<T> {
        let uid = self.next_virtual;
        self.next_virtual += 1;
        self.tensor(uid, dims, strides, ty, true, false)
    }

    /// A virtual f32 like `x` (FE's pointwise outputs take the shape and strides of their first
    /// input of the same shape).
    fn like(&mut self, x: T) -> Result<T> {
        self.virt(x.dims, x.strides, D::CUDNN_DATA_FLOAT)
    }

    fn desc(&self, t: T) -> &Descriptor {
        &self.tensors[t.at]
    }

    /// `y = mode(x, b, t)`, computed in `math`; `axis` for GEN_INDEX.
    fn pointwise(
        &mut self,
        mode: P,
        math: D,
        (x, b, t): (T, Option<T>, Option<T>),
        y: T,
        axis: Option<i64>,
    ) -> Result<()> {
        let mut pw = Descriptor::new(K::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.set_pointwise_mode(A::CUDNN_ATTR_POINTWISE_MODE, mode)?;
        pw.set_data_type(A::CUDNN_ATTR_POINTWISE_MATH_PREC, math)?;
        if let Some(axis) = axis {
            pw.set_i64s(A::CUDNN_ATTR_POINTWISE_AXIS, &[axis])?;
        }
        pw.finalize()?;
        let mut op = Descriptor::new(K::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[self.desc(x)])?;
        if let Some(b) = b {
            op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[self.desc(b)])?;
        }
        if let Some(t) = t {
            op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[self.desc(t)])?;
        }
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[self.desc(y)])?;
        op.set_f32(A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0)?;
        op.set_f32(A::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0)?;
        op.finalize()?;
        self.inner.push(pw);
        self.ops.push(op);
        Ok(())
    }

    /// `y = mode(x)` in f32.
    fn unary(&mut self, mode: P, x: T, y: T) -> Result<()> {
        self.pointwise(mode, D::CUDNN_DATA_FLOAT, (x, None, None), y, None)
    }

    /// `y = mode(x, b)` in f32.
    fn binary(&mut self, mode: P, x: T, b: T, y: T) -> Result<()> {
        self.pointwise(mode, D::CUDNN_DATA_FLOAT, (x, Some(b), None), y, None)
    }

    /// `c = a·b` over the leading (batch, head) dimensions, accumulated in f32.
    fn matmul(&mut self, a: T, b: T, c: T) -> Result<()> {
        let mut mm = Descriptor::new(K::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        mm.set_data_type(A::CUDNN_ATTR_MATMUL_COMP_TYPE, D::CUDNN_DATA_FLOAT)?;
        mm.finalize()?;
        let mut op = Descriptor::new(K::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[self.desc(a)])?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[self.desc(b)])?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[self.desc(c)])?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&mm])?;
        op.finalize()?;
        self.inner.push(mm);
        self.ops.push(op);
        Ok(())
    }

    /// `y = reduce(x)` over the dimensions where `y` has 1, in f32.
    fn reduction(&mut self, mode: R, x: T, y: T) -> Result<()> {
        let mut red = Descriptor::new(K::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        red.set_reduction(A::CUDNN_ATTR_REDUCTION_OPERATOR, mode)?;
        red.set_data_type(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, D::CUDNN_DATA_FLOAT)?;
        red.finalize()?;
        let mut op = Descriptor::new(K::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[self.desc(x)])?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[self.desc(y)])?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&red])?;
        op.finalize()?;
        self.inner.push(red);
        self.ops.push(op);
        Ok(())
    }

    /// `y` = `x` seen with other dimensions and strides (a transpose, no data moved).
    fn reshape(&mut self, x: T, y: T) -> Result<()> {
        let mut op = Descriptor::new(K::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[self.desc(x)])?;
        op.set_descriptors(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[self.desc(y)])?;
        op.finalize()?;
        self.ops.push(op);
        Ok(())
    }

    /// The causal mask (FE's `CompositeDiagonalBandMaskNode` with right bound 0, top-left
    /// aligned): scores above the diagonal (column > row) become −∞.
    fn causal_mask(&mut self, x: T, neg_inf: T) -> Result<T> {
        let row = self.virt(x.dims, x.strides, D::CUDNN_DATA_INT32)?;
        self.pointwise(P::CUDNN_POINTWISE_GEN_INDEX, D::CUDNN_DATA_FLOAT, (x, None, None), row, Some(2))?;
        let col = self.virt(x.dims, x.strides, D::CUDNN_DATA_INT32)?;
        self.pointwise(P::CUDNN_POINTWISE_GEN_INDEX, D::CUDNN_DATA_FLOAT, (x, None, None), col, Some(3))?;
        let keep = self.virt(row.dims, row.strides, D::CUDNN_DATA_BOOLEAN)?;
        self.pointwise(P::CUDNN_POINTWISE_CMP_GE, D::CUDNN_DATA_BOOLEAN, (row, Some(col), None), keep, None)?;
        let y = self.like(x)?;
        self.pointwise(P::CUDNN_POINTWISE_BINARY_SELECT, D::CUDNN_DATA_FLOAT, (x, Some(neg_inf), Some(keep)), y, None)?;
        Ok(y)
    }

    /// The graph of `ops` on `handle`, finalized.
    fn finish(self, handle: sys::cudnnHandle_t) -> Result<OpGraph> {
        let mut graph = Descriptor::new(K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set_handle(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
        graph.set_descriptors(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &self.ops.iter().collect::<Vec<_>>())?;
        graph.finalize()?;
        let parts = self.ops.into_iter().chain(self.inner).chain(self.tensors).collect();
        Ok(OpGraph { graph, _parts: parts })
    }
}

/// The shapes of one call.
struct Shapes {
    /// `[b, h, s, d]`.
    bhsd: [i64; 4],
    /// `[b, h, d, s]`: Kᵀ and Vᵀ.
    bhds: [i64; 4],
    /// The scores `[b, h, s, s]` and their dense strides.
    scores: ([i64; 4], [i64; 4]),
    /// Transposed scores: dims `[b, h, s_kv, s_q]` over the same dense memory.
    scores_t: [i64; 4],
    /// Per-row terms `[b, h, s, 1]` and their dense strides.
    row: ([i64; 4], [i64; 4]),
}

impl Shapes {
    fn of(spec: &SdpaSpec) -> Shapes {
        let [b, h, s, d] = [spec.batch, spec.heads, spec.seq, spec.hd].map(|x| x as i64);
        Shapes {
            bhsd: [b, h, s, d],
            bhds: [b, h, d, s],
            scores: ([b, h, s, s], [h * s * s, s * s, s, 1]),
            scores_t: [h * s * s, s * s, 1, s],
            row: ([b, h, s, 1], [h * s, s, 1, 1]),
        }
    }
}

/// The operation graph of `variant` for `spec`, finalized on `handle`.
pub(super) fn build(handle: sys::cudnnHandle_t, spec: &SdpaSpec, variant: Variant) -> Result<OpGraph> {
    let mut g = Builder::new();
    match variant {
        Variant::Forward => forward(&mut g, spec)?,
        Variant::BackwardDirect => backward(&mut g, spec, false)?,
        Variant::BackwardAccumulated => backward(&mut g, spec, true)?,
    }
    g.finish(handle)
}

/// `S = Q·Kᵀ·scale`, masked: the scores both passes start from.
fn masked_scores(g: &mut Builder, sh: &Shapes, q: T, kt: T, scale: T, neg_inf: T) -> Result<T> {
    let s = g.virt(sh.scores.0, sh.scores.1, D::CUDNN_DATA_FLOAT)?;
    g.matmul(q, kt, s)?;
    let scaled = g.like(s)?;
    g.binary(P::CUDNN_POINTWISE_MUL, s, scale, scaled)?;
    g.causal_mask(scaled, neg_inf)
}

/// FE's composite forward: scores, mask, softmax with `Stats = max + log Σ exp`, `O = P·V`.
fn forward(g: &mut Builder, spec: &SdpaSpec) -> Result<()> {
    let sh = Shapes::of(spec);
    let bf16 = D::CUDNN_DATA_BFLOAT16;
    let q = g.io(uid::Q, sh.bhsd, rows(spec.inputs), bf16)?;
    let kt = g.io(uid::K, sh.bhds, transposed(spec.inputs), bf16)?;
    let v = g.io(uid::V, sh.bhsd, rows(spec.inputs), bf16)?;
    let o = g.io(uid::O, sh.bhsd, rows(spec.outs), bf16)?;
    let stats = g.io(uid::STATS, sh.row.0, sh.row.1, D::CUDNN_DATA_FLOAT)?;
    let (scale, neg_inf) = (g.scalar(uid::SCALE)?, g.scalar(uid::NEG_INF)?);
    let s = masked_scores(g, &sh, q, kt, scale, neg_inf)?;
    // FE's CompositeSoftmaxNode.
    let max = g.virt(sh.row.0, sh.row.1, D::CUDNN_DATA_FLOAT)?;
    g.reduction(R::CUDNN_REDUCE_TENSOR_MAX, s, max)?;
    let centred = g.like(s)?;
    g.binary(P::CUDNN_POINTWISE_SUB, s, max, centred)?;
    let exp = g.like(s)?;
    g.unary(P::CUDNN_POINTWISE_EXP, centred, exp)?;
    let sum = g.virt(sh.row.0, sh.row.1, D::CUDNN_DATA_FLOAT)?;
    g.reduction(R::CUDNN_REDUCE_TENSOR_ADD, exp, sum)?;
    let log = g.virt(sh.row.0, sh.row.1, D::CUDNN_DATA_FLOAT)?;
    g.unary(P::CUDNN_POINTWISE_LOG, sum, log)?;
    g.binary(P::CUDNN_POINTWISE_ADD, max, log, stats)?;
    // The probabilities in the io type, as the second matmul takes them.
    let p = g.virt(sh.scores.0, sh.scores.1, bf16)?;
    g.binary(P::CUDNN_POINTWISE_DIV, exp, sum, p)?;
    g.matmul(p, v, o)
}

/// FE's composite backward (no dropout, no bias, MHA), with dQ written directly or through the
/// fp32 accumulator.
fn backward(g: &mut Builder, spec: &SdpaSpec, accumulate: bool) -> Result<()> {
    let sh = Shapes::of(spec);
    let (bf16, f32) = (D::CUDNN_DATA_BFLOAT16, D::CUDNN_DATA_FLOAT);
    let q = g.io(uid::Q, sh.bhsd, rows(spec.inputs), bf16)?;
    let kt = g.io(uid::K, sh.bhds, transposed(spec.inputs), bf16)?;
    let vt = g.io(uid::V, sh.bhds, transposed(spec.inputs), bf16)?;
    let o = g.io(uid::O, sh.bhsd, rows(spec.outs), bf16)?;
    let d_o = g.io(uid::DO, sh.bhsd, rows(spec.outs), bf16)?;
    let stats = g.io(uid::STATS, sh.row.0, sh.row.1, f32)?;
    let dq = g.io(uid::DQ, sh.bhsd, rows(spec.grads), bf16)?;
    let dk = g.io(uid::DK, sh.bhsd, rows(spec.grads), bf16)?;
    let dv = g.io(uid::DV, sh.bhsd, rows(spec.grads), bf16)?;
    let softmax_sum = g.io(uid::SOFTMAX_SUM, sh.row.0, sh.row.1, f32)?;
    let (scale, neg_inf, one) = (g.scalar(uid::SCALE)?, g.scalar(uid::NEG_INF)?, g.scalar(uid::ONE)?);
    let [b, h, s, d] = sh.bhsd;

    // softmax_sum = Σ_d dO ∘ O (times the dropout scale's inverse, here 1).
    let prod = g.virt(sh.bhsd, [h * s * d, s * d, h * d, 1], f32)?;
    g.binary(P::CUDNN_POINTWISE_MUL, d_o, o, prod)?;
    let reduced = g.virt(sh.row.0, sh.row.1, f32)?;
    g.reduction(R::CUDNN_REDUCE_TENSOR_ADD, prod, reduced)?;
    g.binary(P::CUDNN_POINTWISE_MUL, reduced, one, softmax_sum)?;

    // P = exp(S − Stats); dV = Pᵀ·dO.
    let masked = masked_scores(g, &sh, q, kt, scale, neg_inf)?;
    let centred = g.like(masked)?;
    g.binary(P::CUDNN_POINTWISE_SUB, masked, stats, centred)?;
    let p = g.like(masked)?;
    g.unary(P::CUDNN_POINTWISE_EXP, centred, p)?;
    let p_t = g.virt([b, h, s, s], sh.scores_t, bf16)?;
    g.reshape(p, p_t)?;
    g.matmul(p_t, d_o, dv)?;

    // dS = (dO·Vᵀ − softmax_sum) ∘ P · scale; dK = dSᵀ·Q.
    let dp = g.virt(sh.scores.0, sh.scores.1, f32)?;
    g.matmul(d_o, vt, dp)?;
    let dp_centred = g.like(dp)?;
    g.binary(P::CUDNN_POINTWISE_SUB, dp, softmax_sum, dp_centred)?;
    let dp_p = g.like(dp)?;
    g.binary(P::CUDNN_POINTWISE_MUL, dp_centred, p, dp_p)?;
    let ds = g.like(dp)?;
    g.binary(P::CUDNN_POINTWISE_MUL, dp_p, scale, ds)?;
    let ds_t = g.virt([b, h, s, s], sh.scores_t, bf16)?;
    g.reshape(ds, ds_t)?;
    g.matmul(ds_t, q, dk)?;

    // dQ = dS·K, K seen back through Kᵀ (FE's `reshape_k`, a virtual of the intermediate type).
    let k = g.virt(sh.bhsd, rows(spec.inputs), f32)?;
    g.reshape(kt, k)?;
    if accumulate {
        let acc = g.io(uid::DQ_ACCUMULATOR, sh.bhsd, [h * s * d, s * d, d, 1], f32)?;
        g.matmul(ds, k, acc)?;
        g.unary(P::CUDNN_POINTWISE_IDENTITY, acc, dq)
    } else {
        g.matmul(ds, k, dq)
    }
}
