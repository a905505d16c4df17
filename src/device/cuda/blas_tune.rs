//! Each GEMM layout's cuBLASLt algorithm, chosen by timing the heuristic's candidates once per
//! machine, where `GRAPHED_GEMM_TUNE=1` asks for it.
//!
//! cuBLASLt's heuristic ranks its algorithms without running them. A probe on an H200 at L's
//! shapes, timing each candidate after the one before, found another of its first eight faster
//! by 3.5% of the bf16 GEMMs' time and 10.1% of the FP8 GEMMs' time
//! (`bench/results/2026-12-05-h200-gemm-algos-ae2660b.txt`). With timing on, a plan's first call
//! outside any capture times those candidates on the call's own operands, in rounds that take
//! every candidate in turn, and keeps the fastest, which must beat the first by [`MARGIN`].
//! On an H100 the choices did not shorten L's step (`…-h100-gemm-timed-c3df07b.txt`), so timing is
//! off by default: every plan takes the heuristic's first.
//!
//! The choice is part of the result's bits: candidates may split `k` differently. Within a
//! process a plan's algorithm never changes after its first call, so eager and graphed steps
//! agree bit for bit. Across processes the choice is stored in graphed's disk cache, the first
//! process to store one wins ([`DiskCache::put_first`]), and every later process, or one that
//! timed at the same moment, takes the stored one: a resumed run, the ranks of one machine and a
//! benchmark after the tests all run the same algorithms. Without a cache directory nothing is
//! timed, since a choice that could differ run to run would make runs differ.
//!
//! A plan first used inside a capture takes the stored choice or the heuristic's first: timing
//! synchronizes, which would break a capture. Graphed's warmup runs every layer eagerly before
//! its capture, so a step's GEMMs are timed there.

use std::ffi::c_void;

use cudarc::cublaslt::result::CublasError;
use cudarc::cublaslt::sys;
use cudarc::driver::{result, sys as driver, DriverError};

use super::disk_cache::DiskCache;
use crate::device::gemm::GemmSpec;

/// How many of the heuristic's candidates a plan asks for (on the H200 at L's and M's shapes it
/// returned eight).
pub(super) const CANDIDATES: usize = 8;

/// Another candidate replaces the heuristic's first only if it takes at most `1 - MARGIN` of its
/// time: within that, timing noise would decide.
pub(super) const MARGIN: f32 = 0.02;

/// Timed rounds (the median of a candidate's is kept) and launches per candidate and round: at
/// L's shapes about 100 ms per layout, once per machine.
const ROUNDS: usize = 5;
const RUNS: usize = 5;

/// The cache files' extension, and what its warnings call an entry.
const EXT: &str = "algo";
const WHAT: &str = "cuBLASLt algorithm";

/// Whether and where choices are made and kept.
pub(super) struct Tuner {
    cache: DiskCache,
    enabled: bool,
}

impl Tuner {
    /// Timing as the environment says: on with `GRAPHED_GEMM_TUNE=1` and a cache directory.
    pub(super) fn from_env() -> Tuner {
        let cache = DiskCache::from_env();
        let enabled = cache.is_set() && std::env::var("GRAPHED_GEMM_TUNE").is_ok_and(|v| v == "1");
        Tuner { cache, enabled }
    }

    /// The stored choice for `key`, if a sound one is.
    pub(super) fn stored(&self, key: &str) -> Option<sys::cublasLtMatmulAlgo_t> {
        self.cache.get(EXT, key, WHAT).and_then(|bytes| decode(&bytes))
    }

    /// Whether plans may be timed at all.
    pub(super) fn enabled(&self) -> bool {
        self.enabled
    }

    /// How many of the heuristic's candidates a plan asks for: [`CANDIDATES`] with timing on,
    /// else only its first.
    pub(super) fn candidates(&self) -> usize {
        if self.enabled {
            CANDIDATES
        } else {
            1
        }
    }

    /// Stores `chosen` for `key` unless another process stored one first, and returns the stored
    /// one.
    pub(super) fn keep(&self, key: &str, chosen: sys::cublasLtMatmulAlgo_t) -> sys::cublasLtMatmulAlgo_t {
        decode(&self.cache.put_first(EXT, key, &encode(&chosen), WHAT)).unwrap_or(chosen)
    }
}

/// The disk cache's key of a plan: the GPU (its name, architecture and driver), cuBLASLt's version,
/// the workspace and the layout, since a choice holds for exactly these.
pub(super) fn key(device: &str, spec: &GemmSpec, workspace_bytes: usize) -> String {
    // SAFETY: returns a number; callers have loaded the library (a handle exists).
    let version = unsafe { sys::cublasLtGetVersion() };
    format!("cublaslt-algo-1 {device} cublasLt {version} workspace {workspace_bytes} {spec:?}")
}

