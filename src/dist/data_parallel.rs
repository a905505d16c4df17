//! Data parallelism: every rank runs the whole model on its own microbatch, and the parameter
//! gradients are summed across ranks before the optimizer step.
//!
//! Inside graphs, each layer's gradients are one bucket (a contiguous slice of the flat gradient
//! buffer) reduced on a communication stream forked into the next backward graph, so the
//! reduction overlaps the backward of the layer before (see [`GradSync`]). Two ranks with one
//! microbatch each then hold the gradients one rank accumulates over both (a sum of two f32 values
//! is exact to order), so the optimizer steps are equal bit for bit.

use std::sync::{Arc, Mutex};

use crate::device::CommErrorKind;
use crate::device::{with_dtype, BufferId, Communicator, Stream};
use crate::graph::GradSync;
use crate::nn::{Module, ParamStore, Stack};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The gradient reduction of data parallelism, for one rank: give it to
/// [`GraphOptions::grad_sync`](crate::graph::GraphOptions::grad_sync) to reduce inside the
/// captured backward passes, or call [`all_reduce`](DataParallel::all_reduce) eagerly.
pub struct DataParallel {
    comm: Communicator,
    /// The communication stream, forked from the backward passes.
    stream: Stream,
    /// Per graphed callable, its gradients as one flat tensor.
    buckets: Vec<Tensor>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Callables whose gradients are complete but not yet reduced.
    pending: Vec<usize>,
    /// Whether the communication stream was forked from the pass being captured.
    forked: bool,
}

impl DataParallel {
    /// The reduction over `comm` of `buckets[i]`, the gradients of graphed callable `i` (see
    /// [`ParamStore::grads_of`](crate::nn::ParamStore::grads_of)).
    ///
    /// # Errors
    /// A bucket of another device, or a stream that cannot be made.
    pub fn new(comm: &Communicator, buckets: Vec<Tensor>) -> Result<Arc<DataParallel>> {
        for b in &buckets {
            comm.device().check_same("DataParallel::new", "gradient bucket", b.device_id())?;
        }
        let stream = comm.device().stream()?;
        Ok(Arc::new(DataParallel { comm: comm.clone(), stream, buckets, state: Mutex::default() }))
    }

    /// The reduction of a graphed stack's gradients, one bucket per layer of `stack`, whose
    /// parameters live in `store`.
    ///
    /// # Errors
    /// As [`new`](DataParallel::new), and [`ParamStore::grads_of`]'s when a layer's parameters
    /// are not one contiguous range of `store`.
    pub fn for_stack<M: Module>(
        comm: &Communicator,
        store: &ParamStore,
        stack: &Stack<M>,
    ) -> Result<Arc<DataParallel>> {
        let buckets = stack.layers().iter().map(|l| store.grads_of(&l.parameters())).collect::<Result<_>>()?;
        DataParallel::new(comm, buckets)
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// Sums `grads` across ranks on `stream`, now (eager parts of the model, or every gradient
    /// of an eager step).
    pub fn all_reduce(&self, stream: &Stream, grads: &Tensor) -> Result<()> {
        with_dtype!(grads.dtype(), T => self.comm.all_reduce(stream, grads.view::<T>()?))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forks the communication stream from `stream` and reduces every pending bucket on it.
    fn reduce_pending(&self, stream: &Stream) -> Result<()> {
        let mut st = self.lock();
        if st.pending.is_empty() {
            return Ok(());
        }
        self.stream.wait_stream(stream)?;
        st.forked = true;
        for i in std::mem::take(&mut st.pending) {
            let Some(bucket) = self.buckets.get(i) else {
                let what = format!("graphed callable {i} has no gradient bucket; pass one per callable");
                return Err(Error::Comm {
                    op: "DataParallel",
                    rank: self.comm.rank(),
                    kind: CommErrorKind::Length { what },
                });
            };
            self.all_reduce(&self.stream, bucket)?;
        }
        Ok(())
    }

    fn join(&self, stream: &Stream) -> Result<()> {
        let mut st = self.lock();
        if st.forked {
            stream.wait_stream(&self.stream)?;
            st.forked = false;
        }
        Ok(())
    }
}

impl GradSync for DataParallel {
    fn begin_backward(&self, stream: &Stream) -> Result<()> {
        self.reduce_pending(stream)
    }

    fn end_backward(&self, callable: usize, _stream: &Stream) -> Result<()> {
        self.lock().pending.push(callable);
        Ok(())
    }

    fn finish(&self, stream: &Stream) -> Result<()> {
        self.reduce_pending(stream)?;
        self.join(stream)
    }

    fn end_pass(&self, stream: &Stream) -> Result<()> {
        self.join(stream)
    }

    fn abandon(&self) {
        let mut st = self.lock();
        st.pending.clear();
        st.forked = false;
    }

    fn tail_memory(&self) -> Vec<BufferId> {
        self.buckets.iter().filter_map(|b| b.access(crate::device::AccessMode::Read).ok()).map(|a| a.memory).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CommOptions, DType, SimConfig};
    use crate::memory::CachingAllocator;

    #[test]
    fn an_abandoned_capture_leaves_nothing_deferred_or_forked() {
        let out = crate::dist::on_sim_ranks(1, SimConfig::default(), CommOptions::default(), |c| {
            let (alloc, s) = (CachingAllocator::new(c.device()), c.device().stream()?);
            let dp = DataParallel::new(c, vec![Tensor::zeros(&alloc, &s, &[4], DType::F32)?])?;
            dp.end_backward(0, &s)?;
            dp.begin_backward(&s)?;
            dp.end_backward(0, &s)?;
            let state = |dp: &DataParallel| {
                let st = dp.lock();
                (st.pending.clone(), st.forked)
            };
            let before = state(&dp);
            dp.abandon();
            let after = state(&dp);
            s.synchronize()?;
            Ok((before, after))
        });
        let (before, after) = out.into_iter().next().expect("one rank").expect("rank 0 ran");
        assert_eq!(before, (vec![0], true), "the capture deferred a bucket and forked");
        assert_eq!(after, (Vec::new(), false), "abandon forgets both");
    }
}
