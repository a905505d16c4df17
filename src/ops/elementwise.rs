//! Elementwise kernels on f32 and bf16: each op is one CUDA template in `elementwise.cu` with an
//! entry point per element type, and one generic CPU path over [`Float`] beside it. Both compute
//! in f32 and round once per stored value, so bf16 results are bitwise equal on both devices
//! (and to `bf16::from_f32` of the f32 computation). The memory-bound kernels move 16 bytes per
//! access (4 f32 or 8 bf16) with a scalar tail, in grids sized for the GPU's SMs.
//!
//! Launchers take typed views (`View<f32>` or `View<bf16>`; another element type is
//! [`Error::UnsupportedDType`]), outputs first, the stream last; [`accumulate`] takes tensors.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::ops::elementwise;
//! use half::bf16;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let (x, y) = (dev.alloc::<f32>(3)?, dev.alloc::<f32>(3)?);
//! elementwise::fill(x.view(), 2.0, &s)?;
//! elementwise::scale(y.view(), x.view(), 1.5, &s)?;
//! assert_eq!(y.to_vec(&s)?, vec![3.0; 3]);
//! let h = dev.alloc::<bf16>(2)?;
//! elementwise::fill(h.view(), 1.00390625, &s)?; // 1 + 2^-8: a tie, rounded to even
//! assert_eq!(h.to_vec(&s)?, vec![bf16::ONE; 2]);
//! # Ok::<(), graphed::Error>(())
//! ```

use half::bf16;

use super::{count, float_dtype, lanes, same_len, stride_dims, with_float, PerFloat};
use crate::device::{args, CpuArgs, Float, In, InOut, Kernel, Out, Stream, View};
use crate::tensor::Tensor;
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("elementwise.cu"));

/// `y = value` in f32.
pub static FILL: Kernel =
    Kernel { name: "fill_f32", source: SOURCE, params: &["y", "value", "n"], cpu: fill_cpu::<f32>, strided: false };

/// `y = bf16(value)`.
pub static FILL_BF16: Kernel =
    Kernel { name: "fill_bf16", source: SOURCE, params: &["y", "value", "n"], cpu: fill_cpu::<bf16>, strided: false };

fn fill_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let v = T::from_f32(a.f32("value")?);
    a.output::<T>("y")?.iter_mut().for_each(|y| *y = v);
    Ok(())
}

/// Sets every element of `y` to `value` (rounded to `T`).
///
/// # Errors
/// [`Error::UnsupportedDType`] unless `T` is f32 or bf16.
pub fn fill<T: Float>(y: View<'_, T>, value: f32, stream: &Stream) -> Result<()> {
    let kernel = PerFloat { f32: &FILL, bf16: &FILL_BF16 }.of::<T>("fill")?;
    let n = count("fill", y.len())?;
    stream.launch(kernel, stride_dims(y.len().div_ceil(lanes::<T>())), &args![Out(y), value, n])
}

/// `y += c` in f32.
pub static ADD_SCALAR: Kernel = Kernel {
    name: "add_scalar_f32",
    source: SOURCE,
    params: &["y", "c", "n"],
    cpu: add_scalar_cpu::<f32>,
    strided: false,
};

/// `y = bf16(y + c)`.
pub static ADD_SCALAR_BF16: Kernel = Kernel {
    name: "add_scalar_bf16",
    source: SOURCE,
    params: &["y", "c", "n"],
    cpu: add_scalar_cpu::<bf16>,
    strided: false,
};

fn add_scalar_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let c = a.f32("c")?;
    a.output::<T>("y")?.iter_mut().for_each(|y| *y = T::from_f32(y.to_f32() + c));
    Ok(())
}