/// An algorithm as the cache stores it: its eight words, little-endian.
fn encode(algo: &sys::cublasLtMatmulAlgo_t) -> Vec<u8> {
    algo.data.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn decode(bytes: &[u8]) -> Option<sys::cublasLtMatmulAlgo_t> {
    let words: Vec<u64> = bytes.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes"))).collect();
    let data: [u64; 8] = words.try_into().ok().filter(|_| bytes.len() == 64)?;
    Some(sys::cublasLtMatmulAlgo_t { data })
}

/// The candidate to keep given each one's time (`None`: it failed to run), the heuristic's first
/// at index 0: the fastest, if it beats the first by [`MARGIN`], else the first.
pub(super) fn fastest(times: &[Option<f32>]) -> usize {
    let best = times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    match (times.first().copied().flatten(), best) {
        (Some(first), Some((i, t))) if t <= first * (1.0 - MARGIN) => i,
        (None, Some((i, _))) => i,
        _ => 0,
    }
}

/// Writable memory for timing a GEMM that accumulates into its output in place, whose real
/// output must not be touched. Freed by [`Scratch::free`], which every path calls: a destructor
/// could not return the error.
pub(super) struct Scratch(driver::CUdeviceptr);

impl Scratch {
    /// `bytes` of zeros (set on `stream`), or `None` where the device has no room: then nothing
    /// is timed.
    pub(super) fn zeroed(bytes: usize, stream: driver::CUstream) -> Result<Option<Scratch>, DriverError> {
        // SAFETY: a plain allocation, zeroed in stream order before any use on `stream`.
        let ptr = match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => ptr,
            Err(e) if e.0 == driver::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => return Ok(None),
            Err(e) => return Err(e),
        };
        let scratch = Scratch(ptr);
        // SAFETY: `ptr` holds `bytes`.
        match unsafe { result::memset_d8_async(ptr, 0, bytes, stream) } {
            Ok(()) => Ok(Some(scratch)),
            Err(e) => scratch.free(stream).and(Err(e)),
        }
    }

    pub(super) fn ptr(&self) -> u64 {
        self.0
    }

    /// Frees the memory after the work on `stream` that used it.
    pub(super) fn free(self, stream: driver::CUstream) -> Result<(), DriverError> {
        // SAFETY: allocated by `zeroed`, freed once (`self` is consumed), after the stream's
        // work that used it.
        unsafe {
            result::stream::synchronize(stream)?;
            result::free_sync(self.0)
        }
    }
}

/// Each candidate's time per launch in ms (`None`: it failed to launch): every candidate
/// launched once untimed, so the GPU has left idle clocks before anything is timed; then
/// [`ROUNDS`] rounds, each of [`RUNS`] launches of every candidate in turn, all enqueued before
/// one synchronization with an event between each candidate's launches, and the median of a
/// candidate's rounds. The GPU runs them back to back, as a training step runs its GEMMs, and
/// rounds in turn spread any drift of clocks or power over every candidate alike. Timed one
/// candidate after another, with a synchronization after each three launches, an H100 kept
/// choices that ran up to 12% slower in a benchmark's steady state: short bursts favour the
/// kernels that a power-capped GPU slows most.
pub(super) fn time(
    stream: driver::CUstream,
    run: &dyn Fn(usize) -> Result<(), CublasError>,
    candidates: usize,
) -> Result<Vec<Option<f32>>, DriverError> {
    let mut runs: Vec<bool> = (0..candidates).map(|i| run(i).is_ok()).collect();
    let mut events = Vec::with_capacity(ROUNDS * candidates + 1);
    let timed = (|| {
        let mark = |events: &mut Vec<driver::CUevent>| -> Result<(), DriverError> {
            let e = result::event::create(driver::CUevent_flags::CU_EVENT_DEFAULT)?;
            events.push(e);
            // SAFETY: the event was just created; the stream is live.
            unsafe { result::event::record(e, stream) }
        };
        mark(&mut events)?;
        for _ in 0..ROUNDS {
            for (i, ok) in runs.iter_mut().enumerate() {
                if *ok && (0..RUNS).try_for_each(|_| run(i)).is_err() {
                    *ok = false;
                }
                mark(&mut events)?;
            }
        }
        // SAFETY: the last event is recorded.
        unsafe { result::event::synchronize(*events.last().expect("marked above"))? };
        let mut rounds: Vec<Vec<f32>> = vec![Vec::with_capacity(ROUNDS); candidates];
        for (k, pair) in events.windows(2).enumerate() {
            // SAFETY: both recorded and complete.
            rounds[k % candidates].push(unsafe { result::event::elapsed(pair[0], pair[1])? } / RUNS as f32);
        }
        Ok(rounds)
    })();
    // SAFETY: each created above and destroyed once, after the synchronization that used them.
    // Every event is destroyed; the first failure is kept.
    let destroyed = events.into_iter().map(|e| unsafe { result::event::destroy(e) }).fold(Ok(()), Result::and);
    let rounds = timed?;
    destroyed?;
    Ok(rounds.into_iter().zip(runs).map(|(r, ran)| ran.then(|| median(r))).collect())
}

/// The median of `v` (not empty): its middle element once sorted.
fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

/// The void pointer cuBLASLt takes for a device address.
pub(super) fn dptr(p: u64) -> *const c_void {
    p as *const c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heuristics_first_stays_unless_another_is_clearly_faster() {
        assert_eq!(fastest(&[Some(1.0), Some(0.985), Some(1.2)]), 0);
        assert_eq!(fastest(&[Some(1.0), Some(0.95), Some(0.9)]), 2);
        assert_eq!(fastest(&[Some(1.0), None, Some(0.98)]), 2);
        // The first did not run: the fastest that did.
        assert_eq!(fastest(&[None, Some(2.0), Some(1.5)]), 2);
        assert_eq!(fastest(&[None, None]), 0);
        assert_eq!(fastest(&[]), 0);
        // Equal times: the earlier in the heuristic's order.
        assert_eq!(fastest(&[Some(1.0), Some(0.5), Some(0.5)]), 1);
    }

    #[test]
    fn an_algorithm_round_trips_through_its_bytes_and_nothing_else_decodes() {
        let algo = sys::cublasLtMatmulAlgo_t { data: [1, 2, 3, u64::MAX, 5, 6, 7, 1 << 63] };
        let bytes = encode(&algo);
        assert_eq!(bytes.len(), 64);
        assert_eq!(decode(&bytes).map(|a| a.data), Some(algo.data));
        assert!(decode(&bytes[..63]).is_none());
        assert!(decode(&[bytes.clone(), vec![0; 8]].concat()).is_none());
        assert!(decode(&[]).is_none());
    }
}
