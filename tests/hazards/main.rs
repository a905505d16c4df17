//! Planted hazards: each gives its exact report from the checker (or is refused by the API), and
//! its corrected twin gives none. Run on every device: the checker is host-side bookkeeping, so
//! the reports are the same on CUDA. See: `notes/te-graphs.md` §2.4, `notes/offload.md` §3.6.

#[path = "../common/mod.rs"]
mod common;

use anyhow::{ensure, Context};
use graphed::check::{Checker, Hazard, HazardKind, Site};
use graphed::device::{CaptureMode, Device, DeviceBuffer, GraphExec, Stream};
use graphed::memory::CachingAllocator;
use graphed::ops::elementwise;
use graphed::Error;

/// The single hazard the device's checker found since the last call; forgets it.
fn one_hazard(dev: &Device) -> anyhow::Result<Hazard> {
    let hazards = Checker::of(dev).context("no checker")?.take_hazards();
    ensure!(hazards.len() == 1, "expected one hazard, got {hazards:#?}");
    Ok(hazards.into_iter().next().expect("one"))
}

fn no_hazard(dev: &Device) -> anyhow::Result<()> {
    let hazards = Checker::of(dev).context("no checker")?.take_hazards();
    ensure!(hazards.is_empty(), "the corrected twin must be clean: {hazards:#?}");
    Ok(())
}

/// A graph on `g`: y = 2x, then (if `record_early`) the external record, then z = 3x, then (if
/// not) the record; t = 10y after everything (the tail).
struct SideGraph {
    exec: GraphExec,
    done: graphed::device::Event,
    x: DeviceBuffer<f32>,
    y: DeviceBuffer<f32>,
    z: DeviceBuffer<f32>,
}

fn side_graph(dev: &Device, g: &Stream, record_early: bool) -> anyhow::Result<SideGraph> {
    let (x, y, z, t) = (dev.alloc::<f32>(64)?, dev.alloc::<f32>(64)?, dev.alloc::<f32>(64)?, dev.alloc::<f32>(64)?);
    let done = dev.event()?;
    let cap = g.capture(CaptureMode::ThreadLocal)?;
    elementwise::scale(y.view(), x.view(), 2.0, g)?;
    if record_early {
        g.record_external(&done)?;
    }
    elementwise::scale(z.view(), x.view(), 3.0, g)?;
    if !record_early {
        g.record_external(&done)?;
    }
    elementwise::scale(t.view(), x.view(), 10.0, g)?;
    let exec = cap.finish()?.instantiate()?;
    Ok(SideGraph { exec, done, x, y, z })
}

/// Replays on `g` entered after `main`'s work; the caller resumes on `resume_at`.
fn replay(
    dev: &Device,
    main: &Stream,
    g: &Stream,
    graph: &SideGraph,
    resume_at: &graphed::device::Event,
) -> anyhow::Result<()> {
    let entry = dev.event()?;
    main.record(&entry)?;
    g.wait(&entry)?;
    graph.exec.launch(g)?;
    main.wait(resume_at)?;
    Ok(())
}

/// te-graphs §2.4 item 1 / offload H1, the upstream PR review's bug: the caller waits on an
/// event the graph never records, so it reads outputs before the graph wrote them.
fn never_recorded_event(dev: &Device) -> anyhow::Result<()> {
    let (main, g) = (dev.stream()?, dev.stream()?);
    let graph = side_graph(dev, &g, false)?;
    let stranger = dev.event()?;
    replay(dev, &main, &g, &graph, &stranger)?;
    let h = one_hazard(dev)?;
    ensure!(
        h.kind == HazardKind::WaitNeverRecorded
            && h.event == Some(stranger.id())
            && h.later.site == Site::Stream(main.id()),
        "{h}"
    );
    graph.y.to_vec(&main)?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::ReadAfterWrite && h.buffer == Some(graph.y.id()), "{h}");
    ensure!(
        h.earlier
            .as_ref()
            .is_some_and(|e| e.op == "scale_f32" && matches!(e.site, Site::Graph { stream, .. } if stream == g.id())),
        "{h}"
    );
    ensure!(h.later.site == Site::Host && h.later.op == "to_vec", "{h}");
    ensure!(h.bytes == Some((0, 256)), "{h}");
    g.synchronize()?;
    // Twin: wait on the event the graph records.
    replay(dev, &main, &g, &graph, &graph.done)?;
    graph.y.to_vec(&main)?;
    graph.z.to_vec(&main)?;
    no_hazard(dev)?;
    g.synchronize()?;
    Ok(())
}

