//! SIGINT and SIGTERM during `train`: the first asks the run to stop after the step in flight
//! (then it saves where `--save` is given, flushes its metrics and exits with 130); a second one
//! ends the process at once, without saving.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;

/// Signals received since the handler was installed, shared with the handler.
static RECEIVED: OnceLock<Arc<AtomicUsize>> = OnceLock::new();

/// Whether the user asked the run to stop.
#[derive(Clone)]
pub struct Interrupt(Arc<AtomicUsize>);

impl Interrupt {
    /// Installs the handler (once per process; later calls share it).
    pub fn install() -> anyhow::Result<Interrupt> {
        if let Some(received) = RECEIVED.get() {
            return Ok(Interrupt(received.clone()));
        }
        let received = RECEIVED.get_or_init(|| Arc::new(AtomicUsize::new(0))).clone();
        let count = received.clone();
        ctrlc::set_handler(move || {
            if count.fetch_add(1, Ordering::SeqCst) == 0 {
                eprintln!("\ngraphed: stopping after this step (interrupt again to stop now, without saving)");
            } else {
                eprintln!("\ngraphed: interrupted again: stopping now, without saving");
                std::process::exit(130);
            }
        })
        .map_err(|e| anyhow::anyhow!("cannot install the interrupt handler: {e}"))?;
        Ok(Interrupt(received))
    }

    /// Whether a signal asked the run to stop.
    pub fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst) > 0
    }
}
