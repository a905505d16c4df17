//! What a rank waits for at the host, and for how long: the options, the patience of a wait
//! that a watch of the group can end early, and the watchdog's wait on a stream.

use std::time::{Duration, Instant};

use super::{comm_error, CommErrorKind, Communicator};
use crate::device::backend::Repr;
use crate::device::{Event, Stream};
use crate::Result;

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

/// How long a wait that NCCL ended with [`CommErrorKind::PeerFailed`] gives its watch to name the
/// rank that failed. NCCL may see a dead peer's sockets close before the watch sees its own
/// connection to that rank close (observed under load on the GPU machine), and "rank 1 left the
/// group" tells a user where to look where "another rank failed" does not.
pub const PEER_NAMING_GRACE: Duration = Duration::from_secs(2);

impl<'w> Patience<'w> {
    /// Waits of up to `timeout` from now, ended early by `watch`'s answer.
    pub(crate) fn new(timeout: Duration, watch: &'w dyn Fn() -> Option<CommErrorKind>) -> Patience<'w> {
        Patience { deadline: Instant::now() + timeout, timeout, watch }
    }

    /// `kind` as the watch names it: for [`CommErrorKind::PeerFailed`], the watch's answer if
    /// it gives one within `grace`; any other kind as it is, at once.
    pub(crate) fn named_within(&self, kind: CommErrorKind, grace: Duration) -> CommErrorKind {
        if !matches!(kind, CommErrorKind::PeerFailed { .. }) {
            return kind;
        }
        let until = Instant::now() + grace;
        loop {
            if let Some(named) = (self.watch)() {
                return named;
            }
            if Instant::now() >= until {
                return kind;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// [`named_within`](Patience::named_within) [`PEER_NAMING_GRACE`].
    pub(crate) fn named(&self, kind: CommErrorKind) -> CommErrorKind {
        self.named_within(kind, PEER_NAMING_GRACE)
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
                // Made first: the report looks at what had not completed before the abort.
                let e = fail(kind);
                abort();
                return Err(e);
            }
            state?;
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Communicator {
    /// Blocks until the work queued on `stream` has completed, or fails after the
    /// communicator's timeout (a peer that never arrives), instead of hanging: the watchdog of a
    /// training loop. On a GPU a wait that fails for the group (the timeout, NCCL's error)
    /// aborts the communicator, since its work cannot finish; make a new group to go on.
    ///
    /// A failure for the group (the timeout, a rank gone) that a noted launch explains (of a
    /// graph holding this group's collectives, or of one of them outside graphs) is reported as
    /// [`CommErrorKind::Stalled`]: the graph and its launch if there is one, the collective and
    /// the ranks that arrived and did not (on the simulator; `docs/several-gpus.md` says what
    /// GPUs can tell).
    ///
    /// # Errors
    /// [`CommErrorKind::Timeout`] or [`CommErrorKind::Stalled`], an error NCCL reported,
    /// or the stream's own errors.
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
        let waiting = || format!("the work queued on stream {}", stream.id());
        self.wait_until(&waiting, || stream.synchronize(), || stream.query(), watch)
    }

    /// As [`wait_watching`](Communicator::wait_watching), for the work before `event`'s latest
    /// record instead of a stream's: a training loop that waits for the copy of an earlier step
    /// (queued behind that step's collectives) waits under the watchdog too.
    ///
    /// # Errors
    /// As [`wait_watching`](Communicator::wait_watching).
    pub fn wait_event_watching(&self, event: &Event, watch: &dyn Fn() -> Option<CommErrorKind>) -> Result<()> {
        let waiting = || format!("the work before event {}", event.id());
        self.wait_until(&waiting, || event.synchronize(), || event.query(), watch)
    }

    /// Waits on the simulator with `wait` (its own waits end at the timeout, a rank gone or a
    /// deadlock), on GPUs by polling `query` under the timeout and `watch`; a failure for the
    /// group is reported with the graph launch it stopped, if one did.
    fn wait_until(
        &self,
        waiting: &dyn Fn() -> String,
        wait: impl FnOnce() -> Result<()>,
        mut query: impl FnMut() -> Result<bool>,
        watch: &dyn Fn() -> Option<CommErrorKind>,
    ) -> Result<()> {
        match &self.inner.repr {
            Repr::Sim(_) => wait().map_err(|e| self.explained(e)),
            Repr::Cuda(c) => {
                let patience = Patience::new(self.inner.options.timeout, watch);
                let fail = |kind| comm_error("Communicator::wait", self.rank(), self.explain(kind));
                // An error of NCCL's ends the group; one of the stream's (a query refused during a
                // capture) is the caller's to handle. The watch aborts the group itself when a
                // rank dies, or this wait does when it fails: either way it fails at once, not after
                // NCCL's abort returns. A peer's failure is named by the watch where it can.
                let failed = |kind| {
                    self.abort();
                    fail(patience.named(kind))
                };
                let abort = || self.abort();
                patience.poll(
                    waiting,
                    &abort,
                    fail,
                    || Ok(query()? || c.async_error().map(|()| false).map_err(failed)?),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn peer_failed() -> CommErrorKind {
        CommErrorKind::PeerFailed { call: "the communicator's work".into() }
    }

    #[test]
    fn a_peer_failure_is_named_by_a_watch_that_answers_within_the_grace() {
        let asked = AtomicUsize::new(0);
        // The watch learns of the death on its fourth look, as a closing connection arrives late.
        let watch = || (asked.fetch_add(1, Ordering::SeqCst) >= 3).then_some(CommErrorKind::RankGone { rank: 1 });
        let patience = Patience::new(Duration::from_secs(60), &watch);
        let named = patience.named_within(peer_failed(), Duration::from_secs(60));
        assert_eq!(named, CommErrorKind::RankGone { rank: 1 });
        assert_eq!(asked.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn a_peer_failure_no_watch_names_stays_nccls_after_the_grace() {
        let watch = || None;
        let patience = Patience::new(Duration::from_secs(60), &watch);
        assert_eq!(patience.named_within(peer_failed(), Duration::from_millis(20)), peer_failed());
    }

    #[test]
    fn other_errors_pass_without_asking_the_watch() {
        let asked = AtomicUsize::new(0);
        let watch = || {
            asked.fetch_add(1, Ordering::SeqCst);
            Some(CommErrorKind::RankGone { rank: 1 })
        };
        let patience = Patience::new(Duration::from_secs(60), &watch);
        let nccl = CommErrorKind::Nccl("ncclCommGetAsyncError failed with ncclInternalError".into());
        assert_eq!(patience.named(nccl.clone()), nccl);
        assert_eq!(asked.load(Ordering::SeqCst), 0);
    }
}
