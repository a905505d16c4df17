//! Data parallelism: every rank runs the whole model on its own microbatch, and the parameter
//! gradients are averaged across ranks before the optimizer step (or summed: [`GradReduction`]).
//!
//! Inside graphs, each layer's gradients are one bucket (a contiguous slice of the flat gradient
//! buffer) reduced on a communication stream forked from the backward graphs: the parameters a
//! module tells final early (a transformer layer's MLP half) at once, overlapping the rest of its
//! backward, and the rest in the next backward graph, overlapping the layer before (see
//! [`GradSync`]). Two ranks with one microbatch each then hold the gradients one rank
//! accumulates over both (a sum of two f32 values is exact to order), so the optimizer steps are
//! equal bit for bit; averaged, those gradients halved, which is exact too (see
//! [`GradReduction::Mean`] for other world sizes). [`ReductionGraphs`](super::ReductionGraphs)
//! reduces the same buckets on graphs of their own instead, after typed edges from the backward.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::device::CommErrorKind;
use crate::device::{with_dtype, Access, AccessMode, BufferId, Communicator, DType, Stream};
use crate::graph::{Callable, GradSync};
use crate::nn::{Module, Param, ParamStore, Stack};
use crate::ops::elementwise::scale;
use crate::ops::with_float;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// How data parallelism combines the ranks' gradients.
///
/// Note [Where the mean divides]: the mean is the sum multiplied by `1/world` (rounded to f32
/// once), in place, on the communication stream right after each bucket's all-reduce, inside
/// the same graph (a `scale` kernel the checker sees like any other). It then equals bit for bit
/// one rank that accumulates every rank's microbatch and scales the sum the same way, for any
/// world size, wherever the sum does (on the simulator, which adds in rank order, always; on
/// GPUs, for two ranks, whose one addition is exact to order). For a world that is a power of
/// two, the scaling is exact (barring underflow below f32's normal range), so the mean also
/// equals one rank whose loss is the whole batch's mean (its output gradients divided by the
/// world), since a backward is linear in its output gradient and halving commutes with every
/// rounding. For other worlds (3 ranks, 6, ...) `1/world` is not a power of two and the mean is
/// one rounding away from that: there [`Sum`](GradReduction::Sum) with every rank's loss
/// weighed by the whole batch (the loss's `1/world` in its weights, as Megatron-LM's per-token
/// loss does) is the exact one, as `graphed train --grad-reduce sum` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradReduction {
    /// The mean over the ranks, as PyTorch's DDP and Megatron-LM average: each rank's loss is the
    /// mean over its own microbatch, and the step is that of the whole batch's mean loss.
    #[default]
    Mean,
    /// The sum over the ranks: what one rank accumulating every rank's microbatch holds, for a
    /// loss that each rank already weighs by the whole batch (or a learning rate meant for it).
    Sum,
}

impl GradReduction {
    /// Its name on the command line: `mean` or `sum`.
    pub fn name(self) -> &'static str {
        match self {
            GradReduction::Mean => "mean",
            GradReduction::Sum => "sum",
        }
    }
}

impl std::fmt::Display for GradReduction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The gradient reduction of data parallelism, for one rank: give it to
/// [`GraphOptions::grad_sync`](crate::graph::GraphOptions::grad_sync) to reduce inside the
/// captured backward passes, or call [`all_reduce`](DataParallel::all_reduce) eagerly. It
/// averages the gradients unless made to sum them ([`with_reduction`](DataParallel::with_reduction)).
pub struct DataParallel {
    comm: Communicator,
    /// Mean or sum.
    reduction: GradReduction,
    /// The communication stream, forked from the backward passes.
    stream: Stream,
    /// Per graphed callable, its gradients.
    buckets: Vec<Bucket>,
    /// The buckets' memory, which the reductions write in the tail.
    memory: Vec<BufferId>,
    state: Mutex<State>,
}

/// One graphed callable's gradients.
#[derive(Clone)]
struct Bucket {
    /// As one flat tensor.
    grads: Tensor,
    /// Each parameter's range of `grads`, by name; empty when not known, and then the whole
    /// bucket is reduced after the backward, whatever the module tells early.
    params: Vec<(String, Range<usize>)>,
}

#[derive(Default)]
struct State {
    /// Ranges of callables' buckets whose gradients are complete but not yet reduced.
    pending: Vec<(usize, Range<usize>)>,
    /// Ranges of callables' buckets reduced during the backward being captured.
    early: Vec<(usize, Range<usize>)>,
    /// Whether the communication stream was forked from the pass being captured.
    forked: bool,
}

