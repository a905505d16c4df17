//! A transformer stack twin-built for eager, graphed and offloaded runs, and the steps the tests
//! take with it.

use anyhow::{anyhow, ensure};
use graphed::check::{Checker, Hazard};
use graphed::device::{DType, Device, Stream};
use graphed::graph::{make_graphed_stack, GraphOptions, GraphedStack, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    input_grad, AttentionKind, AttentionSpec, Builder, Chunk, Inputs, KeepOnDevice, Layers, Module, ParamStore,
    SaveHook, SavedTensor, Stack, TransformerLayer,
};
use graphed::offload::{OffloadConfig, OffloadManager};
use graphed::tensor::Tensor;
use std::sync::Mutex;

pub use super::common::lcg;

pub type Result<T = ()> = anyhow::Result<T>;

/// Heads of the layers.
/// Heads of 32 features, which the fused attention (the default form) runs.
const HEADS: usize = 1;

/// Sizes of a model: batch, sequence, width, layers.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub batch: usize,
    pub seq: usize,
    pub dim: usize,
    pub layers: usize,
    /// Dropout probability of every dropout.
    pub dropout: f32,
    /// The attention's form, which decides what it saves (`probs` only unfused).
    pub attention: AttentionKind,
}

/// The default sizes: each saved `(B·T, C)` tensor has 512 elements.
pub const DIMS: Dims = Dims { batch: 2, seq: 8, dim: 32, layers: 4, dropout: 0.1, attention: AttentionKind::Fused };

/// A stack of transformer layers (dropout on) and its parameters.
pub struct Model {
    pub dims: Dims,
    pub dtype: DType,
    pub s: Stream,
    pub alloc: CachingAllocator,
    pub store: ParamStore,
    pub stack: Stack<TransformerLayer>,
}

impl Model {
    /// The same parameters and dropout seeds on every call.
    pub fn new(dev: &Device, dims: Dims, dtype: DType) -> Result<Model> {
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let c = dims.dim;
        let store = ParamStore::with_dtype(&alloc, &s, dims.layers * TransformerLayer::parameter_count(c), dtype)?;
        let vb = Builder::new(&store, &alloc, &s)?.with_seed(3).with_dropout(dims.dropout, 5);
        let attention = AttentionSpec::new(c, HEADS).kind(dims.attention);
        let stack = Stack::new(TransformerLayer::stack(&vb, attention, &Layers::first(dims.layers))?);
        let stack = stack.with_rng_step(vb.step());
        Ok(Model { dims, dtype, s, alloc, store, stack })
    }

    pub fn shape(&self) -> [usize; 3] {
        [self.dims.batch, self.dims.seq, self.dims.dim]
    }

    /// Microbatch `k`'s input and upstream gradient.
    pub fn data(&self, k: u64) -> Result<(Tensor, Tensor)> {
        let shape = self.shape();
        let n: usize = shape.iter().product();
        let x = Tensor::from_f32(&self.alloc, &self.s, &lcg(n, 100 + k), &shape, self.dtype)?;
        let dy = Tensor::from_f32(&self.alloc, &self.s, &lcg(n, 200 + k), &shape, self.dtype)?;
        Ok((x, dy))
    }

    /// One eager microbatch through `hook`; returns (y, dx).
    pub fn eager(&self, hook: &dyn SaveHook, k: u64) -> Result<(Vec<f32>, Vec<f32>)> {
        let (x, dy) = self.data(k)?;
        let (y, ctx) = self.stack.forward(&Inputs::one(&x), hook, &self.s)?;
        let y = y[0].to_f32_vec(&self.s)?;
        let dx = input_grad("eager", self.stack.backward(ctx, &[&dy], &self.s)?)?;
        Ok((y, dx.to_f32_vec(&self.s)?))
    }

    /// The stack graphed with `options`.
    pub fn graph(&self, options: GraphOptions) -> Result<GraphedStack> {
        let (x0, _) = self.data(0)?;
        Ok(make_graphed_stack(&self.alloc, &self.stack, &x0, options)?)
    }

