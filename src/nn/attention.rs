//! Causal multi-head self-attention, in one of two forms ([`AttentionKind`]), around the same
//! parameters: a QKV projection into a `(B·T, 3C)` activation whose column blocks hold the heads
//! of Q, K and V; the attention proper, its output as `(B·T, C)` rows; and the output
//! projection, which can add a residual in its GEMM. A call costs a fixed number of launches,
//! whatever the batch.
//!
//! - [`AttentionKind::Fused`] (the default) runs [`ops::attention`](crate::ops::attention): one
//!   kernel forward, keeping each query row's log-sum-exp, and three backward, recomputing the
//!   probabilities tile by tile. Nothing of size `T × T` is ever allocated. The kernels write the
//!   output straight into the projection's input rows and, in the backward, read it and its
//!   gradient from such rows and write the gradients of q, k and v into the column blocks of the
//!   QKV projection's `(B·T, 3C)` gradient. They read q, k and v where the QKV projection wrote
//!   them, as views of its column blocks: no permute at all (Note [Attention operand layouts] in
//!   `ops::attention`). It saves the input, `qkv` (the projection's output, one tensor), `att`
//!   (the output rows, which the projection's weight gradient needs anyway) and `lse`. Head
//!   widths of [`HEAD_DIMS`](crate::ops::attention::HEAD_DIMS) only.
//!   The unfused form permutes the heads of Q, K and V into `(B, H, T, hd)` in one launch
//!   (`ops::heads::split_qkv`), saves them as `q`, `k` and `v`, permutes its output into rows
//!   and, in the backward, the gradients back.
//! - [`AttentionKind::Unfused`] is the benchmark layer of `BENCH.md`: `scores = Q·Kᵀ` in one
//!   strided-batched GEMM over every (batch element, head) pair, a causal softmax, `att =
//!   probs·V`. The 1/√head_dim scale rides in the score GEMM's alpha (and the gradient GEMMs'),
//!   so the softmax only masks and normalizes. It saves the `T × T` probabilities, and runs any
//!   head width but sequences of at most [`softmax::MAX_SEQ`].
//!
//! Attention dropout (nanoGPT's `attn_dropout`) drops attention probabilities in training, with
//! the numbers of (seed, site, step) (Note [Graph-safe RNG] in `ops/rng.rs`): the unfused form
//! runs [`ops::dropout`](crate::ops::dropout) on the `(B·H, T, T)` probabilities and keeps the
//! mask; the fused kernels draw the same numbers for the same elements, so both forms drop the
//! same probabilities. The fused backward recomputes the mask, so the fused forward snapshots the
//! step counter (one `u64`) into its context: a later forward (another microbatch) may advance
//! the counter before this backward runs.

use super::layernorm::single_input;
use super::{BiasGrad, Builder, DropoutSpec, Inputs, Linear, LinearForward, Module, Param, SaveHook, SavedTensor};
use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::ops::attention::{self, AttentionBackend, AttentionDropout, AttentionRun, ForwardSaved, HEAD_DIMS};
use crate::ops::matmul::{matmul, Matmul};
use crate::ops::{dropout, heads, softmax};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// How [`CausalSelfAttention`] computes `softmax(Q·Kᵀ/√hd + causal mask)·V`. Both forms have the
/// same parameters, draw the same dropout and agree within rounding (the module docs say what
/// each saves).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AttentionKind {
    /// The fused kernels of [`ops::attention`](crate::ops::attention) (FlashAttention-2's
    /// algorithm): no `T × T` tensor, any sequence length, head widths of
    /// [`HEAD_DIMS`](crate::ops::attention::HEAD_DIMS) only.
    #[default]
    Fused,
    /// GEMMs around a causal softmax kernel, saving the `T × T` probabilities: any head width,
    /// sequences of at most [`softmax::MAX_SEQ`](crate::ops::softmax::MAX_SEQ).
    Unfused,
}

impl AttentionKind {
    /// Both forms, the default first.
    pub const ALL: [AttentionKind; 2] = [AttentionKind::Fused, AttentionKind::Unfused];

