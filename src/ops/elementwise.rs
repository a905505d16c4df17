//! Elementwise f32 kernels: the CPU path of each beside its CUDA entry point in
//! `elementwise.cu`. Launchers take outputs, inputs, sizes, and the stream last.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::ops::elementwise;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let (x, y) = (dev.alloc::<f32>(3)?, dev.alloc::<f32>(3)?);
//! elementwise::fill(x.view(), 2.0, &s)?;
//! elementwise::scale(y.view(), x.view(), 1.5, &s)?;
//! assert_eq!(y.to_vec(&s)?, vec![3.0; 3]);
//! # Ok::<(), graphed::Error>(())
//! ```

use super::count;
use crate::device::{args, CpuArgs, In, InOut, Kernel, LaunchDims, Out, Stream, View};
use crate::{Error, Result};

const SOURCE: &str = include_str!("elementwise.cu");

/// `y = value`.
pub static FILL: Kernel =
    Kernel { name: "fill_f32", source: SOURCE, params: &["y", "value", "n"], cpu: fill_cpu, strided: false };

fn fill_cpu(a: &CpuArgs) -> Result<()> {
    let v = a.f32("value")?;
    a.output::<f32>("y")?.iter_mut().for_each(|y| *y = v);
    Ok(())
}

/// Sets every element of `y` to `value`.
pub fn fill(y: View<'_, f32>, value: f32, stream: &Stream) -> Result<()> {
    let n = count("elementwise", y.len())?;
    stream.launch(&FILL, LaunchDims::for_elems(y.len()), &args![Out(y), value, n])
}

/// `y += c`.
pub static ADD_SCALAR: Kernel =
    Kernel { name: "add_scalar_f32", source: SOURCE, params: &["y", "c", "n"], cpu: add_scalar_cpu, strided: false };

fn add_scalar_cpu(a: &CpuArgs) -> Result<()> {
    let c = a.f32("c")?;
    a.output::<f32>("y")?.iter_mut().for_each(|y| *y += c);
    Ok(())
}

/// Adds `c` to every element of `y`.
pub fn add_scalar(y: View<'_, f32>, c: f32, stream: &Stream) -> Result<()> {
    let n = count("elementwise", y.len())?;
    stream.launch(&ADD_SCALAR, LaunchDims::for_elems(y.len()), &args![InOut(y), c, n])
}

/// `y = k·x`.
pub static SCALE: Kernel =
    Kernel { name: "scale_f32", source: SOURCE, params: &["y", "x", "k", "n"], cpu: scale_cpu, strided: false };

fn scale_cpu(a: &CpuArgs) -> Result<()> {
    let (x, k) = (a.input::<f32>("x")?, a.f32("k")?);
    a.output::<f32>("y")?.iter_mut().zip(x.iter()).for_each(|(y, x)| *y = k * x);
    Ok(())
}

/// `y = k·x`; `y` and `x` have the same length.
pub fn scale(y: View<'_, f32>, x: View<'_, f32>, k: f32, stream: &Stream) -> Result<()> {
    same_len("scale", &y, &x)?;
    let n = count("elementwise", y.len())?;
    stream.launch(&SCALE, LaunchDims::for_elems(y.len()), &args![Out(y), In(x), k, n])
}

/// `y = a·x + y`, fused multiply-add (as `__fmaf_rn` on CUDA).
pub static AXPY: Kernel =
    Kernel { name: "axpy_f32", source: SOURCE, params: &["y", "x", "a", "n"], cpu: axpy_cpu, strided: false };

fn axpy_cpu(args: &CpuArgs) -> Result<()> {
    let (x, a) = (args.input::<f32>("x")?, args.f32("a")?);
    args.output::<f32>("y")?.iter_mut().zip(x.iter()).for_each(|(y, x)| *y = a.mul_add(*x, *y));
    Ok(())
}

/// `y += a·x`; `y` and `x` have the same length.
pub fn axpy(y: View<'_, f32>, x: View<'_, f32>, a: f32, stream: &Stream) -> Result<()> {
    same_len("axpy", &y, &x)?;
    let n = count("elementwise", y.len())?;
    stream.launch(&AXPY, LaunchDims::for_elems(y.len()), &args![InOut(y), In(x), a, n])
}

/// `y[r, c] = k·x[r, c]` over two strided matrix views.
pub static SCALE_ROWS: Kernel = Kernel {
    name: "scale_rows_f32",
    source: SOURCE,
    params: &["y", "x", "k", "rows", "cols", "ld_y", "ld_x"],
    cpu: scale_cpu,
    strided: true,
};

/// `y = k·x` for two `rows × cols` matrix views with leading dimensions (a column block of
/// wider matrices, such as one attention head). Only the view's elements are touched.
pub fn scale_rows(y: View<'_, f32>, x: View<'_, f32>, k: f32, stream: &Stream) -> Result<()> {
    let (ry, rx) = (y.region(), x.region());
    let (Some((rows, cols, ld_y)), Some((rows_x, cols_x, ld_x))) = (matrix_of(&ry), matrix_of(&rx)) else {
        return Err(Error::Unsupported {
            op: "scale_rows",
            backend: "any",
            why: "views must be 2-D (rows, cols) with unit column stride",
        });
    };
    if (rows, cols) != (rows_x, cols_x) {
        return Err(Error::LengthMismatch { op: "scale_rows", src: rows_x * cols_x, dst: rows * cols });
    }
    let dims = LaunchDims::for_elems(rows * cols);
    let [rows, cols, ld_y, ld_x] = [rows, cols, ld_y, ld_x].map(|n| count("scale_rows", n));
    stream.launch(&SCALE_ROWS, dims, &args![Out(y), In(x), k, rows?, cols?, ld_y?, ld_x?])
}

fn matrix_of(r: &crate::device::Region) -> Option<(usize, usize, usize)> {
    match r.dims() {
        [row, col] if col.stride == 1 => Some((row.count, col.count, row.stride)),
        [col] if col.stride == 1 => Some((1, col.count, col.count)),
        _ => None,
    }
}

fn same_len(op: &'static str, y: &View<'_, f32>, x: &View<'_, f32>) -> Result<()> {
    if y.len() != x.len() {
        return Err(Error::LengthMismatch { op, src: x.len(), dst: y.len() });
    }
    Ok(())
}
