//! Events between streams and with the host.

use anyhow::ensure;
use graphed::device::{CaptureMode, Device, NodeKind};
use graphed::ops::elementwise;
use graphed::CaptureErrorKind;

fn event_orders_two_streams(dev: &Device) -> anyhow::Result<()> {
    let (producer, consumer) = (dev.stream()?, dev.stream()?);
    let n = 2048;
    let (x, y) = (dev.alloc::<f32>(n)?, dev.alloc::<f32>(n)?);
    let ready = dev.event()?;
    for step in 0..5 {
        elementwise::fill(x.view(), step as f32, &producer)?;
        producer.record(&ready)?;
        consumer.wait(&ready)?;
        elementwise::scale(y.view(), x.view(), 2.0, &consumer)?;
        // The producer must not overwrite x before the consumer read it.
        let done = dev.event()?;
        consumer.record(&done)?;
        producer.wait(&done)?;
    }
    ensure!(y.to_vec(&consumer)?.iter().all(|v| *v == 8.0));
    Ok(())
}

fn wait_on_never_recorded_event_does_nothing(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let never = dev.event()?;
    s.wait(&never)?;
    ensure!(never.query()?, "a never-recorded event counts as complete");
    never.synchronize()?;
    let x = dev.alloc::<f32>(4)?;
    elementwise::fill(x.view(), 7.0, &s)?;
    ensure!(x.to_vec(&s)? == vec![7.0; 4]);
    crate::common::expect_only_hazard(dev, graphed::check::HazardKind::WaitNeverRecorded)
}

fn wait_binds_to_the_record_at_call_time(dev: &Device) -> anyhow::Result<()> {
    // s2 waits on e's first record; s1 then records e again after waiting on s2. If the wait
    // followed the later record the streams would wait on each other and never finish.
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    let (e, f) = (dev.event()?, dev.event()?);
    let x = dev.alloc::<f32>(16)?;
    elementwise::fill(x.view(), 1.0, &s1)?;
    s1.record(&e)?;
    s2.wait(&e)?;
    elementwise::add_scalar(x.view(), 1.0, &s2)?;
    s2.record(&f)?;
    s1.wait(&f)?;
    s1.record(&e)?;
    dev.synchronize()?;
    ensure!(x.to_vec(&s1)? == vec![2.0; 16]);
    Ok(())
}

fn query_and_synchronize_follow_the_work(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let e = dev.event()?;
    let x = dev.alloc::<f32>(1 << 16)?;
    for _ in 0..10 {
        elementwise::add_scalar(x.view(), 1.0, &s)?;
    }
    s.record(&e)?;
    // Polling must make progress and end.
    while !e.query()? {}
    ensure!(s.query()?, "the stream has nothing after the event");
    e.synchronize()?;
    ensure!(x.to_vec(&s)?.iter().all(|v| *v == 10.0));
    Ok(())
}

fn streams_with_priorities(dev: &Device) -> anyhow::Result<()> {
    let (least, greatest) = dev.priority_range()?;
    ensure!(greatest <= least, "greatest priority is numerically lowest: {greatest} vs {least}");
    let hi = dev.stream_with_priority(greatest)?;
    let lo = dev.stream_with_priority(least)?;
    ensure!(hi.priority() == greatest && lo.priority() == least);
    let x = dev.alloc::<f32>(8)?;
    elementwise::fill(x.view(), 3.0, &hi)?;
    let e = dev.event()?;
    hi.record(&e)?;
    lo.wait(&e)?;
    elementwise::add_scalar(x.view(), 1.0, &lo)?;
    ensure!(x.to_vec(&lo)? == vec![4.0; 8]);
    Ok(())
}

