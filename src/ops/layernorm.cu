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
// gradients over its rows in row order; the row groups of a block add their sums in group order
// into the block's slot of the workspace; then a two-level tree, each level in index order: the
// last block of each span of TREE_SPAN consecutive blocks to finish (a ticket counter) adds the
// span's slots in block order, and the last of those adds the spans' sums in span order and adds
// the totals into the gradients. Which block does the adding varies; the order of additions does
// not, so the results are bitwise identical run to run. No float atomics. The small-N path
// (LN_COLUMNS) splits the columns over the blocks instead, so a column's sums never leave its
// block: each owning thread sums its columns over its rows in row order, and the row groups'
// sums are added in group order; no workspace, no tickets.

#define LN_FWD_VALS 16
#define LN_BWD_VALS 8
#define TREE_SPAN 12

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

    float x[K][W];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) {
            load<T, W>(inp + at + c, x[k]);
#pragma unroll
            for (int i = 0; i < W; i++) sum += x[k][i];
        }
    }
    const float m = group_sum(sum, G, red) / (float)C;

    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) {
#pragma unroll
            for (int i = 0; i < W; i++) {
                float d = x[k][i] - m;
                sq += d * d;
            }
        }
    }
    const float r = 1.0f / sqrtf(group_sum(sq, G, red) / (float)C + eps);

#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) {
            float w[W], b[W], y[W];
            load<T, W>(weight + c, w);
            load<T, W>(bias + c, b);
#pragma unroll
            for (int i = 0; i < W; i++) y[i] = (x[k][i] - m) * r * w[i] + b[i];
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

