//! A small transformer stack with its optimizer, twin-built for eager and graphed runs, and
//! modules and save hooks that plant what the tests need.

use graphed::device::DType;
use std::sync::Mutex;

use graphed::device::{Device, Event, Stream};
use graphed::graph::{make_graphed_stack, Callable, GraphOptions, GraphedCallable, GraphedStack, Replay};
use graphed::memory::CachingAllocator;
use graphed::nn::{
    backward_pass, forward_pass, input_grad, Builder, DelayedRecipe, Fp8Recipe, Fp8Scaling, Fp8Training, Inputs,
    KeepOnDevice, Layers, Module, Param, ParamStore, Recompute, SaveHook, SavedTensor, Stack, TransformerLayer,
    Traverse,
};
use graphed::ops::cast::residual_add;
use graphed::ops::elementwise;
use graphed::ops::fp8::Fp8Format;
use graphed::optim::{AdamW, AdamWHyper, LrSchedule};
use graphed::tensor::Tensor;

pub use super::common::lcg;

pub type Result<T = ()> = anyhow::Result<T>;

/// Batch, sequence, width; heads; layers; dropout.
pub const SHAPE: [usize; 3] = [2, 4, 32];
/// [`Model::fp8`]'s: 16 tokens.
pub const FP8_SHAPE: [usize; 3] = [2, 8, 32];
/// [`Model::cudnn_shaped`]'s: 128 tokens of 128 features.
const CUDNN_SHAPE: [usize; 3] = [1, 128, 128];
/// One head of 32 features: the narrowest the fused attention (the default form) runs.
const HEADS: usize = 1;
pub const LAYERS: usize = 2;
const DROPOUT: f32 = 0.25;

/// What [`Model::build`] builds: the element type, the data's shape, the FP8 recipe if any, what
/// the backward recomputes, the layers and their heads, and the dropout.
struct Spec {
    dtype: DType,
    shape: [usize; 3],
    fp8: Option<Fp8Recipe>,
    recompute: Recompute,
    layers: usize,
    heads: usize,
    dropout: f32,
}

impl Spec {
    /// The defaults, in `dtype`.
    fn of(dtype: DType) -> Spec {
        let recompute = Recompute::Nothing;
        Spec { dtype, shape: SHAPE, fp8: None, recompute, layers: LAYERS, heads: HEADS, dropout: DROPOUT }
    }
}

/// A stack of transformer layers, its parameters, step counter and optimizer.
pub struct Model {
    pub dtype: DType,
    /// Batch, sequence, width of the data.
    pub shape: [usize; 3],
    pub s: Stream,
    pub alloc: CachingAllocator,
    pub store: ParamStore,
    pub stack: Stack<TransformerLayer>,
    pub step: Tensor,
    pub optimizer: AdamW,
}

impl Model {
    /// The same parameters and dropout seeds on every call, in f32.
    pub fn new(dev: &Device) -> Result<Model> {
        Model::with_dtype(dev, DType::F32)
    }

    /// As [`Model::new`], with weights and activations of `dtype` (f32 master weights in the
    /// optimizer for bf16).
    pub fn with_dtype(dev: &Device, dtype: DType) -> Result<Model> {
        Model::build(dev, Spec::of(dtype))
    }

    /// As [`Model::new`] in bf16, its layers' GEMMs in FP8 (the optimizer stepping the FP8
    /// state), over 16 tokens: an FP8 GEMM's k, here the tokens of the weight gradient, is a
    /// multiple of 16.
    pub fn fp8(dev: &Device) -> Result<Model> {
        Model::build(dev, Spec { shape: FP8_SHAPE, fp8: Some(short_history(Fp8Format::E5M2)), ..Spec::of(DType::BF16) })
    }

    /// As [`Model::fp8`] with the gradients in E4M3 (TransformerEngine's `Format.E4M3`): GELU's
    /// backward cast to E4M3 in its fused kernel, the backward's GEMMs E4M3 × E4M3.
    pub fn fp8_e4m3_gradients(dev: &Device) -> Result<Model> {
        Model::build(dev, Spec { shape: FP8_SHAPE, fp8: Some(short_history(Fp8Format::E4M3)), ..Spec::of(DType::BF16) })
    }

