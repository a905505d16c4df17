//! The cuDNN path of fused attention: whether a call runs on cuDNN ([`choose`]), and the call
//! itself, with the plan's scratch from the caller's allocator. cuDNN reads and writes the
//! layer's layouts in place (Note [Attention operand layouts]): its `Stats` is our `lse`, its
//! `softmax_sum` our `delta`.

use half::bf16;

use super::{AttentionBackend, AttentionDropout, AttentionRun, ForwardSaved, Heads, Rows};
use crate::device::sdpa::{Sdpa, SdpaGrads, SdpaPass, SdpaPlan, SdpaScratch, SdpaSpec};
use crate::device::{DType, Stream};
use crate::memory::arena::block_size;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The head widths cuDNN's fused attention runs here.
pub const CUDNN_HEAD_DIMS: [usize; 2] = [64, 128];
/// cuDNN runs sequence lengths that are multiples of this: below 9.15.1 its backward could
/// fault in graph replay otherwise (notes/attention.md §2.9).
pub const CUDNN_SEQ_MULTIPLE: usize = 128;

/// The default for [`AttentionRun::scratch_limit`](super::AttentionRun): cuDNN's deterministic
/// backward (the only one whose results are the same bits run to run) keeps a bf16 `T × T`
/// scratch per (batch element, head) pair, `T / (8·hd)` times the pair's eight operands and
/// gradients (q, k, v, out, dout, dq, dk, dv). In one execution at L's 2048 tokens of 64 features
/// that is 1 GiB per two sequences, which set the run's peak and cost a third of the batch that
/// fits (`bench/results/2026-12-03-h200-memory-0b6ab2a.txt`). The default keeps it to the size of
/// the call's operands, or [`MIN_SCRATCH_LIMIT`] where that is more, so a call whose scratch is
/// larger runs in chunks of pairs; `pairs` of `seq` tokens of `hd` features, bf16. Each chunk
/// costs a fixed time, so the limit is as large as leaves the peak alone: at L, half the operands
/// (eight chunks) and the operands (four) left the step's peak reserved memory where the
/// kernels' backward has it, twice them (two) raised it by 512 MiB
/// (`bench/results/2026-12-05-h100-attention-chunks-ad8e278.txt`). It stops growing at
/// [`MAX_SCRATCH_LIMIT`]. Where the run's allocator already holds more free below its peak
/// ([`CachingAllocator::headroom`](crate::memory::CachingAllocator::headroom)), the default
/// takes that room instead, as the chunks change no bit.
pub fn default_scratch_limit(pairs: usize, seq: usize, hd: usize) -> usize {
    let operands = 8 * pairs * seq * hd * DType::BF16.size();
    operands.clamp(MIN_SCRATCH_LIMIT, MAX_SCRATCH_LIMIT)
}

/// The least [`default_scratch_limit`]: a short call's scratch, below this, is never chunked.
pub const MIN_SCRATCH_LIMIT: usize = 64 << 20;

/// The most [`default_scratch_limit`]. A larger scratch block does not fit where the layer's
/// backward has freed memory, and the reservation grows by about its size: at L's width and
/// 2048 tokens near 24 GiB, graphed's batches whose scratch was 1.5 or 2 GiB (18, 20) reserved
/// 1.8 and 1.9 GiB beyond their allocated peak, its prime batches (0.5 GiB of scratch) 0.4, and
/// batch 20 under this limit 0.1 (`bench/results/2026-12-06-h100-memory-parts-08574da.txt`,
/// `…-h200-memory-scratch-289ed41.txt`). The price is executions (about 74 µs each): a batch of
/// 18 runs nine a layer instead of six.
pub const MAX_SCRATCH_LIMIT: usize = 1 << 30;

/// The bytes of `T × T` scratch cuDNN's deterministic backward keeps per pair.
fn scratch_per_pair(seq: usize) -> usize {
    seq * seq * DType::BF16.size()
}

/// The pairs of one cuDNN execution: `batch` whole batch elements when `heads` is every head of
/// the call, else a range of `heads` heads of one batch element. Both divide the call's, so every
/// execution has one shape and one plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Chunk {
    batch: usize,
    heads: usize,
}

impl Chunk {
    /// The whole call in one execution.
    fn whole(h: &Heads) -> Chunk {
        Chunk { batch: h.pairs / h.heads, heads: h.heads }
    }