/// te-graphs §2.4 item 2 / offload H2: the event is recorded before the last output write.
fn event_recorded_before_the_last_output(dev: &Device) -> anyhow::Result<()> {
    let (main, g) = (dev.stream()?, dev.stream()?);
    let early = side_graph(dev, &g, true)?;
    replay(dev, &main, &g, &early, &early.done)?;
    early.y.to_vec(&main)?;
    no_hazard(dev)?;
    early.z.to_vec(&main)?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::ReadAfterWrite && h.buffer == Some(early.z.id()), "{h}");
    ensure!(
        h.fix.contains(&format!("stream {}", g.id())) && h.fix.contains("scale_f32"),
        "the fix names the producer: {h}"
    );
    g.synchronize()?;
    let late = side_graph(dev, &g, false)?;
    replay(dev, &main, &g, &late, &late.done)?;
    late.z.to_vec(&main)?;
    no_hazard(dev)?;
    g.synchronize()?;
    Ok(())
}

/// te-graphs §2.4 item 3: the caller writes the next input while the graph's tail still reads it.
fn static_input_overwritten_under_the_tail(dev: &Device) -> anyhow::Result<()> {
    let (main, g) = (dev.stream()?, dev.stream()?);
    let graph = side_graph(dev, &g, false)?;
    replay(dev, &main, &g, &graph, &graph.done)?;
    elementwise::fill(graph.x.view(), 5.0, &main)?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::WriteAfterRead && h.buffer == Some(graph.x.id()), "{h}");
    ensure!(
        h.earlier.as_ref().is_some_and(|e| matches!(e.site, Site::Graph { .. }))
            && h.later.site == Site::Stream(main.id()),
        "{h}"
    );
    // Twin: join the whole graph before writing the input (R4).
    let joined = dev.event()?;
    g.record(&joined)?;
    main.wait(&joined)?;
    elementwise::fill(graph.x.view(), 6.0, &main)?;
    no_hazard(dev)?;
    g.synchronize()?;
    Ok(())
}

/// The host reads a pinned buffer before the D2H copy into it finished.
fn host_reads_pinned_memory_early(dev: &Device) -> anyhow::Result<()> {
    let (s, d2h) = (dev.stream()?, dev.stream()?);
    let x = dev.alloc_from(&s, &[3.0f32; 32])?;
    let host = dev.alloc_pinned::<f32>(32)?;
    let copied = dev.event()?;
    d2h.copy_d2h(&x, host.view())?;
    d2h.record(&copied)?;
    host.read()?;
    let h = one_hazard(dev)?;
    ensure!(
        h.kind == HazardKind::ReadAfterWrite && h.buffer == Some(host.id()) && h.later.op == "PinnedBuffer::read",
        "{h}"
    );
    ensure!(h.earlier.as_ref().is_some_and(|e| e.op == "copy_d2h" && e.site == Site::Stream(d2h.id())), "{h}");
    copied.synchronize()?;
    ensure!(host.read()? == vec![3.0; 32]);
    no_hazard(dev)
}

/// The host writes a pinned buffer that a queued H2D copy still reads.
fn host_writes_pinned_memory_a_copy_still_reads(dev: &Device) -> anyhow::Result<()> {
    let h2d = dev.stream()?;
    let host = dev.alloc_pinned::<f32>(32)?;
    let act = dev.alloc::<f32>(32)?;
    h2d.copy_h2d(host.view(), &act)?;
    host.write(&[9.0; 32])?;
    let h = one_hazard(dev)?;
    ensure!(
        h.kind == HazardKind::WriteAfterRead && h.buffer == Some(host.id()) && h.later.op == "PinnedBuffer::write",
        "{h}"
    );
    h2d.synchronize()?;
    host.write(&[8.0; 32])?;
    no_hazard(dev)
}