    /// `fused` or `unfused`, as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Fused => "fused",
            AttentionKind::Unfused => "unfused",
        }
    }

    /// The form called `name` (`fused` or `unfused`).
    pub fn named(name: &str) -> Option<AttentionKind> {
        AttentionKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether this form runs heads of `hd` features.
    pub fn supports_head_dim(self, hd: usize) -> bool {
        self == AttentionKind::Unfused || HEAD_DIMS.contains(&hd)
    }
}

impl std::fmt::Display for AttentionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The shape and form of a [`CausalSelfAttention`]: `dim` features in `heads` heads, computed
/// as `kind` says, the fused form on `backend`. A `(dim, heads)` pair converts into the default
/// (fused, automatic backend) form, so that `CausalSelfAttention::new(&vb, (dim, heads))` reads
/// as it always has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSpec {
    /// Model width.
    pub dim: usize,
    /// Attention heads; must divide `dim`.
    pub heads: usize,
    /// The form of the attention proper.
    pub kind: AttentionKind,
    /// Which implementation runs the fused form (cuDNN or graphed's kernels).
    pub backend: AttentionBackend,
    /// The most bytes of `T × T` scratch cuDNN's deterministic backward keeps at once
    /// ([`AttentionRun::with_scratch_limit`]); `None` for the default.
    pub scratch_limit: Option<usize>,
}

impl AttentionSpec {
    /// `dim` features in `heads` heads, in the default form on the default backend.
    pub fn new(dim: usize, heads: usize) -> AttentionSpec {
        let (kind, backend) = (AttentionKind::default(), AttentionBackend::default());
        AttentionSpec { dim, heads, kind, backend, scratch_limit: None }
    }

    /// The same shape in form `kind`.
    pub fn kind(self, kind: AttentionKind) -> AttentionSpec {
        AttentionSpec { kind, ..self }
    }

    /// The same, the fused form running on `backend`.
    pub fn backend(self, backend: AttentionBackend) -> AttentionSpec {
        AttentionSpec { backend, ..self }
    }

    /// The same, cuDNN's backward keeping at most `bytes` of `T × T` scratch at once: lower
    /// trades speed for memory, higher the reverse
    /// ([`default_scratch_limit`](crate::ops::attention::default_scratch_limit) says the default).
    pub fn scratch_limit(self, bytes: usize) -> AttentionSpec {
        AttentionSpec { scratch_limit: Some(bytes), ..self }
    }
}

impl From<(usize, usize)> for AttentionSpec {
    fn from((dim, heads): (usize, usize)) -> AttentionSpec {
        AttentionSpec::new(dim, heads)
    }
}

/// What ran a layer's latest fused forward and backward: cuDNN or graphed's kernels
/// ([`AttentionBackend::Cudnn`] or [`AttentionBackend::Kernels`]); `None` before the first, and
/// always in the unfused form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BackendsRan {
    /// The latest forward's.
    pub forward: Option<AttentionBackend>,
    /// The latest backward's.
    pub backward: Option<AttentionBackend>,
}

/// Causal self-attention over `(B, T, C)` inputs with `heads` heads of `C / heads` features.
pub struct CausalSelfAttention {
    name: String,
    alloc: CachingAllocator,
    /// `C → 3C`: queries, keys, values, each with head `h` in columns `h·hd..(h+1)·hd`.
    pub qkv: Linear,
    /// `C → C`, the output projection.
    pub proj: Linear,
    heads: usize,
    kind: AttentionKind,
    backend: AttentionBackend,
    scratch_limit: Option<usize>,
    /// What the fused calls ran on, for a benchmark to say.
    ran: std::sync::Mutex<BackendsRan>,
    /// Dropout on the probabilities, if any (p > 0).
    dropout: Option<DropoutSpec>,
    training: bool,
    /// Whether the forward saves its input; when not, whoever runs the backward gives it again
    /// (a [`TransformerLayer`](super::TransformerLayer) recomputing its LayerNorm output).
    keep_input: bool,
}

/// What the forward saves: the projections' inputs (x, none when the caller gives it again,
/// and att), and what the form needs besides (see the module docs).
pub struct AttentionCtx {
    dims: Dims,
    x: Option<SavedTensor>,
    att: SavedTensor,
    form: FormCtx,
}

