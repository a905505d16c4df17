//! Launch geometry of `attention.cu`'s kernels: which tile of rows each CTA owns, how many threads
//! it has and how much dynamic shared memory it needs. The tile constants mirror the CUDA source's
//! `AttnTiles<HD>` and `ATTN_*` macros (a test checks the text), so the two cannot drift apart.
//!
//! Every kernel puts `pairs` (batch·heads) in grid.x and its tiles of query or key rows in grid.y
//! (the CUDA side walks them heaviest causal tile first); the delta kernel is one-dimensional.

use crate::device::{DType, LaunchDims};

/// Which of the four kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward,
    Delta,
    BackwardDkDv,
    BackwardDq,
}

/// Threads per block of the delta kernel (`ATTN_DELTA_THREADS`).
const DELTA_THREADS: u32 = 256;
/// Threads per block of the f32 kernels (`ATTN_F32_THREADS`); `HD / 32` threads share a row.
const F32_THREADS: u32 = 128;

/// The bf16 tile constants of one head width, as `AttnTiles<HD>` in attention.cu.
struct Bf16Tiles {
    /// Forward: 16-row MMA tiles per warp, warps, keys per K/V tile.
    fmw: u32,
    fnw: u32,
    fbn: u32,
    /// dK/dV: warps (16 keys each), query rows per tile, K and V fragments kept in registers.
    knw: u32,
    kbm: u32,
    // Changes no launch size (K and V have their shared memory either way); mirrored for the test.
    #[cfg_attr(not(test), allow(dead_code))]
    kregs: bool,
    /// dQ: warps (16 query rows each), keys per K/V tile.
    qnw: u32,
    qbn: u32,
}

fn bf16_tiles(hd: usize) -> Bf16Tiles {
    match hd {
        32 | 64 => Bf16Tiles { fmw: 2, fnw: 4, fbn: 64, knw: 8, kbm: 64, kregs: true, qnw: 8, qbn: 32 },
        _ => Bf16Tiles { fmw: 1, fnw: 8, fbn: 64, knw: 8, kbm: 32, kregs: false, qnw: 8, qbn: 32 },
    }
}

/// Grid, block and dynamic shared memory of `pass` for `pairs` (batch·heads) of `seq` rows of head
/// width `hd` in `dtype` (F32 or BF16; hd one of 32, 64, 128 — the caller has checked).
pub(crate) fn launch_dims(pass: Pass, dtype: DType, hd: usize, seq: usize, pairs: usize) -> LaunchDims {
    let tiles = |rows: u32| seq.div_ceil(rows as usize).max(1) as u32;
    if pass == Pass::Delta {
        let rows_per_block = DELTA_THREADS as usize / (hd / 8);
        let blocks = (pairs * seq).div_ceil(rows_per_block).max(1) as u32;
        return LaunchDims {
            grid: (blocks, 1, 1),
            block: (DELTA_THREADS, 1, 1),
            shared_mem_bytes: 0,
            grid_stride: false,
        };
    }
    let (rows, threads, smem) = if dtype == DType::F32 {
        // One row per hd/32 threads; the other operand in static shared memory.
        (F32_THREADS / (hd as u32 / 32), F32_THREADS, 0)
    } else {
        let t = bf16_tiles(hd);
        let row_bytes = hd as u32 * 2;
        match pass {
            Pass::Forward => {
                let bm = 16 * t.fmw * t.fnw;
                // Q [bm], K and V [2][bn] rows.
                (bm, 32 * t.fnw, (bm + 4 * t.fbn) * row_bytes)
            }
            Pass::BackwardDkDv => {
                let bn = 16 * t.knw;
                // K, V [bn], Q and dO [2][bm] rows; lse and delta [2][bm] f32.
                (bn, 32 * t.knw, (2 * bn + 4 * t.kbm) * row_bytes + 4 * t.kbm * 4)
            }
            Pass::BackwardDq | Pass::Delta => {
                let bm = 16 * t.qnw;
                // Q, dO [bm], K and V [2][bn] rows; lse and delta [bm] f32.
                (bm, 32 * t.qnw, (2 * bm + 4 * t.qbn) * row_bytes + 2 * bm * 4)
            }
        }
    };
    LaunchDims {
        grid: (pairs as u32, tiles(rows), 1),
        block: (threads, 1, 1),
        shared_mem_bytes: smem,
        grid_stride: false,
    }
}

/// Query or key rows one CTA of `pass` owns (grid.y tiles).
#[cfg(test)]
fn rows_per_cta(pass: Pass, dtype: DType, hd: usize) -> usize {
    if dtype == DType::F32 {
        return (F32_THREADS as usize) / (hd / 32);
    }
    let t = bf16_tiles(hd);
    (match pass {
        Pass::Forward => 16 * t.fmw * t.fnw,
        Pass::BackwardDkDv => 16 * t.knw,
        _ => 16 * t.qnw,
    }) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = include_str!("../attention.cu");

    #[test]
    fn geometry_covers_every_row_and_fits_shared_memory() {
        for dtype in [DType::F32, DType::BF16] {
            for hd in [32, 64, 128] {
                for seq in [1, 63, 64, 65, 2048] {
                    for pairs in [1, 128] {
                        for pass in [Pass::Forward, Pass::BackwardDkDv, Pass::BackwardDq] {
                            let d = launch_dims(pass, dtype, hd, seq, pairs);
                            let rows = rows_per_cta(pass, dtype, hd);
                            assert_eq!(d.grid.0 as usize, pairs, "{pass:?} {dtype:?} hd {hd} seq {seq}");
                            let tiles = d.grid.1 as usize;
                            assert!(tiles * rows >= seq && (tiles - 1) * rows < seq, "{pass:?} {hd} {seq}");
                            assert!(tiles <= 65535 && d.grid.2 == 1);
                            assert!(d.shared_mem_bytes <= 227 * 1024, "{pass:?} {hd}: {}", d.shared_mem_bytes);
                            assert!(d.block.0 <= 1024 && d.block.0.is_multiple_of(32));
                        }
                        let d = launch_dims(Pass::Delta, dtype, hd, seq, pairs);
                        let per_block = d.block.0 as usize / (hd / 8);
                        assert!(d.grid.0 as usize * per_block >= pairs * seq);
                        assert!((d.grid.0 as usize - 1) * per_block < pairs * seq);
                    }
                }
            }
        }
    }

    #[test]
    fn constants_match_the_cuda_source() {
        assert!(SOURCE.contains(&format!("#define ATTN_DELTA_THREADS {DELTA_THREADS}\n")));
        assert!(SOURCE.contains(&format!("#define ATTN_F32_THREADS {F32_THREADS}\n")));
        // The dQ entry points' __launch_bounds__ name ATTN_DQ_THREADS: it must be the dQ block size.
        for hd in [32, 64] {
            let threads = launch_dims(Pass::BackwardDq, DType::BF16, hd, 64, 1).block.0;
            assert!(SOURCE.contains(&format!("#define ATTN_DQ_THREADS {threads}\n")));
        }
        for hd in [32, 64, 128] {
            let t = bf16_tiles(hd);
            let text = format!(
                "template <> struct AttnTiles<{hd}> {{\n    static constexpr int FMW = {}, FNW = {}, FBN = {}, KNW = {}, \
                 KBM = {}, QNW = {}, QBN = {};\n    static constexpr bool KREGS = {};\n}};",
                t.fmw, t.fnw, t.fbn, t.knw, t.kbm, t.qnw, t.qbn, t.kregs
            );
            assert!(SOURCE.contains(&text), "attention.cu lacks {text}");
        }
    }
}
