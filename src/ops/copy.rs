//! A device-to-device copy as a kernel, for any element type: what a graph captures where a copy
//! is pointed at other memory between replays, because the driver updates a kernel node's
//! parameters for less than half a memcpy node's; and one that reads its addresses from a table
//! in device memory (`bytes_via`), which an offloaded tensor kept resident points with no node
//! update at all.
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
use crate::device::kernel::Indirect;
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

/// `y = x` as a table entry says: `entry = [address of y, address of x, bytes]`, or no copy
/// where the bytes are 0.
pub(crate) static COPY_BYTES_VIA: Kernel = Kernel {
    name: "copy_bytes_via",
    source: SOURCE,
    params: &["y", "x", "entry"],
    cpu: copy_bytes_via_cpu,
    strided: false,
};

fn copy_bytes_via_cpu(a: &CpuArgs) -> Result<()> {
    let (dst, src, n) = {
        let e = a.input::<u64>("entry")?;
        (e[0], e[1], e[2])
    };
    if n == 0 {
        return Ok(());
    }
    let mut y = a.output_bytes("y")?;
    let bound = (a.address("y")?, a.address("x")?, y.len() as u64);
    if (dst, src, n) != bound {
        let message = format!(
            "its table entry (to {dst:#x}, from {src:#x}, {n} bytes) is not what the node is bound to \
             (to {:#x}, from {:#x}, {} bytes): the table was not written, or not before this launch",
            bound.0, bound.1, bound.2
        );
        return Err(Error::KernelFailed { kernel: "copy_bytes_via", message });
    }
    y.copy_from_slice(&a.input_bytes("x")?);
    Ok(())
}

/// The checks of both copies: one element type and length, contiguous; the copy's bytes.
fn checked<T: Elem>(op: &'static str, y: &View<'_, T>, x: &View<'_, T>) -> Result<u64> {
    same_len(op, y, x)?;
    for v in [y, x] {
        v.region.expect_contiguous(op, v.block.id)?;
    }
    Ok((x.len() * T::DTYPE.size()) as u64)
}

/// Copies `x` into `y`, bit for bit, in one kernel: two contiguous views of one element type and
/// length.
///
/// # Errors
/// [`Error::LengthMismatch`] for unequal lengths, [`Error::NotContiguous`] for a strided view.
pub fn bytes<T: Elem>(y: View<'_, T>, x: View<'_, T>, stream: &Stream) -> Result<()> {
    let n = checked("copy::bytes", &y, &x)?;
    stream.launch(&COPY_BYTES, stride_dims(n.div_ceil(16) as usize), &args![Out(y), In(x), n])
}

/// A copy of `x` into `y` whose addresses and length the kernel reads from `entry` (three
/// words: `y`'s address, `x`'s, the bytes; 0 bytes: no copy). `y` and `x` declare what the node
/// writes and reads, for the checker, the simulator and rebinds; a rebind of them changes no
/// graph node on CUDA ([`Indirect`]), so the caller writes the entry to match, ordered on a
/// stream before the launches that read it. The simulator refuses to run a copy whose entry
/// names other addresses than its bindings'.
///
/// # Errors
/// Those of [`bytes`], and [`Error::LengthMismatch`] for an entry of other than three words.
pub(crate) fn bytes_via<T: Elem>(y: View<'_, T>, x: View<'_, T>, entry: View<'_, u64>, stream: &Stream) -> Result<()> {
    const OP: &str = "copy::bytes_via";
    let n = checked(OP, &y, &x)?;
    if entry.len() != 3 {
        return Err(Error::LengthMismatch { op: OP, src: entry.len(), dst: 3 });
    }
    let list = args![Indirect(Out(y)), Indirect(In(x)), In(entry)];
    stream.launch(&COPY_BYTES_VIA, stride_dims(n.div_ceil(16) as usize), &list)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CaptureMode, Device, DeviceKind, Rebind};

    /// A captured copy that reads its addresses from a table: it copies nothing while its entry
    /// says 0 bytes, the entry's bytes once written, and after a rebind of its source (which
    /// changes no node on CUDA) with the entry rewritten, the new source. The simulator refuses
    /// to run it on an entry that names other addresses than its bindings.
    fn copies_what_its_table_entry_says(dev: &Device) -> Result<()> {
        let s = dev.stream()?;
        let x: Vec<u8> = (1..=40).collect();
        let (xb, other, y) =
            (dev.alloc_from(&s, &x)?, dev.alloc_from(&s, &[7u8; 40])?, dev.alloc_from(&s, &[0u8; 40])?);
        let entry = dev.alloc_from(&s, &[0u64; 3])?;
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        bytes_via(y.view(), xb.view(), entry.view(), &s)?;
        let exec = cap.finish()?.instantiate()?;
        exec.launch(&s)?;
        assert_eq!(y.to_vec(&s)?, vec![0u8; 40], "an entry of 0 bytes copies nothing");
        let point = |src: &crate::device::DeviceBuffer<u8>| {
            entry.write_from(&s, &[y.view().device_address()?, src.view().device_address()?, 40])
        };
        point(&xb)?;
        exec.launch(&s)?;
        assert_eq!(y.to_vec(&s)?, x);
        assert_eq!(exec.rebind(&[Rebind::new(xb.view(), other.view())?])?, 1);
        point(&other)?;
        exec.launch(&s)?;
        assert_eq!(y.to_vec(&s)?, vec![7u8; 40]);
        if dev.kind() == DeviceKind::Sim {
            // Rebound back, the entry still naming `other`.
            exec.rebind(&[Rebind::new(xb.view(), xb.view())?])?;
            exec.launch(&s)?;
            let err = y.to_vec(&s).unwrap_err();
            assert!(matches!(&err, Error::KernelFailed { kernel: "copy_bytes_via", .. }), "{err}");
        }
        Ok(())
    }

    #[test]
    fn table_copies_on_the_simulator() -> Result<()> {
        copies_what_its_table_entry_says(&Device::sim())
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn table_copies_on_cuda() -> Result<()> {
        copies_what_its_table_entry_says(&Device::cuda(0)?)
    }
}
