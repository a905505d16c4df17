//! Lent gradients: a graphed stack's layers lend their parameters' gradient memory to the graph
//! pool while it holds nothing anyone reads (`GraphOptions::lend_gradients`).
//!
//! Note [Lent gradients]: in a training step (forward of layers 0..n, backward of n..0, then the
//! optimizer), layer `i`'s gradients are dead from the optimizer's read to layer `i`'s backward,
//! which writes them; the saved activations of every layer above `i` are born and die in that
//! window. So the pool may place them in layer `i`'s gradient memory instead of growing. PyTorch's
//! graph pools get the same saving the other way round: a backward graph's gradients are outputs
//! in the pool, among the activations freed by the layers above. The rules:
//!
//! - A block allocated while capturing layer `j`'s forward may take memory of layers `i < j`:
//!   whatever it holds (a saved activation, the forward's output) is read at the latest by
//!   backward `j + 1` or `j`, both before backward `i`, and rewritten by the next step's forward
//!   `j` before it is read again.
//! - A block allocated in layer `k`'s backward may take memory of layers `i < k - 1` only: its
//!   static output, layer `k`'s input gradient, is read by backward `k - 1`. Split weight-gradient
//!   passes take none.
//! - A block that dies within its pass may take more (Note [Pass-local blocks] in
//!   `memory/lifetimes.rs`, which says how the pool knows): in a forward, any layer's memory,
//!   the last layer's included (which lends for such blocks alone); in backward `k`, layer
//!   `k - 1`'s too. The backward's transients, cuDNN's scratch among them, and the first
//!   forward's, which no lower layer could hold, leave the pool. The lowest layer's backward
//!   has no lent memory.
//! - Every layer's backward graph begins by zeroing its gradients (lending or not, so that all
//!   behave alike), after which its kernels accumulate as they do without lending; so eager and
//!   graphed steps give the same bits, and a gradient accumulated over several backwards is
//!   lost: one backward per optimizer step. The stack holds the caller to it before anything is
//!   enqueued (`GraphedStack::take_gradients`, called before the optimizer): a forward or a
//!   backward while a backward's gradients wait to be taken, and a take with no backward since
//!   the last, are refused (`LentOrder`). A parameter shared by two layers would accumulate
//!   over both backwards, so it refuses lending; so does a layer that splits its weight
//!   gradients out (`backward_dw`), whose inputs and output gradients, kept for that pass, would
//!   live past the backwards below it, which zero the memory they may lie in.
//! - State a module creates in the recorded pass and keeps across steps must not be lent, since
//!   the next backward would zero it: the warmup makes such state, and a lent block still held
//!   after the capture by anything but a static buffer refuses the capture (`LentState`).
//! - A static output in lent memory is the pool's, not the callable's (as a shared output is,
//!   Note [Shared static outputs]): its `StaticTensor` refuses reads once a backward zeroed it,
//!   and after the static state is released.
//! - The sync-point verification (R2, R3) treats a lent range as the pool's memory, and as no
//!   gradient, in the graphs that may allocate from it: the caller reads no gradient there.
//! - Replays keep the order: the optimizer (on the caller's stream, after the tails' join, R4)
//!   comes before the next forward, which every replay stream waits for (R1).
//! - Gradient work (`grad_sync`: the data-parallel reduction) reads and writes layer `i`'s
//!   gradients on its own stream from backward `i` on, joined before the optimizer (R4). No
//!   later capture of the step may take layer `i`'s memory (backward `k < i` takes only
//!   `i' < k - 1`), and the next step's forwards come after the optimizer.
//!
//! Note [Lent gradients in the warmup]: the warmup runs each layer's passes eagerly, one layer
//! at a time, before the pool holds anything: its peak is the cache's steady memory plus one
//! layer's saved activations and backward transients (cuDNN's scratch among them), which at L
//! was above the captured step's. The gradients it writes are thrown away (the capture
//! restores them), so the warmup may place its blocks in gradient memory too: the cache is lent
//! every lending layer's gradients for the warmup's stream (`CachingAllocator::lend_eager`), and
//! layer `i`'s passes take the memory of every layer but `i`, whose backward writes its own. A
//! block outlives its layer's passes only as an output that feeds layer `i + 1`, which is
//! copied out first if it lies in layer `i + 1`'s memory. The lending ends with the warmup,
//! after a device synchronize; a block still held there then is state a module made in its
//! first pass, which the restored gradients would overwrite: the capture is refused
//! (`WarmupLentState`).

