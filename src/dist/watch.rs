//! The watch a process group keeps on its ranks. The rendezvous's connections stay open for the
//! life of the group, so that when a rank's process dies (its connection closes without a
//! goodbye) the others know which one within milliseconds, instead of seeing a collective that
//! never ends. Rank 0 holds a connection to every rank and tells the others which one died; they
//! hold rank 0's. A host that crashes or leaves the network closes nothing: its ranks are seen
//! by the group's timeout instead ([`ProcessGroup::wait`](super::ProcessGroup::wait)). After the
//! rendezvous, each side writes at most these lines:
//!
//! ```text
//! bye\n         this rank leaves on purpose (`leave`; a drop without it says nothing)
//! gone <r>\n    rank 0 to the others: rank r died
//! ```

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::device::{CommErrorKind, Communicator};
use crate::{Error, Result};

/// One open connection of the rendezvous: the peer's rank, what it sends, and how to write to it.
pub(super) struct Connection {
    pub(super) peer: usize,
    pub(super) reader: BufReader<TcpStream>,
    pub(super) writer: TcpStream,
}

/// Which ranks of a process group died or left, as this rank knows it.
///
/// Made by [`meet`](super::meet); a [`ProcessGroup`](super::ProcessGroup) consults it while
/// waiting on its GPU work, so that a dead rank is a [`CommErrorKind::RankGone`] naming it.
/// Dropping it tells the other ranks that this one leaves on purpose.
pub struct RankWatch {
    shared: Arc<Shared>,
}

struct Shared {
    rank: usize,
    /// The first rank known to have died.
    gone: Mutex<Option<usize>>,
    /// Ranks that said goodbye.
    left: Mutex<Vec<usize>>,
    /// Set once this side is closing: its own connections' ends are then not deaths.
    closing: AtomicBool,
    /// Set when this rank leaves on purpose: only then does it say goodbye.
    leaving: AtomicBool,
    /// Where this rank writes: goodbyes, and on rank 0 the news of a death.
    writers: Mutex<Vec<(usize, TcpStream)>>,
    /// Aborted when a rank dies, so that work waiting on it ends instead of blocking this rank's
    /// host (a copy queued behind a collective that never completes blocks it): the group's
    /// communicator and those split from it.
    comms: Mutex<Vec<Communicator>>,
    /// Called with the dead rank, on a thread of its own.
    on_death: Mutex<Option<DeathHandler>>,
    /// Set by whoever calls the death handler: a death and the handler's setting may each see
    /// the other, and the handler runs once.
    handled: AtomicBool,
}

type DeathHandler = Arc<dyn Fn(usize) + Send + Sync>;

impl RankWatch {
    /// Watches `connections` (rank 0: one per other rank; the others: rank 0's), one thread each.
    pub(super) fn start(rank: usize, connections: Vec<Connection>) -> Result<RankWatch> {
        let fail = |e: std::io::Error| Error::Comm {
            op: "rendezvous",
            rank,
            kind: CommErrorKind::Rendezvous(format!("cannot keep the group's connections open ({e})")),
        };
        let mut writers = Vec::with_capacity(connections.len());
        let mut readers = Vec::with_capacity(connections.len());
        for c in connections {
            // The rendezvous's deadline no longer applies: a watch waits as long as the group lives.
            c.reader.get_ref().set_read_timeout(None).map_err(fail)?;
            writers.push((c.peer, c.writer));
            readers.push((c.peer, c.reader));
        }
        let shared = Arc::new(Shared {
            rank,
            gone: Mutex::new(None),
            left: Mutex::new(Vec::new()),
            closing: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            writers: Mutex::new(writers),
            comms: Mutex::new(Vec::new()),
            on_death: Mutex::new(None),
            handled: AtomicBool::new(false),
        });
        for (peer, reader) in readers {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("graphed-watch-{peer}"))
                .spawn(move || shared.listen(peer, reader))
                .map_err(fail)?;
        }
        Ok(RankWatch { shared })
    }

    /// The first rank known to have died: its process ended without leaving the group (rank 0
    /// sees it directly, the others hear it from rank 0; rank 0 dying is seen by all).
    pub fn gone(&self) -> Option<usize> {
        *self.shared.gone.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The ranks, as far as this one sees (rank 0 sees all; the others see rank 0), that left
    /// on purpose.
    pub fn left(&self) -> Vec<usize> {
        self.shared.left.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Aborts `comm` as soon as a rank dies (at once if one already has). Communicators that
    /// only this watch still holds (their program dropped them, and no graph holds them) are let
    /// go here, on the caller's thread, so that a program that splits groups again and again
    /// does not keep them all for the group's life.
    pub(super) fn abort_on_death(&self, comm: &Communicator) {
        let released: Vec<Communicator> = {
            let mut comms = self.shared.comms.lock().unwrap_or_else(PoisonError::into_inner);
            let (kept, released) = std::mem::take(&mut *comms).into_iter().partition(Communicator::held_elsewhere);
            *comms = kept;
            comms.push(comm.clone());
            released
        };
        // Destroyed outside the lock: a death meanwhile need not wait for it.
        drop(released);
        if self.gone().is_some() {
            comm.abort();
        }
    }

    /// Calls `handler` with the dead rank when a rank dies, on a thread of its own, started as
    /// the communicator's abort begins (or at once, on this thread, if one already died): a
    /// program whose host may be blocked on work that waits for the dead rank ends itself there,
    /// as PyTorch's NCCL watchdog does, even if the abort itself blocks.
    pub fn on_death(&self, handler: impl Fn(usize) + Send + Sync + 'static) {
        let handler: DeathHandler = Arc::new(handler);
        *self.shared.on_death.lock().unwrap_or_else(PoisonError::into_inner) = Some(handler.clone());
        if let Some(rank) = self.gone().filter(|_| !self.shared.handled.swap(true, Ordering::SeqCst)) {
            handler(rank);
        }
    }

    /// Leaves the group on purpose: the others are told goodbye, not a death. A watch dropped
    /// without leaving (this rank failed) is a death to them, so that none waits on this rank.
    pub fn leave(self) {
        self.leave_shared();
    }

    /// Marks the watch as leaving on purpose when its last handle goes (see
    /// [`leave`](RankWatch::leave)).
    pub(super) fn leave_shared(&self) {
        self.shared.leaving.store(true, Ordering::SeqCst);
    }

    /// [`gone`](RankWatch::gone) as the error a rank waiting on the group gets.
    pub fn error(&self) -> Option<CommErrorKind> {
        self.gone().map(|rank| CommErrorKind::RankGone { rank })
    }
}

impl std::fmt::Debug for RankWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankWatch").field("gone", &self.gone()).field("left", &self.left()).finish()
    }
}

