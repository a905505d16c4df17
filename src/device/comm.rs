//! Collectives between devices: NCCL on GPUs, and the simulator's own between simulated devices
//! of one process, with the same semantics (the operations of a communicator match by issue
//! order across ranks) and three things NCCL cannot do: a mismatch in kind, length or element
//! type, a rank gone, and a deadlock (every rank waiting on another) are typed errors.
//!
//! A collective is one more stream operation: enqueued on a [`Stream`], ordered by events,
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

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::backend::{Op, Part, Repr};
use super::kernel::IntoView;
use super::memory::access_of;
use super::{cuda, sim, AccessMode, DType, Device, Elem, Stream};
use crate::{Error, Result};

/// What a communicator's operations may wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommOptions {
    /// How long a rank waits for the others (making or splitting a group, at
    /// [`Communicator::wait`], and on the simulator in a collective) before it fails with
    /// [`CommErrorKind::Timeout`]. A host call into NCCL that connects two ranks (the first
    /// collective or send that needs the pair) waits inside NCCL, out of its reach:
    /// `docs/several-gpus.md` says when that happens and how `graphed launch` avoids it.
    pub timeout: Duration,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions { timeout: Duration::from_secs(300) }
    }
}

/// Why a rank stops waiting for the others at the host: its timeout ran out, or a watch of the
/// group (a process group's view of its ranks' connections) says the group cannot finish.
pub(crate) struct Patience<'w> {
    deadline: Instant,
    timeout: Duration,
    watch: &'w dyn Fn() -> Option<CommErrorKind>,
}

