// Fused causal attention (FlashAttention-2, Dao 2023): forward, the row dot products D = rowsum(dO∘O),
// and a backward in two kernels, in f32 (SIMT, tiles in shared memory) and bf16 (tensor cores through
// inline PTX: mma.sync m16n8k16, ldmatrix, cp.async). Compiled after float.cu (bf16, conversions) and
// rng.cu (philox_block). docs/attention-kernels.md describes tiles, layouts and limits; tiles.rs
// computes the launch geometry, whose constants must match the ones here (ATTN_* below).
//
// Layout: q, k, v, out, dout, dq, dk, dv are (B, H, seq, HD) views whose rows are HD contiguous
// elements (AttnLayout: one batch, head and row stride per group of operands, so that a layer's
// attention reads its output and gradients where its GEMMs keep them, with no copies); lse and
// delta are f32 (pairs, seq), pair = b·H + h. Grid: pairs in grid.x, query or key tiles in grid.y, the heaviest causal tile first
// (query tile gridDim.y - 1 - blockIdx.y in the forward and dQ, key tile blockIdx.y in dK/dV). bf16 pointers must be 16-byte aligned (cp.async).
//
// Math (row i, key j <= i): s = scale * q_i·k_j in f32; lse_i = ln Σ_j exp(s_ij) (computed in base 2
// with scale·log2(e) folded into one multiply, stored as a natural log); p = exp(s - lse). Dropout
// (threshold != 0): element n = ((pair·seq) + i)·seq + j is kept iff lane n % 4 of
// philox_block(seed, site, *step, n / 4) >= threshold, exactly the draw of the dropout op for
// element n of a contiguous (pairs, seq, seq) tensor. p̃ = kept ? p·keep_scale : 0; lse from the
// undropped p. With threshold == 0 no Philox call is made.
//
// Determinism: no atomics; every output element is written once by one thread after a fixed-order
// accumulation (quad shuffles in a fixed xor order), so results are bitwise reproducible. That is
// why the backward is two kernels: dK/dV with one CTA per key tile, dQ with one CTA per query tile.

#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

// 2^x by one MUFU.EX2 (subnormal results flush to zero; 2^-inf = 0).
__device__ __forceinline__ float attn_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float attn_neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float attn_pos_inf() { return __int_as_float(0x7f800000); }

// 1: the bf16 kernels' per-tile elementwise code (softmax, dS) is instantiated twice, with and
// without dropout, and one branch per tile picks it, so that the common path (no dropout) is a
// branch-free block the scheduler can interleave with the MMAs. 0: one instantiation that tests
// the threshold per element (the earlier code). Same results either way.
#define ATTN_SPLIT_DROPOUT 1

// A compile-time flag as a value (a generic lambda's argument selects its instantiation).
template <bool B> struct AttnFlag {
    static constexpr bool value = B;
};

// ---- dropout ------------------------------------------------------------------------------------

struct AttnDrop {
    unsigned seed, site, threshold;
    unsigned long long step;
    float keep_scale;
};

// ---- layout ---------------------------------------------------------------------------------------

// Where one group of operands keeps its rows: element (b, h, i, d) of a (B, H, seq, HD) view at
// b·batch + h·head + i·row + d (elements). Contiguous heads: batch = H·seq·HD, head = seq·HD,
// row = HD; a slice of HD columns per head of a (B·seq, n) matrix: batch = seq·n, head = HD, row = n.
struct AttnRows {
    unsigned long long batch, head, row;
    // The first element of pair p's matrix.
    __device__ __forceinline__ unsigned long long at(unsigned long long p, unsigned heads) const {
        return p / heads * batch + p % heads * head;
    }
};

// One call's shape and its three groups of operands: the inputs q, k and v (`in`), the gradients dq,
// dk and dv (`grad`), and the output and its gradient, out and dout (`outs`).
struct AttnLayout {
    unsigned seq, heads;
    AttnRows in, grad, outs;
};

// Lane k of four numbers, without indexing a local array (which would put it in local memory).
__device__ __forceinline__ unsigned attn_lane(const unsigned r[4], unsigned k) {
    return k == 0 ? r[0] : k == 1 ? r[1] : k == 2 ? r[2] : r[3];
}

// Whether element n is kept (one Philox call).
__device__ __forceinline__ bool attn_kept(const AttnDrop& d, unsigned long long n) {
    unsigned r[4];
    philox_block(r, d.seed, d.site, d.step, n >> 2);
    return attn_lane(r, (unsigned)(n & 3)) >= d.threshold;
}

// Whether elements n and n + 1 are kept: one Philox call, two when they straddle a group of four.
__device__ __forceinline__ void attn_kept2(const AttnDrop& d, unsigned long long n, bool& k0, bool& k1) {
    unsigned r[4];
    philox_block(r, d.seed, d.site, d.step, n >> 2);
    unsigned lane = (unsigned)(n & 3);
    k0 = attn_lane(r, lane) >= d.threshold;
    if (lane == 3) {
        philox_block(r, d.seed, d.site, d.step, (n >> 2) + 1);
        k1 = r[0] >= d.threshold;
    } else {
        k1 = attn_lane(r, lane + 1) >= d.threshold;
    }
}

// ---- delta: D_r = Σ_d f32(dout[r,d]) · f32(out[r,d]) ----------------------------------------------
// G = HD/8 consecutive threads per row, each summing its 8 consecutive elements in order, then an
// xor tree over the G lanes: the order depends on HD only. Block ATTN_DELTA_THREADS threads.

#define ATTN_DELTA_THREADS 256

template <typename T, int HD>
__device__ void attention_delta(float* delta, const T* out, const T* dout, unsigned long long rows,
                                const AttnLayout& L) {
    constexpr int G = HD / 8;
    const unsigned part = threadIdx.x % G;
    const unsigned long long row = (unsigned long long)blockIdx.x * (ATTN_DELTA_THREADS / G) + threadIdx.x / G;
    float acc = 0.0f;
    if (row < rows) {
        const unsigned long long at = L.outs.at(row / L.seq, L.heads) + row % L.seq * L.outs.row + part * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(to_f32(dout[at + e]), to_f32(out[at + e]), acc);
    }
#pragma unroll
    for (int off = G / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && part == 0) delta[row] = acc;
}

// =================================================================================================
// f32: SIMT. R = HD/32 consecutive threads share a row (a query row, or a key row in dK/dV); thread
// `part` owns dims d = part + R·u, u < 32, interleaved so that the R threads read consecutive words of
// a shared-memory row (no bank conflicts; threads of other rows read the same words: broadcast). Dot
// products are reduced over the R lanes by an xor tree, which gives all R lanes the same bits (float
// addition is commutative). Blocks of ATTN_F32_THREADS threads hold 128/R rows; the other operand
// goes through shared memory in tiles of ATTN_F32_TILE rows.
// =================================================================================================

#define ATTN_F32_THREADS 128
#define ATTN_F32_TILE 32

