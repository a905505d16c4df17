//! Collectives between simulated devices: results, capture, and every way ranks can disagree,
//! each a typed error on every rank instead of a hang. The CUDA variants run the same results
//! and captures through NCCL on one GPU and on two.

use std::time::Duration;

use anyhow::{ensure, Context};
use graphed::device::{
    CaptureMode, CommErrorKind, CommOptions, Communicator, Device, Policy, SimConfig, Stalled, StalledLaunch, Transfer,
};
use graphed::Error;

#[path = "../common/mod.rs"]
mod common;
use common::Ranks;

/// Runs `f` on `n` simulated ranks, one thread each, under `policy`; every rank's result.
fn on_ranks<T: Send>(
    n: usize,
    policy: Policy,
    timeout: Duration,
    f: impl Fn(&Communicator) -> graphed::Result<T> + Sync,
) -> Vec<graphed::Result<T>> {
    graphed::dist::on_sim_ranks(n, SimConfig::with_policy(policy), CommOptions { timeout }, f)
}

fn all_ok<T>(results: Vec<graphed::Result<T>>) -> anyhow::Result<Vec<T>> {
    results.into_iter().enumerate().map(|(r, x)| x.with_context(|| format!("rank {r}"))).collect()
}

const LONG: Duration = Duration::from_secs(20);

fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 100 + i) as f32 * 0.25).collect()
}

#[test]
fn collectives_give_nccl_results_under_every_policy() -> anyhow::Result<()> {
    for policy in Policy::ALL {
        for n in [2, 3] {
            collectives_give_nccl_results(Ranks::Sim(policy), n)?;
        }
    }
    Ok(())
}

/// All-reduce, reduce-scatter, all-gather, the amaxes' max and a ring of sends on `n` ranks,
/// against sums and maxima taken on the host.
fn collectives_give_nccl_results(on: Ranks, n: usize) -> anyhow::Result<()> {
    let out = all_ok(on.run(n, CommOptions { timeout: LONG }, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let x = dev.alloc_from(&s, &values(c.rank(), 6))?;
        c.all_reduce(&s, &x)?;
        let full = dev.alloc_from(&s, &values(c.rank(), 6 * c.size()))?;
        let part = dev.alloc::<f32>(6)?;
        c.reduce_scatter(&s, &full, &part)?;
        let gathered = dev.alloc::<f32>(6 * c.size())?;
        c.all_gather(&s, &part, &gathered)?;
        // A ring of messages: each rank sends its rank to the next.
        let token = dev.alloc_from(&s, &[c.rank() as f32])?;
        let got = dev.alloc::<f32>(1)?;
        let (next, prev) = ((c.rank() + 1) % c.size(), (c.rank() + c.size() - 1) % c.size());
        if c.rank() % 2 == 0 {
            c.send(&s, &token, next)?;
            c.recv(&s, &got, prev)?;
        } else {
            c.recv(&s, &got, prev)?;
            c.send(&s, &token, next)?;
        }
        // FP8 amaxes: each rank's own largest in its own place, and a NaN (the amax kernels'
        // 0x7fffffff) on the last rank only, which must win.
        let inf = if c.rank() % 2 == 1 { f32::INFINITY } else { 0.0 };
        let mut amaxes = vec![0.5f32, 0.0, inf, 2.0];
        amaxes[c.rank() % 4] = 10.0 + c.rank() as f32;
        if c.rank() + 1 == c.size() {
            amaxes[3] = f32::from_bits(0x7fff_ffff);
        }
        let amaxes = dev.alloc_from(&s, &amaxes)?;
        c.all_reduce_amax(&s, &amaxes)?;
        let amaxes: Vec<u32> = amaxes.to_vec(&s)?.iter().map(|a| a.to_bits()).collect();
        Ok((x.to_vec(&s)?, part.to_vec(&s)?, gathered.to_vec(&s)?, got.to_vec(&s)?, amaxes))
    })?)?;
    let sum =
        |len: usize| -> Vec<f32> { (0..len).map(|i| (0..n).fold(0.0f32, |acc, r| acc + values(r, len)[i])).collect() };
    let full_sum = sum(6 * n);
    let amax = |i: usize| -> f32 {
        let own = (0..n).filter(|r| r % 4 == i).map(|r| 10.0 + r as f32).fold(0.0f32, f32::max);
        let inf = if i == 2 && n > 1 { f32::INFINITY } else { 0.0 };
        own.max([0.5, 0.0, 0.0, 2.0][i]).max(inf)
    };
    let amaxes: Vec<u32> = (0..3).map(|i| amax(i).to_bits()).chain([0x7fff_ffff]).collect();
    for (r, (reduced, part, gathered, got, maxed)) in out.iter().enumerate() {
        ensure!(*maxed == amaxes, "{on:?}, {n} ranks: all_reduce_amax on rank {r}: {maxed:x?}");
        ensure!(*reduced == sum(6), "{on:?}, {n} ranks: all_reduce on rank {r}");
        ensure!(*part == full_sum[r * 6..][..6], "{on:?}, {n} ranks: reduce_scatter on rank {r}");
        ensure!(*gathered == full_sum, "{on:?}, {n} ranks: all_gather on rank {r}");
        ensure!(*got == [((r + n - 1) % n) as f32], "{on:?}, {n} ranks: recv on rank {r}");
    }
    Ok(())
}

