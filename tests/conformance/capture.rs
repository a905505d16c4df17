//! Stream-capture rules: each broken rule gives the same error kind on CUDA and the simulator.

use anyhow::ensure;
use graphed::device::{CaptureMode, CaptureStatus, Device};
use graphed::ops::elementwise;
use graphed::{CaptureErrorKind as Kind, CaptureSite};

use crate::common::expect_capture;

fn wait_on_event_recorded_outside_invalidates(dev: &Device) -> anyhow::Result<()> {
    let (s, other) = (dev.stream()?, dev.stream()?);
    let outside = dev.event()?;
    let x = dev.alloc::<f32>(8)?;
    elementwise::fill(x.view(), 1.0, &other)?;
    other.record(&outside)?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    expect_capture(s.wait(&outside), Kind::Isolation)?;
    ensure!(s.capture_status()? == CaptureStatus::Invalidated);
    expect_capture(elementwise::fill(x.view(), 2.0, &s), Kind::Invalidated)?;
    ensure!(s.capture_status()? == CaptureStatus::Invalidated, "an invalidated capture stays invalid");
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    ensure!(s.capture_status()? == CaptureStatus::None);
    ensure!(x.to_vec(&other)? == vec![1.0; 8], "the refused work never ran");
    Ok(())
}

fn wait_on_own_earlier_record_also_invalidates(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let before = dev.event()?;
    let x = dev.alloc::<f32>(8)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    s.record(&before)?;
    s.synchronize()?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    expect_capture(s.wait(&before), Kind::Isolation)?;
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    Ok(())
}

fn external_wait_on_outside_event_is_allowed(dev: &Device) -> anyhow::Result<()> {
    let (s, other) = (dev.stream()?, dev.stream()?);
    let outside = dev.event()?;
    other.record(&outside)?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    s.wait_external(&outside)?;
    ensure!(s.capture_status()? == CaptureStatus::Active);
    let graph = s.end_capture()?;
    ensure!(graph.nodes()?.len() == 1);
    Ok(())
}

fn never_recorded_event_is_allowed_in_capture(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let never = dev.event()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    s.wait(&never)?;
    ensure!(cap.finish()?.nodes()?.is_empty());
    crate::common::expect_only_hazard(dev, graphed::check::HazardKind::WaitNeverRecorded)
}

fn unjoined_fork_fails_end_capture(dev: &Device) -> anyhow::Result<()> {
    let (s, side) = (dev.stream()?, dev.stream()?);
    let fork = dev.event()?;
    let x = dev.alloc::<f32>(8)?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    s.record(&fork)?;
    side.wait(&fork)?;
    ensure!(
        side.capture_status()? == CaptureStatus::Active,
        "a stream that waits on a captured event joins the capture"
    );
    elementwise::fill(x.view(), 1.0, &side)?;
    expect_capture(s.end_capture(), Kind::Unjoined)?;
    ensure!(s.capture_status()? == CaptureStatus::None && side.capture_status()? == CaptureStatus::None);
    Ok(())
}

fn end_capture_on_another_stream_is_unmatched(dev: &Device) -> anyhow::Result<()> {
    let (s, side, stranger) = (dev.stream()?, dev.stream()?, dev.stream()?);
    let fork = dev.event()?;
    let join = dev.event()?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    expect_capture(stranger.end_capture(), Kind::Unmatched)?;
    ensure!(s.capture_status()? == CaptureStatus::Active, "a stream outside the capture cannot disturb it");
    s.record(&fork)?;
    side.wait(&fork)?;
    expect_capture(side.end_capture(), Kind::Unmatched)?;
    ensure!(s.capture_status()? == CaptureStatus::Invalidated, "ending from a joined stream invalidates the capture");
    expect_capture(side.record(&join), Kind::Invalidated)?;
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    ensure!(side.capture_status()? == CaptureStatus::None);
    Ok(())
}

fn begin_on_capturing_stream_is_refused(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    expect_capture(s.begin_capture(CaptureMode::ThreadLocal), Kind::AlreadyCapturing)?;
    cap.finish()?;
    Ok(())
}

fn legacy_stream_cannot_be_captured(dev: &Device) -> anyhow::Result<()> {
    let legacy = dev.legacy_stream()?;
    ensure!(legacy.is_legacy());
    expect_capture(legacy.begin_capture(CaptureMode::ThreadLocal), Kind::Unsupported)?;
    ensure!(legacy.capture_status()? == CaptureStatus::None);
    Ok(())
}

