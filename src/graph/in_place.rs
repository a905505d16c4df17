//! Replays that read the caller's tensors where they are instead of copying them into the static
//! inputs: the graphs' nodes that read a static input are rebound to the caller's tensor
//! ([`Rebind`]), which costs a few driver calls when the tensor changes and none when it does not.
//!
//! A static input can be read in place when every node that names it only reads it, through our
//! own kernels or copies (a GEMM's or attention's operand cannot be moved: cuBLASLt and cuDNN
//! lay out their own arguments), and when no graph of another callable reads it (an activation
//! offloaded by the next layer's graph, say): that graph would go on reading the static buffer.
//! Which inputs qualify is decided once, at capture; the others are copied in as before.

use super::graphed::{GraphedCallable, Pass};
use super::replay::{Route, StaticTensor, Tail};
use super::Replay;
use std::sync::atomic::Ordering;

use crate::device::patch::Resolved;
use crate::device::{Graph, RebindErrorKind, Stream};
use crate::memory::PoolExec;
use crate::nn::Inputs;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The passes of a callable whose graphs read one of its static tensors, each with the uses
/// that read it (found once, at capture, so that a replay moves them with no search), if the
/// tensor can be read in place (none read it: an empty list); `None` when it must be copied in.
pub(crate) type Readers = Option<Vec<(Pass, Resolved)>>;

/// The readers of static tensor `t` of callable `mine` among the graphs of every callable
/// captured with it (`all`, by callable, each graph with its pass).
pub(crate) fn readers(all: &[Vec<(Pass, &Graph)>], mine: usize, t: &Tensor) -> Readers {
    let identity = t.rebind_to(t).ok()?;
    let mut passes = Vec::new();
    for (i, graphs) in all.iter().enumerate() {
        for (pass, graph) in graphs.iter().filter(|(_, g)| g.names(t.id())) {
            match graph.resolve(&identity) {
                Ok(uses) if i == mine => passes.push((*pass, uses)),
                Err(Error::Rebind { kind: RebindErrorKind::NotRead { .. }, .. }) => {}
                _ => return None,
            }
        }
    }
    Some(passes)
}

impl GraphedCallable {
    /// Per static input, in [`Inputs::iter`] order, whether
    /// [`forward_in_place`](GraphedCallable::forward_in_place) reads the caller's tensor where it
    /// is (the others are copied in).
    ///
    /// # Errors
    /// [`GraphedErrorKind::Released`](super::GraphedErrorKind::Released) after
    /// [`release_static_state`](GraphedCallable::release_static_state).
    pub fn in_place_inputs(&self) -> Result<Vec<bool>> {
        Ok(self.state()?.inputs.iter().map(|s| s.readers.is_some()).collect())
    }

    /// Per output gradient, whether [`backward_in_place`](GraphedCallable::backward_in_place)
    /// reads the caller's tensor where it is (the others are copied in).
    ///
    /// # Errors
    /// As [`in_place_inputs`](GraphedCallable::in_place_inputs).
    pub fn in_place_grad_outputs(&self) -> Result<Vec<bool>> {
        Ok(self.state()?.grad_readers.iter().map(Option::is_some).collect())
    }

    /// As [`forward`](GraphedCallable::forward), reading the inputs that
    /// [`in_place_inputs`](GraphedCallable::in_place_inputs) marks where they are instead of
    /// copying them in: nothing is copied for them, and the results are bit for bit those of
    /// `forward`. The backward of this forward reads them too (what the forward saved of them).
    ///
    /// The graphs read the tensors while they run, as eager work does: keep them unchanged until
    /// the backward replay that pairs with this forward has run (and its tail was joined), as an
    /// eager module's saved tensors must be. The graphs hold them until a later replay feeds
    /// other tensors. Another graphed call's output qualifies only if no replay before that
    /// backward rewrites it: the outputs a schedule with buffer reuse shares with later graphs
    /// do get rewritten, and [`StaticTensor::get`] can only say so when it is called.
    ///
    /// # Errors
    /// As [`forward`](GraphedCallable::forward); nothing is rebound, copied or enqueued then.
    pub fn forward_in_place(
        &self,
        caller: &Stream,
        inputs: &Inputs,
        replay: Replay<'_>,
    ) -> Result<(Vec<StaticTensor>, Tail)> {
        self.forward_fed(caller, inputs, replay, true)
    }

    /// As [`backward`](GraphedCallable::backward), reading the output gradients that
    /// [`in_place_grad_outputs`](GraphedCallable::in_place_grad_outputs) marks where they are
    /// (keep them unchanged until the replay has run).
    ///
    /// # Errors
    /// As [`backward`](GraphedCallable::backward).
    pub fn backward_in_place(
        &self,
        caller: &Stream,
        grad_outputs: &[&Tensor],
    ) -> Result<(Vec<Option<StaticTensor>>, Tail)> {
        self.backward_fed(caller, grad_outputs, self.last_route(), true)
    }

