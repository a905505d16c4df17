//! How the commands join their process group: the group, and the end of a process whose peer
//! died while its host waits on the GPU.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use graphed::device::{CommOptions, Device};
use graphed::dist::{ProcessGroup, RankEnv};

/// How long a rank's own error path gets, after a peer died, before the process is ended for it.
const GRACE: Duration = Duration::from_secs(10);

/// Set once this process has left its group (a command joins one at most): its collectives are
/// done, so a peer's death no longer ends it.
static LEFT: AtomicBool = AtomicBool::new(false);

/// Joins the group of `env` (none for a single process) on `dev`, every rank building `model`.
/// When a rank dies, this one's communicator is aborted and its next check or wait fails naming
/// the dead rank, and its error path ends the process; should it not have ended [`GRACE`] later
/// (its host blocked on work that waited for that rank), the process is ended then, with that
/// error and exit status 2, as `main`'s errors do, unless it has left its group by then ([`leave`]):
/// a death no longer concerns it.
pub fn join(dev: &Device, env: Option<RankEnv>, model: &str) -> anyhow::Result<Option<ProcessGroup>> {
    let Some(env) = env else { return Ok(None) };
    let rank = env.rank;
    // Given before NCCL's initialization, so that no wait of this process outlives a dead rank.
    let group = ProcessGroup::join_with_on_death(dev, env, model, CommOptions::default(), move |dead| {
        std::thread::sleep(GRACE);
        if LEFT.load(Ordering::SeqCst) {
            return;
        }
        eprintln!(
            "graphed: rank {rank}: rank {dead}'s process ended without leaving the group, and this rank is still \
             blocked on work that waited for it {} s later; ending it",
            GRACE.as_secs()
        );
        std::process::exit(2);
    })?;
    Ok(Some(group))
}

/// Leaves `group` (if any) once this rank's collectives are done ([`ProcessGroup::leave`]): the
/// others are told goodbye, and a peer's death no longer ends this process.
pub fn leave(group: Option<ProcessGroup>) {
    LEFT.store(true, Ordering::SeqCst);
    if let Some(g) = group {
        g.leave();
    }
}
