//! Several devices, beside layer 7 (above the graph layer): process groups, data parallelism (the
//! gradients averaged over the ranks by default, or summed: [`GradReduction`]; inside the
//! backward graphs, or on graphs of their own: [`ReductionGraphs`]) and pipeline parallelism over
//! the collectives of [`Communicator`](crate::device::Communicator).
//!
//! One process per GPU, started by `graphed launch` or any launcher that sets torchrun's
//! variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`):
//! [`ProcessGroup::join`] meets the other ranks over TCP, checks that they build the same
//! model, and shares the NCCL id. On the simulator, ranks are threads of one process
//! ([`on_sim_ranks`]), so multi-device programs, their hazards and their deadlocks are tested
//! without GPUs; [`on_ranks`] runs the same programs on the GPUs of one process. Data and
//! pipeline parallelism combine through
//! [`Communicator::split`](crate::device::Communicator::split): each replica's pipeline and each
//! stage's data-parallel group are splits of the world ([`Grid`]).

mod data_parallel;
mod grid;
mod group;
mod pipeline;
mod reduction_graphs;
mod rendezvous;
mod watch;

pub use rendezvous::meet;
pub use watch::RankWatch;

pub use data_parallel::{DataParallel, GradReduction};
pub use grid::Grid;
pub use group::{on_ranks, on_sim_ranks, ProcessGroup, RankEnv};
pub use pipeline::P2pLinks;
pub use reduction_graphs::ReductionGraphs;
