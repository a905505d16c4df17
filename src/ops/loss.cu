// Cross-entropy over logits (N, V) of f32 or bf16 (float.cu, prepended), in f32. One block of
// CE_THREADS threads per row: thread j visits columns j, j + CE_THREADS, ... in order, then the
// block combines the per-thread values by a shared-memory tree in a fixed pairing. No atomics, so results are bitwise reproducible run to
// run (they differ from the CPU path in rounding: expf/logf and the summation order differ).
// Launch with blockDim.x == CE_THREADS (loss.rs: THREADS).

#define CE_THREADS 256

// Combines red[0..CE_THREADS) into red[0] with max (is_max) or +; every thread gets the result.
__device__ __forceinline__ float ce_block_reduce(float* red, float value, bool is_max) {
    unsigned tid = threadIdx.x;
    red[tid] = value;
    __syncthreads();
    for (unsigned s = CE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = is_max ? fmaxf(red[tid], red[tid + s]) : red[tid] + red[tid + s];
        __syncthreads();
    }
    float result = red[0];
    __syncthreads();  // red is reused by the next reduction
    return result;
}

// losses[row] = log(sum_j exp(x_j - max)) - (x_target - max); probs[row, j] = softmax, in f32
// whatever the logits' type (T, widened exactly). A target not below v gets a NaN loss (a kernel
// cannot fail; the CPU path does).
template <typename T>
__device__ void cross_entropy_forward(float* losses, float* probs, const T* logits, const unsigned* targets,
                                      unsigned v) {
    __shared__ float red[CE_THREADS];
    unsigned long long row = blockIdx.x;
    const T* x = logits + row * v;
    float* p = probs + row * v;
    float m = __int_as_float(0xff800000);  // -inf
    for (unsigned j = threadIdx.x; j < v; j += CE_THREADS) m = fmaxf(m, to_f32(x[j]));
    m = ce_block_reduce(red, m, true);
    float sum = 0.0f;
    for (unsigned j = threadIdx.x; j < v; j += CE_THREADS) sum += expf(to_f32(x[j]) - m);
    sum = ce_block_reduce(red, sum, false);
    float inv = 1.0f / sum;
    for (unsigned j = threadIdx.x; j < v; j += CE_THREADS) p[j] = expf(to_f32(x[j]) - m) * inv;
    if (threadIdx.x == 0) {
        unsigned t = targets[row];
        losses[row] = t < v ? logf(sum) - (to_f32(x[t]) - m) : __int_as_float(0x7fc00000);
    }
}

extern "C" __global__ void cross_entropy_forward_f32(float* losses, float* probs, const float* logits,
                                                     const unsigned* targets, unsigned v) {
    cross_entropy_forward(losses, probs, logits, targets, v);
}
extern "C" __global__ void cross_entropy_forward_bf16(float* losses, float* probs, const bf16* logits,
                                                      const unsigned* targets, unsigned v) {
    cross_entropy_forward(losses, probs, logits, targets, v);
}

// dlogits[row, j] = (probs[row, j] - [j == target]) * dlosses[row] in f32, rounded once to T;
// elementwise, so bitwise equal to the CPU path. A target not below v subtracts no one-hot term.
template <typename T>
__device__ void cross_entropy_backward(T* dlogits, const float* probs, const unsigned* targets, const float* dlosses,
                                       unsigned v) {
    unsigned long long row = blockIdx.x;
    unsigned t = targets[row];
    float dl = dlosses[row];
    for (unsigned j = threadIdx.x; j < v; j += CE_THREADS) {
        float onehot = j == t ? 1.0f : 0.0f;
        dlogits[row * v + j] = from_f32<T>((probs[row * v + j] - onehot) * dl);
    }
}

extern "C" __global__ void cross_entropy_backward_f32(float* dlogits, const float* probs, const unsigned* targets,
                                                      const float* dlosses, unsigned v) {
    cross_entropy_backward(dlogits, probs, targets, dlosses, v);
}
extern "C" __global__ void cross_entropy_backward_bf16(bf16* dlogits, const float* probs, const unsigned* targets,
                                                       const float* dlosses, unsigned v) {
    cross_entropy_backward(dlogits, probs, targets, dlosses, v);
}
