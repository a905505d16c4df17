//! Fused causal attention (FlashAttention-2's algorithm, Dao 2023): `out = softmax(q·kᵀ·scale +
//! causal mask)·v` without ever storing the `T × T` scores. The forward keeps, per query row, the
//! log-sum-exp of its scaled scores (f32), which is all the backward needs to recompute the
//! probabilities tile by tile. The scale is 1/√head_dim, as PyTorch's
//! `scaled_dot_product_attention` uses by default.
//!
//! Tensors are the heads of one layer, f32 or bf16, `hd` one of [`HEAD_DIMS`]: either contiguous
//! `(.., T, hd)` with every leading dimension a (batch element, head) pair, or `(B, H, T, hd)` views
//! whose rows are `hd` contiguous elements at any batch, head and row strides, so that a layer
//! reads and writes its heads where its GEMMs keep them, as column slices of `(B·T, n)` matrices
//! (Note [Attention operand layouts]); the log-sum-exp and the backward's row terms are f32
//! `(.., T)`, contiguous. Any `T ≥ 1`. One kernel per pass, element type and
//! head width (`attention.cu`), each with its CPU path here (`cpu.rs`), which computes the same
//! math in f32 and rounds once per stored value, in a different summation order than the GPU's
//! tiles: the two devices agree within rounding, not bitwise. Each device is bitwise
//! reproducible run to run: every output element is written once, after a fixed-order sum, with
//! no atomics, which is why the backward has two kernels (one per key tile for `dk` and `dv`, one
//! per query tile for `dq`).
//!
//! Dropout on the probabilities runs inside the kernels, drawn from the same counter-based
//! numbers as [`dropout`] (Note [Graph-safe RNG] in `rng.rs`): element `(pair, i,
//! j)` is the element `(pair·T + i)·T + j` of a `(pairs, T, T)` probability tensor, so the fused
//! and unfused paths drop the same elements, and a graph replay draws fresh ones at each step.
//!
//! # Note [Attention operand layouts]
//!
//! The kernels take three layouts per call, one per group of operands that the layer keeps
//! alike: the inputs `q`, `k` and `v`; the gradients `dq`, `dk` and `dv`; the output `out` and its
//! gradient `dout`. Each is a batch, head and row stride, in elements (`AttnRows` in
//! attention.cu). So the layer's output projection reads the forward's output straight from the
//! `(B·T, C)` rows the kernel wrote, the backward reads that output and its gradient from the
//! same kind of rows, and writes `dq`, `dk` and `dv` into the column slices of one `(B·T, 3C)`
//! gradient that the QKV projection's backward reads: four copies per layer (heads to rows and
//! back) are gone. The CPU paths see dense heads either way: the simulator gathers a strided
//! view's elements in order. bf16 views need 16-byte aligned rows (`cp.async`): strides and
//! offsets that are multiples of 8 elements.
//!
//! ```
//! use graphed::device::{DType, Device};
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::attention;
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let shape = [1, 2, 3, 32]; // batch 1, 2 heads, 3 tokens, head width 32
//! let q = Tensor::from_host(&alloc, &s, &vec![0.1f32; 192], &shape)?;
//! let (out, lse) = (Tensor::uninit(&alloc, &s, &shape, DType::F32)?, Tensor::uninit(&alloc, &s, &[1, 2, 3], DType::F32)?);
//! let run = attention::AttentionRun::new(attention::AttentionBackend::Auto, &alloc);
//! attention::attention_forward(&out, &lse, (&q, &q, &q), None, run, &s)?;
//! // Equal scores: token i averages the i + 1 values it sees, here all 0.1.
//! assert!(out.to_vec::<f32>(&s)?.iter().all(|&o| (o - 0.1).abs() < 1e-6));
//! assert!((lse.to_vec::<f32>(&s)?[2] - (0.32f32 / 32f32.sqrt() + 3f32.ln())).abs() < 1e-5);
//! # Ok::<(), graphed::Error>(())
//! ```

mod backend;
mod cpu;
mod cudnn;
mod tiles;

use half::bf16;

use super::{checked, count, dropout, float_dtype, rng, with_float};
use crate::device::sdpa::SdpaPass;
use crate::device::{args, Arg, DType, Elem, In, Kernel, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};
pub use backend::{AttentionBackend, AttentionRun};
use cudnn::Choice;
pub use cudnn::{
    cudnn_refusal, default_scratch_limit, CUDNN_HEAD_DIMS, CUDNN_SEQ_MULTIPLE, MAX_SCRATCH_LIMIT, MIN_SCRATCH_LIMIT,
};
use tiles::{launch_dims, Pass};