fn synchronizing_a_capturing_stream_invalidates(dev: &Device) -> anyhow::Result<()> {
    for mode in [CaptureMode::Global, CaptureMode::ThreadLocal, CaptureMode::Relaxed] {
        let s = dev.stream()?;
        s.begin_capture(mode)?;
        expect_capture(s.synchronize(), Kind::Unsupported)?;
        expect_capture(s.end_capture(), Kind::Invalidated)?;
    }
    Ok(())
}

fn blocking_copy_from_capturing_stream_is_refused(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc::<f32>(8)?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    expect_capture(x.to_vec(&s), Kind::Unsupported)?;
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    Ok(())
}

fn allocation_follows_the_capture_mode(dev: &Device) -> anyhow::Result<()> {
    // Thread-local: forbidden on the capturing thread only.
    let s = dev.stream()?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    let other_thread = std::thread::scope(|t| t.spawn(|| dev.alloc::<f32>(64).map(|_| ())).join());
    ensure!(matches!(other_thread, Ok(Ok(()))), "thread-local capture allows other threads: {other_thread:?}");
    expect_capture(dev.alloc::<f32>(64), Kind::Unsupported)?;
    expect_capture(s.end_capture(), Kind::Invalidated)?;

    // Global: forbidden on every thread.
    s.begin_capture(CaptureMode::Global)?;
    let other_thread = std::thread::scope(|t| t.spawn(|| dev.alloc::<f32>(64).map(|_| ())).join());
    match other_thread {
        Ok(r) => expect_capture(r, Kind::Unsupported)?,
        Err(_) => anyhow::bail!("the allocating thread panicked"),
    }
    expect_capture(s.end_capture(), Kind::Invalidated)?;

    // Relaxed: allowed.
    s.begin_capture(CaptureMode::Relaxed)?;
    let buf = dev.alloc::<f32>(64)?;
    elementwise::fill(buf.view(), 1.0, &s)?;
    let graph = s.end_capture()?;
    ensure!(graph.nodes()?.len() == 1);
    Ok(())
}

fn device_synchronize_follows_the_capture_mode(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    expect_capture(dev.synchronize(), Kind::Unsupported)?;
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    Ok(())
}

fn module_loading_is_allowed_during_capture(dev: &Device) -> anyhow::Result<()> {
    // Each test runs in its own process on the GPU, so these are first loads of each module.
    let s = dev.stream()?;
    let x = dev.alloc::<f32>(8)?;
    s.begin_capture(CaptureMode::Global)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    let graph = s.end_capture()?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    dev.load_kernel(&MODULE_OF_ITS_OWN)?;
    s.end_capture()?;
    let exec = graph.instantiate()?;
    exec.launch(&s)?;
    ensure!(x.to_vec(&s)? == vec![1.0; 8]);
    Ok(())
}

static MODULE_OF_ITS_OWN: graphed::device::Kernel = graphed::device::Kernel {
    name: "nothing",
    source: r#"extern "C" __global__ void nothing() {}"#,
    params: &[],
    cpu: |_| Ok(()),
    strided: false,
};

fn waiting_on_other_work_follows_the_capture_mode(dev: &Device) -> anyhow::Result<()> {
    let (s, other) = (dev.stream()?, dev.stream()?);
    let e = dev.event()?;
    let x = dev.alloc::<f32>(8)?;
    elementwise::fill(x.view(), 1.0, &other)?;
    other.record(&e)?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    expect_capture(other.synchronize(), Kind::Unsupported)?;
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    expect_capture(e.query(), Kind::Unsupported)?;
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    s.begin_capture(CaptureMode::Relaxed)?;
    other.synchronize()?;
    ensure!(e.query()?);
    e.synchronize()?;
    s.end_capture()?;
    Ok(())
}

fn fork_without_work_needs_no_join(dev: &Device) -> anyhow::Result<()> {
    let (s, side) = (dev.stream()?, dev.stream()?);
    let fork = dev.event()?;
    let x = dev.alloc::<f32>(8)?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    s.record(&fork)?;
    side.wait(&fork)?;
    elementwise::add_scalar(x.view(), 1.0, &s)?;
    let graph = s.end_capture()?;
    ensure!(graph.nodes()?.len() == 2);
    ensure!(side.capture_status()? == CaptureStatus::None);
    Ok(())
}