#[test]
fn a_captured_all_reduce_runs_again_at_every_launch() -> anyhow::Result<()> {
    for policy in Policy::ALL {
        a_captured_all_reduce_runs_at_every_launch(Ranks::Sim(policy))?;
    }
    Ok(())
}

fn a_captured_all_reduce_runs_at_every_launch(on: Ranks) -> anyhow::Result<()> {
    let out = all_ok(on.run(2, CommOptions { timeout: LONG }, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let x = dev.alloc_from(&s, &[1.0f32 + c.rank() as f32; 8])?;
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        c.all_reduce(&s, &x)?;
        let exec = cap.finish()?.instantiate()?;
        for _ in 0..3 {
            exec.launch(&s)?;
        }
        x.to_vec(&s)
    })?)?;
    // 1 + 2 = 3, then 6, then 12 on both ranks.
    ensure!(out.iter().all(|x| *x == [12.0; 8]), "{on:?}: {out:?}");
    Ok(())
}

#[test]
fn crossed_sends_deadlock_and_one_exchange_of_both_meets_even_captured() -> anyhow::Result<()> {
    // Both ranks send before they receive: NCCL's sends wait for their receives, so they hang.
    let crossed = on_ranks(2, Policy::InOrder, LONG, |c| {
        let (dev, s, peer) = (c.device(), c.device().stream()?, 1 - c.rank());
        let (mine, theirs) = (dev.alloc::<f32>(4)?, dev.alloc::<f32>(4)?);
        c.send(&s, &mine, peer)?;
        c.recv(&s, &theirs, peer)?;
        s.synchronize()
    });
    for (r, res) in crossed.iter().enumerate() {
        let Some(CommErrorKind::Deadlock { waits }) = kind_of(res) else { anyhow::bail!("rank {r}: {res:?}") };
        ensure!(waits.contains("waits in send #0 to rank"), "{waits}");
    }
    for policy in Policy::ALL {
        one_exchange_of_both_meets_eagerly_and_captured(Ranks::Sim(policy))?;
    }
    Ok(())
}

/// The crossed transfers as one group meet, eagerly and from a graph at every launch.
fn one_exchange_of_both_meets_eagerly_and_captured(on: Ranks) -> anyhow::Result<()> {
    let out = all_ok(on.run(2, CommOptions { timeout: LONG }, |c| {
        let (dev, s, peer) = (c.device(), c.device().stream()?, 1 - c.rank());
        let mine = dev.alloc_from(&s, &values(c.rank(), 5))?;
        let theirs = dev.alloc::<f32>(5)?;
        c.exchange(&s, &[Transfer::send(&mine, peer), Transfer::recv(&theirs, peer)])?;
        let eager = theirs.to_vec(&s)?;
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        c.exchange(&s, &[Transfer::recv(&theirs, peer), Transfer::send(&mine, peer)])?;
        let exec = cap.finish()?.instantiate()?;
        let next = dev.alloc_from(&s, &values(c.rank() + 2, 5))?;
        s.copy_d2d(&next, &mine)?;
        exec.launch(&s)?;
        Ok((eager, theirs.to_vec(&s)?))
    })?)?;
    for (r, (eager, launched)) in out.iter().enumerate() {
        ensure!(*eager == values(1 - r, 5), "{on:?}: rank {r} received {eager:?}");
        ensure!(*launched == values(1 - r + 2, 5), "{on:?}: rank {r} received {launched:?} from the graph");
    }
    Ok(())
}

fn kind_of<T>(r: &graphed::Result<T>) -> Option<&CommErrorKind> {
    match r {
        Err(Error::Comm { kind, .. }) => Some(kind),
        _ => None,
    }
}

#[test]
fn ranks_that_issue_different_collectives_get_a_mismatch_on_every_rank() -> anyhow::Result<()> {
    let out = on_ranks(2, Policy::Random, LONG, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let x = dev.alloc::<f32>(8 + c.rank())?;
        c.all_reduce(&s, &x)?;
        s.synchronize()
    });
    for (r, res) in out.iter().enumerate() {
        ensure!(matches!(kind_of(res), Some(CommErrorKind::Mismatch { seq: 0, .. })), "rank {r}: {res:?}");
    }
    Ok(())
}

