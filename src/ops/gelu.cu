// GELU, tanh approximation (PyTorch's gelu(approximate='tanh')), on f32 (and bf16 where noted),
// after gelu_math.cu's gelu and gelu_grad; the CPU paths in gelu.rs use the same formulas.
//
// Determinism: the elementwise kernels have no reductions. column_sum_add_f32 runs one thread per
// column that sums its rows 0, 1, 2, ... in order and adds the total once, without atomics, so
// every result has one fixed order of additions.

// 16-byte accesses in a grid-stride loop (map1), as gelu_backward.
template <typename T> __device__ void gelu_forward(T* out, const T* inp, unsigned n) {
    map1<Lanes<T>::N>(out, inp, n, [](float x) { return gelu(x); });
}

extern "C" __global__ void gelu_forward_f32(float* out, const float* inp, unsigned n) { gelu_forward(out, inp, n); }

// In bf16: the MLP's activation recomputed from its saved pre-activation (nn::Recompute::Gelu).
extern "C" __global__ void gelu_forward_bf16(bf16* out, const bf16* inp, unsigned n) { gelu_forward(out, inp, n); }

// 16-byte accesses in a grid-stride loop (map2): one element per thread moved 2-byte accesses of
// bf16 at a third of HBM's rate.
template <typename T> __device__ void gelu_backward(T* dinp, const T* inp, const T* dout, unsigned n) {
    map2<Lanes<T>::N>(dinp, inp, dout, n, [](float x, float d) { return gelu_grad(x) * d; });
}

extern "C" __global__ void gelu_backward_f32(float* dinp, const float* inp, const float* dout, unsigned n) {
    gelu_backward(dinp, inp, dout, n);
}

// In bf16: the product of the widened values, rounded once (the FP8 data gradient through a GELU,
// whose FP8 GEMM runs faster without cuBLASLt's DGELU epilogue).
extern "C" __global__ void gelu_backward_bf16(bf16* dinp, const bf16* inp, const bf16* dout, unsigned n) {
    gelu_backward(dinp, inp, dout, n);
}

// out[r, c] = gelu(inp[r, c] + bias[c]) over n = rows * C elements.
extern "C" __global__ void bias_gelu_forward_f32(float* out, const float* inp, const float* bias, unsigned n,
                                                 unsigned C) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu(inp[i] + bias[i % C]);
}

extern "C" __global__ void bias_gelu_backward_f32(float* dinp, const float* inp, const float* bias,
                                                  const float* dout, unsigned n, unsigned C) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dinp[i] = gelu_grad(inp[i] + bias[i % C]) * dout[i];
}

// acc[c] += sum over rows of x[r, c]: one thread per column, rows in index order.
extern "C" __global__ void column_sum_add_f32(float* acc, const float* x, unsigned rows, unsigned C) {
    unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    acc[c] += column_sum(x, rows, C, c);
}
