//! `bench alloc`: host time of an allocation and its free, through the caching allocator and
//! through `cuMemAlloc` and `cuMemFree`.

use serde::Deserialize;

use crate::cli::plot::{Bar, Bars, Panel};
use crate::cli::report::error::ReportError;
use crate::cli::report::figure::{Figure, Table};
use crate::cli::report::results::{Report, Run};

#[derive(Debug, Deserialize)]
struct Row {
    bytes: u64,
    cached_us: f64,
    plain_us: f64,
}

pub(super) fn figure(run: &Run) -> Result<Figure, ReportError> {
    let report = Report::<Row>::of(run)?;
    let mut table = Table::new(&["size", "caching allocator µs", "`cuMemAlloc` + `cuMemFree` µs"]);
    let mut panels = Vec::new();
    for r in &report.rows {
        table.row(vec![size(r.bytes), format!("{:.2}", r.cached_us), format!("{:.1}", r.plain_us)]);
        let bars = vec![Bar::ours("caching allocator", r.cached_us), Bar::theirs("cuMemAlloc + cuMemFree", r.plain_us)];
        panels.push(Panel { title: size(r.bytes), unit: "host µs per allocation and free (median)".into(), bars });
    }
    Ok(Figure {
        tables: vec![table],
        sources: vec![run.ours.name.clone()],
        provenance: report.provenance(),
        note: format!("host µs per allocation and free, median over {} pairs", report.reps),
        chart: Bars { title: "graphed bench alloc: the caching allocator against the driver".into(), panels },
    })
}

/// `bytes` in the largest binary unit that divides it.
fn size(bytes: u64) -> String {
    let units = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    match units.iter().find(|(u, _)| bytes >= *u && bytes.is_multiple_of(*u)) {
        Some((u, name)) => format!("{} {name}", bytes / u),
        None => format!("{bytes} B"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_take_the_largest_unit_that_divides_them() {
        assert_eq!([4096, 1 << 20, 64 << 20, 1000].map(super::size), ["4 KiB", "1 MiB", "64 MiB", "1000 B"]);
    }
}
