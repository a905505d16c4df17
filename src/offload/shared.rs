//! What a manager and its chunk hooks share: the allocator, the copy streams, the configuration
//! and the protocol's state behind one lock. Its own file, so that the manager and the hooks
//! both depend on it and not on each other.

use std::sync::{Mutex, MutexGuard, PoisonError};

use super::config::{OffloadConfig, Policy};
use super::state::State;
use crate::device::{Event, Stream};
use crate::memory::CachingAllocator;
use crate::Result;

/// The state every hook of one [`OffloadManager`](super::OffloadManager) shares.
pub(crate) struct Inner {
    pub(crate) alloc: CachingAllocator,
    /// Copies out (device to host).
    pub(crate) d2h: Stream,
    /// Copies back (host to device).
    pub(crate) h2d: Stream,
    /// Recorded on the caller's stream when a switch gives resident tensors' memory back.
    pub(crate) released: Event,
    pub(crate) config: OffloadConfig,
    state: Mutex<State>,
}

impl Inner {
    /// The state of a new manager on `alloc`'s device, with its own copy streams.
    pub(crate) fn new(alloc: &CachingAllocator, config: OffloadConfig) -> Result<Inner> {
        let dev = alloc.device();
        Ok(Inner {
            alloc: alloc.clone(),
            d2h: dev.stream()?,
            h2d: dev.stream()?,
            released: dev.event()?,
            config,
            state: Mutex::new(State::new()),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent before it can fail.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether an eager recording iteration times its units: the automatic policy, on a device
    /// with a clock.
    pub(crate) fn timed(&self) -> bool {
        self.config.policy == Policy::Auto && self.alloc.device().has_clock()
    }
}