#[test]
fn ranks_that_wait_on_each_other_get_a_deadlock_not_a_hang() -> anyhow::Result<()> {
    // Rank 0 reduces then sends; rank 1 receives before it reduces: neither can go on.
    let out = on_ranks(2, Policy::InOrder, LONG, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let (x, m) = (dev.alloc::<f32>(4)?, dev.alloc::<f32>(4)?);
        if c.rank() == 0 {
            c.all_reduce(&s, &x)?;
            c.send(&s, &m, 1)?;
        } else {
            c.recv(&s, &m, 0)?;
            c.all_reduce(&s, &x)?;
        }
        s.synchronize()
    });
    for (r, res) in out.iter().enumerate() {
        let Some(CommErrorKind::Deadlock { waits }) = kind_of(res) else { anyhow::bail!("rank {r}: {res:?}") };
        ensure!(waits.contains("rank 0 waits in all_reduce") || waits.contains("rank 1 waits in recv"), "{waits}");
    }
    Ok(())
}

/// The grid's order bug: each rank issues a world all-reduce and one of a split group in the
/// other rank's opposite order, so each waits in a different group on the other. Neither group
/// alone sees every rank waiting in it, but the cycle through both is a deadlock on both ranks,
/// under every policy, not the timeout; the same collectives in one order meet.
#[test]
fn a_deadlock_through_two_groups_is_seen_on_every_rank() -> anyhow::Result<()> {
    for policy in Policy::ALL {
        for crossed in [true, false] {
            let out = on_ranks(2, policy, LONG, |c| {
                let group = c.split(Some(0), c.rank())?.expect("a color gives a group");
                let (dev, s) = (c.device(), c.device().stream()?);
                let (x, y) = (dev.alloc_from(&s, &[1.0f32; 4])?, dev.alloc_from(&s, &[2.0f32; 4])?);
                match crossed && c.rank() == 1 {
                    true => group.all_reduce(&s, &y).and_then(|()| c.all_reduce(&s, &x))?,
                    false => c.all_reduce(&s, &x).and_then(|()| group.all_reduce(&s, &y))?,
                }
                s.synchronize()?;
                Ok((x.to_vec(&s)?[0], y.to_vec(&s)?[0]))
            });
            for (r, res) in out.iter().enumerate() {
                match (crossed, res) {
                    (true, _) => {
                        let Some(CommErrorKind::Deadlock { waits }) = kind_of(res) else {
                            anyhow::bail!("{policy:?}, rank {r}: {res:?}")
                        };
                        ensure!(waits.contains("in a group of 2, rank"), "{waits}");
                    }
                    (false, Ok(got)) => ensure!(*got == (2.0, 4.0), "{policy:?}, rank {r}: {got:?}"),
                    (false, Err(e)) => anyhow::bail!("{policy:?}, rank {r}, one order: {e}"),
                }
            }
        }
    }
    Ok(())
}

#[test]
fn a_rank_that_leaves_fails_the_others() -> anyhow::Result<()> {
    let out = on_ranks(2, Policy::Random, LONG, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        if c.rank() == 1 {
            // Fails before its collective, as a rank whose data is damaged would.
            return Err(Error::Unsupported { op: "test", backend: "sim", why: "rank 1 gives up" });
        }
        let x = dev.alloc::<f32>(4)?;
        c.all_reduce(&s, &x)?;
        s.synchronize()
    });
    ensure!(matches!(kind_of(&out[0]), Some(CommErrorKind::RankGone { rank: 1 })), "{:?}", out[0]);
    Ok(())
}

/// A rank that waits on collectives of two groups at once (the world and a split of it), whose
/// peer leaves: each collective is looked at in its own group, so the wait ends with the peer's
/// departure instead of spinning (a key of one group is not a key of the other).
#[test]
fn a_rank_waiting_in_two_groups_learns_that_its_peer_left() -> anyhow::Result<()> {
    let out = on_ranks(2, Policy::InOrder, LONG, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let group = c.split(Some(0), c.rank())?.expect("a color gives a group");
        let x = dev.alloc::<f32>(4)?;
        group.all_reduce(&s, &x)?;
        s.synchronize()?;
        if c.rank() == 1 {
            return Ok(());
        }
        // The world's collective #0 and the group's #1, on two streams, waited for together.
        let other = dev.stream()?;
        c.all_reduce(&s, &x)?;
        group.all_reduce(&other, &dev.alloc::<f32>(4)?)?;
        dev.synchronize()
    });
    ensure!(out[1].is_ok(), "rank 1: {:?}", out[1]);
    ensure!(matches!(kind_of(&out[0]), Some(CommErrorKind::RankGone { rank: 1 })), "{:?}", out[0]);
    Ok(())
}

