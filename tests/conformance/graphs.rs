//! Graphs: capture, introspection, launch on any stream, external events, lifetimes.

use anyhow::ensure;
use graphed::device::{CaptureMode, Device, NodeKind};
use graphed::ops::elementwise;
use graphed::Error;

fn graph_replays_the_captured_work(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc_from(&s, &[1.0f32; 64])?;
    let y = dev.alloc::<f32>(64)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::scale(y.view(), x.view(), 3.0, &s)?;
    elementwise::add_scalar(x.view(), 1.0, &s)?;
    let graph = cap.finish()?;
    ensure!(x.to_vec(&s)? == vec![1.0; 64], "capture must not run the work");
    let exec = graph.instantiate()?;
    exec.upload(&s)?;
    for step in 1..=3 {
        exec.launch(&s)?;
        ensure!(
            y.to_vec(&s)? == vec![3.0 * step as f32; 64],
            "replay {step}: scalars are frozen, inputs are read live"
        );
    }
    Ok(())
}

fn graph_launches_on_any_stream_run_in_order(dev: &Device) -> anyhow::Result<()> {
    let capture_stream = dev.stream()?;
    let x = dev.alloc_from(&capture_stream, &[0.0f32; 4096])?;
    let cap = capture_stream.capture(CaptureMode::ThreadLocal)?;
    for _ in 0..4 {
        elementwise::add_scalar(x.view(), 1.0, &capture_stream)?;
    }
    let exec = cap.finish()?.instantiate()?;
    // No events between the launches: CUDA runs launches of one executable one after another.
    let streams = [dev.stream()?, dev.stream()?, dev.stream()?, capture_stream.clone()];
    for s in &streams {
        exec.launch(s)?;
    }
    dev.synchronize()?;
    ensure!(x.to_vec(&capture_stream)?.iter().all(|v| *v == 16.0));
    Ok(())
}

fn fork_and_join_inside_a_capture(dev: &Device) -> anyhow::Result<()> {
    let (main, side) = (dev.stream()?, dev.stream()?);
    let (fork, join) = (dev.event()?, dev.event()?);
    let x = dev.alloc_from(&main, &[2.0f32; 128])?;
    let (a, b) = (dev.alloc::<f32>(128)?, dev.alloc::<f32>(128)?);
    let cap = main.capture(CaptureMode::ThreadLocal)?;
    main.record(&fork)?;
    side.wait(&fork)?;
    elementwise::scale(a.view(), x.view(), 2.0, &side)?;
    elementwise::scale(b.view(), x.view(), 5.0, &main)?;
    side.record(&join)?;
    main.wait(&join)?;
    elementwise::axpy(b.view(), a.view(), 1.0, &main)?;
    let graph = cap.finish()?;
    let nodes = graph.nodes()?;
    ensure!(nodes.iter().all(|n| n.kind == NodeKind::Kernel), "plain records add no nodes: {nodes:?}");
    ensure!(nodes.len() == 3);
    let last = nodes.iter().position(|n| n.name == "axpy_f32").expect("axpy node");
    ensure!(nodes[last].deps.len() == 2, "the join node depends on both branches: {:?}", nodes[last]);
    let exec = graph.instantiate()?;
    exec.launch(&side)?;
    ensure!(b.to_vec(&side)? == vec![14.0; 128]);
    Ok(())
}

