//! Data parallelism's gradient reduction on graphs of its own, ordered by typed edges.
//!
//! Inside the backward graphs ([`DataParallel`] as a capture's `grad_sync`), a layer's
//! reduction is forked in the next backward graph and joined at its end, so it overlaps that
//! one graph. Here each bucket's reduction is a graph of its own, replayed on the communication
//! stream, that waits through a [`GraphEdge`] on the pass that completes the bucket's gradients
//! (its callable's backward, or its weight-gradient pass). Its all-reduce may then run beside
//! every backward after that one, and the caller's stream waits only once, before the
//! optimizer. Megatron-LM wires such events between its graphs by hand; here the edge is
//! declared at capture, recorded after the producer's last write, and a reduction replayed
//! without a new backward is refused before anything is enqueued.

use super::DataParallel;
use crate::device::{CommErrorKind, Stream};
use crate::graph::{make_graphed_fn_with_edges, Edges, GraphEdge, GraphOptions, GraphedFn};
use crate::memory::CachingAllocator;
use crate::{Error, Result};
use std::sync::Arc;

/// One graph per gradient bucket of a [`DataParallel`], each reducing its bucket after the pass
/// that completes it, on the communication stream.
///
/// ```
/// use graphed::device::{CommOptions, SimConfig};
/// use graphed::dist::{on_sim_ranks, DataParallel, ReductionGraphs};
/// use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Layers, ParamStore, Stack, TransformerLayer};
/// use graphed::tensor::Tensor;
///
/// let grads = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |comm| {
///     let (alloc, s) = (CachingAllocator::new(comm.device()), comm.device().stream()?);
///     let store = ParamStore::new(&alloc, &s, 2 * TransformerLayer::parameter_count(32))?;
///     let stack = Stack::new(TransformerLayer::stack(&Builder::new(&store, &alloc, &s)?, (32, 1), &Layers::first(2))?);
///     let x = Tensor::from_host(&alloc, &s, &vec![comm.rank() as f32; 128], &[1, 4, 32])?;
///     let reduce = ReductionGraphs::capture(&alloc, DataParallel::for_stack(comm, &store, &stack)?)?;
///     let graphed = make_graphed_stack(&alloc, &stack, &x, reduce.signalled(GraphOptions::default()))?;
///     graphed.forward(&s, &x, Replay::caller())?;
///     graphed.backward(&s, &x)?;
///     reduce.replay(&s)?; // each layer's reduction after its backward, then the join
///     graphed.join(&s)?;
///     assert!(reduce.replay(&s).is_err()); // no backward since: refused
///     store.grads()?.to_vec::<f32>(&s)
/// });
/// let (a, b) = (grads[0].as_ref().unwrap(), grads[1].as_ref().unwrap());
/// assert_eq!(a, b); // both ranks hold the mean
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct ReductionGraphs {
    dp: DataParallel,
    /// Per bucket, the edge its callable's gradient pass records and the graph that waits on it.
    buckets: Vec<(GraphEdge, GraphedFn)>,
}

impl ReductionGraphs {
    /// Captures a graph per bucket of `dp` (in new pools of `alloc`) that waits on an edge of its
    /// own and then reduces the bucket as `dp` does (averaged or summed). Give the captures of the
    /// callables [`signalled`](Self::signalled) options. Nothing runs. Under a pipeline schedule,
    /// whose passes take no edges, reduce inside the backward graphs instead
    /// ([`GraphOptions::grad_sync`]).
    ///
    /// # Errors
    /// [`CommErrorKind::ReducedTwice`] when `dp` is held elsewhere (a capture's `grad_sync` would
    /// reduce the gradients a second time), before anything is captured; capture errors, after
    /// which nothing is left behind.
    pub fn capture(alloc: &CachingAllocator, dp: Arc<DataParallel>) -> Result<ReductionGraphs> {
        let rank = dp.comm().rank();
        let dp = Arc::try_unwrap(dp).map_err(|held| Error::Comm {
            op: "ReductionGraphs::capture",
            rank,
            kind: CommErrorKind::ReducedTwice { holders: Arc::strong_count(&held) - 1 },
        })?;
        let dev = dp.comm().device().clone();
        let buckets = (dp.bucket_grads().enumerate())
            .map(|(i, grads)| {
                let edge = GraphEdge::new(&dev, &format!("gradients of callable {i}"))?;
                let waits = Edges { waits_on: &[&edge], ..Edges::default() };
                let graph = make_graphed_fn_with_edges(alloc, waits, |s| dp.all_reduce(s, grads))?;
                Ok((edge, graph.with_name(&format!("reduction of callable {i}'s gradients"))))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ReductionGraphs { dp, buckets })
    }

    /// `options` with callable `i`'s gradient pass recording bucket `i`'s edge, for the capture
    /// of the callables the buckets were made for.
    pub fn signalled(&self, options: GraphOptions) -> GraphOptions {
        self.buckets.iter().enumerate().fold(options, |o, (i, (edge, _))| o.signals_gradients(i, edge))
    }

    /// Replays every bucket's reduction on the communication stream, in the order the backward
    /// completes them (the last callable's first), each after its edge's record; then `caller`
    /// waits for them all, so that the optimizer enqueued next reads reduced gradients. Call it
    /// once per step, after the backward (or the last microbatch's, when they accumulate) is
    /// enqueued: nothing else reduces the gradients, and a step without it leaves each rank
    /// with its own.
    ///
    /// # Errors
    /// [`GraphedErrorKind::EdgeNotProduced`](crate::graph::GraphedErrorKind::EdgeNotProduced)
    /// when a bucket's gradient pass has not been replayed since its last reduction, before
    /// anything is enqueued; launch errors.
    pub fn replay(&self, caller: &Stream) -> Result<()> {
        for (edge, graph) in &self.buckets {
            edge.check_produced().map_err(|kind| GraphEdge::error(graph.name(), kind))?;
        }
        let comm = self.dp.comm_stream();
        for (_, graph) in self.buckets.iter().rev() {
            graph.replay(comm)?;
        }
        caller.wait_stream(comm)
    }

    /// The reduction the graphs run.
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
    }
}