const SOURCE: &str = concat!(include_str!("../float.cu"), include_str!("../rng.cu"), include_str!("../attention.cu"));

/// The head widths the kernels are built for.
pub const HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// A kernel's parameters: its own, then the call's shape and operand layout (`AttnLayout` in
/// attention.cu; [`Layout`]).
macro_rules! with_layout {
    ($($p:literal),*) => {
        &[$($p,)* "seq", "pairs", "heads", "in_batch", "in_head", "in_row", "grad_batch", "grad_head", "grad_row",
          "outs_batch", "outs_head", "outs_row"]
    };
}

const FORWARD_PARAMS: &[&str] =
    with_layout!("out", "lse", "q", "k", "v", "step", "scale", "threshold", "keep_scale", "seed", "site");
const DELTA_PARAMS: &[&str] = with_layout!("delta", "out", "dout");
const DKDV_PARAMS: &[&str] = with_layout!(
    "dk",
    "dv",
    "q",
    "k",
    "v",
    "dout",
    "lse",
    "delta",
    "step",
    "scale",
    "threshold",
    "keep_scale",
    "seed",
    "site"
);
const DQ_PARAMS: &[&str] = with_layout!(
    "dq",
    "q",
    "k",
    "v",
    "dout",
    "lse",
    "delta",
    "step",
    "scale",
    "threshold",
    "keep_scale",
    "seed",
    "site"
);

/// Declares the kernels of one pass: a static per (element type, head width) and the table that
/// [`kernel`] looks them up in.
macro_rules! pass_kernels {
    ($table:ident, $params:ident, $cpu:ident, [$($static:ident = $name:literal, $t:ty;)*]) => {
        $(
            #[doc = concat!("`", $name, "` in `attention.cu`.")]
            pub(crate) static $static: Kernel =
                Kernel { name: $name, source: SOURCE, params: $params, cpu: cpu::$cpu::<$t>, strided: true };
        )*
        /// The pass's kernels: f32 then bf16, each for every width of [`HEAD_DIMS`].
        pub(crate) static $table: [&Kernel; 6] = [$(&$static),*];
    };
}

pass_kernels!(FORWARD, FORWARD_PARAMS, forward, [
    ATTENTION_FORWARD_F32_D32 = "attention_forward_f32_d32", f32;
    ATTENTION_FORWARD_F32_D64 = "attention_forward_f32_d64", f32;
    ATTENTION_FORWARD_F32_D128 = "attention_forward_f32_d128", f32;
    ATTENTION_FORWARD_BF16_D32 = "attention_forward_bf16_d32", bf16;
    ATTENTION_FORWARD_BF16_D64 = "attention_forward_bf16_d64", bf16;
    ATTENTION_FORWARD_BF16_D128 = "attention_forward_bf16_d128", bf16;
]);
pass_kernels!(DELTA, DELTA_PARAMS, delta, [
    ATTENTION_DELTA_F32_D32 = "attention_delta_f32_d32", f32;
    ATTENTION_DELTA_F32_D64 = "attention_delta_f32_d64", f32;
    ATTENTION_DELTA_F32_D128 = "attention_delta_f32_d128", f32;
    ATTENTION_DELTA_BF16_D32 = "attention_delta_bf16_d32", bf16;
    ATTENTION_DELTA_BF16_D64 = "attention_delta_bf16_d64", bf16;
    ATTENTION_DELTA_BF16_D128 = "attention_delta_bf16_d128", bf16;
]);
pass_kernels!(BACKWARD_DKDV, DKDV_PARAMS, backward_dkdv, [
    ATTENTION_BACKWARD_DKDV_F32_D32 = "attention_backward_dkdv_f32_d32", f32;
    ATTENTION_BACKWARD_DKDV_F32_D64 = "attention_backward_dkdv_f32_d64", f32;
    ATTENTION_BACKWARD_DKDV_F32_D128 = "attention_backward_dkdv_f32_d128", f32;
    ATTENTION_BACKWARD_DKDV_BF16_D32 = "attention_backward_dkdv_bf16_d32", bf16;
    ATTENTION_BACKWARD_DKDV_BF16_D64 = "attention_backward_dkdv_bf16_d64", bf16;
    ATTENTION_BACKWARD_DKDV_BF16_D128 = "attention_backward_dkdv_bf16_d128", bf16;
]);
pass_kernels!(BACKWARD_DQ, DQ_PARAMS, backward_dq, [
    ATTENTION_BACKWARD_DQ_F32_D32 = "attention_backward_dq_f32_d32", f32;
    ATTENTION_BACKWARD_DQ_F32_D64 = "attention_backward_dq_f32_d64", f32;
    ATTENTION_BACKWARD_DQ_F32_D128 = "attention_backward_dq_f32_d128", f32;
    ATTENTION_BACKWARD_DQ_BF16_D32 = "attention_backward_dq_bf16_d32", bf16;
    ATTENTION_BACKWARD_DQ_BF16_D64 = "attention_backward_dq_bf16_d64", bf16;
    ATTENTION_BACKWARD_DQ_BF16_D128 = "attention_backward_dq_bf16_d128", bf16;
]);

