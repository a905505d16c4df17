//! Process groups: where a rank finds itself (the launcher's variables) and its communicator.

use std::sync::Arc;

use super::{rendezvous, Grid, RankWatch};
use crate::device::{CommErrorKind, CommOptions, Communicator, Device, DeviceKind, Event, NcclId, SimConfig, Stream};
use crate::{Error, Result};

/// Where this process sits in its group, as torchrun and `graphed launch` say it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// This process's rank (`RANK`).
    pub rank: usize,
    /// How many ranks (`WORLD_SIZE`).
    pub world: usize,
    /// The GPU of this host it uses (`LOCAL_RANK`).
    pub local_rank: usize,
    /// Rank 0's host (`MASTER_ADDR`).
    pub master_addr: String,
    /// Rank 0's rendezvous port (`MASTER_PORT`).
    pub master_port: u16,
}

impl RankEnv {
    /// Reads the launcher's variables; `None` when `WORLD_SIZE` is unset (a single process).
    ///
    /// # Errors
    /// [`CommErrorKind::Env`] naming the variable that is missing or malformed.
    pub fn from_env() -> Result<Option<RankEnv>> {
        RankEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`from_env`](RankEnv::from_env), from any source of variables.
    ///
    /// # Errors
    /// As [`from_env`](RankEnv::from_env).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>> {
        if var("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let number = |name: &'static str, default: Option<usize>| -> Result<usize> {
            match (var(name), default) {
                (None, Some(d)) => Ok(d),
                (None, None) => Err(env_error(name, "is not set".into())),
                (Some(v), _) => v.trim().parse().map_err(|_| env_error(name, format!("`{v}` is not a number"))),
            }
        };
        let world = number("WORLD_SIZE", None)?;
        let rank = number("RANK", None)?;
        let local_rank = number("LOCAL_RANK", Some(rank))?;
        if world == 0 || rank >= world {
            return Err(env_error("RANK", format!("{rank} is not a rank of a group of {world}")));
        }
        let master_addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = number("MASTER_PORT", Some(29500))?;
        let master_port = u16::try_from(port).map_err(|_| env_error("MASTER_PORT", format!("{port} is not a port")))?;
        Ok(Some(RankEnv { rank, world, local_rank, master_addr, master_port }))
    }

    /// Refuses a group of other than `world` ranks, before any rank opens its GPU or meets the
    /// others; `why` says what needs that many (a program written for a fixed layout).
    ///
    /// ```
    /// # use graphed::dist::RankEnv;
    /// let env = RankEnv { rank: 0, world: 3, local_rank: 0, master_addr: "127.0.0.1".into(), master_port: 29500 };
    /// let e = env.require_world(2, "the model is split into two stages").unwrap_err();
    /// assert!(e.to_string().contains("3 ranks; the model is split into two stages: start 2"));
    /// ```
    ///
    /// # Errors
    /// [`CommErrorKind::Env`] naming `WORLD_SIZE`.
    pub fn require_world(&self, world: usize, why: &str) -> Result<()> {
        if self.world == world {
            return Ok(());
        }
        let why = format!("{} ranks; {why}: start {world}", self.world);
        Err(Error::Comm {
            op: "RankEnv::require_world",
            rank: self.rank,
            kind: CommErrorKind::Env { var: "WORLD_SIZE", why },
        })
    }

    /// This rank's GPU: GPU `LOCAL_RANK` of this host (the device [`ProcessGroup::join`] takes).
    ///
    /// # Errors
    /// The GPU's, when it cannot be opened.
    pub fn gpu(&self) -> Result<Device> {
        Device::cuda(self.local_rank)
    }
}

fn env_error(var: &'static str, why: String) -> Error {
    Error::Comm { op: "RankEnv::from_env", rank: 0, kind: CommErrorKind::Env { var, why } }
}