use super::callable::Callable;
use super::graphed::Pass;
use super::options::{GraphOptions, Mode};
use super::output::StaticOutput;
use super::record::Recorded;
use super::GraphedErrorKind;
use crate::device::{ids, with_dtype, Access, AccessMode, BufferId, Stream};
use crate::memory::{CachingAllocator, EagerLending, GraphPool, LentRange, Lifetimes, PoolCapture};
use crate::tensor::Tensor;
use crate::{Error, Result};
use std::collections::HashMap;

/// What a stack's layers lend: per layer, the gradients its backward zeroes first, and the id
/// and flat range of what it lends, if it lends.
pub(crate) struct Lending {
    zeroed: Vec<Vec<Tensor>>,
    lenders: Vec<Option<(usize, Tensor)>>,
}

fn refuse(why: &'static str) -> Error {
    Error::Graphed { callable: "make_graphed_stack".into(), kind: GraphedErrorKind::LendGradients { why } }
}

impl Lending {
    /// The lending `options` ask for over the stack's layers `callables`: `None` unless asked;
    /// refused where it cannot work. Every layer's backward zeroes its gradients first, so that
    /// each backward gives its own, lending or not; a layer lends when its parameters' gradients
    /// are one contiguous range (the last layer's serves blocks that die within a pass only:
    /// Note [Pass-local blocks] in `memory`).
    pub(crate) fn plan(callables: &[&dyn Callable], options: &GraphOptions) -> Result<Option<Lending>> {
        if !options.lend_gradients {
            return Ok(None);
        }
        if options.mode == Mode::Inference {
            return Err(refuse("needs training mode: gradients are lent until the backward that writes them"));
        }
        if options.pool_per_callable {
            return Err(refuse("needs one pool for the stack's layers; drop pool_per_callable"));
        }
        if callables.iter().any(|c| c.splits_dw_dyn()) {
            return Err(refuse(
                "does not combine with split weight gradients: a layer that leaves them to backward_dw keeps what \
                 they read until after the backwards below it zeroed their gradients; graph without one of them",
            ));
        }
        let grads: Vec<Vec<&Tensor>> =
            callables.iter().map(|c| c.parameters_dyn().into_iter().map(|p| &p.grad).collect()).collect();
        let accesses: Vec<Vec<Access>> = (grads.iter())
            .map(|mine| mine.iter().map(|g| g.access(AccessMode::Read)).collect::<Result<_>>())
            .collect::<Result<_>>()?;
        for (i, mine) in accesses.iter().enumerate() {
            if accesses[i + 1..].iter().flatten().any(|g| mine.iter().any(|m| m.overlaps(g))) {
                return Err(refuse(
                    "needs every parameter in one layer: a parameter shared by two layers accumulates over both \
                     backwards, which lending zeroes; graph without lend_gradients",
                ));
            }
        }
        let n = callables.len();
        let mut lending = Lending { zeroed: Vec::with_capacity(n), lenders: Vec::with_capacity(n) };
        for mine in grads {
            let span = span(&mine);
            lending.zeroed.push(match &span {
                Some(all) => vec![all.clone()],
                None => mine.into_iter().cloned().collect(),
            });
            lending.lenders.push(span.map(|all| (ids::next_id() as usize, all)));
        }
        Ok(Some(lending))
    }

    /// Lends every lending layer's gradients to `pool`, closed to every capture until
    /// [`open_for`](Lending::open_for).
    pub(crate) fn lend(&self, pool: &GraphPool) -> Result<()> {
        self.ranges()?.into_iter().for_each(|lent| pool.lend(lent));
        Ok(())
    }

