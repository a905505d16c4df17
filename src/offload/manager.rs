//! The offload manager: its copy streams, host buffers, chunks and policy.

use std::sync::Arc;

use super::chunk::{bake, ChunkHook};
use super::config::{OffloadConfig, Policy};
use super::error::OffloadErrorKind;
use super::host::HostBuffer;
use super::policy::{decide, GroupLayout, Summary, Timings};
use super::shared::{has_clock, Inner};
use super::state::{Fault, PassTiming};
use crate::device::{DType, Stream};
use crate::graph::GraphOptions;
use crate::memory::CachingAllocator;
use crate::nn::{Chunk, SaveHook};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Activation offloading, eager and inside captured graphs (Megatron-LM's fine-grained
/// offloading): a copy-out and a copy-back stream, pinned host buffers, one save hook per chunk,
/// and a policy decided after a warmup iteration and frozen before capture.
///
/// ```
/// use graphed::device::{DType, Device};
/// use graphed::graph::{make_graphed_stack, GraphOptions, Replay};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::{Builder, Chunk, Inputs, Layers, Module, ParamStore, Stack, TransformerLayer};
/// use graphed::offload::{OffloadConfig, OffloadManager};
/// use graphed::tensor::Tensor;
///
/// let dev = Device::sim();
/// let (main, side, ready) = (dev.stream()?, dev.stream()?, dev.event()?);
/// let alloc = CachingAllocator::new(&dev);
/// let store = ParamStore::new(&alloc, &main, 3 * TransformerLayer::parameter_count(32))?;
/// let vb = Builder::new(&store, &alloc, &main)?;
/// let stack = Stack::new(TransformerLayer::stack(&vb, (32, 1), &Layers::first(3))?);
/// let x = Tensor::zeros(&alloc, &main, &[2, 4, 32], DType::F32)?;
/// let dy = Tensor::zeros(&alloc, &main, &[2, 4, 32], DType::F32)?;
///
/// let offload = OffloadManager::new(&alloc, OffloadConfig::default().min_elements(64))?;
/// // The warmup iteration records what every module saves; `end_iteration` freezes the policy.
/// let hook = offload.chunk(Chunk::default());
/// let (_, ctx) = stack.forward(&Inputs::one(&x), &hook, &main)?;
/// stack.backward(ctx, &[&dy], &main)?;
/// offload.end_iteration(&main)?;
/// assert!(offload.summary().unwrap().offloaded_bytes() > 0);
///
/// // The copies run inside the graphs, as their tails.
/// let options = offload.graph_options(GraphOptions::default().sync_event(&ready))?;
/// let graphed = make_graphed_stack(&alloc, &stack, &x, options)?;
/// graphed.forward(&main, &x, Replay::side(&side))?;
/// graphed.backward(&main, &dy)?;
/// graphed.join(&main)?;
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone)]
pub struct OffloadManager {
    inner: Arc<Inner>,
}

/// The bytes a bandwidth probe copies each way.
const PROBE_BYTES: usize = 64 << 20;

impl OffloadManager {
    /// A manager on `alloc`'s device, with its own copy streams.
    ///
    /// # Errors
    /// [`OffloadErrorKind::BadSelector`] or [`OffloadErrorKind::Slack`] for an invalid
    /// configuration; device errors.
    pub fn new(alloc: &CachingAllocator, config: OffloadConfig) -> Result<OffloadManager> {
        config.validate()?;
        Ok(OffloadManager { inner: Arc::new(Inner::new(alloc, config)?) })
    }

    /// The save hook of `chunk`, for its eager forward. The first iteration through the chunk
    /// hooks records what is saved (and keeps it on the device); later ones offload.
    pub fn chunk(&self, chunk: Chunk) -> ChunkHook {
        ChunkHook { inner: self.inner.clone(), chunk, baked: None }
    }

    /// `options` with this manager as the graphs' save hook: a hook per captured chunk holding
    /// host buffers for its graphs (they live as long as the graphs), and offloading off during
    /// the capture's warmup (`pre_warmup`/`post_warmup`, which this replaces; call
    /// [`disable`](OffloadManager::disable) and [`enable`](OffloadManager::enable) from your own
    /// hooks instead). Give the options a sync event, so that side-stream replays overlap the
    /// copies in each graph's tail.
    ///
    /// # Errors
    /// [`OffloadErrorKind::NotFrozen`] before the warmup iteration ended.
    pub fn graph_options(&self, options: GraphOptions) -> Result<GraphOptions> {
        if !self.inner.lock().frozen {
            return Err(Error::Offload(OffloadErrorKind::NotFrozen));
        }
        let (handler, off, on) = (self.clone(), self.clone(), self.clone());
        Ok(options
            .init_chunk_handler(move |chunk| handler.graph_hook(chunk))
            .pre_warmup(move |_| {
                off.disable();
                Ok(())
            })
            .post_warmup(move |_| {
                on.enable();
                Ok(())
            }))
    }