impl<'w> Patience<'w> {
    /// Waits of up to `timeout` from now, ended early by `watch`'s answer.
    pub(crate) fn new(timeout: Duration, watch: &'w dyn Fn() -> Option<CommErrorKind>) -> Patience<'w> {
        Patience { deadline: Instant::now() + timeout, timeout, watch }
    }

    /// Polls `ready` until it says the wait for `waiting` is over. Fails on the watch's answer
    /// or the timeout (both as `fail` makes them), after calling `abort` (what was waited for
    /// cannot finish), or on an error of `ready`, in that order: the watch knows which rank died,
    /// NCCL only that one did.
    pub(crate) fn poll<E>(
        &self,
        waiting: &dyn Fn() -> String,
        abort: &dyn Fn(),
        fail: impl Fn(CommErrorKind) -> E,
        mut ready: impl FnMut() -> std::result::Result<bool, E>,
    ) -> std::result::Result<(), E> {
        loop {
            let state = ready();
            if let Ok(true) = state {
                return Ok(());
            }
            let ended = (self.watch)().or_else(|| {
                let secs = self.timeout.as_secs_f64();
                (Instant::now() > self.deadline).then(|| CommErrorKind::Timeout { waiting: waiting(), secs })
            });
            if let Some(kind) = ended {
                abort();
                return Err(fail(kind));
            }
            state?;
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

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

/// The operation a rank issues; every rank of a collective issues the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    /// Sum in place across ranks.
    AllReduce,
    /// Sum across ranks, each rank keeping its slice.
    ReduceScatter,
    /// Every rank's input, concatenated in rank order, on every rank.
    AllGather,
    /// To one peer (matched with its [`Collective::Recv`]).
    Send(usize),
    /// From one peer.
    Recv(usize),
}

impl Collective {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather",
            Collective::Send(_) => "send",
            Collective::Recv(_) => "recv",
        }
    }
}

/// Why a collective or a process group failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CommErrorKind {
    /// Ranks issued different operations at the same place in their order.
    #[error("rank {rank} issued {found} as operation #{seq} of the communicator, but rank {other} issued {expected}; every rank must issue the same collectives in the same order (NCCL would hang or corrupt data here)")]
    Mismatch {
        /// The operation's place in the communicator's order.
        seq: u64,
        /// The rank that issued it second.
        rank: usize,
        /// What it issued.
        found: String,
        /// The rank that issued it first.
        other: usize,
        /// What that rank issued.
        expected: String,
    },
    /// Every rank waits for another: the ranks issued operations in orders that cannot meet.
    #[error("deadlock: {waits}; issue collectives and sends/receives in an order every rank can meet (NCCL would hang here)")]
    Deadlock {
        /// What each rank waits for.
        waits: String,
    },
    /// A rank waited longer than [`CommOptions::timeout`].
    #[error(
        "waited {secs:.1} s for {waiting}; a rank is slow, stuck or dead: check every rank's log, or raise the timeout"
    )]
    Timeout {
        /// What it waited for.
        waiting: String,
        /// How long.
        secs: f64,
    },
    /// A rank left (its communicator was dropped, or its process died) while others waited on it.
    #[error("rank {rank} left the group while others waited on it (its process ended, or it failed and dropped its communicator); see that rank's log")]
    RankGone {
        /// The rank that left.
        rank: usize,
    },
    /// A rank's thread panicked (ranks run as threads of one process: `dist::on_ranks`); the
    /// other ranks see it leave ([`CommErrorKind::RankGone`]).
    #[error("rank {rank} panicked: {message}; this is a bug in the code the rank ran, fix it there")]
    Panicked {
        /// The rank whose thread panicked.
        rank: usize,
        /// The panic's message (its `&str` or `String` payload), or a note that it had none.
        message: String,
    },
    /// A rank number outside the group.
    #[error("peer {peer} is not a rank of this group of {size}; pass a rank below {size} other than your own")]
    BadPeer {
        /// The peer asked for.
        peer: usize,
        /// The group's size.
        size: usize,
    },
    /// Lengths that do not fit the operation.
    #[error("{what}; pass views of the lengths the operation takes")]
    Length {
        /// What was wrong.
        what: String,
    },
    /// Buffers of one operation (or group) that overlap where one of them is written: NCCL's
    /// result would be undefined.
    #[error("{what}; give the operation's buffers distinct memory")]
    Overlap {
        /// Which buffers overlap.
        what: String,
    },
    /// Gradient buckets of two graphed callables that overlap
    /// ([`DataParallel::new`](crate::dist::DataParallel::new)): a gradient in both would be
    /// summed twice, the second sum doubling the first.
    #[error(
        "the gradient buckets of graphed callables {first} and {second} overlap (a parameter they share would be \
         reduced twice); give each gradient to one bucket"
    )]
    BucketOverlap {
        /// The earlier callable.
        first: usize,
        /// The later callable.
        second: usize,
    },
    /// A graphed callable whose index has no gradient bucket in the
    /// [`DataParallel`](crate::dist::DataParallel) it reduces through.
    #[error("graphed callable {callable} has no gradient bucket; pass one per callable")]
    NoBucket {
        /// The callable's index.
        callable: usize,
    },
    /// A parameter a module told final in its backward that is not in its callable's gradient
    /// bucket.
    #[error(
        "parameter `{param}` was told final in graphed callable {callable}'s backward but is not in its gradient \
         bucket; make the DataParallel from the callables' own parameters (DataParallel::for_callables or \
         for_stack)"
    )]
    NotInBucket {
        /// The parameter's name.
        param: String,
        /// The callable's index.
        callable: usize,
    },
    /// A reduction of an element type that has no sum here.
    #[error("cannot sum {dtype}; reduce f32, bf16 or f16")]
    DType {
        /// The element type.
        dtype: DType,
    },
    /// NCCL returned an error.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// The rendezvous of a process group failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// Ranks disagree on what they train.
    #[error(
        "rank {rank} builds {theirs}, but rank 0 builds {ours}; launch every rank with the same model and arguments"
    )]
    ModelMismatch {
        /// The disagreeing rank.
        rank: usize,
        /// What rank 0 builds.
        ours: String,
        /// What that rank builds.
        theirs: String,
    },
    /// The launcher's environment is missing or wrong.
    #[error("environment variable {var}: {why}; launch with `graphed launch` or torchrun, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

impl Communicator {
    /// One communicator per simulated device, as one group (rank `i` on `devices[i]`). Run each
    /// rank on its own thread: a rank's device runs its queued work when its host synchronizes,
    /// and a collective completes when every rank's part has run.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when a device is not a simulator or a device appears twice.
    pub fn sim_group(devices: &[Device], options: CommOptions) -> Result<Vec<Communicator>> {
        for (i, d) in devices.iter().enumerate() {
            let refused = match d.backend() {
                super::backend::BackendImpl::Cuda(_) => {
                    Some(("cuda", "a simulated group takes simulator devices; on GPUs use Communicator::nccl"))
                }
                super::backend::BackendImpl::Sim(_) if devices[..i].iter().any(|e| e.id() == d.id()) => {
                    Some(("sim", "a device appears twice; give each rank its own"))
                }
                super::backend::BackendImpl::Sim(_) => None,
            };
            if let Some((backend, why)) = refused {
                return Err(Error::Unsupported { op: "Communicator::sim_group", backend, why });
            }
        }
        let links = sim::SimLink::group(devices.iter().map(Device::id).collect(), options.timeout);
        Ok(devices
            .iter()
            .zip(links)
            .enumerate()
            .map(|(rank, (dev, link))| Communicator::new(dev.clone(), rank, devices.len(), options, Repr::Sim(link)))
            .collect())
    }

