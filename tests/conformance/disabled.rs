//! Nodes turned off in an executable (`GraphExec::set_enabled`): they do nothing, what came
//! after them still waits on what they waited on, they run again when turned on, the checker
//! sees launches without them, and what cannot be turned off is refused with nothing changed.

use anyhow::ensure;
use graphed::device::{CaptureMode, Device, Gemm, RebindErrorKind};
use graphed::ops::elementwise;
use graphed::{CaptureErrorKind, Error};

/// `x += 1` on the capture stream, then on a second stream a copy of `x` into `y` and `z = 2x`.
/// With the copy turned off, `z` still sees the increment (the copy's edges are kept: under the
/// simulator's adversarial orders a dropped edge would let the scale read `x` first), `y` keeps
/// its contents, and turned on again the copy runs.
fn a_node_turned_off_does_nothing_and_keeps_its_edges(dev: &Device) -> anyhow::Result<()> {
    const N: usize = 512;
    let (s, side) = (dev.stream()?, dev.stream()?);
    let x = dev.alloc_from(&s, &vec![1.0f32; N])?;
    let (y, z) = (dev.alloc_from(&s, &vec![-1.0f32; N])?, dev.alloc::<f32>(N)?);
    s.synchronize()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::add_scalar(x.view(), 1.0, &s)?;
    side.wait_stream(&s)?;
    side.copy_d2d(x.view(), y.view())?;
    elementwise::scale(z.view(), x.view(), 2.0, &side)?;
    s.wait_stream(&side)?;
    let exec = cap.finish()?.instantiate()?;

    ensure!(exec.set_enabled(&[y.id()], false)? == 1, "one node names y");
    ensure!(exec.set_enabled(&[y.id()], false)? == 0, "already off: nothing changes");
    exec.launch(&s)?;
    s.synchronize()?;
    ensure!(x.to_vec(&s)? == vec![2.0; N], "the increment ran");
    ensure!(y.to_vec(&s)? == vec![-1.0; N], "the copy did not");
    ensure!(z.to_vec(&s)? == vec![4.0; N], "the scale ran after the increment");

    ensure!(exec.set_enabled(&[y.id()], true)? == 1);
    exec.launch(&s)?;
    s.synchronize()?;
    ensure!(y.to_vec(&s)? == vec![3.0; N], "on again, the copy runs");
    ensure!(z.to_vec(&s)? == vec![6.0; N]);
    Ok(())
}

/// A copy into pinned memory turned off is not a write the host's read races with: the host
/// reads right after the launch, unsynchronized, and the checker (which fails the test on any
/// hazard) reports nothing; the memory keeps what the host wrote.
fn the_checker_sees_launches_without_what_is_off(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[5.0f32; 64])?;
    let host = dev.alloc_pinned::<f32>(64)?;
    host.write(&[7.0; 64])?;
    s.synchronize()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::add_scalar(x.view(), 1.0, &s)?;
    s.copy_d2h(x.view(), host.view())?;
    let exec = cap.finish()?.instantiate()?;
    ensure!(exec.set_enabled(&[host.id()], false)? == 1);
    exec.launch(&s)?;
    ensure!(host.read()? == vec![7.0; 64], "nothing copied into the host's memory");
    s.synchronize()?;
    ensure!(x.to_vec(&s)? == vec![6.0; 64]);
    Ok(())
}

/// A GEMM's operand (a library call's nodes are the library's) and a buffer no node names are
/// refused, and the executable still runs every node.
fn what_cannot_be_turned_off_is_refused(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (a, c, w) = (dev.alloc_from(&s, &[1.0f32; 64])?, dev.alloc::<f32>(64)?, dev.alloc_from(&s, &[0.0f32; 64])?);
    let unnamed = dev.alloc::<f32>(64)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    s.gemm(Gemm::new(c.view(), a.view(), a.view(), (8, 8, 8)))?;
    elementwise::add_scalar(w.view(), 1.0, &s)?;
    let exec = cap.finish()?.instantiate()?;
    for (buffer, what) in [(a.id(), "opaque"), (unnamed.id(), "not named")] {
        let kind = match exec.set_enabled(&[buffer], false) {
            Err(Error::Rebind { kind, .. }) => kind,
            other => anyhow::bail!("{what}: expected a refusal, got {other:?}"),
        };
        let ok = match what {
            "opaque" => matches!(kind, RebindErrorKind::Opaque { .. }),
            _ => matches!(kind, RebindErrorKind::NotNamed { .. }),
        };
        ensure!(ok, "{what}: {kind}");
    }
    exec.launch(&s)?;
    ensure!(c.to_vec(&s)? == vec![8.0; 64], "the GEMM ran");
    ensure!(w.to_vec(&s)? == vec![1.0; 64]);
    Ok(())
}

/// Work captured inside `capture_off` starts turned off in every executable of the graph, and
/// runs once turned on; outside a capture the call is refused before `f` runs.
fn work_captured_off_starts_off(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let (x, y) = (dev.alloc_from(&s, &[2.0f32; 128])?, dev.alloc_from(&s, &[0.0f32; 128])?);
    let mut ran = false;
    match s.capture_off(|| {
        ran = true;
        Ok(())
    }) {
        Err(Error::Capture { kind: CaptureErrorKind::OffOutsideCapture, .. }) => {}
        other => anyhow::bail!("capture_off outside a capture: {other:?}"),
    }
    ensure!(!ran, "refused before anything ran");
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    s.capture_off(|| elementwise::scale(y.view(), x.view(), 3.0, &s))?;
    elementwise::add_scalar(x.view(), 1.0, &s)?;
    let graph = cap.finish()?;
    let (first, second) = (graph.instantiate()?, graph.instantiate()?);
    first.launch(&s)?;
    ensure!(y.to_vec(&s)? == vec![0.0; 128] && x.to_vec(&s)? == vec![3.0; 128], "the scale starts off");
    ensure!(second.set_enabled(&[y.id()], true)? == 1, "each executable starts with it off");
    second.launch(&s)?;
    ensure!(y.to_vec(&s)? == vec![9.0; 128], "turned on, it runs");
    ensure!(second.set_enabled(&[y.id()], false)? == 1 && first.set_enabled(&[y.id()], false)? == 0);
    Ok(())
}

crate::per_device!(
    work_captured_off_starts_off,
    a_node_turned_off_does_nothing_and_keeps_its_edges,
    the_checker_sees_launches_without_what_is_off,
    what_cannot_be_turned_off_is_refused,
);
