//! `y = x·Wᵀ + b`: the GEMMs of a fully connected layer, with the work around them folded into
//! cuBLASLt's epilogues: the bias, a residual added as the GEMM's C (`beta = 1`), GELU with its
//! pre-activation kept for the backward, GELU's backward fused into the next layer's data
//! gradient, and the bias gradient as a by-product of the weight-gradient GEMM.
//!
//! Gradients: `dx = dy·W` (written), `dW += dyᵀ·x` (the GEMM accumulates with `beta = 1`),
//! `db += Σ_rows dy` (the weight-gradient GEMM writes the sum, in cuBLASLt's fixed order, to a
//! scratch vector that one kernel adds to the gradient). The composite modules use the pieces
//! ([`Linear::forward_with`], [`Linear::forward_gelu`], [`Linear::backward_with`]) to fuse
//! across layers.

use half::bf16;

use super::fp8::Fp8Linear;
use super::params::init_uniform;
use super::{Builder, Inputs, Module, Param, SaveHook, SavedTensor};
use crate::device::{DType, Stream};
use crate::memory::CachingAllocator;
use crate::ops::elementwise;
use crate::ops::fp8::{dgelu_cast_transpose, sum_tiles, tile_rows};
use crate::ops::gelu::gelu_backward;
use crate::ops::matmul::{fp8_matmul, matmul, Fp8Matmul, Fused, Matmul};
use crate::tensor::Tensor;
use crate::{Error, Result};

use std::sync::{Mutex, PoisonError};

/// Who adds a Linear's bias gradient `Σ_rows dy`.
#[derive(Clone, Debug, Default)]
pub enum BiasGrad {
    /// The weight-gradient GEMM computes it (cuBLASLt's bias-gradient epilogue) and the layer
    /// adds it.
    #[default]
    Compute,
    /// The caller adds it (a LayerNorm backward that reads the same gradient as its residual
    /// sums its columns in the same pass).
    Elsewhere,
}

/// A weight-gradient computation left for `backward_dw`: the output gradient, the input, and who
/// adds the bias gradient.
type Deferred = (OutputGrad, Tensor, BiasGrad);

/// An output gradient as the weight-gradient GEMM reads it.
#[derive(Clone)]
enum OutputGrad {
    /// As the layer received it, `(n, out)` in bf16 or f32, and in FP8 training its FP8
    /// transpose `(out, n)`, quantized in the same pass as the data gradient's row-major copy.
    Given { dy: Tensor, fp8_t: Option<Tensor> },
    /// Quantized by the layer above in GELU's backward ([`PreActGrad::Quantized`]): its FP8
    /// transpose and its column sums per tile of rows.
    Quantized { fp8_t: Tensor, tile_sums: Tensor },
}

/// The gradient of a GELU's pre-activation, as [`Linear::backward_through_gelu`] leaves it for
/// the layer whose output the pre-activation was ([`Linear::backward_from`]).
pub enum PreActGrad {
    /// `(n, features)`, as [`Linear::backward_with`] returns it.
    Plain(Tensor),
    /// FP8 under delayed scaling: GELU's backward, its cast to the gradients' format in both
    /// layouts and its column sums, from one pass ([`dgelu_cast_transpose`]), so no bf16 copy of
    /// it is written.
    Quantized(Box<QuantizedGrad>),
}

/// [`PreActGrad::Quantized`]'s tensors, quantized with one layer's gradient scale: only that
/// layer's [`Linear::backward_from`] takes them (another's would read them with its own scale).
pub struct QuantizedGrad {
    /// `(n, features)`, in the gradients' format: the data gradient's operand.
    q: Tensor,
    /// `(features, n)`, likewise: the weight gradient's.
    q_t: Tensor,
    /// `(tile_rows(n), features)`, f32: the bias gradient's partial sums ([`sum_tiles`]).
    tile_sums: Tensor,
    /// The layer whose gradient slot scaled them.
    slot: Fp8Linear,
}

