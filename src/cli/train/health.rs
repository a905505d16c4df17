//! Signs that a run went wrong: a step whose gradients were not finite, or whose loss was not
//! although its gradients were, stops it (unless `--on-nonfinite skip`); a loss that diverges
//! is warned of once.

use graphed::device::Stream;
use graphed::optim::AdamW;
use graphed::Error;

use crate::cli::args::NonFiniteArg;

/// Why a run stopped on a value that is not finite.
#[derive(Debug, thiserror::Error)]
pub enum NonFiniteStop {
    /// The optimizer found a gradient that is not finite at `step` (counted from 0, as the run's
    /// lines) and updated nothing from then on.
    #[error(
        "step {step} had a gradient that is not finite (the first in `{param}`): the run stopped with the \
         parameters of the step before it and saved nothing after it; lower --lr (or check the data) and resume \
         from the last checkpoint, or pass --on-nonfinite skip to skip such steps"
    )]
    Gradient { step: u64, param: String },
    /// The reported loss of `step` is not finite although every gradient was.
    #[error("the loss of step {step} is {loss} although every gradient was finite; lower --lr, or check the data")]
    Loss { step: usize, loss: f64 },
}

/// Fails, naming the first step whose gradients were not finite, unless `policy` skips such
/// steps (the optimizer kept the parameters of the last good step either way).
pub fn gradients(optimizer: &AdamW, s: &Stream, policy: NonFiniteArg) -> anyhow::Result<()> {
    if policy == NonFiniteArg::Skip {
        return Ok(());
    }
    match optimizer.check_finite(s) {
        // The optimizer counts its steps from 1, the run's lines from 0.
        Err(Error::NonFinite { step, param, .. }) => {
            Err(NonFiniteStop::Gradient { step: step.saturating_sub(1), param }.into())
        }
        other => Ok(other?),
    }
}

/// Fails when the loss reported at `step` is not finite, unless `policy` skips non-finite steps.
pub fn loss(step: usize, loss: f64, policy: NonFiniteArg) -> Result<(), NonFiniteStop> {
    match loss.is_finite() || policy == NonFiniteArg::Skip {
        true => Ok(()),
        false => Err(NonFiniteStop::Loss { step, loss }),
    }
}

/// Watches the reported losses for a run that diverges (a learning rate too high for the model),
/// which is finite for a while and then not.
#[derive(Default)]
pub struct Divergence {
    /// The lowest loss reported so far, and its step.
    best: Option<(usize, f64)>,
    warned: bool,
}

impl Divergence {
    /// A warning, once, when `loss` at `step` is ten times the lowest reported loss and above it
    /// by more than 1 (noise at a low loss is not divergence).
    pub fn observe(&mut self, step: usize, loss: f64) -> Option<String> {
        let (at, best) = *self.best.get_or_insert((step, loss));
        if loss < best {
            self.best = Some((step, loss));
            return None;
        }
        if self.warned || loss < 10.0 * best || loss < best + 1.0 {
            return None;
        }
        self.warned = true;
        Some(format!(
            "the loss rose from {best:.4} at step {at} to {loss:.4} at step {step}: training diverges; lower --lr"
        ))
    }
}
