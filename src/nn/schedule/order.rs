//! A validated schedule: its builders (TransformerEngine's order, all-forward-then-backward,
//! interleaved 1F1B, zero bubble) and what it says about its steps.

use std::fmt;

use super::error::refuse;
use super::{ScheduleErrorKind, Step};
use crate::Result;

/// One layer pass of a schedule ([`Schedule::visits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Visit {
    /// Its step's position in [`Schedule::steps`].
    pub position: usize,
    /// Its step.
    pub step: Step,
    /// The microbatch the step runs.
    pub microbatch: usize,
    /// The layer, counted over every chunk's layers, chunk by chunk.
    pub layer: usize,
    /// The layer's place in its chunk.
    pub in_chunk: usize,
    /// The callable of this (layer, microbatch) among one per pair: [`Schedule::instance`].
    pub instance: usize,
}

/// A validated schedule: its steps, chunks and microbatches.
///
/// ```
/// use graphed::nn::{Schedule, Step};
/// // TransformerEngine's test order: 2 chunks, 3 microbatches.
/// let s = Schedule::from_te_order(&[1.0, 2.0, 1.0, 2.0, -2.0, -1.0, 1.0, 2.0, -2.0, -1.0, -2.0, -1.0])?;
/// assert_eq!((s.chunks(), s.microbatches()), (2, 3));
/// assert_eq!(s.steps()[4], Step::Backward(1));
/// assert_eq!(Schedule::interleaved_1f1b(1, 0, 2, 4)?.microbatches(), 4);
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    steps: Vec<Step>,
    chunks: usize,
    microbatches: usize,
}

impl Schedule {
    /// Validates `steps`: every chunk from 0 has the same number of forwards and backwards (the
    /// microbatch count), each backward follows its forward, chunk k + 1's forward of a
    /// microbatch follows chunk k's and chunk k's backward follows chunk k + 1's, and a chunk's
    /// weight-gradient entries, if any, follow its backwards one for one.
    ///
    /// # Errors
    /// [`Error::Schedule`](crate::Error::Schedule) naming the first inconsistency.
    pub fn new(steps: Vec<Step>) -> Result<Schedule> {
        let chunk_of = |s: &Step| s.chunk();
        let chunks = steps.iter().filter(|s| !matches!(s, Step::WeightGrad(_))).map(|s| chunk_of(s) + 1).max();
        let Some(chunks) = chunks else { return refuse(ScheduleErrorKind::Empty) };
        let count = |f: &dyn Fn(&Step) -> bool| -> Vec<usize> {
            let mut n = vec![0; chunks];
            for s in steps.iter().filter(|s| f(s)) {
                if let Some(c) = n.get_mut(chunk_of(s)) {
                    *c += 1;
                }
            }
            n
        };
        let (fwd, bwd, wgrad) = (
            count(&|s| matches!(s, Step::Forward(_))),
            count(&|s| matches!(s, Step::Backward(_))),
            count(&|s| matches!(s, Step::WeightGrad(_))),
        );
        let microbatches = fwd[0];
        for k in 0..chunks {
            if fwd[k] != microbatches || bwd[k] != microbatches || microbatches == 0 {
                let (forwards, backwards) = (fwd[k], bwd[k]);
                return refuse(ScheduleErrorKind::Counts { chunk: k, forwards, backwards, microbatches });
            }
        }
        for (k, &w) in wgrad.iter().enumerate() {
            if w != 0 && w != bwd[k] {
                return refuse(ScheduleErrorKind::WeightGrads { chunk: k, wgrads: w, backwards: bwd[k] });
            }
        }
        if let Some(chunk) = steps.iter().map(chunk_of).find(|k| *k >= chunks) {
            let wgrads = steps.iter().filter(|s| chunk_of(s) == chunk).count();
            return refuse(ScheduleErrorKind::WeightGrads { chunk, wgrads, backwards: 0 });
        }
        let (mut f, mut b, mut w) = (vec![0usize; chunks], vec![0usize; chunks], vec![0usize; chunks]);
        for (index, &step) in steps.iter().enumerate() {
            let dep = |microbatch: usize, needs: String| {
                refuse(ScheduleErrorKind::Dependency { index, step, microbatch, needs })
            };
            match step {
                Step::Forward(k) => {
                    if k > 0 && f[k - 1] <= f[k] {
                        return dep(f[k], format!("F{} of that microbatch", k - 1));
                    }
                    f[k] += 1;
                }
                Step::Backward(k) => {
                    if f[k] <= b[k] {
                        return dep(b[k], format!("F{k} of that microbatch"));
                    }
                    if k + 1 < chunks && b[k + 1] <= b[k] {
                        return dep(b[k], format!("B{} of that microbatch", k + 1));
                    }
                    b[k] += 1;
                }
                Step::WeightGrad(k) => {
                    if b[k] <= w[k] {
                        return refuse(ScheduleErrorKind::WeightGrads { chunk: k, wgrads: w[k] + 1, backwards: b[k] });
                    }
                    w[k] += 1;
                }
            }
        }
        Ok(Schedule { steps, chunks, microbatches })
    }