#[test]
fn a_rank_that_never_arrives_times_out() -> anyhow::Result<()> {
    let timeout = Duration::from_millis(200);
    let out = on_ranks(2, Policy::Random, timeout, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let x = dev.alloc::<f32>(4)?;
        if c.rank() == 1 {
            // Busy on the host for longer than the timeout, then arrives.
            std::thread::sleep(timeout * 5);
        }
        c.all_reduce(&s, &x)?;
        s.synchronize()
    });
    ensure!(matches!(kind_of(&out[0]), Some(CommErrorKind::Timeout { .. })), "{:?}", out[0]);
    // The group is broken for rank 1 too: its late collective is refused with the same error.
    ensure!(matches!(kind_of(&out[1]), Some(CommErrorKind::Timeout { .. })), "{:?}", out[1]);
    Ok(())
}

/// How a rank takes part in [`a_rank_that_stalls_in_a_graph_is_reported`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stall {
    /// It never launches the second graph, and stays in the group until the other rank's
    /// wait failed.
    NeverLaunches,
    /// It fails before the second graph (its thread ends: its communicator goes).
    Dies,
}

/// Two graphs on each rank, `forward` (an all-reduce) and `fp8 step` (a graphed function: an
/// all-gather, then an amax all-reduce, as an FP8 optimizer step's), both captured on every
/// rank; rank 1 replays only `forward`, then stalls as `stall` says. Rank 0's wait for its
/// replay of both fails within the timeout naming the graph, the first collective that rank 1
/// never reached, and the ranks (on the simulator; NCCL says neither).
fn a_rank_that_stalls_in_a_graph_is_reported(on: Ranks, stall: Stall) -> anyhow::Result<()> {
    // On GPUs the timeout also bounds NCCL's making of the group, which takes seconds.
    let timeout = match on {
        Ranks::Sim(_) => Duration::from_millis(300),
        Ranks::Gpus => Duration::from_secs(10),
    };
    let rank_0_done = std::sync::Barrier::new(2);
    let out = on.run(2, CommOptions { timeout }, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let alloc = graphed::memory::CachingAllocator::new(dev);
        let x = dev.alloc_from(&s, &[1.0f32; 8])?;
        let (part, all) = (dev.alloc_from(&s, &[2.0f32; 4])?, dev.alloc::<f32>(8)?);
        let amaxes = dev.alloc_from(&s, &[0.5f32; 4])?;
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        c.all_reduce(&s, &x)?;
        let forward = cap.finish()?;
        forward.set_name("forward");
        let fp8_step = graphed::graph::make_graphed_fn(&alloc, |g| {
            c.all_gather(g, &part, &all)?;
            c.all_reduce_amax(g, &amaxes)
        })?
        .with_name("fp8 step");
        let held: Vec<String> = fp8_step.graph().collectives().iter().map(|x| x.to_string()).collect();
        let want = [
            format!("all_gather of 4 × f32 (collective 1 of 2 in the graph, rank {} of a group of 2)", c.rank()),
            format!("all_reduce_amax of 4 × f32 (collective 2 of 2 in the graph, rank {} of a group of 2)", c.rank()),
        ];
        assert_eq!(held, want, "what the capture recorded");
        forward.instantiate()?.launch(&s)?;
        c.wait(&s)?;
        if c.rank() == 1 {
            match stall {
                Stall::NeverLaunches => {
                    rank_0_done.wait();
                    return Ok(());
                }
                Stall::Dies => return Err(Error::Unsupported { op: "test", backend: "sim", why: "rank 1 dies" }),
            }
        }
        fp8_step.replay(&s)?;
        let waited = c.wait(&s);
        if stall == Stall::NeverLaunches {
            rank_0_done.wait();
        }
        waited
    })?;
    let Some(CommErrorKind::Stalled(stalled)) = kind_of(&out[0]) else {
        anyhow::bail!("{on:?}, {stall:?}: expected a stalled graph, got {:?}", out[0]);
    };
    let Stalled { graph, collective, arrived, missing, cause } = &**stalled;
    let want = StalledLaunch { graph: "fp8 step".into(), launch: 1 };
    ensure!(graph.as_ref() == Some(&want), "{on:?}: {graph:?}");
    let first = "all_gather of 4 × f32 (collective 1 of 2 in the graph, rank 0 of a group of 2)";
    match (on, stall) {
        (Ranks::Sim(_), _) => {
            ensure!(collective == first, "{on:?}: {collective}");
            ensure!(
                arrived.as_deref() == Some(&[0][..]) && missing.as_deref() == Some(&[1][..]),
                "{arrived:?} {missing:?}"
            );
        }
        // NCCL does not say which collective of the graph waits, nor who arrived.
        (Ranks::Gpus, _) => ensure!(collective.contains(first) && arrived.is_none(), "{collective}, {arrived:?}"),
    }
    match stall {
        Stall::NeverLaunches => ensure!(matches!(cause, CommErrorKind::Timeout { .. }), "{cause:?}"),
        Stall::Dies => ensure!(matches!(cause, CommErrorKind::RankGone { rank: 1 }), "{cause:?}"),
    }
    let message = out[0].as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(message.contains("graph `fp8 step` (launch 1 of it) did not complete"), "{message}");
    Ok(())
}