template <int R> __device__ __forceinline__ float attn_group_sum(float x) {
#pragma unroll
    for (int off = 1; off < R; off *= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// Rows [r0, r0 + ATTN_F32_TILE) of a (seq, HD) matrix with rows `ld` apart into shared memory,
// zeros past seq.
template <int HD>
__device__ __forceinline__ void attn_f32_tile(float* s, const float* g, unsigned long long ld, unsigned r0,
                                              unsigned seq) {
    for (unsigned x = threadIdx.x; x < ATTN_F32_TILE * HD; x += ATTN_F32_THREADS) {
        unsigned r = r0 + x / HD;
        s[x] = r < seq ? g[r * ld + x % HD] : 0.0f;
    }
}

template <int HD>
__device__ void attention_forward_f32(float* out, float* lse, const float* q, const float* k, const float* v,
                                      const AttnDrop& drop, float scale, const AttnLayout& L) {
    constexpr int R = HD / 32, ROWS = ATTN_F32_THREADS / R, KB = ATTN_F32_TILE;
    __shared__ float sK[KB * HD], sV[KB * HD];
    const unsigned seq = L.seq;
    const unsigned long long pair = blockIdx.x, ib = L.in.at(pair, L.heads), ob = L.outs.at(pair, L.heads);
    const unsigned r0 = (gridDim.y - 1 - blockIdx.y) * ROWS;
    const unsigned row = r0 + threadIdx.x / R, part = threadIdx.x % R;
    const bool live = row < seq;
    const float sl2 = scale * ATTN_LOG2E;

    float qr[32], o[32];
#pragma unroll
    for (int u = 0; u < 32; ++u) {
        qr[u] = live ? q[ib + row * L.in.row + part + R * u] : 0.0f;
        o[u] = 0.0f;
    }
    float m = attn_neg_inf(), l = 0.0f;
    const unsigned last = min(r0 + ROWS, seq) - 1;  // the block's last row: keys 0..=last
    for (unsigned k0 = 0; k0 <= last; k0 += KB) {
        __syncthreads();  // the previous tile is consumed
        attn_f32_tile<HD>(sK, k + ib, L.in.row, k0, seq);
        attn_f32_tile<HD>(sV, v + ib, L.in.row, k0, seq);
        __syncthreads();
        float x[KB];
        float mx = attn_neg_inf();
#pragma unroll
        for (int j = 0; j < KB; ++j) {
            float dot = 0.0f;
#pragma unroll
            for (int u = 0; u < 32; ++u) dot = fmaf(qr[u], sK[j * HD + part + R * u], dot);
            dot = attn_group_sum<R>(dot);
            unsigned col = k0 + j;
            x[j] = (col <= row && col < seq) ? dot * sl2 : attn_neg_inf();
            mx = fmaxf(mx, x[j]);
        }
        const float mn = fmaxf(m, mx), mu = mn == attn_neg_inf() ? 0.0f : mn;
        const float alpha = exp2f(m - mu);
        m = mn;
        float sum = 0.0f;
        unsigned r[4] = {0, 0, 0, 0};
        const unsigned long long n0 = ((unsigned long long)pair * seq + row) * seq + k0;
#pragma unroll
        for (int j = 0; j < KB; ++j) {
            float p = exp2f(x[j] - mu);
            sum += p;
            if (drop.threshold != 0) {
                unsigned long long n = n0 + j;
                if (j == 0 || (n & 3) == 0) philox_block(r, drop.seed, drop.site, drop.step, n >> 2);
                p = attn_lane(r, (unsigned)(n & 3)) >= drop.threshold ? p * drop.keep_scale : 0.0f;
            }
            x[j] = p;
        }
        l = l * alpha + sum;
#pragma unroll
        for (int u = 0; u < 32; ++u) {
            float acc = o[u] * alpha;
#pragma unroll
            for (int j = 0; j < KB; ++j) acc = fmaf(x[j], sV[j * HD + part + R * u], acc);
            o[u] = acc;
        }
    }
    if (live) {
        const float inv = 1.0f / l;
#pragma unroll
        for (int u = 0; u < 32; ++u) out[ob + row * L.outs.row + part + R * u] = o[u] * inv;
        if (part == 0) lse[pair * seq + row] = (m + log2f(l)) * ATTN_LN2;
    }
}

// dK, dV: R threads per key row; query rows stream through shared memory with their lse and delta.
template <int HD>
__device__ void attention_dkdv_f32(float* dk, float* dv, const float* q, const float* k, const float* v,
                                   const float* dout, const float* lse, const float* delta, const AttnDrop& drop,
                                   float scale, const AttnLayout& L) {
    constexpr int R = HD / 32, ROWS = ATTN_F32_THREADS / R, QB = ATTN_F32_TILE;
    __shared__ float sQ[QB * HD], sO[QB * HD], sL[QB], sD[QB];
    const unsigned seq = L.seq;
    const unsigned long long pair = blockIdx.x, ib = L.in.at(pair, L.heads), gb = L.grad.at(pair, L.heads);
    const unsigned long long ob = L.outs.at(pair, L.heads);
    const unsigned k0 = blockIdx.y * ROWS;  // key tiles: the first (most query rows) is the heaviest
    const unsigned key = k0 + threadIdx.x / R, part = threadIdx.x % R;
    const bool live = key < seq;
    const float sl2 = scale * ATTN_LOG2E;

    float kr[32], vr[32], gk[32], gv[32];
#pragma unroll
    for (int u = 0; u < 32; ++u) {
        unsigned long long at = ib + key * L.in.row + part + R * u;
        kr[u] = live ? k[at] : 0.0f;
        vr[u] = live ? v[at] : 0.0f;
        gk[u] = 0.0f;
        gv[u] = 0.0f;
    }
    for (unsigned i0 = k0 / QB * QB; i0 < seq; i0 += QB) {
        __syncthreads();
        attn_f32_tile<HD>(sQ, q + ib, L.in.row, i0, seq);
        attn_f32_tile<HD>(sO, dout + ob, L.outs.row, i0, seq);
        for (unsigned x = threadIdx.x; x < QB; x += ATTN_F32_THREADS) {
            bool in = i0 + x < seq;
            sL[x] = in ? lse[pair * seq + i0 + x] * ATTN_LOG2E : attn_pos_inf();
            sD[x] = in ? delta[pair * seq + i0 + x] : 0.0f;
        }
        __syncthreads();
        for (int i = 0; i < QB; ++i) {
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int u = 0; u < 32; ++u) {
                s = fmaf(sQ[i * HD + part + R * u], kr[u], s);
                dp = fmaf(sO[i * HD + part + R * u], vr[u], dp);
            }
            s = attn_group_sum<R>(s);
            dp = attn_group_sum<R>(dp);
            const unsigned row = i0 + i;
            const bool valid = live && key <= row && row < seq;
            const float p = valid ? exp2f(s * sl2 - sL[i]) : 0.0f;
            float pd = p;
            if (drop.threshold != 0 && valid) {
                bool kept = attn_kept(drop, ((unsigned long long)pair * seq + row) * seq + key);
                pd = kept ? p * drop.keep_scale : 0.0f;
                dp = kept ? dp * drop.keep_scale : 0.0f;
            }
            const float ds = p * (dp - sD[i]);
#pragma unroll
            for (int u = 0; u < 32; ++u) {
                gv[u] = fmaf(pd, sO[i * HD + part + R * u], gv[u]);
                gk[u] = fmaf(ds, sQ[i * HD + part + R * u], gk[u]);
            }
        }
    }
    if (live) {
#pragma unroll
        for (int u = 0; u < 32; ++u) {
            unsigned long long at = gb + key * L.grad.row + part + R * u;
            dk[at] = gk[u] * scale;
            dv[at] = gv[u];
        }
    }
}

// dQ: R threads per query row; key rows stream through shared memory.
template <int HD>
__device__ void attention_dq_f32(float* dq, const float* q, const float* k, const float* v, const float* dout,
                                 const float* lse, const float* delta, const AttnDrop& drop, float scale,
                                 const AttnLayout& L) {
    constexpr int R = HD / 32, ROWS = ATTN_F32_THREADS / R, KB = ATTN_F32_TILE;
    __shared__ float sK[KB * HD], sV[KB * HD];
    const unsigned seq = L.seq;
    const unsigned long long pair = blockIdx.x, ib = L.in.at(pair, L.heads), gb = L.grad.at(pair, L.heads);
    const unsigned long long ob = L.outs.at(pair, L.heads);
    const unsigned r0 = (gridDim.y - 1 - blockIdx.y) * ROWS;
    const unsigned row = r0 + threadIdx.x / R, part = threadIdx.x % R;
    const bool live = row < seq;
    const float sl2 = scale * ATTN_LOG2E;

    float qr[32], dor[32], g[32];
#pragma unroll
    for (int u = 0; u < 32; ++u) {
        qr[u] = live ? q[ib + row * L.in.row + part + R * u] : 0.0f;
        dor[u] = live ? dout[ob + row * L.outs.row + part + R * u] : 0.0f;
        g[u] = 0.0f;
    }
    const float l2 = live ? lse[pair * seq + row] * ATTN_LOG2E : attn_pos_inf();
    const float dl = live ? delta[pair * seq + row] : 0.0f;
    const unsigned last = min(r0 + ROWS, seq) - 1;
    const unsigned long long nrow = ((unsigned long long)pair * seq + row) * seq;
    for (unsigned k0 = 0; k0 <= last; k0 += KB) {
        __syncthreads();
        attn_f32_tile<HD>(sK, k + ib, L.in.row, k0, seq);
        attn_f32_tile<HD>(sV, v + ib, L.in.row, k0, seq);
        __syncthreads();
        unsigned r[4] = {0, 0, 0, 0};
        for (int j = 0; j < KB; ++j) {
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int u = 0; u < 32; ++u) {
                s = fmaf(qr[u], sK[j * HD + part + R * u], s);
                dp = fmaf(dor[u], sV[j * HD + part + R * u], dp);
            }
            s = attn_group_sum<R>(s);
            dp = attn_group_sum<R>(dp);
            const unsigned col = k0 + j;
            const bool valid = live && col <= row;  // col <= row < seq
            const float p = valid ? exp2f(s * sl2 - l2) : 0.0f;
            if (drop.threshold != 0 && valid) {
                unsigned long long n = nrow + col;
                if (j == 0 || (n & 3) == 0) philox_block(r, drop.seed, drop.site, drop.step, n >> 2);
                dp = attn_lane(r, (unsigned)(n & 3)) >= drop.threshold ? dp * drop.keep_scale : 0.0f;
            }
            const float ds = p * (dp - dl);
#pragma unroll
            for (int u = 0; u < 32; ++u) g[u] = fmaf(ds, sK[j * HD + part + R * u], g[u]);
        }
    }
    if (live) {
#pragma unroll
        for (int u = 0; u < 32; ++u) dq[gb + row * L.grad.row + part + R * u] = g[u] * scale;
    }
}

