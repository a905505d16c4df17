//! Patched replays: an executable pointed at other buffers than those it was captured with,
//! without a new capture and without copying the data in.
//!
//! A capture records, for every node it adds, how the node names buffers (a [`Site`]): which
//! kernel parameter holds which bytes of which block, or which side of a copy. Kernel arguments
//! are typed ([`Kernel::params`](super::Kernel::params)), so this is exact, views included;
//! PyTorch's pointer-patched replay has to guess pointers among 8-byte values. A [`Rebind`] moves
//! every captured read of some bytes to the same bytes of another buffer; the device then
//! rewrites those nodes' parameters in the executable (`cuGraphExecKernelNodeSetParams`,
//! `cuGraphExecMemcpyNodeSetParams`; on the simulator, the node's task).
//!
//! Only reads move. A node that writes the bytes, or a library call whose arguments graphed does
//! not know (cuBLASLt, cuDNN, NCCL), refuses the rebind as a whole, before anything changes: its
//! bytes must be copied in instead.

use foldhash::HashMap;
use std::sync::Arc;

use super::backend::Op;
use super::kernel::Arg;
use super::memory::Block;
use super::{BufferId, Elem, GraphId, View};
use crate::{Error, Result};

/// Moves a graph executable's captured reads of `from` to the same elements of `to` (see
/// [`GraphExec::rebind`](super::GraphExec::rebind)).
///
/// ```
/// use graphed::device::{CaptureMode, Device, Rebind};
/// use graphed::ops::elementwise;
///
/// let dev = Device::sim();
/// let s = dev.stream()?;
/// let (x, y) = (dev.alloc_from(&s, &[1.0f32, 2.0])?, dev.alloc::<f32>(2)?);
/// let cap = s.capture(CaptureMode::ThreadLocal)?;
/// elementwise::scale(y.view(), x.view(), 2.0, &s)?;
/// let exec = cap.finish()?.instantiate()?;
///
/// let other = dev.alloc_from(&s, &[10.0f32, 20.0])?;
/// assert_eq!(exec.rebind(&[Rebind::new(x.view(), other.view())?])?, 1); // one node now reads `other`
/// exec.launch(&s)?;
/// assert_eq!(y.to_vec(&s)?, vec![20.0, 40.0]);
/// # Ok::<(), graphed::Error>(())
/// ```
#[derive(Clone)]
pub struct Rebind<'a> {
    pub(crate) from: &'a Arc<Block>,
    /// Bytes from the start of `from`.
    pub(crate) from_start: usize,
    pub(crate) to: &'a Arc<Block>,
    /// Bytes from the start of `to`.
    pub(crate) to_start: usize,
    pub(crate) bytes: usize,
    /// Whether writes move too ([`Rebind::moving_writes`]).
    pub(crate) writes: bool,
}

impl<'a> Rebind<'a> {
    /// Moves the captured reads of `from` to `to`: two contiguous views of one element type and
    /// length on one device. `Rebind::new(x, x)` moves them back to where they were captured.
    ///
    /// # Errors
    /// [`Error::NotContiguous`] for a strided view, [`Error::LengthMismatch`] for views of other
    /// lengths, [`Error::WrongDevice`] for buffers of two devices.
    pub fn new<T: Elem>(from: View<'a, T>, to: View<'a, T>) -> Result<Rebind<'a>> {
        const OP: &str = "Rebind::new";
        for v in [&from, &to] {
            v.region.expect_contiguous(OP, v.block.id)?;
        }
        if from.len() != to.len() {
            return Err(Error::LengthMismatch { op: OP, src: from.len(), dst: to.len() });
        }
        if from.block.raw.device != to.block.raw.device {
            return Err(Error::WrongDevice {
                op: OP,
                what: "buffer",
                expected: from.block.raw.device,
                found: to.block.raw.device,
            });
        }
        let size = T::DTYPE.size();
        Ok(Rebind {
            from: from.block,
            from_start: from.region.offset() * size,
            to: to.block,
            to_start: to.region.offset() * size,
            bytes: from.len() * size,
            writes: false,
        })
    }

    /// Moves the captured writes of `from` too (a kernel's output parameter, a device-to-device
    /// copy's destination): the launches then write `to`, which the caller gives for that. A
    /// memset's destination still refuses to move.
    #[must_use]
    pub fn moving_writes(mut self) -> Rebind<'a> {
        self.writes = true;
        self
    }

    /// The buffer whose reads it moves.
    pub fn from(&self) -> BufferId {
        self.from.id
    }
}

