//! `graphed inspect`: graphs `BENCH.md`'s stack of transformer layers as `bench graphs` does and
//! prints what was captured, so that a graph's contents can be checked without a profiler: per
//! graph its nodes by kind and the external events it records, per callable its static surfaces,
//! and the pool's memory and replay order; optionally each graph as Graphviz DOT.

use std::collections::BTreeMap;

use anyhow::Context;
use graphed::device::{Device, DeviceKind, GraphId};
use graphed::graph::GraphedCallable;
use graphed::memory::CachingAllocator;
use graphed::offload::OffloadManager;

use super::args::InspectArgs;
use super::bench_model::{BenchModel, Config};

/// Graphs the stack and prints the report.
pub fn run(dev: &Device, args: &InspectArgs) -> anyhow::Result<()> {
    let config = match &args.config {
        Some(name) => Config::named(name)?,
        None if dev.kind() == DeviceKind::Cuda => Config::named("S")?,
        None => Config::named("tiny")?,
    };
    let config = config.with_attention(args.attention);
    config.check_device(dev, "--config")?;
    let alloc = CachingAllocator::new(dev);
    let stream = dev.stream()?;
    let model = BenchModel::new(&alloc, &stream, config, args.dtype.resolve(dev)?)?;
    let event = if args.side_stream { Some(dev.event()?) } else { None };
    let offload = args.offload.config(dev).map(|c| OffloadManager::new(&alloc, c)).transpose()?;
    let stack = model.graph(&alloc, event.as_ref(), offload.as_ref())?;
    if let Some(summary) = offload.as_ref().and_then(|m| m.summary()) {
        println!("{summary}");
    }
    let graphed = stack.layers();
    let pool = stack.pool();
    let sync = stack.sync_event().map_or_else(|| "no sync event".to_string(), |e| format!("sync event {}", e.id()));
    println!("{config}: a graphed stack of {} layers in {}, {sync}", graphed.len(), pool.id());
    let fed = |in_place: bool| if in_place { "read in place" } else { "copied in" };
    println!(
        "with forward_in_place and backward_in_place: the input {}, the upstream gradient {}",
        fed(stack.in_place_input()?),
        fed(stack.in_place_grad_output()?)
    );

    // Graph ids name the graphs in the replay order and the DOT files.
    let mut names: BTreeMap<GraphId, String> = BTreeMap::new();
    for g in graphed {
        print_callable(g)?;
        for (pass, graph) in g.graphs() {
            names.insert(graph.id(), format!("{} {pass:?}", g.name()));
        }
    }

    let stats = alloc.stats();
    let (_, mine) =
        stats.pools.iter().find(|(id, _)| *id == pool.id()).with_context(|| {
            format!("the allocator reports no {}, which the callables were captured into", pool.id())
        })?;
    println!(
        "{}: allocated {}, reserved {}, peak allocated {}, peak reserved {}",
        pool.id(),
        bytes(mine.allocated),
        bytes(mine.reserved),
        bytes(mine.peak_allocated),
        bytes(mine.peak_reserved)
    );
    let order: Vec<String> = pool
        .order()
        .iter()
        .map(|id| names.get(id).map_or_else(|| id.to_string(), |name| format!("{name} ({id})")))
        .collect();
    println!("replay order: {}", order.join(" -> "));

    if let Some(dir) = &args.dot {
        write_dots(graphed, dir)?;
    }
    Ok(())
}

fn print_callable(g: &GraphedCallable) -> anyhow::Result<()> {
    let report = g.report()?;
    println!(
        "{}: inputs {:?}, outputs {:?}, static buffers outside the pool {}",
        report.name,
        report.input_shapes,
        report.output_shapes,
        bytes(report.static_bytes)
    );
    for graph in &report.graphs {
        let total: usize = graph.nodes.values().sum();
        let kinds: Vec<String> = graph.nodes.iter().map(|(kind, n)| format!("{kind:?} {n}")).collect();
        let records = match graph.records.as_slice() {
            [] => "none".to_string(),
            events => events.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
        };
        println!(
            "  {} {:?} {}: {total} nodes ({}), records {records}",
            report.name,
            graph.pass,
            graph.graph,
            kinds.join(", ")
        );
        if !graph.tail.is_empty() {
            let ops: Vec<String> =
                graph.tail.iter().map(|t| format!("{} x{} ({})", t.op, t.writes, bytes(t.bytes))).collect();
            println!("    tail (after the sync event): {}", ops.join(", "));
        }
        if !graph.disabled.is_empty() {
            let mut off: Vec<(&str, usize)> = Vec::new();
            for op in &graph.disabled {
                match off.iter_mut().find(|(o, _)| o == op) {
                    Some((_, n)) => *n += 1,
                    None => off.push((op, 1)),
                }
            }
            let ops: Vec<String> = off.iter().map(|(op, n)| format!("{op} x{n}")).collect();
            println!("    turned off: {}", ops.join(", "));
        }
    }
    Ok(())
}

/// Writes each graph to `<callable>-<pass>.dot` in `dir`, the callable's name made safe for
/// shells and URLs (`TransformerLayer#0 (layer0)` → `TransformerLayer_0_layer0`).
fn write_dots(graphed: &[GraphedCallable], dir: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create {}; pass a writable directory to --dot", dir.display()))?;
    let mut written = 0;
    for g in graphed {
        for (pass, graph) in g.graphs() {
            let path = dir.join(format!("{}-{pass:?}.dot", file_safe(g.name())));
            std::fs::write(&path, graph.dot()?)
                .with_context(|| format!("cannot write {}; pass a writable directory to --dot", path.display()))?;
            written += 1;
        }
    }
    println!("wrote {written} DOT files to {}", dir.display());
    Ok(())
}

/// Bytes, with MiB for reading at a glance.
fn bytes(n: usize) -> String {
    format!("{n} B ({:.2} MiB)", n as f64 / (1 << 20) as f64)
}

/// `name` with every run of characters other than letters, digits and `-` made one `_`.
fn file_safe(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c.is_ascii_alphanumeric() || c == '-' {
            true => out.push(c),
            false if !out.ends_with('_') => out.push('_'),
            false => {}
        }
    }
    out.trim_matches('_').to_string()
}
