//! `y = x·Wᵀ + b`: the GEMMs of a fully connected layer, with the bias in cuBLASLt's epilogue.
//!
//! Gradients: `dx = dy·W` (written), `dW += dyᵀ·x`, `db += dyᵀ·1` (accumulated; the bias
//! gradient is a GEMM against a vector of ones, so its sum runs in cuBLASLt's fixed order).

use super::params::init_uniform;
use super::{Inputs, Module, Param, ParamStore, SaveHook};
use crate::device::Stream;
use crate::memory::CachingAllocator;
use crate::ops::elementwise;
use crate::ops::matmul::{matmul, Matmul};
use crate::tensor::Tensor;
use crate::{Error, Result};

use std::sync::{Mutex, PoisonError};

/// A weight-gradient computation left for `backward_dw`: the output gradient and the input.
type Deferred = (Tensor, Tensor);

/// A fully connected layer over the last dimension of an `(n, in)` input.
pub struct Linear {
    name: String,
    alloc: CachingAllocator,
    /// With a split weight gradient, the `(dy, x)` pairs whose weight gradients
    /// [`Module::backward_dw`] still owes; `None` when `backward` computes them itself.
    deferred: Option<Mutex<Vec<Deferred>>>,
    /// `(out, in)`.
    pub weight: Param,
    /// `(out)`.
    pub bias: Param,
}

/// What the forward saves: the input.
pub struct LinearCtx {
    /// `(n, in)`.
    pub input: Tensor,
}

impl Linear {
    /// The parameters a layer from `in` to `out` features adds to its store: size a
    /// [`ParamStore`] with the counts of the modules it will hold.
    pub fn parameter_count((inputs, outputs): (usize, usize)) -> usize {
        inputs * outputs + outputs
    }

    /// A layer with weights uniform in ±1/√in (PyTorch's default) from `seed`, bias zero.
    pub fn new(
        store: &mut ParamStore,
        alloc: &CachingAllocator,
        name: &str,
        (inputs, outputs): (usize, usize),
        seed: u64,
        stream: &Stream,
    ) -> Result<Linear> {
        let bound = 1.0 / (inputs as f32).sqrt();
        let weight = store.add(
            &format!("{name}.weight"),
            &[outputs, inputs],
            &init_uniform(inputs * outputs, bound, seed),
            stream,
        )?;
        let bias = store.add(&format!("{name}.bias"), &[outputs], &vec![0.0; outputs], stream)?;
        Ok(Linear { name: name.to_string(), alloc: alloc.clone(), deferred: None, weight, bias })
    }

    /// Splits the weight gradient out of `backward` into [`Module::backward_dw`] (or joins it
    /// back). Work already deferred is dropped on a change, so switch between steps.
    pub fn set_split_dw(&mut self, split: bool) {
        self.deferred = split.then(|| Mutex::new(Vec::new()));
    }

    /// `dW += dyᵀ·x` and `db += dyᵀ·1`.
    fn weight_gradients(&self, dy: &Tensor, x: &Tensor, stream: &Stream) -> Result<()> {
        let (i, o) = self.dims();
        let n = dy.shape()[0];
        matmul(Matmul { trans_a: true, beta: 1.0, ..Matmul::new(&self.weight.grad, dy, x, (o, i, n)) }, stream)?;
        let ones = Tensor::uninit(&self.alloc, stream, &[n], dy.dtype())?;
        crate::ops::with_float!("Linear::backward", dy.dtype(), T => elementwise::fill(ones.view::<T>()?, 1.0, stream))?;
        matmul(Matmul { trans_a: true, beta: 1.0, ..Matmul::new(&self.bias.grad, dy, &ones, (o, 1, n)) }, stream)
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
        const OP: &str = "Linear::forward";
        let (i, o) = self.dims();
        let x = inputs.only(OP)?;
        let n = self.rows(OP, x, i)?;
        let y = Tensor::uninit(&self.alloc, stream, &[n, o], x.dtype())?;
        let gemm =
            Matmul { bias: Some(&self.bias.value), trans_b: true, ..Matmul::new(&y, x, &self.weight.value, (n, o, i)) };
        matmul(gemm, stream)?;
        hook.open_group(&self.name)?;
        let input = hook.save("input", x.clone(), stream)?;
        hook.commit_group(&self.name)?;
        Ok((vec![y], LinearCtx { input }))
    }

    fn backward(&self, ctx: LinearCtx, grad_outputs: &[&Tensor], stream: &Stream) -> Result<Vec<Option<Tensor>>> {
        const OP: &str = "Linear::backward";
        let (i, o) = self.dims();
        let dy = grad_outputs.first().ok_or(Error::Shape {
            op: OP,
            expected: "one output gradient".into(),
            found: vec![],
        })?;
        let n = self.rows(OP, dy, o)?;
        let dx = Tensor::uninit(&self.alloc, stream, &[n, i], dy.dtype())?;
        matmul(Matmul::new(&dx, dy, &self.weight.value, (n, i, o)), stream)?;
        match &self.deferred {
            Some(queue) => queue.lock().unwrap_or_else(PoisonError::into_inner).push(((*dy).clone(), ctx.input)),
            None => self.weight_gradients(dy, &ctx.input, stream)?,
        }
        Ok(vec![Some(dx)])
    }

    fn backward_dw(&self, stream: &Stream) -> Result<()> {
        let Some(queue) = &self.deferred else { return Ok(()) };
        let pending = std::mem::take(&mut *queue.lock().unwrap_or_else(PoisonError::into_inner));
        pending.iter().try_for_each(|(dy, x)| self.weight_gradients(dy, x, stream))
    }

    fn splits_dw(&self) -> bool {
        self.deferred.is_some()
    }

    fn parameters(&self) -> Vec<&Param> {
        vec![&self.weight, &self.bias]
    }

    fn set_training(&mut self, _training: bool) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::nn::KeepOnDevice;

    /// Loss Σ y⊙r, its gradient by the module, and by central differences on the host.
    #[test]
    fn gradients_match_finite_differences() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let mut store = ParamStore::new(&alloc, &s, 64).unwrap();
        let lin = Linear::new(&mut store, &alloc, "fc", (4, 3), 7, &s).unwrap();
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
        let mut split = Linear::new(&mut store, &alloc, "fc2", (4, 3), 7, &s).unwrap();
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
