// Block-wide reductions shared by the one-block-per-row kernels (prepended to their sources).
//
// Launch contract: blocks of exactly ROW_BLOCK threads (the shared arrays assume it).
//
// Determinism: no atomics. A caller's thread t first combines its elements t, t + ROW_BLOCK,
// t + 2 ROW_BLOCK, ... in index order; these combine the ROW_BLOCK partial results by a tree whose
// pairing depends only on thread indices. So every sum has one fixed order of additions and the
// results are bitwise identical run to run. (A maximum is exact in any order.)

#define ROW_BLOCK 256

// The sum of v over the block, returned to every thread. buf is ROW_BLOCK floats of shared memory.
__device__ float block_sum(float v, float* buf) {
    unsigned t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (unsigned s = ROW_BLOCK / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];
        __syncthreads();
    }
    float total = buf[0];
    __syncthreads();  // every thread has read buf[0] before the next reduction overwrites it
    return total;
}

// The maximum of v over the block, returned to every thread.
__device__ float block_max(float v, float* buf) {
    unsigned t = threadIdx.x;
    buf[t] = v;
    __syncthreads();
    for (unsigned s = ROW_BLOCK / 2; s > 0; s >>= 1) {
        if (t < s && buf[t + s] > buf[t]) buf[t] = buf[t + s];
        __syncthreads();
    }
    float m = buf[0];
    __syncthreads();
    return m;
}