/// Why a [`Rebind`] was refused. Nothing changed: copy those bytes into the captured buffer
/// instead (what a replay without patching does).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RebindErrorKind {
    /// No captured node names the bytes.
    #[error("no captured node reads buffer {buffer} there")]
    NotRead {
        /// The buffer.
        buffer: BufferId,
    },
    /// A node names them through a library call whose arguments graphed does not know.
    #[error("`{op}` names buffer {buffer} through arguments graphed does not know (a library call)")]
    Opaque {
        /// The operation.
        op: &'static str,
        /// The buffer.
        buffer: BufferId,
    },
    /// A node writes them: moving the write would write the caller's buffer (allowed with
    /// [`Rebind::moving_writes`], except a memset's).
    #[error("`{op}` writes buffer {buffer}")]
    Written {
        /// The operation.
        op: &'static str,
        /// The buffer.
        buffer: BufferId,
    },
    /// A node reads bytes of the buffer partly outside those rebound.
    #[error("`{op}` reads bytes {start}..{end} of buffer {buffer}, not all within the rebound {from}..{to}")]
    Partial {
        /// The operation.
        op: &'static str,
        /// The buffer.
        buffer: BufferId,
        /// The bytes the node reads.
        start: usize,
        /// Past the last byte it reads.
        end: usize,
        /// The bytes rebound.
        from: usize,
        /// Past the last byte rebound.
        to: usize,
    },
    /// The driver refused a rebind midway and then refused to undo it: the executable's nodes
    /// read partly where they were and partly where they were moved, so it is not launched.
    #[error("a rebind failed midway and could not be undone")]
    Broken,
    /// No captured node names the buffer at all (what [`GraphExec::set_enabled`] turns off).
    ///
    /// [`GraphExec::set_enabled`]: super::GraphExec::set_enabled
    #[error("no captured node names buffer {buffer}")]
    NotNamed {
        /// The buffer.
        buffer: BufferId,
    },
}

impl RebindErrorKind {
    /// What to do about it.
    pub fn fix(&self) -> &'static str {
        match self {
            RebindErrorKind::Broken => "capture the graph again",
            RebindErrorKind::NotNamed { .. } => "name a buffer that the graph's operations use",
            _ => "copy the data into the captured buffer instead (a replay without rebinding)",
        }
    }
}

/// Where a node names a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Kernel parameter `i`.
    Param(usize),
    /// Kernel parameter `i`, whose address the CUDA code reads from a table the caller keeps
    /// ([`Indirect`](super::kernel::Indirect)): a rebind moves what the checker and the
    /// simulator see, and on CUDA changes no node.
    Indirect(usize),
    /// The source of a copy.
    CopySrc,
    /// The destination of a copy.
    CopyDst,
    /// The destination of a memset.
    Memset,
    /// An argument of a library call or collective, which graphed passes but does not lay out.
    Opaque,
}

/// One buffer a node names: bytes `start..end` of `block`.
pub(crate) struct BufferUse {
    pub(crate) block: Arc<Block>,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) slot: Slot,
    pub(crate) writes: bool,
}

/// How one captured node names buffers.
pub(crate) struct Site {
    pub(crate) op: &'static str,
    pub(crate) uses: Vec<BufferUse>,
    /// Captured inside [`Stream::capture_off`](super::Stream::capture_off): every executable
    /// starts with its node turned off.
    pub(crate) off: bool,
}