    /// A schedule in TransformerEngine's `_order` encoding (chunks from 1).
    ///
    /// # Errors
    /// [`ScheduleErrorKind::BadEntry`] for an entry that is not `±k` or `-(k + 0.5)`; then as
    /// [`Schedule::new`].
    pub fn from_te_order(order: &[f64]) -> Result<Schedule> {
        let mut steps = Vec::with_capacity(order.len());
        for (index, &value) in order.iter().enumerate() {
            let bad = || refuse(ScheduleErrorKind::BadEntry { index, value });
            let (magnitude, half) = (value.abs().floor(), value.abs().fract());
            if !value.is_finite() || !(1.0..=1e6).contains(&magnitude) {
                return bad();
            }
            let k = magnitude as usize - 1;
            let (whole, halved) = (half == 0.0, half == 0.5);
            steps.push(match (value > 0.0, whole, halved) {
                (true, true, _) => Step::Forward(k),
                (false, true, _) => Step::Backward(k),
                (false, _, true) => Step::WeightGrad(k),
                _ => return bad(),
            });
        }
        Schedule::new(steps)
    }

    /// Every forward (each microbatch through every chunk), then every backward in reverse.
    ///
    /// # Errors
    /// [`ScheduleErrorKind::Zero`] for zero chunks or microbatches.
    pub fn all_forward_then_backward(chunks: usize, microbatches: usize) -> Result<Schedule> {
        positive(&[("chunks", chunks), ("microbatches", microbatches)])?;
        let fwd = (0..microbatches).flat_map(|_| (0..chunks).map(Step::Forward));
        let bwd = (0..microbatches).flat_map(|_| (0..chunks).rev().map(Step::Backward));
        Schedule::new(fwd.chain(bwd).collect())
    }