    /// Rank `rank` of a group of `size` GPUs that share `id` (made once by [`NcclId::new`] and
    /// sent to every rank, as a process group's rendezvous does). Waits until every rank has
    /// joined, then connects the group with two eager all-reduces, so that its collectives can be
    /// captured from the first.
    ///
    /// # Errors
    /// [`Error::Comm`] with [`CommErrorKind::Timeout`] when a rank does not join within the
    /// options' timeout, [`CommErrorKind::Nccl`] when NCCL is missing or fails, or
    /// [`Error::Unsupported`] on the simulator.
    pub fn nccl(dev: &Device, rank: usize, size: usize, id: &NcclId, options: CommOptions) -> Result<Communicator> {
        Communicator::nccl_watching(dev, rank, size, id, options, &|| None)
    }

    /// As [`nccl`](Communicator::nccl), also failing as soon as `watch` reports why the group
    /// cannot form (a process group's watch says which rank died), with its answer. A failed
    /// join aborts the half-made communicator.
    ///
    /// # Errors
    /// `watch`'s error, and as [`nccl`](Communicator::nccl).
    pub fn nccl_watching(
        dev: &Device,
        rank: usize,
        size: usize,
        id: &NcclId,
        options: CommOptions,
        watch: &dyn Fn() -> Option<CommErrorKind>,
    ) -> Result<Communicator> {
        let super::backend::BackendImpl::Cuda(b) = dev.backend() else {
            return Err(Error::Unsupported {
                op: "Communicator::nccl",
                backend: "sim",
                why: "NCCL runs on GPUs; group simulated devices with Communicator::sim_group",
            });
        };
        if rank >= size {
            return Err(comm_error("Communicator::nccl", rank, CommErrorKind::BadPeer { peer: rank, size }));
        }
        let patience = Patience::new(options.timeout, watch);
        let comm = b.nccl_comm(rank, size, &id.0, &patience).map_err(|k| comm_error("Communicator::nccl", rank, k))?;
        let comm = Communicator::new(dev.clone(), rank, size, options, Repr::Cuda(comm));
        comm.connect(watch)?;
        Ok(comm)
    }

    /// Runs one small and one large all-reduce eagerly. NCCL connects a group's ranks at the
    /// first collective that needs each connection, and connecting fails inside a stream capture
    /// (`ncclInternalError` on the H200s when a group's first all-reduce was captured), so a
    /// group is connected before anyone captures its collectives. Sends and receives connect
    /// their own pairs at their first use: run one eagerly before capturing them (as
    /// [`P2pLinks`](crate::dist::P2pLinks) does). A failure aborts the communicator: nobody else
    /// holds it yet.
    fn connect(&self, watch: &dyn Fn() -> Option<CommErrorKind>) -> Result<()> {
        let connected = (|| {
            let (dev, stream) = (self.device(), self.device().stream()?);
            for len in [1, 4 << 20] {
                let scratch = dev.alloc::<f32>(len)?;
                self.all_reduce(&stream, &scratch)?;
                self.wait_watching(&stream, watch)?;
            }
            Ok(())
        })();
        if connected.is_err() {
            self.abort();
        }
        connected
    }