// =================================================================================================
// bf16: tensor cores. PTX fragment layouts of mma.m16n8k16 (.bf16 inputs, .f32 accumulators), with
// lane = 4·g + t (g = lane >> 2 the "group", t = lane & 3 the thread in its quad):
//   A (16×16, row-major): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9],
//                         a3 = A[g+8][2t+8, 2t+9]
//   B (16×8, "col"):      b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
//   C (16×8, f32):        c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// Each .b32 register holds two bf16, the lower column (or k) index in the low half. Hence an f32
// accumulator tile of 16 rows × 16 columns (two C fragments n, n+1) is, packed pairwise, exactly the
// A fragment of the next mma: a0 = C_n[0,1], a1 = C_n[2,3], a2 = C_{n+1}[0,1], a3 = C_{n+1}[2,3]
// (FA2's register reuse of P; no shared-memory round trip).
//
// ldmatrix .x4: lanes 8m..8m+7 give the row addresses of 8×8 matrix m (16 bytes per row); register
// m of lane (g, t) receives row g, elements 2t and 2t+1 of matrix m; with .trans, elements [2t][g]
// and [2t+1][g] instead. So:
//   A from a row-major [rows][k] tile: lane gives row (lane & 15), k chunk (lane >> 4)
//     -> matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3.
//   B for C = X·Yᵀ from a row-major [n][k] tile Y (K for S = QKᵀ): lane gives n row
//     (lane & 7) + 8·(lane >> 4), k chunk (lane >> 3) & 1 -> b0, b1 of n-block 0, b0, b1 of n-block 1.
//   B for C = X·Y from a row-major [k][n] tile Y (V for O = PV), with .trans: lane gives k row
//     (lane & 7) + 8·((lane >> 3) & 1), n chunk (lane >> 4) -> b0, b1 of n-block 0, then of n-block 1.
//
// Shared memory: a tile of rows of HD bf16 (HD/8 chunks of 16 bytes) with the chunk index xor-swizzled
// by the row, so that the 8 rows one ldmatrix phase reads (8 consecutive rows, one logical chunk) hit
// 8 distinct 16-byte bank groups, and so do cp.async's writes.
// =================================================================================================

__device__ __forceinline__ unsigned attn_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// Byte offset of chunk c (8 bf16) of row r in a swizzled tile of HD-wide rows. HD >= 64: a row
// is >= 128 bytes; xor the low 3 bits of the chunk with r & 7. HD == 32: a row is 64 bytes, two rows
// per 128-byte line; xor the 2 chunk bits with (r >> 1) & 3, so rows r, r+2, r+4, r+6 use different
// chunks and r, r+1 different halves of the line.
template <int HD> __device__ __forceinline__ unsigned attn_swz(unsigned r, unsigned c) {
    if (HD >= 64) return r * (HD * 2) + ((c ^ (r & 7)) << 4);
    return r * (HD * 2) + ((c ^ ((r >> 1) & 3)) << 4);
}