    /// The order that pipeline rank `rank` of `stages` runs under interleaved 1F1B with
    /// `virtual_stages` chunks per rank (Megatron-LM's schedule; 1F1B when `virtual_stages` is 1):
    /// microbatches go through the chunks in groups of `stages`, a warmup of forwards, then one
    /// forward and one backward in turn, then the remaining backwards.
    ///
    /// # Errors
    /// [`ScheduleErrorKind::Zero`] for zero sizes, [`ScheduleErrorKind::RankOutsideStages`] for a
    /// rank outside the stages, [`ScheduleErrorKind::NotMultipleOfStages`] for (with several
    /// chunks) microbatches that are not a multiple of the stages.
    pub fn interleaved_1f1b(
        stages: usize,
        rank: usize,
        virtual_stages: usize,
        microbatches: usize,
    ) -> Result<Schedule> {
        positive(&[("stages", stages), ("virtual stages", virtual_stages), ("microbatches", microbatches)])?;
        if rank >= stages {
            return refuse(ScheduleErrorKind::RankOutsideStages { rank, stages });
        }
        if virtual_stages > 1 && !microbatches.is_multiple_of(stages) {
            return refuse(ScheduleErrorKind::NotMultipleOfStages { microbatches, stages });
        }
        let total = microbatches * virtual_stages;
        // The k-th forward (or backward) of the rank is of this chunk: groups of `stages`
        // microbatches go through every chunk (backwards through the chunks in reverse).
        let chunk = |k: usize, forward: bool| {
            let c = (k / stages) % virtual_stages;
            if forward {
                c
            } else {
                virtual_stages - 1 - c
            }
        };
        let warmup = match virtual_stages {
            1 => (stages - rank - 1).min(total),
            _ => ((stages - rank - 1) * 2 + (virtual_stages - 1) * stages).min(total),
        };
        let mut steps = Vec::with_capacity(2 * total);
        steps.extend((0..warmup).map(|k| Step::Forward(chunk(k, true))));
        for k in warmup..total {
            steps.push(Step::Forward(chunk(k, true)));
            steps.push(Step::Backward(chunk(k - warmup, false)));
        }
        steps.extend((total - warmup..total).map(|k| Step::Backward(chunk(k, false))));
        Schedule::new(steps)
    }

    /// 1F1B for `rank` of `stages` with each backward split into its data-gradient pass and a
    /// weight-gradient pass issued one backward later (after the last backward, the rest), the
    /// way zero-bubble schedules fill the pipeline's bubbles with weight gradients.
    ///
    /// # Errors
    /// As [`Schedule::interleaved_1f1b`] with one virtual stage.
    pub fn zero_bubble(stages: usize, rank: usize, microbatches: usize) -> Result<Schedule> {
        let base = Schedule::interleaved_1f1b(stages, rank, 1, microbatches)?;
        let mut steps = Vec::with_capacity(3 * microbatches);
        let mut pending = 0;
        for step in base.steps {
            steps.push(step);
            if let Step::Backward(k) = step {
                if pending > 0 {
                    steps.push(Step::WeightGrad(k));
                    pending -= 1;
                }
                pending += 1;
            }
        }
        steps.extend((0..pending).map(|_| Step::WeightGrad(0)));
        Schedule::new(steps)
    }

    /// The steps, in order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Whether weight-gradient steps run the layers that split theirs out, over chunks of
    /// `layers_per_chunk` layers, where `splits(layer)` says whether a layer (over every chunk's)
    /// does: a chunk has such steps if and only if one of its layers splits. Decided before
    /// anything runs, so that no split weight gradient is left unrun.
    pub(crate) fn check_weight_grads(
        &self,
        layers_per_chunk: &[usize],
        splits: &mut dyn FnMut(usize) -> Result<bool>,
    ) -> Result<()> {
        let mut first = 0;
        for (chunk, &n) in layers_per_chunk.iter().enumerate() {
            let mut splitting = None;
            for layer in first..first + n {
                if splits(layer)? {
                    splitting.get_or_insert(layer);
                }
            }
            match (self.steps.contains(&Step::WeightGrad(chunk)), splitting) {
                (false, Some(layer)) => return refuse(ScheduleErrorKind::UnrunWeightGrads { layer, chunk }),
                (true, None) => return refuse(ScheduleErrorKind::NothingToSplit { chunk }),
                _ => {}
            }
            first += n;
        }
        Ok(())
    }

    /// Model chunks (virtual pipeline stages) of the rank.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Microbatches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// Whether it splits weight gradients out of the backwards.
    pub fn splits_weight_grads(&self) -> bool {
        self.steps.iter().any(|s| matches!(s, Step::WeightGrad(_)))
    }