/// What one form saves besides the common tensors.
enum FormCtx {
    /// The QKV projection's `(B·T, 3C)` output, whose column blocks the kernels read as the
    /// heads of q, k and v; the log-sum-exp `(B, H, T)` f32; and the step counter's value at the
    /// forward when it dropped (a one-element `u64` copy).
    Fused { qkv: SavedTensor, lse: SavedTensor, step: Option<Tensor> },
    /// The heads of q, k and v `(B, H, T, hd)`; the probabilities `(B, H, T, T)` before dropout,
    /// and the dropout mask (`u8`, same shape) when it dropped.
    Unfused { heads: [SavedTensor; 3], probs: SavedTensor, mask: Option<Tensor> },
}

/// Batch, sequence, heads and head width of one call.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    seq: usize,
    heads: usize,
    hd: usize,
}

impl Dims {
    /// `(B, H, T, hd)`, the layout of the heads.
    fn head_shape(&self) -> [usize; 4] {
        [self.batch, self.heads, self.seq, self.hd]
    }

    /// Part `part` of `parts` of `(B·T, parts·C)` rows as heads `(B, H, T, hd)`: a view, each row
    /// `hd` contiguous elements (the fused kernels read and write such views in place; Note
    /// [Attention operand layouts] in `ops::attention`).
    fn heads_of_rows(&self, rows: &Tensor, parts: usize, part: usize) -> Result<Tensor> {
        rows.reshape(&[self.batch, self.seq, parts, self.heads, self.hd])?.select(2, part)?.transpose(1, 2)
    }

    /// The heads of q, k and v in `(B·T, 3C)` rows (the QKV projection's output, or its
    /// gradient): views of the three column blocks.
    fn qkv_heads(&self, rows: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        Ok((self.heads_of_rows(rows, 3, 0)?, self.heads_of_rows(rows, 3, 1)?, self.heads_of_rows(rows, 3, 2)?))
    }

    /// `(B, H, T)`, the layout of per-row terms (the log-sum-exp).
    fn row_shape(&self) -> [usize; 3] {
        [self.batch, self.heads, self.seq]
    }

    /// `(B, H, T, T)`, the layout of the unfused form's scores and probabilities.
    fn square_shape(&self) -> [usize; 4] {
        [self.batch, self.heads, self.seq, self.seq]
    }

    /// Every (batch element, head) pair: the batch of the attention GEMMs.
    fn pairs(&self) -> usize {
        self.batch * self.heads
    }

    fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }
}

/// `c = alpha·op(a)·op(b)` for the `batch` matrices of `(m, n, k)` (`beta` 0).
fn batched(
    stream: &Stream,
    (c, a, b): (&Tensor, &Tensor, &Tensor),
    (m, n, k): (usize, usize, usize),
    (batch, alpha): (usize, f32),
    (trans_a, trans_b): (bool, bool),
) -> Result<()> {
    matmul(Matmul { batch, alpha, trans_a, trans_b, ..Matmul::new(c, a, b, (m, n, k)) }, stream)
}

/// Why the fused form refuses a head width, in a user's words.
pub(crate) const FUSED_HEAD_DIMS_WHY: &str = "fused attention runs heads of 32, 64 or 128 features; pick a head \
     count that gives one of them, or the unfused form (AttentionKind::Unfused, `--attention unfused`)";

impl CausalSelfAttention {
    /// The parameters attention on `dim` features adds to its store (QKV and output projection).
    pub fn parameter_count(dim: usize) -> usize {
        Linear::parameter_count((dim, 3 * dim)) + Linear::parameter_count((dim, dim))
    }

