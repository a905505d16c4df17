// Dropout, compiled after rng.cu (dropout.rs concatenates them) for philox_block. One thread per
// group of four elements (one Philox call); no reductions, so outputs and masks are bitwise
// identical to the CPU paths in dropout.rs. The keep test compares the random u32 with a
// threshold computed on the host, so no float rounding can differ between the devices.

extern "C" __global__ void dropout_forward_f32(float* out, unsigned char* mask, const float* inp,
                                               const unsigned long long* step, unsigned threshold,
                                               float scale, unsigned seed, unsigned site,
                                               unsigned n) {
    unsigned long long group = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long first = group * 4;
    if (first >= n) return;
    unsigned r[4];
    philox_block(r, seed, site, *step, group);
    for (int k = 0; k < 4; ++k) {
        unsigned long long i = first + k;
        if (i < n) {
            bool keep = r[k] >= threshold;
            out[i] = keep ? inp[i] * scale : 0.0f;
            mask[i] = keep ? 1 : 0;
        }
    }
}

// One thread per element.
extern "C" __global__ void dropout_backward_f32(float* dinp, const float* dout,
                                                const unsigned char* mask, float scale,
                                                unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dinp[i] = mask[i] ? dout[i] * scale : 0.0f;
}
