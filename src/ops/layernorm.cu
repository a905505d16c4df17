// LayerNorm over the last dimension of a row-major (rows, C) matrix of T (float or bf16), with f32
// statistics and f32 math: each value is widened once when loaded and rounded once when stored.
// The CPU paths in layernorm.rs compute the same formulas with sequential sums. rows.cu (the row
// groups, vector accesses and reductions) is prepended to this source.
//
// Launch contract (layernorm.rs computes it): blocks of blockDim.x threads split into row groups
// of G threads, G a power of two dividing blockDim.x, and C <= G * LN_*_VALS, so that a thread
// keeps its part of a row in registers and every value is loaded once.
//
// Determinism: row sums as rows.cu says. In the backward, each thread sums its columns' parameter
// gradients over its rows in row order, and the row groups of a block add their sums in group
// order into the block's slot of the workspace; a second kernel (layernorm_column_sums) then adds
// the slots into the gradients, each column's in block order (in eight runs of consecutive
// slots, added in run order). The order of additions depends only on the shapes, so the results
// are bitwise identical run to run. No atomics. The small-N path (LN_COLUMNS) splits the columns
// over the blocks instead, so a column's sums never leave its block: each owning thread sums its
// columns over its rows in row order, and the row groups' sums are added in group order; no
// workspace, no second kernel.

#define LN_FWD_VALS 16
#define LN_BWD_VALS 8
// The threads of a backward block (BWD_BLOCK in layernorm.rs), and of the column sums' runs of
// slots per column, one warp each (SUM_BLOCK / 32).
#define LN_BWD_BLOCK 512
#define LN_SUM_RUNS 8

// out = (inp - mean) * rstd * weight + bias; saves mean and rstd = 1 / sqrt(var + eps), the
// biased variance computed in a second pass over the row in registers.
template <typename T, int W>
__device__ void layernorm_forward_rows(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                                       const T* bias, float eps, unsigned rows, unsigned C, unsigned G) {
    constexpr int K = LN_FWD_VALS / W;
    __shared__ float red[64];
    const unsigned t = threadIdx.x % G, row = blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
    const bool live = row < rows;  // a group past the last row still takes part in the barriers
    const unsigned long long at = (unsigned long long)row * C;

    // The row's chunks stay as loaded and are widened in each pass: fewer registers, so more
    // blocks per SM overlap one row's reductions with another's loads.
    Raw<T, W> raw[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) load_raw<T, W>(inp + at + c, raw[k]);
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) {
            float x[W];
            widen<T, W>(raw[k], x);
#pragma unroll
            for (int i = 0; i < W; i++) sum += x[i];
        }
    }
    const float m = group_sum(sum, G, red) / (float)C;

    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) {
            float x[W];
            widen<T, W>(raw[k], x);
#pragma unroll
            for (int i = 0; i < W; i++) {
                float d = x[i] - m;
                sq += d * d;
            }
        }
    }
    const float r = 1.0f / sqrtf(group_sum(sq, G, red) / (float)C + eps);

#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) {
            float x[W], w[W], b[W], y[W];
            widen<T, W>(raw[k], x);
            load<T, W>(weight + c, w);
            load<T, W>(bias + c, b);
#pragma unroll
            for (int i = 0; i < W; i++) y[i] = (x[i] - m) * r * w[i] + b[i];
            store<T, W>(out + at + c, y);
        }
    }
    if (live && t == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

template <typename T>
__device__ void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight, const T* bias,
                                  float eps, unsigned rows, unsigned C, unsigned G) {
    if (vectorizable<T>(C, out, inp, weight, bias)) {
        layernorm_forward_rows<T, Vec<T>::W>(out, mean, rstd, inp, weight, bias, eps, rows, C, G);
    } else {
        layernorm_forward_rows<T, 1>(out, mean, rstd, inp, weight, bias, eps, rows, C, G);
    }
}

extern "C" __global__ void layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp,
                                                 const float* weight, const float* bias, float eps, unsigned rows,
                                                 unsigned C, unsigned G) {
    layernorm_forward<float>(out, mean, rstd, inp, weight, bias, eps, rows, C, G);
}

extern "C" __global__ void layernorm_forward_bf16(bf16* out, float* mean, float* rstd, const bf16* inp,
                                                  const bf16* weight, const bf16* bias, float eps, unsigned rows,
                                                  unsigned C, unsigned G) {
    layernorm_forward<bf16>(out, mean, rstd, inp, weight, bias, eps, rows, C, G);
}

