//! cuDNN's fused causal attention (scaled dot-product attention, "SDPA"), the second library
//! call of the device layer: cuDNN's backend graph API on CUDA; the simulator has no cuDNN and
//! refuses it.
//!
//! A call is declared like a kernel launch, as [`Gemm`](super::Gemm) is, so its accesses (the
//! operands, the saved log-sum-exp, the row terms of the backward, and the hidden plan workspace
//! and fp32 dQ accumulator, which come from the caller's allocator and so from a graph's pool
//! under capture) reach the checker and graph summaries. Operands are bf16 `(B, H, T, hd)` views
//! whose rows are `hd` contiguous elements at any batch, head and row strides (Note [Attention
//! operand layouts] in `ops::attention`): cuDNN reads and writes them in place. The log-sum-exp
//! (cuDNN's `Stats`) and the backward's row terms (cuDNN's `softmax_sum`) are f32 `(B, H, T)`,
//! dense, as cuDNN's backward engines need them.
//!
//! A call is planned first ([`Stream::sdpa_plan`](super::Stream::sdpa_plan)): cuDNN's heuristics
//! pick an engine for its [`SdpaSpec`], once per spec, and the plan says how much workspace the
//! caller must allocate. The backward takes only engines cuDNN does not mark nondeterministic, so
//! that every run is bitwise the same, unless the spec says otherwise (an explicit opt-in).

use half::bf16;

use super::kernel::{Arg, CpuArgs, Hidden, In, Kernel, Out};
use super::{DType, View};
use crate::{Error, Result};

/// Forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum SdpaPass {
    Forward,
    Backward,
}

/// Element strides of one operand group of a `(B, H, T, hd)` call: batch, head, row (the
/// feature stride is 1).
pub(crate) type Strides = [usize; 3];

/// The layout of a call, the key under which CUDA caches its plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SdpaSpec {
    pub(crate) pass: SdpaPass,
    pub(crate) dtype: DType,
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    pub(crate) seq: usize,
    pub(crate) hd: usize,
    /// q, k and v.
    pub(crate) inputs: Strides,
    /// The output and, in the backward, its gradient.
    pub(crate) outs: Strides,
    /// dq, dk and dv (the backward only; the forward's are `outs`).
    pub(crate) grads: Strides,
    /// Only engines cuDNN does not mark nondeterministic (the default; see
    /// `AttentionBackend::CudnnNondeterministic` for the other).
    pub(crate) deterministic: bool,
}

impl SdpaSpec {
    /// The causal products the pass runs, at 2·B·H·T²·hd/2 FLOPs each (FlashAttention's count):
    /// 2 forward (`q·kᵀ`, `p·v`), 5 backward (`q·kᵀ` again, `dout·vᵀ`, `pᵀ·dout`, `dsᵀ·q`,
    /// `ds·k`).
    pub(crate) fn flops(&self) -> u64 {
        let product = (self.batch * self.heads) as u64 * (self.seq as u64).pow(2) * self.hd as u64;
        match self.pass {
            SdpaPass::Forward => 2 * product,
            SdpaPass::Backward => 5 * product,
        }
    }
}

/// What a plan needs of the caller, or why there is none.
#[derive(Debug, Clone)]
pub(crate) enum SdpaPlan {
    /// cuDNN runs the spec with `workspace` bytes of scratch, and, when `dq_accumulator`, an f32
    /// `(B, H, T, hd)` dQ accumulator besides.
    Ready { workspace: usize, dq_accumulator: bool },
    /// cuDNN cannot run it here; the reason, for a refusal or a log line.
    Unavailable(String),
}

/// The operands of one call: the forward's, and the backward's besides.
pub(crate) struct Sdpa<'a> {
    /// q, k and v: read.
    pub(crate) inputs: [View<'a, bf16>; 3],
    /// The output: written by the forward, read by the backward.
    pub(crate) out: View<'a, bf16>,
    /// The log-sum-exp (cuDNN's `Stats`): written by the forward, read by the backward.
    pub(crate) lse: View<'a, f32>,
    /// The backward's operands; none for the forward.
    pub(crate) backward: Option<SdpaGrads<'a>>,
}

/// The backward's own operands.
pub(crate) struct SdpaGrads<'a> {
    /// The output's gradient: read.
    pub(crate) dout: View<'a, bf16>,
    /// dq, dk and dv: written.
    pub(crate) grads: [View<'a, bf16>; 3],
    /// cuDNN's `softmax_sum`, each row's `dout · out`: written.
    pub(crate) delta: View<'a, f32>,
}

/// The scratch memory of one call, from the caller's allocator.
pub(crate) struct SdpaScratch<'a> {
    /// The plan's workspace.
    pub(crate) workspace: View<'a, u8>,
    /// The backward's f32 dQ accumulator when its plan has one, else an empty view.
    pub(crate) dq_accumulator: View<'a, f32>,
}

/// Why the simulator cannot run a cuDNN call.
pub(crate) const SIM_WHY: &str = "the simulator has no cuDNN";

/// The simulator's path: none (the public layer refuses cuDNN calls on the simulator first).
fn no_cpu_path(_: &CpuArgs) -> Result<()> {
    Err(Error::CudnnUnavailable { op: "attention", why: SIM_WHY.into() })
}

/// The forward, as reports and graph summaries name it.
pub(crate) static SDPA_FORWARD: Kernel = Kernel {
    name: "cudnn_sdpa_forward_bf16",
    source: "",
    params: &["out", "lse", "q", "k", "v", "workspace", "scale"],
    cpu: no_cpu_path,
    strided: true,
};

/// The backward, as reports and graph summaries name it.
pub(crate) static SDPA_BACKWARD: Kernel = Kernel {
    name: "cudnn_sdpa_backward_bf16",
    source: "",
    params: &["dq", "dk", "dv", "delta", "q", "k", "v", "out", "dout", "lse", "workspace", "dq_accumulator", "scale"],
    cpu: no_cpu_path,
    strided: true,
};

impl<'a> Sdpa<'a> {
    pub(crate) fn kernel(&self) -> &'static Kernel {
        match self.backward {
            None => &SDPA_FORWARD,
            Some(_) => &SDPA_BACKWARD,
        }
    }

    /// The launch arguments, one per name of [`Sdpa::kernel`]'s params.
    pub(crate) fn args<'w>(&'w self, scratch: &SdpaScratch<'w>, scale: f32) -> Vec<Arg<'w>> {
        let workspace = Hidden("cudnn workspace", scratch.workspace).into();
        let [q, k, v] = self.inputs;
        match &self.backward {
            None => vec![
                Out(self.out).into(),
                Out(self.lse).into(),
                In(q).into(),
                In(k).into(),
                In(v).into(),
                workspace,
                scale.into(),
            ],
            Some(SdpaGrads { dout, grads: [dq, dk, dv], delta }) => vec![
                Out(*dq).into(),
                Out(*dk).into(),
                Out(*dv).into(),
                Out(*delta).into(),
                In(q).into(),
                In(k).into(),
                In(v).into(),
                In(self.out).into(),
                In(*dout).into(),
                In(self.lse).into(),
                workspace,
                Hidden("cudnn dq accumulator", scratch.dq_accumulator).into(),
                scale.into(),
            ],
        }
    }
}
