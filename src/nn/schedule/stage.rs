//! Where a rank's chunks sit in a pipeline of ranks, and how tensors cross between stages.

use super::error::refuse;
use super::ScheduleErrorKind;
use crate::tensor::Tensor;
use crate::Result;

/// Where a rank's chunks sit in a pipeline of ranks: with `count` stages, chunk k of stage s
/// is the model's chunk k·count + s (Megatron-LM's interleaved placement), so activations go
/// from stage s to s + 1 and from the last stage back to the first between a rank's chunks.
/// [`Stage::single`] holds the whole model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    index: usize,
    count: usize,
}

impl Stage {
    /// One stage that holds every chunk: nothing crosses ranks.
    pub fn single() -> Stage {
        Stage { index: 0, count: 1 }
    }

    /// Stage `index` of `count`.
    ///
    /// # Errors
    /// [`ScheduleErrorKind::NoSuchStage`] for no stages or an index outside them.
    pub fn new(index: usize, count: usize) -> Result<Stage> {
        if index >= count {
            return refuse(ScheduleErrorKind::NoSuchStage { index, count });
        }
        Ok(Stage { index, count })
    }

    /// Its index among the stages.
    pub fn index(self) -> usize {
        self.index
    }

    /// How many stages the pipeline has.
    pub fn count(self) -> usize {
        self.count
    }

    /// The model's chunk that the rank's chunk `chunk` is.
    pub fn model_chunk(self, chunk: usize) -> usize {
        chunk * self.count + self.index
    }

    /// The model's layers the stage holds, in its chunks' order, when every chunk has
    /// `per_chunk` layers and the stage `chunks` chunks: what it builds and graphs.
    pub fn model_layers(self, chunks: usize, per_chunk: usize) -> Vec<usize> {
        (0..chunks).flat_map(|k| (0..per_chunk).map(move |i| self.model_chunk(k) * per_chunk + i)).collect()
    }

    /// The stage activations come from.
    pub fn prev(self) -> usize {
        (self.index + self.count - 1) % self.count
    }

    /// The stage activations go to.
    pub fn next(self) -> usize {
        (self.index + 1) % self.count
    }
}

/// How activations and gradients cross between pipeline stages (`dist::P2pLinks` over a
/// communicator): between two steps of a schedule, the sends of the step before and the receive
/// of the step after, as one group, so that neighbours sending to each other meet.
///
/// Links may run their exchanges off the stage's stream, so that they overlap the passes that do
/// not read what they receive: the traversal calls [`wait`](StageLinks::wait) before a pass
/// reads a received tensor, and [`join`](StageLinks::join) when the step ends, failed or not.
pub trait StageLinks {
    /// Exchange number `index` of the rank's step (the same on every step, so that a graphed
    /// implementation replays what it captured): sends each `(stage, tensor)` of `sends` and
    /// receives one tensor of the boundary's shape from each stage of `recvs`, returned in order.
    fn exchange(&mut self, index: usize, sends: &[(usize, Tensor)], recvs: &[usize]) -> Result<Vec<Tensor>>;

    /// A pass on the stage's stream is about to read what exchange `index` of this step
    /// received: order the stream after it. Links that exchange on the stage's stream have
    /// nothing to do (the default).
    fn wait(&mut self, index: usize) -> Result<()> {
        let _ = index;
        Ok(())
    }

    /// The step's last exchange is enqueued: order the stage's stream after every exchange of
    /// the step, sends included. The default has nothing to do.
    fn join(&mut self) -> Result<()> {
        Ok(())
    }
}