    /// The hook of `chunk` for its graphs, with host buffers baked for them.
    fn graph_hook(&self, chunk: Chunk) -> Result<Arc<dyn SaveHook>> {
        let st = self.inner.lock();
        let Some(c) = st.chunks.get(&chunk) else {
            let (expected, found) = ("nothing (the chunk was not in it)".into(), "a capture".into());
            return Err(Error::Offload(OffloadErrorKind::Schedule { chunk, expected, found }));
        };
        let baked = bake(self.inner.alloc.device(), &c.layout)?;
        Ok(Arc::new(ChunkHook { inner: self.inner.clone(), chunk, baked: Some(Arc::new(baked)) }))
    }

    /// Turns offloading off: every hook keeps tensors on the device and its state stays as it
    /// is (for a graph capture's warmup, which runs the modules in its own order).
    pub fn disable(&self) {
        self.inner.lock().enabled = false;
    }

    /// Turns offloading on again.
    pub fn enable(&self) {
        self.inner.lock().enabled = true;
    }

    /// Leaves a step of the protocol out from now on, so that a test can show what catches the
    /// hazard it guards against (like
    /// [`GraphPool::disable_order_check`](crate::memory::GraphPool::disable_order_check)); never
    /// for training.
    pub fn inject(&self, fault: Fault) {
        self.inner.lock().fault = Some(fault);
    }

    /// Ends an iteration (every chunk's forward and backward), on the compute `stream`. After
    /// the first, the warmup iteration, decides and freezes the policy (timing the copies for
    /// the automatic policy).
    ///
    /// # Errors
    /// [`OffloadErrorKind::Pending`] when saved tensors were not taken back or delayed copies
    /// are queued (the manager releases them; the policy is not frozen on that iteration);
    /// [`OffloadErrorKind::NoClock`] for the automatic policy on the simulator.
    pub fn end_iteration(&self, stream: &Stream) -> Result<()> {
        let mut st = self.inner.lock();
        let pending: usize = st.chunks.values().map(|c| c.pending()).sum();
        let delayed = std::mem::take(&mut st.delayed).len();
        let timings: Vec<(Chunk, Option<PassTiming>)> =
            st.chunks.iter_mut().map(|(k, c)| (*k, c.timing.take())).collect();
        for c in st.chunks.values_mut() {
            c.restart();
        }
        if pending + delayed > 0 {
            if !st.frozen {
                st.chunks.clear();
            }
            let what = format!("{pending} groups not taken back and {delayed} delayed copies");
            return Err(Error::Offload(OffloadErrorKind::Pending { what }));
        }
        if st.frozen {
            return Ok(());
        }
        let config = &self.inner.config;
        let saved = st
            .chunks
            .values()
            .flat_map(|c| c.layout.iter())
            .flat_map(|g| g.tensors.iter().map(move |t| (g.site.as_str(), t.name.as_str())));
        if let Some(e) = config.unmatched(saved) {
            st.chunks.clear();
            return Err(e);
        }
        let timings = match config.policy {
            Policy::Listed => None,
            Policy::Auto if !has_clock(self.inner.alloc.device().kind()) => {
                st.chunks.clear();
                return Err(Error::Offload(OffloadErrorKind::NoClock));
            }
            Policy::Auto => Some(self.measure(stream, timings)?),
        };
        for c in st.chunks.values_mut() {
            decide(config, &mut c.layout, timings.as_ref());
            c.offloads = c.layout.iter().any(|g| g.offloaded_bytes() > 0);
        }
        let layouts: Vec<(Chunk, &[GroupLayout])> = st.chunks.iter().map(|(k, c)| (*k, c.layout.as_slice())).collect();
        let summary = Summary::from_layouts(&layouts, timings.as_ref(), config);
        st.summary = Some(summary);
        st.frozen = true;
        Ok(())
    }

    /// The warmup's unit times (the slowest chunk's, per unit) and the copy bandwidths.
    fn measure(&self, stream: &Stream, timings: Vec<(Chunk, Option<PassTiming>)>) -> Result<Timings> {
        let end = stream.device().timing_event()?;
        stream.record(&end)?;
        end.synchronize()?;
        let (mut forward_ms, mut backward_ms) = (Vec::<f64>::new(), Vec::<f64>::new());
        let keep = |v: &mut Vec<f64>, p: usize, ms: f32| {
            if v.len() <= p {
                v.resize(p + 1, 0.0);
            }
            v[p] = v[p].max(f64::from(ms));
        };
        for (_, t) in timings {
            let Some(t) = t else { continue };
            for (p, e) in t.forward.iter().enumerate() {
                let next = t.forward.get(p + 1).or_else(|| t.backward.values().next_back()).unwrap_or(&end);
                keep(&mut forward_ms, p, e.elapsed_ms(next)?);
            }
            for (&p, e) in &t.backward {
                let next = p.checked_sub(1).and_then(|q| t.backward.get(&q)).unwrap_or(&end);
                keep(&mut backward_ms, p, e.elapsed_ms(next)?);
            }
        }
        let (out, back) = self.probe_bandwidth(stream)?;
        Ok(Timings { forward_ms, backward_ms, out_bytes_per_ms: out, in_bytes_per_ms: back })
    }

