//! The one traversal of a schedule ([`run_schedule`], [`run_pipeline_stage`]) and what it runs
//! through ([`SchedulePasses`]).

use super::{Schedule, ScheduleErrorKind, Stage, StageLinks, Step, Visit};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// What a pass of a schedule hands on (an output, an input gradient): to the next pass, or to the
/// caller (the head's input, the step's input gradients).
pub trait Handed: Clone {
    /// The tensor.
    ///
    /// # Errors
    /// When it can no longer be read: graphed, once a later replay overwrote it
    /// (`graph::GraphedErrorKind::StaleOutput`).
    fn tensor(&self) -> Result<&Tensor>;
}

/// An eager pass's own tensor, readable as long as it lives.
impl Handed for Tensor {
    fn tensor(&self) -> Result<&Tensor> {
        Ok(self)
    }
}

/// One way of running the passes a schedule names: layer `layer` (counted over every chunk's
/// layers, chunk by chunk) for microbatch `microbatch`, eagerly ([`EagerPasses`](super::EagerPasses)) or graphed
/// (`graph::GraphedSchedule::passes`).
pub trait SchedulePasses {
    /// What its passes hand on: a [`Tensor`] eagerly; graphed, a `graph::StaticTensor`, which
    /// refuses to be read once a later replay overwrote its static buffer.
    type Out: Handed;
    /// Adds `by` (wrapping: a step back is a wrapped add) to the dropout step counter `step`,
    /// on the passes' stream.
    fn advance_rng(&mut self, step: &Tensor, by: u64) -> Result<()>;
    /// The layer's forward of `x`.
    fn forward(&mut self, layer: usize, microbatch: usize, x: &Tensor) -> Result<Self::Out>;
    /// The layer's backward of `dy`: its input gradient.
    fn backward(&mut self, layer: usize, microbatch: usize, dy: &Tensor) -> Result<Self::Out>;
    /// The layer's split weight-gradient pass; nothing for a layer that does not split one out.
    fn weight_grad(&mut self, layer: usize, microbatch: usize) -> Result<()>;
    /// Whether the layer splits its weight gradients out, run by the schedule's weight-gradient
    /// steps.
    ///
    /// # Errors
    /// [`ScheduleErrorKind::NoSuchLayer`] when the passes have no such layer.
    fn splits_weight_grads(&self, layer: usize) -> Result<bool>;
}

/// Runs `schedule` over chunks of `layers_per_chunk` layers: microbatch j's `inputs[j]` through
/// chunk 0, each chunk's output into the next chunk's forward of the same microbatch, the last
/// chunk's output to `head(j, y)`, which returns its upstream gradient; each backward's input
/// gradient into the previous chunk's backward of the microbatch. Before every forward step of
/// microbatch j, `rng_step` (the layers' dropout step counter, if any) is moved to its value at
/// the step's start plus j + 1, as a stack's forward of microbatch j advances it, so that every
/// schedule (and every pipeline stage) draws the masks of the plain stack. Returns each
/// microbatch's input gradient. The one traversal of a schedule, as
/// [`forward_pass`](crate::nn::forward_pass) and [`backward_pass`](crate::nn::backward_pass) are a
/// stack's. What reaches `head` and what it returns are the passes' [`Handed`] values: graphed,
/// they refuse to be read after a later replay (the next step's) overwrote them.
///
/// # Errors
/// [`ScheduleErrorKind::LayersAndInputs`] when the layers or inputs do not fit the schedule; the
/// passes' own.
pub fn run_schedule<P: SchedulePasses + ?Sized>(
    passes: &mut P,
    schedule: &Schedule,
    layers_per_chunk: &[usize],
    inputs: &[Tensor],
    rng_step: Option<&Tensor>,
    head: &mut dyn FnMut(usize, P::Out) -> Result<Tensor>,
) -> Result<Vec<P::Out>> {
    traverse(passes, schedule, (layers_per_chunk, inputs), rng_step, head, None)
}

