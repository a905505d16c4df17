//! `graphed launch`: one process per GPU of this host, with torchrun's variables, so that
//! `graphed launch --gpus 2 -- train` runs data parallel. On several hosts, start one launcher
//! per host with the same `MASTER_ADDR`/`MASTER_PORT` and ranks offset per host (or use
//! torchrun): the processes only read the variables, and NCCL picks its transports itself.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::args::LaunchArgs;

/// Starts the processes and waits for them; the first failure is the launcher's.
pub fn run(args: &LaunchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.gpus > 0, "--gpus must be at least 1");
    let exe = std::env::current_exe()?;
    let nccl = nccl_library_path();
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(args.gpus);
    for rank in 0..args.gpus {
        let mut cmd = Command::new(&exe);
        cmd.args(&args.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", args.gpus.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", args.port.to_string())
            // NVLink multicast can take a shared host's GPUs out of service: never on here.
            .env("NCCL_NVLS_ENABLE", "0");
        if let Some(dir) = &nccl {
            let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
            cmd.env("LD_LIBRARY_PATH", format!("{}:{path}", dir.display()));
        }
        let child = cmd.spawn().map_err(|e| anyhow::anyhow!("cannot start rank {rank} ({}): {e}", exe.display()))?;
        children.push((rank, child));
    }
    let mut failed: Option<(usize, std::process::ExitStatus, Instant)> = None;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait()? {
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
                for (rank, child) in &mut children {
                    eprintln!("graphed launch: stopping rank {rank}");
                    // Already ended if this fails; nothing else to do.
                    let _ = child.kill();
                    let _ = child.wait();
                }
                children.clear();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match failed {
        Some((rank, status, _)) => anyhow::bail!("rank {rank} failed ({status}); see its error above"),
        None => Ok(()),
    }
}

/// A folder with `libnccl.so` for cudarc, which does not look for the `libnccl.so.2` that
/// NCCL's packages ship: `None` when `libnccl.so` is already found, else a link to the copy in
/// PyTorch's `nvidia-nccl` package (or `GRAPHED_NCCL`, a path to any `libnccl.so.2`).
fn nccl_library_path() -> Option<PathBuf> {
    let dirs = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let standard = ["/usr/lib/x86_64-linux-gnu", "/usr/local/lib", "/usr/lib64"];
    let found = dirs.split(':').chain(standard).any(|d| !d.is_empty() && PathBuf::from(d).join("libnccl.so").exists());
    if found {
        return None;
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
    })?;
    let dir = std::env::temp_dir().join(format!("graphed-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let link = dir.join("libnccl.so");
    // A link left by an earlier launcher of the same pid is fine.
    let _ = std::os::unix::fs::symlink(&lib, &link);
    eprintln!("graphed launch: NCCL from {}", lib.display());
    link.exists().then_some(dir)
}
