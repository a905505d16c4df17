// Element types, conversions and 16-byte chunks shared by the kernels that run in f32 or bf16
// (prepended to their sources). Each kernel is one template over its element type T, computes in
// f32 and rounds once per stored value, as the CPU paths do through `Float`.
//
// bf16 is handled as its bits (NVRTC has no cuda_bf16.h without the toolkit's headers), and the
// conversions do the integer operations of half::bf16, so a value a kernel stores is bitwise the
// CPU path's `Float::from_f32` of the same f32.

struct __align__(2) bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_f32(float x) { return x; }

// Exact; NaNs get the quiet bit, as half::bf16::to_f32.
__device__ __forceinline__ float to_f32(bf16 x) {
    unsigned h = x.bits;
    return __uint_as_float(((h & 0x7fffu) > 0x7f80u ? (h | 0x0040u) : h) << 16);
}

template <typename T> __device__ __forceinline__ T from_f32(float x);

template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }

// Round to nearest, ties to even; NaNs stay NaN (quiet bit set), as half::bf16::from_f32.
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    unsigned u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        // Round up when the dropped half is above 0x8000, or exactly 0x8000 with an odd result.
        bool up = (u & 0x8000u) != 0 && (u & 0x17fffu) != 0;
        r.bits = (unsigned short)((u >> 16) + (up ? 1u : 0u));
    }
    return r;
}

// Elements of T in one 16-byte access: 4 f32 or 8 bf16.
template <typename T> struct Lanes {
    static constexpr int N = 16 / sizeof(T);
};

// 16 bytes of elements to and from one uint4, by bit operations: a chunk is read from memory as
// uint4 and its elements taken apart in registers (no type punning of local objects).
__device__ __forceinline__ void unpack(uint4 u, float* out) {
    out[0] = __uint_as_float(u.x);
    out[1] = __uint_as_float(u.y);
    out[2] = __uint_as_float(u.z);
    out[3] = __uint_as_float(u.w);
}

__device__ __forceinline__ void unpack(uint4 u, bf16* out) {
    unsigned words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        out[2 * q].bits = (unsigned short)(words[q] & 0xffffu);
        out[2 * q + 1].bits = (unsigned short)(words[q] >> 16);
    }
}

__device__ __forceinline__ uint4 pack(const float* in) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]), __float_as_uint(in[3]));
}

__device__ __forceinline__ uint4 pack(const bf16* in) {
    unsigned words[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) words[q] = (unsigned)in[2 * q].bits | ((unsigned)in[2 * q + 1].bits << 16);
    return make_uint4(words[0], words[1], words[2], words[3]);
}

// W elements of T moved by 16-byte accesses (W·sizeof(T) a multiple of 16; p 16-byte aligned).
template <typename T, int W> struct Chunk {
    T v[W];
};

template <typename T, int W> __device__ __forceinline__ Chunk<T, W> load_chunk(const T* p) {
    static_assert(W * sizeof(T) % 16 == 0, "a chunk is whole 16-byte accesses");
    constexpr int PER = 16 / sizeof(T);
    Chunk<T, W> c;
#pragma unroll
    for (int q = 0; q < W / PER; ++q) unpack(reinterpret_cast<const uint4*>(p)[q], c.v + q * PER);
    return c;
}

// A chunk as loaded, its 16-byte words not yet taken apart: what a thread holds while its other
// loads are in flight. A bf16 chunk of 8 is 4 registers so, against 8 once unpacked, which is
// what lets map1 and map2 keep UNROLL chunks in flight at 4 blocks of 256 threads per SM.
template <typename T, int W> struct Raw {
    uint4 q[W * sizeof(T) / 16];
};

template <typename T, int W> __device__ __forceinline__ Raw<T, W> load_raw(const T* p) {
    static_assert(W * sizeof(T) % 16 == 0, "a chunk is whole 16-byte accesses");
    Raw<T, W> r;
#pragma unroll
    for (int q = 0; q < W * (int)sizeof(T) / 16; ++q) r.q[q] = reinterpret_cast<const uint4*>(p)[q];
    return r;
}

template <typename T, int W> __device__ __forceinline__ Chunk<T, W> unpack_raw(const Raw<T, W>& r) {
    constexpr int PER = 16 / sizeof(T);
    Chunk<T, W> c;
#pragma unroll
    for (int q = 0; q < W / PER; ++q) unpack(r.q[q], c.v + q * PER);
    return c;
}