/// A fully connected layer over the last dimension of an `(n, in)` input.
pub struct Linear {
    name: String,
    alloc: CachingAllocator,
    /// With a split weight gradient, the work that [`Module::backward_dw`] still owes; `None`
    /// when `backward` computes the weight gradients itself.
    deferred: Option<Mutex<Vec<Deferred>>>,
    /// With FP8 training ([`Builder::with_fp8`]), the layer's handle on the model's FP8 state.
    fp8: Option<Fp8Linear>,
    /// `(out, in)`.
    pub weight: Param,
    /// `(out)`.
    pub bias: Param,
}

/// What the forward saves: the input as the backward reads it.
pub struct LinearCtx {
    /// [`LinearForward::input`].
    pub input: SavedTensor,
}

/// A forward's output and its input as the layer's backward ([`Linear::backward_with`]) reads
/// it: the input itself, or in FP8 training with delayed scaling its E4M3 transpose `(in, n)`,
/// which the forward's cast writes in the same read as the GEMM's operand. Keeping that instead
/// of the input halves the bytes kept (or offloaded) and saves the backward a second cast.
/// (Under current scaling another microbatch's cast would rescale its slot before the backward
/// reads it, so the layer keeps the input itself.)
pub struct LinearForward {
    /// The output `(n, out)`.
    pub y: Tensor,
    /// For the backward's weight gradient.
    pub input: Tensor,
}

/// Whether a forward keeps its input for the backward itself.
#[derive(Clone, Copy)]
enum Keep {
    /// The caller keeps the input (needed unquantized elsewhere).
    Nothing,
    /// The forward returns it, in FP8 quantized transposed in the same pass.
    Input,
}

impl Linear {
    /// The parameters a layer from `in` to `out` features adds to its store: size a
    /// [`ParamStore`](super::ParamStore) with the counts of the modules it will hold.
    pub fn parameter_count((inputs, outputs): (usize, usize)) -> usize {
        inputs * outputs + outputs
    }

    /// A layer named by `vb`'s prefix (`{prefix}.weight`, `{prefix}.bias`), with weights uniform
    /// in ±1/√in (PyTorch's default) from `vb`'s seed, bias zero.
    ///
    /// # Errors
    /// [`Error::Shape`] when the store is full.
    pub fn new(vb: &Builder, (inputs, outputs): (usize, usize)) -> Result<Linear> {
        let bound = 1.0 / (inputs as f32).sqrt();
        let weight = vb.add("weight", &[outputs, inputs], &init_uniform(inputs * outputs, bound, vb.seed()))?;
        let bias = vb.add("bias", &[outputs], &vec![0.0; outputs])?;
        let fp8 = vb.fp8().map(|f| f.register(&weight.value, vb.stream())).transpose()?;
        Ok(Linear { name: vb.prefix().to_string(), alloc: vb.alloc().clone(), deferred: None, fp8, weight, bias })
    }

    /// Splits the weight gradient out of `backward` into [`Module::backward_dw`] (or joins it
    /// back). Work already deferred is dropped on a change, so switch between steps.
    pub fn set_split_dw(&mut self, split: bool) {
        self.deferred = split.then(|| Mutex::new(Vec::new()));
    }

    /// `y = x·Wᵀ + b (+ residual)`: one GEMM, the residual added as its C. For a caller that
    /// keeps `x` itself for the backward; else [`forward_keeping_input`](Linear::forward_keeping_input).
    pub fn forward_with(&self, x: &Tensor, residual: Option<&Tensor>, stream: &Stream) -> Result<Tensor> {
        Ok(self.forward_residual(x, residual, Keep::Nothing, stream)?.y)
    }

    /// As [`forward_with`](Linear::forward_with), with the input as the backward reads it.
    pub fn forward_keeping_input(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        stream: &Stream,
    ) -> Result<LinearForward> {
        self.forward_residual(x, residual, Keep::Input, stream)
    }

