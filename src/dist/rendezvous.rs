//! The rendezvous of a process group: rank 0 listens at `MASTER_ADDR:MASTER_PORT`, every other
//! rank connects and says who it is and what model it builds; rank 0 answers all of them with
//! its payload (the NCCL id) or with why the group cannot start. Two lines each way:
//!
//! ```text
//! rank -> 0:  graphed-rendezvous/1 <rank> <world>\n<model>\n
//! 0 -> rank:  ok <payload as hex>\n   or   refused <message>\n
//!             or   mismatch <rank>\n<rank 0's model>\n<that rank's model>\n
//! ```
//!
//! The connections then stay open: they are the group's [`RankWatch`].

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::watch::{Connection, RankWatch};
use super::RankEnv;
use crate::device::CommErrorKind;
use crate::{Error, Result};

const HELLO: &str = "graphed-rendezvous/1";
/// The most a connection may send rank 0 before its answer: a hello and a model's description.
const HELLO_BYTES: u64 = 1 << 20;
/// How long rank 0 waits for a connection's hello (a rank sends it as it connects), so that a
/// stray connection that says nothing cannot hold the rendezvous until its deadline.
const HELLO_WAIT: Duration = Duration::from_secs(10);

fn fail(rank: usize, kind: CommErrorKind) -> Error {
    Error::Comm { op: "rendezvous", rank, kind }
}

fn rdzv(rank: usize, what: impl Into<String>) -> Error {
    fail(rank, CommErrorKind::Rendezvous(what.into()))
}

/// Meets every rank of `env`'s group: rank 0 (which passes `payload`) waits for the others, checks
/// that they were launched for the same group and build the same `model`, and gives them its
/// payload; every rank returns it, and the watch that keeps the connections open to learn which
/// rank dies. [`ProcessGroup::join`](super::ProcessGroup::join) shares the NCCL id this way.
///
/// # Errors
/// [`CommErrorKind::Rendezvous`] when a rank does not arrive within `timeout` (naming it) or rank 0
/// refuses the group; [`CommErrorKind::ModelMismatch`] on every rank when a rank builds another
/// model than rank 0, naming the first such rank.
pub fn meet(env: &RankEnv, model: &str, payload: Option<Vec<u8>>, timeout: Duration) -> Result<(Vec<u8>, RankWatch)> {
    let model = model.replace(['\n', '\r'], " ");
    let deadline = Instant::now() + timeout;
    match (env.rank, payload) {
        (0, Some(p)) => lead(env, &model, p, deadline),
        (0, None) => Err(rdzv(0, "rank 0 has nothing to share; please report this as a bug")),
        _ => follow(env, &model, deadline),
    }
}

fn lead(env: &RankEnv, model: &str, payload: Vec<u8>, deadline: Instant) -> Result<(Vec<u8>, RankWatch)> {
    let addr = (env.master_addr.as_str(), env.master_port);
    let listener = TcpListener::bind(addr).map_err(|e| {
        rdzv(0, format!("cannot listen at {}:{} ({e}); choose a free MASTER_PORT", env.master_addr, env.master_port))
    })?;
    listener.set_nonblocking(true).map_err(|e| rdzv(0, e.to_string()))?;
    let mut arrivals = Arrivals::default();
    while arrivals.count() + 1 < env.world {
        match listener.accept() {
            Ok((stream, _)) => arrivals.admit(stream, env, model, deadline)?,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(arrivals.late(env));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(rdzv(0, e.to_string())),
        }
    }
    if let Some(refused) = arrivals.refusal(model) {
        return Err(refused);
    }
    let connections = arrivals.welcome(&payload)?;
    Ok((payload, RankWatch::start(0, connections)?))
}

/// The connections rank 0 accepted.
#[derive(Default)]
struct Arrivals {
    /// The ranks that can join: each one's rank, connection and model.
    peers: Vec<(usize, TcpStream, String)>,
    /// Connections that cannot join (another world size, a rank twice, not a rank): counted as
    /// arrivals, so that rank 0 stops waiting once everyone came, and refused with the others.
    strays: Vec<TcpStream>,
    /// Why each stray cannot join.
    problems: Vec<String>,
    /// The first rank that builds another model than rank 0, and its model.
    mismatch: Option<(usize, String)>,
}

impl Arrivals {
    /// Connections accepted, strays included.
    fn count(&self) -> usize {
        self.peers.len() + self.strays.len()
    }

    /// Reads `stream`'s hello (until `deadline`, at most [`HELLO_WAIT`]) and keeps it as a rank of
    /// `env`'s group, noting whether it builds rank 0's `model`, or as a stray.
    fn admit(&mut self, stream: TcpStream, env: &RankEnv, model: &str, deadline: Instant) -> Result<()> {
        stream.set_nonblocking(false).map_err(|e| rdzv(0, e.to_string()))?;
        let wait = remaining(deadline).min(HELLO_WAIT);
        stream.set_read_timeout(Some(wait)).map_err(|e| rdzv(0, e.to_string()))?;
        let reader = stream.try_clone().map_err(|e| rdzv(0, e.to_string()))?;
        let mut lines = BufReader::new(reader.take(HELLO_BYTES)).lines();
        let hello = lines.next().and_then(|l| l.ok()).unwrap_or_default();
        let theirs = lines.next().and_then(|l| l.ok()).unwrap_or_default();
        let fields: Vec<&str> = hello.split(' ').collect();
        let parsed = match fields.as_slice() {
            [HELLO, r, w] => r.parse::<usize>().ok().zip(w.parse::<usize>().ok()),
            _ => None,
        };
        let problem = match parsed {
            Some((r, w)) if w != env.world => format!("rank {r} was launched for {w} ranks, rank 0 for {}", env.world),
            Some((r, _)) if r == 0 || r >= env.world || self.peers.iter().any(|p| p.0 == r) => {
                format!("rank {r} arrived twice or does not exist in a group of {}", env.world)
            }
            Some((r, _)) => {
                if theirs != model && self.mismatch.is_none() {
                    self.mismatch = Some((r, theirs.clone()));
                }
                self.peers.push((r, stream, theirs));
                return Ok(());
            }
            None => format!("a connection that is not a graphed rank said `{hello}`"),
        };
        self.problems.push(problem);
        self.strays.push(stream);
        Ok(())
    }