    /// How many graph nodes the last replay (forward or backward, in place or copying in)
    /// pointed at other tensors: none when it read the tensors the one before read, so a loop
    /// that feeds the same tensors every step rebinds once.
    pub fn rebound_nodes(&self) -> usize {
        self.rebound.load(Ordering::Relaxed)
    }

    pub(crate) fn forward_fed(
        &self,
        caller: &Stream,
        inputs: &Inputs,
        replay: Replay<'_>,
        in_place: bool,
    ) -> Result<(Vec<StaticTensor>, Tail)> {
        self.refuse_in_stack()?;
        self.exec(Pass::Forward)?;
        let route = self.route_for(caller, replay)?;
        let sources = self.match_inputs(inputs)?;
        let state = self.state()?;
        let statics: Vec<&Tensor> = state.inputs.iter().map(|s| &s.input.tensor).collect();
        let readers: Vec<&Readers> = state.inputs.iter().map(|s| &s.readers).collect();
        let tail = self.replay(Pass::Forward, caller, &route, (&sources, &statics), &readers, in_place)?;
        Ok((self.static_outputs()?, tail))
    }

    pub(crate) fn backward_fed(
        &self,
        caller: &Stream,
        grad_outputs: &[&Tensor],
        route: Route,
        in_place: bool,
    ) -> Result<(Vec<Option<StaticTensor>>, Tail)> {
        self.refuse_in_stack()?;
        self.exec(Pass::Backward)?;
        let sources = self.match_grad_outputs(grad_outputs)?;
        let state = self.state()?;
        let statics: Vec<&Tensor> = state.grad_outputs.iter().collect();
        let readers: Vec<&Readers> = state.grad_readers.iter().collect();
        let tail = self.replay(Pass::Backward, caller, &route, (&sources, &statics), &readers, in_place)?;
        Ok((self.static_grad_inputs()?, tail))
    }

    /// Replays `pass` under `route` with each static tensor of `statics` fed from its source
    /// ([`bind_sources`](Self::bind_sources)): the pool's order (R5) and the edges are checked
    /// first, so a refused replay rebinds, copies and enqueues nothing.
    pub(crate) fn replay(
        &self,
        pass: Pass,
        caller: &Stream,
        route: &Route,
        (sources, statics): (&[Option<&Tensor>], &[&Tensor]),
        readers: &[&Readers],
        in_place: bool,
    ) -> Result<Tail> {
        let exec = self.exec(pass)?;
        PoolExec::check_launches(&[exec], route.stream(caller), caller)
            .map_err(|e| super::error::refusal(self.name(), e))?;
        self.check_edges(pass)?;
        let copies = self.bind_sources(sources, readers, in_place)?;
        self.replay_checked(pass, caller, route, &copies, statics)
    }

    /// Points the graphs that read each static tensor at its source, where `in_place`, the
    /// source is contiguous and the tensor qualifies (`readers`), and back at the static tensor
    /// otherwise; returns the sources still to copy in. Counts the nodes moved
    /// ([`rebound_nodes`](GraphedCallable::rebound_nodes)).
    pub(crate) fn bind_sources<'a>(
        &self,
        sources: &[Option<&'a Tensor>],
        readers: &[&Readers],
        in_place: bool,
    ) -> Result<Vec<Option<&'a Tensor>>> {
        let mut copies = sources.to_vec();
        let mut nodes = 0;
        for (k, readers) in readers.iter().enumerate() {
            let Some(passes) = readers else { continue };
            // Where the uses point: the source's bytes, or back at the static tensor, where
            // they were captured. The source's shape and type were matched to the static's.
            let to = match sources[k] {
                Some(src) if in_place && src.is_contiguous() => {
                    copies[k] = None;
                    Some(src.placement()?)
                }
                _ => None,
            };
            for (pass, uses) in passes {
                nodes += self.exec(*pass)?.rebind_resolved(&[(uses, to)])?;
            }
        }
        self.rebound.store(nodes, Ordering::Relaxed);
        Ok(copies)
    }

    /// The readers of the static tensor a stack feeds this layer in `pass`: its input (forward),
    /// or its output gradient (backward).
    pub(crate) fn fed_readers(&self, pass: Pass) -> Result<&Readers> {
        let state = self.state()?;
        let readers = match pass {
            Pass::Forward => state.inputs.first().map(|s| &s.readers),
            _ => state.grad_readers.first(),
        };
        Ok(readers.unwrap_or(&None))
    }
}