    fn forward_residual(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        keep: Keep,
        stream: &Stream,
    ) -> Result<LinearForward> {
        let (i, o) = self.dims();
        let n = self.rows("Linear::forward", x, i)?;
        if let Some(r) = residual {
            r.expect_shape("Linear::forward", &[n, o])?;
        }
        let y = Tensor::uninit(&self.alloc, stream, &[n, o], x.dtype())?;
        let input = self.forward_gemm(&y, x, Fused::Bias(&self.bias.value), residual, keep, stream)?;
        Ok(LinearForward { y, input })
    }

    /// `GELU(pre)` (as `y`) and the input as the backward reads it, and `pre = x·Wᵀ + b`: one
    /// GEMM, the GELU in its epilogue, `pre` kept for the next layer's
    /// [`Linear::backward_with`].
    pub fn forward_gelu(&self, x: &Tensor, stream: &Stream) -> Result<(LinearForward, Tensor)> {
        let (i, o) = self.dims();
        let n = self.rows("Linear::forward_gelu", x, i)?;
        let act = Tensor::uninit(&self.alloc, stream, &[n, o], x.dtype())?;
        let pre = Tensor::uninit(&self.alloc, stream, &[n, o], x.dtype())?;
        let fused = Fused::BiasGeluAux { bias: &self.bias.value, aux: &pre };
        let input = self.forward_gemm(&act, x, fused, None, Keep::Input, stream)?;
        Ok((LinearForward { y: act, input }, pre))
    }

    /// The backward of `y = x·Wᵀ + b`: returns `dx = dy·W`, or with `gelu_pre` (the
    /// pre-activation of a GELU whose output was `x`, [`Linear::forward_gelu`]'s) the gradient
    /// of that pre-activation, `(dy·W) ⊙ GELU′(pre)`; `dW += dyᵀ·x` and the bias gradient as
    /// `bias` says, now or (with a split weight gradient) at [`Module::backward_dw`]. `x` is the
    /// input as the forward kept it ([`LinearForward::input`]) or the input itself.
    ///
    /// GELU's backward is cuBLASLt's `DGELU` epilogue. (Its `DGELU_BGRAD`, which would also sum
    /// the columns into the bias gradient of the layer before, took 95.6 µs against 44.8 µs for
    /// the `DGELU` GEMM at BENCH.md's M on the H200, more than that layer's `BGRADB` costs.) In
    /// FP8, `dy` is quantized once to the recipe's gradient format, row-major for the data
    /// gradient and transposed for the weight gradient, in one pass.
    ///
    /// # Errors
    /// [`Error::Shape`] unless `dy` is `(n, out)`, `x` `(n, in)` (or FP8's kept `(in, n)`) and
    /// `gelu_pre` `(n, in)`; [`Error::DTypeMismatch`] for an FP8 input to a layer not in FP8; as
    /// the GEMMs.
    pub fn backward_with(
        &self,
        dy: &Tensor,
        x: &Tensor,
        gelu_pre: Option<&Tensor>,
        bias: BiasGrad,
        stream: &Stream,
    ) -> Result<Tensor> {
        const OP: &str = "Linear::backward";
        let (i, o) = self.dims();
        let n = self.rows(OP, dy, o)?;
        self.check_input(OP, x, n, dy.dtype())?;
        if let Some(pre) = gelu_pre {
            pre.expect_shape(OP, &[n, i])?;
        }
        let dx = Tensor::uninit(&self.alloc, stream, &[n, i], dy.dtype())?;
        let fused = gelu_pre.map_or(Fused::None, |aux| Fused::DGelu { aux });
        let grad = self.data_gemm(&dx, dy, fused, stream)?;
        self.weight_grads(grad, x, bias, stream)?;
        Ok(dx)
    }

