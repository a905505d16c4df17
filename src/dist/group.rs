//! Process groups: where a rank finds itself (the launcher's variables) and its communicator.

use super::rendezvous;
use crate::device::{CommErrorKind, CommOptions, Communicator, Device, NcclId, SimConfig};
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
}

fn env_error(var: &'static str, why: String) -> Error {
    Error::Comm { op: "RankEnv::from_env", rank: 0, kind: CommErrorKind::Env { var, why } }
}

/// A rank of a group of processes, one GPU each, joined by NCCL.
#[derive(Debug, Clone)]
pub struct ProcessGroup {
    env: RankEnv,
    comm: Communicator,
}

impl ProcessGroup {
    /// Meets the other ranks at `MASTER_ADDR:MASTER_PORT` (rank 0 listens), checks that every
    /// rank builds the same `model` (any description of what it trains: its configuration and
    /// parameter count), and joins the NCCL group on `dev` (GPU `LOCAL_RANK` of this host, made
    /// with `Device::cuda(env.local_rank)`).
    ///
    /// # Errors
    /// [`CommErrorKind::Rendezvous`] when a rank does not arrive within the options' timeout,
    /// [`CommErrorKind::ModelMismatch`] on every rank when one builds another model, and NCCL's
    /// or the GPU's errors.
    pub fn join(dev: &Device, env: RankEnv, model: &str, options: CommOptions) -> Result<ProcessGroup> {
        let id = match env.rank {
            0 => Some(NcclId::new()?),
            _ => None,
        };
        let shared = rendezvous::meet(&env, model, id.map(|i| i.as_bytes().to_vec()), options.timeout)?;
        let bytes: [u8; 128] = shared.try_into().map_err(|_| {
            let kind = CommErrorKind::Rendezvous("rank 0 sent an NCCL id of the wrong length".into());
            Error::Comm { op: "ProcessGroup::join", rank: env.rank, kind }
        })?;
        let comm = Communicator::nccl(dev, env.rank, env.world, &NcclId::from_bytes(bytes), options)?;
        Ok(ProcessGroup { env, comm })
    }

    /// Where this rank sits.
    pub fn env(&self) -> &RankEnv {
        &self.env
    }

    /// Its communicator (and, through it, its device).
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }
}

/// Runs `f` on `ranks` simulated devices, one thread each, as one group; every rank's result, in
/// rank order. The simulator's counterpart of `graphed launch`: rank `r`'s device is the
/// simulator with `config`'s policy and seed `config.seed + r`.
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
    let comms = match Communicator::sim_group(&devices, options) {
        Ok(c) => c,
        Err(e) => return vec![Err(e)],
    };
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(&c))).collect();
        (handles.into_iter().enumerate())
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Comm { op: "on_sim_ranks", rank, kind: CommErrorKind::RankGone { rank } })
                })
            })
            .collect()
    })
}
