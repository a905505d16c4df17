//! The `graphed` command: `train` (the main job), `bench`.

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    // The library reports through `tracing` (checker reports, a damaged kernel cache entry):
    // shown on stderr, warnings and up unless `GRAPHED_LOG` says otherwise (`info`, `debug`, ...).
    let filter = tracing_subscriber::EnvFilter::try_from_env("GRAPHED_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only on a terminal: a log redirected to a file, or a rank's stderr that the
    // launcher prefixes, stays plain text.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .without_time()
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .init();
    // clap's own refusals of the arguments exit with 2, as `exit::Refused` does.
    let args = <cli::args::Cli as clap::Parser>::parse();
    let outcome = cli::run(args);
    if let Err(e) = &outcome {
        eprintln!("graphed: {e:#}");
    }
    cli::exit::code(&outcome)
}