    /// The error of a rendezvous whose deadline passed, with every connection told: the ranks
    /// of `env`'s group that did not arrive, after why the strays cannot join.
    fn late(&mut self, env: &RankEnv) -> Error {
        let arrived: Vec<usize> = self.peers.iter().map(|p| p.0).collect();
        let missing: Vec<String> = (1..env.world).filter(|r| !arrived.contains(r)).map(|r| r.to_string()).collect();
        let what = format!(
            "{}ranks {} did not arrive in time; check that they were started and can reach {}:{}",
            self.problems.iter().map(|p| format!("{p}, and ")).collect::<String>(),
            missing.join(", "),
            env.master_addr,
            env.master_port
        );
        self.refuse_all(&format!("refused {what}"));
        rdzv(0, what)
    }

    /// Why the group cannot start once everyone arrived (a rank building another `model` than
    /// rank 0, or strays), with every connection told; `None` when it can.
    fn refusal(&mut self, model: &str) -> Option<Error> {
        if let Some((rank, theirs)) = self.mismatch.take() {
            self.refuse_all(&format!("{MISMATCH}{rank}\n{model}\n{theirs}"));
            return Some(fail(0, CommErrorKind::ModelMismatch { rank, ours: model.into(), theirs }));
        }
        if self.problems.is_empty() {
            return None;
        }
        let what = self.problems.join("; ");
        self.refuse_all(&format!("refused {what}"));
        Some(rdzv(0, what))
    }

    /// Answers every connection with `answer` (a `refused` line, or a mismatch's lines).
    fn refuse_all(&mut self, answer: &str) {
        for stream in self.peers.iter_mut().map(|p| &mut p.1).chain(&mut self.strays) {
            // A rank that left already learns nothing; its own timeout ends it.
            let _ = writeln!(stream, "{answer}");
        }
    }

    /// Gives every rank `payload`: the connections, kept open for the group's watch.
    fn welcome(self, payload: &[u8]) -> Result<Vec<Connection>> {
        let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
        let mut connections = Vec::with_capacity(self.peers.len());
        for (r, mut stream, _) in self.peers {
            writeln!(stream, "ok {hex}").map_err(|e| rdzv(0, format!("rank {r} left during the rendezvous ({e})")))?;
            let reader = BufReader::new(stream.try_clone().map_err(|e| rdzv(0, e.to_string()))?);
            connections.push(Connection { peer: r, reader, writer: stream });
        }
        Ok(connections)
    }
}

/// The answer that names a rank building another model (followed by both models' lines).
const MISMATCH: &str = "mismatch ";

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

fn follow(env: &RankEnv, model: &str, deadline: Instant) -> Result<(Vec<u8>, RankWatch)> {
    let rank = env.rank;
    let addrs: Vec<_> = (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| rdzv(rank, format!("MASTER_ADDR {} does not resolve ({e})", env.master_addr)))?
        .collect();
    let mut stream = loop {
        match addrs.iter().find_map(|a| TcpStream::connect_timeout(a, remaining(deadline)).ok()) {
            Some(s) => break s,
            None if Instant::now() >= deadline => {
                return Err(rdzv(rank, format!("rank 0 is not listening at {}:{}", env.master_addr, env.master_port)))
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    write!(stream, "{HELLO} {rank} {}\n{model}\n", env.world).map_err(|e| rdzv(rank, e.to_string()))?;
    stream.set_read_timeout(Some(remaining(deadline))).map_err(|e| rdzv(rank, e.to_string()))?;
    let mut reply = String::new();
    // The same reader serves the watch afterwards: it may hold what rank 0 wrote next.
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| rdzv(rank, e.to_string()))?);
    reader.read_line(&mut reply).map_err(|e| rdzv(rank, format!("rank 0 did not answer in time ({e})")))?;
    let reply = reply.trim_end();
    if let Some(hex) = reply.strip_prefix("ok ") {
        let payload = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("x"), 16))
            .collect::<std::result::Result<Vec<u8>, _>>()
            .map_err(|_| rdzv(rank, "rank 0's answer is damaged"))?;
        let watch = RankWatch::start(rank, vec![Connection { peer: 0, reader, writer: stream }])?;
        return Ok((payload, watch));
    }
    if let Some(who) = reply.strip_prefix(MISMATCH) {
        let mut line = || {
            let mut l = String::new();
            reader.read_line(&mut l).ok().filter(|&n| n > 0).map(|_| l.trim_end().to_string())
        };
        let (ours, theirs) = (line(), line());
        return match (who.parse::<usize>(), ours, theirs) {
            (Ok(r), Some(ours), Some(theirs)) => {
                Err(fail(rank, CommErrorKind::ModelMismatch { rank: r, ours, theirs }))
            }
            _ => Err(rdzv(rank, "rank 0's answer is damaged")),
        };
    }
    match reply.strip_prefix("refused ") {
        Some(why) => Err(rdzv(rank, format!("rank 0 refused the group: {why}"))),
        None => Err(rdzv(rank, "rank 0 closed the connection without an answer; see rank 0's error")),
    }
}