__device__ __forceinline__ void attn_cp16(unsigned dst, const void* src, bool valid) {
    // src-size 0 fills the 16 bytes with zeros without reading (src is still a valid address).
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void attn_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void attn_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void attn_ldsm4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void attn_ldsm4t(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// c += A·B for one m16n8k16 tile.
__device__ __forceinline__ void attn_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 to a bf16 pair, round to nearest even: lo in the low half (the lower column index).
__device__ __forceinline__ unsigned attn_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// A fragment of 16 rows × 16 columns from two f32 accumulator tiles (see the layout notes above).
__device__ __forceinline__ void attn_acc_to_a(unsigned (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = attn_pack(c0[0], c0[1]);
    a[1] = attn_pack(c0[2], c0[3]);
    a[2] = attn_pack(c1[0], c1[1]);
    a[3] = attn_pack(c1[2], c1[3]);
}

// Rows [r0, r0 + ROWS) of a (seq, HD) bf16 matrix g with rows `ld` apart (16-byte aligned) into the
// swizzled tile at shared address s, by cp.async of 16-byte chunks from NT threads; rows past seq
// are zeros.
template <int HD, int ROWS, int NT>
__device__ __forceinline__ void attn_load_tile(unsigned s, const bf16* g, unsigned long long ld, unsigned r0,
                                               unsigned seq) {
    constexpr int CH = HD / 8;
#pragma unroll
    for (int i = 0; i < (ROWS * CH + NT - 1) / NT; ++i) {
        const unsigned x = threadIdx.x + i * NT;
        if (ROWS * CH % NT != 0 && x >= ROWS * CH) break;
        const unsigned r = x / CH, c = x % CH;
        const bool valid = r0 + r < seq;
        const bf16* src = valid ? g + (r0 + r) * ld + c * 8 : g;
        attn_cp16(s + attn_swz<HD>(r, c), src, valid);
    }
}

// A fragments (16 rows × HD) of rows [r, r + 16) of a swizzled tile: f[kd] covers d in [16kd, 16kd+16).
template <int HD>
__device__ __forceinline__ void attn_load_a(unsigned (&f)[HD / 16][4], unsigned s, unsigned r, unsigned lane) {
#pragma unroll
    for (int kd = 0; kd < HD / 16; ++kd) attn_ldsm4(f[kd], s + attn_swz<HD>(r + (lane & 15), 2 * kd + (lane >> 4)));
}

// c[mi][n] += A_mi·Yᵀ over d for MW row tiles A_mi (A_mi's k-step kd is a[mi][kd]) and the 8-row
// n-blocks of a swizzled [8·NB][HD] tile Y at s (rows are the n index). Each B fragment is loaded once
// and used by all MW row tiles.
template <int HD, int NB, int MW>
__device__ __forceinline__ void attn_mma_abt(float (&c)[MW][NB][4], const unsigned (&a)[MW][HD / 16][4], unsigned s,
                                             unsigned lane) {
#pragma unroll
    for (int kd = 0; kd < HD / 16; ++kd) {
#pragma unroll
        for (int n2 = 0; n2 < NB / 2; ++n2) {
            unsigned b[4];
            attn_ldsm4(b, s + attn_swz<HD>(16 * n2 + (lane & 7) + ((lane >> 4) << 3), 2 * kd + ((lane >> 3) & 1)));
#pragma unroll
            for (int mi = 0; mi < MW; ++mi) {
                attn_mma(c[mi][2 * n2], a[mi][kd], b[0], b[1]);
                attn_mma(c[mi][2 * n2 + 1], a[mi][kd], b[2], b[3]);
            }
        }
    }
}

// One row tile: c[n] += A·Yᵀ.
template <int HD, int NB>
__device__ __forceinline__ void attn_mma_abt(float (&c)[NB][4], const unsigned (&a)[HD / 16][4], unsigned s,
                                             unsigned lane) {
    attn_mma_abt<HD, NB, 1>(reinterpret_cast<float(&)[1][NB][4]>(c),
                            reinterpret_cast<const unsigned(&)[1][HD / 16][4]>(a), s, lane);
}

// o[mi][nd] += P_mi·Y for MW row tiles P_mi (16 × 16·KS, held as accumulator tiles p[mi][0 .. 2·KS))
// and a swizzled [16·KS][HD] tile Y at s (rows are the k index): B fragments by ldmatrix.trans, each
// loaded once for all MW row tiles.
template <int HD, int KS, int MW>
__device__ __forceinline__ void attn_mma_pv(float (&o)[MW][HD / 8][4], const float (&p)[MW][2 * KS][4], unsigned s,
                                            unsigned lane) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        unsigned a[MW][4];
#pragma unroll
        for (int mi = 0; mi < MW; ++mi) attn_acc_to_a(a[mi], p[mi][2 * kk], p[mi][2 * kk + 1]);
#pragma unroll
        for (int n2 = 0; n2 < HD / 16; ++n2) {
            unsigned b[4];
            attn_ldsm4t(b, s + attn_swz<HD>(16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3), 2 * n2 + (lane >> 4)));
#pragma unroll
            for (int mi = 0; mi < MW; ++mi) {
                attn_mma(o[mi][2 * n2], a[mi], b[0], b[1]);
                attn_mma(o[mi][2 * n2 + 1], a[mi], b[2], b[3]);
            }
        }
    }
}

// One row tile: o[nd] += P·Y.
template <int HD, int KS>
__device__ __forceinline__ void attn_mma_pv(float (&o)[HD / 8][4], const float (&p)[2 * KS][4], unsigned s,
                                            unsigned lane) {
    attn_mma_pv<HD, KS, 1>(reinterpret_cast<float(&)[1][HD / 8][4]>(o),
                           reinterpret_cast<const float(&)[1][2 * KS][4]>(p), s, lane);
}

// Stores 16 rows × HD accumulator tiles c (times `mul`) as bf16 at rows r0 + g and r0 + g + 8 of g_
// (rows `ld` apart), rows past seq skipped. Each thread writes bf16 pairs (4 bytes) at columns
// 8nd + 2t.
template <int HD>
__device__ __forceinline__ void attn_store_rows(bf16* g_, unsigned long long ld, const float (&c)[HD / 8][4],
                                                unsigned r0, float mul0, float mul1, unsigned seq, unsigned lane) {
    const unsigned g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned r = r0 + g + 8 * h;
        const float mul = h == 0 ? mul0 : mul1;
        if (r < seq) {
            unsigned* dst = reinterpret_cast<unsigned*>(g_ + r * ld + 2 * t);
#pragma unroll
            for (int nd = 0; nd < HD / 8; ++nd) dst[4 * nd] = attn_pack(c[nd][2 * h] * mul, c[nd][2 * h + 1] * mul);
        }
    }
}

// ---- bf16 forward ---------------------------------------------------------------------------------
// CTA: BM = 16·MW·NW query rows (warp w owns rows 16·MW·w ..), Q fragments in registers for the whole
// loop; K and V tiles of BN keys double-buffered by cp.async (tile kt+1 loads while kt computes).
// Shared memory: Q [BM][HD], K [2][BN][HD], V [2][BN][HD], bf16, swizzled.
// Per key tile: S = QKᵀ (f32), x = S·scale·log2e masked to -inf (only in tiles touching the diagonal
// or seq), running max m and per-thread partial sum l in base 2, O rescaled by 2^(m_old - m_new),
// O += P̃·V with P̃ packed to bf16 in registers. Rows reduce their max over the quad (2 shuffles);
// l is reduced once at the end.

