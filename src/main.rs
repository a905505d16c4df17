//! The `graphed` command: `train` (the main job), `bench`.

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = <cli::args::Cli as clap::Parser>::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("graphed: {e:#}");
            ExitCode::from(2)
        }
    }
}