/// [`run_schedule`] for pipeline stage `stage`, whose chunks are the model's chunks
/// `k·stages + stage`: a chunk's input comes through `links` from the stage before unless it is
/// the model's first, its output goes to the stage after unless it is the model's last (then
/// to `head`), and gradients go the other way. `inputs` are the microbatches on the first stage
/// and empty on the others; only the first stage returns input gradients (the others an empty
/// list). Sends of one step and the receive of the next go as one exchange.
///
/// # Errors
/// As [`run_schedule`], and the links' own.
pub fn run_pipeline_stage<P: SchedulePasses + ?Sized>(
    passes: &mut P,
    schedule: &Schedule,
    (layers_per_chunk, inputs): (&[usize], &[Tensor]),
    rng_step: Option<&Tensor>,
    head: &mut dyn FnMut(usize, P::Out) -> Result<Tensor>,
    stage: Stage,
    links: &mut dyn StageLinks,
) -> Result<Vec<P::Out>> {
    let walked = traverse(passes, schedule, (layers_per_chunk, inputs), rng_step, head, Some((stage, &mut *links)));
    // Joined on every exit, a failed step's too, so that no exchange of this step is in flight
    // or waited for when the next one starts.
    let joined = links.join();
    let dxs = walked?;
    joined?;
    Ok(dxs)
}

/// A tensor between chunks: one the caller gave or a pass received, or one a pass made.
#[derive(Clone)]
enum Flow<O> {
    Given(Tensor),
    Made(O),
}

impl<O: Handed> Flow<O> {
    fn tensor(&self) -> Result<&Tensor> {
        match self {
            Flow::Given(t) => Ok(t),
            Flow::Made(o) => o.tensor(),
        }
    }
}

/// A tensor between chunks, and the exchange that received it (`None` when it never left the
/// rank).
type Arrived<O> = (Flow<O>, Option<usize>);

/// Runs `schedule`'s steps on `passes` for this rank's stage of `pipeline` (one stage without
/// it), its chunks of `layers_per_chunk` layers fed `inputs` (stage 0) or what the stage before
/// sends, exchanging with the neighbouring stages before the steps that need it, and `head` after
/// the model's last chunk; stage 0's input gradients per microbatch.
fn traverse<P: SchedulePasses + ?Sized>(
    passes: &mut P,
    schedule: &Schedule,
    (layers_per_chunk, inputs): (&[usize], &[Tensor]),
    rng_step: Option<&Tensor>,
    head: &mut dyn FnMut(usize, P::Out) -> Result<Tensor>,
    pipeline: Option<(Stage, &mut dyn StageLinks)>,
) -> Result<Vec<P::Out>> {
    let stage = pipeline.as_ref().map_or(Stage::single(), |(s, _)| *s);
    let microbatches = schedule.microbatches();
    let expected_inputs = if stage.index() == 0 { microbatches } else { 0 };
    let fits = layers_per_chunk.len() == schedule.chunks() && !layers_per_chunk.contains(&0);
    if !fits || inputs.len() != expected_inputs {
        return Err(Error::Schedule(ScheduleErrorKind::LayersAndInputs {
            layers_per_chunk: layers_per_chunk.to_vec(),
            inputs: inputs.len(),
            chunks: schedule.chunks(),
            microbatches,
            stage: stage.index(),
            stages: stage.count(),
        }));
    }
    // Every layer exists, and split weight gradients have steps to run them.
    schedule.check_weight_grads(layers_per_chunk, &mut |l| passes.splits_weight_grads(l))?;
    let mut walk = Walk::new(schedule, stage, inputs, pipeline.map(|(_, links)| links));
    let visits = schedule.visits(layers_per_chunk);
    // Every chunk has a layer (checked above): one group of visits per step.
    for (i, step) in visits.chunk_by(|a, b| a.position == b.position).enumerate() {
        walk.exchange_before(i)?;
        walk.run(passes, step, rng_step, head)?;
    }
    walk.finish(passes, rng_step)
}