/// The external flag exists only during capture: outside one, an external record or wait is
/// refused with the same typed error on both devices (CUDA says CUDA_ERROR_ILLEGAL_STATE) and
/// enqueues nothing; inside one, the same event may be recorded externally twice (two record
/// nodes), as the H200 accepts.
fn external_records_and_waits_need_a_capture(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let e = dev.event()?;
    let outside = |r: graphed::Result<()>| matches!(r, Err(e) if e.capture_kind() == Some(CaptureErrorKind::ExternalOutsideCapture));
    ensure!(outside(s.record_external(&e)), "an external record outside a capture is refused");
    s.record(&e)?;
    ensure!(outside(s.wait_external(&e)), "an external wait outside a capture is refused");
    let x = dev.alloc::<f32>(4)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    s.record_external(&e)?;
    s.record_external(&e)?;
    let graph = cap.finish()?;
    ensure!(graph.node_counts()?.get(&NodeKind::EventRecord) == Some(&2), "two record nodes");
    let exec = graph.instantiate()?;
    exec.launch(&s)?;
    ensure!(x.to_vec(&s)? == vec![1.0; 4], "the graph ran");
    drop(exec);
    Ok(())
}

/// During a capture an external record is only a node for the graph's launches: it leaves the
/// event as it was for plain waits, as measured on the H200. A wait on a never-recorded event
/// then does nothing (it forks no stream into the capture), and a wait on an event recorded
/// before the capture still binds to that record, which the capturing stream may not wait for.
fn an_external_record_leaves_the_event_for_plain_waits(dev: &Device) -> anyhow::Result<()> {
    let (s, other) = (dev.stream()?, dev.stream()?);
    let x = dev.alloc::<f32>(4)?;
    let fresh = dev.event()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    s.record_external(&fresh)?;
    other.wait(&fresh)?;
    ensure!(other.capture_id()?.is_none(), "a wait after the external record forked its stream into the capture");
    s.wait(&fresh)?;
    let exec = cap.finish()?.instantiate()?;
    exec.launch(&s)?;
    ensure!(x.to_vec(&s)? == vec![1.0; 4], "the graph ran");
    drop(exec);

    let before = dev.event()?;
    s.record(&before)?;
    s.synchronize()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    s.record_external(&before)?;
    match s.wait(&before) {
        Err(e) if e.capture_kind() == Some(CaptureErrorKind::Isolation) => {}
        other => anyhow::bail!("a capturing stream waiting on a record made before the capture: {other:?}"),
    }
    ensure!(cap.finish().is_err(), "the isolation error invalidated the capture");
    Ok(())
}

/// An event last recorded inside a capture that has ended stands for no work: a wait on it, a
/// query and a synchronize are refused with one typed error on both devices (the H200 says
/// CUDA_ERROR_INVALID_VALUE), a capturing stream's wait on it also invalidates its capture, and a
/// new record outside a capture makes the event usable again.
fn a_record_of_an_ended_capture_is_refused(dev: &Device) -> anyhow::Result<()> {
    let (s, other) = (dev.stream()?, dev.stream()?);
    let x = dev.alloc::<f32>(4)?;
    let e = dev.event()?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    s.record(&e)?;
    let exec = cap.finish()?.instantiate()?;
    let ended = |r: graphed::Result<()>| matches!(r, Err(err) if err.capture_kind() == Some(CaptureErrorKind::RecordOfEndedCapture));
    ensure!(ended(other.wait(&e)), "a wait on it");
    ensure!(ended(e.query().map(|_| ())), "a query of it");
    ensure!(ended(e.synchronize()), "a synchronize of it");
    let cap = other.capture(CaptureMode::ThreadLocal)?;
    ensure!(ended(other.wait(&e)), "a capturing stream's wait on it");
    ensure!(cap.finish().is_err(), "the capture survived the refused wait");
    exec.launch(&s)?;
    s.record(&e)?;
    other.wait(&e)?;
    ensure!(x.to_vec(&other)? == vec![1.0; 4], "recorded again outside, the event orders the streams");
    drop(exec);
    Ok(())
}

crate::per_device!(
    a_record_of_an_ended_capture_is_refused,
    an_external_record_leaves_the_event_for_plain_waits,
    external_records_and_waits_need_a_capture,
    event_orders_two_streams,
    wait_on_never_recorded_event_does_nothing,
    wait_binds_to_the_record_at_call_time,
    query_and_synchronize_follow_the_work,
    streams_with_priorities,
);
