//! LayerNorm over the last dimension of an `(N, C)` f32 matrix with f32 statistics (LN1 and LN2 of
//! the benchmark layer, eps 1e-5): the CPU path of each kernel beside its CUDA entry point in
//! `layernorm.cu`. The forward saves each row's mean and reciprocal standard deviation (`rstd`),
//! so the backward does not recompute them.
//!
//! Gradient convention (llm.c `layernorm.cuh`): parameter gradients accumulate (`dweight +=`,
//! `dbias +=`), so micro-batches sum into one buffer; the activation gradient is written
//! (`dinp =`). Tensors must be contiguous; outputs must not alias inputs.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::layernorm;
//! use graphed::tensor::Tensor;
//!
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let inp = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0, 3.0, 4.0], &[1, 4])?;
//! let (weight, bias) = (Tensor::from_host(&alloc, &s, &[1.0f32; 4], &[4])?, Tensor::zeros(&alloc, &s, &[4], graphed::device::DType::F32)?);
//! let out = Tensor::uninit(&alloc, &s, &[1, 4], graphed::device::DType::F32)?;
//! let (mean, rstd) = (Tensor::uninit(&alloc, &s, &[1], graphed::device::DType::F32)?, Tensor::uninit(&alloc, &s, &[1], graphed::device::DType::F32)?);
//! layernorm::layernorm_forward(&out, &mean, &rstd, &inp, &weight, &bias, 1e-5, &s)?;
//! assert_eq!(mean.to_vec::<f32>(&s)?, vec![2.5]);
//! let y = out.to_vec::<f32>(&s)?;
//! assert!(y.iter().sum::<f32>().abs() < 1e-6 && (y[3] - 1.3416).abs() < 1e-4);
//! # Ok::<(), graphed::Error>(())
//! ```

use super::{checked, count, row_blocks, rows_cols};
use crate::device::{args, CpuArgs, In, InOut, Kernel, LaunchDims, Out, Stream};
use crate::tensor::Tensor;
use crate::Result;

const SOURCE: &str = concat!(include_str!("reduce.cu"), include_str!("layernorm.cu"));

/// Normalizes each row and saves its statistics (one block per row on CUDA).
pub static LAYERNORM_FORWARD: Kernel = Kernel {
    name: "layernorm_forward_f32",
    source: SOURCE,
    params: &["out", "mean", "rstd", "inp", "weight", "bias", "eps", "rows", "C"],
    cpu: forward_cpu,
    strided: false,
};

fn forward_cpu(a: &CpuArgs) -> Result<()> {
    let (inp, weight, bias) = (a.input::<f32>("inp")?, a.input::<f32>("weight")?, a.input::<f32>("bias")?);
    let (eps, c) = (a.f32("eps")?, a.u32("C")? as usize);
    let (mut out, mut mean, mut rstd) = (a.output::<f32>("out")?, a.output::<f32>("mean")?, a.output::<f32>("rstd")?);
    let rows = out.chunks_exact_mut(c).zip(inp.chunks_exact(c));
    for ((y, x), (m_out, r_out)) in rows.zip(mean.iter_mut().zip(rstd.iter_mut())) {
        let m = x.iter().sum::<f32>() / c as f32;
        let var = x.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / c as f32;
        let r = 1.0 / (var + eps).sqrt();
        for (((y, x), w), b) in y.iter_mut().zip(x).zip(weight.iter()).zip(bias.iter()) {
            *y = (x - m) * r * w + b;
        }
        (*m_out, *r_out) = (m, r);
    }
    Ok(())
}

/// `out = (inp − mean)·rstd·weight + bias` over each row of `inp` (N, C), with
/// `rstd = 1/√(var + eps)` and the biased variance; writes `mean` and `rstd` (N) for
/// [`layernorm_backward`].
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless `inp` is (N, C) with C > 0, `out` (N, C), `mean` and `rstd` (N),
/// `weight` and `bias` (C); [`Error::NotContiguous`](crate::Error::NotContiguous) for a strided tensor.
#[allow(clippy::too_many_arguments)] // llm.c's order: outputs, inputs, sizes, stream
pub fn layernorm_forward(
    out: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    inp: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f32,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "layernorm_forward";
    let (n, c) = rows_cols(OP, inp)?;
    let args = args![
        Out(checked::<f32>(OP, "out", out, &[n, c])?),
        Out(checked::<f32>(OP, "mean", mean, &[n])?),
        Out(checked::<f32>(OP, "rstd", rstd, &[n])?),
        In(checked::<f32>(OP, "inp", inp, &[n, c])?),
        In(checked::<f32>(OP, "weight", weight, &[c])?),
        In(checked::<f32>(OP, "bias", bias, &[c])?),
        eps,
        count(OP, n)?,
        count(OP, c)?,
    ];
    stream.launch(&LAYERNORM_FORWARD, row_blocks(OP, n)?, &args)
}

