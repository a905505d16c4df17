//! Declared memory accesses: what an enqueued operation reads and writes.
//!
//! Every operation declares its accesses, derived from its typed arguments (see
//! [`kernel`](super::kernel)). The simulator executes a kernel on exactly these regions, the
//! checker orders them, and graph capture verifies the replay contract from them. Regions are
//! strided (up to four count/stride dimensions), not byte hulls, so a view of one attention head
//! or a matrix with a leading-dimension gap does not conflict with its neighbours.

use super::BufferId;

/// How an operation touches a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessMode {
    /// Reads only.
    Read,
    /// Writes every element of the region without reading it.
    Write,
    /// Reads and writes.
    ReadWrite,
}

impl AccessMode {
    /// Whether the region is read.
    pub fn reads(self) -> bool {
        matches!(self, AccessMode::Read | AccessMode::ReadWrite)
    }

    /// Whether the region is written.
    pub fn writes(self) -> bool {
        matches!(self, AccessMode::Write | AccessMode::ReadWrite)
    }
}

/// One dimension of a strided region, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dim {
    /// Number of positions along this dimension.
    pub count: usize,
    /// Distance in elements between consecutive positions.
    pub stride: usize,
}

/// A strided set of elements of one buffer: `offset + Σ iₖ·strideₖ` for `iₖ < countₖ`,
/// outermost dimension first. Elements are enumerated in that (row-major) order.
///
/// ```
/// use graphed::device::Region;
/// // Head 1 of a (seq=4, heads=2, dim=3) row-major tensor: 4 rows of 3 elements, 6 apart.
/// let head = Region::strided(3, &[(4, 6), (3, 1)]).unwrap();
/// assert_eq!(head.len(), 12);
/// assert_eq!(head.end(), 24);
/// assert!(!head.is_contiguous());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    offset: usize,
    rank: u8,
    dims: [Dim; MAX_RANK],
}

/// The most dimensions a region has: a (batch, head, row, feature) view of attention operands
/// kept as column slices of a row-major matrix has four.
pub const MAX_RANK: usize = 4;

const UNIT: Dim = Dim { count: 1, stride: 1 };

impl Region {
    /// `len` consecutive elements starting at `offset`.
    pub fn contiguous(offset: usize, len: usize) -> Region {
        Region { offset, rank: 1, dims: [Dim { count: len, stride: 1 }, UNIT, UNIT, UNIT] }
    }

    /// A strided region; `dims` are `(count, stride)` pairs, outermost first, at most four.
    /// Returns `None` for more.
    pub fn strided(offset: usize, dims: &[(usize, usize)]) -> Option<Region> {
        if dims.len() > MAX_RANK {
            return None;
        }
        let mut out = [UNIT; MAX_RANK];
        for (slot, &(count, stride)) in out.iter_mut().zip(dims) {
            *slot = Dim { count, stride };
        }
        Some(Region { offset, rank: dims.len().max(1) as u8, dims: out })
    }