    /// The largest chunk of `h`'s pairs whose scratch fits `limit` bytes, or `None` where one
    /// pair's does not.
    fn within(h: &Heads, limit: usize) -> Option<Chunk> {
        let fit = limit / scratch_per_pair(h.seq);
        let largest_divisor = |n: usize, most: usize| (1..=most.min(n)).rev().find(|d| n.is_multiple_of(*d));
        let batch = h.pairs / h.heads;
        if fit >= h.heads {
            largest_divisor(batch, fit / h.heads).map(|batch| Chunk { batch, heads: h.heads })
        } else {
            largest_divisor(h.heads, fit).map(|heads| Chunk { batch: 1, heads })
        }
    }

    /// The pairs of one execution.
    fn pairs(self) -> usize {
        self.batch * self.heads
    }

    /// The first (batch element, head) of every execution, in order.
    fn starts(self, h: &Heads) -> impl Iterator<Item = (usize, usize)> {
        let (batch, heads, step) = (h.pairs / h.heads, h.heads, self.heads);
        (0..batch).step_by(self.batch).flat_map(move |b| (0..heads).step_by(step).map(move |head| (b, head)))
    }

    /// The part of `t` that the execution at `(b, head)` reads or writes: `t` is one of the
    /// call's operands (`tail` = `[T, hd]`) or per-row terms (`tail` = `[T]`), as `(B, H, ..)`
    /// views when `four_d`, else contiguous over `h.pairs` leading pairs.
    fn part(
        self,
        t: &Tensor,
        h: &Heads,
        (four_d, tail): (bool, &[usize]),
        (b, head): (usize, usize),
    ) -> Result<Tensor> {
        if four_d {
            t.narrow(0, b, self.batch)?.narrow(1, head, self.heads)
        } else {
            t.reshape(&[&[h.pairs][..], tail].concat())?.narrow(0, b, self.batch)
        }
    }
}

/// How a call runs.
pub(super) enum Choice {
    Kernels,
    /// cuDNN, in executions of `chunk`'s pairs (all of them but in the deterministic backward)
    /// planned as `spec`.
    Cudnn {
        spec: SdpaSpec,
        workspace: usize,
        dq_accumulator: bool,
        chunk: Chunk,
    },
}

