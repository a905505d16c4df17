//! Layer 8, the binary: parses arguments, picks the device, runs a subcommand. Uses only the
//! library's public API.

pub mod args;
mod bench;
mod bench_model;
mod demo;
mod inspect;
mod train;

use graphed::device::{Device, SimConfig};

use args::{Cli, Command, DeviceChoice};

/// Runs one command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(a) => train::run(&open_device(&a.device)?, &a),
        Command::Demo(a) => demo::run(&open_device(&a.device)?, &a),
        Command::Bench(b) => bench::run(&b),
        Command::Inspect(a) => inspect::run(&open_device(&a.device)?, &a),
    }
}

/// The device a command runs on.
pub fn open_device(choice: &args::DeviceArgs) -> anyhow::Result<Device> {
    let sim = SimConfig { policy: choice.policy.into(), seed: choice.sim_seed, ..SimConfig::default() };
    Ok(match choice.device {
        DeviceChoice::Auto => {
            let (dev, why) = Device::cuda_or_sim(sim);
            if let Some(e) = why {
                eprintln!("graphed: {e}; using the simulator");
            }
            dev
        }
        DeviceChoice::Cuda => Device::cuda(0)?,
        DeviceChoice::Sim => Device::sim_with(sim),
    })
}
