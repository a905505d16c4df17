// amax = max |x| over a tensor, accumulated into one f32 in device memory (after float.cu and
// fp8.cu). Note [Amax as integer bits]: the magnitude's bits, every NaN made 0x7fffffff, order
// as unsigned integers exactly as the magnitudes do, with NaN above +inf; so the amax is an
// integer max (NaN kept: CUDA's fmaxf would drop it) and the blocks combine by atomicMax on the
// f32's bits. Max does not depend on the order, so the result is deterministic; the CPU path in
// amax.rs does the same integer max.

__device__ __forceinline__ unsigned amax_bits(float x) {
    unsigned a = __float_as_uint(x) & 0x7fffffffu;
    return a > 0x7f800000u ? 0x7fffffffu : a;
}

__device__ __forceinline__ unsigned max_bits(unsigned a, unsigned b) { return a > b ? a : b; }

__device__ __forceinline__ unsigned warp_max_bits(unsigned v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max_bits(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Every thread of the block calls it with its own maximum; thread 0 gets the block's.
__device__ __forceinline__ unsigned block_max_bits(unsigned v) {
    __shared__ unsigned warps[32];
    v = warp_max_bits(v);
    if ((threadIdx.x & 31u) == 0) warps[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < (blockDim.x + 31) / 32 ? warps[threadIdx.x] : 0u;
        v = warp_max_bits(v);
    }
    return v;
}

// As block_max_bits, folded into amax[0]: one atomicMax per block.
__device__ __forceinline__ void block_amax(float* amax, unsigned v) {
    v = block_max_bits(v);
    if (threadIdx.x == 0 && v != 0) atomicMax(reinterpret_cast<unsigned*>(amax), v);
}

// This thread's share of max |inp| as amax bits: 16-byte chunks when aligned, then the tail. (One
// chunk per trip: keeping four in flight, as map1 does, was no faster here, 2.0–2.5 TB/s on an
// H100 either way, `…-h100-fp8-current-measure-*.txt`.)
template <typename T> __device__ __forceinline__ unsigned thread_amax(const T* inp, unsigned n) {
    constexpr int W = Lanes<T>::N;
    unsigned v = 0;
    const unsigned long long chunks = aligned16(inp) ? n / W : 0, step = grid_threads();
    for (unsigned long long j = first_thread(); j < chunks; j += step) {
        const Chunk<T, W> c = load_chunk<T, W>(inp + j * W);
#pragma unroll
        for (int e = 0; e < W; ++e) v = max_bits(v, amax_bits(to_f32(c.v[e])));
    }
    for (unsigned long long i = chunks * W + first_thread(); i < n; i += step) {
        v = max_bits(v, amax_bits(to_f32(inp[i])));
    }
    return v;
}

extern "C" __global__ void amax_f32(float* amax, const float* inp, unsigned n) { block_amax(amax, thread_amax(inp, n)); }
extern "C" __global__ void amax_bf16(float* amax, const bf16* inp, unsigned n) { block_amax(amax, thread_amax(inp, n)); }