template <typename T, int W> __device__ __forceinline__ void store_chunk(T* p, const Chunk<T, W>& c) {
    static_assert(W * sizeof(T) % 16 == 0, "a chunk is whole 16-byte accesses");
    constexpr int PER = 16 / sizeof(T);
#pragma unroll
    for (int q = 0; q < W / PER; ++q) reinterpret_cast<uint4*>(p)[q] = pack(c.v + q * PER);
}

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15u) == 0; }

// Column c of a row-major [rows, C] f32 matrix summed in row order from 0: the one order of the
// column-sum kernels (a thread per column), which ops::column_sums repeats on the CPU. The
// unrolled loop issues its loads ahead of the additions, which keep their order.
__device__ __forceinline__ float column_sum(const float* x, unsigned rows, unsigned C, unsigned c) {
    float sum = 0.0f;
#pragma unroll 16
    for (unsigned r = 0; r < rows; ++r) sum += x[(unsigned long long)r * C + c];
    return sum;
}

// Grid-stride loops: grids are sized for the GPU's SMs (ops/mod.rs: stride_dims), not the data.
__device__ __forceinline__ unsigned long long first_thread() {
    return (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ unsigned long long grid_threads() {
    return (unsigned long long)gridDim.x * blockDim.x;
}

// Chunks a thread moves per trip of a grid-stride loop: their loads are all issued before the
// first store, so that enough bytes are in flight to keep HBM busy (one chunk per trip kept a
// memory-bound kernel near a third of the H200's bandwidth).
constexpr int UNROLL = 4;

// y[i] = f(x[i]) for i < n, in f32, rounded once to Y: chunks of W elements by 16-byte accesses
// when both pointers are 16-byte aligned, UNROLL chunks per trip, then the tail one element at a
// time (everything, when they are not). Every way computes each element alike, so the result
// does not depend on it.
template <int W, typename Y, typename X, typename F>
__device__ __forceinline__ void map1(Y* y, const X* x, unsigned long long n, F f) {
    unsigned long long chunks = aligned16(y) && aligned16(x) ? n / W : 0;
    const unsigned long long step = grid_threads();
    for (unsigned long long j = first_thread(); j < chunks; j += UNROLL * step) {
        Raw<X, W> a[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (j + u * step < chunks) a[u] = load_raw<X, W>(x + (j + u * step) * W);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (j + u * step >= chunks) break;
            const Chunk<X, W> xs = unpack_raw(a[u]);
            Chunk<Y, W> r;
#pragma unroll
            for (int e = 0; e < W; ++e) r.v[e] = from_f32<Y>(f(to_f32(xs.v[e])));
            store_chunk<Y, W>(y + (j + u * step) * W, r);
        }
    }
    for (unsigned long long i = chunks * W + first_thread(); i < n; i += step) {
        y[i] = from_f32<Y>(f(to_f32(x[i])));
    }
}

// y[i] = f(a[i], b[i]) for i < n, as map1.
template <int W, typename Y, typename A, typename B, typename F>
__device__ __forceinline__ void map2(Y* y, const A* a, const B* b, unsigned long long n, F f) {
    unsigned long long chunks = aligned16(y) && aligned16(a) && aligned16(b) ? n / W : 0;
    const unsigned long long step = grid_threads();
    for (unsigned long long j = first_thread(); j < chunks; j += UNROLL * step) {
        Raw<A, W> ra[UNROLL];
        Raw<B, W> rb[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (j + u * step < chunks) {
                ra[u] = load_raw<A, W>(a + (j + u * step) * W);
                rb[u] = load_raw<B, W>(b + (j + u * step) * W);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (j + u * step >= chunks) break;
            const Chunk<A, W> as = unpack_raw(ra[u]);
            const Chunk<B, W> bs = unpack_raw(rb[u]);
            Chunk<Y, W> r;
#pragma unroll
            for (int e = 0; e < W; ++e) r.v[e] = from_f32<Y>(f(to_f32(as.v[e]), to_f32(bs.v[e])));
            store_chunk<Y, W>(y + (j + u * step) * W, r);
        }
    }
    for (unsigned long long i = chunks * W + first_thread(); i < n; i += step) {
        y[i] = from_f32<Y>(f(to_f32(a[i]), to_f32(b[i])));
    }
}