/// Adds `c` to every element of `y`.
///
/// # Errors
/// [`Error::UnsupportedDType`] unless `T` is f32 or bf16.
pub fn add_scalar<T: Float>(y: View<'_, T>, c: f32, stream: &Stream) -> Result<()> {
    let kernel = PerFloat { f32: &ADD_SCALAR, bf16: &ADD_SCALAR_BF16 }.of::<T>("add_scalar")?;
    let n = count("add_scalar", y.len())?;
    stream.launch(kernel, stride_dims(y.len().div_ceil(lanes::<T>())), &args![InOut(y), c, n])
}

/// `y = k·x` in f32.
pub static SCALE: Kernel =
    Kernel { name: "scale_f32", source: SOURCE, params: &["y", "x", "k", "n"], cpu: scale_cpu::<f32>, strided: false };

/// `y = bf16(k·x)`.
pub static SCALE_BF16: Kernel = Kernel {
    name: "scale_bf16",
    source: SOURCE,
    params: &["y", "x", "k", "n"],
    cpu: scale_cpu::<bf16>,
    strided: false,
};

fn scale_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let (x, k) = (a.input::<T>("x")?, a.f32("k")?);
    a.output::<T>("y")?.iter_mut().zip(x.iter()).for_each(|(y, x)| *y = T::from_f32(k * x.to_f32()));
    Ok(())
}

/// `y = k·x`; `y` and `x` have the same length.
///
/// # Errors
/// [`Error::LengthMismatch`] for unequal lengths; [`Error::UnsupportedDType`] unless `T` is f32
/// or bf16.
pub fn scale<T: Float>(y: View<'_, T>, x: View<'_, T>, k: f32, stream: &Stream) -> Result<()> {
    let kernel = PerFloat { f32: &SCALE, bf16: &SCALE_BF16 }.of::<T>("scale")?;
    same_len("scale", &y, &x)?;
    let n = count("scale", y.len())?;
    stream.launch(kernel, stride_dims(y.len().div_ceil(lanes::<T>())), &args![Out(y), In(x), k, n])
}

/// `y = a·x + y` in f32, one fused multiply-add (as `__fmaf_rn` on CUDA).
pub static AXPY: Kernel =
    Kernel { name: "axpy_f32", source: SOURCE, params: &["y", "x", "a", "n"], cpu: axpy_cpu::<f32>, strided: false };

/// `y = bf16(a·x + y)`, the multiply-add fused in f32.
pub static AXPY_BF16: Kernel =
    Kernel { name: "axpy_bf16", source: SOURCE, params: &["y", "x", "a", "n"], cpu: axpy_cpu::<bf16>, strided: false };

fn axpy_cpu<T: Float>(args: &CpuArgs) -> Result<()> {
    let (x, a) = (args.input::<T>("x")?, args.f32("a")?);
    let mut y = args.output::<T>("y")?;
    y.iter_mut().zip(x.iter()).for_each(|(y, x)| *y = T::from_f32(a.mul_add(x.to_f32(), y.to_f32())));
    Ok(())
}

/// `y += a·x`; `y` and `x` have the same length.
///
/// # Errors
/// As [`scale`].
pub fn axpy<T: Float>(y: View<'_, T>, x: View<'_, T>, a: f32, stream: &Stream) -> Result<()> {
    let kernel = PerFloat { f32: &AXPY, bf16: &AXPY_BF16 }.of::<T>("axpy")?;
    same_len("axpy", &y, &x)?;
    let n = count("axpy", y.len())?;
    stream.launch(kernel, stride_dims(y.len().div_ceil(lanes::<T>())), &args![InOut(y), In(x), a, n])
}

/// `dst += src` in f32.
pub static ACCUMULATE: Kernel = Kernel {
    name: "accumulate_f32",
    source: SOURCE,
    params: &["dst", "src", "n"],
    cpu: accumulate_cpu::<f32>,
    strided: false,
};

/// `dst = bf16(dst + src)`.
pub static ACCUMULATE_BF16: Kernel = Kernel {
    name: "accumulate_bf16",
    source: SOURCE,
    params: &["dst", "src", "n"],
    cpu: accumulate_cpu::<bf16>,
    strided: false,
};