/// The kernel of `pass` for `dtype` (f32 or bf16, checked by the caller) and a width of
/// [`HEAD_DIMS`].
fn kernel(pass: Pass, dtype: DType, hd: usize) -> &'static Kernel {
    let table = match pass {
        Pass::Forward => &FORWARD,
        Pass::Delta => &DELTA,
        Pass::BackwardDkDv => &BACKWARD_DKDV,
        Pass::BackwardDq => &BACKWARD_DQ,
    };
    let width = HEAD_DIMS.iter().position(|&d| d == hd).expect("the launcher checked the head width");
    table[usize::from(dtype == DType::BF16) * HEAD_DIMS.len() + width]
}

/// Dropout on the attention probabilities: drop probability `p` in `[0, 1)`, the numbers of
/// (`seed`, `site`, `*step`) (Note [Graph-safe RNG] in `rng.rs`). The backward must get the
/// forward's, with the step counter unchanged in between.
#[derive(Clone, Copy)]
pub struct AttentionDropout<'a> {
    /// Drop probability.
    pub p: f32,
    /// The model's RNG seed.
    pub seed: u32,
    /// The layer's site, distinct from every other dropout's.
    pub site: u32,
    /// The one-element `u64` step counter.
    pub step: &'a Tensor,
}

/// The shape of one call: `pairs` (batch element, head) pairs of `seq` rows of `hd` features,
/// `heads` pairs per batch element (1 for contiguous `(.., T, hd)` heads).
#[derive(Clone, Copy, Debug)]
struct Heads {
    pairs: usize,
    heads: usize,
    seq: usize,
    hd: usize,
}

/// Where one group of operands keeps its rows: element `(b, h, i, d)` of a `(B, H, T, hd)` view at
/// `b·batch + h·head + i·row + d` (`AttnRows` in attention.cu; Note [Attention operand layouts]).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Rows {
    batch: u64,
    head: u64,
    row: u64,
}

impl Heads {
    /// The heads of `q`: `(B, H, T, hd)`, or contiguous `(.., T, hd)` with at least one leading
    /// dimension.
    fn of(op: &'static str, q: &Tensor) -> Result<Heads> {
        let shape = q.shape();
        let shape_error = || Error::Shape {
            op,
            expected: "heads (.., T, hd) with T ≥ 1 and at least one leading (batch, head) dimension".into(),
            found: shape.to_vec(),
        };
        let [lead @ .., seq, hd] = shape else { return Err(shape_error()) };
        let pairs: usize = lead.iter().product();
        if lead.is_empty() || pairs == 0 || *seq == 0 {
            return Err(shape_error());
        }
        if !HEAD_DIMS.contains(hd) {
            return Err(Error::Unsupported {
                op,
                backend: "any",
                why: "fused attention supports head widths 32, 64 and 128; use the unfused attention for others",
            });
        }
        // Each kernel indexes rows and scores with 32-bit sizes.
        count(op, pairs * seq * hd)?;
        let heads = if shape.len() == 4 { shape[1] } else { 1 };
        Ok(Heads { pairs, heads, seq: *seq, hd: *hd })
    }

