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

// Every thread of the block calls it with its own maximum; one atomicMax per block.
__device__ __forceinline__ void block_amax(float* amax, unsigned v) {
    __shared__ unsigned warps[32];
    v = warp_max_bits(v);
    if ((threadIdx.x & 31u) == 0) warps[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < (blockDim.x + 31) / 32 ? warps[threadIdx.x] : 0u;
        v = warp_max_bits(v);
        if (threadIdx.x == 0 && v != 0) atomicMax(reinterpret_cast<unsigned*>(amax), v);
    }
}

// amax[0] = max(amax[0], max |inp|), 16-byte chunks when aligned (as map1), then the tail.
template <typename T> __device__ void amax_accumulate(float* amax, const T* inp, unsigned n) {
    constexpr int W = Lanes<T>::N;
    unsigned v = 0;
    unsigned long long chunks = aligned16(inp) ? n / W : 0;
    for (unsigned long long j = first_thread(); j < chunks; j += grid_threads()) {
        Chunk<T, W> c = load_chunk<T, W>(inp + j * W);
#pragma unroll
        for (int e = 0; e < W; ++e) v = max_bits(v, amax_bits(to_f32(c.v[e])));
    }
    for (unsigned long long i = chunks * W + first_thread(); i < n; i += grid_threads()) {
        v = max_bits(v, amax_bits(to_f32(inp[i])));
    }
    block_amax(amax, v);
}

extern "C" __global__ void amax_f32(float* amax, const float* inp, unsigned n) { amax_accumulate(amax, inp, n); }
extern "C" __global__ void amax_bf16(float* amax, const bf16* inp, unsigned n) { amax_accumulate(amax, inp, n); }