template <int HD, int MW, int NW, int BN>
__device__ void attention_forward_mma(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                      const AttnDrop& drop, float scale, const AttnLayout& L) {
    constexpr int BM = 16 * MW * NW, NT = 32 * NW, NB = BN / 8, ND = HD / 8;
    constexpr unsigned QBYTES = BM * HD * 2, KVBYTES = BN * HD * 2;
    extern __shared__ __align__(128) unsigned char attn_shared[];
    const unsigned sQ = attn_smem(attn_shared), sK = sQ + QBYTES, sV = sK + 2 * KVBYTES;

    const unsigned seq = L.seq;
    const unsigned long long pair = blockIdx.x, ld = L.in.row;
    const unsigned q0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const unsigned wr = 16 * MW * warp;  // the warp's first row in the tile
    const unsigned long long ib = L.in.at(pair, L.heads);
    const bf16 *qp = q + ib, *kp = k + ib, *vp = v + ib;
    const unsigned nkt = (min(q0 + BM, seq) - 1) / BN + 1;  // key tiles with some j <= the last row
    const float sl2 = scale * ATTN_LOG2E;

    attn_load_tile<HD, BM, NT>(sQ, qp, ld, q0, seq);
    attn_load_tile<HD, BN, NT>(sK, kp, ld, 0, seq);
    attn_load_tile<HD, BN, NT>(sV, vp, ld, 0, seq);
    attn_cp_commit();
    attn_cp_wait<0>();
    __syncthreads();

    unsigned qf[MW][HD / 16][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) attn_load_a<HD>(qf[mi], sQ, wr + 16 * mi, lane);

    float o[MW][ND][4];
    float m[MW][2], l[MW][2];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
        for (int nd = 0; nd < ND; ++nd) o[mi][nd][0] = o[mi][nd][1] = o[mi][nd][2] = o[mi][nd][3] = 0.0f;
        m[mi][0] = m[mi][1] = attn_neg_inf();
        l[mi][0] = l[mi][1] = 0.0f;
    }

    for (unsigned kt = 0; kt < nkt; ++kt) {
        const unsigned buf = kt & 1, k0 = kt * BN;
        if (kt + 1 < nkt) {
            // Buffer buf^1 was last read in iteration kt-1, which every thread has left (barrier below).
            attn_load_tile<HD, BN, NT>(sK + (buf ^ 1) * KVBYTES, kp, ld, k0 + BN, seq);
            attn_load_tile<HD, BN, NT>(sV + (buf ^ 1) * KVBYTES, vp, ld, k0 + BN, seq);
        }
        attn_cp_commit();

        // The diagonal or seq crosses this tile: elements need the mask.
        const bool masked = k0 + BN - 1 > q0 || k0 + BN > seq;
        float s[MW][NB][4];
#pragma unroll
        for (int mi = 0; mi < MW; ++mi) {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) s[mi][nb][0] = s[mi][nb][1] = s[mi][nb][2] = s[mi][nb][3] = 0.0f;
        }
        attn_mma_abt<HD, NB, MW>(s, qf, sK + buf * KVBYTES, lane);
        auto elementwise = [&](auto dropping) {
#pragma unroll
            for (int mi = 0; mi < MW; ++mi) {
                // s[mi][nb][2h + e] is row q0 + wr + 16mi + g + 8h, key k0 + 8nb + 2t + e.
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned row = q0 + wr + 16 * mi + g + 8 * h;
                    float mx = attn_neg_inf();
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const unsigned col = k0 + 8 * nb + 2 * t + e;
                            float x = s[mi][nb][2 * h + e] * sl2;
                            if (masked && (col > row || col >= seq)) x = attn_neg_inf();
                            s[mi][nb][2 * h + e] = x;
                            mx = fmaxf(mx, x);
                        }
                    }
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mn = fmaxf(m[mi][h], mx);
                    const float mu = mn == attn_neg_inf() ? 0.0f : mn;  // a row with nothing visible yet
                    const float alpha = attn_exp2(m[mi][h] - mu);
                    m[mi][h] = mn;
                    float sum = 0.0f;
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) {
                        const float p0 = attn_exp2(s[mi][nb][2 * h] - mu), p1 = attn_exp2(s[mi][nb][2 * h + 1] - mu);
                        sum += p0 + p1;
                        s[mi][nb][2 * h] = p0;
                        s[mi][nb][2 * h + 1] = p1;
                    }
                    l[mi][h] = l[mi][h] * alpha + sum;
#pragma unroll
                    for (int nd = 0; nd < ND; ++nd) {
                        o[mi][nd][2 * h] *= alpha;
                        o[mi][nd][2 * h + 1] *= alpha;
                    }
                    if (decltype(dropping)::value && drop.threshold != 0 && row < seq) {
                        // Dropped elements are zeroed; keep_scale is applied once with 1/l at the end.
                        const unsigned long long nrow = (pair * seq + row) * seq;
#pragma unroll
                        for (int nb = 0; nb < NB; ++nb) {
                            const unsigned col = k0 + 8 * nb + 2 * t;
                            if (col <= row) {
                                bool k0_, k1_;
                                attn_kept2(drop, nrow + col, k0_, k1_);
                                if (!k0_) s[mi][nb][2 * h] = 0.0f;
                                if (!k1_) s[mi][nb][2 * h + 1] = 0.0f;
                            }
                        }
                    }
                }
            }
        };
        if (!ATTN_SPLIT_DROPOUT || drop.threshold != 0) {
            elementwise(AttnFlag<true>());
        } else {
            elementwise(AttnFlag<false>());
        }
        attn_mma_pv<HD, BN / 16, MW>(o, s, sV + buf * KVBYTES, lane);
        attn_cp_wait<0>();
        __syncthreads();
    }

#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
        float inv[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[mi][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inv[h] = (drop.threshold != 0 ? drop.keep_scale : 1.0f) / sum;
            const unsigned row = q0 + wr + 16 * mi + g + 8 * h;
            if (t == 0 && row < seq) lse[pair * seq + row] = (m[mi][h] + log2f(sum)) * ATTN_LN2;
        }
        attn_store_rows<HD>(out + L.outs.at(pair, L.heads), L.outs.row, o[mi], q0 + wr + 16 * mi, inv[0], inv[1], seq, lane);
    }
}

// ---- bf16 backward: dK, dV ------------------------------------------------------------------------
// CTA: BN = 16·NW keys, warp w owns keys 16w .. 16w+15 and computes everything transposed (keys are
// the rows), so that all its products stay in registers with no exchange between warps:
//   Sᵀ = K·Qᵀ,  dP̃ᵀ = V·dOᵀ  (A = K, V: fragments in registers when KV_REGS, else from shared memory;
//                              B = Q, dO rows by plain ldmatrix),
//   Pᵀ = exp2(Sᵀ·scale·log2e − lse₂[i]),  dSᵀ = Pᵀ∘(dPᵀ − delta[i]),
//   dV += P̃ᵀ·dO,  dK += dSᵀ·Q  (A = P̃ᵀ, dSᵀ packed from the accumulators; B = dO, Q by ldmatrix.trans).
// Query tiles of BM rows run from the diagonal down to seq; Q, dO, lse₂ = lse·log2e and delta are
// double-buffered. A warp whose keys are all above every row of the tile skips it (nothing visible).
// Shared memory: K [BN][HD], V [BN][HD], Q [2][BM][HD], dO [2][BM][HD] (bf16, swizzled), lse₂ [2][BM],
// delta [2][BM] (f32).