#[test]
fn a_rank_that_never_launches_a_graph_is_named_with_the_graph_its_collective_and_the_missing_rank() -> anyhow::Result<()>
{
    for policy in Policy::ALL {
        a_rank_that_stalls_in_a_graph_is_reported(Ranks::Sim(policy), Stall::NeverLaunches)?;
    }
    Ok(())
}

#[test]
fn a_rank_that_dies_before_a_graph_is_named_with_the_graph_its_collective_and_the_rank() -> anyhow::Result<()> {
    for policy in Policy::ALL {
        a_rank_that_stalls_in_a_graph_is_reported(Ranks::Sim(policy), Stall::Dies)?;
    }
    Ok(())
}

/// A wait that fails in a collective enqueued outside graphs names that collective, no graph,
/// and the ranks, even after a graph holding a collective of the group was launched.
#[test]
fn a_timeout_of_an_eager_collective_names_it_and_no_graph() -> anyhow::Result<()> {
    let timeout = Duration::from_millis(200);
    let rank_0_done = std::sync::Barrier::new(2);
    let out = on_ranks(2, Policy::Random, timeout, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let x = dev.alloc::<f32>(4)?;
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        c.all_reduce(&s, &x)?;
        let exec = cap.finish()?.instantiate()?;
        exec.launch(&s)?;
        c.wait(&s)?;
        if c.rank() == 1 {
            rank_0_done.wait();
            return Ok(());
        }
        c.all_reduce(&s, &x)?;
        let waited = c.wait(&s);
        rank_0_done.wait();
        waited
    });
    let Some(CommErrorKind::Stalled(stalled)) = kind_of(&out[0]) else {
        anyhow::bail!("expected the stalled collective, got {:?}", out[0]);
    };
    let Stalled { graph, collective, arrived, missing, cause } = &**stalled;
    ensure!(graph.is_none(), "{graph:?}");
    ensure!(collective == "all_reduce of 4 × f32 outside graphs (rank 0 of a group of 2)", "{collective}");
    ensure!(arrived.as_deref() == Some(&[0][..]) && missing.as_deref() == Some(&[1][..]), "{arrived:?} {missing:?}");
    ensure!(matches!(cause, CommErrorKind::Timeout { .. }), "{cause:?}");
    let message = out[0].as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(message.contains("a collective did not complete: all_reduce of 4 × f32 outside graphs"), "{message}");
    Ok(())
}

#[test]
fn splits_form_groups_by_color_ranked_by_key() -> anyhow::Result<()> {
    for n in [3, 4] {
        splits_give_groups_by_color_ranked_by_key(Ranks::Sim(Policy::Random), n)?;
    }
    Ok(())
}

/// The world of `n` split twice: every rank in one group keyed in reverse (so its ranks
/// reverse), then by parity with the last rank in none (from 3 ranks); each group all-reduces
/// its members' world ranks.
fn splits_give_groups_by_color_ranked_by_key(on: Ranks, n: usize) -> anyhow::Result<()> {
    let parity = |r: usize| (n < 3 || r != n - 1).then_some(r as u32 % 2);
    type Place = (usize, usize, f32);
    let out = all_ok(on.run(n, CommOptions { timeout: LONG }, |c| {
        let place = |g: &Communicator| -> graphed::Result<Place> {
            let s = g.device().stream()?;
            let x = g.device().alloc_from(&s, &[c.rank() as f32])?;
            g.all_reduce(&s, &x)?;
            Ok((g.rank(), g.size(), x.to_vec(&s)?[0]))
        };
        let reversed = c.split(Some(7), n - c.rank())?.expect("a color gives a group");
        let by_parity = c.split(parity(c.rank()), c.rank())?;
        Ok((place(&reversed)?, by_parity.as_ref().map(place).transpose()?))
    })?)?;
    let world_sum = (0..n).sum::<usize>() as f32;
    for (r, (reversed, by_parity)) in out.into_iter().enumerate() {
        ensure!(reversed == (n - 1 - r, n, world_sum), "rank {r} in the reversed world: {reversed:?}");
        let want = parity(r).map(|p| {
            let members: Vec<usize> = (0..n).filter(|&m| parity(m) == Some(p)).collect();
            (members.iter().filter(|&&m| m < r).count(), members.len(), members.iter().sum::<usize>() as f32)
        });
        ensure!(by_parity == want, "rank {r} by parity: {by_parity:?}, want {want:?}");
    }
    Ok(())
}

