//! The addresses that a switchable graph's device copies read: one entry per copy (its
//! destination, its source, its bytes), in device memory that a switch rewrites with one
//! stream-ordered copy, so that keeping a tensor resident or offloading it again updates no
//! graph node (docs/offload.md).

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::device::{BufferId, DeviceBuffer, Event, PinnedBuffer, Stream, View};
use crate::memory::CachingAllocator;
use crate::Result;

/// Words per entry: destination, source, bytes.
const WORDS: usize = 3;

/// How many pinned buffers a table is written from, in turn: an upload waits for the one that
/// read its buffer last, [`STAGING`] uploads ago (switches back to back, a benchmark's, would
/// otherwise wait for the copy of the switch before).
const STAGING: usize = 2;

/// A table of copy entries on the device, its host copy, and the pinned buffers it is written
/// from.
pub(crate) struct CopyTable {
    words: DeviceBuffer<u64>,
    staging: [PinnedBuffer<u64>; STAGING],
    state: Mutex<TableState>,
}

struct TableState {
    /// What the device's table holds once the last upload ran, or will hold after the next.
    entries: Vec<u64>,
    /// Changed since the last upload.
    dirty: bool,
    /// Recorded after the last upload from each staging buffer, which read it.
    uploaded: [Option<Event>; STAGING],
    /// The staging buffer the next upload writes.
    next: usize,
}

impl CopyTable {
    /// A table of `entries` entries, all copying nothing, zeroed on `stream` (before any launch
    /// that reads it, as it is made before the capture whose copies read it).
    pub(crate) fn new(alloc: &CachingAllocator, stream: &Stream, entries: usize) -> Result<CopyTable> {
        let words = alloc.alloc::<u64>(stream, entries * WORDS)?;
        stream.memset(&words, 0)?;
        let pinned = || stream.device().alloc_pinned::<u64>(entries * WORDS);
        let staging = [pinned()?, pinned()?];
        let state = TableState { entries: vec![0; entries * WORDS], dirty: false, uploaded: [None, None], next: 0 };
        Ok(CopyTable { words, staging, state: Mutex::new(state) })
    }

    fn lock(&self) -> MutexGuard<'_, TableState> {
        // Each change is one assignment of whole words: consistent after a panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The allocation its device words are in.
    pub(crate) fn memory_id(&self) -> BufferId {
        self.words.memory_id()
    }

    /// Entry `e` on the device, for the copy that reads it.
    pub(crate) fn entry(&self, e: usize) -> View<'_, u64> {
        self.words.slice(e * WORDS..(e + 1) * WORDS)
    }

    /// Sets entry `e` to copy `bytes` (none for 0) from `src` to `dst` (device addresses), from
    /// the next [`upload`](CopyTable::upload) on.
    pub(crate) fn set(&self, e: usize, dst: u64, src: u64, bytes: u64) {
        let mut st = self.lock();
        let words = &mut st.entries[e * WORDS..(e + 1) * WORDS];
        if words != [dst, src, bytes] {
            words.copy_from_slice(&[dst, src, bytes]);
            st.dirty = true;
        }
    }

    /// Points the pair of entries `out` (a copy out of a tensor, its source kept) and `back`
    /// (its copy back, its destination kept) at device memory `to`: both copy `bytes` through
    /// it. Under one lock: a switch points a few dozen pairs.
    pub(crate) fn point_pair(&self, [out, back]: [usize; 2], to: [u64; 2], bytes: u64) {
        let mut st = self.lock();
        let (src, dst) = (st.entries[out * WORDS + 1], st.entries[back * WORDS]);
        for (e, words) in [(out, [to[0], src, bytes]), (back, [dst, to[1], bytes])] {
            let entry = &mut st.entries[e * WORDS..(e + 1) * WORDS];
            if entry != words {
                entry.copy_from_slice(&words);
                st.dirty = true;
            }
        }
    }

    /// Writes the entries set since the last upload to the device on `stream`, after the work
    /// queued there: launches enqueued on `stream` later (or ordered after it) read them. Waits
    /// for the upload [`STAGING`] uploads ago to have read the pinned buffer this one writes,
    /// which a switch a step after the last one never does. Does nothing when nothing changed.
    pub(crate) fn upload(&self, stream: &Stream) -> Result<()> {
        let st = &mut *self.lock();
        if !st.dirty {
            return Ok(());
        }
        let (k, staging) = (st.next, &self.staging[st.next]);
        if let Some(e) = &st.uploaded[k] {
            e.synchronize()?;
        }
        staging.write(&st.entries)?;
        stream.copy_h2d(staging.view(), &self.words)?;
        let done = match &mut st.uploaded[k] {
            Some(e) => &*e,
            none => none.insert(stream.device().event()?),
        };
        stream.record(done)?;
        (st.dirty, st.next) = (false, (k + 1) % STAGING);
        Ok(())
    }
}