fn accumulate_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    let src = a.input::<T>("src")?;
    let mut dst = a.output::<T>("dst")?;
    dst.iter_mut().zip(src.iter()).for_each(|(d, s)| *d = T::from_f32(d.to_f32() + s.to_f32()));
    Ok(())
}

/// `dst += src` (a parameter gradient computed into a scratch, such as a bias gradient from a
/// GEMM epilogue, added to its accumulator): equal element counts, the same element type (f32
/// or bf16), both contiguous; the sum is computed in f32 and rounded once.
///
/// # Errors
/// [`Error::UnsupportedDType`] or [`Error::DTypeMismatch`] for other element types,
/// [`Error::LengthMismatch`] for unequal counts, [`Error::NotContiguous`]; all before anything is
/// enqueued.
pub fn accumulate(dst: &Tensor, src: &Tensor, stream: &Stream) -> Result<()> {
    const OP: &str = "accumulate";
    let dtype = float_dtype(OP, dst, &[src])?;
    if dst.numel() != src.numel() {
        return Err(Error::LengthMismatch { op: OP, src: src.numel(), dst: dst.numel() });
    }
    let n = count(OP, dst.numel())?;
    with_float!(OP, dtype, T => {
        let kernel = PerFloat { f32: &ACCUMULATE, bf16: &ACCUMULATE_BF16 }.of::<T>(OP)?;
        let (d, s) = (super::dense::<T>(OP, dst)?, super::dense::<T>(OP, src)?);
        stream.launch(kernel, stride_dims(d.len().div_ceil(lanes::<T>())), &args![InOut(d), In(s), n])
    })
}

/// `flag = 1` if an f32 of `x` has a bit set.
pub static ANY_NONZERO: Kernel = Kernel {
    name: "any_nonzero_f32",
    source: SOURCE,
    params: &["flag", "x", "n"],
    cpu: any_nonzero_cpu::<f32>,
    strided: false,
};

/// `flag = 1` if a bf16 of `x` has a bit set.
pub static ANY_NONZERO_BF16: Kernel = Kernel {
    name: "any_nonzero_bf16",
    source: SOURCE,
    params: &["flag", "x", "n"],
    cpu: any_nonzero_cpu::<bf16>,
    strided: false,
};

fn any_nonzero_cpu<T: Float>(a: &CpuArgs) -> Result<()> {
    if a.input::<T>("x")?.iter().any(|v| bytemuck::bytes_of(v).iter().any(|b| *b != 0)) {
        a.output::<u32>("flag")?[0] = 1;
    }
    Ok(())
}

/// Sets `flag` (one `u32`) to 1 if any element of `x` has a bit set, `-0.0` and NaN included;
/// leaves it as it is otherwise (zero it first). A whole buffer is tested on the device, with
/// four bytes to read back.
///
/// ```
/// use graphed::device::Device;
/// use graphed::ops::elementwise;
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let (x, flag) = (dev.alloc_from(&s, &[0.0f32, -0.0, 0.0])?, dev.alloc_from(&s, &[0u32])?);
/// elementwise::any_nonzero(flag.view(), x.slice(0..1), &s)?;
/// assert_eq!(flag.to_vec(&s)?, vec![0]);
/// elementwise::any_nonzero(flag.view(), x.view(), &s)?; // -0.0 has its sign bit set
/// assert_eq!(flag.to_vec(&s)?, vec![1]);
/// # Ok::<(), graphed::Error>(())
/// ```
///
/// # Errors
/// [`Error::UnsupportedDType`] unless `T` is f32 or bf16; [`Error::LengthMismatch`] unless
/// `flag` has one element.
pub fn any_nonzero<T: Float>(flag: View<'_, u32>, x: View<'_, T>, stream: &Stream) -> Result<()> {
    const OP: &str = "any_nonzero";
    let kernel = PerFloat { f32: &ANY_NONZERO, bf16: &ANY_NONZERO_BF16 }.of::<T>(OP)?;
    if flag.len() != 1 {
        return Err(Error::LengthMismatch { op: OP, src: 1, dst: flag.len() });
    }
    let n = count(OP, x.len())?;
    stream.launch(kernel, stride_dims(x.len()), &args![InOut(flag), In(x), n])
}

