//! A small transformer stack with its optimizer, twin-built for eager and graphed runs, and
//! callables and save hooks that plant what the tests need.

use std::sync::Mutex;

use graphed::device::{Device, Event, Stream};
use graphed::graph::{Callable, GraphedCallable, Inputs, Replay, Saved, Tails};
use graphed::memory::CachingAllocator;
use graphed::nn::{DropoutSpec, KeepOnDevice, Module, Param, ParamStore, SaveHook, TransformerLayer};
use graphed::ops::adamw::{adamw_step, AdamW};
use graphed::ops::cast::residual_add;
use graphed::ops::{elementwise, rng};
use graphed::tensor::Tensor;

pub use super::common::lcg;

pub type Result<T = ()> = anyhow::Result<T>;

/// Batch, sequence, width; heads; layers; dropout.
pub const SHAPE: [usize; 3] = [2, 4, 16];
const HEADS: usize = 2;
pub const LAYERS: usize = 2;
const DROPOUT: f32 = 0.25;

/// A stack of transformer layers, its parameters, step counter and AdamW state.
pub struct Stack {
    pub s: Stream,
    pub alloc: CachingAllocator,
    pub store: ParamStore,
    pub layers: Vec<TransformerLayer>,
    pub step: Tensor<u64>,
    m: Tensor<f32>,
    v: Tensor<f32>,
    lr: Tensor<f32>,
    t: Tensor<u64>,
}

impl Stack {
    /// The same parameters and dropout seeds on every call.
    pub fn new(dev: &Device) -> Result<Stack> {
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let c = SHAPE[2];
        let mut store = ParamStore::new(&alloc, &s, LAYERS * (12 * c * c + 13 * c))?;
        let step = Tensor::zeros(&alloc, &s, &[1])?;
        let mut layers = Vec::new();
        for l in 0..LAYERS {
            let spec = DropoutSpec { p: DROPOUT, seed: 77, site: 2 * l as u32, step: step.clone() };
            layers.push(TransformerLayer::new(
                &mut store,
                &alloc,
                &format!("h{l}"),
                (c, HEADS),
                &spec,
                10 + l as u64,
                &s,
            )?);
        }
        let n = store.values()?.numel();
        let (m, v) = (Tensor::zeros(&alloc, &s, &[n])?, Tensor::zeros(&alloc, &s, &[n])?);
        let lr = Tensor::from_host(&alloc, &s, &[1e-2f32], &[1])?;
        let t = Tensor::zeros(&alloc, &s, &[1])?;
        Ok(Stack { s, alloc, store, layers, step, m, v, lr, t })
    }

    pub fn callables(&self) -> Vec<&dyn Callable> {
        self.layers.iter().map(|l| l as &dyn Callable).collect()
    }

    /// Microbatch `k`'s input and upstream gradient: new values every microbatch.
    pub fn data(&self, k: u64) -> Result<(Tensor<f32>, Tensor<f32>)> {
        let n: usize = SHAPE.iter().product();
        let x = Tensor::from_host(&self.alloc, &self.s, &lcg(n, 100 + k), &SHAPE)?;
        let dy = Tensor::from_host(&self.alloc, &self.s, &lcg(n, 200 + k), &SHAPE)?;
        Ok((x, dy))
    }

    /// One eager microbatch: the step counter advanced, forward, backward; returns (y, dx).
    pub fn eager(&self, x: &Tensor<f32>, dy: &Tensor<f32>) -> Result<(Vec<f32>, Vec<f32>)> {
        rng::step_add(&self.step, 1, &self.s)?;
        let mut h = x.clone();
        let mut ctxs = Vec::new();
        for l in &self.layers {
            let (mut out, ctx) = Module::forward(l, &[&h], &KeepOnDevice, &self.s)?;
            h = out.remove(0);
            ctxs.push(ctx);
        }
        let y = h.to_vec(&self.s)?;
        let mut d = dy.clone();
        for (l, ctx) in self.layers.iter().zip(ctxs).rev() {
            d = Module::backward(l, ctx, &[&d], &self.s)?.remove(0);
        }
        Ok((y, d.to_vec(&self.s)?))
    }

    /// One graphed microbatch, every replay as `replay` says; tails joined at the end.
    pub fn graphed(
        &self,
        g: &mut [GraphedCallable],
        x: &Tensor<f32>,
        dy: &Tensor<f32>,
        replay: Replay<'_>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        rng::step_add(&self.step, 1, &self.s)?;
        let mut tails = Tails::new();
        let mut h = x.clone();
        for gi in g.iter_mut() {
            let (y, tail) = gi.forward(&self.s, &Inputs::args(&[&h]), replay)?;
            tails.push(tail);
            h = y[0].get()?.clone();
        }
        let y = h.to_vec(&self.s)?;
        let mut d = dy.clone();
        for gi in g.iter_mut().rev() {
            let (dx, tail) = gi.backward(&self.s, &[&d])?;
            tails.push(tail);
            d = dx[0].as_ref().ok_or_else(|| anyhow::anyhow!("no input gradient"))?.get()?.clone();
        }
        let dx = d.to_vec(&self.s)?;
        tails.join(&self.s)?;
        Ok((y, dx))
    }