    /// Lends every lending layer's gradients to `alloc`'s cache for the warmup's passes on
    /// `stream`, none open until [`EagerLending::open`] (Note [Lent gradients in the warmup]).
    pub(crate) fn lend_to_warmup<'a>(&self, alloc: &'a CachingAllocator, stream: &Stream) -> Result<EagerLending<'a>> {
        Ok(alloc.lend_eager(stream, self.ranges()?))
    }

    /// What each lending layer lends: its gradients' aligned range.
    fn ranges(&self) -> Result<Vec<LentRange>> {
        let mut ranges = Vec::new();
        for (id, grads) in self.lenders.iter().flatten() {
            with_dtype!(grads.dtype(), T => {
                let buffer = grads.buffer::<T>("make_graphed_stack")?;
                ranges.extend(LentRange::of(*id, buffer, grads.offset()..grads.offset() + grads.numel()));
            });
        }
        Ok(ranges)
    }

    /// Per layer, the bytes it lends (0 for a layer that lends nothing).
    pub(crate) fn lent_bytes(&self) -> Result<Vec<usize>> {
        let ranges = self.ranges()?;
        let of = |id: usize| ranges.iter().filter(|r| r.lender == id).map(|r| r.bytes).sum();
        Ok(self.lenders.iter().map(|l| l.as_ref().map_or(0, |(id, _)| of(*id))).collect())
    }

    /// The lenders whose memory the warmup of layer `i` may take: every layer's but `i`'s, which
    /// its backward writes (Note [Lent gradients in the warmup]).
    pub(crate) fn warmup_lenders(&self, i: usize) -> Vec<usize> {
        (self.lenders.iter().enumerate())
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, l)| l.as_ref().map(|l| l.0))
            .collect()
    }

    /// Whether `t` lies in the memory layer `i` lends.
    pub(crate) fn in_lent_memory(&self, i: usize, t: &Tensor) -> Result<bool> {
        let Some(Some((_, grads))) = self.lenders.get(i) else { return Ok(false) };
        Ok(t.access(AccessMode::Read)?.overlaps(&grads.access(AccessMode::Read)?))
    }

    fn ids(&self) -> Vec<usize> {
        self.lenders.iter().flatten().map(|(id, _)| *id).collect()
    }

    /// Gives back what the layers lent to `pool` (a failed capture: no graph uses it).
    pub(crate) fn give_back(&self, pool: &GraphPool) {
        pool.give_back_lent(Some(&self.ids()));
    }

    /// The capture succeeded: `pool` keeps what the layers lent until none of its graphs can run.
    pub(crate) fn unpin(&self, pool: &GraphPool) {
        pool.unpin_lent(&self.ids());
    }

    /// The lenders whose memory the capture of layer `i`'s `pass` may take (Note [Lent
    /// gradients]).
    pub(crate) fn lenders(&self, i: usize, pass: Pass) -> Vec<usize> {
        let below = match pass {
            Pass::Forward => i,
            Pass::Backward => i.saturating_sub(1),
            Pass::BackwardDw => 0,
        };
        self.lenders[..below.min(self.lenders.len())].iter().flatten().map(|(id, _)| *id).collect()
    }

    /// The lenders whose memory a block that dies within the capture of layer `i`'s `pass` may
    /// take besides [`lenders`](Lending::lenders)' (Note [Pass-local blocks] in `memory`): every
    /// layer's gradients are dead during a forward, and layer `i - 1`'s during backward `i`,
    /// which writes only its own. Split weight-gradient passes take none.
    pub(crate) fn wide(&self, i: usize, pass: Pass) -> Vec<usize> {
        let n = self.lenders.len();
        let range = match pass {
            Pass::Forward => i.min(n)..n,
            Pass::Backward => i.saturating_sub(1).min(n)..i.min(n),
            Pass::BackwardDw => 0..0,
        };
        self.lenders[range].iter().flatten().map(|(id, _)| *id).collect()
    }

    /// Opens the pool's lent memory to `cap`, the capture of layer `i`'s `pass`.
    pub(crate) fn open_for(&self, cap: &PoolCapture<'_>, i: usize, pass: Pass) {
        cap.open_lent(&self.lenders(i, pass));
    }

    /// Zeroes layer `i`'s gradients on `stream`: the first work of its backward graph.
    pub(crate) fn zero(&self, i: usize, stream: &Stream) -> Result<()> {
        self.zeroed.get(i).into_iter().flatten().try_for_each(|g| g.zero(stream))
    }

    /// After the recording: refuses lent memory that something other than a static buffer
    /// still holds, and makes the static outputs in lent memory the pool's (Note [Lent
    /// gradients]).
    pub(crate) fn seal(alloc: &CachingAllocator, pool: &GraphPool, recorded: &mut Recorded) -> Result<()> {
        let statics: Vec<BufferId> = (recorded.inputs.iter().flat_map(|x| x.iter().map(|x| x.tensor.id())))
            .chain(recorded.outputs.iter().flatten().map(|y| y.tensor().id()))
            .chain(recorded.grad_inputs.iter().flatten().flatten().map(|d| d.tensor().id()))
            .collect();
        let held: usize = (alloc.blocks().into_iter())
            .filter(|b| b.lent && b.pool == Some(pool.id()))
            .filter(|b| b.buffer.is_some_and(|id| !statics.contains(&id)))
            .map(|b| b.info.size)
            .sum();
        if held > 0 {
            let kind = GraphedErrorKind::LentState { bytes: held };
            return Err(Error::Graphed { callable: "make_graphed_stack".into(), kind });
        }
        let lent = |t: &Tensor| alloc.block_of(t.id()).is_some_and(|b| b.lent);
        let share = |y: StaticOutput| if lent(y.tensor()) { y.share(alloc, pool) } else { Ok(y) };
        for outputs in &mut recorded.outputs {
            *outputs = std::mem::take(outputs).into_iter().map(share).collect::<Result<_>>()?;
        }
        for grads in &mut recorded.grad_inputs {
            *grads = std::mem::take(grads).into_iter().map(|d| d.map(share).transpose()).collect::<Result<_>>()?;
        }
        Ok(())
    }
}

