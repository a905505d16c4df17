//! The cuDNN path of fused attention: whether a call runs on cuDNN ([`choose`]), and the call
//! itself, with the plan's scratch from the caller's allocator. cuDNN reads and writes the
//! layer's layouts in place (Note [Attention operand layouts]): its `Stats` is our `lse`, its
//! `softmax_sum` our `delta`.

use half::bf16;

use super::{AttentionBackend, AttentionDropout, AttentionRun, ForwardSaved, Heads, Rows};
use crate::device::sdpa::{Sdpa, SdpaGrads, SdpaPass, SdpaPlan, SdpaScratch, SdpaSpec};
use crate::device::{DType, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The head widths cuDNN's fused attention runs here.
pub const CUDNN_HEAD_DIMS: [usize; 2] = [64, 128];
/// cuDNN runs sequence lengths that are multiples of this: below 9.15.1 its backward could
/// fault in graph replay otherwise (notes/attention.md §2.9).
pub const CUDNN_SEQ_MULTIPLE: usize = 128;

/// [`AttentionBackend::Auto`] runs cuDNN's backward for sequences up to this many times the head
/// width, and graphed's backward kernels beyond. cuDNN's deterministic backward (the only one
/// whose results are the same bits run to run) keeps a `T × T` bf16 scratch per (batch element,
/// head), `T / (8·hd)` times the call's eight operands and gradients (q, k, v, out, dout, dq, dk,
/// dv): up to `T = 8·hd` it is no larger than they are; at L's 2048 tokens of 64 features it is
/// 1 GiB per two sequences, which set the run's peak and cost a third of the batch that fits
/// (`bench/results/2026-12-03-h200-memory-0b6ab2a.txt`).
pub const AUTO_BACKWARD_SEQ_PER_HEAD_DIM: usize = 8;

/// Whether [`AttentionBackend::Auto`] leaves the backward of `seq` tokens over heads of `hd`
/// features to graphed's kernels, for cuDNN's scratch (see [`AUTO_BACKWARD_SEQ_PER_HEAD_DIM`]).
fn auto_keeps_backward(seq: usize, hd: usize) -> bool {
    seq > AUTO_BACKWARD_SEQ_PER_HEAD_DIM * hd
}

/// How a call runs.
pub(super) enum Choice {
    Kernels,
    Cudnn { spec: SdpaSpec, workspace: usize, dq_accumulator: bool },
}

/// Why cuDNN's backend does not run attention of element type `dtype` over heads of `hd`
/// features and sequences of `seq`, with drop probability `dropout_p`, if it does not (on a GPU
/// with cuDNN; the rule [`AttentionBackend::Cudnn`] refuses by, for a caller to refuse early).
pub fn cudnn_refusal(dtype: DType, hd: usize, seq: usize, dropout_p: f32) -> Option<&'static str> {
    if dtype != DType::BF16 {
        Some("cuDNN's fused attention runs bf16; f32 runs on graphed's kernels")
    } else if !CUDNN_HEAD_DIMS.contains(&hd) {
        Some("cuDNN's fused attention runs head widths 64 and 128 here")
    } else if !seq.is_multiple_of(CUDNN_SEQ_MULTIPLE) {
        Some("cuDNN's fused attention runs sequence lengths that are multiples of 128 here")
    } else if dropout_p != 0.0 {
        Some("cuDNN's dropout masks are not graphed's counter-based ones; attention dropout runs on graphed's kernels")
    } else {
        None
    }
}

/// cuDNN's strides of one group: a head stride for every layout (contiguous heads have one head
/// per batch element, whose stride cuDNN never steps).
fn strides(h: &Heads, r: Rows) -> [usize; 3] {
    let head = if h.heads == 1 { r.batch } else { r.head };
    [r.batch as usize, head as usize, r.row as usize]
}