    /// AdamW over every parameter, then the gradients zeroed.
    pub fn optimizer_step(&self) -> Result {
        let (p, g) = (self.store.values()?, self.store.grads()?);
        rng::step_add(&self.t, 1, &self.s)?;
        adamw_step(&p, &g, &self.m, &self.v, &self.lr, &self.t, &AdamW::default(), &self.s)?;
        self.s.memset(g.view()?, 0)?;
        Ok(())
    }

    pub fn params(&self) -> Result<Vec<f32>> {
        Ok(self.store.values()?.to_vec(&self.s)?)
    }

    pub fn grads(&self) -> Result<Vec<f32>> {
        Ok(self.store.grads()?.to_vec(&self.s)?)
    }
}

/// `y = x + shift` with `shift` a named input; `dx = dy`, `dshift = dy`. One parameter, `p`,
/// whose gradient gets 1 added per backward, so that the callable has a parameter surface.
pub struct Shifted {
    pub p: Param,
    alloc: CachingAllocator,
    /// Whether the backward returns a gradient for the positional input.
    pub grad_x: bool,
}

impl Shifted {
    pub fn new(store: &mut ParamStore, alloc: &CachingAllocator, s: &Stream) -> Result<Shifted> {
        let p = store.add("shifted.p", &[1], &[0.0], s)?;
        Ok(Shifted { p, alloc: alloc.clone(), grad_x: true })
    }

    fn copy(&self, x: &Tensor<f32>, s: &Stream) -> graphed::Result<Tensor<f32>> {
        let y = Tensor::uninit(&self.alloc, s, x.shape())?;
        s.copy_d2d(x.view()?, y.view()?)?;
        Ok(y)
    }
}

impl Callable for Shifted {
    fn forward(&self, inputs: &Inputs, _hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor<f32>>, Saved)> {
        let x = inputs.positional().next().expect("one positional input");
        let shift = inputs.get("shift").expect("a shift");
        let y = Tensor::uninit(&self.alloc, s, x.shape())?;
        residual_add(&y, x, shift, s)?;
        Ok((vec![y], Box::new(())))
    }

    fn backward(&self, _saved: Saved, dys: &[&Tensor<f32>], s: &Stream) -> graphed::Result<Vec<Option<Tensor<f32>>>> {
        let dx = self.copy(dys[0], s)?;
        let dshift = self.copy(dys[0], s)?;
        elementwise::add_scalar(self.p.grad.view()?, 1.0, s)?;
        Ok(vec![self.grad_x.then_some(dx), Some(dshift)])
    }

    fn parameters(&self) -> Vec<&Param> {
        vec![&self.p]
    }
}

/// What a planted tail does with the tensors it is given to save.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TailWork {
    /// Fills and scales scratch memory of the pool, many times (a legal, long tail).
    Churn(usize),
    /// Reads the saved tensor (for a Linear, its input: a static surface).
    ReadSaved,
    /// Writes the saved tensor.
    WriteSaved,
}

/// A save hook that forks a stream at the first save of each pass, gives it `work`, and joins it
/// in `end_pass`, after the sync event: the Megatron offload protocol, with planted work.
pub struct TailHook {
    side: Stream,
    alloc: CachingAllocator,
    work: TailWork,
    forked: Mutex<bool>,
    /// Recorded (externally) again in `end_pass`, to plant a second record.
    pub extra_record: Option<Event>,
    /// Waited on (externally) in `end_pass`, to plant an external wait.
    pub extra_wait: Option<Event>,
}

impl TailHook {
    pub fn new(dev: &Device, alloc: &CachingAllocator, work: TailWork) -> Result<TailHook> {
        let side = dev.stream()?;
        Ok(TailHook {
            side,
            alloc: alloc.clone(),
            work,
            forked: Mutex::new(false),
            extra_record: None,
            extra_wait: None,
        })
    }

    fn fork(&self, stream: &Stream) -> graphed::Result<bool> {
        let mut forked = self.forked.lock().unwrap();
        if !*forked && stream.capture_id()?.is_some() {
            let e = stream.device().event()?;
            stream.record(&e)?;
            self.side.wait(&e)?;
            *forked = true;
            return Ok(true);
        }
        Ok(false)
    }
}

impl SaveHook for TailHook {
    fn save(&self, _name: &str, t: Tensor<f32>, stream: &Stream) -> graphed::Result<Tensor<f32>> {
        if !self.fork(stream)? {
            return Ok(t);
        }
        match self.work {
            TailWork::Churn(n) => {
                let scratch = Tensor::uninit(&self.alloc, &self.side, &[1 << 20])?;
                elementwise::fill(scratch.view()?, 1.0, &self.side)?;
                for _ in 0..n {
                    elementwise::scale(scratch.view()?, scratch.view()?, 1.0, &self.side)?;
                }
            }
            TailWork::ReadSaved => {
                let scratch = Tensor::uninit(&self.alloc, &self.side, t.shape())?;
                self.side.copy_d2d(t.view()?, scratch.view()?)?;
            }
            TailWork::WriteSaved => elementwise::fill(t.view()?, 0.0, &self.side)?,
        }
        Ok(t)
    }

    fn end_pass(&self, stream: &Stream) -> graphed::Result<()> {
        if let Some(e) = &self.extra_record {
            stream.record_external(e)?;
        }
        if let Some(e) = &self.extra_wait {
            stream.wait_external(e)?;
        }
        let mut forked = self.forked.lock().unwrap();
        if *forked {
            let e = stream.device().event()?;
            self.side.record(&e)?;
            stream.wait(&e)?;
            *forked = false;
        }
        Ok(())
    }
}