    /// Aborts a GPU communicator: its pending operations end and later ones fail at once. For a
    /// watchdog that knows the group cannot finish; a simulated group breaks by itself when a
    /// rank leaves. NCCL's abort runs on a thread of its own, so that no caller (a wait that the
    /// group's watch ended, the watch itself) queues seconds behind NCCL's threads giving up on a
    /// dead rank; the last handle's drop waits for it, so that the device outlives it (a process
    /// that exits mid-abort, or frees the context under it, crashes inside NCCL).
    pub(crate) fn abort(&self) {
        let Repr::Cuda(c) = &self.inner.repr else { return };
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

    /// One NCCL communicator per GPU of this process, as one group (rank `i` on `devices[i]`):
    /// the GPU counterpart of [`sim_group`](Communicator::sim_group), for programs and tests that
    /// drive several GPUs from threads of one process instead of one process per GPU. A rank
    /// that fails ends the others' wait at once: they fail with [`CommErrorKind::RankGone`]
    /// naming it, and the error returned is that rank's own.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when a device is not a GPU or a GPU appears twice; NCCL's errors
    /// as [`nccl`](Communicator::nccl).
    pub fn nccl_group(devices: &[Device], options: CommOptions) -> Result<Vec<Communicator>> {
        let ordinal = |d: &Device| match d.backend() {
            super::backend::BackendImpl::Cuda(b) => Some(b.ordinal()),
            super::backend::BackendImpl::Sim(_) => None,
        };
        for (i, d) in devices.iter().enumerate() {
            if ordinal(d).is_none() || devices[..i].iter().any(|e| ordinal(e) == ordinal(d)) {
                return Err(Error::Unsupported {
                    op: "Communicator::nccl_group",
                    backend: "sim",
                    why: "an NCCL group takes distinct GPUs; group simulated devices with Communicator::sim_group",
                });
            }
        }
        let id = NcclId::new()?;
        let size = devices.len();
        // The first rank to fail; the others' watch.
        let failed = std::sync::Mutex::new(None::<usize>);
        let first_failed = || *failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Every rank waits for the others until all have joined: one thread each.
        let ranks = per_rank_thread("Communicator::nccl_group", devices.iter().collect(), |rank, dev| {
            let watch = || first_failed().map(|rank| CommErrorKind::RankGone { rank });
            let joined = Communicator::nccl_watching(dev, rank, size, &id, options, &watch);
            if joined.is_err() {
                failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(rank);
            }
            joined
        });
        match first_failed() {
            Some(rank) => Err(ranks
                .into_iter()
                .nth(rank)
                .and_then(Result::err)
                .unwrap_or_else(|| comm_error("Communicator::nccl_group", rank, CommErrorKind::RankGone { rank }))),
            None => ranks.into_iter().collect(),
        }
    }

    fn new(dev: Device, rank: usize, size: usize, options: CommOptions, repr: CommRepr) -> Communicator {
        Communicator { inner: Arc::new(CommInner { dev, rank, size, options, repr, abort: Mutex::new(None) }) }
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

    /// Splits the group (NCCL's `ncclCommSplit`): every rank calls it, and it blocks on the host
    /// until all have; the ranks that give the same `color` form a new group, ranked by `key`
    /// and then by their rank here, connected as a new group is. `None` joins no group and
    /// returns `None`. Megatron-LM's data- and pipeline-parallel groups are two splits of the
    /// world: with P stages of D replicas and rank `r = stage·D + replica`, the stage's
    /// data-parallel group is `split(Some(stage), replica)` and the replica's pipeline is
    /// `split(Some(replica), stage)`.
    ///
    /// ```
    /// use graphed::device::{Communicator, CommOptions, Device};
    /// let devices: Vec<Device> = (0..4).map(|_| Device::sim()).collect();
    /// let world = Communicator::sim_group(&devices, CommOptions::default())?;
    /// let groups: Vec<(usize, usize)> = std::thread::scope(|s| {
    ///     let ranks: Vec<_> = world.iter().map(|c| s.spawn(move || {
    ///         let evens_and_odds = c.split(Some(c.rank() as u32 % 2), c.rank())?.expect("a color");
    ///         Ok::<_, graphed::Error>((evens_and_odds.rank(), evens_and_odds.size()))
    ///     })).collect();
    ///     ranks.into_iter().map(|h| h.join().expect("rank thread")).collect::<graphed::Result<_>>()
    /// })?;
    /// assert_eq!(groups, [(0, 2), (0, 2), (1, 2), (1, 2)]);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`CommErrorKind::RankGone`] when a rank left before calling it, [`CommErrorKind::Deadlock`]
    /// (simulator) when the ranks that did not call it wait on those that did,
    /// [`CommErrorKind::Timeout`] when one does not call it within the options' timeout, NCCL's.
    /// A color or key above `i32::MAX` is refused first ([`CommErrorKind::Nccl`]: NCCL takes
    /// neither), and changes nothing; a failure of NCCL's split on GPUs aborts this
    /// communicator, since the other ranks wait in it.
    pub fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Communicator>> {
        self.split_watching(color, key, &|| None)
    }

    /// As [`split`](Communicator::split), also failing as soon as `watch` reports why the group
    /// cannot finish, with its answer (on GPUs; a simulated group learns of a rank gone itself).
    ///
    /// # Errors
    /// `watch`'s error, and as [`split`](Communicator::split).
    pub fn split_watching(
        &self,
        color: Option<u32>,
        key: usize,
        watch: &dyn Fn() -> Option<CommErrorKind>,
    ) -> Result<Option<Communicator>> {
        let fail = |kind| comm_error("Communicator::split", self.rank(), kind);
        // NCCL takes both as a C int; the simulator refuses what GPUs would, before any rank
        // waits in the split.
        let too_big = |what: &str| {
            fail(CommErrorKind::Nccl(format!("a split {what} above {}, which NCCL cannot take", i32::MAX)))
        };
        let nccl_color = color.map(i32::try_from).transpose().map_err(|_| too_big("color"))?;
        let nccl_key = i32::try_from(key).map_err(|_| too_big("key"))?;
        let (dev, options) = (&self.inner.dev, self.inner.options);
        match (&self.inner.repr, dev.backend()) {
            (Repr::Sim(link), super::backend::BackendImpl::Sim(sim)) => Ok(link
                .split(color, key, &|| sim.progress())
                .map_err(fail)?
                .map(|(link, rank, size)| Communicator::new(dev.clone(), rank, size, options, Repr::Sim(link)))),
            (Repr::Cuda(c), super::backend::BackendImpl::Cuda(b)) => {
                let patience = Patience::new(options.timeout, watch);
                let Some((comm, rank, size)) = b.nccl_split(c, nccl_color, nccl_key, &patience).map_err(fail)? else {
                    return Ok(None);
                };
                let comm = Communicator::new(dev.clone(), rank, size, options, Repr::Cuda(comm));
                comm.connect(watch)?;
                Ok(Some(comm))
            }
            (Repr::Cuda(_), super::backend::BackendImpl::Sim(_)) => {
                Err(fail(CommErrorKind::Nccl("an NCCL communicator on a simulated device".into())))
            }
            (Repr::Sim(_), super::backend::BackendImpl::Cuda(_)) => {
                Err(fail(CommErrorKind::Nccl("a simulated communicator on a GPU".into())))
            }
        }
    }

    /// Sums `buf` across ranks, in place, on `stream`.
    ///
    /// # Errors
    /// [`Error::Comm`] for an element type without a sum or a mismatch with another rank's
    /// operation; the usual errors of a stream operation (another device's buffer, a capture).
    pub fn all_reduce<'b, T: Elem>(&self, stream: &Stream, buf: impl IntoView<'b, Elem = T>) -> Result<()> {
        let buf = buf.into_view();
        self.reducible(Collective::AllReduce, T::DTYPE)?;
        let count = buf.len();
        self.enqueue(
            stream,
            &[Planned { kind: Collective::AllReduce, first: (&buf, AccessMode::ReadWrite), second: None, count }],
        )
    }

    /// Sums `src` (`size` slices of `dst`'s length) across ranks; rank `r` gets slice `r` in `dst`.
    ///
    /// # Errors
    /// As [`all_reduce`](Communicator::all_reduce), [`CommErrorKind::Length`] unless `src` is
    /// `size` times as long as `dst`, and [`CommErrorKind::Overlap`] when they overlap (NCCL's
    /// in-place layout included).
    pub fn reduce_scatter<'s, 'd, T: Elem>(
        &self,
        stream: &Stream,
        src: impl IntoView<'s, Elem = T>,
        dst: impl IntoView<'d, Elem = T>,
    ) -> Result<()> {
        let (src, dst) = (src.into_view(), dst.into_view());
        self.reducible(Collective::ReduceScatter, T::DTYPE)?;
        self.sized(Collective::ReduceScatter, src.len(), dst.len())?;
        let (kind, count) = (Collective::ReduceScatter, dst.len());
        self.enqueue(stream, &[Planned { kind, first: (&src, AccessMode::Read), second: Some(&dst), count }])
    }

    /// Every rank's `src`, concatenated in rank order, into `dst` (`size` times as long).
    ///
    /// # Errors
    /// [`CommErrorKind::Length`] unless `dst` is `size` times as long as `src`,
    /// [`CommErrorKind::Overlap`] when they overlap (NCCL's in-place layout included), and as
    /// [`all_reduce`](Communicator::all_reduce).
    pub fn all_gather<'s, 'd, T: Elem>(
        &self,
        stream: &Stream,
        src: impl IntoView<'s, Elem = T>,
        dst: impl IntoView<'d, Elem = T>,
    ) -> Result<()> {
        let (src, dst) = (src.into_view(), dst.into_view());
        self.sized(Collective::AllGather, dst.len(), src.len())?;
        let (kind, count) = (Collective::AllGather, src.len());
        self.enqueue(stream, &[Planned { kind, first: (&src, AccessMode::Read), second: Some(&dst), count }])
    }

    /// Sends `src` to rank `peer`, which receives it with [`recv`](Communicator::recv). The send
    /// completes only once the peer's receive has begun (as NCCL's do, beyond its small buffers),
    /// so two ranks that send to each other first deadlock; [`exchange`](Communicator::exchange)
    /// issues both directions as one group.
    ///
    /// # Errors
    /// [`CommErrorKind::BadPeer`] for a peer outside the group or this rank, and as
    /// [`all_reduce`](Communicator::all_reduce).
    pub fn send<'s, T: Elem>(&self, stream: &Stream, src: impl IntoView<'s, Elem = T>, peer: usize) -> Result<()> {
        self.exchange(stream, &[Transfer::send(src, peer)])
    }

