//! Why a graphed callable or stack refused a call or a capture.

use crate::device::GraphId;
use crate::Error;

/// Which rule a graphed call or capture broke. Each variant's message ends with the fix.
///
/// Not `Clone` or `PartialEq`: [`Refused`](GraphedErrorKind::Refused) holds the lower layer's
/// [`Error`]; match on the variants instead.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GraphedErrorKind {
    // ---- refusals of the layers below -----------------------------------------------------------
    /// A layer below (the device, the allocator, a graph pool) refused the call: a stream,
    /// tensor or pool of another device ([`Error::WrongDevice`]), a pool of another allocator
    /// ([`Error::ForeignPool`]), a replay out of its pool's capture order ([`Error::PoolOrder`],
    /// R5) or racing the pool's replay on another stream ([`Error::PoolConcurrent`], R5). The
    /// wrapped error names the operation, the devices or both graphs; the message is its message
    /// (with the graph layer's way out where there is one), so it is not also its `source()`.
    #[error("{0}{fix}", fix = graph_layer_fix(.0))]
    Refused(Box<Error>),

    // ---- arguments of make_graphed_callables and make_graphed_stack -----------------------------
    /// Gradient work (`GraphOptions::grad_sync`) asked for where it cannot run.
    #[error("GraphOptions::grad_sync {why}")]
    GradSync {
        /// Where, and what to do instead.
        why: &'static str,
    },
    /// Lent gradients (`GraphOptions::lend_gradients`) asked for where they cannot be lent.
    #[error("GraphOptions::lend_gradients {why}")]
    LendGradients {
        /// Where, and what to do instead.
        why: &'static str,
    },
    /// A block of lent gradient memory was still held after the capture by something that is
    /// no static buffer: state a module made during the recorded pass, which the next backward
    /// would zero.
    #[error(
        "{bytes} bytes of lent gradient memory are still held after the capture by something other than a static \
         buffer (state a module created while being captured); create such state before graphing (one eager step \
         does), or graph without lend_gradients"
    )]
    LentState {
        /// The bytes held.
        bytes: usize,
    },
    /// With lent gradients, blocks that the warmup placed in lent gradient memory were still
    /// held after it (Note [Lent gradients in the warmup] in `graph/lend.rs`): state a module
    /// created in its first pass, which the gradients, restored after the warmup, overwrite.
    #[error(
        "{bytes} bytes that the warmup allocated in lent gradient memory are still held after it (state a module \
         created in its first pass), and the gradients overwrite that memory; rebuild the module and create such \
         state before graphing (one eager step does), or graph without lend_gradients"
    )]
    WarmupLentState {
        /// The bytes held.
        bytes: usize,
    },
    /// With lent gradients, a captured pass held blocks past its end that its warmup freed
    /// within the pass: they lie in gradient memory lent for the pass alone (Note [Pass-local
    /// blocks] in `memory`), which a later pass zeroes.
    #[error(
        "{bytes} bytes that the warmup of this pass freed within it were still held when the captured pass ended: \
         the module allocates differently while captured than in the warmup, and lent gradient memory cannot hold \
         what outlives the pass; make the captured pass allocate as the warmup does, or graph without lend_gradients"
    )]
    PassLocalHeld {
        /// The bytes held.
        bytes: usize,
    },
    /// With lent gradients, a stack's replay or
    /// [`take_gradients`](super::GraphedStack::take_gradients) out of the one order lent memory
    /// allows: forward, backward, take the gradients (before the optimizer reads them), forward
    /// again (Note [Lent gradients]). Refused before anything is enqueued.
    #[error(
        "with lent gradients, {what}; lent memory allows one backward per optimizer step: replay the forward, the \
         backward, then call GraphedStack::take_gradients before the optimizer reads them (to accumulate gradients \
         over microbatches, graph without lend_gradients)"
    )]
    LentOrder {
        /// What the call would have done.
        what: &'static str,
    },
    /// No callables (or an empty stack) were given.
    #[error("no callables to graph; pass at least one")]
    NoCallables,
    /// The number of sample inputs differs from the number of callables.
    #[error("{callables} callables but {samples} sample input sets; pass one Inputs per callable")]
    SampleCount {
        /// Callables given.
        callables: usize,
        /// Sample input sets given.
        samples: usize,
    },
    /// Training capture with zero warmup iterations: the first capture would then include lazy
    /// initialization, and unused inputs could not be found.
    #[error(
        "warmup_iters is 0 in training mode; use at least 1 (lazy initialization must not end up inside the capture)"
    )]
    ZeroWarmup,
    /// `GraphOptions::pool` and `GraphOptions::pool_per_callable` were both given.
    #[error("both a shared pool and a pool per callable were asked for; choose one")]
    ConflictingPools,
    /// A pipeline schedule given for an inference capture.
    #[error(
        "a schedule runs backwards, which inference does not capture; graph it in training mode, or graph the \
         forwards without a schedule"
    )]
    ScheduleInInference,
    /// A pipeline schedule given to `make_graphed_stack`.
    #[error("a stack replays as one pass; graph a schedule's layers with make_graphed_callables")]
    ScheduleForStack,
    /// Callables that do not split evenly into the schedule's chunks, and no
    /// `GraphOptions::layers_per_chunk` to say how they split.
    #[error("{callables} callables do not split evenly into {chunks} chunks; pass layers_per_chunk")]
    UnevenChunks {
        /// Callables given.
        callables: usize,
        /// The schedule's chunks.
        chunks: usize,
    },
    /// `GraphOptions::layers_per_chunk` that does not give every chunk of the schedule at least
    /// one of the callables, or not all of them.
    #[error(
        "layers per chunk {layers:?} do not give the schedule's {chunks} chunks the {callables} callables; give \
         each chunk at least one"
    )]
    LayersPerChunk {
        /// The layers per chunk given.
        layers: Vec<usize>,
        /// The schedule's chunks.
        chunks: usize,
        /// Callables given.
        callables: usize,
    },
    /// Under a schedule, a number of sample input sets other than one per (chunk, microbatch,
    /// layer).
    #[error(
        "{samples} sample input sets for {callables} layers and {microbatches} microbatches; pass one per (chunk, \
         microbatch, layer)"
    )]
    ScheduleSamples {
        /// Sample input sets given.
        samples: usize,
        /// Callables (layers) given.
        callables: usize,
        /// The schedule's microbatches.
        microbatches: usize,
    },

    // ---- inputs of a call -----------------------------------------------------------------------
    /// A named input of the sample is missing at call time.
    #[error("named input `{name}` is missing; pass every named input the sample had")]
    MissingInput {
        /// Its name.
        name: String,
    },
    /// A named input the sample did not have was passed.
    #[error("named input `{name}` was not in the sample; pass only the names captured")]
    UnknownInput {
        /// Its name.
        name: String,
    },
    /// The same name was given twice.
    #[error("named input `{name}` is given twice; give each name once")]
    DuplicateInput {
        /// Its name.
        name: String,
    },
    /// The number of positional inputs (or of output gradients) differs from the capture.
    #[error("{found} {what} given but {expected} were captured; pass them as in the sample")]
    InputCount {
        /// What the inputs are ("positional inputs", "output gradients").
        what: &'static str,
        /// As captured.
        expected: usize,
        /// As given.
        found: usize,
    },
    /// An input's shape differs from the static buffer it is copied into.
    #[error(
        "{input} has shape {found:?} but its static buffer has {expected:?}; graphs replay fixed shapes, so pad to the captured shape or capture another graph"
    )]
    InputShape {
        /// Which input ("input 0", "input `mask`", "output gradient 0").
        input: String,
        /// As captured.
        expected: Vec<usize>,
        /// As given.
        found: Vec<usize>,
    },
    /// An input's element type differs from the static buffer it is copied into.
    #[error("{input} holds {found} but its static buffer holds {expected}; graphs replay fixed element types, so cast it or capture another graph")]
    InputDType {
        /// Which input ("input 0", "input `mask`", "output gradient 0").
        input: String,
        /// As captured.
        expected: crate::device::DType,
        /// As given.
        found: crate::device::DType,
    },

    // ---- what the capture found -----------------------------------------------------------------
    /// A differentiable input received no gradient in the warmup backward.
    #[error(
        "{input} received no gradient in the warmup backward; pass it with Inputs::constant, or set GraphOptions::allow_unused_input"
    )]
    UnusedInput {
        /// Which input.
        input: String,
    },
    /// In a stack, a layer gave no gradient for an input that the layer before it produced.
    #[error(
        "{input} is the previous layer's output, so a stack needs its gradient, but the backward gave none; return it from the layer's backward"
    )]
    StackGradient {
        /// Which input.
        input: String,
    },
    /// A captured graph breaks the replay contract at its sync event (checked at capture from the
    /// access summary): `rule` is R2, R3 or R7 of `docs/design.md`.
    #[error("graph {graph} breaks {rule} at its sync event: {detail}; {}", sync_fix(rule))]
    SyncContract {
        /// The graph.
        graph: GraphId,
        /// Which rule.
        rule: &'static str,
        /// What breaks it, with the operation.
        detail: String,
    },
    /// The capture's accesses could not be verified (the device has no checker watching
    /// captures).
    #[error(
        "the device watches no captures, so the sync event cannot be verified; create the device with Device::cuda or Device::sim"
    )]
    Unverifiable,

    // ---- replays and their outputs --------------------------------------------------------------
    /// A side-stream replay of graphs captured without a sync event.
    #[error(
        "its graphs record no sync event, so the caller could not resume before the whole replay ends; capture with GraphOptions::sync_event, or replay with Replay::joined"
    )]
    NoSyncEvent,
    /// A side-stream replay on the caller's own stream.
    #[error(
        "a side-stream replay needs a stream other than the caller's; pass another stream to Replay::side, or use Replay::caller"
    )]
    SideIsCaller,
    /// An output (or input gradient) was read after a later replay overwrote its static buffer.
    #[error(
        "{what} was overwritten by launch {now} of graph {}{} (it was returned after launch {made_by}); copy it (StaticTensor::to_owned) before replaying further",
        graph, graph_name.as_ref().map_or_else(String::new, |n| format!(" ({n})"))
    )]
    StaleOutput {
        /// Which one ("output 0", "gradient of input 0"), of the callable the error names.
        what: String,
        /// The graph whose replay overwrote it.
        graph: GraphId,
        /// That graph's name in its pool (module, microbatch and pass), if it has one.
        graph_name: Option<String>,
        /// That graph's launches when the tensor was returned.
        made_by: u64,
        /// Its launches now.
        now: u64,
    },
    /// A [`StaticTensor`](super::StaticTensor) read after its callable was released, when its
    /// memory is shared with the pool's later graphs (under a schedule with buffer reuse): the
    /// callable did not own it, so the pool may use it for other captures now.
    #[error(
        "{what} is memory its graph pool shares with later graphs, and its callable was released; copy it (StaticTensor::to_owned) before releasing"
    )]
    OutputReleased {
        /// Which one ("output 0", "gradient of input 0"), of the callable the error names.
        what: String,
    },
    /// The callable's static state was released
    /// ([`GraphedCallable::release_static_state`](super::GraphedCallable::release_static_state),
    /// or its stack's).
    #[error("its static state was released (graphs and static buffers); capture it again to replay")]
    Released,
    /// `backward` or `backward_dw` of a callable graphed for inference (forward graphs only).
    #[error("it was graphed for inference (forward graphs only); graph it in training mode")]
    Inference,
    /// `backward_dw` of a callable without a split weight gradient.
    #[error(
        "it has no split weight gradient, so backward already accumulated it; call backward_dw only for modules that split it"
    )]
    NoSplitDw,
    /// A layer of a graphed stack was replayed on its own: its input is the previous layer's
    /// static output, which only the stack's replay feeds correctly.
    #[error(
        "it is a layer of a graphed stack, whose inputs are the previous layer's outputs; replay the GraphedStack"
    )]
    StackLayer,

    // ---- typed edges between graphs (graph::GraphEdge) -------------------------------------------
    /// A capture that would take an edge's end another graph holds, or both ends of one edge.
    #[error("edge `{edge}` {why}")]
    EdgeTaken {
        /// The edge's name.
        edge: String,
        /// Which end, and what to do instead.
        why: &'static str,
    },
    /// An edge given to a pass the capture does not make, or to a wait no replay would check.
    #[error("edge `{edge}` is given to {pass}, which {why}")]
    EdgePass {
        /// The edge's name.
        edge: String,
        /// The callable and pass it was given to.
        pass: String,
        /// Why the capture does not make that pass.
        why: &'static str,
    },
    /// A consumer replayed before its producer's replay of this step: it would wait on the
    /// previous step's event (or on none) and read stale data.
    #[error(
        "it waits on edge `{edge}`, whose producer has not been replayed since this graph's last replay; replay the \
         producer first in every step"
    )]
    EdgeNotProduced {
        /// The edge's name.
        edge: String,
    },
}

