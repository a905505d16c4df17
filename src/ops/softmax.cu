// Causal masked softmax over the last dimension of attention scores (B, H, T, T), f32; row i of
// each (b, h) sees keys j <= i. The CPU paths in softmax.rs compute the same formulas with
// sequential sums.
//
// Launch contract: one block of exactly ROW_BLOCK threads per row (the shared arrays and the strides
// below assume it).
//
// Determinism: no atomics; row reductions are reduce.cu's fixed-order block reductions (prepended
// to this source), so the results are bitwise identical run to run.
//
// The scale is applied with __fmul_rn, which the compiler never fuses into an FMA, so the
// scaled scores are rounded as on the CPU path.

// probs[j] = exp(scale * scores[j] - max) / sum for j <= i, exactly 0 for j > i. Scores above the
// diagonal are never read.
extern "C" __global__ void softmax_causal_forward_f32(float* probs, const float* scores, float scale,
                                                      unsigned rows, unsigned T) {
    __shared__ float buf[ROW_BLOCK];
    unsigned row = blockIdx.x;
    if (row >= rows) return;  // uniform over the block, so no thread misses a barrier
    unsigned i = row % T;     // the query position
    const float* x = scores + (unsigned long long)row * T;
    float* p = probs + (unsigned long long)row * T;

    float m = -__int_as_float(0x7f800000);  // -inf: a thread with no visible key contributes nothing
    for (unsigned j = threadIdx.x; j <= i; j += ROW_BLOCK) {
        float z = __fmul_rn(scale, x[j]);
        if (z > m) m = z;
    }
    m = block_max(m, buf);

    float sum = 0.0f;
    for (unsigned j = threadIdx.x; j <= i; j += ROW_BLOCK) sum += expf(__fmul_rn(scale, x[j]) - m);
    sum = block_sum(sum, buf);

    for (unsigned j = threadIdx.x; j < T; j += ROW_BLOCK) {
        p[j] = j <= i ? expf(__fmul_rn(scale, x[j]) - m) / sum : 0.0f;
    }
}

// dscores[j] = scale * probs[j] * (dprobs[j] - sum_{k <= i} dprobs[k] * probs[k]) for j <= i,
// exactly 0 for j > i. Inputs above the diagonal are never read.
extern "C" __global__ void softmax_causal_backward_f32(float* dscores, const float* probs, const float* dprobs,
                                                       float scale, unsigned rows, unsigned T) {
    __shared__ float buf[ROW_BLOCK];
    unsigned row = blockIdx.x;
    if (row >= rows) return;  // uniform over the block
    unsigned i = row % T;
    unsigned long long at = (unsigned long long)row * T;
    const float* p = probs + at;
    const float* dp = dprobs + at;
    float* ds = dscores + at;

    float dot = 0.0f;
    for (unsigned j = threadIdx.x; j <= i; j += ROW_BLOCK) dot += dp[j] * p[j];
    dot = block_sum(dot, buf);

    for (unsigned j = threadIdx.x; j < T; j += ROW_BLOCK) ds[j] = j <= i ? scale * (p[j] * (dp[j] - dot)) : 0.0f;
}
