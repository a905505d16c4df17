//! Attention heads between the `(B·T, P·C)` activations of the projections (head `h` of block
//! `p` is a column block) and the contiguous `(B, H, T, hd)` layout in which one strided-batched
//! GEMM covers every (batch element, head) pair, in f32 or bf16. Pure permutations, bitwise equal
//! on both devices: one CUDA template per kernel in `heads.cu` and one generic CPU path each.
//!
//! [`split_qkv`] and [`merge_qkv`] move all three blocks of a QKV activation (or its gradient) in
//! one launch; [`heads_from_rows`] and [`rows_from_heads`] move one block, passed as a strided
//! view of its columns, so the declared accesses are exactly the block (on CUDA the kernels index
//! it with its leading dimension).
//!
//! ```
//! use graphed::device::{DType, Device};
//! use graphed::memory::CachingAllocator;
//! use graphed::ops::heads;
//! use graphed::tensor::Tensor;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let alloc = CachingAllocator::new(&dev);
//! let (b, h, t, hd) = (1, 2, 2, 1); // C = 2: each row is [q0 q1 | k0 k1 | v0 v1]
//! let qkv = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0], &[2, 6])?;
//! let [q, k, v] = [(); 3].map(|_| Tensor::zeros(&alloc, &s, &[b, h, t, hd], DType::F32).unwrap());
//! heads::split_qkv(&q, &k, &v, &qkv, &s)?;
//! assert_eq!(k.to_vec::<f32>(&s)?, vec![3.0, 9.0, 4.0, 10.0], "head 0 at t = 0, 1, then head 1");
//! # Ok::<(), graphed::Error>(())
//! ```

use half::bf16;

use super::{count, float_dtype, lanes, stride_dims, with_float, PerFloat};
use crate::device::{args, CpuArgs, Elem, Float, In, Kernel, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("heads.cu"));

const ONE_PART: [&str; 7] = ["dst", "src", "B", "H", "T", "hd", "ld"];

/// `dst[b, h, t, d] = block[b·T + t, h·hd + d]` in f32.
pub static HEADS_FROM_ROWS: Kernel =
    Kernel { name: "heads_from_rows_f32", source: SOURCE, params: &ONE_PART, cpu: from_rows_cpu::<f32>, strided: true };

/// `dst[b, h, t, d] = block[b·T + t, h·hd + d]` in bf16.
pub static HEADS_FROM_ROWS_BF16: Kernel = Kernel {
    name: "heads_from_rows_bf16",
    source: SOURCE,
    params: &ONE_PART,
    cpu: from_rows_cpu::<bf16>,
    strided: true,
};

/// `block[b·T + t, h·hd + d] = src[b, h, t, d]` in f32.
pub static ROWS_FROM_HEADS: Kernel =
    Kernel { name: "rows_from_heads_f32", source: SOURCE, params: &ONE_PART, cpu: to_rows_cpu::<f32>, strided: true };

/// `block[b·T + t, h·hd + d] = src[b, h, t, d]` in bf16.
pub static ROWS_FROM_HEADS_BF16: Kernel =
    Kernel { name: "rows_from_heads_bf16", source: SOURCE, params: &ONE_PART, cpu: to_rows_cpu::<bf16>, strided: true };

const SPLIT: [&str; 8] = ["q", "k", "v", "qkv", "B", "H", "T", "hd"];

/// `q, k, v = blocks 0, 1, 2 of qkv`, in f32.
pub static SPLIT_QKV: Kernel =
    Kernel { name: "split_qkv_f32", source: SOURCE, params: &SPLIT, cpu: split_cpu::<f32>, strided: false };

/// `q, k, v = blocks 0, 1, 2 of qkv`, in bf16.
pub static SPLIT_QKV_BF16: Kernel =
    Kernel { name: "split_qkv_bf16", source: SOURCE, params: &SPLIT, cpu: split_cpu::<bf16>, strided: false };

const MERGE: [&str; 8] = ["dqkv", "dq", "dk", "dv", "B", "H", "T", "hd"];

/// `dqkv = [dq | dk | dv]`, in f32.
pub static MERGE_QKV: Kernel =
    Kernel { name: "merge_qkv_f32", source: SOURCE, params: &MERGE, cpu: merge_cpu::<f32>, strided: false };

/// `dqkv = [dq | dk | dv]`, in bf16.
pub static MERGE_QKV_BF16: Kernel =
    Kernel { name: "merge_qkv_bf16", source: SOURCE, params: &MERGE, cpu: merge_cpu::<bf16>, strided: false };

