// Moving attention heads between the row-major (B*T, P*C) activations of the projections, where
// head h of block p is columns p*C + h*hd .. p*C + (h+1)*hd, and the contiguous (B, H, T, hd)
// layout that lets one strided-batched GEMM cover every (batch element, head) pair. Pure
// permutations: one thread per element, no arithmetic, so both devices agree bitwise.

// The offset in the row layout (leading dimension ld) of element i of a (B, H, T, hd) tensor.
__device__ unsigned long long row_index(unsigned long long i, unsigned H, unsigned T, unsigned hd,
                                        unsigned ld) {
    unsigned d = i % hd;
    unsigned t = (i / hd) % T;
    unsigned h = (i / ((unsigned long long)hd * T)) % H;
    unsigned long long b = i / ((unsigned long long)hd * T * H);
    return (b * T + t) * ld + (unsigned long long)h * hd + d;
}

// dst[b, h, t, d] = src[(b*T + t)*ld + h*hd + d], src pointing at column block p.
extern "C" __global__ void heads_from_rows_f32(float* dst, const float* src, unsigned B, unsigned H,
                                               unsigned T, unsigned hd, unsigned ld) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)B * H * T * hd) return;
    dst[i] = src[row_index(i, H, T, hd, ld)];
}

// dst[(b*T + t)*ld + h*hd + d] = src[b, h, t, d], dst pointing at column block p.
extern "C" __global__ void rows_from_heads_f32(float* dst, const float* src, unsigned B, unsigned H,
                                               unsigned T, unsigned hd, unsigned ld) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)B * H * T * hd) return;
    dst[row_index(i, H, T, hd, ld)] = src[i];
}
