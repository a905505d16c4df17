//! The copies the automatic policy plans with, captured in graphs on the copy streams as the
//! offload graphs' tails run them: their rate each way; the work the window probe starts beside
//! each forward and backward, to time what copy traffic costs the kernels it overlaps; and the
//! small copy it captures in a tail of each pass's graph, to time what a graph pays for
//! carrying copies at all.

use super::host::HostBuffer;
use super::shared::Inner;
use crate::device::{CaptureMode, DType, Stream};
use crate::graph::{Pass, ProbeCopies};
use crate::memory::PoolExec;
use crate::tensor::Tensor;
use crate::Result;

/// One unit's candidate copies, out and back, each way a graph in a pool of its own, and the
/// stream they run on beside the probe's passes; the small copy for the passes' tails, and the
/// copy streams it runs on.
pub(super) struct CopyGraphs {
    bytes: usize,
    out: PoolExec,
    back: PoolExec,
    beside: Stream,
    _buffers: Vec<(HostBuffer, Tensor)>,
    tail: (HostBuffer, Tensor),
    d2h: Stream,
    h2d: Stream,
}

/// Elements (bf16) of the copy in each probed pass's tail: small, so that the probe times what
/// carrying a copy costs the graph rather than the copy's traffic (timed beside the passes).
const TAIL_ELEMENTS: usize = 32 << 10;

impl CopyGraphs {
    /// Copies of `sizes` bytes each, captured from `stream` on `inner`'s copy streams.
    ///
    /// # Errors
    /// Allocation, host-buffer and capture errors.
    pub(super) fn new(inner: &Inner, stream: &Stream, sizes: &[usize]) -> Result<CopyGraphs> {
        let (dev, alloc) = (stream.device(), &inner.alloc);
        let mut buffers = Vec::with_capacity(sizes.len());
        for &bytes in sizes {
            let n = bytes / DType::BF16.size();
            buffers.push((HostBuffer::new(dev, DType::BF16, n)?, Tensor::zeros(alloc, stream, &[n], DType::BF16)?));
        }
        stream.synchronize()?;
        let capture = |side: &Stream, copy: &dyn Fn(&HostBuffer, &Tensor) -> Result<()>| -> Result<PoolExec> {
            let cap = alloc.capture(stream, CaptureMode::ThreadLocal, &alloc.new_pool())?;
            side.wait_stream(stream)?;
            for (h, t) in &buffers {
                copy(h, t)?;
            }
            stream.wait_stream(side)?;
            cap.finish()?.instantiate()
        };
        let out = capture(&inner.d2h, &|h, t| h.copy_out(t, &inner.d2h))?;
        let back = capture(&inner.h2d, &|h, t| h.copy_in(t, &inner.h2d))?;
        let bytes = buffers.iter().map(|(h, _)| h.bytes()).sum();
        let tail = (
            HostBuffer::new(dev, DType::BF16, TAIL_ELEMENTS)?,
            Tensor::zeros(alloc, stream, &[TAIL_ELEMENTS], DType::BF16)?,
        );
        let (d2h, h2d) = (inner.d2h.clone(), inner.h2d.clone());
        Ok(CopyGraphs { bytes, out, back, beside: dev.stream()?, _buffers: buffers, tail, d2h, h2d })
    }

    /// Bytes per millisecond each way on `stream`, the best of three replays.
    ///
    /// # Errors
    /// Launch and timing errors.
    pub(super) fn rates(&self, stream: &Stream) -> Result<(f64, f64)> {
        stream.device().synchronize()?;
        let rate = |exec: &PoolExec| -> Result<f64> {
            Ok(self.bytes as f64 / fastest_of_three(stream, &|| exec.launch(stream))?)
        };
        Ok((rate(&self.out)?, rate(&self.back)?))
    }

    /// Bytes copied each way.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl ProbeCopies for CopyGraphs {
    fn start_beside(&self, pass: Pass, stream: &Stream) -> Result<()> {
        self.beside.wait_stream(stream)?;
        match pass {
            Pass::Forward => self.out.launch(&self.beside),
            _ => self.back.launch(&self.beside),
        }
    }

    fn join_beside(&self, stream: &Stream) -> Result<()> {
        stream.wait_stream(&self.beside)
    }

    fn capture_in_tail(&self, pass: Pass, stream: &Stream, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let (host, t) = &self.tail;
        let side = if pass == Pass::Forward { &self.d2h } else { &self.h2d };
        side.wait_stream(stream)?;
        match pass {
            Pass::Forward => host.copy_out(t, side)?,
            _ => host.copy_in(t, side)?,
        }
        body()?;
        stream.wait_stream(side)
    }
}

/// The milliseconds of the fastest of three runs of `work` on `stream`, timed by events there
/// (never below a nanosecond, so that rates stay finite).
pub(super) fn fastest_of_three(stream: &Stream, work: &dyn Fn() -> Result<()>) -> Result<f64> {
    let dev = stream.device();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let (a, b) = (dev.timing_event()?, dev.timing_event()?);
        stream.record(&a)?;
        work()?;
        stream.record(&b)?;
        b.synchronize()?;
        best = best.min(f64::from(a.elapsed_ms(&b)?));
    }
    Ok(best.max(1e-6))
}