#[test]
fn a_split_fails_when_a_rank_leaves_never_calls_it_or_waits_on_another() -> anyhow::Result<()> {
    let timeout = Duration::from_millis(200);
    let out = on_ranks(3, Policy::Random, timeout, |c| match c.rank() {
        2 => Err(Error::Unsupported { op: "test", backend: "sim", why: "rank 2 gives up before splitting" }),
        _ => c.split(Some(0), 0).map(|_| ()),
    });
    for (r, res) in out.iter().take(2).enumerate() {
        ensure!(matches!(kind_of(res), Some(CommErrorKind::RankGone { rank: 2 })), "rank {r}: {res:?}");
    }
    let out = on_ranks(2, Policy::Random, timeout, |c| {
        if c.rank() == 1 {
            // Busy on the host for longer than the timeout, and never splits.
            std::thread::sleep(timeout * 5);
            return Ok(());
        }
        c.split(Some(0), 0).map(|_| ())
    });
    ensure!(matches!(kind_of(&out[0]), Some(CommErrorKind::Timeout { .. })), "{:?}", out[0]);
    // One rank splits while the other waits on a collective the first never issues: a deadlock
    // on both (not the timeout).
    let out = on_ranks(2, Policy::Random, LONG, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        match c.rank() {
            0 => c.split(Some(0), 0).map(|_| ()),
            _ => dev.alloc::<f32>(4).and_then(|x| c.all_reduce(&s, &x)).and_then(|()| s.synchronize()),
        }
    });
    for (r, res) in out.iter().enumerate() {
        ensure!(matches!(kind_of(res), Some(CommErrorKind::Deadlock { .. })), "rank {r}: {res:?}");
    }
    Ok(())
}

/// A GPU runs its queued collectives while its host waits in a split, so one rank may split
/// with collectives still queued that another rank synchronizes on before it splits; on the
/// simulator as on GPUs, under every policy (each collective after the first also waits on the
/// one before it in its stream).
#[test]
fn collectives_queued_before_a_split_complete_while_their_rank_waits_in_it() -> anyhow::Result<()> {
    for policy in Policy::ALL {
        let out = all_ok(on_ranks(2, policy, LONG, |c| {
            let (dev, s) = (c.device(), c.device().stream()?);
            let (a, b) = (dev.alloc_from(&s, &[c.rank() as f32 + 1.0])?, dev.alloc_from(&s, &[10.0f32])?);
            c.all_reduce(&s, &a)?;
            c.all_reduce(&s, &b)?;
            if c.rank() == 1 {
                s.synchronize()?;
            }
            let group = c.split(Some(0), c.rank())?.expect("a color gives a group");
            Ok((a.to_vec(&s)?[0], b.to_vec(&s)?[0], group.size()))
        }))
        .with_context(|| format!("{policy:?}"))?;
        ensure!(out.iter().all(|&got| got == (3.0, 20.0, 2)), "{policy:?}: {out:?}");
    }
    Ok(())
}

/// A rank whose host waits on one stream's collective while its arrival at another, earlier
/// collective sits on a stream it has not synchronized: a GPU runs that arrival anyway, so the
/// peer waiting on it goes on, and so does the simulator, under every policy (no false deadlock).
#[test]
fn a_collective_on_a_stream_not_waited_for_still_reaches_its_peers() -> anyhow::Result<()> {
    for policy in Policy::ALL {
        let out = all_ok(on_ranks(2, policy, LONG, |c| {
            let dev = c.device();
            let (a, b) = (dev.stream()?, dev.stream()?);
            let (x, y) = (dev.alloc_from(&a, &[1.0f32])?, dev.alloc_from(&b, &[2.0f32])?);
            a.synchronize()?;
            c.all_reduce(&a, &x)?;
            c.all_reduce(&b, &y)?;
            // Rank 0 waits for the second collective first, rank 1 for the first.
            match c.rank() {
                0 => b.synchronize().and_then(|()| a.synchronize())?,
                _ => a.synchronize().and_then(|()| b.synchronize())?,
            }
            Ok((x.to_vec(&a)?[0], y.to_vec(&b)?[0]))
        }))
        .with_context(|| format!("{policy:?}"))?;
        ensure!(out.iter().all(|&got| got == (2.0, 4.0)), "{policy:?}: {out:?}");
    }
    Ok(())
}

/// NCCL takes colors and keys as C ints: larger ones are refused on the simulator as on GPUs,
/// before the rank waits in the split, and the refused split is not one of the group's.
#[test]
fn a_split_color_or_key_nccl_cannot_take_is_refused_before_the_split() -> anyhow::Result<()> {
    let out = on_ranks(2, Policy::Random, LONG, |c| {
        let refused = match c.rank() {
            0 => c.split(Some(u32::MAX), 0),
            _ => c.split(Some(0), usize::MAX),
        };
        let refused = matches!(kind_of(&refused), Some(CommErrorKind::Nccl(why)) if why.contains("above"));
        let group = c.split(Some(0), c.rank())?.expect("a color gives a group");
        Ok((refused, group.size()))
    });
    for (r, res) in out.into_iter().enumerate() {
        ensure!(res? == (true, 2), "rank {r}");
    }
    Ok(())
}

