//! One entry of a schedule.

use std::fmt;
use std::ops::Range;

/// One entry of a schedule: a pass of a chunk (0-based) for the chunk's next microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// The forward of every layer of the chunk, in order.
    Forward(usize),
    /// The backward (data gradients, and weight gradients unless split) of every layer of the
    /// chunk, last layer first.
    Backward(usize),
    /// The split weight-gradient pass of the chunk, for its oldest backward without one.
    WeightGrad(usize),
}

impl Step {
    /// The chunk it runs.
    pub fn chunk(self) -> usize {
        match self {
            Step::Forward(k) | Step::Backward(k) | Step::WeightGrad(k) => k,
        }
    }

    /// `layers`, its chunk's, in the order it runs them: in order for a forward, last first
    /// otherwise. The traversal and the capture both follow it, so that replays meet the pool's
    /// capture order.
    pub(crate) fn layer_order(self, layers: Range<usize>) -> impl Iterator<Item = usize> {
        let (forward, start, end) = (matches!(self, Step::Forward(_)), layers.start, layers.end);
        layers.map(move |l| if forward { l } else { start + end - 1 - l })
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Forward(k) => write!(f, "F{k}"),
            Step::Backward(k) => write!(f, "B{k}"),
            Step::WeightGrad(k) => write!(f, "W{k}"),
        }
    }
}
