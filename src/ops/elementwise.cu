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

// dst[c] += sum over r of src[r, c]: a bias gradient (the column sums of the output gradient)
// added to its accumulator. A block of ACC_WARPS warps takes ACC_COLS columns, two per lane, so a
// warp reads 64 consecutive elements of a row; warp w sums rows w, w + ACC_WARPS, ... in order,
// then warp 0 adds the warps' sums in warp order and rounds once: a fixed order, so results are
// bitwise identical run to run (not to the simulator's row-order sums, beyond one row).
#define ACC_COLS 64
#define ACC_WARPS 32
template <typename T> __device__ void accumulate(T* dst, const T* src, unsigned rows, unsigned cols) {
    __shared__ float part[ACC_WARPS][ACC_COLS];
    const unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned c = blockIdx.x * ACC_COLS + 2 * lane;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 4
    for (unsigned r = w; r < rows; r += ACC_WARPS) {
        const T* row = src + (unsigned long long)r * cols;
        if (c < cols) s0 += to_f32(row[c]);
        if (c + 1 < cols) s1 += to_f32(row[c + 1]);
    }
    part[w][2 * lane] = s0;
    part[w][2 * lane + 1] = s1;
    __syncthreads();
    if (w != 0) return;
    for (unsigned j = 0; j < 2; j++) {
        float s = 0.0f;
        for (unsigned k = 0; k < ACC_WARPS; k++) s += part[k][2 * lane + j];
        if (c + j < cols) dst[c + j] = from_f32<T>(to_f32(dst[c + j]) + s);
    }
}

extern "C" __global__ void accumulate_f32(float* dst, const float* src, unsigned rows, unsigned cols) {
    accumulate(dst, src, rows, cols);
}
extern "C" __global__ void accumulate_bf16(bf16* dst, const bf16* src, unsigned rows, unsigned cols) {
    accumulate(dst, src, rows, cols);
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