// One row of the backward, for both paths: row group g's lanes load row `row` (if it is one),
// add its terms to their parameter-gradient sums dw and db, and where `writes` (the row exists and,
// on the small-N path, the lane owns its columns) store dinp and add the residual into dr. Every
// thread of the block calls it, as group_sum2 has barriers.
template <typename T, int W, int K>
__device__ __forceinline__ void layernorm_backward_row(T* dinp, const T* dout, const T* inp, const float* mean,
                                                       const float* rstd, const T* residual, const float (&w)[K][W],
                                                       float (&dw)[K][W], float (&db)[K][W], float (&dr)[K][W],
                                                       float* red, unsigned row, unsigned rows, bool writes,
                                                       unsigned C, unsigned G, unsigned t, unsigned flags) {
    const bool has_residual = flags & LN_RESIDUAL, has_colsum = flags & LN_COLSUM;
    const bool live = row < rows;
    const unsigned long long at = (unsigned long long)row * C;
    const float m = live ? mean[row] : 0.0f, r = live ? rstd[row] : 0.0f;
    float norm[K][W], dnorm[K][W];
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W;
        if (live && c < C) {
            float x[W], dy[W];
            load<T, W>(inp + at + c, x);
            load<T, W>(dout + at + c, dy);
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
                load<T, W>(residual + at + c, res);
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

// dinp = residual + (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, with
// norm = (inp - mean) * rstd and dnorm = dout * weight; dweight += sum_rows dout * norm,
// dbias += sum_rows dout, dcolsum += sum_rows residual.
template <typename T, int W>
__device__ void layernorm_backward_rows(T* dinp, T* dweight, T* dbias, T* dcolsum, float* scratch,
                                        unsigned* counters, const T* dout, const T* inp, const T* weight,
                                        const float* mean, const float* rstd, const T* residual, unsigned rows,
                                        unsigned C, unsigned G, unsigned flags) {
    constexpr int K = LN_BWD_VALS / W;
    __shared__ float red[64];
    __shared__ unsigned ticket;
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

    // Uniform over the block (base depends on the block only), so every thread meets the barriers.
    for (unsigned base = blockIdx.x * R; base < rows; base += gridDim.x * R) {
        const unsigned row = base + g;
        layernorm_backward_row<T, W, K>(dinp, dout, inp, mean, rstd, residual, w, dw, db, dr, red, row, rows,
                                        row < rows, C, G, t, flags);
    }

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

    // Level 1: the last block of this span to finish adds the span's slots into its first slot.
    __threadfence();  // the slot is visible to every block before the ticket is taken
    __syncthreads();
    const unsigned span = blockIdx.x / TREE_SPAN, first = span * TREE_SPAN;
    const unsigned in_span = min(TREE_SPAN, gridDim.x - first);
    if (threadIdx.x == 0) ticket = atomicAdd(&counters[1 + span], 1u);
    __syncthreads();
    if (ticket != in_span - 1) return;  // uniform over the block
    __threadfence();
    if (threadIdx.x == 0) counters[1 + span] = 0;  // every block of the span has taken its ticket
    const unsigned long long n = parts * (unsigned long long)C;
    const unsigned spans = (gridDim.x + TREE_SPAN - 1) / TREE_SPAN;
    for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
        float s = __ldcg(scratch + first * C3 + j);
#pragma unroll 4
        for (unsigned b = first + 1; b < first + in_span; b++) s += __ldcg(scratch + b * C3 + j);
        if (spans == 1) {
            // One span: its sum is the total, added here (the same additions as level 2's).
            unsigned part = (unsigned)(j / C), c = (unsigned)(j % C);
            T* grad = part == 0 ? dweight : part == 1 ? dbias : dcolsum;
            grad[c] = from_float<T>(to_float(grad[c]) + s);
        } else {
            scratch[first * C3 + j] = s;
        }
    }
    if (spans == 1) return;  // level 2's counter was never taken

    // Level 2: the last span to finish adds the spans' sums in span order into the gradients.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(&counters[0], 1u);
    __syncthreads();
    if (ticket != spans - 1) return;
    __threadfence();
    if (threadIdx.x == 0) counters[0] = 0;  // the next launch (or graph replay) starts from 0
    for (unsigned long long j = threadIdx.x; j < n; j += blockDim.x) {
        float s = __ldcg(scratch + j);
#pragma unroll 4
        for (unsigned p = 1; p < spans; p++) s += __ldcg(scratch + p * TREE_SPAN * C3 + j);
        unsigned part = (unsigned)(j / C), c = (unsigned)(j % C);
        T* grad = part == 0 ? dweight : part == 1 ? dbias : dcolsum;
        grad[c] = from_float<T>(to_float(grad[c]) + s);
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
// and the counters are not touched, and the order depends only on N and C.
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

    // Uniform over the block, so every thread meets group_sum2's barriers.
    for (unsigned base = 0; base < rows; base += R) {
        const unsigned row = base + g;
        layernorm_backward_row<T, W, K>(dinp, dout, inp, mean, rstd, residual, w, dw, db, dr, red, row, rows,
                                        row < rows && mine, C, G, t, flags);
    }

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
__device__ void layernorm_backward(T* dinp, T* dweight, T* dbias, T* dcolsum, float* scratch, unsigned* counters,
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
        layernorm_backward_rows<T, Vec<T>::W>(dinp, dweight, dbias, dcolsum, scratch, counters, dout, inp, weight,
                                              mean, rstd, residual, rows, C, G, flags);
    } else {
        layernorm_backward_rows<T, 1>(dinp, dweight, dbias, dcolsum, scratch, counters, dout, inp, weight, mean,
                                      rstd, residual, rows, C, G, flags);
    }
}

extern "C" __global__ void layernorm_backward_f32(float* dinp, float* dweight, float* dbias, float* dcolsum,
                                                  float* scratch, unsigned* counters, const float* dout,
                                                  const float* inp, const float* weight, const float* mean,
                                                  const float* rstd, const float* residual, unsigned rows,
                                                  unsigned C, unsigned G, unsigned flags) {
    layernorm_backward<float>(dinp, dweight, dbias, dcolsum, scratch, counters, dout, inp, weight, mean, rstd,
                              residual, rows, C, G, flags);
}

extern "C" __global__ void layernorm_backward_bf16(bf16* dinp, bf16* dweight, bf16* dbias, bf16* dcolsum,
                                                   float* scratch, unsigned* counters, const bf16* dout,
                                                   const bf16* inp, const bf16* weight, const float* mean,
                                                   const float* rstd, const bf16* residual, unsigned rows,
                                                   unsigned C, unsigned G, unsigned flags) {
    layernorm_backward<bf16>(dinp, dweight, dbias, dcolsum, scratch, counters, dout, inp, weight, mean, rstd,
                             residual, rows, C, G, flags);
}
