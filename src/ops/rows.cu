// Row kernels' shared device code (prepended to layernorm.cu and softmax.cu): bf16 as its bits,
// 16-byte vector accesses, and reductions over a row group.
//
// A row group is G consecutive threads of a block (G a power of two, 32 <= G <= 1024, dividing
// blockDim.x) that share one row. Thread t of a group holds the row's chunks t, t + G, t + 2G, ...
// of W consecutive elements: W = 16 bytes of the element type where the row length and the
// pointers allow, else W = 1. So a warp's accesses are consecutive, and each chunk is one 16-byte
// load or store.
//
// Determinism: no atomics in the reductions. A thread combines its own values in index order; a
// warp combines its 32 partial results by a butterfly of shuffles (at each step lane l adds lane
// l ^ o, and since a + b == b + a every lane holds the same bits); the warps of a group combine in
// warp order through shared memory. Every sum has one order of additions, fixed by the launch
// shape, so the results are bitwise identical run to run. (A maximum is exact in any order.)

// bf16 as its bits: NVRTC compiles without headers, so there is no __nv_bfloat16.
typedef unsigned short bf16;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __uint_as_float((unsigned)v << 16); }

template <typename T> __device__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
// Round to nearest, ties to even; NaNs stay NaN (quiet bit set): half::bf16::from_f32's rules.
template <> __device__ __forceinline__ bf16 from_float<bf16>(float v) {
    unsigned x = __float_as_uint(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (bf16)((x >> 16) | 0x0040u);
    bool up = (x & 0x8000u) != 0 && (x & 0x17fffu) != 0;  // above half an ulp, or a tie to odd
    return (bf16)((x >> 16) + (up ? 1u : 0u));
}

// Elements per 16-byte access.
template <typename T> struct Vec { static constexpr int W = 16 / sizeof(T); };

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// Whether rows of n elements at these pointers can be accessed in 16-byte chunks: n a multiple of
// the chunk and every pointer 16-byte aligned (a row's start is then aligned too).
template <typename T> __device__ bool vectorizable(unsigned n, const void* a, const void* b, const void* c = 0,
                                                   const void* d = 0, const void* e = 0) {
    return n % Vec<T>::W == 0 && aligned16(a) && aligned16(b) && aligned16(c) && aligned16(d) && aligned16(e);
}

// W elements of T as stored: one 16-byte chunk when W > 1, else one element. A kernel loads a
// row's chunks early (load_raw) and widens them when it needs them, so that the next row's loads
// are in flight during this row's reductions at the cost of 4 registers a chunk, not W.
template <typename T, int W> struct Raw { uint4 u; };
template <typename T> struct Raw<T, 1> { T u; };

template <typename T, int W> __device__ __forceinline__ void load_raw(const T* p, Raw<T, W>& r) {
    if constexpr (W == 1) {
        r.u = p[0];
    } else {
        r.u = *reinterpret_cast<const uint4*>(p);
    }
}

// A chunk as W floats.
template <typename T, int W> __device__ __forceinline__ void widen(const Raw<T, W>& r, float (&v)[W]) {
    if constexpr (W == 1) {
        v[0] = to_float(r.u);
    } else {
        unsigned w[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] = __uint_as_float(w[i]);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {  // little-endian: the lower half is the earlier element
                v[2 * i] = __uint_as_float(w[i] << 16);
                v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
            }
        }
    }
}

// W elements at p (16-byte aligned when W > 1) as floats.
template <typename T, int W> __device__ __forceinline__ void load(const T* p, float (&v)[W]) {
    Raw<T, W> r;
    load_raw<T, W>(p, r);
    widen<T, W>(r, v);
}

// Stores W floats at p (16-byte aligned when W > 1), each rounded once to T.
template <typename T, int W> __device__ __forceinline__ void store(T* p, const float (&v)[W]) {
    if constexpr (W == 1) {
        p[0] = from_float<T>(v[0]);
    } else {
        unsigned w[4];
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int i = 0; i < 4; i++) w[i] = __float_as_uint(v[i]);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                w[i] = (unsigned)from_float<bf16>(v[2 * i]) | ((unsigned)from_float<bf16>(v[2 * i + 1]) << 16);
            }
        }
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sums of a and b over this thread's row group of G threads, returned to all of them. Every
// thread of the block must call it the same number of times (it has barriers when G > 32). red
// holds 2 * blockDim.x / 32 floats of shared memory.
__device__ float2 group_sum2(float a, float b, unsigned G, float* red) {
    a = warp_sum(a);
    b = warp_sum(b);
    if (G == 32) return make_float2(a, b);
    unsigned warps = blockDim.x / 32, warp = threadIdx.x / 32, first = warp & ~(G / 32 - 1);
    if (threadIdx.x % 32 == 0) {
        red[warp] = a;
        red[warps + warp] = b;
    }
    __syncthreads();
    float sa = red[first], sb = red[warps + first];
    for (unsigned w = first + 1; w < first + G / 32; w++) {
        sa += red[w];
        sb += red[warps + w];
    }
    __syncthreads();  // every thread has read red before the next reduction overwrites it
    return make_float2(sa, sb);
}

__device__ float group_sum(float v, unsigned G, float* red) { return group_sum2(v, 0.0f, G, red).x; }

// The maximum of v over the row group (as group_sum2).
__device__ float group_max(float v, unsigned G, float* red) {
    v = warp_max(v);
    if (G == 32) return v;
    unsigned warp = threadIdx.x / 32, first = warp & ~(G / 32 - 1);
    if (threadIdx.x % 32 == 0) red[warp] = v;
    __syncthreads();
    float m = red[first];
    for (unsigned w = first + 1; w < first + G / 32; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}