/// A rank of a group of processes, one GPU each, joined by NCCL, and watching the others: a
/// rank whose process dies, or that drops its group without [`leave`](ProcessGroup::leave), is
/// named to the others (see [`ProcessGroup::wait`]). On the simulator, a rank of simulated
/// devices, threads of one process ([`ProcessGroup::simulated`]).
#[derive(Debug, Clone)]
pub struct ProcessGroup {
    env: RankEnv,
    comm: Communicator,
    watch: Arc<RankWatch>,
}

impl ProcessGroup {
    /// Meets the other ranks at `MASTER_ADDR:MASTER_PORT` (rank 0 listens), checks that every
    /// rank builds the same `model` (any description of what it trains: its configuration and
    /// parameter count), and joins the NCCL group on `dev` (GPU `LOCAL_RANK` of this host:
    /// [`RankEnv::gpu`]).
    ///
    /// # Errors
    /// [`CommErrorKind::Rendezvous`] when a rank does not arrive within the options' timeout,
    /// [`CommErrorKind::ModelMismatch`] on every rank when one builds another model than rank 0,
    /// [`CommErrorKind::RankGone`] when a rank dies before NCCL's group is made,
    /// [`CommErrorKind::Timeout`] when one does not join it within the timeout, and NCCL's or
    /// the GPU's errors.
    pub fn join(dev: &Device, env: RankEnv, model: &str, options: CommOptions) -> Result<ProcessGroup> {
        ProcessGroup::join_inner(dev, env, model, options, None)
    }

    /// As [`join`](ProcessGroup::join), with `on_death` given to the group's watch (see
    /// [`RankWatch::on_death`]) before NCCL's initialization: a program that ends itself when a
    /// rank dies does so from the start.
    ///
    /// # Errors
    /// As [`join`](ProcessGroup::join).
    pub fn join_with_on_death(
        dev: &Device,
        env: RankEnv,
        model: &str,
        options: CommOptions,
        on_death: impl Fn(usize) + Send + Sync + 'static,
    ) -> Result<ProcessGroup> {
        ProcessGroup::join_inner(dev, env, model, options, Some(Box::new(on_death)))
    }

    fn join_inner(
        dev: &Device,
        env: RankEnv,
        model: &str,
        options: CommOptions,
        on_death: Option<Box<dyn Fn(usize) + Send + Sync>>,
    ) -> Result<ProcessGroup> {
        let id = match env.rank {
            0 => Some(NcclId::new()?),
            _ => None,
        };
        let (shared, watch) = rendezvous::meet(&env, model, id.map(|i| i.as_bytes().to_vec()), options.timeout)?;
        if let Some(handler) = on_death {
            watch.on_death(handler);
        }
        let bytes: [u8; 128] = shared.try_into().map_err(|_| {
            let kind = CommErrorKind::Rendezvous("rank 0 sent an NCCL id of the wrong length".into());
            Error::Comm { op: "ProcessGroup::join", rank: env.rank, kind }
        })?;
        let id = NcclId::from_bytes(bytes);
        let comm = Communicator::nccl_watching(dev, env.rank, env.world, &id, options, &|| watch.error())?;
        watch.abort_on_death(&comm);
        Ok(ProcessGroup { env, comm, watch: Arc::new(watch) })
    }

