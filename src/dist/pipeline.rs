//! Pipeline parallelism: the links through which [`run_pipeline_stage`](crate::nn::run_pipeline_stage)
//! hands activations forward and gradients back between stages, one rank per stage, over a
//! [`Communicator`] whose rank `s` is stage `s`.

use crate::device::{with_dtype, Communicator, DType, Stream, Transfer};
use crate::graph::{make_graphed_fn, GraphedFn};
use crate::memory::CachingAllocator;
use crate::nn::{ScheduleErrorKind, StageLinks};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The links of one pipeline stage: every exchange of a step (the sends of one step of the
/// schedule and the receive of the next, as one group) enqueued on the stage's stream, eagerly
/// or from a graph captured at its first use.
///
/// ```
/// use graphed::device::{CommOptions, DType, Policy, SimConfig};
/// use graphed::dist::{on_sim_ranks, P2pLinks};
/// use graphed::memory::CachingAllocator;
/// use graphed::nn::StageLinks;
/// use graphed::tensor::Tensor;
///
/// // Stage 0 sends an activation of [2, 3]; stage 1 receives it.
/// let got = on_sim_ranks(2, SimConfig::default(), CommOptions::default(), |comm| {
///     let (alloc, s) = (CachingAllocator::new(comm.device()), comm.device().stream()?);
///     let mut links = P2pLinks::eager(comm, &alloc, &s, &[2, 3], DType::F32);
///     match comm.rank() {
///         0 => {
///             let y = Tensor::from_host(&alloc, &s, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
///             links.exchange(0, &[(1, y)], &[])?;
///             s.synchronize()?; // a rank that leaves with work pending fails its peers
///             Ok(Vec::new())
///         }
///         _ => links.exchange(0, &[], &[0])?[0].to_vec::<f32>(&s),
///     }
/// });
/// assert_eq!(got[1].as_ref().unwrap(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
/// # Ok::<(), graphed::Error>(())
/// ```
pub struct P2pLinks {
    comm: Communicator,
    alloc: CachingAllocator,
    stream: Stream,
    shape: Vec<usize>,
    dtype: DType,
    /// Per exchange of a step, its graph; `None` when the links run eagerly.
    captured: Option<Vec<Captured>>,
}

/// One exchange as captured: what it sends (the same buffers at every step), the buffers it
/// receives into, and its graph.
struct Captured {
    sends: Vec<(usize, Tensor)>,
    recvs: Vec<(usize, Tensor)>,
    graph: GraphedFn,
}

impl P2pLinks {
    /// The links of `comm`'s rank, enqueued on `stream`. Every boundary carries a tensor of
    /// `shape` and `dtype`: a transformer's `[batch, tokens, width]` activation forward, and
    /// its gradient back.
    pub fn eager(
        comm: &Communicator,
        alloc: &CachingAllocator,
        stream: &Stream,
        shape: &[usize],
        dtype: DType,
    ) -> P2pLinks {
        P2pLinks {
            comm: comm.clone(),
            alloc: alloc.clone(),
            stream: stream.clone(),
            shape: shape.to_vec(),
            dtype,
            captured: None,
        }
    }

    /// As [`eager`](P2pLinks::eager), but each exchange runs eagerly at its first use (where NCCL
    /// connects the ranks), is captured into a graph then, and is replayed from then on, so that
    /// a graphed pipeline step issues no NCCL call from the host after the first. What an exchange sends must be the same buffers at every step, as the static outputs
    /// of graphed passes are; it receives into buffers of its own.
    pub fn graphed(
        comm: &Communicator,
        alloc: &CachingAllocator,
        stream: &Stream,
        shape: &[usize],
        dtype: DType,
    ) -> P2pLinks {
        P2pLinks { captured: Some(Vec::new()), ..P2pLinks::eager(comm, alloc, stream, shape, dtype) }
    }

    fn refuse<T>(&self, what: String) -> Result<T> {
        Err(Error::Schedule(ScheduleErrorKind::Arguments { what }))
    }

    /// Checks what `index` sends against the boundary (a peer would receive a different count:
    /// NCCL would hang or corrupt memory), before anything is enqueued.
    fn check_sends(&self, index: usize, sends: &[(usize, Tensor)]) -> Result<()> {
        let numel: usize = self.shape.iter().product();
        for (peer, t) in sends {
            if t.numel() != numel || t.dtype() != self.dtype || !t.is_contiguous() {
                return self.refuse(format!(
                    "exchange {index} sends a {} tensor of shape {:?} to stage {peer}, but the stages' boundary is a \
                     contiguous {} tensor of shape {:?}; give the links the boundary's shape",
                    t.dtype(),
                    t.shape(),
                    self.dtype,
                    self.shape
                ));
            }
        }
        Ok(())
    }

    fn receive_buffers(&self, recvs: &[usize]) -> Result<Vec<(usize, Tensor)>> {
        (recvs.iter()).map(|&p| Ok((p, Tensor::uninit(&self.alloc, &self.stream, &self.shape, self.dtype)?))).collect()
    }
}

impl StageLinks for P2pLinks {
    fn exchange(&mut self, index: usize, sends: &[(usize, Tensor)], recvs: &[usize]) -> Result<Vec<Tensor>> {
        self.check_sends(index, sends)?;
        let Some(captured) = &self.captured else {
            let recvs = self.receive_buffers(recvs)?;
            enqueue(&self.comm, &self.stream, sends, &recvs)?;
            return Ok(recvs.into_iter().map(|(_, t)| t).collect());
        };
        let Some(c) = captured.get(index) else {
            if index != captured.len() {
                return self.refuse(format!(
                    "exchange {index} of a step after {} captured ones; run the same schedule at every step",
                    captured.len()
                ));
            }
            let recvs = self.receive_buffers(recvs)?;
            // NCCL connects two ranks at their first transfer, which must not happen inside a
            // capture: the first use runs eagerly, and its graph serves the next ones.
            enqueue(&self.comm, &self.stream, sends, &recvs)?;
            let graph = make_graphed_fn(&self.alloc, |s| enqueue(&self.comm, s, sends, &recvs))?;
            let got = recvs.iter().map(|(_, t)| t.clone()).collect();
            let c = Captured { sends: sends.to_vec(), recvs, graph };
            self.captured.get_or_insert_with(Vec::new).push(c);
            return Ok(got);
        };
        let same_sends = c.sends.len() == sends.len()
            && c.sends.iter().zip(sends).all(|((p, t), (q, u))| p == q && t.is_same_view(u));
        let same_recvs = c.recvs.len() == recvs.len() && c.recvs.iter().zip(recvs).all(|((p, _), q)| p == q);
        if !(same_sends && same_recvs) {
            return self.refuse(format!(
                "exchange {index} sends or receives other buffers or stages than its graph captured; graphed links \
                 need the static outputs of graphed passes and the same schedule at every step (use eager links \
                 with eager passes)"
            ));
        }
        c.graph.replay(&self.stream)?;
        Ok(c.recvs.iter().map(|(_, t)| t.clone()).collect())
    }
}

/// Enqueues `sends` and `recvs` as one group on `stream`.
fn enqueue(comm: &Communicator, stream: &Stream, sends: &[(usize, Tensor)], recvs: &[(usize, Tensor)]) -> Result<()> {
    let Some((_, first)) = sends.iter().chain(recvs).next() else { return Ok(()) };
    with_dtype!(first.dtype(), T => {
        let mut transfers = Vec::with_capacity(sends.len() + recvs.len());
        for (peer, t) in sends {
            transfers.push(Transfer::send(t.view::<T>()?, *peer));
        }
        for (peer, t) in recvs {
            transfers.push(Transfer::recv(t.view::<T>()?, *peer));
        }
        comm.exchange(stream, &transfers)
    })
}