// flags: bit 0, residual is given (added into dinp); bit 1, dcolsum is given (+= column sums of
// residual). Slot layout of scratch, 3 * C floats per block: dweight, dbias, dcolsum partials.
#define LN_RESIDUAL 1u
#define LN_COLSUM 2u
// flags bit 2: the small-N path (layernorm_backward_cols), which splits the columns over the grid.
#define LN_COLUMNS 4u

// What one row's sums read, as stored: row group g's lanes' chunks of inp and dout, and the
// row's statistics. Loaded one row ahead of their use (see Raw in rows.cu), so each block keeps
// two rows' reads in flight across the row sums' barriers.
template <typename T, int W, int K> struct RowReads {
    Raw<T, W> x[K], dy[K];
    float m, r;
};

// The reads of row `row` (none past the last row) for lane t.
template <typename T, int W, int K>
__device__ __forceinline__ void layernorm_backward_load(RowReads<T, W, K>& in, const T* dout, const T* inp,
                                                        const float* mean, const float* rstd, const T* residual,
                                                        unsigned row, unsigned rows, unsigned C, unsigned G,
                                                        unsigned t, unsigned flags) {
    if (row >= rows) return;
    const unsigned long long at = (unsigned long long)row * C;
    in.m = mean[row];
    in.r = rstd[row];
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (c < C) {
            load_raw<T, W>(inp + at + c, in.x[k]);
            load_raw<T, W>(dout + at + c, in.dy[k]);
        }
    }
}

// One row of the backward, for both paths, from its reads: row group g's lanes add the row's
// terms to their parameter-gradient sums dw and db, and where `writes` (the row exists and, on
// the small-N path, the lane owns its columns) store dinp and add the residual into dr. Every
// thread of the block calls it, as group_sum2 has barriers.
template <typename T, int W, int K>
__device__ __forceinline__ void layernorm_backward_row(T* dinp, const RowReads<T, W, K>& in, const T* residual,
                                                       const float (&w)[K][W], float (&dw)[K][W],
                                                       float (&db)[K][W], float (&dr)[K][W], float* red,
                                                       unsigned row, unsigned rows, bool writes, unsigned C,
                                                       unsigned G, unsigned t, unsigned flags) {
    const bool has_residual = flags & LN_RESIDUAL, has_colsum = flags & LN_COLSUM;
    const bool live = row < rows;
    const unsigned long long at = (unsigned long long)row * C;
    const float m = live ? in.m : 0.0f, r = live ? in.r : 0.0f;
    float norm[K][W], dnorm[K][W];
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) {
            float x[W], dy[W];
            widen<T, W>(in.x[k], x);
            widen<T, W>(in.dy[k], dy);
#pragma unroll
            for (int i = 0; i < W; i++) {
                norm[k][i] = (x[i] - m) * r;
                dnorm[k][i] = dy[i] * w[k][i];
                a += dnorm[k][i];
                b += dnorm[k][i] * norm[k][i];
                dw[k][i] += dy[i] * norm[k][i];
                db[k][i] += dy[i];
            }
        }
    }
    // The residual's reads in flight during the row's sums.
    Raw<T, W> res_raw[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (has_residual && writes && c < C) load_raw<T, W>(residual + at + c, res_raw[k]);
    }
    const float2 s = group_sum2(a, b, G, red);
    const float mean_a = s.x / (float)C, mean_b = s.y / (float)C;
    if (!writes) return;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (c < C) {
            float d[W];
#pragma unroll
            for (int i = 0; i < W; i++) d[i] = (dnorm[k][i] - mean_a - norm[k][i] * mean_b) * r;
            if (has_residual) {
                float res[W];
                widen<T, W>(res_raw[k], res);
#pragma unroll
                for (int i = 0; i < W; i++) {
                    d[i] += res[i];
                    if (has_colsum) dr[k][i] += res[i];
                }
            }
            store<T, W>(dinp + at + c, d);
        }
    }
}

