//! How the commands join their process group: the group, the end of a process whose peer died
//! while its host waits on the GPU, and the group's view of what each rank measures.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use graphed::device::{CommOptions, Communicator, DType, Device, Stream};
use graphed::dist::{ProcessGroup, RankEnv};
use graphed::memory::CachingAllocator;
use graphed::tensor::Tensor;

/// How long a rank's own error path gets, after a peer died, before the process is ended for it.
const GRACE: Duration = Duration::from_secs(10);

/// Set once this process has left its group (a command joins one at most): its collectives are
/// done, so a peer's death no longer ends it.
static LEFT: AtomicBool = AtomicBool::new(false);

/// Joins the group of `env` (none for a single process) on `dev`, every rank building `model`,
/// with `options` (its timeout).
/// When a rank dies, this one's communicator is aborted and its next check or wait fails naming
/// the dead rank, and its error path ends the process; should it not have ended [`GRACE`] later
/// (its host blocked on work that waited for that rank), the process is ended then, with that
/// error and exit status 1, as `main`'s failures do ([`exit::now`](crate::cli::exit::now)), unless
/// it has left its group by then ([`leave`]): a death no longer concerns it.
pub fn join(
    dev: &Device,
    env: Option<RankEnv>,
    model: &str,
    options: CommOptions,
) -> anyhow::Result<Option<ProcessGroup>> {
    let Some(env) = env else { return Ok(None) };
    let rank = env.rank;
    // Given before NCCL's initialization, so that no wait of this process outlives a dead rank.
    let group = ProcessGroup::join_with_on_death(dev, env, model, options, move |dead| {
        std::thread::sleep(GRACE);
        if LEFT.load(Ordering::SeqCst) {
            return;
        }
        crate::cli::exit::now(anyhow::anyhow!(
            "rank {rank}: rank {dead}'s process ended without leaving the group, and this rank is still blocked on \
             work that waited for it {} s later; ending it",
            GRACE.as_secs()
        ));
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

/// Ranks that gather values: a process group, whose wait fails at once naming a rank that died
/// (a gather waiting on it would otherwise block until the group's timeout), or a bare
/// communicator.
pub trait Ranks {
    /// The communicator the values travel on.
    fn comm(&self) -> &Communicator;
    /// Blocks until `s`'s work is done, failing as the group's watchdog does.
    fn wait(&self, s: &Stream) -> graphed::Result<()>;
}

impl Ranks for ProcessGroup {
    fn comm(&self) -> &Communicator {
        ProcessGroup::comm(self)
    }
    fn wait(&self, s: &Stream) -> graphed::Result<()> {
        ProcessGroup::wait(self, s)
    }
}

impl Ranks for Communicator {
    fn comm(&self) -> &Communicator {
        self
    }
    fn wait(&self, s: &Stream) -> graphed::Result<()> {
        Communicator::wait(self, s)
    }
}

/// The sum over the ranks of `value`, each rank's own (every rank calls it at the same point,
/// as it would a collective); `value` itself without a group. The values travel as their bits
/// (an all-gather) and are summed here in rank order, so a group of one gives `value` back
/// exactly and every rank gets the same sum.
pub fn sum_over_ranks(
    ranks: Option<&impl Ranks>,
    alloc: &CachingAllocator,
    s: &Stream,
    value: f64,
) -> graphed::Result<f64> {
    let Some(ranks) = ranks else { return Ok(value) };
    Ok(gather(ranks, alloc, s, value.to_bits())?.iter().map(|&b| f64::from_bits(b)).sum())
}

/// Whether `flag` is set on any rank (every rank calls it at the same point): how a group learns
/// of one rank's interrupt at the same step on every rank.
pub fn any_rank(ranks: &impl Ranks, alloc: &CachingAllocator, s: &Stream, flag: bool) -> graphed::Result<bool> {
    Ok(gather(ranks, alloc, s, u64::from(flag))?.contains(&1))
}

/// Every rank's `value`, in rank order.
fn gather(ranks: &impl Ranks, alloc: &CachingAllocator, s: &Stream, value: u64) -> graphed::Result<Vec<u64>> {
    let comm = ranks.comm();
    let mine = Tensor::from_host(alloc, s, &[value], &[1])?;
    let all = Tensor::zeros(alloc, s, &[comm.size()], DType::U64)?;
    comm.all_gather(s, mine.view::<u64>()?, all.view::<u64>()?)?;
    // A rank that died ends the wait at once (a group's watch), one that never gathers after the
    // group's timeout.
    ranks.wait(s)?;
    all.to_vec::<u64>(s)
}

#[cfg(test)]
mod tests {
    use graphed::device::SimConfig;
    use graphed::dist::on_sim_ranks;

    use super::*;

    /// Rank r's value: not exact in binary, so that a rounding on the way would show.
    fn value(rank: usize) -> f64 {
        0.1 + 0.2 * rank as f64
    }

    #[test]
    fn every_rank_gets_the_sum_of_all_ranks_values_in_rank_order_and_one_rank_its_own() -> graphed::Result<()> {
        let sums = on_sim_ranks(3, SimConfig::default(), CommOptions::default(), |c| {
            let (s, alloc) = (c.device().stream()?, CachingAllocator::new(c.device()));
            sum_over_ranks(Some(c), &alloc, &s, value(c.rank()))
        });
        let want = value(0) + value(1) + value(2);
        for sum in sums {
            assert_eq!(sum?.to_bits(), want.to_bits());
        }
        let one = on_sim_ranks(1, SimConfig::default(), CommOptions::default(), |c| {
            let (s, alloc) = (c.device().stream()?, CachingAllocator::new(c.device()));
            sum_over_ranks(Some(c), &alloc, &s, value(0))
        });
        for sum in one {
            assert_eq!(sum?.to_bits(), value(0).to_bits());
        }
        let dev = Device::sim();
        let (s, alloc) = (dev.stream()?, CachingAllocator::new(&dev));
        assert_eq!(sum_over_ranks(None::<&Communicator>, &alloc, &s, value(1))?.to_bits(), value(1).to_bits());
        Ok(())
    }

    #[test]
    fn one_ranks_flag_reaches_every_rank() {
        let any = |set: usize| {
            on_sim_ranks(3, SimConfig::default(), CommOptions::default(), move |c| {
                let (s, alloc) = (c.device().stream()?, CachingAllocator::new(c.device()));
                any_rank(c, &alloc, &s, c.rank() == set)
            })
        };
        for flag in any(1) {
            assert_eq!(flag.ok(), Some(true));
        }
        for flag in any(usize::MAX) {
            assert_eq!(flag.ok(), Some(false));
        }
    }
}