    /// Each step with the microbatch it runs (each chunk's passes take its microbatches in
    /// order; a weight-gradient pass takes the oldest backward without one).
    pub fn with_microbatches(&self) -> Vec<(Step, usize)> {
        let (mut f, mut b, mut w) = (vec![0; self.chunks], vec![0; self.chunks], vec![0; self.chunks]);
        let next = |v: &mut Vec<usize>, k: usize| {
            v[k] += 1;
            v[k] - 1
        };
        (self.steps.iter())
            .map(|&s| match s {
                Step::Forward(k) => (s, next(&mut f, k)),
                Step::Backward(k) => (s, next(&mut b, k)),
                Step::WeightGrad(k) => (s, next(&mut w, k)),
            })
            .collect()
    }

    /// Every layer pass the schedule runs, in order: each step's chunk's layers (of
    /// `layers_per_chunk`; a chunk past its end has none), in order for a forward and last first
    /// otherwise, each with its step, microbatch and callable. The one walk that eager runs,
    /// captures, buffer sharing and pipeline stages all follow, so that replays meet the order
    /// the graphs were captured in (R5).
    ///
    /// ```
    /// use graphed::nn::{Schedule, Step};
    /// let s = Schedule::all_forward_then_backward(1, 2)?;
    /// let passes: Vec<_> = s.visits(&[2]).iter().map(|v| (v.step, v.microbatch, v.layer)).collect();
    /// assert_eq!(&passes[..3], [(Step::Forward(0), 0, 0), (Step::Forward(0), 0, 1), (Step::Forward(0), 1, 0)]);
    /// assert_eq!(passes[4], (Step::Backward(0), 0, 1));
    /// # Ok::<(), graphed::Error>(())
    /// ```
    pub fn visits(&self, layers_per_chunk: &[usize]) -> Vec<Visit> {
        let first: Vec<usize> = layers_per_chunk.iter().scan(0, |a, n| Some(std::mem::replace(a, *a + n))).collect();
        let mut visits = Vec::new();
        for (position, (step, microbatch)) in self.with_microbatches().into_iter().enumerate() {
            let k = step.chunk();
            let (start, n) = (first.get(k).copied().unwrap_or(0), layers_per_chunk.get(k).copied().unwrap_or(0));
            for layer in step.layer_order(start..start + n) {
                let instance = self.instance(layers_per_chunk, layer, microbatch);
                visits.push(Visit { position, step, microbatch, layer, in_chunk: layer - start, instance });
            }
        }
        visits
    }

    /// Where layer `layer` (counted over every chunk's `layers_per_chunk` layers) for
    /// `microbatch` sits among one-per-(layer, microbatch) things ordered chunk by chunk,
    /// microbatch by microbatch, layer by layer, as TransformerEngine orders sample inputs and
    /// graphed callables.
    pub fn instance(&self, layers_per_chunk: &[usize], layer: usize, microbatch: usize) -> usize {
        let mut first = 0;
        for &n in layers_per_chunk {
            if layer < first + n {
                return first * self.microbatches + microbatch * n + (layer - first);
            }
            first += n;
        }
        first * self.microbatches + microbatch
    }

    /// In TransformerEngine's `_order` encoding.
    pub fn to_te_order(&self) -> Vec<f64> {
        (self.steps.iter())
            .map(|s| match *s {
                Step::Forward(k) => (k + 1) as f64,
                Step::Backward(k) => -((k + 1) as f64),
                Step::WeightGrad(k) => -((k + 1) as f64 + 0.5),
            })
            .collect()
    }
}

fn positive(args: &[(&'static str, usize)]) -> Result<()> {
    match args.iter().find(|(_, v)| *v == 0) {
        Some(&(name, _)) => refuse(ScheduleErrorKind::Zero { name }),
        None => Ok(()),
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let steps: Vec<String> = self.steps.iter().map(ToString::to_string).collect();
        write!(f, "{} chunks × {} microbatches: {}", self.chunks, self.microbatches, steps.join(" "))
    }
}
