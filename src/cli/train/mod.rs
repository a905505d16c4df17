//! `graphed train`: a small GPT learns 3-digit addition (`addition.rs`), or with `--data FILE` a
//! byte-level language model of a local text file (`text.rs`). Its transformer layers replay as
//! graphed callables (`step.rs`; on a side stream with `--side-stream`), the embedding and the
//! head run eagerly around them; `--eager` runs everything eagerly. Reports the loss as it goes,
//! host and wall time per step, and at the end the exact-match accuracy on held-out sums with
//! greedy decoding, or the held-out loss and a sample of the text.

mod addition;
mod checkpoint;
mod health;
mod interrupt;
mod memory;
mod metrics;
pub(crate) mod outputs;
mod plan;
mod schedule;
mod step;
mod task;
mod text;
mod training;
mod upload;

use graphed::device::Device;
use graphed::dist::{ProcessGroup, RankEnv};

use super::args::TrainArgs;
pub use training::check;
use training::Training;

/// Where a `train` run finds the other ranks of its group: the only thing that differs between
/// a single process, a process launched as a rank of several and a simulated rank.
pub enum Joining {
    /// One process, on its own.
    Alone,
    /// One process per GPU (`graphed launch`, torchrun): it meets the others over TCP and joins
    /// their NCCL group once the run is known to be able to start.
    Launched(RankEnv),
    /// A simulated rank, a thread of this process, whose group is made already (`graphed launch
    /// -- train --device sim`).
    Simulated(ProcessGroup),
}

impl Joining {
    /// Whether this rank reports, saves and plots for the group: rank 0, or the only one.
    fn lead(&self) -> bool {
        match self {
            Joining::Alone => true,
            Joining::Launched(env) => env.rank == 0,
            Joining::Simulated(g) => g.env().rank == 0,
        }
    }

    /// This rank and the group's ranks: `(0, 1)` alone.
    fn place(&self) -> (usize, usize) {
        match self {
            Joining::Alone => (0, 1),
            Joining::Launched(env) => (env.rank, env.world),
            Joining::Simulated(g) => (g.env().rank, g.env().world),
        }
    }
}

/// Trains, alone or as a rank of a data-parallel group or of a grid of pipelines (`joining`;
/// rank 0 reports). Nothing runs
/// unless the whole run can ([`Training::setup`]); its steps' failure, once what was reported is
/// kept, or its interrupt, once saved, is returned for `main` to end with.
pub fn run(dev: &Device, args: &TrainArgs, joining: Joining) -> anyhow::Result<()> {
    let mut training = Training::setup(dev, args, joining)?;
    let trained = training.steps();
    training.finish(trained)
}
