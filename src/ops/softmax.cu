// Causal softmax over the last dimension of attention scores (.., T, T) of T_ (float or bf16),
// f32 math: row i of each (T, T) matrix sees keys j <= i. Each value is widened once when loaded
// and rounded once when stored. The CPU paths in softmax.rs compute the same formulas with
// sequential sums. rows.cu (row groups, vector accesses, reductions) is prepended to this source.
//
// Launch contract (softmax.rs computes it): blocks of blockDim.x threads split into row groups
// of G threads, G a power of two dividing blockDim.x, T <= G * SM_VALS, one row per group, so a
// thread keeps its part of a row in registers and every value is loaded once.
//
// Never read: a row reads columns 0..=i only. A 16-byte chunk that straddles the diagonal is read
// element by element up to it, so the upper triangle (uninitialized, or NaN) is never loaded.
// Every column is written: exact zeros above the diagonal, as the next GEMM reads the whole row.
//
// Determinism: the row reductions of rows.cu, so results are bitwise identical run to run.

#define SM_VALS 16

// How many of the W elements from column c on are visible to row i: all, some, or none.
template <int W> __device__ __forceinline__ unsigned visible(unsigned c, unsigned i) {
    return c > i ? 0u : min((unsigned)W, i - c + 1u);
}

// W elements from p, of which the first n are visible (n == W: one 16-byte access when W > 1),
// as floats; the others are set to `fill` without being read.
template <typename T, int W>
__device__ __forceinline__ void load_visible(const T* p, unsigned n, float fill, float (&v)[W]) {
    if (n == W) {
        load<T, W>(p, v);
    } else {
#pragma unroll
        for (int e = 0; e < W; e++) v[e] = (unsigned)e < n ? to_float(p[e]) : fill;
    }
}

// probs[j] = exp(scores[j] - max) / sum for j <= i, exactly 0 for j > i.
template <typename T, int W>
__device__ void softmax_causal_forward_rows(T* probs, const T* scores, unsigned rows, unsigned T_, unsigned G) {
    constexpr int K = SM_VALS / W;
    __shared__ float red[64];
    const unsigned t = threadIdx.x % G, row = blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
    const bool live = row < rows;  // a group past the last row still takes part in the barriers
    const unsigned i = live ? row % T_ : 0;  // the query's position: it sees keys 0..=i
    const unsigned long long at = (unsigned long long)row * T_;
    const float neg_inf = -__int_as_float(0x7f800000);

    float z[K][W];
    float m = neg_inf;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W, n = live ? visible<W>(c, i) : 0u;
        if (n > 0) {
            load_visible<T, W>(scores + at + c, n, neg_inf, z[k]);
#pragma unroll
            for (int e = 0; e < W; e++) m = fmaxf(m, z[k][e]);
        }
    }
    m = group_max(m, G, red);

    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W, n = live ? visible<W>(c, i) : 0u;
#pragma unroll
        for (int e = 0; e < W; e++) {
            if ((unsigned)e < n) {
                z[k][e] = expf(z[k][e] - m);
                sum += z[k][e];
            }
        }
    }
    sum = group_sum(sum, G, red);

#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W, n = live ? visible<W>(c, i) : 0u;
        if (live && c < T_) {
            float p[W];
#pragma unroll
            for (int e = 0; e < W; e++) p[e] = (unsigned)e < n ? z[k][e] / sum : 0.0f;
            store<T, W>(probs + at + c, p);
        }
    }
}

template <typename T>
__device__ void softmax_causal_forward(T* probs, const T* scores, unsigned rows, unsigned T_, unsigned G) {
    if (vectorizable<T>(T_, probs, scores)) {
        softmax_causal_forward_rows<T, Vec<T>::W>(probs, scores, rows, T_, G);
    } else {
        softmax_causal_forward_rows<T, 1>(probs, scores, rows, T_, G);
    }
}

extern "C" __global__ void softmax_causal_forward_f32(float* probs, const float* scores, unsigned rows, unsigned T,
                                                      unsigned G) {
    softmax_causal_forward<float>(probs, scores, rows, T, G);
}

extern "C" __global__ void softmax_causal_forward_bf16(bf16* probs, const bf16* scores, unsigned rows, unsigned T,
                                                       unsigned G) {
    softmax_causal_forward<bf16>(probs, scores, rows, T, G);
}

// dscores[j] = probs[j] * (dprobs[j] - sum_{k <= i} probs[k] * dprobs[k]) for j <= i, exactly 0
// for j > i.
template <typename T, int W>
__device__ void softmax_causal_backward_rows(T* dscores, const T* probs, const T* dprobs, unsigned rows, unsigned T_,
                                             unsigned G) {
    constexpr int K = SM_VALS / W;
    __shared__ float red[64];
    const unsigned t = threadIdx.x % G, row = blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
    const bool live = row < rows;
    const unsigned i = live ? row % T_ : 0;
    const unsigned long long at = (unsigned long long)row * T_;

    float p[K][W], dp[K][W];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W, n = live ? visible<W>(c, i) : 0u;
        if (n > 0) {
            load_visible<T, W>(probs + at + c, n, 0.0f, p[k]);
            load_visible<T, W>(dprobs + at + c, n, 0.0f, dp[k]);
#pragma unroll
            for (int e = 0; e < W; e++) {
                if ((unsigned)e < n) dot += p[k][e] * dp[k][e];
            }
        }
    }
    dot = group_sum(dot, G, red);

#pragma unroll
    for (int k = 0; k < K; k++) {
        unsigned c = (k * G + t) * W, n = live ? visible<W>(c, i) : 0u;
        if (live && c < T_) {
            float ds[W];
#pragma unroll
            for (int e = 0; e < W; e++) ds[e] = (unsigned)e < n ? p[k][e] * (dp[k][e] - dot) : 0.0f;
            store<T, W>(dscores + at + c, ds);
        }
    }
}

template <typename T>
__device__ void softmax_causal_backward(T* dscores, const T* probs, const T* dprobs, unsigned rows, unsigned T_,
                                        unsigned G) {
    if (vectorizable<T>(T_, dscores, probs, dprobs)) {
        softmax_causal_backward_rows<T, Vec<T>::W>(dscores, probs, dprobs, rows, T_, G);
    } else {
        softmax_causal_backward_rows<T, 1>(dscores, probs, dprobs, rows, T_, G);
    }
}

extern "C" __global__ void softmax_causal_backward_f32(float* dscores, const float* probs, const float* dprobs,
                                                       unsigned rows, unsigned T, unsigned G) {
    softmax_causal_backward<float>(dscores, probs, dprobs, rows, T, G);
}

extern "C" __global__ void softmax_causal_backward_bf16(bf16* dscores, const bf16* probs, const bf16* dprobs,
                                                        unsigned rows, unsigned T, unsigned G) {
    softmax_causal_backward<bf16>(dscores, probs, dprobs, rows, T, G);
}
