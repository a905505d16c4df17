// LayerNorm over the last dimension of a row-major (rows, C) matrix, f32 with f32 statistics.
// The CPU paths in layernorm.rs compute the same formulas with sequential sums.
//
// Launch contract: the per-row kernels run one block of exactly LN_BLOCK threads per row (the
// shared arrays and the strides below assume it); the parameter kernel runs one thread per column.
//
// Determinism: no atomics anywhere. In a per-row reduction, thread t first sums elements
// t, t + LN_BLOCK, t + 2 LN_BLOCK, ... in index order, then the LN_BLOCK partial sums are combined
// by a tree whose pairing depends only on thread indices. In the parameter kernel each thread
// sums its column over rows 0, 1, 2, ... in order. So every sum has one fixed order of additions
// and the results are bitwise identical run to run.

#define LN_BLOCK 256

// The sum of v over the block, returned to every thread. buf is LN_BLOCK floats of shared memory.
__device__ float ln_block_sum(float v, float* buf) {
    unsigned t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (unsigned s = LN_BLOCK / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];
        __syncthreads();
    }
    float total = buf[0];
    __syncthreads();  // every thread has read buf[0] before the next reduction overwrites it
    return total;
}

// out = (inp - mean) * rstd * weight + bias per row; saves mean and rstd = 1 / sqrt(var + eps).
// Two passes over the row (mean, then the centered variance) for accuracy.
extern "C" __global__ void layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp,
                                                 const float* weight, const float* bias, float eps,
                                                 unsigned rows, unsigned C) {
    __shared__ float buf[LN_BLOCK];
    unsigned row = blockIdx.x;
    if (row >= rows) return;  // uniform over the block, so no thread misses a barrier
    const float* x = inp + (unsigned long long)row * C;
    float* y = out + (unsigned long long)row * C;

    float sum = 0.0f;
    for (unsigned c = threadIdx.x; c < C; c += LN_BLOCK) sum += x[c];
    float m = ln_block_sum(sum, buf) / (float)C;

    float sq = 0.0f;
    for (unsigned c = threadIdx.x; c < C; c += LN_BLOCK) {
        float d = x[c] - m;
        sq += d * d;
    }
    float r = 1.0f / sqrtf(ln_block_sum(sq, buf) / (float)C + eps);

    for (unsigned c = threadIdx.x; c < C; c += LN_BLOCK) y[c] = (x[c] - m) * r * weight[c] + bias[c];
    if (threadIdx.x == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// dinp = (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd per row, with
// norm = (inp - mean) * rstd and dnorm = dout * weight. Written, not accumulated.
extern "C" __global__ void layernorm_backward_dinp_f32(float* dinp, const float* dout, const float* inp,
                                                       const float* weight, const float* mean,
                                                       const float* rstd, unsigned rows, unsigned C) {
    __shared__ float buf[LN_BLOCK];
    unsigned row = blockIdx.x;
    if (row >= rows) return;  // uniform over the block
    unsigned long long at = (unsigned long long)row * C;
    const float* x = inp + at;
    const float* g = dout + at;
    float* dx = dinp + at;
    float m = mean[row], r = rstd[row];

    float dn_sum = 0.0f, dnn_sum = 0.0f;
    for (unsigned c = threadIdx.x; c < C; c += LN_BLOCK) {
        float norm = (x[c] - m) * r;
        float dn = g[c] * weight[c];
        dn_sum += dn;
        dnn_sum += dn * norm;
    }
    float dn_mean = ln_block_sum(dn_sum, buf) / (float)C;
    float dnn_mean = ln_block_sum(dnn_sum, buf) / (float)C;

    for (unsigned c = threadIdx.x; c < C; c += LN_BLOCK) {
        float norm = (x[c] - m) * r;
        float dn = g[c] * weight[c];
        dx[c] = (dn - dn_mean - norm * dnn_mean) * r;
    }
}

// dweight[c] += sum_rows dout * norm, dbias[c] += sum_rows dout: one thread per column, rows in
// index order, added to the gradients once at the end.
extern "C" __global__ void layernorm_backward_params_f32(float* dweight, float* dbias, const float* dout,
                                                         const float* inp, const float* mean,
                                                         const float* rstd, unsigned rows, unsigned C) {
    unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (unsigned row = 0; row < rows; row++) {
        unsigned long long i = (unsigned long long)row * C + c;
        float g = dout[i];
        dw += g * ((inp[i] - mean[row]) * rstd[row]);
        db += g;
    }
    dweight[c] += dw;
    dbias[c] += db;
}
