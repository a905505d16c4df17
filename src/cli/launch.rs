//! `graphed launch`: one process per GPU of this host, with torchrun's variables, so that
//! `graphed launch --gpus 2 -- train` runs data parallel (and `-- train --pipeline P` a grid of
//! pipelines). On several hosts, start one launcher
//! per host with the same `--nnodes`, `--master-addr` and `--port` and its own `--node-rank`
//! (torchrun's flags; torchrun itself works as well): the processes only read the variables, and
//! NCCL picks its transports itself. `graphed launch --gpus N -- train --device sim` runs N
//! simulated ranks instead, as threads of the launcher ([`simulated`]).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use clap::Parser;
use graphed::check::Checker;
use graphed::device::{Device, SimConfig};
use graphed::dist::{on_sim_ranks, ProcessGroup};

use super::args::{Cli, DeviceChoice, LaunchArgs, TrainArgs};
use super::exit::{refuse, Interrupted};
use super::train::{self, Joining};

/// The variables of each of this host's processes, or why the flags cannot give them.
fn rank_vars(args: &LaunchArgs) -> anyhow::Result<Vec<Vec<(&'static str, String)>>> {
    anyhow::ensure!(args.gpus > 0, "--gpus must be at least 1");
    anyhow::ensure!(args.nnodes > 0, "--nnodes must be at least 1");
    anyhow::ensure!(
        args.node_rank < args.nnodes,
        "--node-rank {} is not below --nnodes {}; number the hosts 0 to {}",
        args.node_rank,
        args.nnodes,
        args.nnodes - 1
    );
    let master = match (&args.master_addr, args.nnodes) {
        (Some(addr), _) => addr.clone(),
        (None, 1) => "127.0.0.1".to_string(),
        (None, n) => {
            anyhow::bail!("--nnodes {n} needs --master-addr: the address of node rank 0's host, the same on every host")
        }
    };
    let vars = |local: usize| {
        let mut vars = vec![
            ("RANK", (args.node_rank * args.gpus + local).to_string()),
            ("LOCAL_RANK", local.to_string()),
            ("WORLD_SIZE", (args.nnodes * args.gpus).to_string()),
            ("MASTER_ADDR", master.clone()),
            ("MASTER_PORT", args.port.to_string()),
            // NVLink multicast can take a shared host's GPUs out of service: never on here.
            ("NCCL_NVLS_ENABLE", "0".to_string()),
        ];
        // Collectives' connections made while the group is made, in NCCL's non-blocking split
        // that the timeout and the watch can end, not at their first call, where a rank waits
        // inside NCCL for its peers (unless the user chose otherwise).
        if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
            vars.push(("NCCL_RUNTIME_CONNECT", "0".to_string()));
        }
        vars
    };
    Ok((0..args.gpus).map(vars).collect())
}

/// Ends the processes still running, after a failure of the launcher's own.
fn stop(children: &mut Vec<(usize, Child)>) {
    for (rank, child) in children.iter_mut() {
        eprintln!("graphed launch: stopping rank {rank}");
        // Already ended if this fails; nothing else to do.
        let _ = child.kill();
        let _ = child.wait();
    }
    children.clear();
}

/// `train --device sim`'s arguments, when the command to launch is that.
fn simulated_train(command: &[String]) -> Option<TrainArgs> {
    let cli = Cli::try_parse_from(std::iter::once("graphed").chain(command.iter().map(String::as_str))).ok()?;
    match cli.command {
        super::args::Command::Train(t) if t.device.device == DeviceChoice::Sim => Some(t),
        _ => None,
    }
}

