//! Layer 4, kernels: each op's CPU path beside its CUDA C, launched through the device layer on
//! [`Tensor`](crate::tensor::Tensor)s or views. Launchers take outputs, then inputs, then sizes,
//! and the stream last. Kernels with reductions sum in a fixed order without atomics, so results
//! are bitwise reproducible run to run on each device.

pub mod adamw;
pub mod cast;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gelu;
pub mod layernorm;
pub mod loss;
pub mod rng;
pub mod softmax;