    /// [`backward_with`](Linear::backward_with) through a GELU whose pre-activation `pre` is
    /// `below`'s output: the gradient of `pre`, as `below`'s [`backward_from`](Linear::backward_from)
    /// takes it. In FP8 under delayed scaling (both layers) it leaves quantized for `below`
    /// ([`PreActGrad::Quantized`]): the data-gradient GEMM writes `dy·W` in bf16, and one pass
    /// applies GELU's backward and casts the result with `below`'s gradient scale, which saves
    /// `below` its own cast and its bias GEMV. Elsewhere ([`PreActGrad::Plain`]) it is
    /// `backward_with`'s, GELU's backward in the GEMM's epilogue (bf16) or a kernel after it
    /// (FP8 under current scaling, whose cast needs the amax of the finished gradient first).
    ///
    /// It takes the GELU output `x` (this layer's input) and lets it go as soon as its last
    /// reader is enqueued: without FP8 and a split weight gradient, the weight gradient comes
    /// first, so that a recomputed (or no longer saved) `x` and the pre-activation's gradient, both
    /// four widths, are not held at once.
    ///
    /// # Errors
    /// As [`backward_with`](Linear::backward_with), before anything is enqueued.
    pub fn backward_through_gelu(
        &self,
        dy: &Tensor,
        x: Tensor,
        pre: &Tensor,
        bias: BiasGrad,
        below: &Linear,
        stream: &Stream,
    ) -> Result<PreActGrad> {
        const OP: &str = "Linear::backward_through_gelu";
        let (i, o) = self.dims();
        let n = self.rows(OP, dy, o)?;
        self.check_input(OP, &x, n, dy.dtype())?;
        pre.expect_shape(OP, &[n, i])?;
        if self.fp8.is_none() && self.deferred.is_none() {
            self.weight_grads_now(&OutputGrad::Given { dy: dy.clone(), fp8_t: None }, &x, &bias, stream)?;
            drop(x);
            let dx = Tensor::uninit(&self.alloc, stream, &[n, i], dy.dtype())?;
            self.data_gemm(&dx, dy, Fused::DGelu { aux: pre }, stream)?;
            return Ok(PreActGrad::Plain(dx));
        }
        // What the fused kernel reads must suit it, or it would refuse after the GEMM before it
        // was enqueued: elsewhere the unfused path decides.
        let fused = self.fp8.is_some()
            && below.fp8.as_ref().is_some_and(Fp8Linear::scales_hold_for_the_step)
            && dy.dtype() == DType::BF16
            && pre.dtype() == DType::BF16
            && pre.is_contiguous();
        if !fused {
            return self.backward_with(dy, &x, Some(pre), bias, stream).map(PreActGrad::Plain);
        }
        let slot = below.fp8.clone().ok_or(Error::Unsupported {
            op: OP,
            backend: "any",
            why: "the layer below lost its FP8 state; please report this as a bug",
        })?;
        let into = slot.grad()?;
        let dact = Tensor::uninit(&self.alloc, stream, &[n, i], dy.dtype())?;
        let grad = self.data_gemm(&dact, dy, Fused::None, stream)?;
        let q = Tensor::uninit(&self.alloc, stream, &[n, i], into.dtype())?;
        let q_t = Tensor::uninit(&self.alloc, stream, &[i, n], into.dtype())?;
        let tile_sums = Tensor::uninit(&self.alloc, stream, &[tile_rows(n), i], DType::F32)?;
        dgelu_cast_transpose((&q, &q_t), &into.amax, &tile_sums, (&dact, pre), &into.scale, stream)?;
        self.weight_grads(grad, &x, bias, stream)?;
        Ok(PreActGrad::Quantized(Box::new(QuantizedGrad { q, q_t, tile_sums, slot })))
    }