    /// As [`Model::fp8`] with current scaling: every scale from its tensor's amax just before
    /// its cast.
    pub fn fp8_current(dev: &Device) -> Result<Model> {
        let fp8 = Fp8Recipe { scaling: Fp8Scaling::Current, ..Fp8Recipe::default() };
        Model::build(dev, Spec { shape: FP8_SHAPE, fp8: Some(fp8), ..Spec::of(DType::BF16) })
    }

    /// As [`Model::with_dtype`] in bf16, the MLPs' backward recomputing their GELU output.
    pub fn recomputing(dev: &Device) -> Result<Model> {
        Model::build(dev, Spec { recompute: Recompute::Gelu, ..Spec::of(DType::BF16) })
    }

    /// As [`Model::with_dtype`], with `layers` layers.
    pub fn deep(dev: &Device, dtype: DType, layers: usize) -> Result<Model> {
        Model::build(dev, Spec { layers, ..Spec::of(dtype) })
    }

    /// As [`Model::recomputing`], the LayerNorm outputs recomputed too.
    pub fn recomputing_all(dev: &Device) -> Result<Model> {
        Model::build(dev, Spec { recompute: Recompute::GeluAndNorms, ..Spec::of(DType::BF16) })
    }

    /// In bf16 over [`CUDNN_SHAPE`], two heads of 64 features and no dropout (a call cuDNN's
    /// fused attention runs).
    pub fn cudnn_shaped(dev: &Device) -> Result<Model> {
        Model::build(dev, Spec { shape: CUDNN_SHAPE, heads: 2, dropout: 0.0, ..Spec::of(DType::BF16) })
    }

    fn build(dev: &Device, spec: Spec) -> Result<Model> {
        let Spec { dtype, shape, fp8, recompute, layers, heads, dropout } = spec;
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(dev);
        let fp8 = fp8.map(|recipe| Fp8Training::new(&alloc, recipe));
        let c = shape[2];
        let store = ParamStore::with_dtype(&alloc, &s, layers * TransformerLayer::parameter_count(c), dtype)?;
        let vb = (Builder::new(&store, &alloc, &s)?.with_seed(10).with_dropout(dropout, 77)).with_recompute(recompute);
        let vb = match &fp8 {
            Some(f) => vb.with_fp8(f),
            None => vb,
        };
        let layers = TransformerLayer::stack(&vb, (c, heads), &Layers::first(layers))?;
        let step = vb.step().clone();
        let optimizer = AdamW::new(&alloc, &store, AdamWHyper::default(), LrSchedule::Constant(1e-2), &s)?;
        let optimizer = match &fp8 {
            Some(f) => {
                f.start(&s)?;
                optimizer.with_fp8(f)
            }
            None => optimizer,
        };
        Ok(Model { dtype, shape, s, alloc, store, stack: Stack::new(layers).with_rng_step(&step), step, optimizer })
    }

    pub fn layers(&self) -> &[TransformerLayer] {
        self.stack.layers()
    }

    pub fn callables(&self) -> Vec<&dyn Callable> {
        self.layers().iter().map(|l| l as &dyn Callable).collect()
    }

    /// Microbatch `k`'s input and upstream gradient: new values every microbatch.
    pub fn data(&self, k: u64) -> Result<(Tensor, Tensor)> {
        let n: usize = self.shape.iter().product();
        let x = Tensor::from_f32(&self.alloc, &self.s, &lcg(n, 100 + k), &self.shape, self.dtype)?;
        let dy = Tensor::from_f32(&self.alloc, &self.s, &lcg(n, 200 + k), &self.shape, self.dtype)?;
        Ok((x, dy))
    }

    /// The stack graphed with `options`, from microbatch 0's input.
    pub fn graph(&self, options: GraphOptions) -> Result<GraphedStack> {
        let (x0, _) = self.data(0)?;
        Ok(make_graphed_stack(&self.alloc, &self.stack, &x0, options)?)
    }

