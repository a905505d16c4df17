//! What to offload: the sites, the size threshold, the margin, the byte budget and the policy.

use super::OffloadErrorKind;
use crate::{Error, Result};

/// The saved tensors offloaded by default, as `module.tensor` selectors (the module is the last
/// part of a site's name: `layer3.attn` is an `attn`): the attention's input (the first
/// LayerNorm's output), its q, k and v (the fused form's `qkv`, the QKV projection's output
/// whose column blocks its kernels read; the unfused form's `q`, `k` and `v`, permuted into
/// heads), its output (the projection's input), and the MLP's input (the second LayerNorm's
/// output) ([`AttentionKind`](crate::nn::AttentionKind)). Besides these, the fused attention
/// saves `attn.lse` (f32 `(B, heads, T)`, a `1/(3·head_dim)` of qkv's elements: not worth a copy
/// by default) and the unfused one `attn.probs`, the `(B, heads, T, T)` softmax (1 GiB per layer
/// at `L`, never by default); either may be listed explicitly, for the form that saves it.
pub const DEFAULT_SITES: [&str; 7] = ["attn.input", "attn.qkv", "attn.q", "attn.k", "attn.v", "attn.att", "mlp.input"];

/// What the automatic policy chooses from: the default sites, the MLP's pre-activation and
/// activation (four times as wide), and the second LayerNorm's input. A LayerNorm's input at the
/// start of a layer is the layer's input, which a graph's tail must not read (R3).
pub const AUTO_CANDIDATES: [&str; 10] = [
    "attn.input",
    "attn.qkv",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.att",
    "mlp.input",
    "mlp.pre",
    "mlp.act",
    "ln2.input",
];

/// How the offloaded tensors are chosen after the recording iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Every eligible tensor of the listed sites, outside the margin, within the byte budget,
    /// earlier layers first.
    #[default]
    Listed,
    /// Per layer, the largest eligible tensors whose copies fit under the measured compute of
    /// the layer after it (its forward for the copy out, its backward for the copy back); a
    /// layer whose copies fit nowhere keeps its activations. For graphs, the layer times are
    /// those of each layer's graphs replayed after the capture's warmup and the bandwidth that
    /// of copies inside a graph ([`Windows::Graphs`](super::Windows::Graphs)); eagerly, those
    /// of the recording iteration ([`Windows::Eager`](super::Windows::Eager)).
    Auto,
}

/// The configuration of an [`OffloadManager`](super::OffloadManager).
///
/// ```
/// use graphed::offload::{OffloadConfig, Policy};
/// let config = OffloadConfig::default().sites(&["attn.qkv", "attn.att"]).margin(1).policy(Policy::Listed);
/// assert!(config.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadConfig {
    pub(crate) sites: Vec<String>,
    /// Whether a site selector that selects nothing the model saves is refused (sites a user
    /// names) or skipped (a built-in list of candidates, [`OffloadConfig::candidates`]).
    pub(crate) exact_sites: bool,
    pub(crate) min_elements: usize,
    pub(crate) margin: usize,
    pub(crate) max_bytes: Option<usize>,
    pub(crate) policy: Policy,
    pub(crate) delay_eager_commits: bool,
    pub(crate) slack: f64,
    pub(crate) max_overhead: f64,
    pub(crate) switchable: bool,
}

impl Default for OffloadConfig {
    fn default() -> OffloadConfig {
        OffloadConfig {
            sites: DEFAULT_SITES.iter().map(|s| s.to_string()).collect(),
            // A built-in list: a model that recomputes its LayerNorm outputs saves no
            // `attn.input` or `mlp.input`.
            exact_sites: false,
            min_elements: 1 << 16,
            margin: 2,
            max_bytes: None,
            policy: Policy::Listed,
            delay_eager_commits: false,
            slack: 1.0,
            max_overhead: 0.01,
            switchable: false,
        }
    }
}

impl OffloadConfig {
    /// The tensors to offload (or to choose from, with [`Policy::Auto`]), as `module.tensor`
    /// selectors; `module.*` selects all of a module's tensors.
    pub fn sites(mut self, sites: &[&str]) -> OffloadConfig {
        self.sites = sites.iter().map(|s| s.to_string()).collect();
        self.exact_sites = true;
        self
    }

    /// As [`sites`](OffloadConfig::sites), for a list that names what a model may save rather
    /// than what it does ([`AUTO_CANDIDATES`], and [`DEFAULT_SITES`], the default's): a selector
    /// that selects nothing is skipped, not refused. A model whose MLP recomputes its activation
    /// (`nn::Recompute::Gelu`) saves no `mlp.act`, which the automatic policy's candidates name;
    /// one that recomputes its LayerNorm outputs (`nn::Recompute::Norms`) no `attn.input` or
    /// `mlp.input`, which the default sites name.
    pub fn candidates(mut self, sites: &[&str]) -> OffloadConfig {
        self = self.sites(sites);
        self.exact_sites = false;
        self
    }

    /// Tensors with fewer elements stay on the device (default 65 536): copies of small tensors
    /// cost more in launches than they save.
    pub fn min_elements(mut self, n: usize) -> OffloadConfig {
        self.min_elements = n;
        self
    }