thread_local! {
    /// Whether this thread is inside [`Stream::capture_off`](super::Stream::capture_off).
    static CAPTURING_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the operations this thread captures marked to start turned off.
pub(crate) fn capturing_off<T>(f: impl FnOnce() -> T) -> T {
    let before = CAPTURING_OFF.with(|c| c.replace(true));
    let out = f();
    CAPTURING_OFF.with(|c| c.set(before));
    out
}

impl Site {
    /// The site of `op`, captured as one node.
    pub(crate) fn of(op: &Op<'_>) -> Site {
        let name = op.name();
        let whole = |block: &Arc<Block>, offset: usize, bytes: usize, slot, writes| BufferUse {
            block: block.clone(),
            start: offset - block.base,
            end: offset - block.base + bytes,
            slot,
            writes,
        };
        let uses = match op {
            Op::Kernel { args, .. } | Op::Gemm { args, .. } | Op::Sdpa { args, .. } => {
                let library = !matches!(op, Op::Kernel { .. });
                args.iter()
                    .enumerate()
                    .filter_map(|(i, a)| match a {
                        Arg::Buf(b) => Some(BufferUse {
                            block: b.block.clone(),
                            start: b.view.offset() * b.dtype.size(),
                            end: b.view.end() * b.dtype.size(),
                            slot: match (library, b.indirect) {
                                (true, _) => Slot::Opaque,
                                (false, false) => Slot::Param(i),
                                (false, true) => Slot::Indirect(i),
                            },
                            writes: b.mode.writes(),
                        }),
                        Arg::Scalar(_) => None,
                    })
                    .collect()
            }
            Op::Copy { src, src_offset, dst, dst_offset, bytes, .. } => vec![
                whole(src, *src_offset, *bytes, Slot::CopySrc, false),
                whole(dst, *dst_offset, *bytes, Slot::CopyDst, true),
            ],
            Op::Memset { dst, offset, bytes, .. } => vec![whole(dst, *offset, *bytes, Slot::Memset, true)],
            Op::Collective { parts, .. } => parts
                .iter()
                .flat_map(|p| [(p.src.0, true), (p.dst.0, true)])
                .map(|(block, writes)| BufferUse {
                    block: block.clone(),
                    start: 0,
                    end: block.bytes,
                    slot: Slot::Opaque,
                    writes,
                })
                .collect(),
        };
        Site { op: name, uses, off: CAPTURING_OFF.with(std::cell::Cell::get) }
    }

    /// The site of a node graphed cannot patch (a call that added other than one node).
    pub(crate) fn opaque(mut self) -> Site {
        self.uses.iter_mut().for_each(|u| u.slot = Slot::Opaque);
        self
    }
}

/// Where a use of a site points now: bytes `start..` of `block`.
#[derive(Clone)]
pub(crate) struct Bound {
    pub(crate) block: Arc<Block>,
    pub(crate) start: usize,
}

/// Where an executable's moved uses point now, by (site, use), sorted; a use not listed points
/// where it was captured. Sparse: a switch moves a few dozen of an executable's hundreds of uses.
pub(crate) type Bindings = Vec<((usize, usize), Bound)>;

/// A site, where its moved uses point now (its part of [`Bindings`]), and whether a use that
/// the node itself holds moved (not only [`Slot::Indirect`] ones, which CUDA reads from the
/// caller's table).
pub(crate) type SiteChange<'b> = (usize, &'b [((usize, usize), Bound)], bool);

/// The sites `changed` (each with whether its node changes), each with its part of `bound`.
pub(crate) fn changes<'b>(changed: &[(usize, bool)], bound: &'b [((usize, usize), Bound)]) -> Vec<SiteChange<'b>> {
    let of = |s: usize| &bound[bound.partition_point(|e| e.0 .0 < s)..bound.partition_point(|e| e.0 .0 <= s)];
    changed.iter().map(|&(s, node)| (s, of(s), node)).collect()
}

/// The uses of a graph's sites, by the block they name.
pub(crate) struct UseIndex {
    /// By block, its (site, use) pairs, in capture order.
    by_block: HashMap<BufferId, Vec<(usize, usize)>>,
}

impl UseIndex {
    /// The index of `sites`.
    pub(crate) fn of(sites: &[Site]) -> UseIndex {
        let mut by_block: HashMap<BufferId, Vec<(usize, usize)>> = HashMap::default();
        for (s, site) in sites.iter().enumerate() {
            for (u, x) in site.uses.iter().enumerate() {
                by_block.entry(x.block.id).or_default().push((s, u));
            }
        }
        UseIndex { by_block }
    }

    /// Whether a use names `block`.
    pub(crate) fn names(&self, block: BufferId) -> bool {
        self.by_block.contains_key(&block)
    }

    /// The sites that name `block`, in capture order.
    pub(crate) fn sites_naming(&self, block: BufferId) -> impl Iterator<Item = usize> + '_ {
        let uses = self.by_block.get(&block).map_or(&[][..], Vec::as_slice);
        // A site's uses are listed together: each site once, at its first use.
        (0..uses.len()).filter(move |&i| i == 0 || uses[i - 1].0 != uses[i].0).map(move |i| uses[i].0)
    }
}

