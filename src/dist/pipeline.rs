//! Pipeline parallelism: the links through which [`run_pipeline_stage`](crate::nn::run_pipeline_stage)
//! hands activations forward and gradients back between stages, one rank per stage, over a
//! [`Communicator`] whose rank `s` is stage `s`.

use crate::device::{with_dtype, Communicator, DType, Event, Stream, Transfer};
use crate::graph::{make_graphed_fn, GraphedFn};
use crate::memory::CachingAllocator;
use crate::nn::{ScheduleErrorKind, StageLinks};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The links of one pipeline stage: every exchange of a step (the sends of one step of the
/// schedule and the receive of the next, as one group) enqueued on the stage's stream, or
/// [`overlapped`](P2pLinks::overlapped) on a stream of their own; eagerly or from a graph
/// captured at its first use.
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
    /// With [`overlapped`](P2pLinks::overlapped): the stream the exchanges run on.
    overlap: Option<Overlap>,
}

/// Exchanges off the stage's stream: each on the communication stream, after everything the
/// stage's stream enqueued before it (what it sends, the buffers it receives into), with an
/// event after it that the stage's stream waits for before a pass reads what it received.
struct Overlap {
    stream: Stream,
    /// Per exchange of a step, the event recorded after it.
    done: Vec<Event>,
    /// The last exchange of this step the stage's stream waits for (the stream runs exchanges
    /// in order: waiting for one waits for those before it).
    waited: Option<usize>,
    /// How many exchanges this step has run (their events in `done` are this step's).
    ran: usize,
    /// What this step's exchanges send, kept until the stage's stream has waited for them, so
    /// that no pass reuses their memory while they are read.
    sending: Vec<Tensor>,
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
            overlap: None,
        }
    }

    /// As [`eager`](P2pLinks::eager), but each exchange runs eagerly at its first use (where NCCL
    /// connects the ranks), is captured into a graph then, and is replayed from then on, so that
    /// a graphed pipeline step issues no NCCL call from the host after the first. What an
    /// exchange sends must be the same buffers at every step, as the static outputs of graphed
    /// passes are; it receives into buffers of its own.
    pub fn graphed(
        comm: &Communicator,
        alloc: &CachingAllocator,
        stream: &Stream,
        shape: &[usize],
        dtype: DType,
    ) -> P2pLinks {
        let mut links = P2pLinks::eager(comm, alloc, stream, shape, dtype);
        links.captured = Some(Vec::new());
        links
    }

    /// These links with every exchange on a communication stream of their own instead of the
    /// stage's: a pass waits only for the exchange whose tensor it reads, so an exchange overlaps
    /// the passes before that one (a forward of the first chunk while the gradient it brings is
    /// in flight), and a send overlaps everything after it. The exchanges and their order are
    /// the same, so a schedule that meets without deadlock still does.
    ///
    /// # Errors
    /// A stream that cannot be made.
    pub fn overlapped(mut self) -> Result<P2pLinks> {
        let stream = self.comm.device().stream()?;
        self.overlap = Some(Overlap { stream, done: Vec::new(), waited: None, ran: 0, sending: Vec::new() });
        Ok(self)
    }

    /// The stream an exchange sending `sends` runs on: the stage's; when overlapped, the
    /// communication stream, ordered after the stage's, with `sends` kept until the join.
    fn exchange_stream(&mut self, sends: &[(usize, Tensor)]) -> Result<Stream> {
        let Some(o) = &mut self.overlap else { return Ok(self.stream.clone()) };
        o.stream.wait_stream(&self.stream)?;
        o.sending.extend(sends.iter().map(|(_, t)| t.clone()));
        Ok(o.stream.clone())
    }

    /// Records exchange `index`'s event on the communication stream, when overlapped.
    fn exchanged(&mut self, index: usize) -> Result<()> {
        let Some(o) = &mut self.overlap else { return Ok(()) };
        while o.done.len() <= index {
            o.done.push(self.comm.device().event()?);
        }
        o.stream.record(&o.done[index])?;
        o.ran = o.ran.max(index + 1);
        Ok(())
    }

    /// Checks exchange `index`'s peers (ranks of the group other than this one) and what it
    /// sends against the boundary (a peer would receive a different count: NCCL would hang or
    /// corrupt memory), before anything is enqueued or kept.
    fn check(&self, index: usize, sends: &[(usize, Tensor)], recvs: &[usize]) -> Result<()> {
        for &peer in sends.iter().map(|(p, _)| p).chain(recvs) {
            self.comm.check_peer("P2pLinks::exchange", peer)?;
        }
        let numel: usize = self.shape.iter().product();
        for (peer, t) in sends {
            if t.numel() != numel || t.dtype() != self.dtype || !t.is_contiguous() {
                return Err(Error::Schedule(ScheduleErrorKind::Boundary {
                    index,
                    peer: *peer,
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    boundary_dtype: self.dtype,
                    boundary: self.shape.clone(),
                }));
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
        let dev = self.comm.device().clone();
        let _range = dev.range_with(|| {
            let to: Vec<usize> = sends.iter().map(|(p, _)| *p).collect();
            format!("exchange {index}: send to {to:?}, receive from {recvs:?}")
        });
        let got = self.exchange_on_stream(index, sends, recvs)?;
        self.exchanged(index)?;
        Ok(got)
    }

    fn wait(&mut self, index: usize) -> Result<()> {
        let Some(o) = &mut self.overlap else { return Ok(()) };
        if o.waited.is_none_or(|w| w < index) {
            // An event of an exchange this step has not run would be an earlier step's.
            let not_run = Error::Schedule(ScheduleErrorKind::ExchangeNotRun { index });
            let done = o.done.get(index).filter(|_| index < o.ran).ok_or(not_run)?;
            self.stream.wait(done)?;
            o.waited = Some(index);
        }
        Ok(())
    }

    fn join(&mut self) -> Result<()> {
        let Some(o) = &mut self.overlap else { return Ok(()) };
        self.stream.wait_stream(&o.stream)?;
        o.sending.clear();
        (o.waited, o.ran) = (None, 0);
        Ok(())
    }
}

impl P2pLinks {
    /// Exchange `index`, enqueued on the exchange stream once every check passed; returns what
    /// it receives into.
    fn exchange_on_stream(&mut self, index: usize, sends: &[(usize, Tensor)], recvs: &[usize]) -> Result<Vec<Tensor>> {
        self.check(index, sends, recvs)?;
        let replay = match &self.captured {
            None => false,
            Some(captured) => match captured.get(index) {
                Some(c) => {
                    let same_sends = c.sends.len() == sends.len()
                        && c.sends.iter().zip(sends).all(|((p, t), (q, u))| p == q && t.is_same_view(u));
                    let same_recvs =
                        c.recvs.len() == recvs.len() && c.recvs.iter().zip(recvs).all(|((p, _), q)| p == q);
                    if !(same_sends && same_recvs) {
                        return Err(Error::Schedule(ScheduleErrorKind::NotAsCaptured { index }));
                    }
                    true
                }
                None if index == captured.len() => false,
                None => {
                    let captured = captured.len();
                    return Err(Error::Schedule(ScheduleErrorKind::BeyondCaptured { index, captured }));
                }
            },
        };
        if replay {
            let stream = self.exchange_stream(sends)?;
            let c = &self.captured.as_ref().expect("checked: a captured exchange")[index];
            c.graph.replay(&stream)?;
            return Ok(c.recvs.iter().map(|(_, t)| t.clone()).collect());
        }
        // Receive buffers come from the stage's stream, before the exchange stream orders after it.
        let recvs = self.receive_buffers(recvs)?;
        let stream = self.exchange_stream(sends)?;
        enqueue(&self.comm, &stream, sends, &recvs)?;
        let Some(captured) = &mut self.captured else {
            return Ok(recvs.into_iter().map(|(_, t)| t).collect());
        };
        // NCCL connects two ranks at their first transfer, which must not happen inside a
        // capture: the first use ran eagerly above, and its graph serves the next ones.
        let graph = make_graphed_fn(&self.alloc, |s| enqueue(&self.comm, s, sends, &recvs))?;
        // Named in profiles and in the watchdog's report of a stalled exchange.
        let peers = |ts: &[(usize, Tensor)]| ts.iter().map(|(p, _)| *p).collect::<Vec<_>>();
        let name = format!("pipeline exchange {index}: send to {:?}, receive from {:?}", peers(sends), peers(&recvs));
        let graph = graph.with_name(&name);
        let got = recvs.iter().map(|(_, t)| t.clone()).collect();
        captured.push(Captured { sends: sends.to_vec(), recvs, graph });
        Ok(got)
    }
}

impl Drop for P2pLinks {
    /// Overlapped links dropped mid-step still join, so that the memory of what they send or
    /// receive is not reused while the exchange stream reads or writes it.
    fn drop(&mut self) {
        if self.overlap.is_some() {
            if let Err(e) = self.join() {
                self.comm.device().record_drop_err("pipeline links (their join)", e);
            }
        }
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