    /// The last `n` layers of each chunk keep their activations (default 2): their backward
    /// comes right after their forward, so a copy out and back would only stall it. With one
    /// layer kept, the next-to-last layer's copy saves nothing: the backward prefetches it while
    /// the last layer's activations are still there, which is the peak a margin of two has
    /// anyway (`Summary::expected_peak_saving`); two keep the same peak with one layer fewer
    /// copied.
    pub fn margin(mut self, n: usize) -> OffloadConfig {
        self.margin = n;
        self
    }

    /// At most `bytes` offloaded per chunk (host memory), earlier layers first.
    pub fn max_bytes(mut self, bytes: usize) -> OffloadConfig {
        self.max_bytes = Some(bytes);
        self
    }

    /// How tensors are chosen (default [`Policy::Listed`]).
    pub fn policy(mut self, policy: Policy) -> OffloadConfig {
        self.policy = policy;
        self
    }

    /// Queues the copies of groups committed by eager modules and issues them after the next
    /// graph launch (Megatron's `delay_offload_until_cuda_graph`), so that their launches run
    /// while the graph does; the queue is drained when the chunk's backward begins.
    pub fn delay_eager_commits(mut self, yes: bool) -> OffloadConfig {
        self.delay_eager_commits = yes;
        self
    }

    /// The share of a layer's measured time that the automatic policy fills with copies
    /// (default 1.0: on the H200 at `L`, filling the whole window cost 1.9% of the step and saved
    /// 448 MiB, 0.8 cost 0.2% and saved 320 MiB, both with windows timed eagerly). Lower it
    /// where eager windows include launch gaps that graphs remove (an eagerly recorded policy);
    /// what copies cost the kernels they overlap is [`max_overhead`](OffloadConfig::max_overhead)'s.
    pub fn slack(mut self, share: f64) -> OffloadConfig {
        self.slack = share;
        self
    }

    /// The share of the measured step that the automatic policy's copies may cost (default
    /// 0.01): the window probe times each pass with one layer's candidate copies running beside
    /// it, and again with a small copy in its graph's tail, and the policy charges each copy it
    /// picks its share of the first difference, and each offloading layer once the second
    /// (docs/offload.md). The default leaves room for what that model misses: on an H100 at `M`
    /// it expected one offloading layer's cost within 0.2% of the step, but two layers' at about
    /// half of what they measured (1.3–1.6% expected, 2.1–3.3% measured).
    pub fn max_overhead(mut self, share: f64) -> OffloadConfig {
        self.max_overhead = share;
        self
    }

    /// Whether the graphs can keep offloaded tensors on the device later without a new capture
    /// ([`OffloadManager::keep_resident`](super::OffloadManager::keep_resident); default off).
    /// Each offloaded tensor's graphs then also hold a device copy of it out and one back, both
    /// captured turned off, naming a scratch buffer the manager holds (two, each as long as the
    /// largest offloaded tensor): nothing runs for them until a switch points them at memory of
    /// the tensor's own and turns the host copies off.
    pub fn switchable(mut self, yes: bool) -> OffloadConfig {
        self.switchable = yes;
        self
    }

    /// Checks every value.
    ///
    /// # Errors
    /// [`OffloadErrorKind::BadSelector`] for a selector that is not `module.tensor` or
    /// `module.*`, [`OffloadErrorKind::Slack`] for a slack outside (0, 1] or a maximal overhead
    /// outside [0, 1].
    pub fn validate(&self) -> Result<()> {
        for s in &self.sites {
            match s.split_once('.') {
                Some((m, t)) if !m.is_empty() && !t.is_empty() && !t.contains('.') => {}
                _ => return Err(Error::Offload(OffloadErrorKind::BadSelector { selector: s.clone() })),
            }
        }
        if !(self.slack > 0.0 && self.slack <= 1.0) {
            return Err(Error::Offload(OffloadErrorKind::Slack { slack: self.slack }));
        }
        if !(0.0..=1.0).contains(&self.max_overhead) {
            return Err(Error::Offload(OffloadErrorKind::MaxOverhead { share: self.max_overhead }));
        }
        Ok(())
    }

    /// The first site selector that selects none of the `saved` tensors (`(site, name)` pairs of
    /// everything the model saved, offloadable or not), with what it could have selected: a
    /// misspelt selector would otherwise offload nothing without a word.
    pub(crate) fn unmatched<'a>(&self, saved: impl Iterator<Item = (&'a str, &'a str)> + Clone) -> Option<Error> {
        if !self.exact_sites {
            return None;
        }
        let bad = self.sites.iter().find(|sel| !saved.clone().any(|(site, name)| selector_selects(sel, site, name)))?;
        let mut known: Vec<String> =
            saved.map(|(site, name)| format!("{}.{name}", site.rsplit('.').next().unwrap_or(site))).collect();
        known.sort();
        known.dedup();
        Some(Error::Offload(OffloadErrorKind::UnmatchedSelector { selector: bad.clone(), saved: known }))
    }

    /// Whether the tensor `name` saved at `site` is selected.
    pub(crate) fn selects(&self, site: &str, name: &str) -> bool {
        self.sites.iter().any(|sel| selector_selects(sel, site, name))
    }
}

/// Whether selector `sel` (`module.tensor` or `module.*`) selects tensor `name` saved at `site`
/// (whose module is the last part of its name).
fn selector_selects(sel: &str, site: &str, name: &str) -> bool {
    let module = site.rsplit('.').next().unwrap_or(site);
    match sel.split_once('.') {
        Some((m, t)) => m == module && (t == "*" || t == name),
        None => false,
    }
}
