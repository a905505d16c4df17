//! Layer 3, memory: a caching allocator with stream-ordered reuse and graph pools.

pub mod arena;
