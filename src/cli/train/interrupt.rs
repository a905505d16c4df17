//! SIGINT and SIGTERM during `train`: the first asks the run to stop after the step in flight
//! (then it saves where `--save` is given, flushes its metrics and exits with 130); a second one
//! ends the process at once, without saving, with the same code ([`exit::now`](crate::cli::exit::now)).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Signals received since the handler was installed.
static RECEIVED: AtomicUsize = AtomicUsize::new(0);

/// Whether the handler could be installed (once per process).
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

/// Whether the user asked the run to stop.
pub struct Interrupt;

impl Interrupt {
    /// Installs the handler (once per process; later calls share it).
    pub fn install() -> anyhow::Result<Interrupt> {
        let installed = INSTALLED.get_or_init(|| {
            ctrlc::set_handler(|| {
                if RECEIVED.fetch_add(1, Ordering::SeqCst) == 0 {
                    eprintln!("\ngraphed: stopping after this step (interrupt again to stop now, without saving)");
                } else {
                    crate::cli::exit::now(crate::cli::exit::InterruptedAgain.into());
                }
            })
            .map_err(|e| e.to_string())
        });
        match installed {
            Ok(()) => Ok(Interrupt),
            Err(e) => anyhow::bail!("cannot install the interrupt handler: {e}"),
        }
    }

    /// Whether a signal asked the run to stop.
    pub fn requested(&self) -> bool {
        RECEIVED.load(Ordering::SeqCst) > 0
    }
}
