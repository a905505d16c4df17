// Counter-based random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC'11), bit-identical to philox4x32_10 in rng.rs, and the step-counter kernels.
// Kernels that draw random numbers are compiled with this file as a prefix of theirs (dropout.rs
// concatenates it with dropout.cu), so Philox has one CUDA copy. No reductions, no atomics.

__device__ __forceinline__ unsigned philox_mulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}

// The four numbers of `group` (elements 4*group .. 4*group+3) at `step` for key (seed, site):
// counter (group lo, group hi, step lo, step hi), the key bumped before rounds 2..10.
__device__ __forceinline__ void philox_block(unsigned out[4], unsigned seed, unsigned site,
                                             unsigned long long step, unsigned long long group) {
    unsigned c0 = (unsigned)group, c1 = (unsigned)(group >> 32);
    unsigned c2 = (unsigned)step, c3 = (unsigned)(step >> 32);
    unsigned k0 = seed, k1 = site;
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned hi0 = philox_mulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        unsigned hi1 = philox_mulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

// One thread per group of four elements.
extern "C" __global__ void random_u32(unsigned* out, const unsigned long long* step, unsigned seed,
                                      unsigned site, unsigned n) {
    unsigned long long group = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long first = group * 4;
    if (first >= n) return;
    unsigned r[4];
    philox_block(r, seed, site, *step, group);
    for (int k = 0; k < 4; ++k) {
        if (first + k < n) out[first + k] = r[k];
    }
}

// One thread.
extern "C" __global__ void step_write_u64(unsigned long long* step, unsigned long long value) {
    *step = value;
}

// One thread.
extern "C" __global__ void step_add_u64(unsigned long long* step, unsigned long long by) {
    *step = *step + by;
}