impl State {
    /// What callable `callable`'s backward has reduced so far.
    fn early_of(&self, callable: usize) -> Vec<Range<usize>> {
        self.early.iter().filter(|(i, _)| *i == callable).map(|(_, r)| r.clone()).collect()
    }
}

impl DataParallel {
    /// The reduction over `comm` of `buckets[i]`, the gradients of graphed callable `i` (see
    /// [`ParamStore::grads_of`](crate::nn::ParamStore::grads_of)), each reduced whole after its
    /// callable's backward, averaged over the ranks. [`for_callables`](DataParallel::for_callables) and
    /// [`for_stack`](DataParallel::for_stack) know the parameters, and reduce those a module
    /// tells final early at once.
    ///
    /// # Errors
    /// A bucket of another device, buckets that overlap (a gradient in two would be summed
    /// twice), or a stream that cannot be made.
    pub fn new(comm: &Communicator, buckets: Vec<Tensor>) -> Result<Arc<DataParallel>> {
        DataParallel::with_buckets(
            comm,
            buckets.into_iter().map(|grads| Bucket { grads, params: Vec::new() }).collect(),
            GradReduction::Mean,
        )
    }

    /// The same reduction over the same buckets, combining the gradients as `reduction` says:
    /// a new one (with a communication stream of its own), to give to the graphs in place of
    /// this one.
    ///
    /// ```
    /// use graphed::device::{CommOptions, SimConfig};
    /// use graphed::dist::{DataParallel, GradReduction};
    /// use graphed::memory::CachingAllocator;
    /// use graphed::tensor::Tensor;
    /// let ranks = graphed::dist::on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |comm| {
    ///     let (alloc, s) = (CachingAllocator::new(comm.device()), comm.device().stream()?);
    ///     let mine = [comm.rank() as f32 + 1.0; 2];
    ///     let (a, b) = (Tensor::from_host(&alloc, &s, &mine, &[2])?, Tensor::from_host(&alloc, &s, &mine, &[2])?);
    ///     let mean = DataParallel::new(comm, Vec::new())?;
    ///     let sum = mean.with_reduction(GradReduction::Sum)?;
    ///     mean.all_reduce(&s, &a)?;
    ///     sum.all_reduce(&s, &b)?;
    ///     Ok((mean.reduction(), a.to_vec::<f32>(&s)?, b.to_vec::<f32>(&s)?))
    /// });
    /// for rank in ranks {
    ///     assert_eq!(rank?, (GradReduction::Mean, vec![1.5; 2], vec![3.0; 2]));
    /// }
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// A stream that cannot be made.
    pub fn with_reduction(&self, reduction: GradReduction) -> Result<Arc<DataParallel>> {
        DataParallel::with_buckets(&self.comm, self.buckets.clone(), reduction)
    }

    /// How it combines the ranks' gradients.
    pub fn reduction(&self) -> GradReduction {
        self.reduction
    }

    fn with_buckets(comm: &Communicator, buckets: Vec<Bucket>, reduction: GradReduction) -> Result<Arc<DataParallel>> {
        let mut seen = Vec::with_capacity(buckets.len());
        for (i, b) in buckets.iter().enumerate() {
            comm.device().check_same("DataParallel::new", "gradient bucket", b.grads.device_id())?;
            let at = b.grads.access(AccessMode::Read)?;
            // A gradient in two buckets (a parameter shared by two callables) would be summed
            // twice: the second sum would double the first.
            if let Some(first) = seen.iter().position(|other: &Access| other.overlaps(&at)) {
                return Err(bucket_error(comm.rank(), CommErrorKind::BucketOverlap { first, second: i }));
            }
            seen.push(at);
        }
        let stream = comm.device().stream()?;
        let memory = seen.iter().map(|a| a.memory).collect();
        Ok(Arc::new(DataParallel { comm: comm.clone(), reduction, stream, buckets, memory, state: Mutex::default() }))
    }

    /// The reduction of a graphed stack's gradients, one bucket per layer of `stack`, whose
    /// parameters live in `store`, averaged over the ranks: [`for_callables`](DataParallel::for_callables)
    /// of its layers.
    ///
    /// # Errors
    /// As [`for_callables`](DataParallel::for_callables).
    pub fn for_stack<M: Module>(
        comm: &Communicator,
        store: &ParamStore,
        stack: &Stack<M>,
    ) -> Result<Arc<DataParallel>> {
        let layers: Vec<&dyn Callable> = stack.layers().iter().map(|l| l as &dyn Callable).collect();
        DataParallel::for_callables(comm, store, &layers)
    }