impl Choice {
    /// The bytes a cuDNN call takes from the run's allocator, in the blocks it hands out: the
    /// plan's workspace, and the dQ accumulator of one execution's pairs if the plan has one.
    fn scratch_bytes(&self, h: &Heads) -> usize {
        match *self {
            Choice::Kernels => 0,
            Choice::Cudnn { workspace, dq_accumulator, chunk, .. } => {
                let accumulator = match dq_accumulator {
                    true => block_size(chunk.pairs() * h.seq * h.hd * DType::F32.size()),
                    false => 0,
                };
                block_size(workspace) + accumulator
            }
        }
    }
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

/// Whether the call of `pass` runs on cuDNN or on graphed's kernels, as `run`'s backend says;
/// for cuDNN, its plan (made now if this layout has none yet) and, for the deterministic
/// backward, the chunks of pairs whose `T × T` scratch fits `run`'s limit (under the default
/// limit, or the room its allocator holds where that is more: [`roomier_chunk`]). Where not even
/// one pair's fits the limit, [`AttentionBackend::Auto`] runs the kernels and [`AttentionBackend::Cudnn`] one
/// pair per execution.
///
/// # Errors
/// [`Error::CudnnUnavailable`] for [`AttentionBackend::Cudnn`] and
/// [`AttentionBackend::CudnnNondeterministic`] where cuDNN cannot run the call.
pub(super) fn choose(
    op: &'static str,
    run: AttentionRun<'_>,
    (pass, dtype, h): (SdpaPass, DType, &Heads),
    [inputs, grads, outs]: [Rows; 3],
    dropout: Option<&AttentionDropout<'_>>,
    stream: &Stream,
) -> Result<Choice> {
    let backend = run.backend;
    let refuse = |why: String| match backend.requires_cudnn() {
        true => Err(Error::CudnnUnavailable { op, why }),
        false => Ok(Choice::Kernels),
    };
    if backend == AttentionBackend::Kernels {
        return Ok(Choice::Kernels);
    }
    if let Some(why) = cudnn_refusal(dtype, h.hd, h.seq, dropout.map_or(0.0, |d| d.p)) {
        return refuse(why.into());
    }
    // Only the deterministic backward keeps the `T × T` scratch; the nondeterministic one
    // accumulates dQ in f32 instead.
    let limited = pass == SdpaPass::Backward && backend != AttentionBackend::CudnnNondeterministic;
    let chunk = match limited.then(|| Chunk::within(h, run.scratch_limit_for(h.pairs, h.seq, h.hd))) {
        None => Chunk::whole(h),
        Some(Some(chunk)) => chunk,
        Some(None) if backend == AttentionBackend::Auto => return Ok(Choice::Kernels),
        Some(None) => Chunk { batch: 1, heads: 1 },
    };
    let plan = |chunk: Chunk| {
        let spec = SdpaSpec {
            pass,
            dtype,
            batch: chunk.batch,
            heads: chunk.heads,
            seq: h.seq,
            hd: h.hd,
            inputs: strides(h, inputs),
            outs: strides(h, outs),
            grads: strides(h, grads),
            deterministic: backend != AttentionBackend::CudnnNondeterministic,
        };
        Ok(match stream.sdpa_plan(&spec)? {
            SdpaPlan::Ready { workspace, dq_accumulator } => {
                Ok(Choice::Cudnn { spec, workspace, dq_accumulator, chunk })
            }
            SdpaPlan::Unavailable(why) => Err(why),
        })
    };
    if limited && run.scratch_limit.is_none() {
        if let Some((roomy, room)) = roomier_chunk(h, chunk, run, stream)? {
            if let Ok(choice) = plan(roomy)? {
                if choice.scratch_bytes(h) <= room {
                    return Ok(choice);
                }
            }
        }
    }
    plan(chunk)?.or_else(refuse)
}

/// Under the default limit, a chunk of more pairs than `chunk` whose scratch the run's
/// allocator already holds free below its peak ([`CachingAllocator::headroom`]), with that room
/// in bytes (planning takes nothing from the allocator, so it still holds after): fewer
/// executions at no memory cost. In an eager step the layers above have freed their
/// activations by a lower layer's backward, which then has room for more pairs; in a pool the
/// freed blocks are smaller (docs/attention-kernels.md). The bits do not depend on the chunks,
/// so a graphed step still equals an eager one whose allocator had another amount free.
///
/// [`CachingAllocator::headroom`]: crate::memory::CachingAllocator::headroom
fn roomier_chunk(h: &Heads, chunk: Chunk, run: AttentionRun<'_>, stream: &Stream) -> Result<Option<(Chunk, usize)>> {
    if chunk == Chunk::whole(h) {
        return Ok(None);
    }
    let room = run.scratch.headroom(stream)?;
    let roomy = Chunk::within(h, room).filter(|roomy| roomy.pairs() > chunk.pairs());
    tracing::debug!(
        "graphed: cuDNN attention backward: {} MiB free below the peak, {chunk:?} by default, {roomy:?} in that room",
        room >> 20
    );
    Ok(roomy.map(|c| (c, room)))
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

/// The backward on cuDNN, as `choose` planned it for heads `h`: one execution per chunk of
/// pairs, in order on `stream`, sharing one workspace (and dQ accumulator). Every chunk's call is
/// made and checked before the first is enqueued.
pub(super) fn backward(
    (dq, dk, dv): (&Tensor, &Tensor, &Tensor),
    dout: &Tensor,
    saved: ForwardSaved<'_>,
    delta: &Tensor,
    (spec, bytes, dq_accumulator, chunk): (SdpaSpec, usize, bool, Chunk),
    (h, run): (&Heads, AttentionRun<'_>),
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "attention_backward";
    let ForwardSaved { q, k, v, out, lse } = saved;
    let four_d = q.shape().len() == 4;
    let (heads_tail, rows_tail) = ([h.seq, h.hd], [h.seq]);
    let parts = chunk
        .starts(h)
        .map(|at| {
            let part = |t: &Tensor| chunk.part(t, h, (four_d, &heads_tail), at);
            let row_part = |t: &Tensor| chunk.part(t, h, (four_d, &rows_tail), at);
            Ok([
                part(q)?,
                part(k)?,
                part(v)?,
                part(out)?,
                part(dout)?,
                part(dq)?,
                part(dk)?,
                part(dv)?,
                row_part(lse)?,
                row_part(delta)?,
            ])
        })
        .collect::<Result<Vec<_>>>()?;
    let calls = parts
        .iter()
        .map(|[q, k, v, out, dout, dq, dk, dv, lse, delta]| {
            let (lse, delta) = (super::rows_view(OP, "lse", lse, q)?, super::rows_view(OP, "delta", delta, q)?);
            let grads = SdpaGrads { dout: dout.view()?, grads: [dq.view()?, dk.view()?, dv.view()?], delta };
            let call = Sdpa { inputs: [q.view()?, k.view()?, v.view()?], out: out.view()?, lse, backward: Some(grads) };
            // Without an accumulator the call names an empty view of its row terms instead.
            Ok((call, delta.nothing()))
        })
        .collect::<Result<Vec<_>>>()?;
    let ws = workspace(run, bytes, stream)?;
    let accumulator = match (dq_accumulator, parts.first()) {
        (true, Some([q, ..])) => Some(Tensor::uninit(run.scratch, stream, q.shape(), DType::F32)?),
        _ => None,
    };
    let (workspace, accumulator) = (ws.view()?, accumulator.as_ref().map(Tensor::view).transpose()?);
    for (call, no_accumulator) in &calls {
        let dq_accumulator = accumulator.unwrap_or(*no_accumulator);
        stream.sdpa(call, spec, &SdpaScratch { workspace, dq_accumulator }, 1.0 / (spec.hd as f32).sqrt())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heads(batch: usize, heads: usize, seq: usize) -> Heads {
        Heads { pairs: batch * heads, heads, seq, hd: 64 }
    }

    /// Every pair in exactly one execution, in order.
    fn covered(h: &Heads, c: Chunk) -> bool {
        let mut pairs: Vec<usize> = c
            .starts(h)
            .flat_map(|(b, head)| {
                (b..b + c.batch).flat_map(move |b| (head..head + c.heads).map(move |x| b * h.heads + x))
            })
            .collect();
        let n = pairs.len();
        pairs.dedup();
        n == h.pairs && pairs == (0..h.pairs).collect::<Vec<_>>()
    }

    #[test]
    fn the_default_limit_chunks_what_outgrows_the_operands_or_a_gibibyte() {
        // M's attention (4 × 16 pairs of 512 tokens): 32 MiB of scratch, one execution.
        let m = heads(4, 16, 512);
        let limit = default_scratch_limit(m.pairs, m.seq, m.hd);
        assert_eq!(Chunk::within(&m, limit), Some(Chunk::whole(&m)));
        // L's (2 × 64 pairs of 2048 tokens, 8 MiB each): within the 256 MiB of operands, 32
        // heads of one sequence per execution.
        let l = heads(2, 64, 2048);
        let limit = default_scratch_limit(l.pairs, l.seq, l.hd);
        assert_eq!(limit, 256 << 20);
        assert_eq!(Chunk::within(&l, limit), Some(Chunk { batch: 1, heads: 32 }));
        // A batch of 18 at L's shape: 2.25 GiB of operands, but executions of at most 1 GiB,
        // two whole sequences each.
        let large = heads(18, 64, 2048);
        let limit = default_scratch_limit(large.pairs, large.seq, large.hd);
        assert_eq!(limit, MAX_SCRATCH_LIMIT);
        assert_eq!(Chunk::within(&large, limit), Some(Chunk { batch: 2, heads: 64 }));
        // One pair of 8192 tokens keeps 128 MiB: more than the limit, so no chunk fits.
        let long = heads(1, 1, 8192);
        assert_eq!(Chunk::within(&long, default_scratch_limit(1, 8192, 64)), None);
    }

    #[test]
    fn chunks_cover_every_pair_once_within_the_limit() {
        for (batch, h, seq) in [(2, 64, 2048), (3, 12, 1024), (5, 1, 512), (1, 6, 256), (4, 7, 128)] {
            let hs = heads(batch, h, seq);
            for limit in [1, 100_000, 1 << 20, 3 << 20, 64 << 20, 1 << 30] {
                match Chunk::within(&hs, limit) {
                    Some(c) => {
                        assert!(c.batch * c.heads * scratch_per_pair(seq) <= limit, "{hs:?} {limit}: {c:?}");
                        assert!(c.heads == h || c.batch == 1, "{hs:?}: {c:?} is not a rectangle");
                        assert!(covered(&hs, c), "{hs:?} {limit}: {c:?}");
                    }
                    None => assert!(scratch_per_pair(seq) > limit),
                }
            }
        }
    }
}