#[test]
fn refusals_change_nothing() -> anyhow::Result<()> {
    let out = on_ranks(2, Policy::Random, LONG, |c| {
        let (dev, s) = (c.device(), c.device().stream()?);
        let (x, y) = (dev.alloc_from(&s, &[1.0f32; 4])?, dev.alloc::<f32>(3)?);
        let overlap = |r: graphed::Result<()>| matches!(kind_of(&r), Some(CommErrorKind::Overlap { .. }));
        let peer = 1 - c.rank();
        let refused = [
            c.send(&s, &x, c.rank()).is_err(),
            c.send(&s, &x, 7).is_err(),
            c.all_gather(&s, &x, &y).is_err(),
            c.all_reduce(&s, &dev.alloc::<u32>(4)?).is_err(),
            // Written buffers that meet another of the operation: undefined under NCCL.
            overlap(c.reduce_scatter(&s, &x, x.slice(1..3))),
            overlap(c.all_gather(&s, x.slice(0..2), &x)),
            overlap(c.exchange(&s, &[Transfer::send(x.slice(0..2), peer), Transfer::recv(x.slice(1..3), peer)])),
        ];
        // The group is not broken: the ranks still meet; sending one buffer twice reads it twice.
        let (a, b) = (dev.alloc::<f32>(4)?, dev.alloc::<f32>(4)?);
        let twice =
            [Transfer::send(&x, peer), Transfer::send(&x, peer), Transfer::recv(&a, peer), Transfer::recv(&b, peer)];
        c.exchange(&s, &twice)?;
        c.all_reduce(&s, &x)?;
        Ok((refused, x.to_vec(&s)?))
    });
    for res in all_ok(out)? {
        ensure!(res.0 == [true; 7] && res.1 == [2.0; 4], "{res:?}");
    }
    Ok(())
}

#[test]
fn the_checker_sees_a_read_of_a_reduced_buffer_on_another_stream() -> anyhow::Result<()> {
    let out = all_ok(on_ranks(2, Policy::InOrder, LONG, |c| {
        let (dev, s, other) = (c.device(), c.device().stream()?, c.device().stream()?);
        let (x, y) = (dev.alloc_from(&s, &[1.0f32; 4])?, dev.alloc::<f32>(4)?);
        c.all_reduce(&s, &x)?;
        other.copy_d2d(&x, &y)?;
        dev.synchronize()?;
        let hazards = graphed::check::Checker::of(dev).expect("checked").take_hazards();
        Ok(hazards.len())
    }))?;
    ensure!(out == [1, 1], "one unordered read per rank, got {out:?}");
    Ok(())
}

mod cuda {
    use super::*;

    /// One rank through NCCL: all-reduce is the identity, eagerly and captured.
    #[test]
    #[ignore = "needs a CUDA GPU and NCCL"]
    fn nccl_with_one_rank_reduces_eagerly_and_in_a_graph() -> anyhow::Result<()> {
        let dev = Device::cuda(0)?;
        let id = graphed::device::NcclId::new()?;
        let c = Communicator::nccl(&dev, 0, 1, &id, CommOptions::default())?;
        let s = dev.stream()?;
        let x = dev.alloc_from(&s, &[1.5f32; 1024])?;
        c.all_reduce(&s, &x)?;
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        c.all_reduce(&s, &x)?;
        let exec = cap.finish()?.instantiate()?;
        exec.launch(&s)?;
        c.wait(&s)?;
        ensure!(x.to_vec(&s)? == vec![1.5f32; 1024]);
        Ok(())
    }

    /// `ncclCommSplit` of a group of one: groups of one, and no group without a color.
    #[test]
    #[ignore = "needs a CUDA GPU and NCCL"]
    fn nccl_splits_a_group_of_one() -> anyhow::Result<()> {
        splits_give_groups_by_color_ranked_by_key(Ranks::Gpus, 1)?;
        let dev = Device::cuda(0)?;
        let c = Communicator::nccl(&dev, 0, 1, &graphed::device::NcclId::new()?, CommOptions::default())?;
        ensure!(c.split(None, 0)?.is_none(), "no color, no group");
        Ok(())
    }