    /// The rows of operand `t` (named `name`), of `q`'s shape: a `(B, H, T, hd)` view's strides,
    /// or a contiguous tensor's. Refused unless its rows are `hd` contiguous elements, 16-byte
    /// aligned for bf16.
    fn rows(&self, op: &'static str, name: &str, t: &Tensor, shape: &[usize]) -> Result<Rows> {
        if t.shape() != shape {
            return Err(Error::Shape { op, expected: format!("{name} of shape {shape:?}"), found: t.shape().to_vec() });
        }
        let rows = match *t.strides() {
            [batch, head, row, 1] => Rows { batch: batch as u64, head: head as u64, row: row as u64 },
            _ if t.is_contiguous() => {
                let row = self.hd as u64;
                Rows { batch: self.seq as u64 * row, head: 0, row }
            }
            _ => return Err(Error::NotContiguous { op, buffer: t.id() }),
        };
        let lanes = (16 / t.dtype().size()) as u64;
        let aligned = [rows.batch, rows.head, rows.row, t.offset() as u64].iter().all(|s| s % lanes == 0);
        if t.dtype() == DType::BF16 && !aligned {
            return Err(Error::Unsupported {
                op,
                backend: "any",
                why: "bf16 attention operands need rows 16 bytes aligned: strides and offsets that are multiples of 8",
            });
        }
        Ok(rows)
    }

    /// The group layout of `ts` (one [`Rows`] for all of them), refused if they differ.
    fn group(&self, op: &'static str, ts: &[(&str, &Tensor)], shape: &[usize]) -> Result<Rows> {
        let (first, t) = ts[0];
        let rows = self.rows(op, first, t, shape)?;
        for &(name, t) in &ts[1..] {
            if self.rows(op, name, t, shape)? != rows {
                return Err(Error::Shape {
                    op,
                    expected: format!("{name} laid out as {first} (the same strides)"),
                    found: t.strides().to_vec(),
                });
            }
        }
        Ok(rows)
    }

    /// The kernels' shape and layout arguments (`with_layout!`'s parameters).
    fn layout_args(&self, op: &'static str, [inputs, grads, outs]: [Rows; 3]) -> Result<[Arg<'static>; 12]> {
        let (seq, pairs, heads) = (count(op, self.seq)?, count(op, self.pairs)?, count(op, self.heads)?);
        Ok([
            seq.into(),
            pairs.into(),
            heads.into(),
            inputs.batch.into(),
            inputs.head.into(),
            inputs.row.into(),
            grads.batch.into(),
            grads.head.into(),
            grads.row.into(),
            outs.batch.into(),
            outs.head.into(),
            outs.row.into(),
        ])
    }

    /// `(.., T)`: the shape of the per-row terms.
    fn rows_shape(q: &Tensor) -> Vec<usize> {
        q.shape()[..q.shape().len() - 1].to_vec()
    }

    fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }

    /// FLOPs of one `T × T × hd` matrix product over every pair, causal: 2·pairs·T²·hd/2
    /// (FlashAttention's count, the masked half not counted).
    fn causal_product_flops(&self) -> u64 {
        (self.pairs as u64) * (self.seq as u64).pow(2) * (self.hd as u64)
    }
}

/// The causal `T × T × hd` products the forward executes, and so declares to a profile
/// ([`Stream::launch_counting`]) at 2·pairs·T²·hd/2 FLOPs each: `q·kᵀ` and `p·v`.
pub const FORWARD_PRODUCTS: u64 = 2;
/// The products the dk/dv kernel executes per tile: `q·kᵀ` again, `dout·vᵀ`, `pᵀ·dout` and
/// `dsᵀ·q`.
pub const DKDV_PRODUCTS: u64 = 4;
/// The products the dq kernel executes: `q·kᵀ` again, `dout·vᵀ` again and `ds·k`.
pub const DQ_PRODUCTS: u64 = 3;

/// The kernels' dropout arguments: the step counter, `threshold` (0: no dropout), `keep_scale`,
/// `seed` and `site`. Without dropout the kernels never read the step, so an empty view of `q`
/// stands in for it and declares no access.
fn dropout_args<'t, T: Elem>(
    op: &'static str,
    dropout: Option<AttentionDropout<'t>>,
    q: &'t Tensor,
) -> Result<(Arg<'t>, u32, f32, u32, u32)> {
    match dropout {
        Some(d) if d.p != 0.0 => {
            let (threshold, keep_scale) = dropout::keep_rule(op, d.p)?;
            Ok((In(rng::step_view(op, d.step)?).into(), threshold, keep_scale, d.seed, d.site))
        }
        _ => Ok((In(q.buffer::<T>(op)?.slice(0..0)).into(), 0, 1.0, 0, 0)),
    }
}

