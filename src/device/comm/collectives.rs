//! The operations a rank enqueues: collectives and grouped sends and receives, checked (element
//! type, lengths, peers, overlaps, devices) before anything is enqueued, then declared to the
//! checker as any stream operation is.

use std::sync::Arc;

use super::{comm_error, CommErrorKind, Communicator};
use crate::device::backend::{Op, Part};
use crate::device::kernel::IntoView;
use crate::device::memory::{access_of, Block};
use crate::device::{Access, AccessMode, DType, Elem, Stream, View};
use crate::Result;

/// The operation a rank issues; every rank of a collective issues the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    /// Sum in place across ranks.
    AllReduce,
    /// Max in place across ranks, of non-negative f32 values compared as their bits
    /// ([`Communicator::all_reduce_amax`]).
    AllReduceAmax,
    /// Sum across ranks, each rank keeping its slice.
    ReduceScatter,
    /// Every rank's input, concatenated in rank order, on every rank.
    AllGather,
    /// To one peer (matched with its [`Collective::Recv`]).
    Send(usize),
    /// From one peer.
    Recv(usize),
}

impl Collective {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllReduceAmax => "all_reduce_amax",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather",
            Collective::Send(_) => "send",
            Collective::Recv(_) => "recv",
        }
    }
}

impl Communicator {
    /// Sums `buf` across ranks, in place, on `stream`.
    ///
    /// # Errors
    /// [`Error::Comm`](crate::Error::Comm) for an element type without a sum or a mismatch with another rank's
    /// operation; the usual errors of a stream operation (another device's buffer, a capture).
    pub fn all_reduce<'b, T: Elem>(&self, stream: &Stream, buf: impl IntoView<'b, Elem = T>) -> Result<()> {
        let buf = buf.into_view();
        self.reducible(Collective::AllReduce, T::DTYPE)?;
        let count = buf.len();
        self.enqueue(
            stream,
            T::DTYPE,
            &[Planned { kind: Collective::AllReduce, first: (&buf, AccessMode::ReadWrite), second: None, count }],
        )
    }

    /// The max across ranks of FP8 amaxes, in place, on `stream`: non-negative f32 values, NaN
    /// as `0x7fffffff` (above +∞; see [`ops::fp8::amax`](crate::ops::fp8::amax)). They are
    /// compared as their bits, which order such values as their magnitudes and keep a NaN of any
    /// rank, exactly and in any order; NCCL's float max leaves NaN to its `fmax`. A negative
    /// value would compare above every positive one: the amax kernels never write one.
    ///
    /// # Errors
    /// As [`all_reduce`](Communicator::all_reduce).
    pub fn all_reduce_amax<'b>(&self, stream: &Stream, buf: impl IntoView<'b, Elem = f32>) -> Result<()> {
        let buf = buf.into_view();
        let count = buf.len();
        self.enqueue(
            stream,
            DType::U32,
            &[Planned { kind: Collective::AllReduceAmax, first: (&buf, AccessMode::ReadWrite), second: None, count }],
        )
    }

    /// Sums `src` (`size` slices of `dst`'s length) across ranks; rank `r` gets slice `r` in `dst`.
    ///
    /// # Errors
    /// As [`all_reduce`](Communicator::all_reduce), [`CommErrorKind::Length`] unless `src` is
    /// `size` times as long as `dst`, and [`CommErrorKind::Overlap`] when they overlap (NCCL's
    /// in-place layout included).
    pub fn reduce_scatter<'s, 'd, T: Elem>(
        &self,
        stream: &Stream,
        src: impl IntoView<'s, Elem = T>,
        dst: impl IntoView<'d, Elem = T>,
    ) -> Result<()> {
        let (src, dst) = (src.into_view(), dst.into_view());
        self.reducible(Collective::ReduceScatter, T::DTYPE)?;
        self.sized(Collective::ReduceScatter, src.len(), dst.len())?;
        let (kind, count) = (Collective::ReduceScatter, dst.len());
        self.enqueue(stream, T::DTYPE, &[Planned { kind, first: (&src, AccessMode::Read), second: Some(&dst), count }])
    }

    /// Every rank's `src`, concatenated in rank order, into `dst` (`size` times as long).
    ///
    /// # Errors
    /// [`CommErrorKind::Length`] unless `dst` is `size` times as long as `src`,
    /// [`CommErrorKind::Overlap`] when they overlap (NCCL's in-place layout included), and as
    /// [`all_reduce`](Communicator::all_reduce).
    pub fn all_gather<'s, 'd, T: Elem>(
        &self,
        stream: &Stream,
        src: impl IntoView<'s, Elem = T>,
        dst: impl IntoView<'d, Elem = T>,
    ) -> Result<()> {
        let (src, dst) = (src.into_view(), dst.into_view());
        self.sized(Collective::AllGather, dst.len(), src.len())?;
        let (kind, count) = (Collective::AllGather, src.len());
        self.enqueue(stream, T::DTYPE, &[Planned { kind, first: (&src, AccessMode::Read), second: Some(&dst), count }])
    }

    /// Sends `src` to rank `peer`, which receives it with [`recv`](Communicator::recv). The send
    /// completes only once the peer's receive has begun (as NCCL's do, beyond its small buffers),
    /// so two ranks that send to each other first deadlock; [`exchange`](Communicator::exchange)
    /// issues both directions as one group.
    ///
    /// # Errors
    /// [`CommErrorKind::BadPeer`] for a peer outside the group or this rank, and as
    /// [`all_reduce`](Communicator::all_reduce).
    pub fn send<'s, T: Elem>(&self, stream: &Stream, src: impl IntoView<'s, Elem = T>, peer: usize) -> Result<()> {
        self.exchange(stream, &[Transfer::send(src, peer)])
    }

    /// Receives into `dst` what rank `peer` sends with [`send`](Communicator::send).
    ///
    /// # Errors
    /// As [`send`](Communicator::send).
    pub fn recv<'d, T: Elem>(&self, stream: &Stream, dst: impl IntoView<'d, Elem = T>, peer: usize) -> Result<()> {
        self.exchange(stream, &[Transfer::recv(dst, peer)])
    }

    /// Sends and receives issued as one group (NCCL's `ncclGroupStart`/`ncclGroupEnd`): they
    /// progress together, so that a stage that sends its activation forward while it receives a
    /// gradient back meets its neighbour doing the opposite. Each transfer matches the peer's
    /// opposite one by order between the two ranks. Nothing is enqueued for no transfers.
    ///
    /// ```
    /// use graphed::device::{Communicator, CommOptions, Device, Transfer};
    /// let devices = [Device::sim(), Device::sim()];
    /// let comms = Communicator::sim_group(&devices, CommOptions::default())?;
    /// let received: Vec<Vec<f32>> = std::thread::scope(|s| {
    ///     let ranks: Vec<_> = comms.iter().map(|comm| s.spawn(move || -> graphed::Result<Vec<f32>> {
    ///         let (stream, peer) = (comm.device().stream()?, 1 - comm.rank());
    ///         let mine = comm.device().alloc_from(&stream, &[comm.rank() as f32; 2])?;
    ///         let theirs = comm.device().alloc::<f32>(2)?;
    ///         // Both ranks send first: as two plain sends this would deadlock.
    ///         comm.exchange(&stream, &[Transfer::send(&mine, peer), Transfer::recv(&theirs, peer)])?;
    ///         theirs.to_vec(&stream)
    ///     })).collect();
    ///     ranks.into_iter().map(|h| h.join().expect("rank thread")).collect::<graphed::Result<_>>()
    /// })?;
    /// assert_eq!(received, vec![vec![1.0; 2], vec![0.0; 2]]);
    /// # Ok::<(), graphed::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`send`](Communicator::send), for each transfer, and [`CommErrorKind::Overlap`] when a
    /// receive's buffer meets another transfer's; before anything is enqueued.
    pub fn exchange<T: Elem>(&self, stream: &Stream, transfers: &[Transfer<'_, T>]) -> Result<()> {
        let mut planned = Vec::with_capacity(transfers.len());
        for t in transfers {
            let (kind, view, mode, peer) = match t {
                Transfer::Send(v, peer) => (Collective::Send(*peer), v, AccessMode::Read, *peer),
                Transfer::Recv(v, peer) => (Collective::Recv(*peer), v, AccessMode::Write, *peer),
            };
            self.check_peer(kind.name(), peer)?;
            planned.push(Planned { kind, first: (view, mode), second: None, count: view.len() });
        }
        self.enqueue(stream, T::DTYPE, &planned)
    }

    fn reducible(&self, op: Collective, dtype: DType) -> Result<()> {
        match dtype {
            DType::F32 | DType::BF16 | DType::F16 => Ok(()),
            dtype => Err(comm_error(op.name(), self.rank(), CommErrorKind::DType { dtype })),
        }
    }

    fn sized(&self, op: Collective, long: usize, short: usize) -> Result<()> {
        if long != short * self.size() {
            let what =
                format!("{} takes a buffer of {} × the other's {short} elements, found {long}", op.name(), self.size());
            return Err(comm_error(op.name(), self.rank(), CommErrorKind::Length { what }));
        }
        Ok(())
    }

    /// Refuses a peer outside the group, or this rank, for `op`.
    pub(crate) fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank() {
            return Err(comm_error(op, self.rank(), CommErrorKind::BadPeer { peer, size: self.size() }));
        }
        Ok(())
    }

    /// Checks and enqueues one operation, or one group of them, on elements of `dtype` (`T`'s, or
    /// for the amax max, the bits of `T` as an integer of its size).
    fn enqueue<T: Elem>(&self, stream: &Stream, dtype: DType, planned: &[Planned<'_, '_, T>]) -> Result<()> {
        let op = match planned {
            [] => return Ok(()),
            [one] => one.kind.name(),
            _ => "p2p_group",
        };
        self.inner.dev.check_same(op, "communicator", stream.device().id())?;
        for v in planned.iter().flat_map(|p| std::iter::once(p.first.0).chain(p.second)) {
            self.inner.dev.check_same(op, "buffer", v.block.raw.device)?;
            v.check_bounds(op)?;
            v.region.expect_contiguous(op, v.block.id)?;
        }
        // Every buffer with whether it is written (a reduce-scatter's or gather's destination, a
        // receive, an all-reduce's in-place buffer alone); no written one may meet another.
        let touched: Vec<(Access, bool)> = (planned.iter())
            .flat_map(|p| {
                let first = (p.first.0.access(p.first.1), p.first.1 != AccessMode::Read);
                std::iter::once(first).chain(p.second.map(|d| (d.access(AccessMode::Write), true)))
            })
            .collect();
        for (i, (a, a_writes)) in touched.iter().enumerate() {
            if let Some(j) = (i + 1..touched.len()).find(|&j| (*a_writes || touched[j].1) && a.overlaps(&touched[j].0))
            {
                let what = format!("{op}: its buffers {i} and {j} overlap, and one of them is written");
                return Err(comm_error(op, self.rank(), CommErrorKind::Overlap { what }));
            }
        }
        let elem = dtype.size();
        fn at<'v, T: Elem>(v: &View<'v, T>, elem: usize) -> (&'v Arc<Block>, usize) {
            (v.block, v.absolute().offset() * elem)
        }
        let parts: Vec<Part<'_>> = (planned.iter())
            .map(|p| Part {
                kind: p.kind,
                src: at(p.first.0, elem),
                dst: at(p.second.unwrap_or(p.first.0), elem),
                count: p.count,
            })
            .collect();
        let first = self.issued();
        stream.enqueue_op(&Op::Collective { comm: &self.inner.repr, parts: &parts, dtype })?;
        let described = match planned {
            [one] => describe(one.kind),
            _ => format!("p2p_group ({})", planned.iter().map(|p| describe(p.kind)).collect::<Vec<_>>().join(", ")),
        };
        let ordered = !matches!(planned, [] | [Planned { kind: Collective::Send(_) | Collective::Recv(_), .. }, ..]);
        // In the caller's element type: the amaxes are f32, whatever their max compares.
        self.note_collective(stream, (described, planned.iter().map(|p| p.count).sum(), T::DTYPE), ordered, first)?;
        let (mut accesses, mut blocks) = (Vec::new(), Vec::new());
        for p in planned {
            let second = p.second.map(|v| (v, AccessMode::Write));
            for (v, mode) in std::iter::once(p.first).chain(second) {
                accesses.push(access_of(v.block, v.region, elem, mode, accesses.len()));
                blocks.push(v.block);
            }
        }
        stream.enqueued_on(op, &blocks, &accesses)
    }
}

