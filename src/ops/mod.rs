//! Layer 4, kernels: each op's CPU path beside its CUDA C, launched through the device layer.
//! Uses only [`device`](crate::device).

pub mod elementwise;