/// What to do about a broken sync contract, by rule.
fn sync_fix(rule: &str) -> &'static str {
    match rule {
        "R2" => "work the caller reads must finish before the pass returns: join any stream the module forked before returning from it (a save hook joins its copy streams in end_pass, which runs after the sync event), and leave recording the sync event to GraphOptions::sync_event",
        "R3" => "work after the sync event (a forked copy stream) may only touch its own pool memory: copy from a buffer the pass owns, not from a static input, output or parameter",
        _ => "a graph replayed with a sync event must not wait on events outside it: record what it waits for inside the pass, or replay with Replay::joined",
    }
}

/// The graph layer's way out of a lower layer's refusal, where it has one beyond the wrapped
/// error's own: a graphed replay's side-stream tail is joined through its `Tail`, `Tails` or
/// `GraphedStack`, not through the pool.
fn graph_layer_fix(e: &Error) -> &'static str {
    match e {
        Error::PoolConcurrent { .. } => {
            " (a graphed call's side-stream replay leaves a tail: join it first with Tail::join, Tails::join or \
             GraphedStack::join)"
        }
        _ => "",
    }
}

/// A refusal from the layers below, in the graph layer's one shape: `Error::Graphed` naming
/// `callable`, wrapping the lower error in [`GraphedErrorKind::Refused`], so that a user matches
/// every refusal of a graphed call the same way. Errors that are no refusal (a device failure)
/// pass through unwrapped.
pub(crate) fn refusal(callable: &str, e: Error) -> Error {
    match e {
        Error::PoolOrder { .. }
        | Error::PoolConcurrent { .. }
        | Error::WrongDevice { .. }
        | Error::ForeignPool { .. } => {
            Error::Graphed { callable: callable.to_string(), kind: GraphedErrorKind::Refused(Box::new(e)) }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::StreamId;
    use crate::memory::PoolId;

    #[test]
    fn a_refusal_of_a_layer_below_is_wrapped_with_its_message() {
        let foreign = || Error::ForeignPool { op: "make_graphed_callables", pool: PoolId(3) };
        let e = refusal("fc#0", foreign());
        assert!(matches!(e.refused_by(), Some(Error::ForeignPool { pool: PoolId(3), .. })));
        assert_eq!(e.to_string(), format!("graphed callable fc#0: {}", foreign()));
        // A concurrent replay adds the graph layer's way out: its tails.
        let concurrent = || Error::PoolConcurrent {
            pool: PoolId(1),
            graph: GraphId(2),
            graph_name: Some("fc#0 Backward".into()),
            stream: StreamId(4),
            previous: GraphId(1),
            previous_name: None,
            previous_stream: StreamId(5),
        };
        let e = refusal("fc#0", concurrent()).to_string();
        assert!(e.starts_with(&format!("graphed callable fc#0: {}", concurrent())), "{e}");
        assert!(e.contains("Tail::join"), "{e}");
        // Anything else is no refusal of the call, and passes through.
        assert!(matches!(refusal("fc#0", Error::GraphReset { op: "launch" }), Error::GraphReset { .. }));
    }
}
