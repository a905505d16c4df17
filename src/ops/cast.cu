// Casts between f32 and bf16, and the residual add. One thread per element, no reductions.
// bf16 is handled as its bits (unsigned short; NVRTC has no cuda_bf16.h without headers) and
// f32 as unsigned where only bits move, with the same integer rules as half::bf16, so casts are
// bitwise equal to the CPU paths in cast.rs.

// Round to nearest, ties to even; NaNs stay NaN (quiet bit set), as half::bf16::from_f32.
extern "C" __global__ void cast_f32_to_bf16(unsigned short* out, const unsigned* inp, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned x = inp[i];
    unsigned short r;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        r = (unsigned short)((x >> 16) | 0x0040u);
    } else {
        // Round up when the dropped half is above 0x8000, or exactly 0x8000 with an odd result.
        bool up = (x & 0x8000u) != 0 && (x & 0x17fffu) != 0;
        r = (unsigned short)((x >> 16) + (up ? 1u : 0u));
    }
    out[i] = r;
}

// Exact; NaNs get the quiet bit, as half::bf16::to_f32.
extern "C" __global__ void cast_bf16_to_f32(unsigned* out, const unsigned short* inp, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned h = inp[i];
    out[i] = ((h & 0x7fffu) > 0x7f80u ? (h | 0x0040u) : h) << 16;
}

extern "C" __global__ void residual_add_f32(float* out, const float* a, const float* b, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
