//! A device-to-device copy as a kernel, for any element type: what a graph captures where a copy
//! is pointed at other memory between replays (an offloaded tensor kept resident), because the
//! driver updates a kernel node's parameters for less than half a memcpy node's.
//!
//! ```
//! use graphed::device::Device;
//! use graphed::ops::copy;
//! use half::bf16;
//! let dev = Device::sim();
//! let s = dev.stream()?;
//! let x = dev.alloc_from(&s, &[bf16::ONE, bf16::MAX, bf16::NAN])?;
//! let y = dev.alloc::<bf16>(3)?;
//! copy::bytes(y.view(), x.view(), &s)?;
//! assert_eq!(y.to_vec(&s)?.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
//!            x.to_vec(&s)?.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
//! # Ok::<(), graphed::Error>(())
//! ```

use super::{same_len, stride_dims};
use crate::device::{args, CpuArgs, Elem, In, Kernel, Out, Stream, View};
use crate::{Error, Result};

const SOURCE: &str = concat!(include_str!("float.cu"), include_str!("copy.cu"));

/// `y = x`, byte for byte.
pub static COPY_BYTES: Kernel =
    Kernel { name: "copy_bytes", source: SOURCE, params: &["y", "x", "n"], cpu: copy_bytes_cpu, strided: false };

fn copy_bytes_cpu(a: &CpuArgs) -> Result<()> {
    a.output_bytes("y")?.copy_from_slice(&a.input_bytes("x")?);
    Ok(())
}

/// Copies `x` into `y`, bit for bit, in one kernel: two contiguous views of one element type and
/// length.
///
/// # Errors
/// [`Error::LengthMismatch`] for unequal lengths, [`Error::NotContiguous`] for a strided view.
pub fn bytes<T: Elem>(y: View<'_, T>, x: View<'_, T>, stream: &Stream) -> Result<()> {
    const OP: &str = "copy::bytes";
    same_len(OP, &y, &x)?;
    for v in [&y, &x] {
        if !v.region.is_contiguous() {
            return Err(Error::NotContiguous { op: OP, buffer: v.block.id });
        }
    }
    let n = (x.len() * T::DTYPE.size()) as u64;
    stream.launch(&COPY_BYTES, stride_dims(n.div_ceil(16) as usize), &args![Out(y), In(x), n])
}