// Rows first, first + step, ... below `rows` through layernorm_backward_row, each row's reads
// issued while the row before it is reduced. `mine` as layernorm_backward_row's `writes`, for
// the rows that exist.
template <typename T, int W, int K>
__device__ __forceinline__ void layernorm_backward_walk(T* dinp, const T* dout, const T* inp, const float* mean,
                                                        const float* rstd, const T* residual,
                                                        const float (&w)[K][W], float (&dw)[K][W],
                                                        float (&db)[K][W], float (&dr)[K][W], float* red,
                                                        unsigned first, unsigned step,
                                                        unsigned rows, bool mine, unsigned C, unsigned G,
                                                        unsigned t, unsigned flags) {
    const unsigned g = threadIdx.x / G;
    RowReads<T, W, K> cur;
    layernorm_backward_load<T, W, K>(cur, dout, inp, mean, rstd, residual, first + g, rows, C, G, t, flags);
    // `first` and `step` are uniform over the block, so every thread meets the barriers.
    for (unsigned base = first; base < rows; base += step) {
        RowReads<T, W, K> next;
        layernorm_backward_load<T, W, K>(next, dout, inp, mean, rstd, residual, base + step + g, rows, C, G, t,
                                         flags);
        const unsigned row = base + g;
        layernorm_backward_row<T, W, K>(dinp, cur, residual, w, dw, db, dr, red, row, rows, row < rows && mine, C,
                                        G, t, flags);
        cur = next;
    }
}

