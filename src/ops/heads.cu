// Moving attention heads between the row-major (B*T, P*C) activations of the projections, where
// head h of block p is columns p*C + h*hd .. p*C + (h+1)*hd, and the contiguous (B, H, T, hd)
// layout that lets one strided-batched GEMM cover every (batch element, head) pair. Compiled
// after float.cu. Pure permutations of f32 or bf16 values, no arithmetic on them, so both
// devices agree bitwise. Each thread moves 16 bytes at a time (a chunk of one head's row) when hd
// and the leading dimension are multiples of a chunk and the pointers are 16-byte aligned, else
// one element at a time.
//
// The element type is E here: the entry points have a parameter named T (the sequence length).

// The offset in the row layout (leading dimension ld) of element i of a (B, H, T, hd) tensor.
__device__ __forceinline__ unsigned long long row_index(unsigned long long i, unsigned H, unsigned T, unsigned hd,
                                                        unsigned long long ld) {
    unsigned d = i % hd;
    unsigned t = (i / hd) % T;
    unsigned h = (i / ((unsigned long long)hd * T)) % H;
    unsigned long long b = i / ((unsigned long long)hd * T * H);
    return (b * T + t) * ld + (unsigned long long)h * hd + d;
}

template <int W> struct Width {};

// Copies W elements: one element, or whole 16-byte chunks.
template <typename E, int W> __device__ __forceinline__ void copy_elems(Width<W>, E* dst, const E* src) {
    if constexpr (W == 1) {
        *dst = *src;
    } else {
        store_chunk<E, W>(dst, load_chunk<E, W>(src));
    }
}

// Calls f(width, i, r) for the pieces of a (B, H, T, hd) tensor of n elements: i the index of the
// piece's first element, r its offset in the row layout; pieces of a chunk when vec, else of one.
template <typename E, typename F>
__device__ __forceinline__ void for_pieces(bool vec, unsigned long long n, unsigned H, unsigned T, unsigned hd,
                                           unsigned long long ld, F f) {
    constexpr int W = Lanes<E>::N;
    if (vec) {
        for (unsigned long long j = first_thread(); j < n / W; j += grid_threads()) {
            f(Width<W>(), j * W, row_index(j * W, H, T, hd, ld));
        }
    } else {
        for (unsigned long long i = first_thread(); i < n; i += grid_threads()) f(Width<1>(), i, row_index(i, H, T, hd, ld));
    }
}

template <typename E> __device__ __forceinline__ bool chunked(unsigned hd, unsigned long long ld) {
    return hd % Lanes<E>::N == 0 && ld % Lanes<E>::N == 0;
}

// dst[b, h, t, d] = src[(b*T + t)*ld + h*hd + d], src pointing at column block p.
template <typename E>
__device__ void heads_from_rows(E* dst, const E* src, unsigned B, unsigned H, unsigned T, unsigned hd, unsigned ld) {
    bool vec = chunked<E>(hd, ld) && aligned16(dst) && aligned16(src);
    for_pieces<E>(vec, (unsigned long long)B * H * T * hd, H, T, hd, ld,
                  [&](auto w, unsigned long long i, unsigned long long r) { copy_elems(w, dst + i, src + r); });
}

extern "C" __global__ void heads_from_rows_f32(float* dst, const float* src, unsigned B, unsigned H, unsigned T,
                                               unsigned hd, unsigned ld) {
    heads_from_rows(dst, src, B, H, T, hd, ld);
}
extern "C" __global__ void heads_from_rows_bf16(bf16* dst, const bf16* src, unsigned B, unsigned H, unsigned T,
                                                unsigned hd, unsigned ld) {
    heads_from_rows(dst, src, B, H, T, hd, ld);
}

// dst[(b*T + t)*ld + h*hd + d] = src[b, h, t, d], dst pointing at column block p.
template <typename E>
__device__ void rows_from_heads(E* dst, const E* src, unsigned B, unsigned H, unsigned T, unsigned hd, unsigned ld) {
    bool vec = chunked<E>(hd, ld) && aligned16(dst) && aligned16(src);
    for_pieces<E>(vec, (unsigned long long)B * H * T * hd, H, T, hd, ld,
                  [&](auto w, unsigned long long i, unsigned long long r) { copy_elems(w, dst + r, src + i); });
}

extern "C" __global__ void rows_from_heads_f32(float* dst, const float* src, unsigned B, unsigned H, unsigned T,
                                               unsigned hd, unsigned ld) {
    rows_from_heads(dst, src, B, H, T, hd, ld);
}
extern "C" __global__ void rows_from_heads_bf16(bf16* dst, const bf16* src, unsigned B, unsigned H, unsigned T,
                                                unsigned hd, unsigned ld) {
    rows_from_heads(dst, src, B, H, T, hd, ld);
}

// q, k, v (each (B, H, T, hd)) = blocks 0, 1, 2 of qkv (B*T, 3C), C = H*hd, in one pass.
template <typename E>
__device__ void split_qkv(E* q, E* k, E* v, const E* qkv, unsigned B, unsigned H, unsigned T, unsigned hd) {
    unsigned long long c = (unsigned long long)H * hd;
    bool vec = chunked<E>(hd, 3 * c) && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(qkv);
    for_pieces<E>(vec, (unsigned long long)B * H * T * hd, H, T, hd, 3 * c,
                  [&](auto w, unsigned long long i, unsigned long long r) {
                      copy_elems(w, q + i, qkv + r);
                      copy_elems(w, k + i, qkv + r + c);
                      copy_elems(w, v + i, qkv + r + 2 * c);
                  });
}

extern "C" __global__ void split_qkv_f32(float* q, float* k, float* v, const float* qkv, unsigned B, unsigned H,
                                         unsigned T, unsigned hd) {
    split_qkv(q, k, v, qkv, B, H, T, hd);
}
extern "C" __global__ void split_qkv_bf16(bf16* q, bf16* k, bf16* v, const bf16* qkv, unsigned B, unsigned H,
                                          unsigned T, unsigned hd) {
    split_qkv(q, k, v, qkv, B, H, T, hd);
}

// dqkv (B*T, 3C) = [dq | dk | dv] (each (B, H, T, hd)) in one pass: every element written once.
template <typename E>
__device__ void merge_qkv(E* dqkv, const E* dq, const E* dk, const E* dv, unsigned B, unsigned H, unsigned T,
                          unsigned hd) {
    unsigned long long c = (unsigned long long)H * hd;
    bool vec = chunked<E>(hd, 3 * c) && aligned16(dqkv) && aligned16(dq) && aligned16(dk) && aligned16(dv);
    for_pieces<E>(vec, (unsigned long long)B * H * T * hd, H, T, hd, 3 * c,
                  [&](auto w, unsigned long long i, unsigned long long r) {
                      copy_elems(w, dqkv + r, dq + i);
                      copy_elems(w, dqkv + r + c, dk + i);
                      copy_elems(w, dqkv + r + 2 * c, dv + i);
                  });
}

extern "C" __global__ void merge_qkv_f32(float* dqkv, const float* dq, const float* dk, const float* dv, unsigned B,
                                         unsigned H, unsigned T, unsigned hd) {
    merge_qkv(dqkv, dq, dk, dv, B, H, T, hd);
}
extern "C" __global__ void merge_qkv_bf16(bf16* dqkv, const bf16* dq, const bf16* dk, const bf16* dv, unsigned B,
                                          unsigned H, unsigned T, unsigned hd) {
    merge_qkv(dqkv, dq, dk, dv, B, H, T, hd);
}