    /// Rank `comm.rank()` of a group of simulated devices (a communicator of
    /// [`Communicator::sim_group`], whose ranks are threads of this process), as a process group:
    /// so that a program written for processes runs its ranks on the simulator with nothing
    /// else changed (`graphed launch -- train --device sim`). Its place says rank and world,
    /// `local_rank` is the rank (its simulated device), and there is no rendezvous
    /// (`master_addr` is empty, `master_port` 0). A rank that leaves is seen by the simulator's
    /// collectives themselves: the others' waits on it fail with [`CommErrorKind::RankGone`]
    /// naming it, so [`check`](ProcessGroup::check) has nothing more to say.
    ///
    /// ```
    /// use graphed::device::{CommOptions, SimConfig};
    /// use graphed::dist::{on_sim_ranks, ProcessGroup};
    /// let places = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |comm| {
    ///     let group = ProcessGroup::simulated(comm.clone())?;
    ///     group.check()?;
    ///     Ok((group.env().rank, group.env().world))
    /// });
    /// assert_eq!(places.into_iter().collect::<graphed::Result<Vec<_>>>()?, [(0, 2), (1, 2)]);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a communicator of GPUs (join those with
    /// [`join`](ProcessGroup::join)).
    pub fn simulated(comm: Communicator) -> Result<ProcessGroup> {
        if comm.device().kind() != DeviceKind::Sim {
            return Err(Error::Unsupported {
                op: "ProcessGroup::simulated",
                backend: "cuda",
                why: "a simulated group takes a communicator of Communicator::sim_group; a rank of GPUs joins with ProcessGroup::join",
            });
        }
        let (rank, world) = (comm.rank(), comm.size());
        let env = RankEnv { rank, world, local_rank: rank, master_addr: String::new(), master_port: 0 };
        // Nothing to watch: no other process holds a rank.
        let watch = RankWatch::start(rank, Vec::new())?;
        Ok(ProcessGroup { env, comm, watch: Arc::new(watch) })
    }

    /// Fails when another rank's process died: a training loop calls it before each step, so
    /// that it enqueues nothing for a group that cannot finish.
    ///
    /// # Errors
    /// [`CommErrorKind::RankGone`] naming the dead rank.
    pub fn check(&self) -> Result<()> {
        match self.watch.error() {
            Some(kind) => Err(Error::Comm { op: "ProcessGroup::check", rank: self.env.rank, kind }),
            None => Ok(()),
        }
    }

    /// Blocks until the work queued on `stream` has completed: the watchdog of a training loop.
    /// Fails at once when another rank's process died (naming it; the communicator was aborted
    /// when the death was seen), and after the communicator's timeout when a rank is stuck,
    /// instead of hanging.
    ///
    /// # Errors
    /// [`CommErrorKind::RankGone`] naming the dead rank, as [`Communicator::wait`] otherwise;
    /// either as [`CommErrorKind::Stalled`] when a collective (in a graph's launch or not) was
    /// waiting on the rank.
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        self.comm.wait_watching(stream, &|| self.watch.error())
    }

    /// As [`wait`](ProcessGroup::wait), for the work before `event`'s latest record: the
    /// watchdog of a wait for an earlier step's copy, which that step's collectives hold up.
    ///
    /// # Errors
    /// As [`wait`](ProcessGroup::wait).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.comm.wait_event_watching(event, &|| self.watch.error())
    }

    /// What this rank knows of the others' processes.
    pub fn watch(&self) -> &RankWatch {
        &self.watch
    }

    /// Where this rank sits.
    pub fn env(&self) -> &RankEnv {
        &self.env
    }

    /// Its communicator (and, through it, its device).
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// Leaves the group on purpose, once this rank's collectives are done: the others are told
    /// goodbye. A group dropped without leaving (an error on this rank) is a death to the
    /// others, whose waits then fail naming this rank instead of waiting on it.
    pub fn leave(self) {
        self.watch.leave_shared();
    }

    /// [`Communicator::split`] of the group's communicator, watched as it is: a rank's process
    /// that dies ends the split with [`CommErrorKind::RankGone`], and aborts the new
    /// communicator later. Every rank calls it.
    ///
    /// # Errors
    /// As [`Communicator::split_watching`].
    pub fn split(&self, color: Option<u32>, key: usize) -> Result<Option<Communicator>> {
        let split = self.comm.split_watching(color, key, &|| self.watch.error())?;
        if let Some(c) = &split {
            self.watch.abort_on_death(c);
        }
        Ok(split)
    }

    /// The grid of `stages` pipeline stages × `world / stages` data-parallel replicas, split from
    /// this group ([`Grid::split`] through [`split`](ProcessGroup::split), so that a rank's death
    /// aborts both groups too). Every rank calls it.
    ///
    /// # Errors
    /// As [`Grid::split`].
    pub fn grid(&self, stages: usize) -> Result<Grid> {
        Grid::split(&self.comm, stages, &|color, key| self.split(color, key))
    }
}