/// An operation in the words of a report: its name, and a send's or receive's peer.
fn describe(kind: Collective) -> String {
    match kind {
        Collective::Send(peer) => format!("send to rank {peer}"),
        Collective::Recv(peer) => format!("recv from rank {peer}"),
        other => other.name().to_string(),
    }
}

/// One operation as checked before it is enqueued: `first` is the buffer it reads (or reads and
/// writes, or for a receive writes), `second` the one it writes when they differ.
struct Planned<'v, 'a, T: Elem> {
    kind: Collective,
    first: (&'v View<'a, T>, AccessMode),
    second: Option<&'v View<'a, T>>,
    count: usize,
}

/// One send or receive of a [`Communicator::exchange`].
pub enum Transfer<'a, T: Elem> {
    /// The view, to the peer rank.
    Send(View<'a, T>, usize),
    /// Into the view, from the peer rank.
    Recv(View<'a, T>, usize),
}

impl<'a, T: Elem> Transfer<'a, T> {
    /// Sends `src` to `peer`.
    pub fn send(src: impl IntoView<'a, Elem = T>, peer: usize) -> Transfer<'a, T> {
        Transfer::Send(src.into_view(), peer)
    }

    /// Receives into `dst` from `peer`.
    pub fn recv(dst: impl IntoView<'a, Elem = T>, peer: usize) -> Transfer<'a, T> {
        Transfer::Recv(dst.into_view(), peer)
    }
}
