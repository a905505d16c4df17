//! Pass-local blocks: the allocator learns, in a pass run eagerly, which of its allocations die
//! within the pass, so that the same allocations of the captured pass may take lent memory that
//! is dead for the length of the pass only.
//!
//! Note [Pass-local blocks]: lent gradient memory (Note [Lent gradients] in `graph/lend.rs`) is
//! dead for a window of the step. A block that outlives its pass must fit the window from its
//! pass to its last reader; a block that dies within its pass needs the pass only, which more
//! lenders cover: every layer's gradients are dead during any forward, and layer `k - 1`'s
//! during backward `k`. Which blocks die within their pass is not known when they are allocated,
//! but a pass asks for the same sequence of sizes on every run. So the warmup, which runs each
//! pass eagerly before its capture, has the allocator record each allocation of the pass on its
//! stream: its size, and whether the pass freed it ([`Lifetimes`]). The capture of that pass
//! expects the same sequence ([`GraphPool::expect`](super::GraphPool::expect)): an allocation
//! the size of the next expected one, which the warmup freed, may take the wider memory; the
//! first allocation that differs ends the expectation, and every later one is taken to outlive
//! the pass. When the captured pass ends, every block placed in memory only a pass-local block
//! may take must be free again, or the capture is refused: a pass that allocates differently
//! when captured than in the warmup cannot leave anything where a later pass zeroes it.
//! Allocations that a captured pass makes by design and its warmup does not (the offload's
//! reloads, whose warmup runs with offloading off) are made outside the expectation
//! ([`CachingAllocator::outside_expectation`](super::CachingAllocator::outside_expectation)),
//! so that they neither stand in for the warmup's allocations nor end the expectation early.

use super::arena::{SegmentId, StreamKey};
use super::pool::PoolId;
use crate::device::BufferId;

/// Per allocation of one pass on its stream, in order: its size in bytes, and whether the pass
/// freed it before it ended (Note [Pass-local blocks]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Lifetimes(pub(crate) Vec<(usize, bool)>);

/// Where a handed-out block is: its pool (none: the cache), segment and offset.
pub(crate) type Place = (Option<PoolId>, SegmentId, usize);

/// The allocations of one stream being learned.
pub(crate) struct Learning {
    pub(crate) stream: StreamKey,
    /// Each allocation's size, place and buffer, in order.
    pub(crate) seen: Vec<(usize, Place, BufferId)>,
}

/// What the capture in progress expects of its allocations.
pub(crate) struct Expectation {
    /// The capture stream: allocations on streams forked from it are not expected.
    pub(crate) stream: StreamKey,
    lifetimes: Lifetimes,
    /// The index of the next allocation expected; `None` once one differed.
    next: Option<usize>,
    /// The lent segments that pass-local blocks may take besides the open ones.
    pub(crate) wide: Vec<SegmentId>,
    /// The blocks placed where only pass-local blocks may go: segment, offset, buffer and size.
    pub(crate) placed: Vec<(SegmentId, usize, BufferId, usize)>,
    /// Whether allocations now are outside the pass's sequence
    /// ([`CachingAllocator::outside_expectation`](super::CachingAllocator::outside_expectation)).
    pub(crate) paused: bool,
}

impl Expectation {
    pub(crate) fn new(stream: StreamKey, lifetimes: Lifetimes, wide: Vec<SegmentId>) -> Expectation {
        Expectation { stream, lifetimes, next: Some(0), wide, placed: Vec::new(), paused: false }
    }

