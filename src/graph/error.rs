//! Why a graphed callable refused a call or a capture.

use std::fmt;

use crate::device::{EventId, GraphId};

/// Which rule a graphed call or capture broke. Each variant's message ends with the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GraphedErrorKind {
    /// No callables were given.
    NoCallables,
    /// The number of sample inputs differs from the number of callables.
    SampleCount {
        /// Callables given.
        callables: usize,
        /// Sample input sets given.
        samples: usize,
    },
    /// Training capture with zero warmup iterations: the first capture would then include lazy
    /// initialization, and unused inputs could not be found.
    ZeroWarmup,
    /// A named input of the sample is missing at call time.
    MissingInput {
        /// Its name.
        name: String,
    },
    /// A named input the sample did not have was passed.
    UnknownInput {
        /// Its name.
        name: String,
    },
    /// The same name was given twice.
    DuplicateInput {
        /// Its name.
        name: String,
    },
    /// The number of positional inputs (or of output gradients) differs from the capture.
    InputCount {
        /// What the inputs are ("positional inputs", "output gradients").
        what: &'static str,
        /// As captured.
        expected: usize,
        /// As given.
        found: usize,
    },
    /// An input's shape differs from the static buffer it is copied into.
    InputShape {
        /// Which input ("input 0", "input `mask`", "output gradient 0").
        input: String,
        /// As captured.
        expected: Vec<usize>,
        /// As given.
        found: Vec<usize>,
    },
    /// The callable does not take named inputs (a [`Module`](crate::nn::Module) takes positional
    /// ones only).
    NamedInputsUnsupported,
    /// A differentiable input received no gradient in the warmup backward.
    UnusedInput {
        /// Which input.
        input: String,
    },
    /// With chaining, a callable's output does not fit the next callable's first input.
    ChainShape {
        /// The previous callable's first output.
        output: Vec<usize>,
        /// This callable's first sample input.
        input: Vec<usize>,
    },
    /// A captured graph breaks the replay contract at its sync event (checked at capture from the
    /// access summary): `rule` is R2, R3 or R7 of DESIGN.md.
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
    Unverifiable,
    /// A replay was asked to resume the caller at an event this callable's graphs do not record.
    EventNotRecorded {
        /// The event given.
        event: EventId,
        /// The event bound at capture, if any.
        bound: Option<EventId>,
    },
    /// A replay that resumes at an event was asked for on the caller's own stream.
    EventOnCallerStream,
    /// An output (or input gradient) was read after a later replay overwrote its static buffer.
    StaleOutput {
        /// Which one.
        what: String,
        /// The graph whose replay overwrote it.
        graph: GraphId,
        /// That graph's launches when the tensor was returned.
        made_by: u64,
        /// Its launches now.
        now: u64,
    },
    /// The callable was reset.
    Reset,
    /// `backward` or `backward_dw` of a callable graphed for inference (forward graphs only).
    Inference,
    /// `backward_dw` of a callable without a split weight gradient.
    NoSplitDw,
}

impl fmt::Display for GraphedErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoCallables => write!(f, "no callables to graph; pass at least one"),
            Self::SampleCount { callables, samples } => {
                write!(f, "{callables} callables but {samples} sample input sets; pass one Inputs per callable")
            }
            Self::ZeroWarmup => write!(
                f,
                "warmup_iters is 0 in training mode; use at least 1 (lazy initialization must not end up inside the capture)"
            ),
            Self::MissingInput { name } => {
                write!(f, "named input `{name}` is missing; pass every named input the sample had")
            }
            Self::UnknownInput { name } => {
                write!(f, "named input `{name}` was not in the sample; pass only the names captured")
            }
            Self::DuplicateInput { name } => write!(f, "named input `{name}` is given twice; give each name once"),
            Self::InputCount { what, expected, found } => {
                write!(f, "{found} {what} given but {expected} were captured; pass them as in the sample")
            }
            Self::InputShape { input, expected, found } => write!(
                f,
                "{input} has shape {found:?} but its static buffer has {expected:?}; graphs replay fixed shapes, so pad to the captured shape or capture another graph"
            ),
            Self::NamedInputsUnsupported => write!(
                f,
                "named inputs given to a Module, which takes positional inputs only; implement graph::Callable to take named inputs"
            ),
            Self::UnusedInput { input } => write!(
                f,
                "{input} received no gradient in the warmup backward; pass it with Inputs::constant, or set GraphOptions::allow_unused_input"
            ),
            Self::ChainShape { output, input } => write!(
                f,
                "with chaining, the previous callable's output {output:?} feeds this callable's first input, sampled as {input:?}; make the shapes agree or turn chaining off"
            ),
            Self::SyncContract { graph, rule, detail } => write!(
                f,
                "graph {graph} breaks {rule} at its sync event: {detail}; record the sync event after that work (the save hook's end_pass runs after it), or replay without the event"
            ),
            Self::Unverifiable => write!(
                f,
                "the device watches no captures, so the sync event cannot be verified; create the device with Device::cuda or Device::sim"
            ),
            Self::EventNotRecorded { event, bound: Some(b) } => write!(
                f,
                "its graphs record event {b}, not {event}, so a wait on {event} would order nothing; resume at {b} (GraphedCallable::sync_event)"
            ),
            Self::EventNotRecorded { event, bound: None } => write!(
                f,
                "its graphs record no event, so a wait on {event} would order nothing; capture with GraphOptions::sync_event, or replay with Replay::joined"
            ),
            Self::EventOnCallerStream => write!(
                f,
                "resuming at an event needs a replay stream other than the caller's; pass a side stream, or use Replay::caller"
            ),
            Self::StaleOutput { what, graph, made_by, now } => write!(
                f,
                "{what} was overwritten by launch {now} of graph {graph} (it was returned after launch {made_by}); copy it (StaticTensor::to_owned) before replaying further"
            ),
            Self::Reset => write!(f, "it was reset and holds no graphs; capture again with make_graphed_callables"),
            Self::Inference => write!(f, "it was graphed for inference (forward graphs only); graph it in training mode"),
            Self::NoSplitDw => write!(
                f,
                "it has no split weight gradient, so backward already accumulated it; call backward_dw only for modules that split it"
            ),
        }
    }
}