/// Whether the call of `pass` runs on cuDNN or on graphed's kernels, as `backend` says; for
/// cuDNN, its plan (made now if this layout has none yet).
///
/// # Errors
/// [`Error::CudnnUnavailable`] for [`AttentionBackend::Cudnn`] and
/// [`AttentionBackend::CudnnNondeterministic`] where cuDNN cannot run the call.
pub(super) fn choose(
    op: &'static str,
    backend: AttentionBackend,
    (pass, dtype, h): (SdpaPass, DType, &Heads),
    [inputs, grads, outs]: [Rows; 3],
    dropout: Option<&AttentionDropout<'_>>,
    stream: &Stream,
) -> Result<Choice> {
    let refuse = |why: String| match backend.requires_cudnn() {
        true => Err(Error::CudnnUnavailable { op, why }),
        false => Ok(Choice::Kernels),
    };
    let lean = backend == AttentionBackend::Auto && pass == SdpaPass::Backward && auto_keeps_backward(h.seq, h.hd);
    if backend == AttentionBackend::Kernels || lean {
        return Ok(Choice::Kernels);
    }
    if let Some(why) = cudnn_refusal(dtype, h.hd, h.seq, dropout.map_or(0.0, |d| d.p)) {
        return refuse(why.into());
    }
    let spec = SdpaSpec {
        pass,
        dtype,
        batch: h.pairs / h.heads,
        heads: h.heads,
        seq: h.seq,
        hd: h.hd,
        inputs: strides(h, inputs),
        outs: strides(h, outs),
        grads: strides(h, grads),
        deterministic: backend != AttentionBackend::CudnnNondeterministic,
    };
    match stream.sdpa_plan(&spec)? {
        SdpaPlan::Ready { workspace, dq_accumulator } => Ok(Choice::Cudnn { spec, workspace, dq_accumulator }),
        SdpaPlan::Unavailable(why) => refuse(why),
    }
}

/// The plan's workspace, from the run's allocator (at least one byte: cuDNN gets an address).
fn workspace(run: AttentionRun<'_>, bytes: usize, stream: &Stream) -> Result<Tensor> {
    Tensor::uninit(run.scratch, stream, &[bytes.max(1)], DType::U8)
}

/// The forward on cuDNN, as `choose` planned it.
pub(super) fn forward(
    out: &Tensor,
    lse: &Tensor,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (spec, bytes): (SdpaSpec, usize),
    run: AttentionRun<'_>,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "attention_forward";
    let lse = super::rows_view(OP, "lse", lse, q)?;
    let ws = workspace(run, bytes, stream)?;
    let call = Sdpa { inputs: [q.view()?, k.view()?, v.view()?], out: out.view::<bf16>()?, lse, backward: None };
    let scratch = SdpaScratch { workspace: ws.view()?, dq_accumulator: lse.nothing() };
    stream.sdpa(&call, spec, &scratch, 1.0 / (spec.hd as f32).sqrt())
}

/// The backward on cuDNN, as `choose` planned it.
pub(super) fn backward(
    (dq, dk, dv): (&Tensor, &Tensor, &Tensor),
    dout: &Tensor,
    saved: ForwardSaved<'_>,
    delta: &Tensor,
    (spec, bytes, dq_accumulator): (SdpaSpec, usize, bool),
    run: AttentionRun<'_>,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "attention_backward";
    let ForwardSaved { q, k, v, out, lse } = saved;
    let (lse, delta) = (super::rows_view(OP, "lse", lse, q)?, super::rows_view(OP, "delta", delta, q)?);
    let ws = workspace(run, bytes, stream)?;
    let accumulator =
        if dq_accumulator { Some(Tensor::uninit(run.scratch, stream, q.shape(), DType::F32)?) } else { None };
    let call = Sdpa {
        inputs: [q.view()?, k.view()?, v.view()?],
        out: out.view()?,
        lse,
        backward: Some(SdpaGrads { dout: dout.view()?, grads: [dq.view()?, dk.view()?, dv.view()?], delta }),
    };
    let dq_accumulator = match &accumulator {
        Some(a) => a.view()?,
        None => delta.nothing(),
    };
    let scratch = SdpaScratch { workspace: ws.view()?, dq_accumulator };
    stream.sdpa(&call, spec, &scratch, 1.0 / (spec.hd as f32).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_keeps_the_backward_where_cudnns_scratch_outgrows_the_operands() {
        // M's attention (512 tokens, heads of 64): cuDNN's scratch is the operands' size.
        assert!(!auto_keeps_backward(512, 64));
        assert!(!auto_keeps_backward(1024, 128));
        // L's (2048 tokens): four times them.
        assert!(auto_keeps_backward(2048, 64));
        assert!(auto_keeps_backward(640, 64));
    }
}