/// The input gradient of each row (one block per row on CUDA).
pub static LAYERNORM_BACKWARD_DINP: Kernel = Kernel {
    name: "layernorm_backward_dinp_f32",
    source: SOURCE,
    params: &["dinp", "dout", "inp", "weight", "mean", "rstd", "rows", "C"],
    cpu: backward_dinp_cpu,
    strided: false,
};

fn backward_dinp_cpu(a: &CpuArgs) -> Result<()> {
    let (dout, inp, weight) = (a.input::<f32>("dout")?, a.input::<f32>("inp")?, a.input::<f32>("weight")?);
    let (mean, rstd, c) = (a.input::<f32>("mean")?, a.input::<f32>("rstd")?, a.u32("C")? as usize);
    let mut dinp = a.output::<f32>("dinp")?;
    let rows = dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c));
    for (((dx, g), x), (&m, &r)) in rows.zip(mean.iter().zip(rstd.iter())) {
        let terms = || x.iter().zip(g).zip(weight.iter()).map(|((x, g), w)| ((x - m) * r, g * w));
        let (dn_sum, dnn_sum) = terms().fold((0.0f32, 0.0f32), |(a, b), (norm, dn)| (a + dn, b + dn * norm));
        let (dn_mean, dnn_mean) = (dn_sum / c as f32, dnn_sum / c as f32);
        for (dx, (norm, dn)) in dx.iter_mut().zip(terms()) {
            *dx = (dn - dn_mean - norm * dnn_mean) * r;
        }
    }
    Ok(())
}

/// The parameter gradients, accumulated (one thread per column on CUDA).
pub static LAYERNORM_BACKWARD_PARAMS: Kernel = Kernel {
    name: "layernorm_backward_params_f32",
    source: SOURCE,
    params: &["dweight", "dbias", "dout", "inp", "mean", "rstd", "rows", "C"],
    cpu: backward_params_cpu,
    strided: false,
};

fn backward_params_cpu(a: &CpuArgs) -> Result<()> {
    let (dout, inp, mean, rstd) =
        (a.input::<f32>("dout")?, a.input::<f32>("inp")?, a.input::<f32>("mean")?, a.input::<f32>("rstd")?);
    let c = a.u32("C")? as usize;
    let (mut dweight, mut dbias) = (a.output::<f32>("dweight")?, a.output::<f32>("dbias")?);
    // Column sums over rows in index order, added once at the end: the CUDA kernel's order.
    let (mut dw, mut db) = (vec![0.0f32; c], vec![0.0f32; c]);
    let rows = dout.chunks_exact(c).zip(inp.chunks_exact(c)).zip(mean.iter().zip(rstd.iter()));
    for ((g, x), (&m, &r)) in rows {
        for (col, (g, x)) in g.iter().zip(x).enumerate() {
            dw[col] += g * ((x - m) * r);
            db[col] += g;
        }
    }
    dweight.iter_mut().zip(dw).for_each(|(acc, v)| *acc += v);
    dbias.iter_mut().zip(db).for_each(|(acc, v)| *acc += v);
    Ok(())
}

/// Writes `dinp` and accumulates `dweight += Σ_rows dout·norm`, `dbias += Σ_rows dout`, from the
/// `mean` and `rstd` that [`layernorm_forward`] saved for `inp`.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) unless `dout` is (N, C) with C > 0, `dinp` and `inp` (N, C), `dweight`,
/// `dbias` and `weight` (C), `mean` and `rstd` (N); [`Error::NotContiguous`](crate::Error::NotContiguous) for a strided tensor.
#[allow(clippy::too_many_arguments)] // llm.c's order: outputs, inputs, sizes, stream
pub fn layernorm_backward(
    dinp: &Tensor,
    dweight: &Tensor,
    dbias: &Tensor,
    dout: &Tensor,
    inp: &Tensor,
    weight: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    stream: &Stream,
) -> Result<()> {
    const OP: &str = "layernorm_backward";
    let (n, c) = rows_cols(OP, dout)?;
    let (dout, inp) = (checked::<f32>(OP, "dout", dout, &[n, c])?, checked::<f32>(OP, "inp", inp, &[n, c])?);
    let (mean, rstd) = (checked::<f32>(OP, "mean", mean, &[n])?, checked::<f32>(OP, "rstd", rstd, &[n])?);
    let args = args![
        Out(checked::<f32>(OP, "dinp", dinp, &[n, c])?),
        In(dout),
        In(inp),
        In(checked::<f32>(OP, "weight", weight, &[c])?),
        In(mean),
        In(rstd),
        count(OP, n)?,
        count(OP, c)?,
    ];
    let params = args![
        InOut(checked::<f32>(OP, "dweight", dweight, &[c])?),
        InOut(checked::<f32>(OP, "dbias", dbias, &[c])?),
        In(dout),
        In(inp),
        In(mean),
        In(rstd),
        count(OP, n)?,
        count(OP, c)?,
    ];
    stream.launch(&LAYERNORM_BACKWARD_DINP, row_blocks(OP, n)?, &args)?;
    stream.launch(&LAYERNORM_BACKWARD_PARAMS, LaunchDims::for_elems(c), &params)
}