/// The per-row log-sum-exp view of `lse`: f32 of shape `(.., T)` for heads `q`.
fn rows_view<'t>(op: &'static str, name: &str, t: &'t Tensor, q: &Tensor) -> Result<crate::device::View<'t, f32>> {
    checked::<f32>(op, name, t, &Heads::rows_shape(q))
}

/// `out = softmax(q·kᵀ/√hd + causal mask)·v`, with dropout on the probabilities if given, and
/// `lse`, each query row's log-sum-exp of its scaled visible scores (natural log), which the
/// backward needs. `q`, `k`, `v` and `out` are heads of one element type (f32 or bf16) and one
/// shape, `q`, `k` and `v` laid out alike (Note [Attention operand layouts]), `lse` is f32
/// `(.., T)` and contiguous; outputs distinct from inputs. Runs on `run`'s backend
/// ([`AttentionBackend`]), its scratch from `run`'s allocator; returns the one that ran
/// ([`AttentionBackend::Cudnn`] or [`AttentionBackend::Kernels`]).
///
/// # Errors
/// Before anything is enqueued: [`Error::UnsupportedDType`] or [`Error::DTypeMismatch`] for other
/// element types; [`Error::Shape`] for other shapes, or `k` or `v` laid out unlike `q`;
/// [`Error::Unsupported`] for a head width not in [`HEAD_DIMS`], more than 2^32 elements, a drop
/// probability outside `[0, 1)`, or misaligned bf16 rows; [`Error::NotContiguous`] for rows that
/// are not contiguous; [`Error::CudnnUnavailable`] for the cuDNN settings
/// ([`AttentionBackend::requires_cudnn`]) where cuDNN cannot run the call. [`Error::Cudnn`] when a cuDNN call fails.
pub fn attention_forward(
    out: &Tensor,
    lse: &Tensor,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    dropout: Option<AttentionDropout<'_>>,
    run: AttentionRun<'_>,
    stream: &Stream,
) -> Result<AttentionBackend> {
    const OP: &str = "attention_forward";
    let dtype = float_dtype(OP, q, &[k, v, out])?;
    let h = Heads::of(OP, q)?;
    let shape = q.shape();
    let inputs = h.group(OP, &[("q", q), ("k", k), ("v", v)], shape)?;
    let outs = h.rows(OP, "out", out, shape)?;
    let layout = h.layout_args(OP, [inputs, inputs, outs])?;
    let groups = [inputs, outs, outs];
    let choice = cudnn::choose(OP, run, (SdpaPass::Forward, dtype, &h), groups, dropout.as_ref(), stream)?;
    if let Choice::Cudnn { spec, workspace, .. } = choice {
        cudnn::forward(out, lse, (q, k, v), (spec, workspace), run, stream)?;
        return Ok(AttentionBackend::Cudnn);
    }
    with_float!(OP, dtype, T => {
        let (step, threshold, keep_scale, seed, site) = dropout_args::<T>(OP, dropout, q)?;
        let args = args![
            Out(out.view::<T>()?),
            Out(rows_view(OP, "lse", lse, q)?),
            In(q.view::<T>()?),
            In(k.view::<T>()?),
            In(v.view::<T>()?),
            step,
            h.scale(),
            threshold,
            keep_scale,
            seed,
            site,
        ];
        let (kernel, dims) = (kernel(Pass::Forward, dtype, h.hd), launch_dims(Pass::Forward, dtype, h.hd, h.seq, h.pairs));
        stream.launch_counting(kernel, dims, &[&args[..], &layout].concat(), FORWARD_PRODUCTS * h.causal_product_flops())
    })?;
    Ok(AttentionBackend::Kernels)
}

/// What the backward reads of the forward: its inputs, its output and its log-sum-exp.
#[derive(Clone, Copy)]
pub struct ForwardSaved<'a> {
    /// Queries `(.., T, hd)`.
    pub q: &'a Tensor,
    /// Keys, as `q`.
    pub k: &'a Tensor,
    /// Values, as `q`.
    pub v: &'a Tensor,
    /// The forward's output, as `q`.
    pub out: &'a Tensor,
    /// The forward's log-sum-exp, f32 `(.., T)`.
    pub lse: &'a Tensor,
}

