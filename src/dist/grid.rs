//! Megatron-LM's grid: a world of ranks split into pipeline stages × data-parallel replicas.
//! Rank `stage · replicas + replica` (Megatron-LM's order, data parallelism inside pipeline
//! parallelism) is stage `stage` of replica `replica`'s pipeline, and replica `replica` of stage
//! `stage`'s data-parallel group; rank 0 is the first stage of the first replica.

use crate::device::{CommErrorKind, Communicator};
use crate::nn::Stage;
use crate::{Error, Result};

/// A rank's place in the grid and its two groups, both splits of the world: its replica's
/// pipeline (whose rank `s` is stage `s`, as [`P2pLinks`](super::P2pLinks) wants) and its
/// stage's replicas (whose rank `r` is replica `r`, over which
/// [`DataParallel`](super::DataParallel) reduces the stage's gradients).
///
/// ```
/// use graphed::device::{CommOptions, SimConfig};
/// use graphed::dist::{on_sim_ranks, ProcessGroup};
/// // Four simulated ranks: two stages × two replicas.
/// let places = on_sim_ranks(4, SimConfig::default(), CommOptions::default(), |comm| {
///     let grid = ProcessGroup::simulated(comm.clone())?.grid(2)?;
///     Ok((grid.stage().index(), grid.replica(), grid.pipeline().size(), grid.data_parallel().size()))
/// });
/// let places = places.into_iter().collect::<graphed::Result<Vec<_>>>()?;
/// assert_eq!(places, [(0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]);
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Debug)]
pub struct Grid {
    stage: Stage,
    replica: usize,
    replicas: usize,
    pipeline: Communicator,
    data_parallel: Communicator,
}

impl Grid {
    /// Where rank `rank` of a world of `world` ranks sits in a grid of `stages` pipeline stages:
    /// its stage, and its replica among the `world / stages` replicas.
    ///
    /// # Errors
    /// [`CommErrorKind::GridShape`] when `stages` is zero or does not divide `world`.
    pub fn place(rank: usize, world: usize, stages: usize) -> Result<(Stage, usize)> {
        if stages == 0 || !world.is_multiple_of(stages) {
            return Err(Error::Comm { op: "Grid::place", rank, kind: CommErrorKind::GridShape { world, stages } });
        }
        let replicas = world / stages;
        Ok((Stage::new(rank / replicas, stages)?, rank % replicas))
    }

    /// Splits `world` into the grid of `stages` stages with `split` (the world's
    /// [`Communicator::split`], or a process group's [`ProcessGroup::split`](super::ProcessGroup::split),
    /// which watches the other ranks' processes): the pipeline first, then the data-parallel
    /// group. Every rank of the world calls it.
    ///
    /// # Errors
    /// As [`Grid::place`] (before any split), and the splits'.
    pub fn split(
        world: &Communicator,
        stages: usize,
        split: &dyn Fn(Option<u32>, usize) -> Result<Option<Communicator>>,
    ) -> Result<Grid> {
        let (stage, replica) = Grid::place(world.rank(), world.size(), stages)?;
        let color = |c: usize| u32::try_from(c).ok();
        // A rank that gives a color always gets a group: `None` would be a bug of the split.
        let no_group = || Error::Comm {
            op: "Grid::split",
            rank: world.rank(),
            kind: CommErrorKind::Nccl("a split with a color gave no group".into()),
        };
        let pipeline = split(color(replica), stage.index())?.ok_or_else(no_group)?;
        let data_parallel = split(color(stage.index()), replica)?.ok_or_else(no_group)?;
        Ok(Grid { stage, replica, replicas: world.size() / stages, pipeline, data_parallel })
    }

    /// This rank's pipeline stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// This rank's replica (its rank in its stage's data-parallel group).
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// How many replicas of the pipeline the world holds.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The ranks of this replica's pipeline, rank `s` its stage `s`.
    pub fn pipeline(&self) -> &Communicator {
        &self.pipeline
    }

    /// The ranks of this stage, one per replica, rank `r` its replica `r`.
    pub fn data_parallel(&self) -> &Communicator {
        &self.data_parallel
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_follow_megatrons_order_and_a_world_that_does_not_split_is_refused() {
        let places: Vec<(usize, usize)> =
            (0..6).map(|r| Grid::place(r, 6, 3).map(|(s, rep)| (s.index(), rep)).expect("a place")).collect();
        assert_eq!(places, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]);
        for (world, stages) in [(6, 4), (4, 0)] {
            let e = Grid::place(0, world, stages).expect_err("refused");
            assert!(
                matches!(e, Error::Comm { kind: CommErrorKind::GridShape { world: w, stages: s }, .. } if (w, s) == (world, stages)),
                "{e}"
            );
        }
    }
}
