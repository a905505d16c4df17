//! GELU with the tanh approximation, as PyTorch's `gelu(approximate='tanh')` (the MLP activation
//! of the benchmark layer), plain and fused with the bias add of the preceding linear layer: the
//! CPU path of each kernel beside its CUDA entry point in `gelu.cu`.
//!
//! Gradient convention (llm.c `layernorm.cuh`): parameter gradients accumulate (`dbias +=`), so
//! micro-batches sum into one buffer; activation gradients are written (`dinp =`). Tensors must be
//! contiguous; outputs must not alias inputs.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::gelu;
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let inp = Tensor::from_host(&alloc, &s, &[-1.0f32, 0.0, 1.0], &[3])?;
//! let out = Tensor::uninit(&alloc, &s, &[3], graphed::device::DType::F32)?;
//! gelu::gelu_forward(&out, &inp, &s)?;
//! let y = out.to_vec::<f32>(&s)?;
//! assert!((y[0] + 0.158808).abs() < 1e-6 && y[1] == 0.0 && (y[2] - 0.841192).abs() < 1e-6);
//! # Ok::<(), graphed::Error>(())
//! ```

use half::bf16;

use super::{checked, column_sums, count, lanes, rows_cols, stride_dims, with_float, PerFloat};
use crate::device::{args, CpuArgs, Float, In, InOut, Kernel, LaunchDims, Out, Stream};
use crate::tensor::Tensor;
use crate::Result;

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("gelu_math.cu"), include_str!("gelu.cu"));

/// √(2/π) as f32 (`GELU_K` in `gelu_math.cu`).
const GELU_K: f32 = 0.797_884_6;
const GELU_CUBE: f32 = 0.044715;
/// 3·`GELU_CUBE`, written as in `gelu.cu` so both round to the same f32.
const GELU_CUBE3: f32 = 0.134145;

fn gelu(x: f32) -> f32 {
    let cube = GELU_CUBE * x * x * x;
    0.5 * x * (1.0 + (GELU_K * (x + cube)).tanh())
}

/// d gelu/dx, with sech² = 1 − tanh² (as `gelu_math.cu`).
pub(crate) fn gelu_grad(x: f32) -> f32 {
    let cube = GELU_CUBE * x * x * x;
    let t = (GELU_K * (x + cube)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + GELU_CUBE3 * x * x)
}

/// `out = gelu(inp)`, elementwise, in f32.
pub static GELU_FORWARD: Kernel = Kernel {
    name: "gelu_forward_f32",
    source: SOURCE,
    params: &["out", "inp", "n"],
    cpu: forward_cpu::<f32>,
    strided: false,
};

/// As [`GELU_FORWARD`] in bf16: GELU of the widened value, rounded once.
pub static GELU_FORWARD_BF16: Kernel = Kernel {
    name: "gelu_forward_bf16",
    source: SOURCE,
    params: &["out", "inp", "n"],
    cpu: forward_cpu::<bf16>,
    strided: false,
};

fn forward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let inp = a.input::<T>("inp")?;
    a.output::<T>("out")?.iter_mut().zip(inp.iter()).for_each(|(y, x)| *y = T::from_f32(gelu(x.to_f32())));
    Ok(())
}

/// `out = gelu(inp)` for f32 or bf16 tensors of one shape and type.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) if the shapes differ; [`Error::NotContiguous`](crate::Error::NotContiguous) for a strided tensor;
/// [`Error::UnsupportedDType`](crate::Error::UnsupportedDType) for another type.
pub fn gelu_forward(out: &Tensor, inp: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "gelu_forward";
    with_float!(OP, inp.dtype(), T => {
        let shape = inp.shape();
        let kernel = PerFloat { f32: &GELU_FORWARD, bf16: &GELU_FORWARD_BF16 }.of::<T>(OP)?;
        let args =
            args![Out(checked::<T>(OP, "out", out, shape)?), In(checked::<T>(OP, "inp", inp, shape)?), n_of(OP, inp)?];
        stream.launch(kernel, stride_dims(inp.numel().div_ceil(lanes::<T>())), &args)
    })
}

