// FP8 scaling recipes on the device (after amax.cu), TransformerEngine's arithmetic in its order
// (Note [Scaling arithmetic] in scaling.rs): nothing is read back by the host, so the kernels run
// inside graphs and each replay uses the amaxes and scales in memory at its replay.

// The scale for an amax: scaled_max / amax (scaled_max = fp8 max · 2^-margin, computed by the
// host once), the previous scale when the amax is 0 or not finite; an infinite scale (a tiny
// amax) becomes FLT_MAX.
__device__ __forceinline__ float scale_for(float amax, float previous, float scaled_max) {
    bool finite = (__float_as_uint(amax) & 0x7f800000u) != 0x7f800000u;
    float s = finite && amax > 0.0f ? scaled_max / amax : previous;
    return (__float_as_uint(s) & 0x7fffffffu) == 0x7f800000u ? __uint_as_float(0x7f7fffffu) : s;
}

__device__ __forceinline__ void set_scale(float* scale, float* scale_inv, float s) {
    *scale = s;
    *scale_inv = canonical(1.0f / s);
}

// Delayed scaling, one block of 256 threads per tensor i: history is [len, n] (history[k·n + i]),
// row 0 the slot this step's casts accumulate into. The history rolls by one toward row 0: row
// k takes row k + 1 (k ≥ 1), row len - 1 takes row 0, and row 0 is zeroed for the next step;
// the amax is row 0 (most_recent) or the max over every row before the roll (fmaxf, which skips
// NaNs, as TransformerEngine's). In each pass of 256 rows every thread reads before any writes,
// and a pass writes only rows that later passes do not read.
extern "C" __global__ void delayed_scaling_update(float* history, float* scale, float* scale_inv, unsigned len,
                                                  unsigned n, unsigned most_recent, float scaled_max,
                                                  unsigned inv_stride) {
    __shared__ float partial[256];
    const unsigned i = blockIdx.x, tid = threadIdx.x;
    if (i >= n) return;
    const float last = history[i];
    float amax = 0.0f;
    for (unsigned off = 0; off < len; off += blockDim.x) {
        unsigned k = off + tid;
        float a = 0.0f;
        if (k < len) {
            a = k + 1 < len ? history[(unsigned long long)(k + 1) * n + i] : last;
            amax = fmaxf(amax, a);
        }
        __syncthreads();
        if (k < len) history[(unsigned long long)k * n + i] = k > 0 ? a : 0.0f;
    }
    partial[tid] = amax;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (tid < half) partial[tid] = fmaxf(partial[tid], partial[tid + half]);
        __syncthreads();
    }
    if (tid == 0)
        set_scale(scale + i, scale_inv + (unsigned long long)i * inv_stride,
                  scale_for(most_recent ? last : partial[0], scale[i], scaled_max));
}

// Current scaling: the scale of tensor i from amax[i], measured this step.
extern "C" __global__ void current_scaling_update(float* scale, float* scale_inv, const float* amax, unsigned n,
                                                  float scaled_max, unsigned inv_stride) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) set_scale(scale + i, scale_inv + (unsigned long long)i * inv_stride, scale_for(amax[i], scale[i], scaled_max));
}

// Current scaling of one tensor in one launch: its amax and, in the last block to finish, its
// scale. work[0] gathers the blocks' amax bits and work[1] counts the blocks done; the last block
// takes both back to 0 (they are 0 between launches), so no memset or update node comes with each
// cast. The blocks' atomicMax lands before their count (the fence), so the last one reads them all.
template <typename T>
__device__ __forceinline__ void amax_scale(unsigned* work, float* amax, float* scale, float* scale_inv, const T* inp,
                                           unsigned n, float scaled_max) {
    const unsigned v = block_max_bits(thread_amax(inp, n));
    if (threadIdx.x != 0) return;
    if (v != 0) atomicMax(work, v);
    __threadfence();
    if (atomicAdd(work + 1, 1u) != gridDim.x - 1) return;
    const float a = __uint_as_float(atomicExch(work, 0u));
    work[1] = 0u;
    *amax = a;
    set_scale(scale, scale_inv, scale_for(a, *scale, scaled_max));
}

extern "C" __global__ void amax_scale_f32(unsigned* work, float* amax, float* scale, float* scale_inv, const float* inp,
                                          unsigned n, float scaled_max) {
    amax_scale(work, amax, scale, scale_inv, inp, n, scaled_max);
}
extern "C" __global__ void amax_scale_bf16(unsigned* work, float* amax, float* scale, float* scale_inv, const bf16* inp,
                                           unsigned n, float scaled_max) {
    amax_scale(work, amax, scale, scale_inv, inp, n, scaled_max);
}
