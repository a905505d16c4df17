// LayerNorm over the last dimension of a row-major (rows, C) matrix, f32 with f32 statistics.
// The CPU paths in layernorm.rs compute the same formulas with sequential sums.
//
// Launch contract: the per-row kernels run one block of exactly ROW_BLOCK threads per row (the
// shared arrays and the strides below assume it); the parameter kernel runs one thread per column.
//
// Determinism: no atomics anywhere. Per-row sums use reduce.cu's fixed-order block reductions
// (prepended to this source). In the parameter kernel each thread sums its column over rows
// 0, 1, 2, ... in order. So every sum has one fixed order of additions and the results are
// bitwise identical run to run.

// out = (inp - mean) * rstd * weight + bias per row; saves mean and rstd = 1 / sqrt(var + eps).
// Two passes over the row (mean, then the centered variance) for accuracy.
extern "C" __global__ void layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp,
                                                 const float* weight, const float* bias, float eps,
                                                 unsigned rows, unsigned C) {
    __shared__ float buf[ROW_BLOCK];
    unsigned row = blockIdx.x;
    if (row >= rows) return;  // uniform over the block, so no thread misses a barrier
    const float* x = inp + (unsigned long long)row * C;
    float* y = out + (unsigned long long)row * C;

    float sum = 0.0f;
    for (unsigned c = threadIdx.x; c < C; c += ROW_BLOCK) sum += x[c];
    float m = block_sum(sum, buf) / (float)C;

    float sq = 0.0f;
    for (unsigned c = threadIdx.x; c < C; c += ROW_BLOCK) {
        float d = x[c] - m;
        sq += d * d;
    }
    float r = 1.0f / sqrtf(block_sum(sq, buf) / (float)C + eps);

    for (unsigned c = threadIdx.x; c < C; c += ROW_BLOCK) y[c] = (x[c] - m) * r * weight[c] + bias[c];
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
    __shared__ float buf[ROW_BLOCK];
    unsigned row = blockIdx.x;
    if (row >= rows) return;  // uniform over the block
    unsigned long long at = (unsigned long long)row * C;
    const float* x = inp + at;
    const float* g = dout + at;
    float* dx = dinp + at;
    float m = mean[row], r = rstd[row];

    float dn_sum = 0.0f, dnn_sum = 0.0f;
    for (unsigned c = threadIdx.x; c < C; c += ROW_BLOCK) {
        float norm = (x[c] - m) * r;
        float dn = g[c] * weight[c];
        dn_sum += dn;
        dnn_sum += dn * norm;
    }
    float dn_mean = block_sum(dn_sum, buf) / (float)C;
    float dnn_mean = block_sum(dnn_sum, buf) / (float)C;

    for (unsigned c = threadIdx.x; c < C; c += ROW_BLOCK) {
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
