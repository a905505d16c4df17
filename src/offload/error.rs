//! What the offload manager refuses, and what to do instead.

use crate::nn::Chunk;

/// Why the offload manager refused a call ([`Error::Offload`](crate::Error::Offload)).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadErrorKind {
    // ---- calls during an iteration --------------------------------------------------------------
    /// A chunk's modules saved in another order than in the recording iteration (H13).
    #[error(
        "{chunk} saved {found} where the recording iteration saved {expected}: the schedule must be the same in \
         every iteration; make a new manager for another schedule"
    )]
    Schedule {
        /// The chunk.
        chunk: Chunk,
        /// What the recording iteration did at this point.
        expected: String,
        /// What happened now.
        found: String,
    },
    /// Work of an iteration was left over at [`end_iteration`](super::OffloadManager::end_iteration)
    /// (H11): the manager released it, but the iteration did not run as recorded.
    #[error("{what} at the end of the iteration: run every chunk's backward before `end_iteration`")]
    Pending {
        /// What was left.
        what: String,
    },
    /// A saved tensor of an earlier iteration was taken after `end_iteration` released it.
    #[error("a saved tensor of {chunk} was taken after `end_iteration`: take saved tensors within their iteration")]
    Stale {
        /// The chunk.
        chunk: Chunk,
    },
    /// The automatic policy needs timings that this device cannot give.
    #[error(
        "the automatic policy times the layers and the copies, and the simulator has no clock: list the sites to \
         offload instead (OffloadConfig::sites), or run on CUDA"
    )]
    NoClock,
    /// A capture used a chunk hook made for eager use.
    #[error(
        "a chunk hook made by `OffloadManager::chunk` is for eager use; graphs bake host buffers in and get \
         their hooks from `OffloadManager::graph_options`"
    )]
    NotForGraphs,
    /// [`keep_resident`](super::OffloadManager::keep_resident) on graphs captured without
    /// [`OffloadConfig::switchable`](super::OffloadConfig::switchable): they hold no device
    /// copies to switch to.
    #[error(
        "the graphs hold no device copies to keep offloaded tensors resident: capture them with \
         OffloadConfig::switchable(true), or capture again with another policy"
    )]
    NotSwitchable,
    /// A switch between a forward replay and its backward: the backward would read where the
    /// forward did not write.
    #[error("a switch of what stays resident while {graph} is not the next graph of its pool: switch between steps")]
    SwitchMidStep {
        /// The graph's name, or its id.
        graph: String,
    },
    /// A switch given only some of the graphs that copy a tensor out and back.
    #[error(
        "a switch given {found} of the 4 graph nodes that copy an offloaded tensor out and back (to the host and on \
         the device): pass every graph captured with this manager (a stack's layers, a schedule's callables)"
    )]
    SwitchGraphs {
        /// The copy nodes found among the graphs given.
        found: usize,
    },

    // ---- configuration ------------------------------------------------------------------------
    /// A site selector of [`OffloadConfig::sites`](super::OffloadConfig::sites) that is not
    /// `module.tensor` or `module.*`.
    #[error(
        "site selector `{selector}` is not `module.tensor` or `module.*` (e.g. `attn.qkv`); name a module and one of its \
         tensors, or `*` for all of them"
    )]
    BadSelector {
        /// The selector given.
        selector: String,
    },
    /// A site selector that selects none of the tensors the model saves: a misspelt selector
    /// would otherwise offload nothing without a word.
    #[error(
        "site selector `{selector}` selects no tensor the model saves; it saves {} (or `module.*` for all of a \
         module's){}",
        saved.join(", "),
        unmatched_hint(selector, saved)
    )]
    UnmatchedSelector {
        /// The selector given.
        selector: String,
        /// What the model saves, as `module.tensor`, sorted.
        saved: Vec<String>,
    },
    /// [`OffloadConfig::slack`](super::OffloadConfig::slack) outside (0, 1].
    #[error(
        "slack {slack} is not in (0, 1]; pass the share of a layer's time to fill with copies, above 0 and at most 1"
    )]
    Slack {
        /// The share given.
        slack: f64,
    },
    /// [`OffloadConfig::max_overhead`](super::OffloadConfig::max_overhead) outside [0, 1].
    #[error(
        "max_overhead {share} is not in [0, 1]; pass the share of the step the copies may cost, 0 for none at all"
    )]
    MaxOverhead {
        /// The share given.
        share: f64,
    },
}

impl OffloadErrorKind {
    /// Whether this refuses the configuration (a user's input) rather than a call or a schedule.
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            Self::BadSelector { .. } | Self::UnmatchedSelector { .. } | Self::Slack { .. } | Self::MaxOverhead { .. }
        )
    }
}

/// A hint for a selector of a tensor that the other attention saves.
fn unmatched_hint(selector: &str, saved: &[String]) -> &'static str {
    match selector.rsplit('.').next() {
        Some("probs") if saved.iter().any(|k| k.ends_with(".lse")) => {
            "; the fused attention keeps no probabilities (the unfused one does: `--attention unfused`)"
        }
        Some("lse") if saved.iter().any(|k| k.ends_with(".probs")) => {
            "; only the fused attention saves a log-sum-exp (`--attention fused`)"
        }
        _ => "",
    }
}