    /// Bytes per millisecond of a pinned copy each way on the copy streams (the best of three).
    pub fn probe_bandwidth(&self, stream: &Stream) -> Result<(f64, f64)> {
        let dev = stream.device();
        let len = PROBE_BYTES / 2;
        let host = HostBuffer::new(dev, DType::BF16, len)?;
        let t = Tensor::zeros(&self.inner.alloc, stream, &[len], DType::BF16)?;
        stream.synchronize()?;
        let time = |s: &Stream, copy: &dyn Fn(&Stream) -> Result<()>| -> Result<f64> {
            Ok(PROBE_BYTES as f64 / fastest_of_three(s, &|| copy(s))?)
        };
        let out = time(&self.inner.d2h, &|s| host.copy_out(&t, s))?;
        let back = time(&self.inner.h2d, &|s| host.copy_in(&t, s))?;
        Ok((out, back))
    }

    /// Bytes per millisecond of copies of `sizes` bytes each, captured in one graph on the copy
    /// streams forked from `stream` as the offload graphs do, each way (the best of three
    /// replays): the in-graph copy rate with nothing else running, to hold against
    /// [`probe_bandwidth`](OffloadManager::probe_bandwidth).
    pub fn probe_graph_bandwidth(&self, stream: &Stream, sizes: &[usize]) -> Result<(f64, f64)> {
        let (dev, alloc) = (stream.device(), &self.inner.alloc);
        let mut pairs = Vec::with_capacity(sizes.len());
        for &bytes in sizes {
            let n = bytes / DType::BF16.size();
            pairs.push((HostBuffer::new(dev, DType::BF16, n)?, Tensor::zeros(alloc, stream, &[n], DType::BF16)?));
        }
        stream.synchronize()?;
        let total: usize = pairs.iter().map(|(h, _)| h.bytes()).sum();
        let rate = |side: &Stream, copy: &dyn Fn(&HostBuffer, &Tensor) -> Result<()>| -> Result<f64> {
            // A pool of its own: the graph replays three times in a row.
            let cap = alloc.capture(stream, crate::device::CaptureMode::ThreadLocal, &alloc.new_pool())?;
            side.wait_stream(stream)?;
            for (h, t) in &pairs {
                copy(h, t)?;
            }
            stream.wait_stream(side)?;
            let exec = cap.finish()?.instantiate()?;
            Ok(total as f64 / fastest_of_three(stream, &|| exec.launch(stream))?)
        };
        let out = rate(&self.inner.d2h, &|h, t| h.copy_out(t, &self.inner.d2h))?;
        let back = rate(&self.inner.h2d, &|h, t| h.copy_in(t, &self.inner.h2d))?;
        Ok((out, back))
    }

    /// The frozen policy's summary (`None` before the warmup iteration ended).
    pub fn summary(&self) -> Option<Summary> {
        self.inner.lock().summary.clone()
    }

    /// The recorded groups of `chunk`, with the policy's decisions once frozen.
    pub fn layout(&self, chunk: Chunk) -> Vec<GroupLayout> {
        self.inner.lock().chunks.get(&chunk).map(|c| c.layout.clone()).unwrap_or_default()
    }

    /// Bytes copied to host memory since the manager was made (eager copies and captures, not
    /// replays) and bytes of pinned host memory in its pool.
    pub fn stats(&self) -> OffloadStats {
        let st = self.inner.lock();
        OffloadStats { copied_out: st.copied_out, host_pool_bytes: st.host.bytes }
    }
}

/// The milliseconds of the fastest of three runs of `work` on `stream`, timed by events there
/// (never below a nanosecond, so that rates stay finite).
fn fastest_of_three(stream: &Stream, work: &dyn Fn() -> Result<()>) -> Result<f64> {
    let dev = stream.device();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let (a, b) = (dev.timing_event()?, dev.timing_event()?);
        stream.record(&a)?;
        work()?;
        stream.record(&b)?;
        b.synchronize()?;
        best = best.min(f64::from(a.elapsed_ms(&b)?));
    }
    Ok(best.max(1e-6))
}

/// Byte counts of an [`OffloadManager`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadStats {
    /// Bytes copied to host memory by eager iterations and captures.
    pub copied_out: usize,
    /// Pinned bytes in the eager pool.
    pub host_pool_bytes: usize,
}

impl std::fmt::Debug for OffloadManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadManager").field("config", &self.inner.config).finish_non_exhaustive()
    }
}