    /// The backward from the gradient of this layer's output as a layer above's
    /// [`backward_through_gelu`](Linear::backward_through_gelu) left it: returns `dx`, and the
    /// weight and bias gradients (now, or at [`Module::backward_dw`] with a split weight
    /// gradient), as [`backward_with`](Linear::backward_with) with [`BiasGrad::Compute`].
    ///
    /// # Errors
    /// As [`backward_with`](Linear::backward_with); [`Error::Shape`] for a gradient of another
    /// width; [`Error::Unsupported`] for a quantized gradient made for another layer (it was
    /// scaled with that layer's gradient scale), before anything is enqueued.
    pub fn backward_from(&self, grad: PreActGrad, x: &Tensor, stream: &Stream) -> Result<Tensor> {
        const OP: &str = "Linear::backward_from";
        let QuantizedGrad { q, q_t, tile_sums, slot } = match grad {
            PreActGrad::Plain(dy) => return self.backward_with(&dy, x, None, BiasGrad::Compute, stream),
            PreActGrad::Quantized(quantized) => *quantized,
        };
        let Some(f) = self.fp8.as_ref().filter(|f| f.is_slot_of(&slot)) else {
            return Err(Error::Unsupported {
                op: OP,
                backend: "any",
                why: "this quantized gradient was scaled for another layer: pass that layer as `below` to \
                      backward_through_gelu, or give the gradient to the layer it names",
            });
        };
        let (i, o) = self.dims();
        let n = self.rows(OP, &q, o)?;
        self.check_input(OP, x, n, DType::BF16)?;
        let dx = Tensor::uninit(&self.alloc, stream, &[n, i], DType::BF16)?;
        self.data_gemm_fp8(f, &dx, &q, stream)?;
        self.weight_grads(OutputGrad::Quantized { fp8_t: q_t, tile_sums }, x, BiasGrad::Compute, stream)?;
        Ok(dx)
    }

    /// Checks a backward's `x`: `(n, in)`, or in FP8 the forward's kept E4M3 transpose `(in, n)`.
    fn check_input(&self, op: &'static str, x: &Tensor, n: usize, grad_dtype: DType) -> Result<()> {
        let i = self.dims().0;
        match (x.dtype(), &self.fp8) {
            (DType::F8E4M3, Some(_)) => x.expect_shape(op, &[i, n]),
            (DType::F8E4M3, None) => Err(Error::DTypeMismatch { op, expected: grad_dtype, found: x.dtype() }),
            _ => x.expect_shape(op, &[n, i]),
        }
    }

    /// The weight gradients now, or queued for `backward_dw` with a split weight gradient.
    fn weight_grads(&self, mut dy: OutputGrad, x: &Tensor, bias: BiasGrad, stream: &Stream) -> Result<()> {
        match &self.deferred {
            Some(queue) => {
                // Read after other microbatches' casts: kept only if its scale holds until then
                // (a quantized gradient exists only where it does).
                if let OutputGrad::Given { fp8_t, .. } = &mut dy {
                    if !self.fp8.as_ref().is_some_and(Fp8Linear::scales_hold_for_the_step) {
                        *fp8_t = None;
                    }
                }
                queue.lock().unwrap_or_else(PoisonError::into_inner).push((dy, x.clone(), bias));
                Ok(())
            }
            None => self.weight_grads_now(&dy, x, &bias, stream),
        }
    }

    /// `y = x·Wᵀ` with `fused` (and `residual` as C), in bf16 or FP8; the input as the backward
    /// reads it (in FP8 with `keep`, the transpose that the input's cast writes as well).
    fn forward_gemm(
        &self,
        y: &Tensor,
        x: &Tensor,
        fused: Fused<'_>,
        residual: Option<&Tensor>,
        keep: Keep,
        stream: &Stream,
    ) -> Result<Tensor> {
        let (i, o) = self.dims();
        let (n, beta) = (x.shape()[0], if residual.is_some() { 1.0 } else { 0.0 });
        let Some(f) = &self.fp8 else {
            let gemm = Matmul {
                fused,
                addend: residual,
                beta,
                trans_b: true,
                ..Matmul::new(y, x, &self.weight.value, (n, o, i))
            };
            matmul(gemm, stream)?;
            return Ok(x.clone());
        };
        let (xs, ws) = (f.input()?, f.weight_scale()?);
        let (x8, kept) = match keep {
            Keep::Input if f.scales_hold_for_the_step() => xs.quantize_both(&self.alloc, x, stream)?,
            _ => (xs.quantize(&self.alloc, x, stream)?, x.clone()),
        };
        let scales = (&xs.scale_inv, &ws.scale_inv);
        let gemm = Fp8Matmul {
            fused,
            addend: residual,
            beta,
            fast_accum: true,
            ..Fp8Matmul::new(y, (&x8, f.weights().0), scales, (n, o, i))
        };
        fp8_matmul(gemm, stream)?;
        Ok(kept)
    }

