//! What offloading is expected to save at the graph pool's peak: one step's saved blocks
//! replayed through the pool's own bookkeeping ([`Arena`]), with the gradient memory the
//! layers lend to the pool where they lend it.
//!
//! Note [Offloading lent memory]: with `GraphOptions::lend_gradients` (Note [Lent gradients] in
//! `graph/lend.rs`) a unit's saved blocks lie in the gradient memory of the layers below it
//! while it has room. That memory is the gradients': held whether a block lies in it or not.
//! Copying such a block out frees nothing a user can spend, and its copy back, allocated in the
//! backward of the unit above, may take only the memory of the layers below its own, which
//! their blocks still hold; unit 0's may take none. So offloading a lent block can raise the
//! pool's peak: at L on an H100 the automatic policy offloaded 192 MiB that it expected to
//! save, and the reserved peak rose by 384 MiB (`bench/results/2026-12-06-h100-offload-lend-1251e80.txt`).
//! The replay places every saved block as the pool does (lent memory first, the lowest layer
//! whose memory a block may take at best fit, then the pool's own memory), so the expected
//! saving is of the pool's own memory, and a choice that saves none of it can be dropped.
//!
//! What the replay leaves out: the passes' transients, which come and go within a pass and
//! take the same memory with or without offloading, and the layer outputs, which the next
//! layer saves as its input and so are counted there.

use super::policy::GroupLayout;
use crate::memory::arena::{block_size, segment_size, Arena, SegmentId};

/// The replay's one stream: the pool reuses a block in capture order.
const STREAM: u64 = 1;
/// The pool's own memory, one segment large enough for any step.
const OWN: SegmentId = 0;
/// The ids of small segments start above this one.
const SMALL_SEGMENTS: SegmentId = SegmentId::MAX / 2;

/// Per unit of a chunk (counted from 0), the bytes of each block it keeps on the device and of
/// each block it offloads, in save order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct UnitBlocks {
    pub(crate) kept: Vec<usize>,
    pub(crate) offloaded: Vec<usize>,
}

impl UnitBlocks {
    /// The units of one chunk's `groups`, as decided.
    pub(crate) fn of(groups: &[GroupLayout]) -> Vec<UnitBlocks> {
        let units = groups.iter().map(|g| g.pass + 1).max().unwrap_or(0);
        let mut out = vec![UnitBlocks::default(); units];
        for g in groups {
            for t in &g.tensors {
                let unit = &mut out[g.pass];
                if t.offload { &mut unit.offloaded } else { &mut unit.kept }.push(t.bytes());
            }
        }
        out
    }

    /// The same unit with nothing offloaded.
    fn all_kept(&self) -> UnitBlocks {
        UnitBlocks { kept: self.kept.iter().chain(&self.offloaded).copied().collect(), offloaded: Vec::new() }
    }
}

/// The expected saving of the pool's own memory at its peak, in bytes (negative where the
/// offloading raises the peak): the replayed peak with nothing offloaded minus the one with
/// `units` as decided. `lent[i]` is what layer `i` lends (empty: no lending).
pub(crate) fn expected_saving(units: &[UnitBlocks], lent: &[usize]) -> i64 {
    let none: Vec<UnitBlocks> = units.iter().map(UnitBlocks::all_kept).collect();
    own_peak(&none, lent) as i64 - own_peak(units, lent) as i64
}