/// Runs `f` on every communicator of a group, one thread each; every rank's result, in rank
/// order. A rank whose thread panics gives [`CommErrorKind::Panicked`] with the panic's message
/// (the other ranks, if they waited on it, [`CommErrorKind::RankGone`]).
///
/// Several GPUs of one process, each rank checked (see [`Device::cuda_checked`]):
///
/// ```no_run
/// use graphed::device::{CommOptions, Communicator, Device};
/// let gpus = [Device::cuda_checked(0)?, Device::cuda_checked(1)?];
/// let comms = Communicator::nccl_group(&gpus, CommOptions::default())?;
/// let sums = graphed::dist::on_ranks(comms, |comm| {
///     let s = comm.device().stream()?;
///     let x = comm.device().alloc_from(&s, &[comm.rank() as f32; 2])?;
///     comm.all_reduce(&s, &x)?;
///     x.to_vec(&s)
/// });
/// # Ok::<(), graphed::Error>(())
/// ```
pub fn on_ranks<T: Send>(comms: Vec<Communicator>, f: impl Fn(&Communicator) -> Result<T> + Sync) -> Vec<Result<T>> {
    crate::device::per_rank_thread("on_ranks", comms, |_, c| f(&c))
}

/// Runs `f` on `ranks` simulated devices as one group ([`on_ranks`] over
/// [`Communicator::sim_group`]): the simulator's counterpart of `graphed launch`. Rank `r`'s
/// device is the simulator with `config`'s policy and seed `config.seed + r`.
///
/// ```
/// use graphed::device::{CommOptions, SimConfig};
/// let sums = graphed::dist::on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |comm| {
///     let s = comm.device().stream()?;
///     let x = comm.device().alloc_from(&s, &[comm.rank() as f32; 2])?;
///     comm.all_reduce(&s, &x)?;
///     x.to_vec(&s)
/// });
/// assert_eq!(sums.into_iter().collect::<graphed::Result<Vec<_>>>()?, vec![vec![1.0; 2]; 2]);
/// # Ok::<(), graphed::Error>(())
/// ```
pub fn on_sim_ranks<T: Send>(
    ranks: usize,
    config: SimConfig,
    options: CommOptions,
    f: impl Fn(&Communicator) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let devices: Vec<Device> =
        (0..ranks).map(|r| Device::sim_with(SimConfig { seed: config.seed + r as u64, ..config })).collect();
    match Communicator::sim_group(&devices, options) {
        Ok(comms) => on_ranks(comms, f),
        Err(e) => vec![Err(e)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's panic reaches the caller with its message, whether `panic!` got a literal (a
    /// `&str` payload) or a format (a `String`); the other rank's result is its own.
    #[test]
    fn a_ranks_panic_keeps_its_message() {
        let out = on_sim_ranks(3, SimConfig::default(), CommOptions::default(), |c| match c.rank() {
            1 => panic!("rank one ran out of data"),
            2 => panic!("rank {} ran out of data", c.rank()),
            r => Ok(r),
        });
        let message = |r: &Result<usize>| match r {
            Err(Error::Comm { kind: CommErrorKind::Panicked { message, .. }, .. }) => Some(message.clone()),
            _ => None,
        };
        assert!(matches!(out[0], Ok(0)), "{:?}", out[0]);
        assert_eq!(message(&out[1]).as_deref(), Some("rank one ran out of data"));
        assert_eq!(message(&out[2]).as_deref(), Some("rank 2 ran out of data"));
    }
}