/// A weight written once and read by many kernels is still checked against a stream that never
/// waited for the write (the checker drops covered records, not the write). Found by fuzzing.
fn write_followed_by_many_reads(dev: &Device) -> anyhow::Result<()> {
    let (a, b) = (dev.stream()?, dev.stream()?);
    let (x, y, z) = (dev.alloc::<f32>(4)?, dev.alloc::<f32>(4)?, dev.alloc::<f32>(4)?);
    elementwise::fill(x.view(), 1.0, &a)?;
    for _ in 0..300 {
        elementwise::scale(y.view(), x.view(), 1.0, &a)?;
    }
    elementwise::scale(z.view(), x.view(), 1.0, &b)?;
    let h = one_hazard(dev)?;
    ensure!(
        h.kind == HazardKind::ReadAfterWrite
            && h.buffer == Some(x.id())
            && h.earlier.as_ref().is_some_and(|e| e.op == "fill_f32"),
        "{h}"
    );
    dev.synchronize()?;
    Ok(())
}

/// R6: the caller waits on the event of an earlier launch while a later launch on the graph's
/// stream, which recorded no event, is what it needed.
fn wait_on_a_stale_record(dev: &Device) -> anyhow::Result<()> {
    let (main, g) = (dev.stream()?, dev.stream()?);
    let first = side_graph(dev, &g, false)?;
    let x = dev.alloc::<f32>(64)?;
    let cap = g.capture(CaptureMode::ThreadLocal)?;
    elementwise::fill(x.view(), 1.0, &g)?;
    let second = cap.finish()?.instantiate()?;
    first.exec.launch(&g)?;
    second.launch(&g)?;
    main.wait(&first.done)?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::StaleRecord && h.event == Some(first.done.id()), "{h}");
    ensure!(
        h.earlier.as_ref().is_some_and(|e| matches!(e.site, Site::Graph { graph, .. } if graph == second.id())),
        "{h}"
    );
    first.exec.launch(&g)?;
    main.wait(&first.done)?;
    no_hazard(dev)?;
    dev.synchronize()?;
    Ok(())
}

/// Offload H9: a reloaded buffer is consumed before its H2D copy ended.
fn reloaded_buffer_consumed_early(dev: &Device) -> anyhow::Result<()> {
    let (main, h2d) = (dev.stream()?, dev.stream()?);
    let host = dev.alloc_pinned::<f32>(64)?;
    host.write(&[1.5; 64])?;
    let (act, out) = (dev.alloc::<f32>(64)?, dev.alloc::<f32>(64)?);
    h2d.copy_h2d(host.view(), &act)?;
    elementwise::scale(out.view(), act.view(), 2.0, &main)?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::ReadAfterWrite && h.buffer == Some(act.id()) && h.later.op == "scale_f32", "{h}");
    ensure!(h.fix.contains(&format!("make stream {} wait", main.id())), "{h}");
    let reloaded = dev.event()?;
    h2d.record(&reloaded)?;
    main.wait(&reloaded)?;
    elementwise::scale(out.view(), act.view(), 2.0, &main)?;
    no_hazard(dev)?;
    ensure!(out.to_vec(&main)? == vec![3.0; 64]);
    Ok(())
}

/// Offload H7: the GPU source of an offload is overwritten before its D2H copy finished.
fn offload_source_reused_early(dev: &Device) -> anyhow::Result<()> {
    let (main, d2h) = (dev.stream()?, dev.stream()?);
    let act = dev.alloc_from(&main, &[2.0f32; 64])?;
    let host = dev.alloc_pinned::<f32>(64)?;
    let ready = dev.event()?;
    main.record(&ready)?;
    d2h.wait(&ready)?;
    d2h.copy_d2h(&act, host.view())?;
    elementwise::fill(act.view(), 0.0, &main)?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::WriteAfterRead && h.buffer == Some(act.id()) && h.later.op == "fill_f32", "{h}");
    let offloaded = dev.event()?;
    d2h.record(&offloaded)?;
    main.wait(&offloaded)?;
    elementwise::fill(act.view(), 0.0, &main)?;
    no_hazard(dev)
}

