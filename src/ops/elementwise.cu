// Elementwise kernels on f32 and bf16 (float.cu, prepended): f32 math, one rounding per stored
// value, no reductions, and no expression that the compiler could contract into an FMA (axpy's
// FMA is explicit, as on the CPU), so results are bitwise identical to the CPU paths in
// elementwise.rs. Grid-stride loops over 16-byte chunks with a scalar tail (map1, map2).

template <typename T> __device__ void fill(T* y, float value, unsigned n) {
    constexpr int W = Lanes<T>::N;
    T v = from_f32<T>(value);
    Chunk<T, W> c;
#pragma unroll
    for (int e = 0; e < W; ++e) c.v[e] = v;
    unsigned long long chunks = aligned16(y) ? n / W : 0;
    for (unsigned long long j = first_thread(); j < chunks; j += grid_threads()) store_chunk<T, W>(y + j * W, c);
    for (unsigned long long i = chunks * W + first_thread(); i < n; i += grid_threads()) y[i] = v;
}

extern "C" __global__ void fill_f32(float* y, float value, unsigned n) { fill(y, value, n); }
extern "C" __global__ void fill_bf16(bf16* y, float value, unsigned n) { fill(y, value, n); }

template <typename T> __device__ void add_scalar(T* y, float c, unsigned n) {
    map1<Lanes<T>::N>(y, y, n, [=](float v) { return v + c; });
}

extern "C" __global__ void add_scalar_f32(float* y, float c, unsigned n) { add_scalar(y, c, n); }
extern "C" __global__ void add_scalar_bf16(bf16* y, float c, unsigned n) { add_scalar(y, c, n); }

template <typename T> __device__ void scale(T* y, const T* x, float k, unsigned n) {
    map1<Lanes<T>::N>(y, x, n, [=](float v) { return k * v; });
}

extern "C" __global__ void scale_f32(float* y, const float* x, float k, unsigned n) { scale(y, x, k, n); }
extern "C" __global__ void scale_bf16(bf16* y, const bf16* x, float k, unsigned n) { scale(y, x, k, n); }

template <typename T> __device__ void axpy(T* y, const T* x, float a, unsigned n) {
    map2<Lanes<T>::N>(y, x, y, n, [=](float xv, float yv) { return __fmaf_rn(a, xv, yv); });
}

extern "C" __global__ void axpy_f32(float* y, const float* x, float a, unsigned n) { axpy(y, x, a, n); }
extern "C" __global__ void axpy_bf16(bf16* y, const bf16* x, float a, unsigned n) { axpy(y, x, a, n); }

template <typename T> __device__ void accumulate(T* dst, const T* src, unsigned n) {
    map2<Lanes<T>::N>(dst, dst, src, n, [](float d, float s) { return d + s; });
}

extern "C" __global__ void accumulate_f32(float* dst, const float* src, unsigned n) { accumulate(dst, src, n); }
extern "C" __global__ void accumulate_bf16(bf16* dst, const bf16* src, unsigned n) { accumulate(dst, src, n); }

// *flag = 1 if any element of x has a bit set (-0.0 and NaN included); else *flag is left as is.
template <typename Bits> __device__ void any_nonzero(unsigned* flag, const Bits* x, unsigned n) {
    bool found = false;
    for (unsigned long long i = first_thread(); i < n; i += grid_threads()) found |= x[i] != 0;
    if (found) *flag = 1u;
}

extern "C" __global__ void any_nonzero_f32(unsigned* flag, const float* x, unsigned n) {
    any_nonzero(flag, reinterpret_cast<const unsigned*>(x), n);
}
extern "C" __global__ void any_nonzero_bf16(unsigned* flag, const bf16* x, unsigned n) {
    any_nonzero(flag, reinterpret_cast<const unsigned short*>(x), n);
}

// y[r, c] = k * x[r, c] for r < rows, c < cols, with leading dimensions ld_y and ld_x.
template <typename T>
__device__ void scale_rows(T* y, const T* x, float k, unsigned rows, unsigned cols, unsigned ld_y, unsigned ld_x) {
    unsigned long long n = (unsigned long long)rows * cols;
    for (unsigned long long i = first_thread(); i < n; i += grid_threads()) {
        unsigned long long r = i / cols, c = i % cols;
        y[r * ld_y + c] = from_f32<T>(k * to_f32(x[r * ld_x + c]));
    }
}

extern "C" __global__ void scale_rows_f32(float* y, const float* x, float k, unsigned rows, unsigned cols,
                                          unsigned ld_y, unsigned ld_x) {
    scale_rows(y, x, k, rows, cols, ld_y, ld_x);
}
extern "C" __global__ void scale_rows_bf16(bf16* y, const bf16* x, float k, unsigned rows, unsigned cols,
                                           unsigned ld_y, unsigned ld_x) {
    scale_rows(y, x, k, rows, cols, ld_y, ld_x);
}