/// Starts the processes and waits for them; the first failure is the launcher's. A `train
/// --device sim` runs its ranks as threads of this process instead ([`simulated`]).
pub fn run(args: &LaunchArgs) -> anyhow::Result<()> {
    if let Some(train) = simulated_train(&args.args) {
        return simulated(args, &train);
    }
    let vars = rank_vars(args)?;
    let exe = std::env::current_exe()?;
    let nccl = nccl_library_folder()?;
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(args.gpus);
    for (local, vars) in vars.into_iter().enumerate() {
        let rank = args.node_rank * args.gpus + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&args.args).envs(vars);
        if let Some(dir) = &nccl {
            // An empty entry would make the loader search the working folder.
            let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
            let dir = dir.path().display();
            let path = if path.is_empty() { dir.to_string() } else { format!("{dir}:{path}") };
            cmd.env("LD_LIBRARY_PATH", path);
        }
        match cmd.spawn() {
            Ok(child) => children.push((rank, child)),
            Err(e) => {
                stop(&mut children);
                anyhow::bail!("cannot start rank {rank} ({}): {e}", exe.display());
            }
        }
    }
    let mut failed: Option<(usize, std::process::ExitStatus, Instant)> = None;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            let waited = children[i].1.try_wait();
            let waited = match waited {
                Ok(w) => w,
                Err(e) => {
                    let rank = children[i].0;
                    stop(&mut children);
                    anyhow::bail!("cannot watch rank {rank} ({e})");
                }
            };
            match waited {
                Some(status) => {
                    let (rank, _) = children.remove(i);
                    if !status.success() && failed.is_none() {
                        eprintln!(
                            "graphed launch: rank {rank} failed ({status}); the others get {} s to end",
                            args.grace
                        );
                        failed = Some((rank, status, Instant::now()));
                    }
                }
                None => i += 1,
            }
        }
        if let Some((_, _, at)) = failed {
            if at.elapsed() > Duration::from_secs(args.grace) {
                stop(&mut children);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match failed {
        Some((rank, status, _)) => anyhow::bail!("rank {rank} failed ({status}); see its error above"),
        None => Ok(()),
    }
}

/// Runs `train` (`--device sim`) as `--gpus` simulated ranks, one thread each: the simulator's
/// counterpart of the processes, so that data-parallel training can be tried and tested on any
/// machine.
///
/// Threads, not processes, because the simulator's collectives live in one process's memory:
/// a group's ranks meet in a world they share (`Communicator::sim_group`), and a deadlock is
/// found by looking at every rank's waits at once, across groups. Simulated ranks as processes
/// would need a second implementation of those collectives over a transport of their own, with
/// its own deadlock detection; threads reuse the one the tests use (`dist::on_sim_ranks`). The
/// training is the same code either way: each thread runs `train` as a rank whose
/// [`ProcessGroup`] is made from its simulated communicator ([`Joining::Simulated`]) rather than
/// joined over TCP and NCCL, and everything after (rank 0 alone reporting, saving and plotting,
/// the rank lines, the group's losses and gradient reduction) is the launched processes' path.
/// Rank `r`'s device is the simulator with `--sim-policy` and seed `--sim-seed + r`.
///
/// What rank 0 would refuse is refused once, before any rank is built. The first rank to fail
/// (in time, as the process launcher's) gives the launcher's error and exit status; the others'
/// errors are shown above it.
fn simulated(args: &LaunchArgs, train_args: &TrainArgs) -> anyhow::Result<()> {
    if args.gpus == 0 {
        refuse!("--gpus must be at least 1");
    }
    if args.nnodes != 1 {
        refuse!(
            "--nnodes {}: simulated ranks are threads of this process, on this host; drop --nnodes (and --node-rank)",
            args.nnodes
        );
    }
    let d = &train_args.device;
    let sim = SimConfig { policy: d.policy.into(), seed: d.sim_seed, ..SimConfig::default() };
    train::check(&Device::sim_with(sim), train_args, args.gpus)?;
    let ranks = on_sim_ranks(args.gpus, sim, train_args.comm_options(), |comm| {
        let group = ProcessGroup::simulated(comm.clone())?;
        let trained = train::run(comm.device(), train_args, Joining::Simulated(group));
        let ended = Instant::now();
        // Each rank's checker line, as each process's `main` shows its own.
        let found = Checker::of(comm.device()).is_some_and(|c| c.found() > 0);
        if trained.is_ok() || found {
            // One write: the other ranks' threads print too.
            let line = format!("rank {}: {}\n", comm.rank(), super::checker_summary(comm.device()));
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        }
        Ok((trained, ended))
    });
    let mut failures: Vec<(Instant, usize, anyhow::Error)> = Vec::new();
    for (rank, outcome) in ranks.into_iter().enumerate() {
        match outcome {
            Ok((Ok(()), _)) => {}
            Ok((Err(e), at)) => failures.push((at, rank, e)),
            // The group could not be made, or the rank's thread panicked.
            Err(e) => failures.push((Instant::now(), rank, e.into())),
        }
    }
    failures.sort_by_key(|(at, rank, _)| (*at, *rank));
    let mut failures = failures.into_iter();
    let Some((_, first, error)) = failures.next() else { return Ok(()) };
    // An interrupt stops every rank at the same step, each saying so: not failures to list.
    let interrupted = |e: &anyhow::Error| e.downcast_ref::<Interrupted>().is_some();
    for (_, rank, e) in failures.filter(|(_, _, e)| !interrupted(e)) {
        eprintln!("graphed launch: rank {rank} failed too: {e:#}");
    }
    if !interrupted(&error) {
        eprintln!("graphed launch: rank {first} failed first");
    }
    Err(error)
}

/// A folder with `libnccl.so` for cudarc, which does not look for the `libnccl.so.2` that
/// NCCL's packages ship: `None` when `libnccl.so` is already found (or no package has a copy),
/// else a new private folder (removed when dropped, after the ranks ended) with a link to the
/// copy in PyTorch's `nvidia-nccl` package (or `GRAPHED_NCCL`, a path to any `libnccl.so.2`).
/// Made fresh and only ours, so that no folder another user or an earlier launcher left
/// decides which library the ranks load.
fn nccl_library_folder() -> anyhow::Result<Option<tempfile::TempDir>> {
    let dirs = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let standard = ["/usr/lib/x86_64-linux-gnu", "/usr/local/lib", "/usr/lib64"];
    let found = dirs.split(':').chain(standard).any(|d| !d.is_empty() && PathBuf::from(d).join("libnccl.so").exists());
    if found {
        return Ok(None);
    }
    let lib = std::env::var_os("GRAPHED_NCCL").map(PathBuf::from).or_else(|| {
        let out = Command::new("python3")
            .args([
                "-c",
                "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))",
            ])
            .output()
            .ok()?;
        let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
        path.exists().then_some(path)
    });
    let Some(lib) = lib else { return Ok(None) };
    let dir = tempfile::Builder::new().prefix("graphed-nccl-").tempdir().map_err(|e| {
        anyhow::anyhow!("making a folder in {} for the link to NCCL's library: {e}", std::env::temp_dir().display())
    })?;
    std::os::unix::fs::symlink(&lib, dir.path().join("libnccl.so"))
        .map_err(|e| anyhow::anyhow!("linking {} as libnccl.so in {}: {e}", lib.display(), dir.path().display()))?;
    eprintln!("graphed launch: NCCL from {}", lib.display());
    Ok(Some(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(gpus: usize, nnodes: usize, node_rank: usize, master_addr: Option<&str>) -> LaunchArgs {
        LaunchArgs {
            gpus,
            nnodes,
            node_rank,
            master_addr: master_addr.map(str::to_string),
            port: 29511,
            grace: 60,
            args: vec!["train".into()],
        }
    }

    fn var(vars: &[(&str, String)], name: &str) -> String {
        vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()).unwrap_or_default()
    }

    #[test]
    fn the_hosts_ranks_follow_one_another_as_torchruns_do() {
        let launched = args(4, 3, 2, Some("10.0.0.1"));
        let vars = &rank_vars(&launched).expect("valid flags")[1];
        let got: Vec<String> =
            ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"].iter().map(|n| var(vars, n)).collect();
        assert_eq!(got, ["9", "1", "12", "10.0.0.1", "29511"]);
        let one_host = &rank_vars(&args(2, 1, 0, None)).expect("valid flags")[1];
        assert_eq!((var(one_host, "RANK"), var(one_host, "MASTER_ADDR")), ("1".into(), "127.0.0.1".into()));
    }

    #[test]
    fn only_train_on_the_simulator_runs_as_threads() {
        let command = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        let sim = simulated_train(&command(&["train", "--device", "sim", "--grad-reduce", "sum"]));
        assert!(sim.is_some_and(|t| t.grad_reduce == crate::cli::args::GradReduceArg::Sum));
        for processes in [&["train"][..], &["train", "--device", "cuda"], &["bench", "parallel"], &["train", "--bogus"]]
        {
            assert!(simulated_train(&command(processes)).is_none(), "{processes:?} runs as processes");
        }
    }

    #[test]
    fn flags_that_cannot_make_a_group_are_refused_naming_the_flag() {
        for (bad, flag) in [
            (args(0, 1, 0, None), "--gpus"),
            (args(2, 0, 0, None), "--nnodes"),
            (args(2, 2, 2, Some("10.0.0.1")), "--node-rank 2"),
            (args(2, 2, 1, None), "--master-addr"),
        ] {
            let err = rank_vars(&bad).expect_err("refused").to_string();
            assert!(err.contains(flag), "{flag}: {err}");
        }
    }
}