    /// `dx = dy·W` with `fused`, in bf16 or FP8 (`dy` in the gradients' format against the weight's transpose);
    /// `dy` as the weight gradient reads it.
    fn data_gemm(&self, dx: &Tensor, dy: &Tensor, fused: Fused<'_>, stream: &Stream) -> Result<OutputGrad> {
        let (i, o) = self.dims();
        let n = dy.shape()[0];
        let Some(f) = &self.fp8 else {
            matmul(Matmul { fused, ..Matmul::new(dx, dy, &self.weight.value, (n, i, o)) }, stream)?;
            return Ok(OutputGrad::Given { dy: dy.clone(), fp8_t: None });
        };
        let (dy8, dy8_t) = f.grad()?.quantize_both(&self.alloc, dy, stream)?;
        let grad = OutputGrad::Given { dy: dy.clone(), fp8_t: Some(dy8_t) };
        match fused {
            Fused::None => self.data_gemm_fp8(f, dx, &dy8, stream)?,
            // cuBLASLt's FP8 DGELU epilogue ran at 605 TFLOP/s against 1276 without it on the
            // H200 at L (0.91 against 0.43 ms): the GEMM alone and GELU's backward as a kernel
            // (one more rounding, to bf16, between the two).
            Fused::DGelu { aux } => {
                let dact = Tensor::uninit(&self.alloc, stream, dx.shape(), dx.dtype())?;
                self.data_gemm_fp8(f, &dact, &dy8, stream)?;
                gelu_backward(dx, aux, &dact, stream)?;
            }
            _ => {
                return Err(Error::Unsupported {
                    op: "Linear (FP8)",
                    backend: "any",
                    why: "an FP8 data gradient fuses GELU's backward only; please report this as a bug",
                })
            }
        }
        Ok(grad)
    }

    /// `dx = dy8·W` (`dy8` the FP8 output gradient in this layer's gradient slot, against the
    /// weight's FP8 transpose), in bf16.
    fn data_gemm_fp8(&self, f: &Fp8Linear, dx: &Tensor, dy8: &Tensor, stream: &Stream) -> Result<()> {
        let (i, o) = self.dims();
        let (gs, ws) = (f.grad()?, f.weight_scale()?);
        let scales = (&gs.scale_inv, &ws.scale_inv);
        fp8_matmul(Fp8Matmul::new(dx, (dy8, f.weights().1), scales, (dy8.shape()[0], i, o)), stream)
    }

    /// `dW += dyᵀ·x` in FP8, both operands quantized transposed, and `Σ_rows dy` when `bias`
    /// computes it: from the tiles' sums of a quantized gradient, else in bf16 by a GEMM with a
    /// row of ones (cuBLASLt has no FP8 bias-gradient epilogue).
    fn weight_grads_fp8(
        &self,
        f: &Fp8Linear,
        (grad, x): (&OutputGrad, &Tensor),
        bias: &BiasGrad,
        stream: &Stream,
    ) -> Result<()> {
        let (i, o) = self.dims();
        let (gs, xs) = (f.grad()?, f.input()?);
        let dy8_t = match grad {
            OutputGrad::Given { fp8_t: Some(t), .. } | OutputGrad::Quantized { fp8_t: t, .. } => t.clone(),
            OutputGrad::Given { dy, fp8_t: None } => gs.quantize_transposed(&self.alloc, dy, stream)?,
        };
        let n = dy8_t.shape()[1];
        let x8_t = match x.dtype() {
            DType::F8E4M3 => x.clone(),
            _ => xs.quantize_transposed(&self.alloc, x, stream)?,
        };
        let scales = (&gs.scale_inv, &xs.scale_inv);
        fp8_matmul(
            Fp8Matmul { beta: 1.0, ..Fp8Matmul::new(&self.weight.grad, (&dy8_t, &x8_t), scales, (o, i, n)) },
            stream,
        )?;
        if let BiasGrad::Compute = bias {
            let db = Tensor::uninit(&self.alloc, stream, &[o], DType::BF16)?;
            match grad {
                OutputGrad::Quantized { tile_sums, .. } => sum_tiles(&db, tile_sums, stream)?,
                OutputGrad::Given { dy, .. } => {
                    let ones = Tensor::uninit(&self.alloc, stream, &[1, n], DType::BF16)?;
                    elementwise::fill(ones.view::<bf16>()?, 1.0, stream)?;
                    matmul(Matmul::new(&db, &ones, dy, (1, o, n)), stream)?;
                }
            }
            elementwise::accumulate(&self.bias.grad, &db, stream)?;
        }
        Ok(())
    }