/// The gradients of q, k and v (written, not accumulated) from the output's gradient `dout`, by
/// recomputing the probabilities from the saved log-sum-exp, with the forward's dropout (same
/// `p`, seed, site and step value). `delta` is f32 `(.., T)` scratch (each row's `dout · out`);
/// the gradients have the heads' shape and type, laid out alike, as are `out` and `dout` (Note
/// [Attention operand layouts]). Three launches on graphed's kernels: the row terms, then `dk`
/// and `dv` per key tile, then `dq` per query tile; on cuDNN one execution (writing `delta` as
/// its `softmax_sum`) per chunk of pairs whose scratch fits `run`'s limit
/// ([`AttentionRun::with_scratch_limit`]). Returns the backend that ran, as [`attention_forward`] does
/// ([`AttentionBackend::CudnnNondeterministic`] where a nondeterministic cuDNN engine did).
///
/// # Errors
/// As [`attention_forward`], for every tensor given.
pub fn attention_backward(
    (dq, dk, dv): (&Tensor, &Tensor, &Tensor),
    dout: &Tensor,
    saved: ForwardSaved<'_>,
    delta: &Tensor,
    dropout: Option<AttentionDropout<'_>>,
    run: AttentionRun<'_>,
    stream: &Stream,
) -> Result<AttentionBackend> {
    const OP: &str = "attention_backward";
    let ForwardSaved { q, k, v, out, lse } = saved;
    let dtype = float_dtype(OP, q, &[k, v, out, dout, dq, dk, dv])?;
    let h = Heads::of(OP, q)?;
    let shape = q.shape();
    let inputs = h.group(OP, &[("q", q), ("k", k), ("v", v)], shape)?;
    let grads = h.group(OP, &[("dq", dq), ("dk", dk), ("dv", dv)], shape)?;
    let outs = h.group(OP, &[("out", out), ("dout", dout)], shape)?;
    let layout = h.layout_args(OP, [inputs, grads, outs])?;
    let groups = [inputs, grads, outs];
    let choice = cudnn::choose(OP, run, (SdpaPass::Backward, dtype, &h), groups, dropout.as_ref(), stream)?;
    if let Choice::Cudnn { spec, workspace, dq_accumulator, chunk } = choice {
        let plan = (spec, workspace, dq_accumulator, chunk);
        cudnn::backward((dq, dk, dv), dout, saved, delta, plan, (&h, run), stream)?;
        return Ok(if spec.deterministic { AttentionBackend::Cudnn } else { AttentionBackend::CudnnNondeterministic });
    }
    let dims = |pass| launch_dims(pass, dtype, h.hd, h.seq, h.pairs);
    with_float!(OP, dtype, T => {
        let (step, threshold, keep_scale, seed, site) = dropout_args::<T>(OP, dropout, q)?;
        let (q, k, v) = (q.view::<T>()?, k.view::<T>()?, v.view::<T>()?);
        let (out, dout) = (out.view::<T>()?, dout.view::<T>()?);
        let (lse, delta) = (rows_view(OP, "lse", lse, saved.q)?, rows_view(OP, "delta", delta, saved.q)?);
        let (dq, dk, dv) = (dq.view::<T>()?, dk.view::<T>()?, dv.view::<T>()?);
        let scale = h.scale();
        let delta_args = [&args![Out(delta), In(out), In(dout)][..], &layout].concat();
        stream.launch(kernel(Pass::Delta, dtype, h.hd), dims(Pass::Delta), &delta_args)?;
        let dkdv = args![
            Out(dk), Out(dv), In(q), In(k), In(v), In(dout), In(lse), In(delta), step.clone(), scale, threshold,
            keep_scale, seed, site,
        ];
        let (dkdv, products) = ([&dkdv[..], &layout].concat(), DKDV_PRODUCTS * h.causal_product_flops());
        stream.launch_counting(kernel(Pass::BackwardDkDv, dtype, h.hd), dims(Pass::BackwardDkDv), &dkdv, products)?;
        let dq_args =
            args![Out(dq), In(q), In(k), In(v), In(dout), In(lse), In(delta), step, scale, threshold, keep_scale, seed, site];
        stream.launch_counting(
            kernel(Pass::BackwardDq, dtype, h.hd),
            dims(Pass::BackwardDq),
            &[&dq_args[..], &layout].concat(),
            DQ_PRODUCTS * h.causal_product_flops(),
        )
    })?;
    Ok(AttentionBackend::Kernels)
}