impl Shared {
    /// Reads `peer`'s lines until its connection ends.
    fn listen(&self, peer: usize, mut reader: BufReader<TcpStream>) {
        let mut said_bye = false;
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => match line.trim_end().split_once(' ') {
                    None if line.trim_end() == "bye" => said_bye = true,
                    Some(("gone", r)) if peer == 0 => {
                        if let Ok(r) = r.parse() {
                            self.died(r);
                        }
                    }
                    _ => {}
                },
            }
        }
        if said_bye {
            self.left.lock().unwrap_or_else(PoisonError::into_inner).push(peer);
        } else if !self.closing.load(Ordering::SeqCst) {
            self.died(peer);
        }
    }

    /// Records that `rank` died, on rank 0 tells the others, starts the death handler and aborts
    /// the communicator, in that order: NCCL's abort may wait for kernels that wait for the dead
    /// rank, and neither the news nor the handler may wait behind it (nor, since the abort runs
    /// on a thread of its own, a dropped watch waiting for this list).
    fn died(&self, rank: usize) {
        {
            let mut gone = self.gone.lock().unwrap_or_else(PoisonError::into_inner);
            if gone.is_some() {
                return;
            }
            *gone = Some(rank);
        }
        tracing::warn!("graphed: rank {rank}'s process ended without leaving the group; aborting its communicator");
        if self.rank == 0 {
            for (peer, w) in self.writers.lock().unwrap_or_else(PoisonError::into_inner).iter_mut() {
                if *peer != rank {
                    // A rank that cannot be told is gone too; its own connection says so.
                    let _ = writeln!(w, "gone {rank}");
                }
            }
        }
        let handler = self.on_death.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if let Some(handler) = handler.filter(|_| !self.handled.swap(true, Ordering::SeqCst)) {
            let run = handler.clone();
            let spawned = std::thread::Builder::new().name("graphed-on-death".into()).spawn(move || run(rank));
            if spawned.is_err() {
                handler(rank);
            }
        }
        // Under the list's lock: this thread never holds the last handle, so no communicator
        // is destroyed here while the process exits.
        for comm in self.comms.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            comm.abort();
        }
    }
}

impl Drop for RankWatch {
    fn drop(&mut self) {
        let leaving = self.shared.leaving.load(Ordering::SeqCst);
        // The communicators go with their group, on this thread (the listeners outlive the watch
        // until their connections close, and must not destroy them, possibly after `main`). A
        // rank that fails aborts them first: their collectives may wait on peers that will now
        // stop, and destroying them would wait for those.
        let comms = std::mem::take(&mut *self.shared.comms.lock().unwrap_or_else(PoisonError::into_inner));
        if !leaving {
            comms.iter().for_each(Communicator::abort);
        }
        drop(comms);
        self.shared.closing.store(true, Ordering::SeqCst);
        for (_, w) in self.shared.writers.lock().unwrap_or_else(PoisonError::into_inner).iter_mut() {
            // A peer that misses the goodbye takes this rank for dead, which only matters if it
            // still waits on it; there is no later call to report a failure to.
            if leaving {
                let _ = writeln!(w, "bye");
            }
            let _ = w.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CommOptions, Device};

    fn one_rank() -> Result<Communicator> {
        Ok(Communicator::sim_group(&[Device::sim()], CommOptions::default())?.remove(0))
    }

    #[test]
    fn communicators_their_program_dropped_are_let_go_at_the_next_one() -> Result<()> {
        let watch = RankWatch::start(0, Vec::new())?;
        let (kept, dropped) = (one_rank()?, one_rank()?);
        watch.abort_on_death(&kept);
        watch.abort_on_death(&dropped);
        drop(dropped);
        let last = one_rank()?;
        watch.abort_on_death(&last);
        let held = watch.shared.comms.lock().unwrap_or_else(PoisonError::into_inner).len();
        assert_eq!(held, 2, "the dropped communicator must be let go, the two held kept");
        Ok(())
    }
}