fn external_record_node_signals_the_caller(dev: &Device) -> anyhow::Result<()> {
    let (main, graph_stream) = (dev.stream()?, dev.stream()?);
    let done = dev.event()?;
    let x = dev.alloc::<f32>(1024)?;
    let y = dev.alloc::<f32>(1024)?;
    let tail = dev.alloc::<f32>(1024)?;
    let cap = graph_stream.capture(CaptureMode::ThreadLocal)?;
    elementwise::scale(y.view(), x.view(), 2.0, &graph_stream)?;
    graph_stream.record_external(&done)?;
    elementwise::scale(tail.view(), y.view(), 10.0, &graph_stream)?;
    let graph = cap.finish()?;
    let counts = graph.node_counts()?;
    ensure!(counts.get(&NodeKind::EventRecord) == Some(&1), "one record node: {counts:?}");
    ensure!(graph.external_record_events()? == vec![done.id()]);
    let exec = graph.instantiate()?;
    let entry = dev.event()?;
    for step in 1..=3 {
        elementwise::fill(x.view(), step as f32, &main)?;
        main.record(&entry)?;
        graph_stream.wait(&entry)?;
        exec.launch(&graph_stream)?;
        main.wait(&done)?;
        ensure!(
            y.to_vec(&main)? == vec![2.0 * step as f32; 1024],
            "step {step}: the caller resumes after y is written"
        );
        graph_stream.synchronize()?;
        ensure!(tail.to_vec(&main)? == vec![20.0 * step as f32; 1024]);
    }
    Ok(())
}

fn external_wait_node_binds_at_each_launch(dev: &Device) -> anyhow::Result<()> {
    let (producer, g) = (dev.stream()?, dev.stream()?);
    let ready = dev.event()?;
    let x = dev.alloc::<f32>(256)?;
    let y = dev.alloc::<f32>(256)?;
    let cap = g.capture(CaptureMode::ThreadLocal)?;
    g.wait_external(&ready)?;
    elementwise::scale(y.view(), x.view(), 1.0, &g)?;
    let graph = cap.finish()?;
    ensure!(graph.node_counts()?.get(&NodeKind::EventWait) == Some(&1));
    let exec = graph.instantiate()?;
    for step in 1..=3 {
        elementwise::fill(x.view(), step as f32, &producer)?;
        producer.record(&ready)?;
        exec.launch(&g)?;
        ensure!(y.to_vec(&g)? == vec![step as f32; 256]);
    }
    Ok(())
}

fn graph_keeps_its_buffers_alive(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let out = dev.alloc::<f32>(32)?;
    let exec = {
        let scratch = dev.alloc_from(&s, &[4.0f32; 32])?;
        let cap = s.capture(CaptureMode::ThreadLocal)?;
        elementwise::scale(out.view(), scratch.view(), 0.5, &s)?;
        cap.finish()?.instantiate()?
    };
    exec.launch(&s)?;
    ensure!(out.to_vec(&s)? == vec![2.0; 32]);
    Ok(())
}

fn reset_graph_refuses_launch(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let x = dev.alloc::<f32>(4)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    s.memset(&x, 0)?;
    let mut exec = cap.finish()?.instantiate()?;
    exec.launch(&s)?;
    s.synchronize()?;
    exec.reset()?;
    ensure!(exec.is_reset());
    ensure!(matches!(exec.launch(&s), Err(Error::GraphReset { .. })));
    ensure!(matches!(exec.upload(&s), Err(Error::GraphReset { .. })));
    Ok(())
}

fn dot_dump_names_every_node(dev: &Device) -> anyhow::Result<()> {
    let s = dev.stream()?;
    let e = dev.event()?;
    let x = dev.alloc::<f32>(16)?;
    let cap = s.capture(CaptureMode::ThreadLocal)?;
    elementwise::fill(x.view(), 1.0, &s)?;
    s.record_external(&e)?;
    let graph = cap.finish()?;
    let dot = graph.dot()?;
    ensure!(dot.contains("digraph"), "not DOT: {dot}");
    ensure!(dot.contains("fill_f32"), "kernel name missing: {dot}");
    ensure!(graph.nodes()?.len() == 2);
    Ok(())
}

crate::per_device!(
    graph_replays_the_captured_work,
    graph_launches_on_any_stream_run_in_order,
    fork_and_join_inside_a_capture,
    external_record_node_signals_the_caller,
    external_wait_node_binds_at_each_launch,
    graph_keeps_its_buffers_alive,
    reset_graph_refuses_launch,
    dot_dump_names_every_node,
);
