//! Layer 3, memory: a caching allocator with stream-ordered reuse and graph pools. Uses only
//! [`device`](crate::device). See Note [Pool replay order] in `pool.rs`.

mod allocator;
pub mod arena;
mod lifetimes;
mod pool;

pub use allocator::{AllocatorConfig, BlockEntry, CachingAllocator, MemoryStats, PoolCapture, EXPANDABLE_ENV};
pub use arena::Stats;
pub(crate) use lifetimes::Lifetimes;
pub use pool::{GraphPool, PoolExec, PoolGraph, PoolId};