    /// One graphed microbatch, replayed as `replay` says, tails joined; returns (y, dx).
    pub fn graphed(&self, g: &GraphedStack, k: u64, replay: Replay<'_>) -> Result<(Vec<f32>, Vec<f32>)> {
        let (x, dy) = self.data(k)?;
        let y = g.forward(&self.s, &x, replay)?.get()?.to_f32_vec(&self.s)?;
        let dx = g.backward(&self.s, &dy)?.ok_or_else(|| anyhow!("no input gradient"))?;
        let dx = dx.get()?.to_f32_vec(&self.s)?;
        g.join(&self.s)?;
        Ok((y, dx))
    }

    /// The accumulated parameter gradients.
    pub fn grads(&self) -> Result<Vec<f32>> {
        Ok(self.store.grads()?.to_f32_vec(&self.s)?)
    }

    /// A manager for eager use, its policy recorded by one eager iteration on microbatch 0,
    /// whose gradients are then zeroed. Graphs need none: their capture records.
    pub fn offload(&self, config: OffloadConfig) -> Result<OffloadManager> {
        let m = OffloadManager::new(&self.alloc, config)?;
        self.eager(&m.chunk(Chunk::default()), 0)?;
        m.end_iteration(&self.s)?;
        self.store.grads()?.zero(&self.s)?;
        Ok(m)
    }

    /// One eager iteration on microbatch 0 without offloading, its gradients then zeroed: the
    /// twin of [`offload`](Model::offload)'s recording iteration (the dropout step counter
    /// advanced once).
    pub fn skip_first(&self) -> Result {
        self.eager(&KeepOnDevice, 0)?;
        self.store.grads()?.zero(&self.s)?;
        Ok(())
    }
}

/// The configuration the tests use: the default sites, tensors of at least 256 elements.
pub fn config() -> OffloadConfig {
    OffloadConfig::default().min_elements(256).margin(1)
}

/// Fails unless the device's checker reported at least one hazard, every one of them on an
/// operation named in `ops` (the planted one); forgets them.
pub fn expect_hazards_on(dev: &Device, ops: &[&str]) -> Result {
    let checker = Checker::of(dev).ok_or_else(|| anyhow!("the device has no checker"))?;
    let hazards: Vec<Hazard> = checker.take_hazards();
    ensure!(!hazards.is_empty(), "expected a hazard on {ops:?}, the checker reported none");
    let names = |h: &Hazard| [Some(h.later.op.to_string()), h.earlier.as_ref().map(|e| e.op.to_string())];
    for h in &hazards {
        ensure!(names(h).iter().flatten().any(|n| ops.iter().any(|o| n.contains(o))), "unexpected hazard: {h}");
    }
    Ok(())
}

/// Fails unless the checker reported nothing.
pub fn expect_clean(dev: &Device) -> Result {
    let hazards = Checker::of(dev).ok_or_else(|| anyhow!("the device has no checker"))?.hazards();
    ensure!(hazards.is_empty(), "hazards: {}", hazards.iter().map(|h| h.to_string()).collect::<Vec<_>>().join("\n"));
    Ok(())
}

/// A save hook that keeps a handle to every tensor it passes on, so that no copied-out memory is
/// freed: the host then never sees a copy out complete through the allocator's release, and a
/// missing wait shows as an unordered access (a planted hazard stays visible).
pub struct KeepAlive<H> {
    pub hook: H,
    kept: Mutex<Vec<Tensor>>,
}

impl<H: SaveHook> KeepAlive<H> {
    pub fn new(hook: H) -> KeepAlive<H> {
        KeepAlive { hook, kept: Mutex::new(Vec::new()) }
    }
}

impl<H: SaveHook> SaveHook for KeepAlive<H> {
    fn begin_forward(&self, stream: &Stream) -> graphed::Result<()> {
        self.hook.begin_forward(stream)
    }
    fn open_group(&self, site: &str) -> graphed::Result<()> {
        self.hook.open_group(site)
    }
    fn save(&self, name: &str, t: Tensor, stream: &Stream) -> graphed::Result<SavedTensor> {
        self.kept.lock().unwrap().push(t.clone());
        self.hook.save(name, t, stream)
    }
    fn commit_group(&self, site: &str, stream: &Stream) -> graphed::Result<()> {
        self.hook.commit_group(site, stream)
    }
}
