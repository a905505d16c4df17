//! A graphed callable's static outputs (its forward's outputs, its backward's input gradients)
//! as it holds them: its own buffers, or memory its pool shares with later graphs.
//!
//! Note [Shared static outputs]: under a schedule with buffer reuse
//! ([`GraphOptions::reuse_buffers`](super::GraphOptions::reuse_buffers)), the output of a layer
//! that is not its chunk's last is read once per replay: by the copy into the static input of
//! the chunk's next layer for the same microbatch, which the caller enqueues just before that
//! layer's forward graph, the next graph of the pool's order (R5). Likewise the input gradient of
//! a layer that is not its chunk's first is read by the copy into the static output gradient of
//! the layer before it, just before that layer's backward graph. So the capture gives such an
//! output's memory back to the pool right before it captures that next graph: graphs captured
//! from then on (and the next microbatch's forward of the same layer) reuse it, and the pool's
//! peak drops by what the outputs would have held. The capture's own references decide when
//! the memory really goes back: a module that keeps its output for its backward (in its saved
//! context) holds it until its backward is captured. Chunk boundaries are never shared: what
//! crosses them goes to the head, to a later step of the schedule or to another pipeline stage,
//! whose exchange may still read it on its own stream while later graphs run.
//!
//! At replay, a shared output is valid from the graph that wrote it until the first later graph
//! of the pool that writes its memory. [`StaticTensor`](super::StaticTensor) already follows
//! every graph that writes an output's memory (computed from the checker's summary of each
//! capture), so a read after such a graph is refused (`StaleOutput`, naming that graph) rather
//! than silently reading the later graph's data, and the pool refuses a replay out of its order
//! (`PoolOrder`). A shared output's memory may also be free when the capture ends, and a later
//! capture into the same pool may be given it, which no summary of this capture shows: for a
//! shared output, every graph captured into the pool afterwards counts as a writer too. The callable owns nothing of a shared output: releasing its static state drops
//! the handle and frees nothing, the pool keeps the memory (its blocks go back to the device when
//! no graph of the pool can run and the pool is trimmed), and a `StaticTensor` made from it then
//! refuses to be read (`OutputReleased`), since the memory may serve another capture.

use std::sync::{Arc, Weak};

use crate::memory::CachingAllocator;
use crate::memory::GraphPool;
use crate::tensor::Tensor;
use crate::Result;

/// A static output of a graphed callable: an output of its forward or an input gradient of its
/// backward.
pub(crate) enum StaticOutput {
    /// The callable's own buffer: no other graph of the pool uses its memory, releasing the
    /// static state drops it, and a [`StaticTensor`](super::StaticTensor) still held keeps it
    /// (and its values).
    Owned(Tensor),
    /// Memory that the pool shares with later graphs (Note [Shared static outputs]).
    Shared(SharedOutput),
}

/// The non-owning handle of a shared static output (Note [Shared static outputs]). The graph
/// pool owns the memory: the capture gave it back when the last owning reference dropped, and
/// the pool frees it with the rest of its memory. Dropping this handle, as releasing the
/// callable's static state does, frees nothing; it ends the reads of every
/// [`StaticTensor`](super::StaticTensor) made from it.
pub(crate) struct SharedOutput {
    /// A view of the memory that does not own it ([`Tensor::alias`]).
    alias: Tensor,
    /// Held only here: `StaticTensor`s made from the output hold it weakly, so that they refuse
    /// reads once the handle is dropped.
    alive: Arc<()>,
}

impl StaticOutput {
    /// The buffer (a non-owning view when shared).
    pub(crate) fn tensor(&self) -> &Tensor {
        match self {
            StaticOutput::Owned(t) => t,
            StaticOutput::Shared(s) => &s.alias,
        }
    }

    /// Whether its memory is shared with later graphs of the pool.
    pub(crate) fn is_shared(&self) -> bool {
        matches!(self, StaticOutput::Shared(_))
    }

    /// What a `StaticTensor` of it checks before a read: `None` for an owned output, which stays
    /// readable as long as the `StaticTensor` holds it.
    pub(crate) fn lent(&self) -> Option<Weak<()>> {
        match self {
            StaticOutput::Owned(_) => None,
            StaticOutput::Shared(s) => Some(Arc::downgrade(&s.alive)),
        }
    }

    /// The output shared with the graphs of `pool` captured from now on, if its memory is a block
    /// of `pool` (an output that is a view of an input, a parameter or memory outside the pool
    /// stays owned): the owning handle is dropped, so the block goes back to the pool unless
    /// something of the capture still holds it (a saved context, until its backward).
    pub(crate) fn share(self, alloc: &CachingAllocator, pool: &GraphPool) -> Result<StaticOutput> {
        let StaticOutput::Owned(t) = self else { return Ok(self) };
        if alloc.block_of(t.id()).and_then(|b| b.pool) != Some(pool.id()) {
            return Ok(StaticOutput::Owned(t));
        }
        let alias = t.alias()?;
        Ok(StaticOutput::Shared(SharedOutput { alias, alive: Arc::new(()) }))
    }
}
