//! Layer 3, memory: a caching allocator with stream-ordered reuse and graph pools. Uses only
//! [`device`](crate::device). See Note [Pool replay order] in `pool.rs`.

mod allocator;
pub mod arena;
mod lifetimes;
mod pool;

pub(crate) use allocator::EagerLending;
pub use allocator::{AllocatorConfig, BlockEntry, CachingAllocator, MemoryStats, PoolCapture, EXPANDABLE_ENV};
pub use arena::Stats;
pub(crate) use lifetimes::Lifetimes;
pub(crate) use pool::LentRange;
pub use pool::{GraphPool, PoolExec, PoolGraph, PoolId};