    /// Attention of `spec`'s shape and form (a `(dim, heads)` pair gives the fused form), with
    /// `dim` a multiple of `heads`: `{prefix}.qkv` initialized from `vb`'s seed, `{prefix}.proj`
    /// from seed + 1; dropout on its probabilities drawn from `vb`'s
    /// [`dropout`](Builder::dropout) at its site (none when p is 0): give it a site no other
    /// dropout uses.
    ///
    /// # Errors
    /// [`Error::Shape`] unless `heads` divides `dim` (both nonzero); [`Error::Unsupported`] for
    /// the fused form with a head width outside
    /// [`HEAD_DIMS`](crate::ops::attention::HEAD_DIMS), or unless the drop probability is in
    /// `[0, 1)`; all before anything is allocated.
    pub fn new(vb: &Builder, spec: impl Into<AttentionSpec>) -> Result<CausalSelfAttention> {
        const OP: &str = "CausalSelfAttention::new";
        let AttentionSpec { dim, heads, kind, backend, scratch_limit } = spec.into();
        if heads == 0 || dim == 0 || dim % heads != 0 {
            return Err(Error::Shape {
                op: OP,
                expected: "a nonzero width divisible by the number of heads".into(),
                found: vec![dim, heads],
            });
        }
        if !kind.supports_head_dim(dim / heads) {
            return Err(Error::Unsupported { op: OP, backend: "any", why: FUSED_HEAD_DIMS_WHY });
        }
        let dropout = vb.dropout();
        if !(0.0..1.0).contains(&dropout.p) {
            return Err(Error::Unsupported { op: OP, backend: "any", why: "the drop probability p must be in [0, 1)" });
        }
        let qkv = Linear::new(&vb.pp("qkv"), (dim, 3 * dim))?;
        let proj = Linear::new(&vb.pp("proj").with_seed(vb.seed().wrapping_add(1)), (dim, dim))?;
        Ok(CausalSelfAttention {
            name: vb.prefix().to_string(),
            alloc: vb.alloc().clone(),
            qkv,
            proj,
            heads,
            kind,
            backend,
            scratch_limit,
            ran: std::sync::Mutex::default(),
            dropout: (dropout.p > 0.0).then(|| dropout.clone()),
            training: true,
            keep_input: true,
        })
    }

    /// Stops saving the input: the backward then needs it given again
    /// ([`backward_with`](CausalSelfAttention::backward_with)'s `input`).
    pub(crate) fn forget_input(&mut self) {
        self.keep_input = false;
    }

    /// The form it computes in.
    pub fn kind(&self) -> AttentionKind {
        self.kind
    }

    /// The backend its fused form runs on.
    pub fn backend(&self) -> AttentionBackend {
        self.backend
    }

    /// The most bytes of `T × T` scratch its cuDNN backward keeps at once, if it sets a limit
    /// (else the default, [`default_scratch_limit`](crate::ops::attention::default_scratch_limit)).
    pub fn scratch_limit(&self) -> Option<usize> {
        self.scratch_limit
    }