template <int HD, int NW, int BM, bool KV_REGS>
__device__ void attention_dkdv_mma(bf16* dk, bf16* dv, const bf16* q, const bf16* k, const bf16* v,
                                   const bf16* dout, const float* lse, const float* delta, const AttnDrop& drop,
                                   float scale, const AttnLayout& L) {
    constexpr int BN = 16 * NW, NT = 32 * NW, NQ = BM / 8, ND = HD / 8, KD = HD / 16;
    constexpr unsigned KBYTES = BN * HD * 2, QBYTES = BM * HD * 2;
    extern __shared__ __align__(128) unsigned char attn_shared[];
    const unsigned sK = attn_smem(attn_shared), sV = sK + KBYTES, sQ = sV + KBYTES, sO = sQ + 2 * QBYTES;
    float* sL = reinterpret_cast<float*>(attn_shared + 2 * KBYTES + 4 * QBYTES);  // [2][BM]
    float* sD = sL + 2 * BM;                                                        // [2][BM]

    const unsigned seq = L.seq;
    const unsigned long long pair = blockIdx.x, ib = L.in.at(pair, L.heads), gb = L.grad.at(pair, L.heads);
    // Key tile blockIdx.y: the first key tiles see the most query rows, so this is heaviest first.
    const unsigned k0 = blockIdx.y * BN;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const unsigned wk = k0 + 16 * warp;  // the warp's first key
    const bf16 *qp = q + ib, *op = dout + L.outs.at(pair, L.heads);
    const float *lp = lse + pair * seq, *dp_ = delta + pair * seq;
    const float sl2 = scale * ATTN_LOG2E;
    const unsigned qt0 = k0 / BM, nqt = (seq + BM - 1) / BM;

    attn_load_tile<HD, BN, NT>(sK, k + ib, L.in.row, k0, seq);
    attn_load_tile<HD, BN, NT>(sV, v + ib, L.in.row, k0, seq);
    attn_load_tile<HD, BM, NT>(sQ, qp, L.in.row, qt0 * BM, seq);
    attn_load_tile<HD, BM, NT>(sO, op, L.outs.row, qt0 * BM, seq);
    attn_cp_commit();
    for (unsigned x = threadIdx.x; x < BM; x += NT) {
        const unsigned i = qt0 * BM + x;
        sL[x] = i < seq ? lp[i] * ATTN_LOG2E : attn_pos_inf();  // +inf: p = 0 for rows past seq
        sD[x] = i < seq ? dp_[i] : 0.0f;
    }
    attn_cp_wait<0>();
    __syncthreads();

    unsigned kf[KV_REGS ? KD : 1][4], vf[KV_REGS ? KD : 1][4];
    if constexpr (KV_REGS) {
        attn_load_a<HD>(kf, sK, 16 * warp, lane);
        attn_load_a<HD>(vf, sV, 16 * warp, lane);
    }
    float gk[ND][4], gv[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
        gk[nd][0] = gk[nd][1] = gk[nd][2] = gk[nd][3] = 0.0f;
        gv[nd][0] = gv[nd][1] = gv[nd][2] = gv[nd][3] = 0.0f;
    }

    for (unsigned qt = qt0; qt < nqt; ++qt) {
        const unsigned buf = (qt - qt0) & 1, q0 = qt * BM;
        const unsigned sQb = sQ + buf * QBYTES, sOb = sO + buf * QBYTES;
        const float *sLb = sL + buf * BM, *sDb = sD + buf * BM;
        // Prefetch the next query tile; its lse and delta are read now and stored after this tile.
        float nl = 0.0f, nd_ = 0.0f;
        const bool more = qt + 1 < nqt;
        if (more) {
            attn_load_tile<HD, BM, NT>(sQ + (buf ^ 1) * QBYTES, qp, L.in.row, q0 + BM, seq);
            attn_load_tile<HD, BM, NT>(sO + (buf ^ 1) * QBYTES, op, L.outs.row, q0 + BM, seq);
            if (threadIdx.x < BM) {
                const unsigned i = q0 + BM + threadIdx.x;
                nl = i < seq ? lp[i] * ATTN_LOG2E : attn_pos_inf();
                nd_ = i < seq ? dp_[i] : 0.0f;
            }
        }
        attn_cp_commit();

        // Some row of the tile sees some key of the warp (the last row is at or past the first key).
        if (q0 + BM - 1 >= wk && wk < seq) {
            const bool masked = q0 < wk + 15 || q0 + BM > seq || wk + 16 > seq;
            float st[NQ][4], pt[NQ][4];
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
                st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.0f;
                pt[n][0] = pt[n][1] = pt[n][2] = pt[n][3] = 0.0f;
            }
            if constexpr (KV_REGS) {
                attn_mma_abt<HD, NQ>(st, kf, sQb, lane);
                attn_mma_abt<HD, NQ>(pt, vf, sOb, lane);
            } else {
                // A fragments one k-step at a time from shared memory (registers are short at HD 128).
#pragma unroll
                for (int kd = 0; kd < KD; ++kd) {
                    unsigned a[1][4];
                    attn_ldsm4(a[0], sK + attn_swz<HD>(16 * warp + (lane & 15), 2 * kd + (lane >> 4)));
#pragma unroll
                    for (int n2 = 0; n2 < NQ / 2; ++n2) {
                        unsigned b[4];
                        attn_ldsm4(b, sQb + attn_swz<HD>(16 * n2 + (lane & 7) + ((lane >> 4) << 3),
                                                         2 * kd + ((lane >> 3) & 1)));
                        attn_mma(st[2 * n2], a[0], b[0], b[1]);
                        attn_mma(st[2 * n2 + 1], a[0], b[2], b[3]);
                    }
                    attn_ldsm4(a[0], sV + attn_swz<HD>(16 * warp + (lane & 15), 2 * kd + (lane >> 4)));
#pragma unroll
                    for (int n2 = 0; n2 < NQ / 2; ++n2) {
                        unsigned b[4];
                        attn_ldsm4(b, sOb + attn_swz<HD>(16 * n2 + (lane & 7) + ((lane >> 4) << 3),
                                                         2 * kd + ((lane >> 3) & 1)));
                        attn_mma(pt[2 * n2], a[0], b[0], b[1]);
                        attn_mma(pt[2 * n2 + 1], a[0], b[2], b[3]);
                    }
                }
            }
            // st[n][2h + e] is key wk + g + 8h, query row q0 + 8n + 2t + e. Afterwards st holds P̃ᵀ and
            // pt holds dSᵀ.
            // Instantiated without and with dropout, so that the common path is one branch-free block.
            auto elementwise = [&](auto dropping) {
#pragma unroll
                for (int n = 0; n < NQ; ++n) {
                    // Rows 8n + 2t and 8n + 2t + 1: one 8-byte load each of lse₂ and delta.
                    const float2 l2v = *reinterpret_cast<const float2*>(sLb + 8 * n + 2 * t);
                    const float2 dlv = *reinterpret_cast<const float2*>(sDb + 8 * n + 2 * t);
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const unsigned x = 8 * n + 2 * t + e, row = q0 + x;
                        const float l2 = e == 0 ? l2v.x : l2v.y, dl = e == 0 ? dlv.x : dlv.y;
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const unsigned key = wk + g + 8 * h;
                            const bool valid = !masked || (key <= row && row < seq && key < seq);
                            const float p = valid ? attn_exp2(st[n][2 * h + e] * sl2 - l2) : 0.0f;
                            float pd = p, dpv = pt[n][2 * h + e];
                            if (decltype(dropping)::value && drop.threshold != 0 && valid) {
                                const bool kept = attn_kept(drop, (pair * seq + row) * seq + key);
                                pd = kept ? p * drop.keep_scale : 0.0f;
                                dpv = kept ? dpv * drop.keep_scale : 0.0f;
                            }
                            st[n][2 * h + e] = pd;
                            pt[n][2 * h + e] = p * (dpv - dl);
                        }
                    }
                }
            };
            if (!ATTN_SPLIT_DROPOUT || drop.threshold != 0) {
                elementwise(AttnFlag<true>());
            } else {
                elementwise(AttnFlag<false>());
            }
            attn_mma_pv<HD, BM / 16>(gv, st, sOb, lane);
            attn_mma_pv<HD, BM / 16>(gk, pt, sQb, lane);
        }

        if (more && threadIdx.x < BM) {
            // The other buffer was last read in the previous iteration, which every thread has left.
            sL[(buf ^ 1) * BM + threadIdx.x] = nl;
            sD[(buf ^ 1) * BM + threadIdx.x] = nd_;
        }
        attn_cp_wait<0>();
        __syncthreads();
    }

    attn_store_rows<HD>(dk + gb, L.grad.row, gk, wk, scale, scale, seq, lane);
    attn_store_rows<HD>(dv + gb, L.grad.row, gv, wk, 1.0f, 1.0f, seq, lane);
}