/// A walk's state between steps: the tensors in flight between chunks, the exchanges with the
/// neighbouring stages, and where the dropout counter stands.
struct Walk<'a, O> {
    steps: Vec<(Step, usize)>,
    stage: Stage,
    links: Option<&'a mut dyn StageLinks>,
    /// Between chunks, per microbatch: an activation forward, a gradient backward, each with the
    /// exchange it came from when received (waited for before it is read).
    flowing: Vec<Option<Arrived<O>>>,
    grads: Vec<Option<Arrived<O>>>,
    /// What the steps since the last exchange send.
    outgoing: Vec<(usize, Tensor)>,
    exchanges: usize,
    /// The microbatch (+ 1) whose forward last moved the dropout counter.
    rng_at: u64,
    /// The model's last chunk.
    last: usize,
    /// Where exchanges go (Megatron-LM's grouping, which its schedules meet without deadlock):
    /// before every step, but an interleaved schedule's steady state runs a backward that
    /// follows a forward in the same segment, so that one exchange sends both passes' outputs
    /// and receives what the next forward and backward need. A rank whose warmup holds every
    /// forward has no steady state: its first backward's gradient is received only after its
    /// last forward's output is sent, since the stage after needs that output to make the
    /// gradient.
    interleaved: bool,
}

impl<'a, O: Handed> Walk<'a, O> {
    fn new(schedule: &Schedule, stage: Stage, inputs: &[Tensor], links: Option<&'a mut dyn StageLinks>) -> Self {
        let steps = schedule.with_microbatches();
        let mut flowing: Vec<Option<Arrived<O>>> = vec![None; schedule.microbatches()];
        for (f, x) in flowing.iter_mut().zip(inputs) {
            *f = Some((Flow::Given(x.clone()), None));
        }
        let all_warmup = steps.iter().rposition(|s| matches!(s.0, Step::Forward(_)))
            < steps.iter().position(|s| matches!(s.0, Step::Backward(_)));
        Walk {
            interleaved: schedule.chunks() > 1 && !all_warmup,
            last: stage.count() * schedule.chunks() - 1,
            grads: vec![None; schedule.microbatches()],
            flowing,
            steps,
            stage,
            links,
            outgoing: Vec::new(),
            exchanges: 0,
            rng_at: 0,
        }
    }

    fn remote(&self) -> bool {
        self.stage.count() > 1
    }

    /// Whether step `i` shares the exchange before the step before it.
    fn joined(&self, i: usize) -> bool {
        let steps = &self.steps;
        self.interleaved && i > 0 && matches!((steps[i - 1].0, steps[i].0), (Step::Forward(_), Step::Backward(_)))
    }

    /// The stage a step receives its input from, if another.
    fn recv_from(&self, step: Step) -> Option<usize> {
        match step {
            Step::Forward(k) if self.remote() && self.stage.model_chunk(k) != 0 => Some(self.stage.prev()),
            Step::Backward(k) if self.remote() && self.stage.model_chunk(k) != self.last => Some(self.stage.next()),
            _ => None,
        }
    }

    /// Before step `i`, unless it joins the one before: one exchange that sends what the steps
    /// since the last one made and receives what this segment's steps read.
    fn exchange_before(&mut self, i: usize) -> Result<()> {
        if self.links.is_none() || self.joined(i) {
            return Ok(());
        }
        let segment = (i..self.steps.len()).take_while(|&n| n == i || self.joined(n));
        let wanted: Vec<(Step, usize, usize)> = segment
            .filter_map(|n| self.recv_from(self.steps[n].0).map(|from| (self.steps[n].0, self.steps[n].1, from)))
            .collect();
        if wanted.is_empty() && self.outgoing.is_empty() {
            return Ok(());
        }
        let recvs: Vec<usize> = wanted.iter().map(|w| w.2).collect();
        let sends = std::mem::take(&mut self.outgoing);
        let links = self.links.as_mut().expect("checked above");
        let got = links.exchange(self.exchanges, &sends, &recvs)?;
        for ((step, mb, _), t) in wanted.into_iter().zip(got) {
            let slot = if matches!(step, Step::Forward(_)) { &mut self.flowing[mb] } else { &mut self.grads[mb] };
            *slot = Some((Flow::Given(t), Some(self.exchanges)));
        }
        self.exchanges += 1;
        Ok(())
    }

