//! Which of cuBLASLt's candidate algorithms each GEMM layout runs, remembered for the process and
//! on disk.
//!
//! The heuristic's first algorithm is often not the fastest for a layout (the epilogue GEMMs of a
//! small layer ran at a quarter of the tensor cores' peak with it), so `tune.rs` times the
//! candidates once and this file keeps the choice. Different algorithms round differently, so a
//! choice must not change under a run: within the process every device of one GPU model takes
//! the first choice made, and across processes the disk cache gives a resumed run, another rank
//! or a later test the same algorithm, hence the same bits. Without a cache directory, another
//! process may choose differently (a few ULPs apart, never a wrong result).

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use super::super::disk_cache::DiskCache;
use crate::device::gemm::GemmSpec;

/// File extension of the choices in the disk cache.
const EXT: &str = "gemm";

/// The choices of this process, by key (device, library, layout, candidates).
static CHOSEN: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());

/// The environment variable that turns the measurement off (`0`): every layout then runs the
/// heuristic's first candidate, for comparing the two in one machine's benchmarks.
const TUNING_ENV: &str = "GRAPHED_GEMM_TUNING";

/// Where a layout's choice is looked up and kept, for one device.
pub(super) struct Choices {
    /// The GPU and its driver, as the device describes itself.
    device: String,
    cache: DiskCache,
    /// Whether new layouts are measured (else they take the heuristic's first).
    measure: bool,
}

/// How a choice was made, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    /// Made earlier in this process.
    Process,
    /// Read from the disk cache.
    Disk,
}

impl Choices {
    /// The choices of `device` ("NVIDIA H200 (sm_90, driver 13.0)"), cached where the
    /// environment says.
    pub(super) fn new(device: String) -> Choices {
        let measure = std::env::var_os(TUNING_ENV).is_none_or(|v| v != "0");
        Choices { device, cache: DiskCache::from_env(), measure }
    }

    /// Whether new layouts are measured: unless `GRAPHED_GEMM_TUNING=0`.
    pub(super) fn measure(&self) -> bool {
        self.measure
    }

    /// Everything a choice depends on: the GPU and driver, cuBLASLt's version, the layout, the
    /// workspace the candidates may use and how many there are.
    pub(super) fn key(&self, spec: &GemmSpec, workspace_bytes: usize, candidates: usize) -> String {
        // SAFETY: a version query without arguments.
        let version = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
        // Unmeasured choices are kept apart, so that turning the measurement off and on again in
        // one process measures.
        let how = if self.measure { "measured" } else { "heuristic" };
        format!(
            "graphed gemm choice 1 {how}\n{}\ncublasLt {version}\n{spec:?}\nworkspace {workspace_bytes}\ncandidates {candidates}",
            self.device
        )
    }

    /// The candidate chosen for `key` earlier, if any, and where it was found; one out of range
    /// of `candidates` counts as damaged and is not returned.
    pub(super) fn recall(&self, key: &str, candidates: usize) -> Option<(usize, Source)> {
        if let Some(&i) = CHOSEN.lock().unwrap_or_else(PoisonError::into_inner).get(key) {
            return Some((i, Source::Process));
        }
        let what = "GEMM algorithm choice";
        let stored = self.cache.get(EXT, key, what)?;
        match parse(&stored, candidates) {
            Some(i) => {
                self.remember(key, i, false);
                Some((i, Source::Disk))
            }
            None => {
                tracing::warn!("graphed: a cached {what} is not a candidate index below {candidates}; measuring again");
                None
            }
        }
    }

    /// Keeps candidate `index` for `key` in this process, and on disk when `persist` (a measured
    /// choice; a heuristic fallback is not worth keeping). The process's first choice stays.
    pub(super) fn remember(&self, key: &str, index: usize, persist: bool) {
        CHOSEN.lock().unwrap_or_else(PoisonError::into_inner).entry(key.to_string()).or_insert(index);
        if persist {
            self.cache.put(EXT, key, index.to_string().as_bytes(), "GEMM algorithm choice");
        }
    }
}

/// A stored choice: a decimal index below `candidates`.
fn parse(stored: &[u8], candidates: usize) -> Option<usize> {
    std::str::from_utf8(stored).ok()?.parse::<usize>().ok().filter(|&i| i < candidates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_choice_is_an_index_below_the_candidates() {
        assert_eq!(parse(b"3", 8), Some(3));
        assert_eq!(parse(b"0", 1), Some(0));
        assert_eq!(parse(b"8", 8), None, "out of range");
        assert_eq!(parse(b"-1", 8), None);
        assert_eq!(parse(b"3 ", 8), None);
        assert_eq!(parse(&[0xff, 0x33], 8), None, "not UTF-8");
    }
}
