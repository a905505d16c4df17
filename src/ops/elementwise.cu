// Elementwise kernels on f32. Each thread handles one element; no reductions, so results are
// bitwise identical to the CPU paths in elementwise.rs.

extern "C" __global__ void fill_f32(float* y, float value, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = value;
}

extern "C" __global__ void add_scalar_f32(float* y, float c, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] + c;
}

extern "C" __global__ void scale_f32(float* y, const float* x, float k, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = k * x[i];
}

extern "C" __global__ void axpy_f32(float* y, const float* x, float a, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fmaf_rn(a, x[i], y[i]);
}

// y[r, c] = k * x[r, c] for r < rows, c < cols, with leading dimensions ld_y and ld_x.
extern "C" __global__ void scale_rows_f32(float* y, const float* x, float k, unsigned rows,
                                          unsigned cols, unsigned ld_y, unsigned ld_x) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        unsigned r = i / cols, c = i % cols;
        y[r * ld_y + c] = k * x[r * ld_x + c];
    }
}
