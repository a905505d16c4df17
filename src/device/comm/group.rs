//! Making groups: one communicator per simulated device or per GPU of this process, a rank of an
//! NCCL group joined through its identity, and splits of a group.

use super::{comm_error, CommErrorKind, CommOptions, Communicator, Patience};
use crate::device::backend::{BackendImpl, Repr};
use crate::device::{cuda, sim, Device};
use crate::{Error, Result};

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
                BackendImpl::Cuda(_) => {
                    Some(("cuda", "a simulated group takes simulator devices; on GPUs use Communicator::nccl"))
                }
                BackendImpl::Sim(_) if devices[..i].iter().any(|e| e.id() == d.id()) => {
                    Some(("sim", "a device appears twice; give each rank its own"))
                }
                BackendImpl::Sim(_) => None,
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
        let BackendImpl::Cuda(b) = dev.backend() else {
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
            BackendImpl::Cuda(b) => Some(b.ordinal()),
            BackendImpl::Sim(_) => None,
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
            (Repr::Sim(link), BackendImpl::Sim(sim)) => Ok(link
                .split(color, key, &|| sim.progress())
                .map_err(fail)?
                .map(|(link, rank, size)| Communicator::new(dev.clone(), rank, size, options, Repr::Sim(link)))),
            (Repr::Cuda(c), BackendImpl::Cuda(b)) => {
                let patience = Patience::new(options.timeout, watch);
                let Some((comm, rank, size)) = b.nccl_split(c, nccl_color, nccl_key, &patience).map_err(fail)? else {
                    return Ok(None);
                };
                let comm = Communicator::new(dev.clone(), rank, size, options, Repr::Cuda(comm));
                comm.connect(watch)?;
                Ok(Some(comm))
            }
            (Repr::Cuda(_), BackendImpl::Sim(_)) => {
                Err(fail(CommErrorKind::Nccl("an NCCL communicator on a simulated device".into())))
            }
            (Repr::Sim(_), BackendImpl::Cuda(_)) => {
                Err(fail(CommErrorKind::Nccl("a simulated communicator on a GPU".into())))
            }
        }
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
