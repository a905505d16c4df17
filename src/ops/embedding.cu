// Token + position embedding. Every output element is written by one thread with a fixed
// summation order and no atomics, so results are bitwise equal to the CPU paths in
// embedding.rs (plain float adds in the same order; nothing to contract into an FMA).
// Tokens not below v are skipped: a zero token embedding forward, no gradient backward.

// out[b, t, c] = wte[tokens[b, t], c] + wpe[t, c]; one thread per output element.
extern "C" __global__ void embedding_forward_f32(float* out, const unsigned* tokens,
                                                 const float* wte, const float* wpe,
                                                 unsigned n, unsigned t_len, unsigned c_len,
                                                 unsigned v) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned bt = i / c_len, c = i % c_len, t = bt % t_len;
    unsigned tok = tokens[bt];
    float pos = wpe[t * c_len + c];
    out[i] = tok < v ? wte[tok * c_len + c] + pos : pos;
}

// dwte[v, c] += sum over positions p = 0, 1, ... (in order) with tokens[p] == v of dout[p, c].
// One thread per (v, c), each reading all positions: O(V·C·B·T) work, fine for small vocabularies.
extern "C" __global__ void embedding_backward_wte_f32(float* dwte, const float* dout,
                                                      const unsigned* tokens, unsigned vc,
                                                      unsigned c_len, unsigned positions) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vc) return;
    unsigned v = i / c_len, c = i % c_len;
    float acc = 0.0f;
    for (unsigned p = 0; p < positions; ++p) {
        if (tokens[p] == v) acc += dout[(unsigned long long)p * c_len + c];
    }
    dwte[i] = dwte[i] + acc;
}

// dwpe[t, c] += sum over b = 0, 1, ... (in order) of dout[b, t, c]; one thread per (t, c).
extern "C" __global__ void embedding_backward_wpe_f32(float* dwpe, const float* dout,
                                                      unsigned tc, unsigned batch) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tc) return;
    float acc = 0.0f;
    for (unsigned b = 0; b < batch; ++b) acc += dout[(unsigned long long)b * tc + i];
    dwpe[i] = dwpe[i] + acc;
}
