//! Attention heads between the `(B·T, P·C)` activations of the projections (head `h` of block
//! `p` is a column block) and the contiguous `(B, H, T, hd)` layout in which one strided-batched
//! GEMM covers every (batch element, head) pair. Pure permutations, bitwise equal on both devices.
//!
//! The row side is passed as a strided view of its column block, so the declared accesses are
//! exactly the block; on CUDA the kernels index it with its leading dimension.

use super::count;
use crate::device::{args, CpuArgs, In, Kernel, LaunchDims, Out, Stream};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = include_str!("heads.cu");

/// `dst[b, h, t, d] = block[b·T + t, h·hd + d]`.
pub static HEADS_FROM_ROWS: Kernel = Kernel {
    name: "heads_from_rows_f32",
    source: SOURCE,
    params: &["dst", "src", "B", "H", "T", "hd", "ld"],
    cpu: from_rows_cpu,
    strided: true,
};

/// `block[b·T + t, h·hd + d] = src[b, h, t, d]`.
pub static ROWS_FROM_HEADS: Kernel = Kernel {
    name: "rows_from_heads_f32",
    source: SOURCE,
    params: &["dst", "src", "B", "H", "T", "hd", "ld"],
    cpu: to_rows_cpu,
    strided: true,
};

/// The (B, H, T, hd) scalars.
fn dims(a: &CpuArgs) -> Result<[usize; 4]> {
    let [b, h, t, hd] = ["B", "H", "T", "hd"].map(|p| a.u32(p).map(|v| v as usize));
    Ok([b?, h?, t?, hd?])
}

/// The index in a dense `(B·T, H·hd)` block of element `i` of a `(B, H, T, hd)` tensor.
fn row_index(i: usize, [_, h, t, hd]: [usize; 4]) -> usize {
    let (d, tt, hh, b) = (i % hd, (i / hd) % t, (i / (hd * t)) % h, i / (hd * t * h));
    (b * t + tt) * (h * hd) + hh * hd + d
}

fn from_rows_cpu(a: &CpuArgs) -> Result<()> {
    let dims = dims(a)?;
    let src = a.input::<f32>("src")?;
    a.output::<f32>("dst")?.iter_mut().enumerate().for_each(|(i, v)| *v = src[row_index(i, dims)]);
    Ok(())
}

fn to_rows_cpu(a: &CpuArgs) -> Result<()> {
    let dims = dims(a)?;
    let src = a.input::<f32>("src")?;
    let mut dst = a.output::<f32>("dst")?;
    src.iter().enumerate().for_each(|(i, v)| dst[row_index(i, dims)] = *v);
    Ok(())
}

/// The column block `part` of a `(B·T, P·C)` tensor that holds the heads of a `(B, H, T, hd)`
/// one, and its leading dimension.
fn block(op: &'static str, rows: &Tensor, part: usize, heads: &Tensor) -> Result<(Tensor, usize, [usize; 4])> {
    let [b, h, t, hd] = *heads.shape() else {
        return Err(Error::Shape { op, expected: "(B, H, T, hd) heads".into(), found: heads.shape().to_vec() });
    };
    let c = h * hd;
    match *rows.shape() {
        [bt, width] if bt == b * t && width % c.max(1) == 0 && part < width / c.max(1) && rows.is_contiguous() => {
            Ok((rows.narrow(1, part * c, c)?, width, [b, h, t, hd]))
        }
        _ => Err(Error::Shape {
            op,
            expected: format!("a contiguous ({}, P·{c}) tensor with block {part}", b * t),
            found: rows.shape().to_vec(),
        }),
    }
}

fn launch(
    kernel: &'static Kernel,
    op: &'static str,
    dst_src: (&Tensor, &Tensor),
    ld: usize,
    d: [usize; 4],
    stream: &Stream,
) -> Result<()> {
    let n = d.iter().product::<usize>();
    let [b, h, t, hd] = d.map(|v| count(op, v));
    let (dst, src) = dst_src;
    stream.launch(
        kernel,
        LaunchDims::for_elems(n),
        &args![Out(dst.view::<f32>()?), In(src.view::<f32>()?), b?, h?, t?, hd?, count(op, ld)?],
    )
}

/// Copies block `part` of `rows` (`(B·T, P·C)`) into `heads` (`(B, H, T, hd)`, contiguous).
pub fn heads_from_rows(heads: &Tensor, rows: &Tensor, part: usize, stream: &Stream) -> Result<()> {
    const OP: &str = "heads_from_rows";
    let (blk, ld, d) = block(OP, rows, part, heads)?;
    super::dense::<f32>(OP, heads)?;
    launch(&HEADS_FROM_ROWS, OP, (heads, &blk), ld, d, stream)
}

/// Copies `heads` (`(B, H, T, hd)`, contiguous) into block `part` of `rows` (`(B·T, P·C)`).
pub fn rows_from_heads(rows: &Tensor, part: usize, heads: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "rows_from_heads";
    let (blk, ld, d) = block(OP, rows, part, heads)?;
    super::dense::<f32>(OP, heads)?;
    launch(&ROWS_FROM_HEADS, OP, (&blk, heads), ld, d, stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
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
        let k = Tensor::uninit(&alloc, &s, &[b, h, t, hd], crate::device::DType::F32).unwrap();
        heads_from_rows(&k, &qkv, 1, &s).unwrap();
        let got = k.to_vec::<f32>(&s).unwrap();
        // k[b=1, h=2, t=3, d=1] is row 1·4 + 3 = 7, column C + 2·2 + 1 = 11.
        assert_eq!(got[((h + 2) * t + 3) * hd + 1], data[7 * 3 * c + 11]);
        let back = Tensor::zeros(&alloc, &s, &[b * t, 3 * c], crate::device::DType::F32).unwrap();
        rows_from_heads(&back, 1, &k, &s).unwrap();
        let back = back.to_vec::<f32>(&s).unwrap();
        for (i, v) in back.iter().enumerate() {
            let in_block = (c..2 * c).contains(&(i % (3 * c)));
            assert_eq!(*v, if in_block { data[i] } else { 0.0 }, "element {i}");
        }
        assert!(heads_from_rows(&k, &qkv, 3, &s).is_err(), "there are only 3 blocks");
    }
}