/// `y[r, c] = k·x[r, c]` over two strided matrix views, in f32.
pub static SCALE_ROWS: Kernel = Kernel {
    name: "scale_rows_f32",
    source: SOURCE,
    params: &["y", "x", "k", "rows", "cols", "ld_y", "ld_x"],
    cpu: scale_cpu::<f32>,
    strided: true,
};

/// `y[r, c] = bf16(k·x[r, c])` over two strided matrix views.
pub static SCALE_ROWS_BF16: Kernel = Kernel {
    name: "scale_rows_bf16",
    source: SOURCE,
    params: &["y", "x", "k", "rows", "cols", "ld_y", "ld_x"],
    cpu: scale_cpu::<bf16>,
    strided: true,
};

/// `y = k·x` for two `rows × cols` matrix views with leading dimensions (a column block of
/// wider matrices, such as one attention head). Only the view's elements are touched.
///
/// # Errors
/// [`Error::Unsupported`] for views that are not such matrices; [`Error::LengthMismatch`] for
/// unequal sizes; [`Error::UnsupportedDType`] unless `T` is f32 or bf16.
pub fn scale_rows<T: Float>(y: View<'_, T>, x: View<'_, T>, k: f32, stream: &Stream) -> Result<()> {
    const OP: &str = "scale_rows";
    let kernel = PerFloat { f32: &SCALE_ROWS, bf16: &SCALE_ROWS_BF16 }.of::<T>(OP)?;
    let (ry, rx) = (y.region(), x.region());
    let (Some((rows, cols, ld_y)), Some((rows_x, cols_x, ld_x))) = (matrix_of(&ry), matrix_of(&rx)) else {
        return Err(Error::Unsupported {
            op: OP,
            backend: "any",
            why: "views must be 2-D (rows, cols) with unit column stride",
        });
    };
    if (rows, cols) != (rows_x, cols_x) {
        return Err(Error::LengthMismatch { op: OP, src: rows_x * cols_x, dst: rows * cols });
    }
    let dims = stride_dims(rows * cols);
    let [rows, cols, ld_y, ld_x] = [rows, cols, ld_y, ld_x].map(|n| count(OP, n));
    stream.launch(kernel, dims, &args![Out(y), In(x), k, rows?, cols?, ld_y?, ld_x?])
}

