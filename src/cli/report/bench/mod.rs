//! The benchmarks `report` knows, each with a file that reads its results (the fields it
//! shows, as `graphed bench` writes them) and makes its figure.

mod alloc;
mod check;
mod gemm;
mod graphs;
mod launch;
mod layer;
mod memory;
mod offload;
mod parallel;
mod schedule;

use serde::Deserialize;

use super::error::ReportError;
use super::figure::Figure;
use super::results::Run;

/// A benchmark of `graphed bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bench {
    /// `bench graphs` (with `bench/torch_reference.py graphs`).
    Graphs,
    /// `bench offload`.
    Offload,
    /// `bench memory` (with `bench/torch_reference.py memory`).
    Memory,
    /// `bench schedule`.
    Schedule,
    /// `bench parallel` (under `graphed launch`).
    Parallel,
    /// `bench layer` (with `bench/torch_reference.py layer`).
    Layer,
    /// `bench gemm` (with `bench/torch_reference.py gemm`).
    Gemm,
    /// `bench launch`.
    Launch,
    /// `bench alloc`.
    Alloc,
    /// `bench check`.
    Check,
}

impl Bench {
    /// Every benchmark.
    pub const ALL: [Bench; 10] = [
        Bench::Graphs,
        Bench::Offload,
        Bench::Memory,
        Bench::Schedule,
        Bench::Parallel,
        Bench::Layer,
        Bench::Gemm,
        Bench::Launch,
        Bench::Alloc,
        Bench::Check,
    ];

    /// Its name, as in `graphed bench <name>` and in results file names.
    pub fn name(self) -> &'static str {
        match self {
            Bench::Graphs => "graphs",
            Bench::Offload => "offload",
            Bench::Memory => "memory",
            Bench::Schedule => "schedule",
            Bench::Parallel => "parallel",
            Bench::Layer => "layer",
            Bench::Gemm => "gemm",
            Bench::Launch => "launch",
            Bench::Alloc => "alloc",
            Bench::Check => "check",
        }
    }

    /// The benchmark called `name`.
    pub fn named(name: &str) -> Option<Bench> {
        Bench::ALL.into_iter().find(|b| b.name() == name)
    }

    /// The figure of its newest run.
    pub fn figure(self, run: &Run) -> Result<Figure, ReportError> {
        match self {
            Bench::Graphs => graphs::figure(run),
            Bench::Offload => offload::figure(run),
            Bench::Memory => memory::figure(run),
            Bench::Schedule => schedule::figure(run),
            Bench::Parallel => parallel::figure(run),
            Bench::Layer => layer::figure(run),
            Bench::Gemm => gemm::figure(run),
            Bench::Launch => launch::figure(run),
            Bench::Alloc => alloc::figure(run),
            Bench::Check => check::figure(run),
        }
    }
}

/// The median of some samples (`bench`'s `Spread`; the range is not shown).
#[derive(Debug, Deserialize)]
struct Median {
    median: f64,
}

/// The model configuration a row of `bench graphs`, `offload` or `schedule` ran.
#[derive(Debug, Deserialize)]
struct Case {
    config: String,
    dim: usize,
    layers: usize,
    batch: usize,
    seq: usize,
    dtype: String,
}

impl Case {
    /// A panel's title: `S: d=256, 8 layers, batch 2 × 64 tokens, bf16`.
    fn title(&self) -> String {
        let Case { config, dim, layers, batch, seq, dtype } = self;
        format!("{config}: d={dim}, {layers} layers, batch {batch} × {seq} tokens, {dtype}")
    }
}

/// The distinct values of `key` over `rows`, in order of first appearance.
fn distinct<'a, R>(rows: &'a [R], key: impl Fn(&'a R) -> &'a str) -> Vec<&'a str> {
    let mut seen = Vec::new();
    for r in rows {
        if !seen.contains(&key(r)) {
            seen.push(key(r));
        }
    }
    seen
}

/// The distinct configurations of `rows`, in order of first appearance.
fn cases<'a, R>(rows: &'a [R], case: impl Fn(&'a R) -> &'a Case) -> Vec<&'a Case> {
    let mut seen: Vec<&Case> = Vec::new();
    for r in rows {
        if !seen.iter().any(|c| c.config == case(r).config) {
            seen.push(case(r));
        }
    }
    seen
}