    /// A rank whose peer never joins fails after the options' timeout instead of waiting in
    /// NCCL forever, and a new group on the same GPU still forms and reduces.
    #[test]
    #[ignore = "needs a CUDA GPU and NCCL"]
    fn a_rank_whose_peer_never_joins_times_out_and_a_new_group_still_forms() -> anyhow::Result<()> {
        let dev = Device::cuda(0)?;
        let options = CommOptions { timeout: Duration::from_secs(2) };
        match Communicator::nccl(&dev, 0, 2, &graphed::device::NcclId::new()?, options) {
            Err(Error::Comm { kind: CommErrorKind::Timeout { waiting, .. }, .. }) => {
                ensure!(waiting.contains("join"), "waited for {waiting}")
            }
            other => anyhow::bail!("expected a timeout, got {other:?}"),
        }
        let c = Communicator::nccl(&dev, 0, 1, &graphed::device::NcclId::new()?, CommOptions::default())?;
        let s = dev.stream()?;
        let x = dev.alloc_from(&s, &[2.5f32; 64])?;
        c.all_reduce(&s, &x)?;
        c.wait(&s)?;
        ensure!(x.to_vec(&s)? == vec![2.5f32; 64]);
        Ok(())
    }

    /// A watch that knows a rank died ends the wait for the group with its answer, long before
    /// the timeout.
    #[test]
    #[ignore = "needs a CUDA GPU and NCCL"]
    fn a_watch_ends_the_wait_for_a_group_with_its_answer() -> anyhow::Result<()> {
        let dev = Device::cuda(0)?;
        let id = graphed::device::NcclId::new()?;
        let watch = || Some(CommErrorKind::RankGone { rank: 1 });
        match Communicator::nccl_watching(&dev, 0, 2, &id, CommOptions::default(), &watch) {
            Err(Error::Comm { kind: CommErrorKind::RankGone { rank: 1 }, rank: 0, .. }) => Ok(()),
            other => anyhow::bail!("expected rank 1 gone, got {other:?}"),
        }
    }
}

/// Two GPUs of one process through NCCL give the simulator's results, eagerly and captured.
mod two_gpus {
    use super::*;

    #[test]
    #[ignore = "needs two CUDA GPUs and NCCL"]
    fn collectives_give_the_simulators_results() -> anyhow::Result<()> {
        collectives_give_nccl_results(Ranks::Gpus, 2)
    }

    #[test]
    #[ignore = "needs two CUDA GPUs and NCCL"]
    fn a_captured_all_reduce_runs_again_at_every_launch() -> anyhow::Result<()> {
        a_captured_all_reduce_runs_at_every_launch(Ranks::Gpus)
    }

    #[test]
    #[ignore = "needs two CUDA GPUs and NCCL"]
    fn one_exchange_of_crossed_transfers_meets_eagerly_and_captured() -> anyhow::Result<()> {
        one_exchange_of_both_meets_eagerly_and_captured(Ranks::Gpus)
    }

    #[test]
    #[ignore = "needs two CUDA GPUs and NCCL"]
    fn splits_give_the_simulators_groups() -> anyhow::Result<()> {
        splits_give_groups_by_color_ranked_by_key(Ranks::Gpus, 2)
    }

    /// A rank that never launches a graph holding collectives: the other's wait fails after
    /// the timeout naming the graph and its collectives instead of hanging.
    #[test]
    #[ignore = "needs two CUDA GPUs and NCCL"]
    fn a_rank_that_never_launches_a_graph_is_named_with_the_graph() -> anyhow::Result<()> {
        a_rank_that_stalls_in_a_graph_is_reported(Ranks::Gpus, Stall::NeverLaunches)
    }

    /// A split that one rank never joins ends, on the rank that waits in it, with the watch's
    /// answer (NCCL's split alone would wait forever), and aborts the group.
    #[test]
    #[ignore = "needs two CUDA GPUs and NCCL"]
    fn a_split_that_a_rank_never_joins_ends_with_the_watchs_answer() -> anyhow::Result<()> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let gpus = [Device::cuda(0)?, Device::cuda(1)?];
        let comms = Communicator::nccl_group(&gpus, CommOptions::default())?;
        let gone = AtomicBool::new(false);
        let watch = || gone.load(Ordering::SeqCst).then_some(CommErrorKind::RankGone { rank: 1 });
        let split = std::thread::scope(|s| {
            let waiting = s.spawn(|| comms[0].split_watching(Some(0), 0, &watch));
            // Rank 1 leaves instead of splitting.
            gone.store(true, Ordering::SeqCst);
            waiting.join().expect("rank 0's thread")
        });
        match split {
            Err(Error::Comm { kind: CommErrorKind::RankGone { rank: 1 }, rank: 0, .. }) => {}
            other => anyhow::bail!("expected rank 1 gone, got {other:?}"),
        }
        let s = comms[0].device().stream()?;
        let x = comms[0].device().alloc_from(&s, &[1.0f32; 4])?;
        ensure!(comms[0].all_reduce(&s, &x).is_err(), "the group was aborted");
        Ok(())
    }
}
