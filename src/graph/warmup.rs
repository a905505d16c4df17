//! The warmup: eager iterations on the capture stream, each running every callable's forward and
//! at once its backward, callable by callable (PyTorch's and TransformerEngine's per-callable
//! warmup), with the capture-time hooks around each pass. It holds one callable's saved
//! activations at a time, and the outputs that feed the next callable, where a warmup of every
//! forward before any backward would hold the whole stack's: the run's peak memory would be set
//! there, before the graphs exist.
//!
//! A callable fed by the previous one takes that one's warmup outputs. Every backward gets its
//! own outputs as output gradients: the next callable's input gradients do not exist yet in this
//! order (whether it gives them is checked in its own backward, `Plan::check_grads`), and the
//! gradients the warmup accumulates are thrown away, so any finite values of the outputs' shape
//! and layout serve. The outputs are held anyway, for the next callable; new zeros would add a
//! buffer and a memset per output to the warmup's peak and time. An output that is not a
//! contiguous tensor gets zeros instead, so that the backward sees the layout its captured
//! replays will (a static output gradient is contiguous).

use super::graphed::Pass;
use super::lend::{Learned, Lending};
use super::options::{GraphOptions, Phase};
use super::plan::Plan;
use super::GraphedErrorKind;
use crate::memory::EagerLending;
use crate::nn::NoGradHook;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Runs `options.warmup_iters` iterations; the first-iteration hook runs after the first (an
/// offload manager records in it).
///
/// The host waits for the stream after each callable: memory a callable freed goes back to the
/// allocator only once no queued work holds it (at once for CUDA's stream-ordered reuse of one
/// stream's blocks, but only after a wait for blocks used on several streams, and on the
/// simulator, which runs work when the host observes it), so that the next callable reuses it
/// on every device. It costs a host wait per callable, once per capture.
///
/// With lent gradients, the passes' allocations take the gradient memory of the layers other
/// than their own (Note [Lent gradients in the warmup] in `lend.rs`); a block still held there
/// after the warmup is refused (`WarmupLentState`).
pub(crate) fn warmup(
    plan: &Plan<'_>,
    options: &mut GraphOptions,
    learned: &mut Learned,
    lending: Option<&Lending>,
) -> Result<()> {
    let _range = plan.stream.device().range_with(|| "warmup".into());
    let lent = lending.map(|l| l.lend_to_warmup(plan.alloc, plan.stream)).transpose()?;
    let ran = iterations(plan, options, learned, lending.zip(lent.as_ref()));
    let held = lent.map_or(Ok(0), EagerLending::finish);
    ran?;
    match held? {
        0 => Ok(()),
        bytes => Err(Error::Graphed {
            callable: "make_graphed_stack".into(),
            kind: GraphedErrorKind::WarmupLentState { bytes },
        }),
    }
}

fn iterations(
    plan: &Plan<'_>,
    options: &mut GraphOptions,
    learned: &mut Learned,
    lent: Option<(&Lending, &EagerLending<'_>)>,
) -> Result<()> {
    // The passes' allocations are learned in the last iteration, the one the captures follow.
    let mut not_learned = Learned::new(false);
    for iteration in 0..options.warmup_iters {
        let mut previous = Vec::new();
        let learning = if iteration + 1 == options.warmup_iters { &mut *learned } else { &mut not_learned };
        for i in 0..plan.len() {
            if let Some((lending, lent)) = lent {
                lent.open(&lending.warmup_lenders(i));
                previous = out_of_lent(plan, lending, i, previous)?;
            }
            previous = warm(plan, options, learning, i, previous)?;
            plan.stream.synchronize()?;
        }
        if iteration == 0 {
            let lends = lent.map(|(lending, _)| lending.lent_bytes()).transpose()?.unwrap_or_default();
            options.run_first_iteration_hook(plan.stream, &lends)?;
        }
    }
    Ok(())
}

/// `previous`, the outputs that feed layer `i`, each copied out of the memory layer `i` lends
/// if it lies there: its backward writes that memory while they are its inputs.
fn out_of_lent(plan: &Plan<'_>, lending: &Lending, i: usize, previous: Vec<Tensor>) -> Result<Vec<Tensor>> {
    (previous.into_iter())
        .map(|y| {
            if !lending.in_lent_memory(i, &y)? {
                return Ok(y);
            }
            let copy = Tensor::uninit(plan.alloc, plan.stream, y.shape(), y.dtype())?;
            copy.copy_from(&y, plan.stream)?;
            Ok(copy)
        })
        .collect()
}

/// Callable `i`'s forward of `previous` (or of its static inputs), then, in training, its
/// backward (and split weight-gradient pass); returns its outputs.
fn warm(
    plan: &Plan<'_>,
    options: &mut GraphOptions,
    learned: &mut Learned,
    i: usize,
    previous: Vec<Tensor>,
) -> Result<Vec<Tensor>> {
    let (stream, callable) = (plan.stream, plan.callables[i]);
    let inputs = plan.inputs(i, &previous);
    drop(previous);
    let (outputs, saved) = {
        let _range = stream.device().range_with(|| plan.ranges[i].name("warmup", Pass::Forward));
        options.run_pass_hook(i, Phase::ForwardPre, stream)?;
        plan.hooks[i].begin_forward(stream)?;
        let forward = learned.learn(plan.alloc, stream, (i, Pass::Forward), || {
            callable.forward_dyn(&inputs, plan.hooks[i].as_ref(), stream)
        })?;
        options.run_pass_hook(i, Phase::Forward, stream)?;
        forward
    };
    if !plan.training {
        return Ok(outputs);
    }
    let _range = stream.device().range_with(|| plan.ranges[i].name("warmup", Pass::Backward));
    options.run_pass_hook(i, Phase::BackwardPre, stream)?;
    let zeros = (outputs.iter())
        .map(|y| (!y.is_contiguous()).then(|| Tensor::zeros(plan.alloc, stream, y.shape(), y.dtype())).transpose())
        .collect::<Result<Vec<_>>>()?;
    let dys: Vec<&Tensor> = outputs.iter().zip(&zeros).map(|(y, zero)| zero.as_ref().unwrap_or(y)).collect();
    let grads = learned
        .learn(plan.alloc, stream, (i, Pass::Backward), || callable.backward_dyn(saved, &dys, &NoGradHook, stream))?;
    plan.check_grads(i, &inputs, &grads)?;
    if callable.splits_dw_dyn() {
        callable.backward_dw_dyn(stream)?;
    }
    options.run_pass_hook(i, Phase::Backward, stream)?;
    Ok(outputs)
}