/// The (B, H, T, hd) scalars.
fn dims(a: &CpuArgs) -> Result<[usize; 4]> {
    let [b, h, t, hd] = ["B", "H", "T", "hd"].map(|p| a.u32(p).map(|v| v as usize));
    Ok([b?, h?, t?, hd?])
}

/// The index in a dense `(B·T, P·H·hd)` matrix of element `i` of a `(B, H, T, hd)` tensor, in
/// block 0 (`parts` = P blocks per row).
fn row_index(i: usize, [_, h, t, hd]: [usize; 4], parts: usize) -> usize {
    let (d, tt, hh, b) = (i % hd, (i / hd) % t, (i / (hd * t)) % h, i / (hd * t * h));
    (b * t + tt) * (parts * h * hd) + hh * hd + d
}

fn from_rows_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let dims = dims(a)?;
    let src = a.input::<T>("src")?;
    a.output::<T>("dst")?.iter_mut().enumerate().for_each(|(i, v)| *v = src[row_index(i, dims, 1)]);
    Ok(())
}

fn to_rows_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let dims = dims(a)?;
    let src = a.input::<T>("src")?;
    let mut dst = a.output::<T>("dst")?;
    src.iter().enumerate().for_each(|(i, v)| dst[row_index(i, dims, 1)] = *v);
    Ok(())
}

fn split_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let dims = dims(a)?;
    let c = dims[1] * dims[3];
    let qkv = a.input::<T>("qkv")?;
    for (part, name) in ["q", "k", "v"].into_iter().enumerate() {
        let mut out = a.output::<T>(name)?;
        out.iter_mut().enumerate().for_each(|(i, v)| *v = qkv[row_index(i, dims, 3) + part * c]);
    }
    Ok(())
}

fn merge_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let dims = dims(a)?;
    let c = dims[1] * dims[3];
    let mut dqkv = a.output::<T>("dqkv")?;
    for (part, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
        let src = a.input::<T>(name)?;
        src.iter().enumerate().for_each(|(i, v)| dqkv[row_index(i, dims, 3) + part * c] = *v);
    }
    Ok(())
}

/// The `(B, H, T, hd)` of a heads tensor, which must be contiguous.
fn head_dims(op: &'static str, heads: &Tensor) -> Result<[usize; 4]> {
    let &[b, h, t, hd] = heads.shape() else {
        return Err(Error::Shape { op, expected: "(B, H, T, hd) heads".into(), found: heads.shape().to_vec() });
    };
    heads.expect_contiguous(op)?;
    Ok([b, h, t, hd])
}

/// The column block `part` of a `(B·T, P·C)` tensor that holds the heads of a `(B, H, T, hd)`
/// one, and its leading dimension.
fn block(op: &'static str, rows: &Tensor, part: usize, d: [usize; 4]) -> Result<(Tensor, usize)> {
    let [b, h, t, hd] = d;
    let c = h * hd;
    match *rows.shape() {
        [bt, width] if bt == b * t && width % c.max(1) == 0 && part < width / c.max(1) && rows.is_contiguous() => {
            Ok((rows.narrow(1, part * c, c)?, width))
        }
        _ => Err(Error::Shape {
            op,
            expected: format!("a contiguous ({}, P·{c}) tensor with block {part}", b * t),
            found: rows.shape().to_vec(),
        }),
    }
}

/// The kernel's (B, H, T, hd) scalars and a grid for `d`'s elements in chunks of `T`.
fn sizes<T: Elem>(op: &'static str, d: [usize; 4]) -> Result<([u32; 4], crate::device::LaunchDims)> {
    let n = d.iter().product::<usize>();
    count(op, n)?;
    let [b, h, t, hd] = d.map(|v| count(op, v));
    let units = if d[3].is_multiple_of(lanes::<T>()) { n / lanes::<T>() } else { n };
    Ok(([b?, h?, t?, hd?], stride_dims(units)))
}

/// Which way [`one_part`] copies.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    FromRows,
    ToRows,
}

