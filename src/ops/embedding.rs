//! Token + position embedding (GPT-2's encoder): `out[b, t] = wte[tokens[b, t]] + wpe[t]`. The
//! backward accumulates (`+=`) into the parameter gradients `dwte` and `dwpe`, as llm.c's
//! `encoder.cuh` does. Tables, activations and gradients are f32 or bf16 (one element type per
//! call; sums in f32, rounded once per stored value): one CUDA template per kernel in
//! `embedding.cu` and one generic CPU path each here.
//!
//! Deterministic without atomics: each gradient element is summed by one thread over the
//! positions in order (see `embedding.cu`), and the CPU paths add in that same order, so both
//! devices give bitwise equal results. The `dwte` kernel reads every position for every (v, c):
//! O(V·C·B·T) work, cheap for the small vocabularies this project trains on; a large vocabulary
//! wants a sort-by-token kernel instead. A token not below V makes the CPU path fail (reported
//! by the next synchronizing call); a kernel cannot fail, so CUDA skips it: a zero token
//! embedding in the forward, no gradient in the backward.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::embedding;
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let wte = Tensor::from_host(&alloc, &s, &[0.0f32, 0.0, 10.0, 20.0], &[2, 2])?; // (V, C)
//! let wpe = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2])?; // (Tmax, C)
//! let tokens = Tensor::from_host(&alloc, &s, &[1u32, 0], &[1, 2])?; // (B, T)
//! let out = Tensor::zeros(&alloc, &s, &[1, 2, 2], graphed::device::DType::F32)?;
//! embedding::embedding_forward(&out, &tokens, &wte, &wpe, &s)?;
//! assert_eq!(out.to_vec::<f32>(&s)?, vec![11.0, 22.0, 3.0, 4.0]);
//! # Ok::<(), graphed::Error>(())
//! ```

use half::bf16;

use super::{count, dense, float_dtype, lanes, stride_dims, with_float, PerFloat};
use crate::device::{args, CpuArgs, Float, In, InOut, Kernel, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("embedding.cu"));

const FORWARD: [&str; 8] = ["out", "tokens", "wte", "wpe", "n", "t_len", "c_len", "v"];

/// Embedding forward in f32.
pub static EMBEDDING_FORWARD: Kernel =
    Kernel { name: "embedding_forward_f32", source: SOURCE, params: &FORWARD, cpu: forward_cpu::<f32>, strided: false };

/// Embedding forward in bf16 (the two rows added in f32, rounded once).
pub static EMBEDDING_FORWARD_BF16: Kernel = Kernel {
    name: "embedding_forward_bf16",
    source: SOURCE,
    params: &FORWARD,
    cpu: forward_cpu::<bf16>,
    strided: false,
};

fn forward_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (tokens, wte, wpe) = (a.input::<u32>("tokens")?, a.input::<T>("wte")?, a.input::<T>("wpe")?);
    let (t_len, c) = (a.u32("t_len")? as usize, a.u32("c_len")? as usize);
    let mut out = a.output::<T>("out")?;
    for (bt, (y, &tok)) in out.chunks_exact_mut(c).zip(tokens.iter()).enumerate() {
        let row = token_row(a, &wte, tok, c, bt)?;
        let pos = &wpe[(bt % t_len) * c..][..c];
        y.iter_mut().zip(row).zip(pos).for_each(|((y, e), p)| *y = T::from_f32(e.to_f32() + p.to_f32()));
    }
    Ok(())
}

