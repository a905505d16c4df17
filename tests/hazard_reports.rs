//! The checker's reports through `tracing`, in a test binary of its own: `tracing` caches whether
//! a call site is enabled for the whole process, so a test thread that reaches the checker's
//! warning with no subscriber while this one captures it (the other hazard tests run in parallel
//! in their binary) can leave the call site disabled and lose warnings here.

use anyhow::{ensure, Context};
use graphed::check::Checker;
use graphed::device::Device;
use graphed::ops::elementwise;

/// Every report is shown once, as a `tracing` warning, when it is found and counted; the
/// checker keeps only the first `MAX_KEPT_HAZARDS`, so a long run does not grow without bound.
#[test]
fn reports_are_shown_once_counted_and_capped() -> anyhow::Result<()> {
    use graphed::check::MAX_KEPT_HAZARDS;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().map_err(|_| std::io::Error::other("poisoned"))?.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    let races = MAX_KEPT_HAZARDS + 10;
    let dev = Device::sim();
    tracing::subscriber::with_default(subscriber, || -> anyhow::Result<()> {
        let (a, b) = (dev.stream()?, dev.stream()?);
        let x = dev.alloc::<f32>(8)?;
        for _ in 0..races {
            elementwise::fill(x.view(), 1.0, &a)?;
            elementwise::fill(x.view(), 2.0, &b)?;
            dev.synchronize()?;
        }
        Ok(())
    })?;
    let checker = Checker::of(&dev).context("no checker")?;
    ensure!(checker.found() == races as u64, "found {} of {races}", checker.found());
    ensure!(checker.hazards().len() == MAX_KEPT_HAZARDS, "kept {}", checker.hazards().len());
    let text = String::from_utf8(sink.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone())?;
    let shown = text.lines().filter(|l| l.contains("WARN") && l.contains("WriteAfterWrite")).count();
    ensure!(shown == races, "{shown} warnings shown for {races} reports");
    Ok(())
}