/// `dinp = gelu'(inp)·dout`, elementwise, in f32.
pub static GELU_BACKWARD: Kernel = Kernel {
    name: "gelu_backward_f32",
    source: SOURCE,
    params: &["dinp", "inp", "dout", "n"],
    cpu: backward_cpu::<f32>,
    strided: false,
};

/// As [`GELU_BACKWARD`] in bf16: the product of the widened values, rounded once.
pub static GELU_BACKWARD_BF16: Kernel = Kernel {
    name: "gelu_backward_bf16",
    source: SOURCE,
    params: &["dinp", "inp", "dout", "n"],
    cpu: backward_cpu::<bf16>,
    strided: false,
};

fn backward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (inp, dout) = (a.input::<T>("inp")?, a.input::<T>("dout")?);
    let mut dinp = a.output::<T>("dinp")?;
    (dinp.iter_mut().zip(inp.iter().zip(dout.iter())))
        .for_each(|(dx, (x, g))| *dx = T::from_f32(gelu_grad(x.to_f32()) * g.to_f32()));
    Ok(())
}

/// Writes `dinp = gelu'(inp)·dout` for f32 or bf16 tensors of one shape and type.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) if the shapes differ; [`Error::NotContiguous`](crate::Error::NotContiguous) for a strided tensor;
/// [`Error::UnsupportedDType`](crate::Error::UnsupportedDType) for another type (and a mismatch
/// is refused as the views are taken).
pub fn gelu_backward(dinp: &Tensor, inp: &Tensor, dout: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "gelu_backward";
    with_float!(OP, inp.dtype(), T => {
        let shape = inp.shape();
        let kernel = PerFloat { f32: &GELU_BACKWARD, bf16: &GELU_BACKWARD_BF16 }.of::<T>(OP)?;
        let args = args![
            Out(checked::<T>(OP, "dinp", dinp, shape)?),
            In(checked::<T>(OP, "inp", inp, shape)?),
            In(checked::<T>(OP, "dout", dout, shape)?),
            n_of(OP, inp)?,
        ];
        stream.launch(kernel, stride_dims(inp.numel().div_ceil(lanes::<T>())), &args)
    })
}

/// `out[r, c] = gelu(inp[r, c] + bias[c])`, elementwise.
pub static BIAS_GELU_FORWARD: Kernel = Kernel {
    name: "bias_gelu_forward_f32",
    source: SOURCE,
    params: &["out", "inp", "bias", "n", "C"],
    cpu: bias_forward_cpu,
    strided: false,
};

fn bias_forward_cpu(a: &CpuArgs) -> Result<()> {
    let (inp, bias) = (a.input::<f32>("inp")?, a.input::<f32>("bias")?);
    let c = a.u32("C")? as usize;
    for (y, x) in a.output::<f32>("out")?.chunks_exact_mut(c).zip(inp.chunks_exact(c)) {
        y.iter_mut().zip(x.iter().zip(bias.iter())).for_each(|(y, (x, b))| *y = gelu(x + b));
    }
    Ok(())
}

/// `out = gelu(inp + bias)` for a pre-activation `inp` (N, C) and its bias (C), broadcast over
/// rows: the bias add of the preceding linear layer fused into the activation.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless `inp` is (N, C) with C > 0, `out` (N, C) and `bias` (C);
/// [`Error::NotContiguous`](crate::Error::NotContiguous) for a strided tensor.
pub fn bias_gelu_forward(out: &Tensor, inp: &Tensor, bias: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "bias_gelu_forward";
    let (n, c) = rows_cols(OP, inp)?;
    let args = args![
        Out(checked::<f32>(OP, "out", out, &[n, c])?),
        In(checked::<f32>(OP, "inp", inp, &[n, c])?),
        In(checked::<f32>(OP, "bias", bias, &[c])?),
        n_of(OP, inp)?,
        count(OP, c)?,
    ];
    stream.launch(&BIAS_GELU_FORWARD, LaunchDims::for_elems(inp.numel()), &args)
}

