// Causal masked softmax over the last dimension of attention scores (B, H, T, T), f32; row i of
// each (b, h) sees keys j <= i. The CPU paths in softmax.rs compute the same formulas with
// sequential sums.
//
// Launch contract: one block of exactly SM_BLOCK threads per row (the shared arrays and the strides
// below assume it).
//
// Determinism: no atomics. In a row reduction, thread t first combines elements t, t + SM_BLOCK,
// t + 2 SM_BLOCK, ... in index order, then the SM_BLOCK partial results are combined by a tree
// whose pairing depends only on thread indices. So every sum has one fixed order of additions and
// the results are bitwise identical run to run. (The maximum is exact in any order.)
//
// The scale is applied with __fmul_rn, which the compiler never fuses into an FMA, so the
// scaled scores are rounded as on the CPU path.

#define SM_BLOCK 256

// The sum of v over the block, returned to every thread. buf is SM_BLOCK floats of shared memory.
__device__ float sm_block_sum(float v, float* buf) {
    unsigned t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (unsigned s = SM_BLOCK / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];
        __syncthreads();
    }
    float total = buf[0];
    __syncthreads();  // every thread has read buf[0] before the next reduction overwrites it
    return total;
}

// The maximum of v over the block, returned to every thread.
__device__ float sm_block_max(float v, float* buf) {
    unsigned t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (unsigned s = SM_BLOCK / 2; s > 0; s >>= 1) {
        if (t < s && buf[t + s] > buf[t]) buf[t] = buf[t + s];
        __syncthreads();
    }
    float m = buf[0];
    __syncthreads();
    return m;
}

// probs[j] = exp(scale * scores[j] - max) / sum for j <= i, exactly 0 for j > i. Scores above the
// diagonal are never read.
extern "C" __global__ void softmax_causal_forward_f32(float* probs, const float* scores, float scale,
                                                      unsigned rows, unsigned T) {
    __shared__ float buf[SM_BLOCK];
    unsigned row = blockIdx.x;
    if (row >= rows) return;  // uniform over the block, so no thread misses a barrier
    unsigned i = row % T;     // the query position
    const float* x = scores + (unsigned long long)row * T;
    float* p = probs + (unsigned long long)row * T;

    float m = -__int_as_float(0x7f800000);  // -inf: a thread with no visible key contributes nothing
    for (unsigned j = threadIdx.x; j <= i; j += SM_BLOCK) {
        float z = __fmul_rn(scale, x[j]);
        if (z > m) m = z;
    }
    m = sm_block_max(m, buf);

    float sum = 0.0f;
    for (unsigned j = threadIdx.x; j <= i; j += SM_BLOCK) sum += expf(__fmul_rn(scale, x[j]) - m);
    sum = sm_block_sum(sum, buf);

    for (unsigned j = threadIdx.x; j < T; j += SM_BLOCK) {
        p[j] = j <= i ? expf(__fmul_rn(scale, x[j]) - m) / sum : 0.0f;
    }
}

// dscores[j] = scale * probs[j] * (dprobs[j] - sum_{k <= i} dprobs[k] * probs[k]) for j <= i,
// exactly 0 for j > i. Inputs above the diagonal are never read.
extern "C" __global__ void softmax_causal_backward_f32(float* dscores, const float* probs, const float* dprobs,
                                                       float scale, unsigned rows, unsigned T) {
    __shared__ float buf[SM_BLOCK];
    unsigned row = blockIdx.x;
    if (row >= rows) return;  // uniform over the block
    unsigned i = row % T;
    unsigned long long at = (unsigned long long)row * T;
    const float* p = probs + at;
    const float* dp = dprobs + at;
    float* ds = dscores + at;

    float dot = 0.0f;
    for (unsigned j = threadIdx.x; j <= i; j += SM_BLOCK) dot += dp[j] * p[j];
    dot = sm_block_sum(dot, buf);

    for (unsigned j = threadIdx.x; j < T; j += SM_BLOCK) ds[j] = j <= i ? scale * (p[j] * (dp[j] - dot)) : 0.0f;
}
