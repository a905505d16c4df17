//! Layer 8, the binary: parses arguments, picks the device, runs a subcommand. Uses only the
//! library's public API.

pub mod args;
mod bench;
mod bench_model;
mod demo;
pub mod exit;
mod group;
mod inspect;
mod launch;
mod plot;
mod report;
mod scheduled;
mod train;

use graphed::check::Checker;
use graphed::device::{Device, SimConfig};
use graphed::dist::RankEnv;

use args::{Cli, Command, DeviceChoice};

/// Runs one command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    let (dev, result) = match cli.command {
        Command::Train(a) => match RankEnv::from_env()? {
            // Launched as one rank of several: this rank's GPU, data parallel.
            Some(env) => {
                let dev = rank_gpu(&env, &a.device)?;
                let result = train::run(&dev, &a, train::Joining::Launched(env));
                (dev, result)
            }
            None => with_device(&a.device, |dev| train::run(dev, &a, train::Joining::Alone))?,
        },
        Command::Launch(a) => return launch::run(&a),
        Command::Demo(a) => with_device(&a.device, |dev| demo::run(dev, &a))?,
        Command::Inspect(a) => with_device(&a.device, |dev| inspect::run(dev, &a))?,
        Command::Bench(b) => return bench::run(&b),
        Command::Report(a) => return Ok(report::run(&a)?),
    };
    // The checker's line is a summary of a finished run, on stderr with the other diagnostics;
    // after a failure it is shown only when it found something that may explain it.
    let found = Checker::of(&dev).is_some_and(|c| c.found() > 0);
    if result.is_ok() || found {
        eprintln!("{}", checker_summary(&dev));
    }
    result
}

/// The GPU of a process launched as rank `env.rank` (GPU `LOCAL_RANK`), or why it has none:
/// simulated ranks are threads of one process, which `graphed launch` starts itself.
fn rank_gpu(env: &RankEnv, choice: &args::DeviceArgs) -> anyhow::Result<Device> {
    let (rank, world) = (env.rank, env.world);
    if choice.device == DeviceChoice::Sim {
        exit::refuse!(
            "--device sim in a process launched as rank {rank} of {world}: simulated ranks are threads of one \
             process, not processes; start them with `graphed launch --gpus {world} -- train --device sim`"
        );
    }
    env.gpu().map_err(|e| {
        let hint = match e {
            graphed::Error::CudaUnavailable { .. } => {
                format!("; without GPUs, run the ranks on the simulator: `graphed launch --gpus {world} -- train --device sim`")
            }
            _ => String::new(),
        };
        anyhow::Error::new(e).context(format!("rank {rank} of {world} has no GPU {}{hint}", env.local_rank))
    })
}

/// Opens the device and runs `f` on it, keeping the device for the checker's summary.
fn with_device(
    choice: &args::DeviceArgs,
    f: impl FnOnce(&Device) -> anyhow::Result<()>,
) -> anyhow::Result<(Device, anyhow::Result<()>)> {
    let dev = open_device(choice)?;
    let result = f(&dev);
    Ok((dev, result))
}

/// One line on what the stream-safety checker found (each report was shown as a warning when
/// it was found).
pub fn checker_summary(dev: &Device) -> String {
    let Some(checker) = Checker::of(dev) else { return "stream-safety checker: off".into() };
    let found = match checker.found() {
        0 => "no hazards found".to_string(),
        n => format!("{n} hazards found (each shown as a warning above)"),
    };
    match checker.checks_everything() {
        true => format!("stream-safety checker: {found}"),
        false => format!("stream-safety checker: captures only (GRAPHED_CHECK=1 checks every operation); {found}"),
    }
}

/// The device a command runs on.
pub fn open_device(choice: &args::DeviceArgs) -> anyhow::Result<Device> {
    let sim = SimConfig { policy: choice.policy.into(), seed: choice.sim_seed, ..SimConfig::default() };
    Ok(match choice.device {
        DeviceChoice::Auto => {
            let (dev, why) = Device::cuda_or_sim(sim);
            match why {
                Some(graphed::Error::CudaUnavailable { reason }) => {
                    eprintln!("graphed: no CUDA GPU here ({reason}); running on the CPU simulator (--device sim says so and skips this line)")
                }
                Some(e) => eprintln!("graphed: no CUDA GPU here ({e}); running on the CPU simulator"),
                None => {}
            }
            dev
        }
        DeviceChoice::Cuda => Device::cuda(0)?,
        DeviceChoice::Sim => Device::sim_with(sim),
    })
}
