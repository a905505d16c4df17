//! Collectives between devices: NCCL on GPUs, and the simulator's own between simulated devices
//! of one process, with the same semantics (the operations of a communicator match by issue
//! order across ranks) and three things NCCL cannot do: a mismatch in kind, length or element
//! type, a rank gone, and a deadlock (every rank waiting on another) are typed errors.
//!
//! A collective is one more stream operation: enqueued on a [`Stream`](super::Stream), ordered by events,
//! declared as accesses to the checker, and captured into graphs like a kernel. Every launch of
//! a captured graph issues its collectives again, in the graph's order.
//!
//! ```
//! use graphed::device::{Communicator, CommOptions, Device};
//! let devices = [Device::sim(), Device::sim()];
//! let comms = Communicator::sim_group(&devices, CommOptions::default())?;
//! let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let handles: Vec<_> = comms.iter().map(|comm| s.spawn(move || -> graphed::Result<Vec<f32>> {
//!         let stream = comm.device().stream()?;
//!         let x = comm.device().alloc_from(&stream, &[comm.rank() as f32 + 1.0; 4])?;
//!         comm.all_reduce(&stream, &x)?;
//!         x.to_vec(&stream)
//!     })).collect();
//!     handles.into_iter().map(|h| h.join().expect("rank thread")).collect::<graphed::Result<_>>()
//! })?;
//! assert_eq!(sums, vec![vec![3.0; 4]; 2]);
//! # Ok::<(), graphed::Error>(())
//! ```
//!
//! One file per purpose: `group.rs` makes groups (simulated, NCCL, splits) and the NCCL
//! identity, `collectives.rs` checks and enqueues the operations, `wait.rs` holds what a rank
//! waits for at the host, `watchdog.rs` what graphs hold of the group's collectives and the
//! report of a launch that did not complete, `error.rs` why a collective or a group fails.

mod collectives;
mod error;
mod group;
mod wait;
mod watchdog;

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::backend::Repr;
use super::{cuda, sim, Device};

pub(crate) use collectives::Collective;
pub use collectives::Transfer;
pub(crate) use error::comm_error;
pub use error::{CommErrorKind, Stalled, StalledLaunch};
pub(crate) use group::per_rank_thread;
pub use group::NcclId;
pub(crate) use wait::Patience;
pub use wait::{CommOptions, PEER_NAMING_GRACE};
pub use watchdog::CapturedCollective;
pub(crate) use watchdog::{GraphCollectives, Stuck};

/// One rank's handle on a group of devices that exchange data (an NCCL communicator, or a group
/// of simulated devices). Cloning yields the same handle.
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<CommInner>,
}

struct CommInner {
    dev: Device,
    rank: usize,
    size: usize,
    options: CommOptions,
    repr: CommRepr,
    /// NCCL's abort, under way on a thread of its own (see [`Communicator::abort`]).
    abort: Mutex<Option<JoinHandle<()>>>,
    /// Its launches of graphs that hold its collectives, for the report of a wait that fails.
    ledger: Mutex<watchdog::Ledger>,
}

impl Drop for CommInner {
    /// Waits for an abort under way before the device and the communicator go: NCCL must not
    /// outlive the context it aborts in. The abort's own failure leaves nothing to report (the
    /// communicator is gone either way), and the thread does not panic.
    fn drop(&mut self) {
        if let Some(thread) = self.abort.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            let _ = thread.join();
        }
    }
}

pub(crate) type CommRepr = Repr<sim::SimLink, cuda::NcclComm>;

impl Communicator {
    fn new(dev: Device, rank: usize, size: usize, options: CommOptions, repr: CommRepr) -> Communicator {
        Communicator {
            inner: Arc::new(CommInner {
                dev,
                rank,
                size,
                options,
                repr,
                abort: Mutex::new(None),
                ledger: Mutex::default(),
            }),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// How many ranks the group has.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// This rank's device.
    pub fn device(&self) -> &Device {
        &self.inner.dev
    }

    /// What operations wait for.
    pub fn options(&self) -> CommOptions {
        self.inner.options
    }

    /// Aborts a GPU communicator: its pending operations end and later ones fail at once. For a
    /// watchdog that knows the group cannot finish; a simulated group breaks by itself when a
    /// rank leaves. NCCL's abort runs on a thread of its own, so that no caller (a wait that the
    /// group's watch ended, the watch itself) queues seconds behind NCCL's threads giving up on a
    /// dead rank; the last handle's drop waits for it, so that the device outlives it (a process
    /// that exits mid-abort, or frees the context under it, crashes inside NCCL).
    pub(crate) fn abort(&self) {
        let Repr::Cuda(c) = &self.inner.repr else { return };
        // What had not completed, before the abort ends it (the report of a wait that fails).
        self.freeze_ledger();
        if !c.begin_abort() {
            return;
        }
        let nccl = c.clone();
        match std::thread::Builder::new().name("graphed-nccl-abort".into()).spawn(move || nccl.abort()) {
            Ok(thread) => *self.inner.abort.lock().unwrap_or_else(PoisonError::into_inner) = Some(thread),
            Err(e) => {
                tracing::warn!("graphed: no thread for a communicator's abort ({e}); aborting on the caller's");
                c.abort();
            }
        }
    }

    /// Whether anything but this handle holds the communicator: another handle, or a graph that
    /// captured its operations.
    pub(crate) fn held_elsewhere(&self) -> bool {
        Arc::strong_count(&self.inner) > 1 || matches!(&self.inner.repr, Repr::Cuda(c) if c.shared())
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {})", self.inner.rank, self.inner.size)
    }
}