    /// First element (the base of the region).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The same dimensions from another first element.
    pub(crate) fn moved_to(&self, offset: usize) -> Region {
        Region { offset, ..*self }
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[Dim] {
        &self.dims[..self.rank as usize]
    }

    /// Number of elements in the region.
    pub fn len(&self) -> usize {
        self.dims().iter().map(|d| d.count).product()
    }

    /// Whether the region has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One past the highest element index touched (`offset` for an empty region).
    pub fn end(&self) -> usize {
        if self.is_empty() {
            return self.offset;
        }
        self.offset + self.dims().iter().map(|d| (d.count - 1) * d.stride).sum::<usize>() + 1
    }

    /// Whether the elements are consecutive and in order.
    pub fn is_contiguous(&self) -> bool {
        self.is_empty() || self.end() - self.offset == self.len() && self.is_injective_dense()
    }

    /// Refuses a region of `buffer` that is not contiguous, for `op`, which needs one.
    pub(crate) fn expect_contiguous(&self, op: &'static str, buffer: BufferId) -> crate::Result<()> {
        match self.is_contiguous() {
            true => Ok(()),
            false => Err(crate::Error::NotContiguous { op, buffer }),
        }
    }

    fn is_injective_dense(&self) -> bool {
        let mut expected = 1;
        for d in self.dims().iter().rev() {
            if d.count > 1 && d.stride != expected {
                return false;
            }
            expected *= d.count;
        }
        true
    }

    /// The same region `by` elements further.
    pub fn shifted(&self, by: usize) -> Region {
        Region { offset: self.offset + by, ..*self }
    }

    /// Whether element `i` is in the region. Exact for regions whose dimensions nest (each
    /// stride at least the extent of the dimensions inside it, as views of tensors do);
    /// otherwise true whenever `i` is inside the region's hull (a conservative answer).
    pub fn contains(&self, i: usize) -> bool {
        if i < self.offset || i >= self.end() {
            return false;
        }
        let mut dims: Vec<Dim> = self.dims().iter().copied().filter(|d| d.count > 1).collect();
        dims.sort_by_key(|d| std::cmp::Reverse(d.stride));
        let nested = dims.windows(2).all(|w| w[0].stride >= w[1].stride * w[1].count);
        if !nested {
            return true;
        }
        let mut rem = i - self.offset;
        for d in &dims {
            let k = (rem / d.stride).min(d.count - 1);
            rem -= k * d.stride;
        }
        rem == 0
    }

    /// Whether the two regions share an element. Exact for nesting regions of up to 2^16
    /// elements; larger or irregular ones that share a hull are reported as overlapping.
    pub fn overlaps(&self, other: &Region) -> bool {
        if self.is_empty() || other.is_empty() || self.end() <= other.offset || other.end() <= self.offset {
            return false;
        }
        if self.is_contiguous() && other.is_contiguous() {
            return true;
        }
        let (small, big) = if self.len() <= other.len() { (self, other) } else { (other, self) };
        if small.len() > 1 << 16 {
            return true;
        }
        small.indices().any(|i| big.contains(i))
    }

    /// Element indices in enumeration order.
    pub fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        let [d0, d1, d2, d3] = self.dims;
        let base = self.offset;
        (0..d0.count).flat_map(move |i| {
            (0..d1.count).flat_map(move |j| {
                (0..d2.count).flat_map(move |k| {
                    let at = base + i * d0.stride + j * d1.stride + k * d2.stride;
                    (0..d3.count).map(move |l| at + l * d3.stride)
                })
            })
        })
    }

    /// Calls `f(start, len)` for each maximal run of consecutive elements, in order.
    pub(crate) fn for_each_run(&self, mut f: impl FnMut(usize, usize)) {
        let dims = self.dims();
        let inner = dims[dims.len() - 1];
        if inner.stride != 1 || inner.count <= 1 {
            self.indices().for_each(|i| f(i, 1));
            return;
        }
        let outer = Region::strided(
            self.offset,
            &dims[..dims.len() - 1].iter().map(|d| (d.count, d.stride)).collect::<Vec<_>>(),
        )
        .expect("fewer dimensions than a valid region");
        if dims.len() == 1 {
            f(self.offset, inner.count);
        } else {
            outer.indices().for_each(|i| f(i, inner.count));
        }
    }
}

/// Who declared an access: a kernel argument, or a hidden access of a library call (a GEMM
/// workspace, an epilogue output) that no argument names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessRole {
    /// Argument `index` of the launch.
    Arg(usize),
    /// Hidden access, named for reports.
    Hidden(&'static str),
}

/// One declared access of an enqueued operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Access {
    /// The buffer touched.
    pub buffer: BufferId,
    /// The allocation the buffer is a block of (a segment of an allocator, or the buffer's own
    /// allocation): blocks reused by another buffer meet here.
    pub memory: BufferId,
    /// `region` in elements from the start of `memory`.
    pub at: Region,
    /// Size of one element of `region`, in bytes.
    pub elem_bytes: usize,
    /// Which elements.
    pub region: Region,
    /// Read, write or both.
    pub mode: AccessMode,
    /// Where the declaration comes from.
    pub role: AccessRole,
}

impl Access {
    /// Its first and past-the-last byte in `memory`.
    pub fn byte_hull(&self) -> (usize, usize) {
        (self.at.offset() * self.elem_bytes, self.at.end() * self.elem_bytes)
    }