/// Offload H8: a pinned buffer is written by a D2H copy while an earlier H2D still reads it.
fn pinned_buffer_reused_before_its_reload_read_it(dev: &Device) -> anyhow::Result<()> {
    let (h2d, d2h) = (dev.stream()?, dev.stream()?);
    let host = dev.alloc_pinned::<f32>(64)?;
    let (a, b) = (dev.alloc_from(&h2d, &[1.0f32; 64])?, dev.alloc::<f32>(64)?);
    h2d.copy_h2d(host.view(), &b)?;
    d2h.copy_d2h(&a, host.view())?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::WriteAfterRead && h.buffer == Some(host.id()) && h.later.op == "copy_d2h", "{h}");
    let read = dev.event()?;
    h2d.record(&read)?;
    d2h.wait(&read)?;
    d2h.copy_d2h(&a, host.view())?;
    no_hazard(dev)?;
    dev.synchronize()?;
    Ok(())
}

/// Offload H5: a reload and its consumer in one graph with no edge between them.
fn unordered_nodes_in_one_graph(dev: &Device) -> anyhow::Result<()> {
    let (g, h2d) = (dev.stream()?, dev.stream()?);
    let host = dev.alloc_pinned::<f32>(64)?;
    let (act, out) = (dev.alloc::<f32>(64)?, dev.alloc::<f32>(64)?);
    let (fork, join) = (dev.event()?, dev.event()?);
    let cap = g.capture(CaptureMode::ThreadLocal)?;
    g.record(&fork)?;
    h2d.wait(&fork)?;
    h2d.copy_h2d(host.view(), &act)?;
    elementwise::scale(out.view(), act.view(), 2.0, &g)?;
    h2d.record(&join)?;
    g.wait(&join)?;
    let graph = cap.finish()?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::ReadAfterWrite && h.buffer == Some(act.id()), "reported at capture: {h}");
    ensure!(h.earlier.as_ref().is_some_and(|e| e.op == "copy_h2d") && h.later.op == "scale_f32", "{h}");
    drop(graph);
    let cap = g.capture(CaptureMode::ThreadLocal)?;
    g.record(&fork)?;
    h2d.wait(&fork)?;
    h2d.copy_h2d(host.view(), &act)?;
    h2d.record(&join)?;
    g.wait(&join)?;
    elementwise::scale(out.view(), act.view(), 2.0, &g)?;
    cap.finish()?;
    no_hazard(dev)
}

/// te-graphs §2.4 item 4 / offload H6: two graphs of one pool replayed concurrently. The pool
/// refuses it; with the check off, the checker reports the overlap in the shared memory.
fn two_pool_graphs_replayed_concurrently(dev: &Device) -> anyhow::Result<()> {
    let alloc = CachingAllocator::new(dev);
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    let pool = alloc.new_pool();
    let (x, out_a, out_b) = (dev.alloc_from(&s1, &[1.0f32; 256])?, dev.alloc::<f32>(256)?, dev.alloc::<f32>(256)?);
    let mut execs = vec![];
    for out in [&out_a, &out_b] {
        let cap = alloc.capture(&s1, CaptureMode::ThreadLocal, &pool)?;
        let scratch = alloc.alloc::<f32>(&s1, 256)?;
        elementwise::scale(scratch.view(), x.view(), 2.0, &s1)?;
        elementwise::scale(out.view(), scratch.view(), 1.0, &s1)?;
        drop(scratch);
        execs.push(cap.finish()?.instantiate()?);
    }
    no_hazard(dev)?;
    execs[0].launch(&s1)?;
    ensure!(matches!(execs[1].launch(&s2), Err(Error::PoolConcurrent { .. })));
    pool.disable_order_check();
    execs[1].launch(&s2)?;
    let hazards = Checker::of(dev).context("checker")?.take_hazards();
    ensure!(
        !hazards.is_empty()
            && hazards.iter().all(|h| matches!(h.later.site, Site::Graph { stream, .. } if stream == s2.id())),
        "{hazards:#?}"
    );
    ensure!(
        hazards.iter().any(|h| h.kind == HazardKind::WriteAfterWrite),
        "the shared scratch is written by both: {hazards:#?}"
    );
    dev.synchronize()?;
    no_hazard(dev)
}

