//! `graphed bench alloc`: host cost of the caching allocator against plain device allocation.

use std::time::Instant;

use graphed::memory::CachingAllocator;
use serde::Serialize;

use super::{write_json, Report};
use crate::cli::args::AllocBenchArgs;

#[derive(Serialize, Debug)]
struct AllocRow {
    bytes: usize,
    cached_us: f64,
    plain_us: f64,
}

/// Host µs per alloc+free pair: the caching allocator (after its first, growing allocation)
/// against a plain device allocation (`cuMemAlloc` + `cuMemFree` on CUDA).
pub fn run(args: &AllocBenchArgs) -> anyhow::Result<()> {
    let dev = super::super::open_device(&args.device)?;
    let s = dev.stream()?;
    let cache = CachingAllocator::new(&dev);
    let mut rows = Vec::new();
    for &bytes in &args.sizes {
        drop(cache.alloc::<u8>(&s, bytes)?);
        let t = Instant::now();
        for _ in 0..args.pairs {
            drop(cache.alloc::<u8>(&s, bytes)?);
        }
        let cached_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(args.pairs);
        let t = Instant::now();
        for _ in 0..args.pairs {
            drop(dev.alloc::<u8>(bytes)?);
        }
        let plain_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(args.pairs);
        rows.push(AllocRow { bytes, cached_us, plain_us });
    }
    println!("{:>12} | {:>10} {:>10} | host µs per alloc+free", "bytes", "cached", "plain");
    for r in &rows {
        println!("{:>12} | {:>10.3} {:>10.3} |", r.bytes, r.cached_us, r.plain_us);
    }
    write_json(&args.json, &Report::new("alloc", &dev, args.pairs, rows))
}
