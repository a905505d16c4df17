//! The device conformance suite: every case runs on the simulator (under each scheduler policy)
//! and on CUDA, and must give the same results and the same error kinds on both.

#[path = "../common/mod.rs"]
mod common;

mod capture;
mod disabled;
mod events;
mod expandable;
mod gemm;
mod gemm_fp8;
mod graphs;
mod memory;
mod misuse;
mod pools;
mod rebind;