    /// One eager microbatch: forward (the stack advances the step counter), backward; returns
    /// (y, dx).
    pub fn eager(&self, x: &Tensor, dy: &Tensor) -> Result<(Vec<f32>, Vec<f32>)> {
        let (y, ctx) = self.stack.forward(&Inputs::one(x), &KeepOnDevice, &self.s)?;
        let dx = input_grad("eager", self.stack.backward(ctx, &[dy], &self.s)?)?;
        Ok((y[0].to_f32_vec(&self.s)?, dx.to_f32_vec(&self.s)?))
    }

    /// One graphed microbatch, replayed as `replay` says (the graphed stack advances the step
    /// counter); tails joined at the end.
    pub fn graphed(
        &self,
        g: &GraphedStack,
        x: &Tensor,
        dy: &Tensor,
        replay: Replay<'_>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        self.graphed_fed(g, (x, dy), replay, false)
    }

    /// As [`Model::graphed`], the stack reading `x` and `dy` in place where it can.
    pub fn graphed_in_place(
        &self,
        g: &GraphedStack,
        x: &Tensor,
        dy: &Tensor,
        replay: Replay<'_>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        self.graphed_fed(g, (x, dy), replay, true)
    }

    fn graphed_fed(
        &self,
        g: &GraphedStack,
        (x, dy): (&Tensor, &Tensor),
        replay: Replay<'_>,
        in_place: bool,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let y = match in_place {
            true => g.forward_in_place(&self.s, x, replay)?,
            false => g.forward(&self.s, x, replay)?,
        };
        let y = y.get()?.to_f32_vec(&self.s)?;
        let dx = match in_place {
            true => g.backward_in_place(&self.s, dy)?,
            false => g.backward(&self.s, dy)?,
        };
        let dx = dx.ok_or_else(|| anyhow::anyhow!("no input gradient"))?;
        let dx = dx.get()?.to_f32_vec(&self.s)?;
        g.join(&self.s)?;
        Ok((y, dx))
    }

    /// One microbatch through layers graphed one by one (`make_graphed_callables`), each input
    /// copied into its layer's static input: the stack traversal over the escape hatch (the
    /// callables advance the step counter, as the stack does).
    pub fn per_layer(&self, g: &[GraphedCallable], x: &Tensor, dy: &Tensor) -> Result<(Vec<f32>, Vec<f32>)> {
        self.per_layer_fed(g, x, dy, false)
    }

    /// As [`Model::per_layer`], each layer reading its input and output gradient in place where
    /// it can (`forward_in_place`, `backward_in_place`): a layer reads the previous layer's
    /// output where that layer's graph wrote it.
    pub fn per_layer_in_place(&self, g: &[GraphedCallable], x: &Tensor, dy: &Tensor) -> Result<(Vec<f32>, Vec<f32>)> {
        self.per_layer_fed(g, x, dy, true)
    }

    fn per_layer_fed(
        &self,
        g: &[GraphedCallable],
        x: &Tensor,
        dy: &Tensor,
        in_place: bool,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut t = PerLayer { g, s: &self.s, in_place };
        let (y, saved) = forward_pass(&mut t, g.len(), x.clone())?;
        let y = y.to_f32_vec(&self.s)?;
        let dx = backward_pass(&mut t, saved, dy.clone())?;
        Ok((y, dx.to_f32_vec(&self.s)?))
    }

    /// The optimizer's step (the gradients zeroed after it).
    pub fn optimizer_step(&self) -> Result {
        Ok(self.optimizer.step(&self.s)?)
    }

    pub fn params(&self) -> Result<Vec<f32>> {
        Ok(self.store.values()?.to_f32_vec(&self.s)?)
    }

    pub fn grads(&self) -> Result<Vec<f32>> {
        Ok(self.store.grads()?.to_f32_vec(&self.s)?)
    }
}

/// Per-layer graphed callables replayed on the caller's stream, their outputs and gradients
/// passed on as tensors.
struct PerLayer<'a> {
    g: &'a [GraphedCallable],
    s: &'a Stream,
    in_place: bool,
}

