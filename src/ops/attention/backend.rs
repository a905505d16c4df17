//! Which implementation runs fused attention: cuDNN's fused attention engines (bf16 on CUDA) or
//! graphed's own kernels (`attention.cu`), chosen per call by an [`AttentionBackend`] setting.

use crate::memory::CachingAllocator;

/// Which implementation runs fused attention. Both compute the same math and keep the same
/// log-sum-exp, so a forward of one and a backward of the other agree within rounding; each is
/// bitwise reproducible run to run, except the opt-in
/// [`CudnnNondeterministic`](AttentionBackend::CudnnNondeterministic).
///
/// cuDNN runs bf16 on CUDA, head widths 64 and 128, sequence lengths that are multiples of 128,
/// without attention dropout (cuDNN's dropout masks are not graphed's counter-based numbers, so
/// graphed's own kernels keep graphed and eager runs equal bit for bit), and only where a
/// deterministic cuDNN engine exists for the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AttentionBackend {
    /// cuDNN where it is available and runs the call, else graphed's kernels; on the simulator,
    /// graphed's kernels (their CPU paths). cuDNN's deterministic backward keeps a `T × T`
    /// scratch per (batch element, head), so it runs in chunks of pairs whose scratch fits the
    /// run's limit ([`AttentionRun::with_scratch_limit`]); where not even one pair's fits, the
    /// backward runs on graphed's kernels.
    #[default]
    Auto,
    /// cuDNN, or a refusal ([`Error::CudnnUnavailable`](crate::Error::CudnnUnavailable)) before
    /// anything is enqueued where it cannot run the call.
    Cudnn,
    /// graphed's own kernels, for every element type, head width and sequence length.
    Kernels,
    /// cuDNN as [`Cudnn`](AttentionBackend::Cudnn), with the backward free to take an engine
    /// cuDNN marks nondeterministic (dQ accumulated with atomics, PyTorch's default): faster and
    /// without the deterministic engine's `T × T` scratch, but its gradients differ in the last
    /// bits run to run, so a graphed run no longer equals an eager one bit for bit. Opt-in only.
    CudnnNondeterministic,
}

impl AttentionBackend {
    /// Every setting, the default first.
    pub const ALL: [AttentionBackend; 4] = [
        AttentionBackend::Auto,
        AttentionBackend::Cudnn,
        AttentionBackend::Kernels,
        AttentionBackend::CudnnNondeterministic,
    ];

    /// `auto`, `cudnn`, `kernels` or `cudnn-nondeterministic`, as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            AttentionBackend::Auto => "auto",
            AttentionBackend::Cudnn => "cudnn",
            AttentionBackend::Kernels => "kernels",
            AttentionBackend::CudnnNondeterministic => "cudnn-nondeterministic",
        }
    }

    /// The setting called `name`.
    pub fn named(name: &str) -> Option<AttentionBackend> {
        AttentionBackend::ALL.into_iter().find(|b| b.name() == name)
    }

    /// Whether this setting runs cuDNN or refuses ([`Cudnn`](AttentionBackend::Cudnn) and
    /// [`CudnnNondeterministic`](AttentionBackend::CudnnNondeterministic)).
    pub fn requires_cudnn(self) -> bool {
        matches!(self, AttentionBackend::Cudnn | AttentionBackend::CudnnNondeterministic)
    }
}

impl std::fmt::Display for AttentionBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How one call runs: the backend setting, the allocator that cuDNN's scratch memory (its
/// plan's workspace, the backward's dQ accumulator) comes from, so that under a capture it lives
/// in the graph's pool like every other temporary, and how much of it cuDNN's backward may keep
/// at once.
#[derive(Clone, Copy)]
pub struct AttentionRun<'a> {
    /// Which implementation.
    pub backend: AttentionBackend,
    /// Where cuDNN's scratch comes from (unused by graphed's kernels).
    pub scratch: &'a CachingAllocator,
    /// The most bytes of `T × T` scratch cuDNN's deterministic backward may keep at once; `None`
    /// for [`default_scratch_limit`](super::default_scratch_limit), or the room the allocator
    /// holds free below its peak where that is more.
    pub scratch_limit: Option<usize>,
}

impl<'a> AttentionRun<'a> {
    /// `backend`, its scratch from `scratch`, within the default limit.
    pub fn new(backend: AttentionBackend, scratch: &'a CachingAllocator) -> AttentionRun<'a> {
        AttentionRun { backend, scratch, scratch_limit: None }
    }

    /// The same run with cuDNN's backward keeping at most `bytes` of `T × T` scratch at once: a
    /// call whose pairs' scratch exceeds it runs as several cuDNN executions over groups of
    /// pairs, one after another on the call's stream, sharing one workspace. Lower it to trade a
    /// little speed for memory; raise it to run a long sequence's backward in fewer executions.
    /// A set limit is kept even where the allocator has more room.
    pub fn with_scratch_limit(self, bytes: usize) -> AttentionRun<'a> {
        AttentionRun { scratch_limit: Some(bytes), ..self }
    }

    /// The limit this run keeps cuDNN's backward scratch of `pairs` pairs of `seq` tokens of
    /// `hd` features within: its own, else [`default_scratch_limit`](super::default_scratch_limit).
    pub fn scratch_limit_for(&self, pairs: usize, seq: usize, hd: usize) -> usize {
        self.scratch_limit.unwrap_or_else(|| super::default_scratch_limit(pairs, seq, hd))
    }
}