/// `dinp[r, c] = gelu'(inp[r, c] + bias[c])·dout[r, c]`, elementwise.
pub static BIAS_GELU_BACKWARD: Kernel = Kernel {
    name: "bias_gelu_backward_f32",
    source: SOURCE,
    params: &["dinp", "inp", "bias", "dout", "n", "C"],
    cpu: bias_backward_cpu,
    strided: false,
};

fn bias_backward_cpu(a: &CpuArgs) -> Result<()> {
    let (inp, bias, dout) = (a.input::<f32>("inp")?, a.input::<f32>("bias")?, a.input::<f32>("dout")?);
    let c = a.u32("C")? as usize;
    let mut dinp = a.output::<f32>("dinp")?;
    for ((dx, x), g) in dinp.chunks_exact_mut(c).zip(inp.chunks_exact(c)).zip(dout.chunks_exact(c)) {
        for ((dx, (x, b)), g) in dx.iter_mut().zip(x.iter().zip(bias.iter())).zip(g) {
            *dx = gelu_grad(x + b) * g;
        }
    }
    Ok(())
}

/// `acc[c] += Σ_r x[r, c]` (one thread per column on CUDA, rows in index order).
pub static COLUMN_SUM_ADD: Kernel = Kernel {
    name: "column_sum_add_f32",
    source: SOURCE,
    params: &["acc", "x", "rows", "C"],
    cpu: column_sum_add_cpu,
    strided: false,
};

fn column_sum_add_cpu(a: &CpuArgs) -> Result<()> {
    let sums = column_sums(&a.input::<f32>("x")?, a.u32("C")? as usize);
    a.output::<f32>("acc")?.iter_mut().zip(sums).for_each(|(acc, s)| *acc += s);
    Ok(())
}

/// Writes `dinp`, the gradient of [`bias_gelu_forward`] for its pre-activation, and accumulates
/// `dbias += Σ_rows dinp`.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless `inp` is (N, C) with C > 0, `dinp` and `dout` (N, C), `bias` and
/// `dbias` (C); [`Error::NotContiguous`](crate::Error::NotContiguous) for a strided tensor.
pub fn bias_gelu_backward(
    dinp: &Tensor,
    dbias: &Tensor,
    inp: &Tensor,
    bias: &Tensor,
    dout: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "bias_gelu_backward";
    let (n, c) = rows_cols(OP, inp)?;
    let dinp = checked::<f32>(OP, "dinp", dinp, &[n, c])?;
    let (numel, c32) = (n_of(OP, inp)?, count(OP, c)?);
    let args = args![
        Out(dinp),
        In(checked::<f32>(OP, "inp", inp, &[n, c])?),
        In(checked::<f32>(OP, "bias", bias, &[c])?),
        In(checked::<f32>(OP, "dout", dout, &[n, c])?),
        numel,
        c32,
    ];
    let sums = args![InOut(checked::<f32>(OP, "dbias", dbias, &[c])?), In(dinp), count(OP, n)?, c32];
    stream.launch(&BIAS_GELU_BACKWARD, LaunchDims::for_elems(inp.numel()), &args)?;
    stream.launch(&COLUMN_SUM_ADD, LaunchDims::for_elems(c), &sums)
}

fn n_of(op: &'static str, t: &Tensor) -> Result<u32> {
    count(op, t.numel())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_cuda_source() {
        assert_eq!(GELU_K, (2.0 / std::f64::consts::PI).sqrt() as f32);
        for (name, v) in [("GELU_K", GELU_K), ("GELU_CUBE", GELU_CUBE), ("GELU_CUBE3", GELU_CUBE3)] {
            assert!(SOURCE.contains(&format!("#define {name} {v}f")), "{name} differs in gelu_math.cu");
        }
    }

    #[test]
    fn matches_the_formula_in_f64() {
        // The tanh formula and its derivative evaluated in f64 (central differences agree).
        for (x, y, dy) in [(1.0f32, 0.841_192, 1.082_964_1), (-2.5, -0.015_084_266, -0.037_951_576)] {
            assert!((gelu(x) - y).abs() < 1e-6, "gelu({x}) = {}", gelu(x));
            assert!((gelu_grad(x) - dy).abs() < 1e-5, "gelu'({x}) = {}", gelu_grad(x));
        }
    }
}
