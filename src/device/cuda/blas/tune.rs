//! Times cuBLASLt's candidate algorithms for one GEMM on the call's own operands, once per
//! layout, before the call itself runs.
//!
//! The candidates write the call's outputs (D, and the epilogue's aux matrix or bias gradient),
//! which the call then overwrites, on the call's stream, so the timing changes no result. The one
//! exception is a GEMM that accumulates into D (`beta ≠ 0` with C = D): its candidates write a
//! scratch copy of D instead. Timing needs synchronous calls (an event wait, and that scratch
//! allocation), so it runs only while no capture is active.

use cudarc::cublaslt::sys;
use cudarc::driver::{result as driver, sys as dsys, CudaEvent};

use super::super::ffi;
use super::super::stream::CuStream;
use super::{Matmul, Plan};
use crate::device::gemm::GemmSpec;
use crate::{Error, Result};

/// Timed runs of each candidate, after one untimed run.
const REPS: usize = 8;

/// A candidate within this fraction of the heuristic's first is not worth leaving it for.
const MARGIN: f64 = 0.02;

/// The measured time of each candidate in microseconds (`None` where cuBLASLt refused it), and
/// the index of the one to use: the fastest, unless the heuristic's first is within [`MARGIN`].
pub(super) struct Timings {
    pub(super) micros: Vec<Option<f64>>,
    pub(super) chosen: usize,
}

/// Times `call` with each of `plan`'s candidates on `stream`. `None` when a scratch D cannot be allocated (the
/// device is full): the caller then keeps the heuristic's first without measuring.
pub(super) fn time_candidates(
    call: &Matmul<'_>,
    plan: &Plan,
    spec: &GemmSpec,
    candidates: &[sys::cublasLtMatmulAlgo_t],
    stream: &CuStream,
) -> Result<Option<Timings>> {
    const OP: &str = "Stream::gemm (timing cuBLASLt's candidates)";
    let driver_err = |e: cudarc::driver::DriverError| Error::Cuda { op: OP, message: format!("{e:?}") };
    let scratch = match call.accumulates() {
        true => match Scratch::new(extent_bytes(spec)) {
            Some(s) => Some(s),
            None => return Ok(None),
        },
        false => None,
    };
    let d = scratch.as_ref().map_or(call.d, |s| s.0);
    let ctx = stream.raw.context();
    let event = || ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver_err);
    let mut marks: Vec<Option<(CudaEvent, CudaEvent)>> = Vec::with_capacity(candidates.len());
    for algo in candidates {
        // A candidate cuBLASLt refuses at launch is left out; the heuristic's first is the call's.
        if call.run(plan, algo, d, stream).is_err() {
            marks.push(None);
            continue;
        }
        let (start, end) = (event()?, event()?);
        start.record(&stream.raw).map_err(driver_err)?;
        for _ in 0..REPS {
            call.run(plan, algo, d, stream)?;
        }
        end.record(&stream.raw).map_err(driver_err)?;
        marks.push(Some((start, end)));
    }
    let mut micros = Vec::with_capacity(marks.len());
    for m in &marks {
        micros.push(match m {
            Some((start, end)) => {
                end.synchronize().map_err(driver_err)?;
                Some(f64::from(ffi::elapsed_ms(start, end).map_err(driver_err)?) * 1e3 / REPS as f64)
            }
            None => None,
        });
    }
    drop(scratch);
    let chosen = fastest(&micros);
    Ok(Some(Timings { micros, chosen }))
}

/// The index of the fastest time, unless the first is within [`MARGIN`] of it (or nothing ran).
fn fastest(micros: &[Option<f64>]) -> usize {
    let best = micros.iter().enumerate().filter_map(|(i, t)| t.map(|t| (i, t))).min_by(|a, b| a.1.total_cmp(&b.1));
    match (best, micros.first().copied().flatten()) {
        (Some((_, t)), Some(first)) if first <= t * (1.0 + MARGIN) => 0,
        (Some((i, _)), _) => i,
        (None, _) => 0,
    }
}

/// Bytes from D's first element to one past its last.
fn extent_bytes(spec: &GemmSpec) -> usize {
    let c = &spec.c;
    let elems = (spec.batch - 1) * c.batch_stride + (c.rows - 1) * c.ld + c.cols;
    elems * spec.dtype.size()
}

/// A device allocation for the candidates' output, freed when dropped.
struct Scratch(u64);

impl Scratch {
    /// `None` when the device cannot hold it.
    fn new(bytes: usize) -> Option<Scratch> {
        // SAFETY: a plain allocation, outside any capture (the caller checked); freed once, on drop.
        unsafe { driver::malloc_sync(bytes) }.ok().map(Scratch)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_sync`; `cuMemFree` waits for the candidates that wrote it.
        if let Err(e) = unsafe { driver::free_sync(self.0) } {
            // A failed free of a scratch buffer leaks it; the GEMM's result does not depend on it.
            tracing::warn!("graphed: freeing a GEMM timing buffer failed: {e:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fastest_candidate_wins_unless_the_first_is_close() {
        assert_eq!(fastest(&[Some(10.0), Some(5.0), Some(7.0)]), 1);
        assert_eq!(fastest(&[Some(10.0), Some(9.9), None]), 0, "within the margin");
        assert_eq!(fastest(&[None, Some(9.0), Some(8.0)]), 2, "the first refused");
        assert_eq!(fastest(&[None, None]), 0, "nothing ran");
        assert_eq!(fastest(&[]), 0);
    }
}
