// Dropout on f32 and bf16, compiled after float.cu and rng.cu (dropout.rs concatenates them) for
// the conversions and philox_block. Element i keeps iff random_u32(seed, site, step, i) is at
// least a threshold computed on the host, so no float rounding decides a keep; a kept value is
// x * scale in f32, rounded once. No reductions: outputs and masks are bitwise identical to the
// CPU paths in dropout.rs. A chunk is 16 bytes of T (4 f32: one Philox call; 8 bf16: two) and W
// mask bytes in one access; what is left, or everything when a pointer is not aligned, goes one
// group of four elements (one Philox call) per thread.

template <int W> struct MaskWord;
template <> struct MaskWord<4> {
    typedef unsigned type;
};
template <> struct MaskWord<8> {
    typedef unsigned long long type;
};

template <typename T>
__device__ void dropout_forward(T* out, unsigned char* mask, const T* inp, const unsigned long long* step,
                                unsigned threshold, float scale, unsigned seed, unsigned site, unsigned n) {
    constexpr int W = Lanes<T>::N;
    typedef typename MaskWord<W>::type Word;
    unsigned long long at = *step;
    bool vec = aligned16(out) && aligned16(inp) && (unsigned long long)mask % W == 0;
    unsigned long long chunks = vec ? n / W : 0;
    for (unsigned long long j = first_thread(); j < chunks; j += grid_threads()) {
        unsigned r[W];
#pragma unroll
        for (int g = 0; g < W / 4; ++g) philox_block(r + 4 * g, seed, site, at, j * (W / 4) + g);
        Chunk<T, W> x = load_chunk<T, W>(inp + j * W), y;
        Word m = 0;
#pragma unroll
        for (int e = 0; e < W; ++e) {
            bool keep = r[e] >= threshold;
            y.v[e] = from_f32<T>(keep ? to_f32(x.v[e]) * scale : 0.0f);
            m |= (Word)(keep ? 1u : 0u) << (8 * e);
        }
        store_chunk<T, W>(out + j * W, y);
        *reinterpret_cast<Word*>(mask + j * W) = m;
    }
    unsigned long long groups = ((unsigned long long)n + 3) / 4;
    for (unsigned long long g = chunks * (W / 4) + first_thread(); g < groups; g += grid_threads()) {
        unsigned r[4];
        philox_block(r, seed, site, at, g);
        for (int k = 0; k < 4; ++k) {
            unsigned long long i = g * 4 + k;
            if (i < n) {
                bool keep = r[k] >= threshold;
                out[i] = from_f32<T>(keep ? to_f32(inp[i]) * scale : 0.0f);
                mask[i] = keep ? 1 : 0;
            }
        }
    }
}

extern "C" __global__ void dropout_forward_f32(float* out, unsigned char* mask, const float* inp,
                                               const unsigned long long* step, unsigned threshold, float scale,
                                               unsigned seed, unsigned site, unsigned n) {
    dropout_forward(out, mask, inp, step, threshold, scale, seed, site, n);
}
extern "C" __global__ void dropout_forward_bf16(bf16* out, unsigned char* mask, const bf16* inp,
                                                const unsigned long long* step, unsigned threshold, float scale,
                                                unsigned seed, unsigned site, unsigned n) {
    dropout_forward(out, mask, inp, step, threshold, scale, seed, site, n);
}

template <typename T>
__device__ void dropout_backward(T* dinp, const T* dout, const unsigned char* mask, float scale, unsigned n) {
    constexpr int W = Lanes<T>::N;
    typedef typename MaskWord<W>::type Word;
    bool vec = aligned16(dinp) && aligned16(dout) && (unsigned long long)mask % W == 0;
    unsigned long long chunks = vec ? n / W : 0;
    for (unsigned long long j = first_thread(); j < chunks; j += grid_threads()) {
        Chunk<T, W> dy = load_chunk<T, W>(dout + j * W), dx;
        Word m = *reinterpret_cast<const Word*>(mask + j * W);
#pragma unroll
        for (int e = 0; e < W; ++e) {
            bool keep = ((m >> (8 * e)) & 0xffu) != 0;
            dx.v[e] = from_f32<T>(keep ? to_f32(dy.v[e]) * scale : 0.0f);
        }
        store_chunk<T, W>(dinp + j * W, dx);
    }
    for (unsigned long long i = chunks * W + first_thread(); i < n; i += grid_threads()) {
        dinp[i] = from_f32<T>(mask[i] ? to_f32(dout[i]) * scale : 0.0f);
    }
}

extern "C" __global__ void dropout_backward_f32(float* dinp, const float* dout, const unsigned char* mask,
                                                float scale, unsigned n) {
    dropout_backward(dinp, dout, mask, scale, n);
}
extern "C" __global__ void dropout_backward_bf16(bf16* dinp, const bf16* dout, const unsigned char* mask,
                                                 float scale, unsigned n) {
    dropout_backward(dinp, dout, mask, scale, n);
}
