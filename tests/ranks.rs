//! Ranks as real processes through NCCL, on GPU 0: each rank says it is a host of its own
//! (`NCCL_HOSTID`, since NCCL refuses two ranks of one host on one GPU), and NCCL joins them
//! through its sockets on loopback. What needs several processes but not several GPUs.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

fn exe() -> String {
    std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string())
}

/// A free port for a group's rendezvous.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    listener.local_addr().expect("its address").port()
}

/// `graphed args` as rank `rank` of `world` on GPU 0, meeting at `port`.
fn rank(rank: usize, world: usize, port: u16, args: &[&str]) -> Command {
    let mut cmd = Command::new(exe());
    cmd.args(args).envs([
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", "0".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("NCCL_HOSTID", format!("graphed-test-rank-{rank}")),
        ("NCCL_SOCKET_IFNAME", "lo".to_string()),
        ("NCCL_IB_DISABLE", "1".to_string()),
        ("NCCL_NVLS_ENABLE", "0".to_string()),
    ]);
    cmd
}

/// The child's exit status, or `None` if it still runs after `limit` (then it is killed): a
/// guard against a hang, not a measure.
fn wait_at_most(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(status) = child.try_wait().expect("the child can be waited for") {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Ranks 0 and 1 of a group of two running `graphed args`, once rank 0 reports a step (the
/// group trains). Rank 0's output is read to the end, so that it never waits on a full pipe; the
/// other's is not needed. Both ranks' stderr is piped.
fn two_stepping_ranks(args: &[&str]) -> Vec<Child> {
    let port = free_port();
    let mut ranks: Vec<Child> = (0..2)
        .map(|r| {
            let mut cmd = rank(r, 2, port, args);
            cmd.stdout(if r == 0 { Stdio::piped() } else { Stdio::null() }).stderr(Stdio::piped());
            cmd.spawn().expect("the binary starts")
        })
        .collect();
    let stdout = ranks[0].stdout.take().expect("rank 0's output");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("step") {
                let _ = tx.send(());
            }
        }
    });
    assert!(rx.recv_timeout(Duration::from_secs(120)).is_ok(), "the two ranks never stepped");
    ranks
}

/// What a finished child wrote to its piped stderr.
fn stderr_of(child: &mut Child) -> String {
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    stderr
}

/// A rank killed mid-run (rank 1, then rank 0, whose death the other sees directly) ends the
/// other by itself, with exit status 1 (a failure while running) and an error naming the dead
/// rank, instead of a hang.
#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn a_killed_rank_ends_the_other_with_an_error_naming_it() {
    for dead in [1, 0] {
        let mut ranks = two_stepping_ranks(&["train", "--steps", "100000"]);
        ranks[dead].kill().expect("the rank can be killed");
        let _ = ranks[dead].wait();
        let survivor = &mut ranks[1 - dead];
        let status = wait_at_most(survivor, Duration::from_secs(60));
        let stderr = stderr_of(survivor);
        let Some(status) = status else { panic!("rank {} still ran 60 s after rank {dead} was killed", 1 - dead) };
        assert_eq!(status.code(), Some(1), "rank {}: {status}; {stderr}", 1 - dead);
        assert!(stderr.contains(&format!("rank {dead} left the group")), "rank {}: {stderr}", 1 - dead);
    }
}

/// A rank stopped mid-run (SIGSTOP: alive, its connections open, its collectives never
/// entered) ends the other within its `--comm-timeout`, with an error naming the collective it
/// waits in, and the graph holding it when it is captured, instead of a hang. Where rank 1 stops
/// decides which: a layer's backward graph (its gradients' reduction) or the embedding's and
/// head's reduction outside graphs.
#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn a_stalled_rank_ends_the_other_naming_the_stalled_collective() {
    const TIMEOUT_S: u64 = 10;
    let timeout = TIMEOUT_S.to_string();
    let mut ranks = two_stepping_ranks(&["train", "--steps", "100000", "--comm-timeout", &timeout]);
    let stopped = Command::new("kill").args(["-STOP", &ranks[1].id().to_string()]).status().expect("kill runs");
    assert!(stopped.success(), "rank 1 could not be stopped");
    let status = wait_at_most(&mut ranks[0], Duration::from_secs(TIMEOUT_S + 60));
    let _ = ranks[1].kill();
    let _ = ranks[1].wait();
    let stderr = stderr_of(&mut ranks[0]);
    let Some(status) = status else { panic!("rank 0 still ran {} s after rank 1 stopped", TIMEOUT_S + 60) };
    assert_eq!(status.code(), Some(1), "rank 0: {status}; {stderr}");
    assert!(stderr.contains("did not complete"), "rank 0's error names no stalled collective: {stderr}");
    let in_graph = stderr.contains("(launch ") && stderr.contains("waits in");
    assert!(in_graph || stderr.contains("outside graphs"), "rank 0's error says neither where: {stderr}");
    let ops = ["all_reduce", "reduce_scatter", "all_gather"];
    assert!(ops.iter().any(|op| stderr.contains(op)), "rank 0's error names no collective: {stderr}");
}

/// `NCCL_COMM_BLOCKING`, which NCCL would apply over both of a rank's communicators, is refused
/// naming it, before any group is made.
#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn nccl_comm_blocking_is_refused_naming_it() {
    for value in ["0", "1"] {
        let mut cmd = rank(0, 1, free_port(), &["train", "--steps", "5"]);
        let out = cmd.env("NCCL_COMM_BLOCKING", value).output().expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "NCCL_COMM_BLOCKING={value}: {stderr}");
        assert!(stderr.contains("NCCL_COMM_BLOCKING is set"), "NCCL_COMM_BLOCKING={value}: {stderr}");
    }
}