    /// Receives into `dst` what rank `peer` sends with [`send`](Communicator::send).
    ///
    /// # Errors
    /// As [`send`](Communicator::send).
    pub fn recv<'d, T: Elem>(&self, stream: &Stream, dst: impl IntoView<'d, Elem = T>, peer: usize) -> Result<()> {
        self.exchange(stream, &[Transfer::recv(dst, peer)])
    }

    /// Sends and receives issued as one group (NCCL's `ncclGroupStart`/`ncclGroupEnd`): they
    /// progress together, so that a stage that sends its activation forward while it receives a
    /// gradient back meets its neighbour doing the opposite. Each transfer matches the peer's
    /// opposite one by order between the two ranks. Nothing is enqueued for no transfers.
    ///
    /// ```
    /// use graphed::device::{Communicator, CommOptions, Device, Transfer};
    /// let devices = [Device::sim(), Device::sim()];
    /// let comms = Communicator::sim_group(&devices, CommOptions::default())?;
    /// let received: Vec<Vec<f32>> = std::thread::scope(|s| {
    ///     let ranks: Vec<_> = comms.iter().map(|comm| s.spawn(move || -> graphed::Result<Vec<f32>> {
    ///         let (stream, peer) = (comm.device().stream()?, 1 - comm.rank());
    ///         let mine = comm.device().alloc_from(&stream, &[comm.rank() as f32; 2])?;
    ///         let theirs = comm.device().alloc::<f32>(2)?;
    ///         // Both ranks send first: as two plain sends this would deadlock.
    ///         comm.exchange(&stream, &[Transfer::send(&mine, peer), Transfer::recv(&theirs, peer)])?;
    ///         theirs.to_vec(&stream)
    ///     })).collect();
    ///     ranks.into_iter().map(|h| h.join().expect("rank thread")).collect::<graphed::Result<_>>()
    /// })?;
    /// assert_eq!(received, vec![vec![1.0; 2], vec![0.0; 2]]);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`send`](Communicator::send), for each transfer, and [`CommErrorKind::Overlap`] when a
    /// receive's buffer meets another transfer's; before anything is enqueued.
    pub fn exchange<T: Elem>(&self, stream: &Stream, transfers: &[Transfer<'_, T>]) -> Result<()> {
        let mut planned = Vec::with_capacity(transfers.len());
        for t in transfers {
            let (kind, view, mode, peer) = match t {
                Transfer::Send(v, peer) => (Collective::Send(*peer), v, AccessMode::Read, *peer),
                Transfer::Recv(v, peer) => (Collective::Recv(*peer), v, AccessMode::Write, *peer),
            };
            self.check_peer(kind.name(), peer)?;
            planned.push(Planned { kind, first: (view, mode), second: None, count: view.len() });
        }
        self.enqueue(stream, &planned)
    }

    /// Blocks until the work queued on `stream` has completed, or fails after the
    /// communicator's timeout (a peer that never arrives), instead of hanging: the watchdog of a
    /// training loop. On a GPU a wait that fails for the group (the timeout, NCCL's error)
    /// aborts the communicator, since its work cannot finish; make a new group to go on.
    ///
    /// # Errors
    /// [`CommErrorKind::Timeout`], an error NCCL reported, or the stream's own errors.
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        self.wait_watching(stream, &|| None)
    }

    /// As [`wait`](Communicator::wait), also failing as soon as `watch` reports why the group
    /// cannot finish (a process group's watch of its ranks' connections says which rank died);
    /// its answer comes before NCCL's own, less specific, error.
    ///
    /// # Errors
    /// `watch`'s error, and as [`wait`](Communicator::wait).
    pub fn wait_watching(&self, stream: &Stream, watch: &dyn Fn() -> Option<CommErrorKind>) -> Result<()> {
        match &self.inner.repr {
            Repr::Sim(_) => stream.synchronize(),
            Repr::Cuda(c) => {
                let fail = |kind| comm_error("Communicator::wait", self.rank(), kind);
                let waiting = || format!("the work queued on stream {}", stream.id());
                // An error of NCCL's ends the group; one of the stream's (a query refused during a
                // capture) is the caller's to handle. The watch aborts the group itself when a
                // rank dies, or this wait does when it fails: either way it fails at once, not after
                // NCCL's abort returns.
                let failed = |kind| {
                    self.abort();
                    fail(kind)
                };
                let abort = || self.abort();
                Patience::new(self.inner.options.timeout, watch).poll(&waiting, &abort, fail, || {
                    Ok(stream.query()? || c.async_error().map(|()| false).map_err(failed)?)
                })
            }
        }
    }

    fn reducible(&self, op: Collective, dtype: DType) -> Result<()> {
        match dtype {
            DType::F32 | DType::BF16 | DType::F16 => Ok(()),
            dtype => Err(comm_error(op.name(), self.rank(), CommErrorKind::DType { dtype })),
        }
    }

    fn sized(&self, op: Collective, long: usize, short: usize) -> Result<()> {
        if long != short * self.size() {
            let what =
                format!("{} takes a buffer of {} × the other's {short} elements, found {long}", op.name(), self.size());
            return Err(comm_error(op.name(), self.rank(), CommErrorKind::Length { what }));
        }
        Ok(())
    }

    /// Refuses a peer outside the group, or this rank, for `op`.
    pub(crate) fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank() {
            return Err(comm_error(op, self.rank(), CommErrorKind::BadPeer { peer, size: self.size() }));
        }
        Ok(())
    }

    /// Checks and enqueues one operation, or one group of them.
    fn enqueue<T: Elem>(&self, stream: &Stream, planned: &[Planned<'_, '_, T>]) -> Result<()> {
        let op = match planned {
            [] => return Ok(()),
            [one] => one.kind.name(),
            _ => "p2p_group",
        };
        self.inner.dev.check_same(op, "communicator", stream.device().id())?;
        for v in planned.iter().flat_map(|p| std::iter::once(p.first.0).chain(p.second)) {
            self.inner.dev.check_same(op, "buffer", v.block.raw.device)?;
            v.check_bounds(op)?;
            if !v.region.is_contiguous() {
                return Err(Error::NotContiguous { op, buffer: v.block.id });
            }
        }
        // Every buffer with whether it is written (a reduce-scatter's or gather's destination, a
        // receive, an all-reduce's in-place buffer alone); no written one may meet another.
        let touched: Vec<(super::Access, bool)> = (planned.iter())
            .flat_map(|p| {
                let first = (p.first.0.access(p.first.1), p.first.1 != AccessMode::Read);
                std::iter::once(first).chain(p.second.map(|d| (d.access(AccessMode::Write), true)))
            })
            .collect();
        for (i, (a, a_writes)) in touched.iter().enumerate() {
            if let Some(j) = (i + 1..touched.len()).find(|&j| (*a_writes || touched[j].1) && a.overlaps(&touched[j].0))
            {
                let what = format!("{op}: its buffers {i} and {j} overlap, and one of them is written");
                return Err(comm_error(op, self.rank(), CommErrorKind::Overlap { what }));
            }
        }
        let elem = T::DTYPE.size();
        fn at<'v, T: Elem>(v: &super::View<'v, T>, elem: usize) -> (&'v Arc<super::memory::Block>, usize) {
            (v.block, v.absolute().offset() * elem)
        }
        let parts: Vec<Part<'_>> = (planned.iter())
            .map(|p| Part {
                kind: p.kind,
                src: at(p.first.0, elem),
                dst: at(p.second.unwrap_or(p.first.0), elem),
                count: p.count,
            })
            .collect();
        stream.enqueue_op(&Op::Collective { comm: &self.inner.repr, parts: &parts, dtype: T::DTYPE })?;
        let (mut accesses, mut blocks) = (Vec::new(), Vec::new());
        for p in planned {
            let second = p.second.map(|v| (v, AccessMode::Write));
            for (v, mode) in std::iter::once(p.first).chain(second) {
                accesses.push(access_of(v.block, v.region, elem, mode, accesses.len()));
                blocks.push(v.block);
            }
        }
        stream.enqueued_on(op, &blocks, &accesses)
    }
}

