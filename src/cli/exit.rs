//! How `graphed` ends, and its exit codes (docs/train.md, "Exit codes"): 0 done; 1 failed while
//! running; 2 refused its input (arguments, files) before running anything; 130 interrupted.
//!
//! A refusal is a [`Refused`] error, one of `report`'s (its results files, or a page that
//! differs from them), or one of the library's errors about a user's input (a damaged or
//! mismatched checkpoint, a model configuration, an offload configuration); an interrupt is
//! [`Interrupted`] (or [`InterruptedAgain`]); anything else is a failure. `main` returns the code
//! of every outcome ([`code`]) but two that cannot wait for it, which end the process at once
//! with the same codes ([`now`]).

use std::process::ExitCode;

/// The input was refused before anything ran: what is wrong and what to do instead.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

impl Refused {
    /// `why` as an `anyhow` error (the CLI's error type).
    pub fn error(why: impl Into<String>) -> anyhow::Error {
        Refused(why.into()).into()
    }
}

/// Returns early with a [`Refused`] error formatted like `format!`.
macro_rules! refuse {
    ($($arg:tt)*) => {
        return Err($crate::cli::exit::Refused::error(format!($($arg)*)))
    };
}
pub(crate) use refuse;

/// A SIGINT or SIGTERM ended the run after a whole step; what was kept says where it stands.
#[derive(Debug, thiserror::Error)]
#[error("interrupted after step {steps}; {kept}")]
pub struct Interrupted {
    /// Steps done when the run stopped.
    pub steps: usize,
    /// What was saved or flushed, and how to continue.
    pub kept: String,
}

/// A second SIGINT or SIGTERM ended the run at once, in the middle of a step: nothing was saved.
#[derive(Debug, thiserror::Error)]
#[error("interrupted again: stopping now, without saving")]
pub struct InterruptedAgain;

/// The exit code for the outcome of a command.
pub fn code(outcome: &anyhow::Result<()>) -> ExitCode {
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => ExitCode::from(status(e)),
    }
}

/// Ends the process now with `error`'s exit code, shown on stderr as `main` shows it (on a line
/// of its own, off a progress bar's). It cannot return to `main`: it serves the two ends that
/// come on another thread while `main`'s is busy, a second interrupt (on the signal handler's
/// thread, in the middle of a step) and a peer's death that left this rank's host blocked on the
/// GPU (on the group's watch). Nothing of the run is unwound; the driver reclaims the GPU as the
/// process ends.
pub fn now(error: anyhow::Error) -> ! {
    eprintln!("\ngraphed: {error:#}");
    std::process::exit(i32::from(status(&error)))
}

/// The exit status of a failed command: 130 interrupted, 2 refused, 1 failed.
fn status(e: &anyhow::Error) -> u8 {
    if e.downcast_ref::<Interrupted>().is_some() || e.downcast_ref::<InterruptedAgain>().is_some() {
        return 130;
    }
    if is_refusal(e) {
        return 2;
    }
    1
}

/// Whether `e` is about the user's input rather than a failure while running.
fn is_refusal(e: &anyhow::Error) -> bool {
    use graphed::Error;
    e.chain().any(|cause| {
        cause.downcast_ref::<Refused>().is_some()
            || cause.downcast_ref::<crate::cli::report::ReportError>().is_some()
            || match cause.downcast_ref::<Error>() {
                Some(Error::Checkpoint { .. } | Error::Config(_) | Error::Scaling(_)) => true,
                Some(Error::Offload(kind)) => kind.is_config(),
                _ => false,
            }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_has_its_code() {
        let code_of = |r: anyhow::Result<()>| format!("{:?}", code(&r));
        assert_eq!(code_of(Ok(())), format!("{:?}", ExitCode::SUCCESS));
        assert_eq!(code_of(Err(Refused::error("no"))), format!("{:?}", ExitCode::from(2)));
        // A refusal keeps its code under added context.
        assert_eq!(code_of(Err(Refused::error("no").context("while planning"))), format!("{:?}", ExitCode::from(2)));
        let stopped = Interrupted { steps: 3, kept: "nothing saved".into() };
        assert_eq!(code_of(Err(stopped.into())), format!("{:?}", ExitCode::from(130)));
        assert_eq!(code_of(Err(InterruptedAgain.into())), format!("{:?}", ExitCode::from(130)));
        assert_eq!(code_of(Err(anyhow::anyhow!("device lost"))), format!("{:?}", ExitCode::FAILURE));
        let damaged = graphed::Error::Checkpoint {
            path: "x".into(),
            kind: graphed::checkpoint::CheckpointErrorKind::Io("gone".into()),
        };
        assert_eq!(code_of(Err(damaged.into())), format!("{:?}", ExitCode::from(2)));
    }
}