fn one_part(way: Way, op: &'static str, heads: &Tensor, rows: &Tensor, part: usize, stream: &Stream) -> Result<()> {
    let dtype = float_dtype(op, heads, &[rows])?;
    let d = head_dims(op, heads)?;
    let (blk, ld) = block(op, rows, part, d)?;
    let kernels = match way {
        Way::FromRows => PerFloat { f32: &HEADS_FROM_ROWS, bf16: &HEADS_FROM_ROWS_BF16 },
        Way::ToRows => PerFloat { f32: &ROWS_FROM_HEADS, bf16: &ROWS_FROM_HEADS_BF16 },
    };
    with_float!(op, dtype, T => {
        let kernel = kernels.of::<T>(op)?;
        let ([b, h, t, hd], dims) = sizes::<T>(op, d)?;
        let (blk, heads) = (blk.view::<T>()?, super::dense::<T>(op, heads)?);
        let ld = count(op, ld)?;
        if way == Way::ToRows {
            stream.launch(kernel, dims, &args![Out(blk), In(heads), b, h, t, hd, ld])
        } else {
            stream.launch(kernel, dims, &args![Out(heads), In(blk), b, h, t, hd, ld])
        }
    })
}

/// Copies block `part` of `rows` (`(B·T, P·C)`, contiguous) into `heads` (`(B, H, T, hd)`,
/// contiguous, `C = H·hd`), both f32 or both bf16.
///
/// # Errors
/// [`Error::UnsupportedDType`] or [`Error::DTypeMismatch`] for other element types;
/// [`Error::Shape`] for other shapes or a block past the last; [`Error::NotContiguous`]; all
/// before anything is enqueued.
pub fn heads_from_rows(heads: &Tensor, rows: &Tensor, part: usize, stream: &Stream) -> Result<()> {
    one_part(Way::FromRows, "heads_from_rows", heads, rows, part, stream)
}

/// Copies `heads` (`(B, H, T, hd)`, contiguous) into block `part` of `rows` (`(B·T, P·C)`,
/// contiguous), both f32 or both bf16; the other blocks are untouched.
///
/// # Errors
/// As [`heads_from_rows`].
pub fn rows_from_heads(rows: &Tensor, part: usize, heads: &Tensor, stream: &Stream) -> Result<()> {
    one_part(Way::ToRows, "rows_from_heads", heads, rows, part, stream)
}

/// The `(B, H, T, hd)` shared by three heads tensors and their `(B·T, 3C)` row matrix, checked.
fn qkv_dims(op: &'static str, heads: [&Tensor; 3], rows: &Tensor) -> Result<[usize; 4]> {
    let d = head_dims(op, heads[0])?;
    for other in &heads[1..] {
        other.expect_shape(op, heads[0].shape())?;
        head_dims(op, other)?;
    }
    let [b, h, t, hd] = d;
    rows.expect_shape(op, &[b * t, 3 * h * hd])?;
    Ok(d)
}

/// Splits the QKV projection's output `qkv` (`(B·T, 3C)`: queries, keys, values as column blocks,
/// head `h` in columns `h·hd..(h+1)·hd` of each) into `q`, `k` and `v` (each `(B, H, T, hd)`,
/// `C = H·hd`) in one launch; all contiguous, all f32 or all bf16.
///
/// # Errors
/// [`Error::UnsupportedDType`] or [`Error::DTypeMismatch`] for other element types;
/// [`Error::Shape`] for other shapes; [`Error::NotContiguous`]; all before anything is enqueued.
pub fn split_qkv(q: &Tensor, k: &Tensor, v: &Tensor, qkv: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "split_qkv";
    let dtype = float_dtype(OP, qkv, &[q, k, v])?;
    let d = qkv_dims(OP, [q, k, v], qkv)?;
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &SPLIT_QKV, bf16: &SPLIT_QKV_BF16 }.of::<T>(OP)?;
        let ([b, h, t, hd], dims) = sizes::<T>(OP, d)?;
        count(OP, qkv.numel())?;
        let dense = |x| super::dense::<T>(OP, x);
        stream.launch(kernel, dims, &args![Out(dense(q)?), Out(dense(k)?), Out(dense(v)?), In(dense(qkv)?), b, h, t, hd])
    })
}

