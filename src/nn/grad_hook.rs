//! Parameter gradients that become final before a backward returns, so that work on them (the
//! data-parallel reduction, `dist::DataParallel`) can start while the rest of the backward runs:
//! PyTorch's post-accumulate-grad hooks, told by the module that knows its own order.

use super::Param;
use crate::device::Stream;
use crate::Result;

/// Hears, during [`Module::backward_hooked`](super::Module::backward_hooked), that parameters'
/// gradients are final for this backward (every accumulation into them is enqueued on `stream`)
/// before the backward returns. A module tells only what is final early; the caller treats the
/// rest as final when the backward returns.
pub trait GradHook: Sync {
    /// `params`' gradients are complete once the work enqueued so far on `stream` is.
    fn grads_final(&self, params: &[&Param], stream: &Stream) -> Result<()>;
}

/// The hook that hears nothing: what [`Module::backward`](super::Module::backward) uses.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoGradHook;

impl GradHook for NoGradHook {
    fn grads_final(&self, _params: &[&Param], _stream: &Stream) -> Result<()> {
        Ok(())
    }
}