/// The uses of a graph that one [`Rebind`] moves, found once, each as (site, use, its first
/// byte's offset from the rebind's first byte): for a caller that moves the same uses again and
/// again (an offload switch), [`GraphExec::rebind_resolved`] applies it to any destination of
/// its size with no search and no checks but that size.
///
/// [`GraphExec::rebind_resolved`]: super::GraphExec::rebind_resolved
pub(crate) struct Resolved {
    /// The graph whose executables it applies to.
    pub(crate) graph: GraphId,
    pub(crate) moves: Vec<(usize, usize, usize)>,
    /// The rebind's bytes: a destination holds at least these.
    pub(crate) bytes: usize,
}

/// A [`Resolved`] rebind and where its uses point: bytes from the given one of the block, or
/// back where they were captured (`None`).
pub(crate) type ResolvedRebind<'a> = (&'a Resolved, Option<(&'a Arc<Block>, usize)>);

/// The uses of graph `graph` that each of `rebinds` moves, or why one is refused. `index` is
/// [`UseIndex::of`] `sites`.
pub(crate) fn plan(
    graph: GraphId,
    sites: &[Site],
    index: &UseIndex,
    rebinds: &[Rebind<'_>],
) -> std::result::Result<Vec<Resolved>, RebindErrorKind> {
    rebinds.iter().map(|r| resolve(graph, sites, index, r)).collect()
}

/// The uses of graph `graph` that `r` moves, or why it is refused ([`plan`] of one).
pub(crate) fn resolve(
    graph: GraphId,
    sites: &[Site],
    index: &UseIndex,
    r: &Rebind<'_>,
) -> std::result::Result<Resolved, RebindErrorKind> {
    let (from, to) = (r.from_start, r.from_start + r.bytes);
    let buffer = r.from.id;
    let mut moves = Vec::new();
    for &(s, u) in index.by_block.get(&buffer).into_iter().flatten() {
        let (site, x) = (&sites[s], &sites[s].uses[u]);
        if x.end <= from || to <= x.start {
            continue;
        }
        let op = site.op;
        if x.slot == Slot::Opaque {
            return Err(RebindErrorKind::Opaque { op, buffer });
        }
        if x.writes && (!r.writes || x.slot == Slot::Memset) {
            return Err(RebindErrorKind::Written { op, buffer });
        }
        if x.start < from || to < x.end {
            return Err(RebindErrorKind::Partial { op, buffer, start: x.start, end: x.end, from, to });
        }
        moves.push((s, u, x.start - from));
    }
    if moves.is_empty() {
        return Err(RebindErrorKind::NotRead { buffer });
    }
    Ok(Resolved { graph, moves, bytes: r.bytes })
}

/// The sites that name `buffer`, in capture order, for [`GraphExec::set_enabled`]; refused
/// where one is a library call or collective (graphed does not hold its nodes: a call may add
/// several) or where none names it. `index` is [`UseIndex::of`] `sites`.
///
/// [`GraphExec::set_enabled`]: super::GraphExec::set_enabled
pub(crate) fn naming(
    sites: &[Site],
    index: &UseIndex,
    buffer: BufferId,
) -> std::result::Result<Vec<usize>, RebindErrorKind> {
    let named: Vec<usize> = index.sites_naming(buffer).collect();
    if named.is_empty() {
        return Err(RebindErrorKind::NotNamed { buffer });
    }
    if let Some(&s) = named.iter().find(|&&s| sites[s].uses.iter().any(|u| u.slot == Slot::Opaque)) {
        return Err(RebindErrorKind::Opaque { op: sites[s].op, buffer });
    }
    Ok(named)
}

/// A moved range, as the checker sees it: accesses of bytes `start..end` of block `from` are
/// accesses of block `to` (of allocation `to_memory`, at `to_base` in it) from byte `to_start` on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Remap {
    pub(crate) from: BufferId,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) to: BufferId,
    pub(crate) to_memory: BufferId,
    pub(crate) to_base: usize,
    pub(crate) to_start: usize,
}

impl Remap {
    pub(crate) fn of(captured: &BufferUse, bound: &Bound) -> Remap {
        Remap {
            from: captured.block.id,
            start: captured.start,
            end: captured.end,
            to: bound.block.id,
            to_memory: bound.block.raw.id,
            to_base: bound.block.base,
            to_start: bound.start,
        }
    }
}