    /// Whether it and `other` touch a common byte of the same memory: exactly for equal element
    /// sizes, by byte hulls otherwise (memory a block of another type reused, which a strided
    /// pattern rarely interleaves).
    pub fn overlaps(&self, other: &Access) -> bool {
        if self.memory != other.memory {
            return false;
        }
        if self.elem_bytes == other.elem_bytes {
            return self.at.overlaps(&other.at);
        }
        let ((a0, a1), (b0, b1)) = (self.byte_hull(), other.byte_hull());
        !self.at.is_empty() && !other.at.is_empty() && a0 < b1 && b0 < a1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accesses_of_other_element_sizes_compare_in_bytes() {
        let access = |offset, len, elem_bytes| Access {
            buffer: BufferId(1),
            memory: BufferId(1),
            at: Region::contiguous(offset, len),
            elem_bytes,
            region: Region::contiguous(0, len),
            mode: AccessMode::Read,
            role: AccessRole::Arg(0),
        };
        // f32 elements [100, 110) are bytes [400, 440); bf16 elements [210, 220) bytes [420, 440).
        assert!(access(100, 10, 4).overlaps(&access(210, 10, 2)));
        // bf16 elements [100, 110) are bytes [200, 220): apart, though the element ranges meet.
        assert!(!access(100, 10, 4).overlaps(&access(100, 10, 2)));
    }

    #[test]
    fn contiguous_region_enumerates_in_order() {
        let r = Region::contiguous(5, 4);
        assert_eq!(r.indices().collect::<Vec<_>>(), vec![5, 6, 7, 8]);
        assert!(r.is_contiguous());
        assert_eq!(r.end(), 9);
    }

    #[test]
    fn head_view_skips_other_heads() {
        // (seq=2, heads=2, dim=2): head 0 is elements 0,1 and 4,5.
        let r = Region::strided(0, &[(2, 4), (2, 1)]).unwrap();
        assert_eq!(r.indices().collect::<Vec<_>>(), vec![0, 1, 4, 5]);
        assert!(!r.is_contiguous());
        let mut runs = vec![];
        r.for_each_run(|s, n| runs.push((s, n)));
        assert_eq!(runs, vec![(0, 2), (4, 2)]);
    }

    #[test]
    fn interleaved_heads_do_not_overlap_but_a_row_does() {
        let head0 = Region::strided(0, &[(4, 6), (3, 1)]).unwrap();
        let head1 = Region::strided(3, &[(4, 6), (3, 1)]).unwrap();
        assert!(!head0.overlaps(&head1) && !head1.overlaps(&head0));
        assert!(head1.overlaps(&Region::contiguous(6, 6)), "row 1 holds head 1's elements 9..12");
        assert!(!head1.overlaps(&Region::contiguous(6, 3)));
        assert!(head0.contains(13) && !head0.contains(15));
    }

    #[test]
    fn a_dense_matrix_is_contiguous_and_too_many_dims_are_refused() {
        assert!(Region::strided(0, &[(3, 4), (4, 1)]).unwrap().is_contiguous());
        assert!(Region::strided(0, &[(1, 1); MAX_RANK + 1]).is_none());
    }

    /// Part 1 of 3 of (B·T, 3C) rows as (B, H, T, hd) heads (B = 2, H = 3, T = 2, hd = 2, so C =
    /// 6 and rows 18 apart): four dimensions, enumerated in head order, apart from parts 0 and 2.
    #[test]
    fn a_column_block_of_rows_is_a_four_dimensional_region() {
        let part = |j: usize| Region::strided(6 * j, &[(2, 36), (3, 2), (2, 18), (2, 1)]).unwrap();
        let k = part(1);
        assert_eq!(k.len(), 24);
        assert_eq!(k.indices().take(6).collect::<Vec<_>>(), vec![6, 7, 24, 25, 8, 9], "head 0's rows, then head 1's");
        assert!(k.contains(6) && k.contains(47) && !k.contains(5) && !k.contains(12));
        assert!(!k.overlaps(&part(0)) && !k.overlaps(&part(2)) && k.overlaps(&Region::contiguous(11, 2)));
    }
}