/// The peak of the pool's own memory over one step of `units` (forwards 0..n, backwards n..0),
/// as the offload graphs order it: unit `q`'s offloaded blocks are held through the next
/// unit's forward, where their copy out runs, and come back in the backward of unit `q + 1`
/// (the last unit's in its own), which prefetches them.
pub(crate) fn own_peak(units: &[UnitBlocks], lent: &[usize]) -> usize {
    let mut arena = Arena::new();
    arena.add_segment(OWN, usize::MAX / 4);
    let lender = |i: usize| i as SegmentId + 1;
    for (i, &bytes) in lent.iter().enumerate().filter(|(_, b)| **b > 0) {
        arena.add_lent(lender(i), bytes);
    }
    // A block placed while layer `below` runs takes the memory of layers under `below` only;
    // a small one not lent takes a small segment, new ones as needed (Note [Small segments]).
    let mut next_small = SMALL_SEGMENTS;
    let mut place = |arena: &mut Arena, bytes: usize, below: usize| {
        let allowed = |s: SegmentId| s != OWN && (s as usize) <= below;
        let placed = arena.alloc_lent(bytes, STREAM, &allowed).or_else(|| arena.alloc(bytes, STREAM));
        let (segment, offset, _) = placed
            .or_else(|| {
                next_small += 1;
                arena.add_segment(next_small, segment_size(block_size(bytes)));
                arena.alloc(bytes, STREAM)
            })
            .expect("the pool's own segment holds any step, and a new small segment any small block");
        (segment, offset)
    };
    let n = units.len();
    let mut kept = vec![Vec::new(); n];
    let mut out = vec![Vec::new(); n];
    for (q, unit) in units.iter().enumerate() {
        kept[q] = unit.kept.iter().map(|&b| place(&mut arena, b, q)).collect();
        out[q] = unit.offloaded.iter().map(|&b| place(&mut arena, b, q)).collect();
        if q > 0 {
            std::mem::take(&mut out[q - 1]).into_iter().for_each(|(s, o)| _ = arena.free(s, o));
        }
    }
    if let Some(last) = out.last_mut() {
        std::mem::take(last).into_iter().for_each(|(s, o)| _ = arena.free(s, o));
    }
    let mut back = vec![Vec::new(); n];
    for k in (0..n).rev() {
        // Backward `k` takes the memory of the layers under `k - 1` only: `k - 1` reads its output.
        let mut reload = |arena: &mut Arena, q: usize| -> Vec<_> {
            units[q].offloaded.iter().map(|&b| place(arena, b, k.saturating_sub(1))).collect()
        };
        if k + 1 == n {
            back[k] = reload(&mut arena, k);
        }
        if k > 0 {
            back[k - 1] = reload(&mut arena, k - 1);
        }
        for (s, o) in std::mem::take(&mut kept[k]).into_iter().chain(std::mem::take(&mut back[k])) {
            arena.free(s, o);
        }
    }
    arena.stats().peak_allocated
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: usize = 1 << 20;

    fn units(n: usize, blocks: usize, offloaded: &[usize]) -> Vec<UnitBlocks> {
        (0..n)
            .map(|q| match offloaded.contains(&q) {
                true => UnitBlocks { kept: Vec::new(), offloaded: vec![B; blocks] },
                false => UnitBlocks { kept: vec![B; blocks], offloaded: Vec::new() },
            })
            .collect()
    }

    #[test]
    fn without_lending_the_offloaded_units_save_all_but_what_the_next_forward_holds() {
        // Units of two blocks; units 0 and 1 offloaded, two kept: all four blocks saved.
        assert_eq!(expected_saving(&units(4, 2, &[0, 1]), &[]), 4 * B as i64);
        // One kept: unit 2's blocks are still held while unit 3's forward copies them out.
        assert_eq!(expected_saving(&units(4, 2, &[0, 1, 2]), &[]), 4 * B as i64);
    }

    #[test]
    fn blocks_in_lent_memory_save_nothing_and_unit_zeros_copy_back_takes_its_own() {
        // Every layer lends room for two units: units 1.. lie in lent memory, unit 0 in the
        // pool's own, and its copy back (in backward 1, where no layer below 0 lends) too.
        let lent = [4 * B; 4];
        assert_eq!(own_peak(&units(4, 2, &[]), &lent), 2 * B);
        assert_eq!(expected_saving(&units(4, 2, &[1, 2]), &lent), 0);
        assert_eq!(expected_saving(&units(4, 2, &[0]), &lent), 0);
    }

    #[test]
    fn lent_memory_too_small_leaves_the_overflow_to_save() {
        // Three units of two blocks, one block lent per layer. Nothing offloaded: unit 0 in
        // the pool's own memory (2), unit 1 half in layer 0's (3), unit 2 half in layer 1's (4).
        // Unit 0 offloaded: its own memory goes to units 1 and 2 (2 at the forward's end), and
        // comes back beside unit 1's own block in backward 1 (3): one block saved, not two.
        let lent = [B; 3];
        assert_eq!(own_peak(&units(3, 2, &[]), &lent), 4 * B);
        assert_eq!(expected_saving(&units(3, 2, &[0]), &lent), B as i64);
    }
}
