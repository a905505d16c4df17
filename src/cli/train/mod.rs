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
use graphed::dist::RankEnv;

use super::args::TrainArgs;
use training::Training;

/// Trains; `env` when launched as one rank of several (data parallel, rank 0 reports). Nothing
/// runs unless the whole run can ([`Training::setup`]); its steps' failure, once what was
/// reported is kept, or its interrupt, once saved, is returned for `main` to end with.
pub fn run(dev: &Device, args: &TrainArgs, env: Option<RankEnv>) -> anyhow::Result<()> {
    let mut training = Training::setup(dev, args, env)?;
    let trained = training.steps();
    training.finish(trained)
}