/// One operation as checked before it is enqueued: `first` is the buffer it reads (or reads and
/// writes, or for a receive writes), `second` the one it writes when they differ.
struct Planned<'v, 'a, T: Elem> {
    kind: Collective,
    first: (&'v super::View<'a, T>, AccessMode),
    second: Option<&'v super::View<'a, T>>,
    count: usize,
}

/// One send or receive of a [`Communicator::exchange`].
pub enum Transfer<'a, T: Elem> {
    /// The view, to the peer rank.
    Send(super::View<'a, T>, usize),
    /// Into the view, from the peer rank.
    Recv(super::View<'a, T>, usize),
}

impl<'a, T: Elem> Transfer<'a, T> {
    /// Sends `src` to `peer`.
    pub fn send(src: impl IntoView<'a, Elem = T>, peer: usize) -> Transfer<'a, T> {
        Transfer::Send(src.into_view(), peer)
    }

    /// Receives into `dst` from `peer`.
    pub fn recv(dst: impl IntoView<'a, Elem = T>, peer: usize) -> Transfer<'a, T> {
        Transfer::Recv(dst.into_view(), peer)
    }
}

/// Runs `f(rank, item)` for every item on a thread of its own (ranks that block until all have
/// arrived), every rank's result in rank order; a rank whose thread panics gives
/// [`CommErrorKind::RankGone`] from `op`.
pub(crate) fn per_rank_thread<I: Send, T: Send>(
    op: &'static str,
    items: Vec<I>,
    f: impl Fn(usize, I) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> =
            items.into_iter().enumerate().map(|(rank, item)| s.spawn(move || f(rank, item))).collect();
        (handles.into_iter().enumerate())
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|p| {
                    Err(comm_error(op, rank, CommErrorKind::Panicked { rank, message: panic_message(p) }))
                })
            })
            .collect()
    })
}

/// The message of a panic's payload: what `panic!` was given, as `&str` or `String`.
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => p.downcast_ref::<&str>().map_or_else(|| "(a payload that is not a string)".into(), |s| s.to_string()),
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {})", self.inner.rank, self.inner.size)
    }
}

/// The identity of an NCCL group: made by one rank, sent to the others (128 opaque bytes).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub(crate) [u8; 128]);

impl NcclId {
    /// A new identity (NCCL's `ncclGetUniqueId`, which opens the listening socket of rank 0).
    ///
    /// # Errors
    /// [`Error::Comm`] with [`CommErrorKind::Nccl`] when NCCL is missing or fails.
    pub fn new() -> Result<NcclId> {
        cuda::nccl_unique_id().map(NcclId).map_err(|k| comm_error("NcclId::new", 0, k))
    }

    /// Its bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    /// The identity other ranks received as bytes.
    pub fn from_bytes(bytes: [u8; 128]) -> NcclId {
        NcclId(bytes)
    }
}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

/// The error of operation `op` on `rank`.
pub(crate) fn comm_error(op: &'static str, rank: usize, kind: CommErrorKind) -> Error {
    Error::Comm { op, rank, kind }
}