fn matrix_of(r: &crate::device::Region) -> Option<(usize, usize, usize)> {
    match r.dims() {
        [row, col] if col.stride == 1 => Some((row.count, col.count, row.stride)),
        [col] if col.stride == 1 => Some((1, col.count, col.count)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DType, Device};
    use crate::memory::CachingAllocator;

    /// Values around bf16's rounding points: ties of both parities, near-ties, subnormals, large.
    fn probes(n: usize) -> Vec<f32> {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let v = f32::from_bits(0x3f80_0000 | (x as u32 & 0x007f_ffff)) * if i % 2 == 0 { 1.0 } else { -3.0 };
                match i % 7 {
                    0 => f32::from_bits(0x3f80_8000 + ((i as u32 % 4) << 16)), // exact ties
                    1 => v * 1e-39,                                            // subnormal
                    2 => v * 1e30,
                    _ => v,
                }
            })
            .collect()
    }

    #[derive(Debug, Clone, Copy)]
    enum Op {
        Scale,
        Axpy,
        AddScalar,
        Accumulate,
    }

    impl Op {
        /// The f32 computation of `y`'s new value.
        fn host(self, x: f32, y: f32) -> f32 {
            match self {
                Op::Scale => 0.3 * x,
                Op::Axpy => 0.7f32.mul_add(x, y),
                Op::AddScalar => y + 0.1,
                Op::Accumulate => y + x,
            }
        }

        /// `y`'s new value from the simulator, for `x` and `y` stored as `T`, as f32 bits.
        fn run<T: Float>(self, x: &[f32], y: &[f32]) -> Vec<u32> {
            let dev = Device::sim();
            let s = dev.stream().unwrap();
            let alloc = CachingAllocator::new(&dev);
            let put = |v: &[f32]| {
                let v: Vec<T> = v.iter().map(|&v| T::from_f32(v)).collect();
                Tensor::from_host(&alloc, &s, &v, &[v.len()]).unwrap()
            };
            let (xt, yt) = (put(x), put(y));
            let (xv, yv) = (xt.view::<T>().unwrap(), yt.view::<T>().unwrap());
            match self {
                Op::Scale => scale(yv, xv, 0.3, &s),
                Op::Axpy => axpy(yv, xv, 0.7, &s),
                Op::AddScalar => add_scalar(yv, 0.1, &s),
                Op::Accumulate => accumulate(&yt, &xt, &s),
            }
            .unwrap();
            yt.to_f32_vec(&s).unwrap().iter().map(|v| v.to_bits()).collect()
        }
    }

    /// The CPU paths of the elementwise ops in bf16 equal `bf16::from_f32` of the f32
    /// computation on the stored operands, and in f32 the f32 computation.
    #[test]
    fn cpu_paths_round_the_f32_result_once() {
        let (x, y) = (probes(37), probes(41)[4..].to_vec());
        let widen = |v: &[f32]| v.iter().map(|&v| bf16::from_f32(v).to_f32()).collect::<Vec<_>>();
        let (xw, yw) = (widen(&x), widen(&y));
        for op in [Op::Scale, Op::Axpy, Op::AddScalar, Op::Accumulate] {
            let want: Vec<u32> =
                xw.iter().zip(&yw).map(|(&x, &y)| bf16::from_f32(op.host(x, y)).to_f32().to_bits()).collect();
            assert_eq!(op.run::<bf16>(&x, &y), want, "{op:?} in bf16");
            let want: Vec<u32> = x.iter().zip(&y).map(|(&x, &y)| op.host(x, y).to_bits()).collect();
            assert_eq!(op.run::<f32>(&x, &y), want, "{op:?} in f32");
        }
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let h = dev.alloc::<bf16>(5).unwrap();
        fill(h.view(), 1.0 + 3.0 / 256.0, &s).unwrap();
        assert_eq!(h.to_vec(&s).unwrap(), vec![bf16::from_f32(1.0 + 4.0 / 256.0); 5], "a tie to even, up");
    }

    #[test]
    fn other_element_types_are_refused_before_anything_runs() {
        let dev = Device::sim();
        let s = dev.stream().unwrap();
        let alloc = CachingAllocator::new(&dev);
        let h16 = dev.alloc::<half::f16>(4).unwrap();
        let r = fill(h16.view(), 1.0, &s);
        assert!(matches!(r, Err(Error::UnsupportedDType { op: "fill", dtype: DType::F16, .. })), "{r:?}");
        let (f, b) = (
            Tensor::from_host(&alloc, &s, &[1.0f32; 4], &[4]).unwrap(),
            Tensor::zeros(&alloc, &s, &[4], DType::BF16).unwrap(),
        );
        let r = accumulate(&f, &b, &s);
        assert!(matches!(r, Err(Error::DTypeMismatch { op: "accumulate", .. })), "{r:?}");
        let u = Tensor::zeros(&alloc, &s, &[4], DType::U32).unwrap();
        let r = accumulate(&u, &u, &s);
        assert!(matches!(r, Err(Error::UnsupportedDType { op: "accumulate", dtype: DType::U32, .. })), "{r:?}");
        let r = accumulate(&f, &Tensor::zeros(&alloc, &s, &[5], DType::F32).unwrap(), &s);
        assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
        assert_eq!(f.to_vec::<f32>(&s).unwrap(), vec![1.0; 4], "nothing ran");
    }
}