/// Merges the gradients `dq`, `dk`, `dv` (each `(B, H, T, hd)`) into `dqkv` (`(B·T, 3C)`, every
/// element written) in one launch: the inverse of [`split_qkv`], with its requirements.
///
/// # Errors
/// As [`split_qkv`].
pub fn merge_qkv(dqkv: &Tensor, dq: &Tensor, dk: &Tensor, dv: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "merge_qkv";
    let dtype = float_dtype(OP, dqkv, &[dq, dk, dv])?;
    let d = qkv_dims(OP, [dq, dk, dv], dqkv)?;
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &MERGE_QKV, bf16: &MERGE_QKV_BF16 }.of::<T>(OP)?;
        let ([b, h, t, hd], dims) = sizes::<T>(OP, d)?;
        count(OP, dqkv.numel())?;
        let dense = |x| super::dense::<T>(OP, x);
        stream.launch(kernel, dims, &args![Out(dense(dqkv)?), In(dense(dq)?), In(dense(dk)?), In(dense(dv)?), b, h, t, hd])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DType, Device};
    use crate::memory::CachingAllocator;

    #[test]
    fn heads_round_trip_through_a_column_block() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let (b, h, t, hd) = (2, 3, 4, 2);
        let c = h * hd;
        let data: Vec<f32> = (0..b * t * 3 * c).map(|i| i as f32).collect();
        let qkv = Tensor::from_host(&alloc, &s, &data, &[b * t, 3 * c]).unwrap();
        let k = Tensor::uninit(&alloc, &s, &[b, h, t, hd], DType::F32).unwrap();
        heads_from_rows(&k, &qkv, 1, &s).unwrap();
        let got = k.to_vec::<f32>(&s).unwrap();
        // k[b=1, h=2, t=3, d=1] is row 1·4 + 3 = 7, column C + 2·2 + 1 = 11.
        assert_eq!(got[((h + 2) * t + 3) * hd + 1], data[7 * 3 * c + 11]);
        let back = Tensor::zeros(&alloc, &s, &[b * t, 3 * c], DType::F32).unwrap();
        rows_from_heads(&back, 1, &k, &s).unwrap();
        let back = back.to_vec::<f32>(&s).unwrap();
        for (i, v) in back.iter().enumerate() {
            let in_block = (c..2 * c).contains(&(i % (3 * c)));
            assert_eq!(*v, if in_block { data[i] } else { 0.0 }, "element {i}");
        }
        assert!(heads_from_rows(&k, &qkv, 3, &s).is_err(), "there are only 3 blocks");
    }

    /// In both element types: the 3-way split equals three one-block copies, and the merge of
    /// what it split is the input, bit for bit (the values are distinct bf16 bit patterns).
    #[test]
    fn split_and_merge_equal_three_one_block_copies() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let (b, h, t, hd) = (2, 3, 5, 4);
        let n = b * t * 3 * h * hd;
        let bits: Vec<u16> = (0..n as u16).map(|i| 0x3f00 + i).collect();
        for dtype in [DType::F32, DType::BF16] {
            let wide: Vec<f32> = bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
            let wide = Tensor::from_host(&alloc, &s, &wide, &[b * t, 3 * h * hd]).unwrap();
            let qkv = Tensor::zeros(&alloc, &s, wide.shape(), dtype).unwrap();
            crate::ops::cast::cast(&qkv, &wide, &s).unwrap();
            let heads = || Tensor::zeros(&alloc, &s, &[b, h, t, hd], dtype).unwrap();
            let (q, k, v) = (heads(), heads(), heads());
            split_qkv(&q, &k, &v, &qkv, &s).unwrap();
            for (part, got) in [&q, &k, &v].into_iter().enumerate() {
                let want = heads();
                heads_from_rows(&want, &qkv, part, &s).unwrap();
                assert_eq!(got.to_f32_vec(&s).unwrap(), want.to_f32_vec(&s).unwrap(), "{dtype} part {part}");
            }
            let back = Tensor::zeros(&alloc, &s, qkv.shape(), dtype).unwrap();
            merge_qkv(&back, &q, &k, &v, &s).unwrap();
            assert_eq!(back.to_f32_vec(&s).unwrap(), qkv.to_f32_vec(&s).unwrap(), "{dtype} round trip");
        }
    }

    #[test]
    fn mixed_and_unsupported_element_types_are_refused() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let qkv = Tensor::zeros(&alloc, &s, &[2, 6], DType::BF16).unwrap();
        let f = || Tensor::zeros(&alloc, &s, &[1, 1, 2, 2], DType::F32).unwrap();
        let r = split_qkv(&f(), &f(), &f(), &qkv, &s);
        assert!(matches!(r, Err(Error::DTypeMismatch { op: "split_qkv", .. })), "{r:?}");
        let h16 = Tensor::zeros(&alloc, &s, &[2, 6], DType::F16).unwrap();
        let r = heads_from_rows(&f(), &h16, 0, &s);
        assert!(matches!(r, Err(Error::DTypeMismatch { op: "heads_from_rows", .. })), "{r:?}");
        let r = merge_qkv(&h16, &f(), &f(), &f(), &s);
        assert!(matches!(r, Err(Error::UnsupportedDType { op: "merge_qkv", dtype: DType::F16, .. })), "{r:?}");
    }
}