    fn weight_grads_now(&self, grad: &OutputGrad, x: &Tensor, bias: &BiasGrad, stream: &Stream) -> Result<()> {
        let (i, o) = self.dims();
        if let Some(f) = &self.fp8 {
            return self.weight_grads_fp8(f, (grad, x), bias, stream);
        }
        let OutputGrad::Given { dy, .. } = grad else {
            return Err(Error::Unsupported {
                op: "Linear::backward",
                backend: "any",
                why: "a quantized gradient reached a layer not in FP8; please report this as a bug",
            });
        };
        let n = dy.shape()[0];
        let scratch = match bias {
            BiasGrad::Compute => Some(Tensor::uninit(&self.alloc, stream, &[o], dy.dtype())?),
            _ => None,
        };
        let fused = scratch.as_ref().map_or(Fused::None, |db| Fused::BGradA { bias_grad: db });
        let gemm = Matmul { fused, trans_a: true, beta: 1.0, ..Matmul::new(&self.weight.grad, dy, x, (o, i, n)) };
        matmul(gemm, stream)?;
        match (bias, &scratch) {
            (BiasGrad::Compute, Some(db)) => elementwise::accumulate(&self.bias.grad, db, stream),
            _ => Ok(()),
        }
    }

    fn dims(&self) -> (usize, usize) {
        (self.weight.value.shape()[1], self.weight.value.shape()[0])
    }

    fn rows(&self, op: &'static str, t: &Tensor, cols: usize) -> Result<usize> {
        match t.shape() {
            [n, c] if *c == cols => Ok(*n),
            other => Err(Error::Shape { op, expected: format!("(n, {cols})"), found: other.to_vec() }),
        }
    }
}

impl Module for Linear {
    type Ctx = LinearCtx;

    fn forward(&self, inputs: &Inputs, hook: &dyn SaveHook, stream: &Stream) -> Result<(Vec<Tensor>, LinearCtx)> {
        let x = inputs.only("Linear::forward")?;
        let LinearForward { y, input } = self.forward_keeping_input(x, None, stream)?;
        hook.open_group(&self.name)?;
        let input = hook.save("input", input, stream)?;
        hook.commit_group(&self.name, stream)?;
        Ok((vec![y], LinearCtx { input }))
    }

    fn backward(&self, ctx: LinearCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        let dy = grad_outputs.first().ok_or(Error::Shape {
            op: "Linear::backward",
            expected: "one output gradient".into(),
            found: vec![],
        })?;
        let dx = self.backward_with(dy, &ctx.input.take(stream)?, None, BiasGrad::Compute, stream)?;
        Ok(vec![Some(dx)])
    }

    fn backward_dw(&self, stream: &Stream) -> Result<()> {
        let Some(queue) = &self.deferred else { return Ok(()) };
        let pending = std::mem::take(&mut *queue.lock().unwrap_or_else(PoisonError::into_inner));
        pending.iter().try_for_each(|(dy, x, bias)| self.weight_grads_now(dy, x, bias, stream))
    }

    fn splits_dw(&self) -> bool {
        self.deferred.is_some()
    }

    fn parameters(&self) -> Vec<&Param> {
        vec![&self.weight, &self.bias]
    }

    fn pass_state(&self) -> Vec<Tensor> {
        self.fp8.as_ref().map_or_else(Vec::new, Fp8Linear::amaxes)
    }

    fn set_training(&mut self, _training: bool) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::nn::{KeepOnDevice, ParamStore};