    /// One step: its layers' passes (`visits`, all of one step), then its output handed on.
    fn run<P: SchedulePasses<Out = O> + ?Sized>(
        &mut self,
        passes: &mut P,
        visits: &[Visit],
        rng_step: Option<&Tensor>,
        head: &mut dyn FnMut(usize, O) -> Result<Tensor>,
    ) -> Result<()> {
        let (step, j) = (visits[0].step, visits[0].microbatch);
        let forward = match step {
            Step::Forward(_) => true,
            Step::Backward(_) => false,
            Step::WeightGrad(_) => return visits.iter().try_for_each(|v| passes.weight_grad(v.layer, j)),
        };
        if let Some(counter) = rng_step.filter(|_| forward) {
            passes.advance_rng(counter, (j as u64 + 1).wrapping_sub(self.rng_at))?;
            self.rng_at = j as u64 + 1;
        }
        let (slot, what) = if forward { (&mut self.flowing[j], "input") } else { (&mut self.grads[j], "gradient") };
        let not_received = || Error::Schedule(ScheduleErrorKind::NotReceived { step, microbatch: j, what });
        let (mut t, from) = slot.take().ok_or_else(not_received)?;
        if let (Some(e), Some(links)) = (from, self.links.as_mut()) {
            links.wait(e)?;
        }
        for v in visits {
            let x = t.tensor()?;
            t = Flow::Made(if forward { passes.forward(v.layer, j, x)? } else { passes.backward(v.layer, j, x)? });
        }
        let Flow::Made(t) = t else { unreachable!("a step visits at least one layer") };
        self.hand_on(step, j, t, head)
    }

    /// A step's output: to the head after the model's last chunk, to the neighbouring stage
    /// across ranks, or to this rank's next step of the microbatch.
    fn hand_on(&mut self, step: Step, j: usize, t: O, head: &mut dyn FnMut(usize, O) -> Result<Tensor>) -> Result<()> {
        let chunk = self.stage.model_chunk(step.chunk());
        let remote = self.remote();
        match step {
            Step::Forward(_) if chunk == self.last => self.grads[j] = Some((Flow::Given(head(j, t)?), None)),
            Step::Forward(_) if remote => self.outgoing.push((self.stage.next(), t.tensor()?.clone())),
            Step::Forward(_) => self.flowing[j] = Some((Flow::Made(t), None)),
            _ if remote && chunk != 0 => self.outgoing.push((self.stage.prev(), t.tensor()?.clone())),
            _ => self.grads[j] = Some((Flow::Made(t), None)),
        }
        Ok(())
    }

    /// After the last step: the last sends, the dropout counter at its step-to-step advance,
    /// and stage 0's input gradients.
    fn finish<P: SchedulePasses<Out = O> + ?Sized>(
        mut self,
        passes: &mut P,
        rng_step: Option<&Tensor>,
    ) -> Result<Vec<O>> {
        if let Some(links) = self.links.as_mut().filter(|_| !self.outgoing.is_empty()) {
            links.exchange(self.exchanges, &self.outgoing, &[])?;
        }
        // Every valid schedule ends its forwards with the last microbatch; this keeps the
        // counter's step-to-step advance at the microbatch count whatever the order.
        let microbatches = self.grads.len() as u64;
        if let Some(counter) = rng_step.filter(|_| self.rng_at != microbatches) {
            passes.advance_rng(counter, microbatches.wrapping_sub(self.rng_at))?;
        }
        if self.stage.index() != 0 {
            return Ok(Vec::new());
        }
        (self.grads.into_iter())
            .map(|d| match d {
                Some((Flow::Made(dx), _)) => Ok(dx),
                _ => Err(Error::Schedule(ScheduleErrorKind::Empty)),
            })
            .collect()
    }
}