// ---- bf16 backward: dQ ----------------------------------------------------------------------------
// CTA: BM = 16·NW query rows, warp w owns rows 16w .. 16w+15, Q and dO fragments in registers; K and V
// tiles of BN keys double-buffered from key 0 up to the diagonal:
//   S = Q·Kᵀ, dP̃ = dO·Vᵀ (B = K, V by plain ldmatrix), P = exp2(S·scale·log2e − lse₂),
//   dS = P∘(dP − delta), dQ += dS·K (A = dS packed from the accumulators, B = K by ldmatrix.trans).
// A warp whose rows are all above the tile's first key skips it. dQ is scaled once at the end.
// Shared memory: Q [BM][HD], dO [BM][HD], K [2][BN][HD], V [2][BN][HD] (bf16, swizzled), lse₂ [BM],
// delta [BM] (f32).

template <int HD, int NW, int BN>
__device__ void attention_dq_mma(bf16* dq, const bf16* q, const bf16* k, const bf16* v, const bf16* dout,
                                 const float* lse, const float* delta, const AttnDrop& drop, float scale,
                                 const AttnLayout& L) {
    constexpr int BM = 16 * NW, NT = 32 * NW, NB = BN / 8, ND = HD / 8;
    constexpr unsigned QBYTES = BM * HD * 2, KVBYTES = BN * HD * 2;
    extern __shared__ __align__(128) unsigned char attn_shared[];
    const unsigned sQ = attn_smem(attn_shared), sO = sQ + QBYTES, sK = sO + QBYTES, sV = sK + 2 * KVBYTES;
    // lse₂ and delta of the CTA's rows, [BM] each: read from shared memory in every key tile rather than
    // held in registers (at HD 64 that is what lets the kernel fit in 128 registers).
    float* sL = reinterpret_cast<float*>(attn_shared + 2 * QBYTES + 4 * KVBYTES);
    float* sD = sL + BM;

    const unsigned seq = L.seq;
    const unsigned long long pair = blockIdx.x, ib = L.in.at(pair, L.heads);
    const unsigned q0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const unsigned wr = q0 + 16 * warp;  // the warp's first row
    const bf16 *kp = k + ib, *vp = v + ib;
    const unsigned nkt = (min(q0 + BM, seq) - 1) / BN + 1;
    const float sl2 = scale * ATTN_LOG2E;

    attn_load_tile<HD, BM, NT>(sQ, q + ib, L.in.row, q0, seq);
    attn_load_tile<HD, BM, NT>(sO, dout + L.outs.at(pair, L.heads), L.outs.row, q0, seq);
    attn_load_tile<HD, BN, NT>(sK, kp, L.in.row, 0, seq);
    attn_load_tile<HD, BN, NT>(sV, vp, L.in.row, 0, seq);
    attn_cp_commit();
    for (unsigned x = threadIdx.x; x < BM; x += NT) {
        const unsigned row = q0 + x;
        sL[x] = row < seq ? lse[pair * seq + row] * ATTN_LOG2E : attn_pos_inf();  // +inf: p = 0 past seq
        sD[x] = row < seq ? delta[pair * seq + row] : 0.0f;
    }
    attn_cp_wait<0>();
    __syncthreads();

    unsigned qf[HD / 16][4], of[HD / 16][4];
    attn_load_a<HD>(qf, sQ, 16 * warp, lane);
    attn_load_a<HD>(of, sO, 16 * warp, lane);
    float gq[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) gq[nd][0] = gq[nd][1] = gq[nd][2] = gq[nd][3] = 0.0f;

    for (unsigned kt = 0; kt < nkt; ++kt) {
        const unsigned buf = kt & 1, k0 = kt * BN;
        if (kt + 1 < nkt) {
            attn_load_tile<HD, BN, NT>(sK + (buf ^ 1) * KVBYTES, kp, L.in.row, k0 + BN, seq);
            attn_load_tile<HD, BN, NT>(sV + (buf ^ 1) * KVBYTES, vp, L.in.row, k0 + BN, seq);
        }
        attn_cp_commit();

        if (k0 <= wr + 15) {  // some key of the tile is visible to some row of the warp
            const bool masked = k0 + BN - 1 > wr || k0 + BN > seq || wr + 16 > seq;
            float s[NB][4], dp[NB][4];
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
                s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
                dp[nb][0] = dp[nb][1] = dp[nb][2] = dp[nb][3] = 0.0f;
            }
            attn_mma_abt<HD, NB>(s, qf, sK + buf * KVBYTES, lane);
            attn_mma_abt<HD, NB>(dp, of, sV + buf * KVBYTES, lane);
            // s[nb][2h + e] is row wr + g + 8h, key k0 + 8nb + 2t + e. Afterwards s holds dS.
            auto elementwise = [&](auto dropping) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned row = wr + g + 8 * h;
                    const float l2 = sL[row - q0], dl = sD[row - q0];
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) {
                        const unsigned col = k0 + 8 * nb + 2 * t;
                        float p[2], d[2] = {dp[nb][2 * h], dp[nb][2 * h + 1]};
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const bool valid = !masked || (col + e <= row && row < seq);
                            p[e] = valid ? attn_exp2(s[nb][2 * h + e] * sl2 - l2) : 0.0f;
                        }
                        if (decltype(dropping)::value && drop.threshold != 0 && col <= row && row < seq) {
                            bool k0_, k1_;
                            attn_kept2(drop, (pair * seq + row) * seq + col, k0_, k1_);
                            d[0] = k0_ ? d[0] * drop.keep_scale : 0.0f;
                            d[1] = k1_ ? d[1] * drop.keep_scale : 0.0f;
                        }
                        s[nb][2 * h] = p[0] * (d[0] - dl);
                        s[nb][2 * h + 1] = p[1] * (d[1] - dl);
                    }
                }
            };
            if (!ATTN_SPLIT_DROPOUT || drop.threshold != 0) {
                elementwise(AttnFlag<true>());
            } else {
                elementwise(AttnFlag<false>());
            }
            attn_mma_pv<HD, BN / 16>(gq, s, sK + buf * KVBYTES, lane);
        }
        attn_cp_wait<0>();
        __syncthreads();
    }
    attn_store_rows<HD>(dq + L.grad.at(pair, L.heads), L.grad.row, gq, wr, scale, scale, seq, lane);
}

// ---- entry points ---------------------------------------------------------------------------------
// Tile constants (tiles.rs mirrors them; a change here must be made there):
//   forward  (MW, NW, BN):  d32 (2, 4, 64), d64 (2, 4, 64), d128 (1, 8, 64)   -> BM = 128 everywhere
//   dK/dV    (NW, BM, KV_REGS): d32 (8, 64, 1), d64 (8, 64, 1), d128 (8, 32, 0) -> BN = 128
//   dQ       (NW, BN):  d32 (8, 32), d64 (8, 32), d128 (8, 32)                 -> BM = 128
//   f32: ATTN_F32_THREADS threads, 128 / (HD/32) rows per block; delta: ATTN_DELTA_THREADS threads.