    /// Loss Σ y⊙r, its gradient by the module, and by central differences on the host.
    #[test]
    fn gradients_match_finite_differences() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let store = ParamStore::new(&alloc, &s, 64).unwrap();
        let vb = Builder::new(&store, &alloc, &s).unwrap().with_seed(7);
        let lin = Linear::new(&vb.pp("fc"), (4, 3)).unwrap();
        let xh = init_uniform(8, 1.0, 1);
        let r = init_uniform(6, 1.0, 2);
        let loss = |x: &[f32], w: &[f32], b: &[f32]| -> f64 {
            (0..2)
                .flat_map(|n| (0..3).map(move |j| (n, j)))
                .map(|(n, j)| {
                    let y = (0..4).map(|k| f64::from(x[n * 4 + k]) * f64::from(w[j * 4 + k])).sum::<f64>()
                        + f64::from(b[j]);
                    y * f64::from(r[n * 3 + j])
                })
                .sum()
        };
        let w = lin.weight.value.to_vec(&s).unwrap();
        let b = lin.bias.value.to_vec(&s).unwrap();
        let x = Tensor::from_host(&alloc, &s, &xh, &[2, 4]).unwrap();
        let (y, ctx) = lin.forward(&Inputs::one(&x), &KeepOnDevice, &s).unwrap();
        let got: f64 = y[0].to_vec::<f32>(&s).unwrap().iter().zip(&r).map(|(y, r)| f64::from(*y) * f64::from(*r)).sum();
        assert!((got - loss(&xh, &w, &b)).abs() < 1e-5);
        let dy = Tensor::from_host(&alloc, &s, &r, &[2, 3]).unwrap();
        let dx = lin.backward(ctx, &[&dy], &s).unwrap().remove(0).unwrap().to_vec(&s).unwrap();
        let num = |v: &[f32], f: &dyn Fn(&[f32]) -> f64| -> Vec<f64> {
            (0..v.len())
                .map(|i| {
                    let (mut up, mut down) = (v.to_vec(), v.to_vec());
                    up[i] += 1e-2;
                    down[i] -= 1e-2;
                    (f(&up) - f(&down)) / 2e-2
                })
                .collect()
        };
        let close = |got: &[f32], want: &[f64]| got.iter().zip(want).all(|(g, w)| (f64::from(*g) - w).abs() < 1e-3);
        assert!(close(&dx, &num(&xh, &|x| loss(x, &w, &b))));
        assert!(close(&lin.weight.grad.to_vec(&s).unwrap(), &num(&w, &|w| loss(&xh, w, &b))));
        assert!(close(&lin.bias.grad.to_vec(&s).unwrap(), &num(&b, &|b| loss(&xh, &w, b))));
        // Split: backward leaves the weight gradients to backward_dw, which adds the same.
        let mut split = Linear::new(&vb.pp("fc2"), (4, 3)).unwrap();
        split.set_split_dw(true);
        let (_, ctx) = split.forward(&Inputs::one(&x), &KeepOnDevice, &s).unwrap();
        split.backward(ctx, &[&dy], &s).unwrap();
        assert!(split.weight.grad.to_vec::<f32>(&s).unwrap().iter().all(|g| *g == 0.0), "deferred");
        split.backward_dw(&s).unwrap();
        assert_eq!(split.weight.grad.to_vec::<f32>(&s).unwrap(), lin.weight.grad.to_vec::<f32>(&s).unwrap());
        assert_eq!(split.bias.grad.to_vec::<f32>(&s).unwrap(), lin.bias.grad.to_vec::<f32>(&s).unwrap());
        // A second backward accumulates the parameter gradients.
        let (_, ctx) = lin.forward(&Inputs::one(&x), &KeepOnDevice, &s).unwrap();
        lin.backward(ctx, &[&dy], &s).unwrap();
        let twice = lin.bias.grad.to_vec(&s).unwrap();
        assert!(close(&twice, &num(&b, &|b| 2.0 * loss(&xh, &w, b))));
    }
}
