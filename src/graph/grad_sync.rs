//! Work on parameter gradients inside the captured backward passes: the data-parallel
//! reduction (`dist::DataParallel`), placed where it overlaps the backward of earlier layers.
//!
//! Graphs replay back to back on one stream, so work forked inside a layer's backward graph and
//! joined at its end overlaps only that graph. A layer's gradients are therefore reduced at the
//! start of the *next* backward graph (the layer before it), on a stream forked from that
//! capture, and joined at its end, after its sync event (the tail). The last backward graph of
//! the step reduces its own layer too and joins everything before its sync event, so a caller
//! that resumes at the event sees every gradient reduced. Parameters that a module tells final
//! before its backward returns ([`Module::backward_hooked`](crate::nn::Module::backward_hooked))
//! are reduced at once, overlapping the rest of that backward graph; only the rest waits for the
//! next graph. A callable that splits its weight gradients out completes them in its
//! weight-gradient pass, which is then the pass that tells; under a pipeline schedule, a layer's
//! passes of earlier microbatches only accumulate, and those of its last microbatch tell.

use crate::device::{BufferId, Stream};
use crate::nn::{GradHook, Param};
use crate::Result;

/// What a captured pass that accumulates gradients (a backward, or a split weight-gradient pass)
/// calls, in order: [`begin_grad_pass`](GradSync::begin_grad_pass) and
/// [`grads_complete`](GradSync::grads_complete) around the callable's work inside its capture
/// (`grads_complete`, like [`grads_final`](GradSync::grads_final), only in the pass that completes
/// the callable's gradients: its last one, under a schedule its last microbatch's); then, in the
/// step's last such pass only, [`finish`](GradSync::finish) before the sync event; then
/// [`end_pass`](GradSync::end_pass) after it; [`abandon`](GradSync::abandon) when the capture
/// fails. Given with [`GraphOptions::grad_sync`](super::GraphOptions::grad_sync).
pub trait GradSync: Send + Sync {
    /// A pass that accumulates gradients begins on `stream`: work deferred from the passes
    /// before may start, forked from `stream`, to overlap this pass.
    fn begin_grad_pass(&self, stream: &Stream) -> Result<()>;
    /// Inside callable `callable`'s backward (`callable` counts the callables as given, not a
    /// schedule's microbatches of them), `params`' gradients are final once the work
    /// enqueued so far on `stream` is (see [`GradHook`]).
    fn grads_final(&self, callable: usize, params: &[&Param], stream: &Stream) -> Result<()>;
    /// Callable `callable`'s parameter gradients are complete once the work enqueued so far on
    /// `stream` is: its last pass that accumulates them has.
    fn grads_complete(&self, callable: usize, stream: &Stream) -> Result<()>;
    /// The step's last pass that accumulates gradients is about to record its sync event:
    /// everything the caller needs must be joined into `stream` now.
    fn finish(&self, stream: &Stream) -> Result<()>;
    /// A captured pass recorded its sync event: join what was forked into `stream` (the tail).
    fn end_pass(&self, stream: &Stream) -> Result<()>;
    /// The memory the tail writes (the gradients): complete only after the stack's join (R4).
    fn tail_memory(&self) -> Vec<BufferId>;
    /// The capture failed and its graphs are gone: forget what it deferred or forked, so that
    /// the next capture starts as the first did.
    fn abandon(&self);
}

/// What a captured backward of callable `callable` tells its module's [`GradHook`]: passed on
/// to the [`GradSync`].
pub(crate) struct CallableGrads<'a> {
    pub(crate) sync: &'a dyn GradSync,
    pub(crate) callable: usize,
}

impl GradHook for CallableGrads<'_> {
    fn grads_final(&self, params: &[&Param], stream: &Stream) -> Result<()> {
        self.sync.grads_final(self.callable, params, stream)
    }
}