impl Traverse for PerLayer<'_> {
    type Act = Tensor;
    type Grad = Tensor;
    type Saved = ();

    fn forward(&mut self, i: usize, x: Tensor) -> graphed::Result<(Tensor, ())> {
        let (y, _tail) = match self.in_place {
            true => self.g[i].forward_in_place(self.s, &Inputs::one(&x), Replay::caller())?,
            false => self.g[i].forward(self.s, &Inputs::one(&x), Replay::caller())?,
        };
        Ok((y[0].get()?.clone(), ()))
    }

    fn backward(&mut self, i: usize, (): (), dy: Tensor) -> graphed::Result<Tensor> {
        let (dx, _tail) = match self.in_place {
            true => self.g[i].backward_in_place(self.s, &[&dy])?,
            false => self.g[i].backward(self.s, &[&dy])?,
        };
        let dx = dx.into_iter().next().flatten();
        let dx = dx.ok_or(graphed::Error::MissingGradient { op: "PerLayer::backward", what: "input 0".into() })?;
        Ok(dx.get()?.clone())
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
    pub fn new(store: &ParamStore, alloc: &CachingAllocator, s: &Stream) -> Result<Shifted> {
        let p = store.add("shifted.p", &[1], &[0.0], s)?;
        Ok(Shifted { p, alloc: alloc.clone(), grad_x: true })
    }

    fn copy(&self, x: &Tensor, s: &Stream) -> graphed::Result<Tensor> {
        let y = Tensor::uninit(&self.alloc, s, x.shape(), x.dtype())?;
        s.copy_d2d(x.view::<f32>()?, y.view::<f32>()?)?;
        Ok(y)
    }
}

impl Module for Shifted {
    type Ctx = ();

    fn forward(&self, inputs: &Inputs, _hook: &dyn SaveHook, s: &Stream) -> graphed::Result<(Vec<Tensor>, ())> {
        let x = inputs.positional().next().ok_or(graphed::Error::InputArity {
            op: "Shifted::forward",
            expected: "one positional input",
            positional: 0,
            named: inputs.named_inputs().len(),
        })?;
        let shift = inputs.require("Shifted::forward", "shift")?;
        let y = Tensor::uninit(&self.alloc, s, x.shape(), x.dtype())?;
        residual_add(&y, x, shift, s)?;
        Ok((vec![y], ()))
    }

    fn backward(&self, (): (), dys: &[&Tensor], s: &Stream) -> graphed::Result<Vec<Option<Tensor>>> {
        let dx = self.copy(dys[0], s)?;
        let dshift = self.copy(dys[0], s)?;
        elementwise::add_scalar(self.p.grad.view::<f32>()?, 1.0, s)?;
        Ok(vec![self.grad_x.then_some(dx), Some(dshift)])
    }

    fn parameters(&self) -> Vec<&Param> {
        vec![&self.p]
    }

    fn set_training(&mut self, _training: bool) {}
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
            self.side.wait_stream(stream)?;
            *forked = true;
            return Ok(true);
        }
        Ok(false)
    }
}

impl SaveHook for TailHook {
    fn save(&self, _name: &str, t: Tensor, stream: &Stream) -> graphed::Result<SavedTensor> {
        if !self.fork(stream)? {
            return Ok(SavedTensor::kept(t));
        }
        match self.work {
            TailWork::Churn(n) => {
                let scratch = Tensor::uninit(&self.alloc, &self.side, &[1 << 20], DType::F32)?;
                elementwise::fill(scratch.view::<f32>()?, 1.0, &self.side)?;
                for _ in 0..n {
                    elementwise::scale(scratch.view::<f32>()?, scratch.view()?, 1.0, &self.side)?;
                }
            }
            TailWork::ReadSaved => {
                let scratch = Tensor::uninit(&self.alloc, &self.side, t.shape(), t.dtype())?;
                self.side.copy_d2d(t.view::<f32>()?, scratch.view::<f32>()?)?;
            }
            TailWork::WriteSaved => elementwise::fill(t.view::<f32>()?, 0.0, &self.side)?,
        }
        Ok(SavedTensor::kept(t))
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
            stream.wait_stream(&self.side)?;
            *forked = false;
        }
        Ok(())
    }
}

/// Delayed scaling over 4 steps of history, the gradients in `gradients`.
fn short_history(gradients: Fp8Format) -> Fp8Recipe {
    let delayed = DelayedRecipe { history_len: 4, ..DelayedRecipe::default() };
    Fp8Recipe { scaling: Fp8Scaling::Delayed(delayed), gradients }
}