// dinp = residual + (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, with
// norm = (inp - mean) * rstd and dnorm = dout * weight; dweight += sum_rows dout * norm,
// dbias += sum_rows dout, dcolsum += sum_rows residual; the parameter gradients' sums over this
// block's rows go to its slot of scratch, for layernorm_column_sums to add.
template <typename T, int W>
__device__ void layernorm_backward_rows(T* dinp, float* scratch, const T* dout, const T* inp, const T* weight,
                                        const float* mean, const float* rstd, const T* residual, unsigned rows,
                                        unsigned C, unsigned G, unsigned flags) {
    constexpr int K = LN_BWD_VALS / W;
    __shared__ float red[64];
    const bool has_colsum = flags & LN_COLSUM;
    const unsigned R = blockDim.x / G, g = threadIdx.x / G, t = threadIdx.x % G;

    // This thread's columns: their weights, and its sums of the parameter gradients over its rows.
    float w[K][W], dw[K][W], db[K][W], dr[K][W];
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (c < C) load<T, W>(weight + c, w[k]);
#pragma unroll
        for (int i = 0; i < W; i++) dw[k][i] = db[k][i] = dr[k][i] = 0.0f;
    }

    layernorm_backward_walk<T, W, K>(dinp, dout, inp, mean, rstd, residual, w, dw, db, dr, red, blockIdx.x * R,
                                     gridDim.x * R, rows, true, C, G, t, flags);

    // The block's partial sums into its slot, row group after row group. With several row groups
    // they are added in shared memory (parts * C floats, the launch's dynamic shared memory), whose
    // round trips are short, and the slot is written once; one row group writes the slot directly.
    extern __shared__ float block_sums[];
    const unsigned long long C3 = 3ull * C;
    const unsigned parts = has_colsum ? 3u : 2u;
    float* slot = scratch + blockIdx.x * C3;
    float* sums = R > 1 ? block_sums : slot;
    for (unsigned step = 0; step < R; step++) {
        if (g == step) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                unsigned c = (k * G + t) * W;
                if (c < C) {
#pragma unroll
                    for (int i = 0; i < W; i++) {
                        float v[3] = {dw[k][i], db[k][i], dr[k][i]};
                        for (unsigned p = 0; p < parts; p++) {
                            float* at = sums + p * C + c + i;
                            *at = step == 0 ? v[p] : *at + v[p];
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
    if (R > 1) {
        for (unsigned j = threadIdx.x; j < parts * C; j += blockDim.x) slot[j] = block_sums[j];
    }

}

// The small-N path: with few rows, the row path has few blocks (8 at 128 rows of 256) and its
// cross-block reduction is most of its time. Here block b owns the columns of lanes
// [b * L, (b + 1) * L) of every row group (L = G / gridDim.x; lane t holds chunks t, t + G, ... as
// in the row path) and walks every row: each row group computes its row's two sums over the whole
// row, in the row path's order (dinp is the row path's formula and order), and only the owning lanes write
// dinp and sum their columns' parameter gradients, in row order. The row groups' sums meet in
// shared memory (the launch's dynamic shared memory, R * 3 * L * LN_BWD_VALS floats) and are
// added in group order into the gradients: a column's sums never leave its block, so the scratch
// is not touched, and the order depends only on N and C.
template <typename T, int W>
__device__ void layernorm_backward_cols(T* dinp, T* dweight, T* dbias, T* dcolsum, const T* dout, const T* inp,
                                        const T* weight, const float* mean, const float* rstd, const T* residual,
                                        unsigned rows, unsigned C, unsigned G, unsigned flags) {
    constexpr int K = LN_BWD_VALS / W;
    __shared__ float red[64];
    const bool has_colsum = flags & LN_COLSUM;
    const unsigned R = blockDim.x / G, g = threadIdx.x / G, t = threadIdx.x % G;
    const unsigned L = G / gridDim.x, first = blockIdx.x * L;
    if (first * W >= C) return;  // no lane of this block holds a column (uniform over the block)
    const bool mine = t - first < L;  // unsigned: false below first too

    float w[K][W], dw[K][W], db[K][W], dr[K][W];
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (c < C) load<T, W>(weight + c, w[k]);
#pragma unroll
        for (int i = 0; i < W; i++) dw[k][i] = db[k][i] = dr[k][i] = 0.0f;
    }

    layernorm_backward_walk<T, W, K>(dinp, dout, inp, mean, rstd, residual, w, dw, db, dr, red, 0, R, rows, mine,
                                     C, G, t, flags);

    // Row group g's sums of part p (dweight, dbias, dcolsum) for value v of owning lane q at
    // sums[((g * 3 + p) * L + q) * LN_BWD_VALS + v]; then one thread per (p, q, v) adds them in
    // group order into the gradient.
    extern __shared__ float block_sums[];
    if (mine) {
        const unsigned q = t - first;
#pragma unroll
        for (int k = 0; k < K; k++) {
#pragma unroll
            for (int i = 0; i < W; i++) {
                const unsigned v = k * W + i;
                block_sums[((g * 3 + 0) * L + q) * LN_BWD_VALS + v] = dw[k][i];
                block_sums[((g * 3 + 1) * L + q) * LN_BWD_VALS + v] = db[k][i];
                block_sums[((g * 3 + 2) * L + q) * LN_BWD_VALS + v] = dr[k][i];
            }
        }
    }
    __syncthreads();
    const unsigned per_part = L * LN_BWD_VALS, n = (has_colsum ? 3u : 2u) * per_part;
    for (unsigned j = threadIdx.x; j < n; j += blockDim.x) {
        const unsigned p = j / per_part, q = j % per_part / LN_BWD_VALS, v = j % LN_BWD_VALS;
        const unsigned c = ((v / W) * G + first + q) * W + v % W;
        if (c >= C) continue;
        float s = block_sums[(p * L + q) * LN_BWD_VALS + v];
        for (unsigned h = 1; h < R; h++) s += block_sums[((h * 3 + p) * L + q) * LN_BWD_VALS + v];
        T* grad = p == 0 ? dweight : p == 1 ? dbias : dcolsum;
        grad[c] = from_float<T>(to_float(grad[c]) + s);
    }
}

template <typename T>
__device__ void layernorm_backward(T* dinp, T* dweight, T* dbias, T* dcolsum, float* scratch,
                                   const T* dout, const T* inp, const T* weight, const float* mean,
                                   const float* rstd, const T* residual, unsigned rows, unsigned C, unsigned G,
                                   unsigned flags) {
    const T* res = flags & LN_RESIDUAL ? residual : 0;
    const bool vec = vectorizable<T>(C, dinp, dout, inp, weight, res);
    if (flags & LN_COLUMNS) {
        if (vec) {
            layernorm_backward_cols<T, Vec<T>::W>(dinp, dweight, dbias, dcolsum, dout, inp, weight, mean, rstd,
                                                  residual, rows, C, G, flags);
        } else {
            layernorm_backward_cols<T, 1>(dinp, dweight, dbias, dcolsum, dout, inp, weight, mean, rstd, residual,
                                          rows, C, G, flags);
        }
    } else if (vec) {
        layernorm_backward_rows<T, Vec<T>::W>(dinp, scratch, dout, inp, weight, mean, rstd, residual, rows, C, G,
                                              flags);
    } else {
        layernorm_backward_rows<T, 1>(dinp, scratch, dout, inp, weight, mean, rstd, residual, rows, C, G, flags);
    }
}

// 128 registers at most, so that the 512 threads of a block fit an SM (their reads of the next
// row in flight cost registers; ptxas spills a few).
extern "C" __global__ __launch_bounds__(LN_BWD_BLOCK) void layernorm_backward_f32(float* dinp, float* dweight, float* dbias, float* dcolsum, float* scratch, const float* dout, const float* inp, const float* weight, const float* mean, const float* rstd, const float* residual, unsigned rows, unsigned C, unsigned G, unsigned flags);
extern "C" __global__ void layernorm_backward_f32(float* dinp, float* dweight, float* dbias, float* dcolsum,
                                                  float* scratch, const float* dout,
                                                  const float* inp, const float* weight, const float* mean,
                                                  const float* rstd, const float* residual, unsigned rows,
                                                  unsigned C, unsigned G, unsigned flags) {
    layernorm_backward<float>(dinp, dweight, dbias, dcolsum, scratch, dout, inp, weight, mean, rstd,
                              residual, rows, C, G, flags);
}

extern "C" __global__ __launch_bounds__(LN_BWD_BLOCK) void layernorm_backward_bf16(bf16* dinp, bf16* dweight, bf16* dbias, bf16* dcolsum, float* scratch, const bf16* dout, const bf16* inp, const bf16* weight, const float* mean, const float* rstd, const bf16* residual, unsigned rows, unsigned C, unsigned G, unsigned flags);
extern "C" __global__ void layernorm_backward_bf16(bf16* dinp, bf16* dweight, bf16* dbias, bf16* dcolsum,
                                                   float* scratch, const bf16* dout,
                                                   const bf16* inp, const bf16* weight, const float* mean,
                                                   const float* rstd, const bf16* residual, unsigned rows,
                                                   unsigned C, unsigned G, unsigned flags) {
    layernorm_backward<bf16>(dinp, dweight, dbias, dcolsum, scratch, dout, inp, weight, mean, rstd,
                             residual, rows, C, G, flags);
}

// The row path's second kernel: gradient part p (dweight, dbias, dcolsum) of column c, at index
// j = p * C + c, += the sum of the first `slots` slots of scratch (3 * C floats each) at j. A
// block of 256 threads serves 32 consecutive indices: warp r sums slots [r * per, (r + 1) * per)
// in slot order (per = ceil(slots / LN_SUM_RUNS)), and the first warp adds the eight runs in run
// order, so the order of additions depends only on `slots` (the backward's block count).
template <typename T>
__device__ void layernorm_column_sums(T* dweight, T* dbias, T* dcolsum, const float* scratch, unsigned slots,
                                      unsigned C, unsigned parts) {
    __shared__ float runs[LN_SUM_RUNS][32];
    const unsigned lane = threadIdx.x % 32, run = threadIdx.x / 32;
    const unsigned long long j = blockIdx.x * 32ull + lane, n = (unsigned long long)parts * C;
    const unsigned per = (slots + LN_SUM_RUNS - 1) / LN_SUM_RUNS, first = run * per;
    const unsigned last = min(slots, first + per);
    float s = 0.0f;
    if (j < n) {
#pragma unroll 4
        for (unsigned b = first; b < last; b++) s += __ldcg(scratch + b * 3ull * C + j);
    }
    runs[run][lane] = s;
    __syncthreads();
    if (run != 0 || j >= n) return;
    float total = runs[0][lane];
#pragma unroll
    for (int r = 1; r < LN_SUM_RUNS; r++) total += runs[r][lane];
    const unsigned p = (unsigned)(j / C), c = (unsigned)(j % C);
    T* grad = p == 0 ? dweight : p == 1 ? dbias : dcolsum;
    grad[c] = from_float<T>(to_float(grad[c]) + total);
}

extern "C" __global__ void layernorm_column_sums_f32(float* dweight, float* dbias, float* dcolsum, const float* scratch,
                                                     unsigned slots, unsigned C, unsigned parts) {
    layernorm_column_sums<float>(dweight, dbias, dcolsum, scratch, slots, C, parts);
}

extern "C" __global__ void layernorm_column_sums_bf16(bf16* dweight, bf16* dbias, bf16* dcolsum, const float* scratch,
                                                      unsigned slots, unsigned C, unsigned parts) {
    layernorm_column_sums<bf16>(dweight, dbias, dcolsum, scratch, slots, C, parts);
}