/// R4: a graph reset while the host has not seen its last launch finish.
fn reset_before_the_tail_is_joined(dev: &Device) -> anyhow::Result<()> {
    let (main, g) = (dev.stream()?, dev.stream()?);
    let mut graph = side_graph(dev, &g, false)?;
    replay(dev, &main, &g, &graph, &graph.done)?;
    graph.exec.reset()?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::TailNotJoined && h.later.site == Site::Host, "{h}");
    let mut twin = side_graph(dev, &g, false)?;
    replay(dev, &main, &g, &twin, &twin.done)?;
    g.synchronize()?;
    twin.exec.reset()?;
    no_hazard(dev)
}

/// Strict mode turns the report into the call's error.
fn strict_mode_returns_the_hazard(dev: &Device) -> anyhow::Result<()> {
    let checker = Checker::of(dev).context("checker")?;
    checker.set_strict(true);
    let (a, b) = (dev.stream()?, dev.stream()?);
    let x = dev.alloc::<f32>(16)?;
    elementwise::fill(x.view(), 1.0, &a)?;
    let r = elementwise::fill(x.view(), 2.0, &b);
    checker.set_strict(false);
    ensure!(matches!(&r, Err(Error::Hazard(h)) if h.kind == HazardKind::WriteAfterWrite), "{r:?}");
    ensure!(checker.hazards().is_empty(), "strict mode returns the hazard instead of recording it");
    ensure!(checker.hazards_json() == "[]");
    dev.synchronize()?;
    Ok(())
}

/// A rebound graph reads the caller's buffer where it is: a write to that buffer on another
/// stream, unordered with the launch, races with it (and no longer with the captured buffer).
fn rebound_read_races_a_write_to_the_new_buffer(dev: &Device) -> anyhow::Result<()> {
    use graphed::device::Rebind;
    let (g, other) = (dev.stream()?, dev.stream()?);
    let (x, y, fresh) = (dev.alloc_from(&g, &[1.0f32; 64])?, dev.alloc::<f32>(64)?, dev.alloc_from(&g, &[2.0f32; 64])?);
    let cap = g.capture(CaptureMode::ThreadLocal)?;
    elementwise::scale(y.view(), x.view(), 2.0, &g)?;
    let exec = cap.finish()?.instantiate()?;
    exec.rebind(&[Rebind::new(x.view(), fresh.view())?])?;
    dev.synchronize()?;
    exec.launch(&g)?;
    elementwise::fill(fresh.view(), 3.0, &other)?;
    let h = one_hazard(dev)?;
    ensure!(h.kind == HazardKind::WriteAfterRead && h.buffer == Some(fresh.id()), "{h}");
    dev.synchronize()?;
    exec.launch(&g)?;
    elementwise::fill(x.view(), 3.0, &other)?;
    no_hazard(dev)?;
    dev.synchronize()?;
    Ok(())
}

per_device!(
    rebound_read_races_a_write_to_the_new_buffer,
    never_recorded_event,
    event_recorded_before_the_last_output,
    static_input_overwritten_under_the_tail,
    host_reads_pinned_memory_early,
    reloaded_buffer_consumed_early,
    host_writes_pinned_memory_a_copy_still_reads,
    wait_on_a_stale_record,
    write_followed_by_many_reads,
    offload_source_reused_early,
    pinned_buffer_reused_before_its_reload_read_it,
    unordered_nodes_in_one_graph,
    two_pool_graphs_replayed_concurrently,
    reset_before_the_tail_is_joined,
    strict_mode_returns_the_hazard,
);