    /// Whether the next allocation, of `bytes`, dies within the pass by the warmup's account;
    /// an allocation the warmup did not make ends the expectation.
    pub(crate) fn pass_local(&mut self, bytes: usize) -> bool {
        let Some(i) = self.next.filter(|_| !self.paused) else { return false };
        match self.lifetimes.0.get(i) {
            Some(&(size, freed)) if size == bytes => {
                self.next = Some(i + 1);
                freed
            }
            _ => {
                self.next = None;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CaptureMode, Device, DeviceBuffer, Policy, SimConfig, Stream};
    use crate::memory::CachingAllocator;
    use crate::Result;

    /// A stream of an in-order simulator, its allocator, and 16 KiB of gradients to lend.
    fn lender() -> Result<(Stream, CachingAllocator, DeviceBuffer<f32>)> {
        let dev = Device::sim_with(SimConfig { policy: Policy::InOrder, seed: 0, memory: 64 << 20 });
        let s = dev.stream()?;
        let alloc = CachingAllocator::new(&dev);
        let grads = alloc.alloc::<f32>(&s, 4096)?;
        Ok((s, alloc, grads))
    }

    /// A block the warmup freed within its pass takes memory lent for the pass alone; one it kept
    /// does not; a pass-local block still held when the pass ends is reported.
    #[test]
    fn blocks_the_warmup_freed_take_memory_lent_for_the_pass() -> Result<()> {
        let (s, alloc, grads) = lender()?;
        let learning = alloc.learn(&s);
        let (short, long) = (alloc.alloc::<f32>(&s, 256)?, alloc.alloc::<f32>(&s, 256)?);
        drop(short);
        assert_eq!(alloc.headroom(&s)?, 0, "a learned pass's sizes must not follow the room");
        let lifetimes = learning.finish()?;
        assert_eq!(lifetimes, Lifetimes(vec![(1024, true), (1024, false)]));
        // Room is for requests above 1 MiB (Note [Small segments]): a freed block of 2 MiB.
        drop(alloc.alloc::<f32>(&s, 1 << 19)?);
        assert_eq!(alloc.headroom(&s)?, 2 << 20, "a freed block, once the learning ended");
        drop(long);
        let pool = alloc.new_pool();
        pool.lend(super::super::LentRange::of(7, &grads, 0..4096).expect("aligned"));
        let lent = |b: &DeviceBuffer<f32>| alloc.block_of(b.id()).is_some_and(|e| e.lent);
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
        pool.expect(&s, &lifetimes, &[7]);
        let (short, long) = (alloc.alloc::<f32>(&s, 256)?, alloc.alloc::<f32>(&s, 256)?);
        assert!(lent(&short) && !lent(&long), "only the block the warmup freed is lent memory");
        drop(short);
        assert_eq!(alloc.headroom(&s)?, 0, "an expected pass's sizes must not follow the room");
        assert_eq!(pool.end_expect(), 0);
        pool.expect(&s, &lifetimes, &[7]);
        let held = alloc.alloc::<f32>(&s, 256)?;
        assert!(lent(&held));
        assert_eq!(pool.end_expect(), 1024, "a pass-local block outlived the pass");
        drop((held, long));
        cap.finish()?;
        Ok(())
    }

    /// The offload's reloads, which the warmup (offloading off) never made and which outlive
    /// the pass: allocated outside the expectation, one the size of the warmup's next
    /// pass-local allocation neither takes lent memory nor moves the expectation on, so the
    /// warmup's allocation after it still does.
    #[test]
    fn allocations_outside_the_expectation_take_no_pass_local_memory() -> Result<()> {
        let (s, alloc, grads) = lender()?;
        let learning = alloc.learn(&s);
        drop(alloc.alloc::<f32>(&s, 256)?);
        let lifetimes = learning.finish()?;
        assert_eq!(lifetimes, Lifetimes(vec![(1024, true)]));
        let pool = alloc.new_pool();
        pool.lend(super::super::LentRange::of(7, &grads, 0..4096).expect("aligned"));
        let lent = |b: &DeviceBuffer<f32>| alloc.block_of(b.id()).is_some_and(|e| e.lent);
        let cap = alloc.capture(&s, CaptureMode::ThreadLocal, &pool)?;
        pool.expect(&s, &lifetimes, &[7]);
        let reload = alloc.outside_expectation(&s, || alloc.alloc::<f32>(&s, 256))?;
        assert!(!lent(&reload), "an allocation outside the expectation took pass-local memory");
        let own = alloc.alloc::<f32>(&s, 256)?;
        assert!(lent(&own), "the warmup's allocation after it was not expected");
        drop(own);
        assert_eq!(pool.end_expect(), 0, "the reload outlives the pass outside lent memory");
        drop(reload);
        cap.finish()?;
        Ok(())
    }

    #[test]
    fn an_allocation_the_warmup_did_not_make_ends_the_expectation() {
        let mut e = Expectation::new(0, Lifetimes(vec![(8, true), (16, false), (8, true), (8, true)]), vec![1]);
        assert!(e.pass_local(8));
        assert!(!e.pass_local(16), "the warmup kept the second");
        assert!(!e.pass_local(32), "a size the warmup did not ask for");
        assert!(!e.pass_local(8), "the expectation ended at the first difference");
        assert!(!e.pass_local(8));
    }

    #[test]
    fn more_allocations_than_the_warmup_made_are_not_pass_local() {
        let mut e = Expectation::new(0, Lifetimes(vec![(8, true)]), vec![1]);
        assert!(e.pass_local(8));
        assert!(!e.pass_local(8));
    }
}