/// `out (B, T, C) = wte[tokens]` + `wpe[..T]`, with `tokens (B, T)` (`u32`), `wte (V, C)`,
/// `wpe (Tmax, C)`, T ≤ Tmax, all contiguous; `out` and both tables of one element type, f32 or
/// bf16 (added in f32, rounded once).
///
/// # Errors
/// [`Error::UnsupportedDType`] or [`Error::DTypeMismatch`] for other element types;
/// [`Error::Shape`] for other shapes; [`Error::NotContiguous`] for a strided tensor; all before
/// anything is enqueued.
pub fn embedding_forward(out: &Tensor, tokens: &Tensor, wte: &Tensor, wpe: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "embedding_forward";
    let dtype = float_dtype(OP, wte, &[wpe, out])?;
    let d = Dims::of(OP, tokens, wte, wpe)?;
    out.expect_shape(OP, &[d.b, d.t, d.c])?;
    let n = count(OP, d.b * d.t * d.c)?;
    if n == 0 {
        return Ok(());
    }
    let wpe = wpe.narrow(0, 0, d.t)?;
    let (t, c, v) = (count(OP, d.t)?, count(OP, d.c)?, count(OP, d.v)?);
    count(OP, d.v * d.c)?; // the kernel's offsets into wte are u32
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &EMBEDDING_FORWARD, bf16: &EMBEDDING_FORWARD_BF16 }.of::<T>(OP)?;
        let (out, tokens, wte, wpe) =
            (dense::<T>(OP, out)?, dense::<u32>(OP, tokens)?, dense::<T>(OP, wte)?, dense::<T>(OP, &wpe)?);
        let units = if d.c.is_multiple_of(lanes::<T>()) { out.len() / lanes::<T>() } else { out.len() };
        stream.launch(kernel, stride_dims(units), &args![Out(out), In(tokens), In(wte), In(wpe), n, t, c, v])
    })
}

const BACKWARD_WTE: [&str; 6] = ["dwte", "dout", "tokens", "vc", "c_len", "positions"];

/// Embedding backward into the token table's gradient, in f32.
pub static EMBEDDING_BACKWARD_WTE: Kernel = Kernel {
    name: "embedding_backward_wte_f32",
    source: SOURCE,
    params: &BACKWARD_WTE,
    cpu: backward_wte_cpu::<f32>,
    strided: false,
};

/// Embedding backward into the token table's gradient, in bf16 (summed in f32, added once).
pub static EMBEDDING_BACKWARD_WTE_BF16: Kernel = Kernel {
    name: "embedding_backward_wte_bf16",
    source: SOURCE,
    params: &BACKWARD_WTE,
    cpu: backward_wte_cpu::<bf16>,
    strided: false,
};

fn backward_wte_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (dout, tokens, c) = (a.input::<T>("dout")?, a.input::<u32>("tokens")?, a.u32("c_len")? as usize);
    let mut dwte = a.output::<T>("dwte")?;
    // Per (v, c) the same order as the kernel: positions ascending, starting from 0, in f32.
    let mut acc = vec![0.0f32; dwte.len()];
    for (p, (dy, &tok)) in dout.chunks_exact(c).zip(tokens.iter()).enumerate() {
        let row = acc.get_mut(tok as usize * c..(tok as usize + 1) * c).ok_or_else(|| bad_token(a, tok, p))?;
        row.iter_mut().zip(dy).for_each(|(s, d)| *s += d.to_f32());
    }
    dwte.iter_mut().zip(&acc).for_each(|(w, &s)| *w = T::from_f32(w.to_f32() + s));
    Ok(())
}

const BACKWARD_WPE: [&str; 4] = ["dwpe", "dout", "tc", "batch"];

/// Embedding backward into the position table's gradient, in f32.
pub static EMBEDDING_BACKWARD_WPE: Kernel = Kernel {
    name: "embedding_backward_wpe_f32",
    source: SOURCE,
    params: &BACKWARD_WPE,
    cpu: backward_wpe_cpu::<f32>,
    strided: false,
};

/// Embedding backward into the position table's gradient, in bf16 (summed in f32, added once).
pub static EMBEDDING_BACKWARD_WPE_BF16: Kernel = Kernel {
    name: "embedding_backward_wpe_bf16",
    source: SOURCE,
    params: &BACKWARD_WPE,
    cpu: backward_wpe_cpu::<bf16>,
    strided: false,
};

fn backward_wpe_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (dout, tc) = (a.input::<T>("dout")?, a.u32("tc")? as usize);
    let mut dwpe = a.output::<T>("dwpe")?;
    // Per (t, c) the same order as the kernel: b ascending, starting from 0, in f32.
    let mut acc = vec![0.0f32; tc];
    for dy in dout.chunks_exact(tc) {
        acc.iter_mut().zip(dy).for_each(|(s, d)| *s += d.to_f32());
    }
    dwpe.iter_mut().zip(&acc).for_each(|(w, &s)| *w = T::from_f32(w.to_f32() + s));
    Ok(())
}