    /// What ran its latest fused forward and backward.
    pub fn backends_ran(&self) -> BackendsRan {
        *self.ran.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes what ran a fused call.
    fn note(&self, f: impl FnOnce(&mut BackendsRan)) {
        f(&mut self.ran.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    }

    /// The fused calls' backend, with cuDNN's scratch from the layer's allocator, within the
    /// layer's limit.
    fn run(&self) -> AttentionRun<'_> {
        AttentionRun { scratch_limit: self.scratch_limit, ..AttentionRun::new(self.backend, &self.alloc) }
    }

    /// The dropout it draws in this forward, if any (training with p > 0).
    fn active_dropout(&self) -> Option<&DropoutSpec> {
        self.dropout.as_ref().filter(|_| self.training)
    }

    fn dims(&self, op: &'static str, x: &Tensor) -> Result<Dims> {
        let c = self.proj.weight.value.shape()[0];
        match *x.shape() {
            [batch, seq, width] if width == c => Ok(Dims { batch, seq, heads: self.heads, hd: c / self.heads }),
            _ => Err(Error::Shape { op, expected: format!("(B, T, {c})"), found: x.shape().to_vec() }),
        }
    }

    fn heads(&self, d: &Dims, dtype: DType, stream: &Stream) -> Result<Tensor> {
        Tensor::uninit(&self.alloc, stream, &d.head_shape(), dtype)
    }
}

impl CausalSelfAttention {
    /// `residual + Attn(x)` (just `Attn(x)` without a residual; the add in the output
    /// projection's GEMM) over a contiguous `(B, T, C)` input.
    pub fn forward_residual(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        hook: &dyn SaveHook,
        stream: &Stream,
    ) -> Result<(Tensor, AttentionCtx)> {
        const OP: &str = "CausalSelfAttention::forward";
        let d = self.dims(OP, x)?;
        let (bt, c, dtype) = (d.batch * d.seq, d.heads * d.hd, x.dtype());
        if let Some(r) = residual {
            r.expect_shape(OP, x.shape())?;
        }
        let rows = x.reshape(&[bt, c])?;
        let LinearForward { y: qkv, input: kept } = self.qkv.forward_keeping_input(&rows, None, stream)?;
        // The fused kernels read the heads where the QKV projection wrote them, and write theirs
        // straight into the output projection's input rows.
        let att = Tensor::uninit(&self.alloc, stream, &[bt, c], dtype)?;
        let form = match self.kind {
            AttentionKind::Fused => {
                let (q, k, v) = d.qkv_heads(&qkv)?;
                self.fused_forward(&d, &d.heads_of_rows(&att, 1, 0)?, (&q, &k, &v), stream)?
            }
            AttentionKind::Unfused => {
                let (q, k, v) =
                    (self.heads(&d, dtype, stream)?, self.heads(&d, dtype, stream)?, self.heads(&d, dtype, stream)?);
                heads::split_qkv(&q, &k, &v, &qkv, stream)?;
                let att_heads = self.heads(&d, dtype, stream)?;
                let form = self.unfused_forward(&d, &att_heads, [q, k, v], stream)?;
                heads::rows_from_heads(&att, 0, &att_heads, stream)?;
                form
            }
        };
        let residual = residual.map(|r| r.reshape(&[bt, c])).transpose()?;
        let y = self.proj.forward_with(&att, residual.as_ref(), stream)?;
        hook.open_group(&self.name)?;
        let x = match self.keep_input {
            true => Some(hook.save("input", kept, stream)?),
            false => None,
        };
        let form = match form {
            Unsaved::Fused { lse, step } => {
                let qkv = hook.save("qkv", qkv, stream)?;
                FormCtx::Fused { qkv, lse: hook.save("lse", lse, stream)?, step }
            }
            Unsaved::Unfused { heads, probs, mask } => {
                let [q, k, v] = *heads;
                drop(qkv);
                let heads = [hook.save("q", q, stream)?, hook.save("k", k, stream)?, hook.save("v", v, stream)?];
                FormCtx::Unfused { heads, probs: hook.save("probs", probs, stream)?, mask }
            }
        };
        let att = hook.save("att", att, stream)?;
        hook.commit_group(&self.name, stream)?;
        Ok((y.reshape(&[d.batch, d.seq, c])?, AttentionCtx { dims: d, x, att, form }))
    }

    /// The fused attention into `out` (heads), with the log-sum-exp and the step snapshot.
    fn fused_forward(
        &self,
        d: &Dims,
        out: &Tensor,
        qkv: (&Tensor, &Tensor, &Tensor),
        stream: &Stream,
    ) -> Result<Unsaved> {
        let lse = Tensor::uninit(&self.alloc, stream, &d.row_shape(), DType::F32)?;
        let step = match self.active_dropout() {
            Some(spec) => {
                let snapshot = Tensor::uninit(&self.alloc, stream, &[1], DType::U64)?;
                stream.copy_d2d(spec.step.view::<u64>()?, snapshot.view::<u64>()?)?;
                Some(snapshot)
            }
            None => None,
        };
        let ran = attention::attention_forward(out, &lse, qkv, self.kernel_dropout(step.as_ref()), self.run(), stream)?;
        self.note(|r| r.forward = Some(ran));
        Ok(Unsaved::Fused { lse, step })
    }