fn a_wait_cannot_merge_two_captures(dev: &Device) -> anyhow::Result<()> {
    let (s, s2) = (dev.stream()?, dev.stream()?);
    let other = dev.event()?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    s2.begin_capture(CaptureMode::ThreadLocal)?;
    s2.record(&other)?;
    expect_capture(s.wait(&other), Kind::Merge)?;
    ensure!((s.capture_status()?, s2.capture_status()?) == (CaptureStatus::Invalidated, CaptureStatus::Invalidated));
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    expect_capture(s2.end_capture(), Kind::Invalidated)?;
    Ok(())
}

fn a_graph_cannot_be_launched_into_a_capture(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[0.0f32; 4])?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::add_scalar(x.view(), 1.0, &s)?;
    let exec = cap.finish()?.instantiate()?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    expect_capture(exec.launch(&s), Kind::Unsupported)?;
    ensure!(s.capture_status()? == CaptureStatus::Invalidated);
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    exec.launch(&s)?;
    ensure!(x.to_vec(&s)? == vec![1.0; 4]);
    Ok(())
}

fn end_capture_on_another_thread_is_refused(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    s.begin_capture(CaptureMode::ThreadLocal)?;
    let r = std::thread::scope(|t| t.spawn(|| s.end_capture().map(|_| ())).join());
    match r {
        Ok(r) => expect_capture(r, Kind::WrongThread)?,
        Err(_) => anyhow::bail!("the ending thread panicked"),
    }
    ensure!(s.capture_status()? == CaptureStatus::None, "the refused end also ended the capture");
    expect_capture(s.end_capture(), Kind::Unmatched)?;
    Ok(())
}

fn query_of_event_recorded_in_capture_is_refused(dev: &Device) -> anyhow::Result<()> {
    // Relaxed, so that the query itself is not a forbidden synchronous call.
    let s = dev.stream()?;
    let e = dev.event()?;
    s.begin_capture(CaptureMode::Relaxed)?;
    s.record(&e)?;
    match e.query() {
        Err(graphed::Error::Capture { on, kind: Kind::CapturedEvent, .. }) => ensure!(on == CaptureSite::Event(e.id())),
        other => anyhow::bail!("expected CapturedEvent, got {other:?}"),
    }
    ensure!(s.capture_status()? == CaptureStatus::Invalidated, "the refused query invalidates the capture");
    expect_capture(s.end_capture(), Kind::Invalidated)?;
    Ok(())
}

fn dropped_guard_ends_the_capture(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc::<f32>(8)?;
    let failing_region = || -> graphed::Result<()> {
        let _cap = s.capture(CaptureMode::ThreadLocal)?;
        elementwise::fill(x.view(), 5.0, &s)?;
        Err(graphed::Error::GraphReset { op: "planted failure" })
    };
    ensure!(failing_region().is_err());
    ensure!(s.capture_status()? == CaptureStatus::None, "the guard ended the capture");
    elementwise::fill(x.view(), 1.0, &s)?;
    ensure!(x.to_vec(&s)? == vec![1.0; 8], "the stream works eagerly again, and the abandoned capture never ran");
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::fill(x.view(), 2.0, &s)?;
    ensure!(cap.finish()?.nodes()?.len() == 1);
    Ok(())
}

crate::per_device!(
    wait_on_event_recorded_outside_invalidates,
    wait_on_own_earlier_record_also_invalidates,
    external_wait_on_outside_event_is_allowed,
    never_recorded_event_is_allowed_in_capture,
    unjoined_fork_fails_end_capture,
    end_capture_on_another_stream_is_unmatched,
    begin_on_capturing_stream_is_refused,
    legacy_stream_cannot_be_captured,
    synchronizing_a_capturing_stream_invalidates,
    blocking_copy_from_capturing_stream_is_refused,
    allocation_follows_the_capture_mode,
    device_synchronize_follows_the_capture_mode,
    module_loading_is_allowed_during_capture,
    end_capture_on_another_thread_is_refused,
    a_wait_cannot_merge_two_captures,
    a_graph_cannot_be_launched_into_a_capture,
    waiting_on_other_work_follows_the_capture_mode,
    fork_without_work_needs_no_join,
    query_of_event_recorded_in_capture_is_refused,
    dropped_guard_ends_the_capture,
);