/// `dwte (V, C) += Σ dout` over the positions holding each token and `dwpe (Tmax, C)[..T] +=
/// Σ_b dout[b]`, with `dout (B, T, C)` and the `tokens (B, T)` of the forward, all contiguous;
/// `dout` and both gradients of one element type, f32 or bf16 (each gradient element's sum is
/// taken in f32 in position order and added once, rounded once).
///
/// # Errors
/// As [`embedding_forward`].
pub fn embedding_backward(dwte: &Tensor, dwpe: &Tensor, dout: &Tensor, tokens: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "embedding_backward";
    let dtype = float_dtype(OP, dwte, &[dwpe, dout])?;
    let d = Dims::of(OP, tokens, dwte, dwpe)?;
    dout.expect_shape(OP, &[d.b, d.t, d.c])?;
    let (positions, vc, tc) = (count(OP, d.b * d.t)?, count(OP, d.v * d.c)?, count(OP, d.t * d.c)?);
    if positions == 0 {
        return Ok(());
    }
    let dwpe = dwpe.narrow(0, 0, d.t)?;
    with_float!(OP, dtype, T => {
        let wte_kernel = PerFloat { f32: &EMBEDDING_BACKWARD_WTE, bf16: &EMBEDDING_BACKWARD_WTE_BF16 }.of::<T>(OP)?;
        let wpe_kernel = PerFloat { f32: &EMBEDDING_BACKWARD_WPE, bf16: &EMBEDDING_BACKWARD_WPE_BF16 }.of::<T>(OP)?;
        let (dwte, dwpe, dout, tokens) =
            (dense::<T>(OP, dwte)?, dense::<T>(OP, &dwpe)?, dense::<T>(OP, dout)?, dense::<u32>(OP, tokens)?);
        let (c, batch) = (count(OP, d.c)?, count(OP, d.b)?);
        stream.launch(wte_kernel, stride_dims(vc as usize), &args![InOut(dwte), In(dout), In(tokens), vc, c, positions])?;
        stream.launch(wpe_kernel, stride_dims(tc as usize), &args![InOut(dwpe), In(dout), tc, batch])
    })
}

/// The sizes shared by forward and backward, from `tokens (B, T)`, a `(V, C)` token table and a
/// `(Tmax, C)` position table.
struct Dims {
    b: usize,
    t: usize,
    c: usize,
    v: usize,
}

impl Dims {
    fn of(op: &'static str, tokens: &Tensor, wte: &Tensor, wpe: &Tensor) -> Result<Dims> {
        let &[b, t] = tokens.shape() else {
            return Err(Error::Shape { op, expected: "(B, T) tokens".into(), found: tokens.shape().to_vec() });
        };
        let &[v, c] = wte.shape() else {
            return Err(Error::Shape { op, expected: "a (V, C) token table".into(), found: wte.shape().to_vec() });
        };
        if v == 0 || c == 0 {
            return Err(Error::Shape {
                op, expected: "a (V, C) token table with V, C ≥ 1".into(), found: vec![v, c]
            });
        }
        match *wpe.shape() {
            [t_max, c_pos] if c_pos == c && t_max >= t => Ok(Dims { b, t, c, v }),
            _ => Err(Error::Shape {
                op,
                expected: format!("a (Tmax, {c}) position table with Tmax ≥ T = {t}"),
                found: wpe.shape().to_vec(),
            }),
        }
    }
}

/// Row `tok` of a `(V, c)` table, or the out-of-vocabulary failure of position `p`.
fn token_row<'w, T>(a: &CpuArgs, table: &'w [T], tok: u32, c: usize, p: usize) -> Result<&'w [T]> {
    table.get(tok as usize * c..(tok as usize + 1) * c).ok_or_else(|| bad_token(a, tok, p))
}

fn bad_token(a: &CpuArgs, tok: u32, p: usize) -> Error {
    Error::KernelFailed {
        kernel: a.kernel.name,
        message: format!("token {tok} at position {p} is not below the vocabulary size (CUDA skips it)"),
    }
}