    /// The kernels' dropout, reading the step counter `step` (the forward's snapshot).
    fn kernel_dropout<'a>(&self, step: Option<&'a Tensor>) -> Option<AttentionDropout<'a>> {
        let (spec, step) = (self.dropout.as_ref()?, step?);
        Some(AttentionDropout { p: spec.p, seed: spec.seed, site: spec.site, step })
    }

    /// Scores, causal softmax, dropout and `probs·V` into `out` (heads), from the heads of q, k
    /// and v, which it keeps.
    fn unfused_forward(&self, d: &Dims, out: &Tensor, heads: [Tensor; 3], stream: &Stream) -> Result<Unsaved> {
        let [q, k, v] = &heads;
        let dtype = q.dtype();
        let square = || Tensor::uninit(&self.alloc, stream, &d.square_shape(), dtype);
        let (scores, probs) = (square()?, square()?);
        batched(stream, (&scores, q, k), (d.seq, d.seq, d.hd), (d.pairs(), d.scale()), (false, true))?;
        softmax::softmax_causal_forward(&probs, &scores, stream)?;
        drop(scores);
        let pv = (d.seq, d.hd, d.seq);
        let mask = match self.active_dropout() {
            Some(spec) => {
                let (dropped, mask) = (square()?, Tensor::uninit(&self.alloc, stream, &d.square_shape(), DType::U8)?);
                dropout::dropout_forward(&dropped, &mask, &probs, spec.p, spec.seed, spec.site, &spec.step, stream)?;
                batched(stream, (out, &dropped, v), pv, (d.pairs(), 1.0), (false, false))?;
                Some(mask)
            }
            None => {
                batched(stream, (out, &probs, v), pv, (d.pairs(), 1.0), (false, false))?;
                None
            }
        };
        Ok(Unsaved::Unfused { heads: Box::new(heads), probs, mask })
    }

    /// The input gradient from the output gradient `dy`; parameter gradients `+=`, the output
    /// projection's bias gradient as `proj_bias` says. `input` is the forward's input again, for
    /// an attention that did not save it.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the forward did not save its input and `input` is `None`.
    pub fn backward_with(
        &self,
        ctx: AttentionCtx,
        dy: &Tensor,
        proj_bias: BiasGrad,
        input: Option<&Tensor>,
        stream: &Stream,
    ) -> Result<Tensor> {
        const OP: &str = "CausalSelfAttention::backward";
        let d = ctx.dims;
        let (bt, c, dtype) = (d.batch * d.seq, d.heads * d.hd, dy.dtype());
        dy.expect_shape(OP, &[d.batch, d.seq, c])?;
        // A saved input is as the QKV projection kept it (in FP8 its quantized transpose); one
        // given is `(B, T, C)`.
        let given = input.map(|x| x.reshape(&[bt, c])).transpose()?;
        let x = super::saved::saved_or_given(ctx.x, given.as_ref(), OP, stream)?;
        let dy = dy.reshape(&[bt, c])?;
        let att = ctx.att.take(stream)?;
        let datt = self.proj.backward_with(&dy, &att, None, proj_bias, stream)?;
        let dqkv = Tensor::uninit(&self.alloc, stream, &[bt, 3 * c], dtype)?;
        match ctx.form {
            FormCtx::Fused { qkv, lse, step } => {
                // The kernels read q, k, v, the output and its gradient where the projections
                // keep them, and write q's, k's and v's gradients into the QKV projection's
                // gradient rows.
                let qkv = qkv.take(stream)?;
                let (q, k, v) = d.qkv_heads(&qkv)?;
                let (out, dout) = (d.heads_of_rows(&att, 1, 0)?, d.heads_of_rows(&datt, 1, 0)?);
                let (dq, dk, dv) = d.qkv_heads(&dqkv)?;
                let lse = lse.take(stream)?;
                let delta = Tensor::uninit(&self.alloc, stream, &d.row_shape(), DType::F32)?;
                let saved = ForwardSaved { q: &q, k: &k, v: &v, out: &out, lse: &lse };
                let dropout = self.kernel_dropout(step.as_ref());
                let grads = (&dq, &dk, &dv);
                let ran = attention::attention_backward(grads, &dout, saved, &delta, dropout, self.run(), stream)?;
                self.note(|r| r.backward = Some(ran));
            }
            FormCtx::Unfused { heads: [q, k, v], probs, mask } => {
                drop(att);
                let (q, k, v) = (&q.take(stream)?, &k.take(stream)?, &v.take(stream)?);
                let datt_heads = self.heads(&d, dtype, stream)?;
                heads::heads_from_rows(&datt_heads, &datt, 0, stream)?;
                let (dq, dk, dv) =
                    (self.heads(&d, dtype, stream)?, self.heads(&d, dtype, stream)?, self.heads(&d, dtype, stream)?);
                let probs = probs.take(stream)?;
                self.unfused_backward(&d, (&dq, &dk, &dv), &datt_heads, (q, k, v), &probs, mask.as_ref(), stream)?;
                heads::merge_qkv(&dqkv, &dq, &dk, &dv, stream)?;
            }
        }
        let dx = self.qkv.backward_with(&dqkv, &x, None, BiasGrad::Compute, stream)?;
        dx.reshape(&[d.batch, d.seq, c])
    }

    /// The unfused form's gradients of q, k and v: through `probs·V`, the dropout (its mask
    /// applied to the gradient, and to the probabilities again for `dV`), and the softmax.
    #[allow(clippy::too_many_arguments)] // gradients, upstream gradient, inputs, saved tensors, stream
    fn unfused_backward(
        &self,
        d: &Dims,
        (dq, dk, dv): (&Tensor, &Tensor, &Tensor),
        datt: &Tensor,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        probs: &Tensor,
        mask: Option<&Tensor>,
        stream: &Stream,
    ) -> Result<()> {
        let (t, hd, pairs, scale) = (d.seq, d.hd, d.pairs(), d.scale());
        let square = || Tensor::uninit(&self.alloc, stream, &d.square_shape(), probs.dtype());
        let dprobs = square()?;
        batched(stream, (&dprobs, datt, v), (t, t, hd), (pairs, 1.0), (false, true))?;
        let dprobs = match (mask, self.dropout.as_ref()) {
            (Some(mask), Some(spec)) => {
                // The dropped probabilities `mask·probs/(1 − p)`, bitwise as the forward's
                // (both scale in f32 and round once), for dV; then the mask on the gradient.
                let dropped = square()?;
                dropout::dropout_backward(&dropped, probs, mask, spec.p, stream)?;
                batched(stream, (dv, &dropped, datt), (t, hd, t), (pairs, 1.0), (true, false))?;
                drop(dropped);
                let dkept = square()?;
                dropout::dropout_backward(&dkept, &dprobs, mask, spec.p, stream)?;
                dkept
            }
            _ => {
                batched(stream, (dv, probs, datt), (t, hd, t), (pairs, 1.0), (true, false))?;
                dprobs
            }
        };
        let dscores = square()?;
        softmax::softmax_causal_backward(&dscores, probs, &dprobs, stream)?;
        batched(stream, (dq, &dscores, k), (t, hd, t), (pairs, scale), (false, false))?;
        batched(stream, (dk, &dscores, q), (t, hd, t), (pairs, scale), (true, false))
    }
}