    /// The reduction of the gradients of `callables`, as given to
    /// [`make_graphed_callables`](crate::graph::make_graphed_callables), one bucket per callable,
    /// whose parameters live in `store`, averaged over the ranks. Knowing each callable's parameters, it reduces those its
    /// module tells final early at once (a whole stack graphed as one callable: layer by layer).
    ///
    /// # Errors
    /// As [`new`](DataParallel::new), and [`ParamStore::grads_of`]'s when a callable's
    /// parameters are not one contiguous range of `store`.
    pub fn for_callables(
        comm: &Communicator,
        store: &ParamStore,
        callables: &[&dyn Callable],
    ) -> Result<Arc<DataParallel>> {
        let bucket = |c: &&dyn Callable| -> Result<Bucket> {
            let params = c.parameters_dyn();
            let grads = store.grads_of(&params)?;
            let ranges = params.iter().map(|p| store.grad_range(p)).collect::<Result<Vec<_>>>()?;
            let start = ranges.iter().map(|r| r.start).min().unwrap_or(0);
            let params = params.iter().zip(ranges).map(|(p, r)| (p.name.clone(), r.start - start..r.end - start));
            Ok(Bucket { grads, params: params.collect() })
        };
        DataParallel::with_buckets(comm, callables.iter().map(bucket).collect::<Result<_>>()?, GradReduction::Mean)
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// The communication stream, where the reductions run.
    pub(super) fn comm_stream(&self) -> &Stream {
        &self.stream
    }

    /// Each bucket's gradients, as one flat tensor, in the callables' order.
    pub(super) fn bucket_grads(&self) -> impl Iterator<Item = &Tensor> {
        self.buckets.iter().map(|b| &b.grads)
    }

    /// Averages (or sums) `grads` across ranks on `stream`, now (eager parts of the model, or
    /// every gradient of an eager step); inside a capture, the graph's own (the buckets'
    /// reductions go through here).
    ///
    /// # Errors
    /// [`Communicator::all_reduce`]'s, and the scaling kernel's for the mean.
    pub fn all_reduce(&self, stream: &Stream, grads: &Tensor) -> Result<()> {
        let world = self.comm.size();
        let mean = self.reduction == GradReduction::Mean && world > 1;
        if mean && !matches!(grads.dtype(), DType::F32 | DType::BF16) {
            // Refused before the sum is enqueued, so that no rank is left with half a mean.
            return Err(crate::ops::unsupported_dtype("DataParallel::all_reduce (mean)", grads.dtype()));
        }
        with_dtype!(grads.dtype(), T => self.comm.all_reduce(stream, grads.view::<T>()?))?;
        if !mean {
            return Ok(());
        }
        // See Note [Where the mean divides]: after the sum, on the same stream, one rounding.
        let k = 1.0 / world as f32;
        with_float!("DataParallel::all_reduce", grads.dtype(), T => scale::<T>(grads.view()?, grads.view()?, k, stream))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A gradient bucket that does not match what the capture tells.
    fn mismatch(&self, kind: CommErrorKind) -> Error {
        bucket_error(self.comm.rank(), kind)
    }

    fn bucket(&self, callable: usize) -> Result<&Bucket> {
        self.buckets.get(callable).ok_or_else(|| self.mismatch(CommErrorKind::NoBucket { callable }))
    }

    /// Reduces `pieces` of buckets on the communication stream, forked from `stream` (after the
    /// gradients it has just completed).
    fn reduce(&self, st: &mut State, stream: &Stream, pieces: &[(usize, Range<usize>)]) -> Result<()> {
        if pieces.is_empty() {
            return Ok(());
        }
        self.stream.wait_stream(stream)?;
        st.forked = true;
        for (i, r) in pieces {
            self.all_reduce(&self.stream, &self.bucket(*i)?.grads.narrow(0, r.start, r.len())?)?;
        }
        Ok(())
    }

    /// Reduces every pending piece, forked from `stream`.
    fn reduce_pending(&self, stream: &Stream) -> Result<()> {
        let mut st = self.lock();
        let pending = std::mem::take(&mut st.pending);
        self.reduce(&mut st, stream, &pending)
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

/// Gradient buckets that do not fit the capture or each other.
fn bucket_error(rank: usize, kind: CommErrorKind) -> Error {
    Error::Comm { op: "DataParallel", rank, kind }
}

/// `ranges` less `done`, in order, adjacent pieces merged: what is left to reduce.
fn subtract(mut ranges: Vec<Range<usize>>, done: &[Range<usize>]) -> Vec<Range<usize>> {
    ranges.sort_unstable_by_key(|r| r.start);
    let mut cuts: Vec<usize> = ranges.iter().chain(done).flat_map(|r| [r.start, r.end]).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let covered = |x: usize, rs: &[Range<usize>]| rs.iter().any(|r| r.contains(&x));
    let mut left: Vec<Range<usize>> = Vec::new();
    for w in cuts.windows(2) {
        let (a, b) = (w[0], w[1]);
        if !covered(a, &ranges) || covered(a, done) {
            continue;
        }
        match left.last_mut() {
            Some(last) if last.end == a => last.end = b,
            _ => left.push(a..b),
        }
    }
    left
}

impl GradSync for DataParallel {
    fn begin_grad_pass(&self, stream: &Stream) -> Result<()> {
        self.reduce_pending(stream)
    }

    fn grads_final(&self, callable: usize, params: &[&Param], stream: &Stream) -> Result<()> {
        let bucket = self.bucket(callable)?;
        if bucket.params.is_empty() {
            return Ok(());
        }
        let mut ranges = Vec::with_capacity(params.len());
        for p in params {
            let Some((_, r)) = bucket.params.iter().find(|(name, _)| *name == p.name) else {
                return Err(self.mismatch(CommErrorKind::NotInBucket { param: p.name.clone(), callable }));
            };
            ranges.push(r.clone());
        }
        let mut st = self.lock();
        let pieces: Vec<_> = subtract(ranges, &st.early_of(callable)).into_iter().map(|r| (callable, r)).collect();
        self.reduce(&mut st, stream, &pieces)?;
        st.early.extend(pieces);
        Ok(())
    }

    fn grads_complete(&self, callable: usize, _stream: &Stream) -> Result<()> {
        let all = 0..self.bucket(callable)?.grads.numel();
        let mut st = self.lock();
        let rest = subtract(vec![all], &st.early_of(callable));
        st.early.retain(|(i, _)| *i != callable);
        st.pending.extend(rest.into_iter().map(|r| (callable, r)));
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
        st.early.clear();
        st.forked = false;
    }

    fn tail_memory(&self) -> Vec<BufferId> {
        self.memory.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CommOptions, DType, SimConfig};
    use crate::memory::CachingAllocator;
    use crate::nn::{Builder, TransformerLayer};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn what_is_left_is_every_element_told_and_not_done_in_merged_runs(
            told in proptest::collection::vec((0usize..40, 0usize..10), 0..5),
            done in proptest::collection::vec((0usize..40, 0usize..10), 0..5),
        ) {
            let ranges = |v: &[(usize, usize)]| v.iter().map(|&(a, n)| a..a + n).collect::<Vec<_>>();
            let (told, done) = (ranges(&told), ranges(&done));
            let left = subtract(told.clone(), &done);
            for x in 0..50 {
                let want = told.iter().any(|r| r.contains(&x)) && !done.iter().any(|r| r.contains(&x));
                prop_assert_eq!(left.iter().any(|r| r.contains(&x)), want, "element {}", x);
            }
            for w in left.windows(2) {
                prop_assert!(w[0].end < w[1].start, "runs in order, apart: {:?}", left);
            }
            prop_assert!(left.iter().all(|r| !r.is_empty()));
        }
    }

    #[test]
    fn buckets_that_share_a_gradient_are_refused() {
        let out = crate::dist::on_sim_ranks(1, SimConfig::default(), CommOptions::default(), |c| {
            let (alloc, s) = (CachingAllocator::new(c.device()), c.device().stream()?);
            let grads = Tensor::zeros(&alloc, &s, &[10], DType::F32)?;
            let apart = DataParallel::new(c, vec![grads.narrow(0, 0, 4)?, grads.narrow(0, 4, 6)?]).err();
            let shared = DataParallel::new(c, vec![grads.narrow(0, 0, 6)?, grads.narrow(0, 4, 6)?]).err();
            let overlap =
                |e: &Error| matches!(e, Error::Comm { kind: CommErrorKind::BucketOverlap { first: 0, second: 1 }, .. });
            Ok((apart.map(|e| e.to_string()), shared.map(|e| (overlap(&e), e.to_string()))))
        });
        let (apart, shared) = out.into_iter().next().expect("one rank").expect("rank 0 ran");
        assert_eq!(apart, None, "adjacent buckets are fine");
        let refused = shared.is_some_and(|(kind, e)| kind && e.contains("callables 0 and 1 overlap"));
        assert!(refused, "overlapping ones are refused as BucketOverlap");
    }

    /// The mean scales in f32 or bf16: gradients of another type are refused before anything is
    /// enqueued (rank 0 alone asks, and its next collective still meets rank 1's); their sum runs.
    #[test]
    fn a_mean_of_gradients_it_cannot_scale_is_refused_before_the_sum() {
        let out = crate::dist::on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |c| {
            let (alloc, s) = (CachingAllocator::new(c.device()), c.device().stream()?);
            let grads = Tensor::zeros(&alloc, &s, &[4], DType::F16)?;
            let mean = DataParallel::new(c, Vec::new())?;
            let refused = match c.rank() {
                0 => Some(mean.all_reduce(&s, &grads)),
                _ => None,
            };
            mean.with_reduction(GradReduction::Sum)?.all_reduce(&s, &grads)?;
            s.synchronize()?;
            Ok(refused.map(|r| r.map_err(|e| (matches!(e, Error::UnsupportedDType { .. }), e.to_string()))))
        });
        let mut ranks = out.into_iter().map(|r| r.expect("the sum ran on every rank"));
        let Some(Some(Err((typed, message)))) = ranks.next() else { panic!("rank 0's mean of f16 was not refused") };
        assert!(typed && message.contains("DataParallel::all_reduce (mean)"), "{message}");
    }

    #[test]
    fn a_layers_mlp_half_told_final_is_reduced_at_once_and_only_the_rest_waits() {
        let out = crate::dist::on_sim_ranks(1, SimConfig::default(), CommOptions::default(), |c| {
            let (alloc, s) = (CachingAllocator::new(c.device()), c.device().stream()?);
            let store = ParamStore::new(&alloc, &s, TransformerLayer::parameter_count(8))?;
            let attention = crate::nn::AttentionSpec::new(8, 2).kind(crate::nn::AttentionKind::Unfused);
            let layer = TransformerLayer::new(&Builder::new(&store, &alloc, &s)?.pp("h0"), attention)?;
            let stack = Stack::new(vec![layer]);
            let layer = &stack.layers()[0];
            let mlp_half = [layer.ln2.parameters(), layer.mlp.parameters()].concat();
            let attn_end = store.grad_range(mlp_half[0])?.start;
            let dp = DataParallel::for_stack(c, &store, &stack)?;
            let snapshot = |dp: &DataParallel| {
                let st = dp.lock();
                (st.early.clone(), st.pending.clone(), st.forked)
            };
            dp.grads_final(0, &mlp_half, &s)?;
            let after_mlp = snapshot(&dp);
            dp.grads_final(0, &mlp_half, &s)?;
            let told_twice = snapshot(&dp);
            let stranger = Param { name: "elsewhere".into(), ..mlp_half[0].clone() };
            let refused = dp.grads_final(0, &[&stranger], &s).err().map(|e| e.to_string());
            dp.grads_complete(0, &s)?;
            let after_backward = snapshot(&dp);
            dp.abandon();
            s.synchronize()?;
            Ok((attn_end, store.grads()?.numel(), after_mlp, told_twice, refused, after_backward))
        });
        let (attn_end, n, after_mlp, told_twice, refused, after_backward) =
            out.into_iter().next().expect("one rank").expect("rank 0 ran");
        assert_eq!(after_mlp, (vec![(0, attn_end..n)], Vec::new(), true), "the MLP half went at once");
        assert_eq!(told_twice, after_mlp, "a half told twice is reduced once");
        assert!(refused.is_some_and(|e| e.contains("`elsewhere`")), "a parameter of no bucket is named");
        assert_eq!(after_backward, (Vec::new(), vec![(0, 0..attn_end)], true), "only the attention half waits");
    }

    #[test]
    fn an_abandoned_capture_leaves_nothing_deferred_or_forked() {
        let out = crate::dist::on_sim_ranks(1, SimConfig::default(), CommOptions::default(), |c| {
            let (alloc, s) = (CachingAllocator::new(c.device()), c.device().stream()?);
            let dp = DataParallel::new(c, vec![Tensor::zeros(&alloc, &s, &[4], DType::F32)?])?;
            dp.grads_complete(0, &s)?;
            dp.begin_grad_pass(&s)?;
            dp.grads_complete(0, &s)?;
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
        assert_eq!(before, (vec![(0, 0..4)], true), "the capture deferred a bucket and forked");
        assert_eq!(after, (Vec::new(), false), "abandon forgets both");
    }
}