// dQ at HD 32 and 64: 8 warps (ATTN_DQ_THREADS, = 32·QNW) and key tiles of 32 leave few enough
// registers (<= 128) for ATTN_DQ_MIN_CTAS = 2 CTAs (16 warps) per SM; the entry points' forward
// declarations below carry the bound. Set it to 1 to go back to the unconstrained allocation.
#define ATTN_DQ_THREADS 256
#define ATTN_DQ_MIN_CTAS 2

#define ATTN_DROP AttnDrop drop = {seed, site, threshold, threshold != 0 ? *step : 0ull, keep_scale}
#define ATTN_LAYOUT \
    AttnLayout { seq, heads, {in_batch, in_head, in_row}, {grad_batch, grad_head, grad_row}, {outs_batch, outs_head, outs_row} }

template <int HD> struct AttnTiles;
template <> struct AttnTiles<32> {
    static constexpr int FMW = 2, FNW = 4, FBN = 64, KNW = 8, KBM = 64, QNW = 8, QBN = 32;
    static constexpr bool KREGS = true;
};
template <> struct AttnTiles<64> {
    static constexpr int FMW = 2, FNW = 4, FBN = 64, KNW = 8, KBM = 64, QNW = 8, QBN = 32;
    static constexpr bool KREGS = true;
};
template <> struct AttnTiles<128> {
    static constexpr int FMW = 1, FNW = 8, FBN = 64, KNW = 8, KBM = 32, QNW = 8, QBN = 32;
    static constexpr bool KREGS = false;
};

template <int HD>
__device__ __forceinline__ void attn_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                                             const AttnDrop& drop, float scale, const AttnLayout& L) {
    attention_forward_f32<HD>(out, lse, q, k, v, drop, scale, L);
}
template <int HD>
__device__ __forceinline__ void attn_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                             const AttnDrop& drop, float scale, const AttnLayout& L) {
    typedef AttnTiles<HD> C;
    attention_forward_mma<HD, C::FMW, C::FNW, C::FBN>(out, lse, q, k, v, drop, scale, L);
}
template <int HD>
__device__ __forceinline__ void attn_dkdv(float* dk, float* dv, const float* q, const float* k, const float* v,
                                          const float* dout, const float* lse, const float* delta,
                                          const AttnDrop& drop, float scale, const AttnLayout& L) {
    attention_dkdv_f32<HD>(dk, dv, q, k, v, dout, lse, delta, drop, scale, L);
}
template <int HD>
__device__ __forceinline__ void attn_dkdv(bf16* dk, bf16* dv, const bf16* q, const bf16* k, const bf16* v,
                                          const bf16* dout, const float* lse, const float* delta,
                                          const AttnDrop& drop, float scale, const AttnLayout& L) {
    typedef AttnTiles<HD> C;
    attention_dkdv_mma<HD, C::KNW, C::KBM, C::KREGS>(dk, dv, q, k, v, dout, lse, delta, drop, scale, L);
}
template <int HD>
__device__ __forceinline__ void attn_dq(float* dq, const float* q, const float* k, const float* v, const float* dout,
                                        const float* lse, const float* delta, const AttnDrop& drop, float scale,
                                        const AttnLayout& L) {
    attention_dq_f32<HD>(dq, q, k, v, dout, lse, delta, drop, scale, L);
}
template <int HD>
__device__ __forceinline__ void attn_dq(bf16* dq, const bf16* q, const bf16* k, const bf16* v, const bf16* dout,
                                        const float* lse, const float* delta, const AttnDrop& drop, float scale,
                                        const AttnLayout& L) {
    typedef AttnTiles<HD> C;
    attention_dq_mma<HD, C::QNW, C::QBN>(dq, q, k, v, dout, lse, delta, drop, scale, L);
}

// The entry points are written out (tests read their parameter lists from this text); each forwards to
// the template above. `pairs` is grid.x, checked by the launch geometry (the delta kernel walks seq·pairs
// rows); `heads` and the strides are AttnLayout's.

extern "C" __global__ void attention_forward_f32_d32(float* out, float* lse, const float* q, const float* k, const float* v, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_forward<32>(out, lse, q, k, v, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_delta_f32_d32(float* delta, const float* out, const float* dout, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    attention_delta<float, 32>(delta, out, dout, (unsigned long long)seq * pairs, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dkdv_f32_d32(float* dk, float* dv, const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dkdv<32>(dk, dv, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dq_f32_d32(float* dq, const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dq<32>(dq, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_forward_f32_d64(float* out, float* lse, const float* q, const float* k, const float* v, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_forward<64>(out, lse, q, k, v, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_delta_f32_d64(float* delta, const float* out, const float* dout, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    attention_delta<float, 64>(delta, out, dout, (unsigned long long)seq * pairs, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dkdv_f32_d64(float* dk, float* dv, const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dkdv<64>(dk, dv, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dq_f32_d64(float* dq, const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dq<64>(dq, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_forward_f32_d128(float* out, float* lse, const float* q, const float* k, const float* v, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_forward<128>(out, lse, q, k, v, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_delta_f32_d128(float* delta, const float* out, const float* dout, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    attention_delta<float, 128>(delta, out, dout, (unsigned long long)seq * pairs, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dkdv_f32_d128(float* dk, float* dv, const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dkdv<128>(dk, dv, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dq_f32_d128(float* dq, const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dq<128>(dq, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_forward_bf16_d32(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_forward<32>(out, lse, q, k, v, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_delta_bf16_d32(float* delta, const bf16* out, const bf16* dout, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    attention_delta<bf16, 32>(delta, out, dout, (unsigned long long)seq * pairs, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dkdv_bf16_d32(bf16* dk, bf16* dv, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dkdv<32>(dk, dv, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ __launch_bounds__(ATTN_DQ_THREADS, ATTN_DQ_MIN_CTAS) void attention_backward_dq_bf16_d32(bf16* dq, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row);
extern "C" __global__ void attention_backward_dq_bf16_d32(bf16* dq, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dq<32>(dq, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_forward_bf16_d64(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_forward<64>(out, lse, q, k, v, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_delta_bf16_d64(float* delta, const bf16* out, const bf16* dout, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    attention_delta<bf16, 64>(delta, out, dout, (unsigned long long)seq * pairs, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dkdv_bf16_d64(bf16* dk, bf16* dv, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dkdv<64>(dk, dv, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ __launch_bounds__(ATTN_DQ_THREADS, ATTN_DQ_MIN_CTAS) void attention_backward_dq_bf16_d64(bf16* dq, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row);
extern "C" __global__ void attention_backward_dq_bf16_d64(bf16* dq, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dq<64>(dq, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_forward_bf16_d128(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_forward<128>(out, lse, q, k, v, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_delta_bf16_d128(float* delta, const bf16* out, const bf16* dout, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    attention_delta<bf16, 128>(delta, out, dout, (unsigned long long)seq * pairs, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dkdv_bf16_d128(bf16* dk, bf16* dv, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dkdv<128>(dk, dv, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
extern "C" __global__ void attention_backward_dq_bf16_d128(bf16* dq, const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* delta, const unsigned long long* step, float scale, unsigned threshold, float keep_scale, unsigned seed, unsigned site, unsigned seq, unsigned pairs, unsigned heads, unsigned long long in_batch, unsigned long long in_head, unsigned long long in_row, unsigned long long grad_batch, unsigned long long grad_head, unsigned long long grad_row, unsigned long long outs_batch, unsigned long long outs_head, unsigned long long outs_row) {
    ATTN_DROP;
    attn_dq<128>(dq, q, k, v, dout, lse, delta, drop, scale, ATTN_LAYOUT);
}