/// A form's tensors before they pass through the save hook.
enum Unsaved {
    Fused { lse: Tensor, step: Option<Tensor> },
    Unfused { heads: Box<[Tensor; 3]>, probs: Tensor, mask: Option<Tensor> },
}

impl Module for CausalSelfAttention {
    type Ctx = AttentionCtx;

    /// One contiguous input `(B, T, C)`, one output `(B, T, C)`.
    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, AttentionCtx)> {
        let x = inputs.only("CausalSelfAttention::forward")?;
        let (y, ctx) = self.forward_residual(x, None, hook, stream)?;
        Ok((vec![y], ctx))
    }

    fn backward(&self, ctx: AttentionCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        let dy = single_input("CausalSelfAttention::backward", grad_outputs)?;
        Ok(vec![Some(self.backward_with(ctx, dy, BiasGrad::Compute, None, stream)?)])
    }

    /// The weight gradients its projections left for later, if split (`Linear::set_split_dw`).
    fn backward_dw(&self, stream: &Stream) -> Result<()> {
        self.proj.backward_dw(stream)?;
        self.qkv.backward_dw(stream)
    }

    fn splits_dw(&self) -> bool {
        self.qkv.splits_dw() || self.proj.splits_dw()
    }

    fn draws_from(&self) -> Option<&Tensor> {
        self.active_dropout().map(|spec| &spec.step)
    }

    fn parameters(&self) -> Vec<&Param> {
        [self.qkv.parameters(), self.proj.parameters()].concat()
    }

    fn pass_state(&self) -> Vec<Tensor> {
        [self.qkv.pass_state(), self.proj.pass_state()].concat()
    }

    /// Turns its attention dropout on or off.
    fn set_training(&mut self, training: bool) {
        self.training = training;
    }
}