/// What the warmup learned of each pass's allocations (Note [Pass-local blocks] in `memory`),
/// by layer and pass; nothing unless gradients are lent.
pub(crate) struct Learned {
    on: bool,
    passes: HashMap<(usize, Pass), Lifetimes>,
}

impl Learned {
    /// Learns when `on` (the stack lends its gradients).
    pub(crate) fn new(on: bool) -> Learned {
        Learned { on, passes: HashMap::new() }
    }

    /// Runs `f`, layer `i`'s own work in its warmup `pass` on `stream`, learning its
    /// allocations.
    pub(crate) fn learn<T>(
        &mut self,
        alloc: &CachingAllocator,
        stream: &Stream,
        (i, pass): (usize, Pass),
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if !self.on {
            return f();
        }
        let learning = alloc.learn(stream);
        let out = f()?;
        self.passes.insert((i, pass), learning.finish()?);
        Ok(out)
    }

    /// Runs `f`, layer `i`'s own work in its captured `pass` on `stream`, with `pool` expecting
    /// the allocations the warmup learned for it, so that those the warmup freed may take the
    /// lenders [`Lending::wide`] names; refuses the capture if any of them outlived the pass.
    pub(crate) fn expect<T>(
        &self,
        lending: Option<&Lending>,
        (pool, stream): (&GraphPool, &Stream),
        (i, pass): (usize, Pass),
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let (Some(lending), Some(lifetimes)) = (lending, self.passes.get(&(i, pass))) else { return f() };
        pool.expect(stream, lifetimes, &lending.wide(i, pass));
        let out = f();
        let held = pool.end_expect();
        let out = out?;
        if held > 0 {
            let kind = GraphedErrorKind::PassLocalHeld { bytes: held };
            return Err(Error::Graphed { callable: "make_graphed_stack".into(), kind });
        }
        Ok(out)
    }
}

/// Gradients of one layer's parameters as one flat view, if they are one contiguous range of one
/// buffer.
fn span(grads: &[&Tensor]) -> Option<Tensor> {
    let mut grads = grads.to_vec();
    grads.sort_by_key(|g| g.offset());
    let first = *grads.first()?;
    let mut end = first.offset();
    for g in &grads {
        if g.id() != first.id() || !g.is_contiguous() || g.offset() != end {
            return None;
        }
        end += g.numel();
    }
    first.flat(first.offset()..end).ok()
}
