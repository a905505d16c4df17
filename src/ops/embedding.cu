// Token + position embedding on f32 or bf16 tables (float.cu, prepended). Every output element is
// written by one thread with a fixed summation order in f32 and no atomics, and rounded once, so
// results are bitwise equal to the CPU paths in embedding.rs (plain float adds in the same order;
// nothing to contract into an FMA). Tokens not below v are skipped: a zero token embedding
// forward, no gradient backward.

// out[b, t, c] = wte[tokens[b, t], c] + wpe[t, c]; 16-byte chunks of a row when C is a multiple of
// a chunk and the pointers are aligned, else (and for a tail) one element per thread.
template <typename T>
__device__ void embedding_forward(T* out, const unsigned* tokens, const T* wte, const T* wpe, unsigned n,
                                  unsigned t_len, unsigned c_len, unsigned v) {
    constexpr int W = Lanes<T>::N;
    bool vec = c_len % W == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe);
    unsigned long long chunks = vec ? n / W : 0;
    for (unsigned long long j = first_thread(); j < chunks; j += grid_threads()) {
        unsigned long long i = j * W, bt = i / c_len, c = i % c_len, t = bt % t_len;
        unsigned tok = tokens[bt];
        Chunk<T, W> pos = load_chunk<T, W>(wpe + t * c_len + c), y = pos;
        if (tok < v) {
            Chunk<T, W> e = load_chunk<T, W>(wte + (unsigned long long)tok * c_len + c);
#pragma unroll
            for (int k = 0; k < W; ++k) y.v[k] = from_f32<T>(to_f32(e.v[k]) + to_f32(pos.v[k]));
        }
        store_chunk<T, W>(out + i, y);
    }
    for (unsigned long long i = chunks * W + first_thread(); i < n; i += grid_threads()) {
        unsigned long long bt = i / c_len, c = i % c_len, t = bt % t_len;
        unsigned tok = tokens[bt];
        T pos = wpe[t * c_len + c];
        out[i] = tok < v ? from_f32<T>(to_f32(wte[(unsigned long long)tok * c_len + c]) + to_f32(pos)) : pos;
    }
}

extern "C" __global__ void embedding_forward_f32(float* out, const unsigned* tokens, const float* wte,
                                                 const float* wpe, unsigned n, unsigned t_len, unsigned c_len,
                                                 unsigned v) {
    embedding_forward(out, tokens, wte, wpe, n, t_len, c_len, v);
}
extern "C" __global__ void embedding_forward_bf16(bf16* out, const unsigned* tokens, const bf16* wte,
                                                  const bf16* wpe, unsigned n, unsigned t_len, unsigned c_len,
                                                  unsigned v) {
    embedding_forward(out, tokens, wte, wpe, n, t_len, c_len, v);
}

// dwte[v, c] += sum over positions p = 0, 1, ... (in order) with tokens[p] == v of dout[p, c],
// summed in f32 from 0 and added once. One thread per (v, c), each reading all positions:
// O(V·C·B·T) work, fine for small vocabularies.
template <typename T>
__device__ void embedding_backward_wte(T* dwte, const T* dout, const unsigned* tokens, unsigned vc, unsigned c_len,
                                       unsigned positions) {
    for (unsigned long long i = first_thread(); i < vc; i += grid_threads()) {
        unsigned v = i / c_len, c = i % c_len;
        float acc = 0.0f;
        for (unsigned p = 0; p < positions; ++p) {
            if (tokens[p] == v) acc += to_f32(dout[(unsigned long long)p * c_len + c]);
        }
        dwte[i] = from_f32<T>(to_f32(dwte[i]) + acc);
    }
}

extern "C" __global__ void embedding_backward_wte_f32(float* dwte, const float* dout, const unsigned* tokens,
                                                      unsigned vc, unsigned c_len, unsigned positions) {
    embedding_backward_wte(dwte, dout, tokens, vc, c_len, positions);
}
extern "C" __global__ void embedding_backward_wte_bf16(bf16* dwte, const bf16* dout, const unsigned* tokens,
                                                       unsigned vc, unsigned c_len, unsigned positions) {
    embedding_backward_wte(dwte, dout, tokens, vc, c_len, positions);
}

// dwpe[t, c] += sum over b = 0, 1, ... (in order) of dout[b, t, c], summed in f32 from 0 and
// added once; one thread per (t, c).
template <typename T> __device__ void embedding_backward_wpe(T* dwpe, const T* dout, unsigned tc, unsigned batch) {
    for (unsigned long long i = first_thread(); i < tc; i += grid_threads()) {
        float acc = 0.0f;
        for (unsigned b = 0; b < batch; ++b) acc += to_f32(dout[(unsigned long long)b * tc + i]);
        dwpe[i] = from_f32<T>(to_f32(dwpe[i]) + acc);
    }
}

extern "C" __global__ void embedding_backward_wpe_f32(float* dwpe, const float* dout, unsigned tc, unsigned batch) {
    embedding_backward_wpe(dwpe, dout, tc, batch);
}
extern "C" __global__ void embedding_backward_wpe_bf16(bf16* dwpe, const bf16* dout, unsigned tc, unsigned batch) {
    embedding_backward_wpe(dwpe, dout, tc, batch);
}
