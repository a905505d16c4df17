//! Layer 3, memory: a caching allocator with stream-ordered reuse and graph pools. Uses only
//! [`device`](crate::device). See Note [Pool replay order] in `pool.rs`.

mod allocator;
pub mod arena;
mod pool;

pub use allocator::{BlockEntry, CachingAllocator, MemoryStats, PoolCapture};
pub use pool::{GraphPool, PoolExec, PoolGraph, PoolId};
