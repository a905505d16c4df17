// The fused FP8 cast of a [rows, cols] matrix (after amax.cu): fp8(x · scale) row-major into
// `out`, its transpose ([cols, rows], row-major) into `out_t`, either or both, and max |x| into
// `amax` (accumulated, Note [Amax as integer bits]), in one read of x. Each element is
// converted once, as quantize converts it, so both outputs equal quantize's bytes.
//
// A block of 256 threads walks 64 x 64 tiles (a grid-stride loop over tiles, so there is one
// atomicMax per block, not per tile). Each thread converts quads, 4 consecutive elements of a
// row, four rows of a tile: their four 16-byte (f32) or 8-byte (bf16) loads first, then one
// 4-byte store of the row-major bytes each. The
// tile's bytes go through shared memory, and the transposed quads (4 consecutive rows of one
// column) leave as one 4-byte store each: both outputs are written by whole 64-byte row pieces
// per 16 threads. Quads that are not whole or not aligned (edge tiles, widths not a multiple of
// 4) take the same path one element at a time.

constexpr int TILE = 64;
constexpr int QUADS = TILE / 4;  // quads per tile row

__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
    return ((unsigned long long)p & (bytes - 1)) == 0;
}

// A quad as loaded (one 16-byte f32 or 8-byte bf16 access), taken apart only when converted, so
// that a thread's four quads in flight hold 8 registers in bf16 rather than 16.
template <typename I> struct Quad;
template <> struct Quad<float> {
    using Raw = float4;
};
template <> struct Quad<bf16> {
    using Raw = uint2;
};

template <typename I> __device__ __forceinline__ typename Quad<I>::Raw load_quad(const I* p) {
    return *reinterpret_cast<const typename Quad<I>::Raw*>(p);
}

__device__ __forceinline__ void quad_values(float4 f, float* v) {
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
}

__device__ __forceinline__ void quad_values(uint2 u, float* v) {
    unsigned words[2] = {u.x, u.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        bf16 h;
        h.bits = (unsigned short)(words[e / 2] >> (16 * (e % 2)));
        v[e] = to_f32(h);
    }
}

// The raw quad of `count` (< 4) elements at p, one element at a time, zeros past them.
template <typename I> __device__ __forceinline__ typename Quad<I>::Raw load_partial(const I* p, unsigned count);
template <> __device__ __forceinline__ float4 load_partial<float>(const float* p, unsigned count) {
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (unsigned e = 0; e < count; ++e) v[e] = p[e];
    return make_float4(v[0], v[1], v[2], v[3]);
}
template <> __device__ __forceinline__ uint2 load_partial<bf16>(const bf16* p, unsigned count) {
    unsigned words[2] = {0u, 0u};
    for (unsigned e = 0; e < count; ++e) words[e / 2] |= (unsigned)p[e].bits << (16 * (e % 2));
    return make_uint2(words[0], words[1]);
}

// Threads per block (ops/mod.rs: stride_dims launches 256), and so the rows of a tile each thread
// converts: its loads are all issued before it converts, so that enough bytes are in flight to
// keep HBM busy (one quad at a time kept the cast near a third of the H200's bandwidth).
constexpr unsigned BLOCK = 256;
constexpr int ROWS_PER_THREAD = TILE * QUADS / BLOCK;

// Converts the tile at (r0, c0): row-major bytes to `out` (when ROW) and to `tile`, whose word
// [r][q] holds columns 4q..4q+3 of row r, low byte first; returns the thread's amax bits.
template <typename O, typename I, bool ROW>
__device__ unsigned cast_tile(O* out, unsigned (*tile)[QUADS + 1], const I* inp, float s, unsigned rows,
                              unsigned cols, unsigned r0, unsigned c0, bool vec_in, bool vec_out) {
    const unsigned q = threadIdx.x % QUADS, first = threadIdx.x / QUADS, col = c0 + 4 * q;
    const bool whole = col + 4 <= cols;
    typename Quad<I>::Raw raw[ROWS_PER_THREAD];
#pragma unroll
    for (int k = 0; k < ROWS_PER_THREAD; ++k) {
        unsigned row = r0 + first + k * (BLOCK / QUADS);
        raw[k] = load_partial<I>(inp, 0);
        if (row < rows && col < cols) {
            unsigned long long at = (unsigned long long)row * cols + col;
            raw[k] = whole && vec_in ? load_quad<I>(inp + at) : load_partial<I>(inp + at, min(4u, cols - col));
        }
    }
    unsigned v = 0;
#pragma unroll
    for (int k = 0; k < ROWS_PER_THREAD; ++k) {
        unsigned r = first + k * (BLOCK / QUADS), row = r0 + r, word = 0;
        if (row < rows && col < cols) {
            unsigned long long at = (unsigned long long)row * cols + col;
            float x[4];
            quad_values(raw[k], x);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (col + e < cols) {
                    v = max_bits(v, amax_bits(x[e]));
                    word |= (unsigned)fp8_bits<O>(x[e] * s) << (8 * e);
                }
            }
            if (ROW && whole && vec_out) {
                *reinterpret_cast<unsigned*>(out + at) = word;
            } else if (ROW) {
                for (unsigned e = 0; e < 4 && col + e < cols; ++e) out[at + e].bits = (unsigned char)(word >> (8 * e));
            }
        }
        tile[r][q] = word;
    }
    return v;
}

// Writes the tile at (r0, c0) transposed: row c0 + c of `out_t` gets rows r0.. of column c.
template <typename O>
__device__ void store_transposed(O* out_t, unsigned (*tile)[QUADS + 1], unsigned rows, unsigned cols, unsigned r0,
                                 unsigned c0, bool vec) {
    const unsigned rq = threadIdx.x % QUADS;
    for (unsigned c = threadIdx.x / QUADS; c < TILE; c += BLOCK / QUADS) {
        unsigned col = c0 + c, row = r0 + 4 * rq;
        if (col >= cols || row >= rows) continue;
        unsigned word = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) word |= ((tile[4 * rq + e][c / 4] >> (8 * (c % 4))) & 0xffu) << (8 * e);
        unsigned long long at = (unsigned long long)col * rows + row;
        if (vec && row + 4 <= rows) {
            *reinterpret_cast<unsigned*>(out_t + at) = word;
        } else {
            for (unsigned e = 0; e < 4 && row + e < rows; ++e) out_t[at + e].bits = (unsigned char)(word >> (8 * e));
        }
    }
}

template <typename O, typename I, bool ROW, bool COL>
__device__ void cast_transpose(O* out, O* out_t, float* amax, const I* inp, const float* scale, unsigned rows,
                               unsigned cols) {
    __shared__ unsigned tile[TILE][QUADS + 1];
    const float s = *scale;
    const bool vec_in = cols % 4 == 0 && aligned_to(inp, 4 * sizeof(I));
    const bool vec_out = cols % 4 == 0 && (!ROW || aligned_to(out, 4));
    const bool vec_t = rows % 4 == 0 && (!COL || aligned_to(out_t, 4));
    const unsigned tiles_c = (cols + TILE - 1) / TILE;
    const unsigned long long tiles = (unsigned long long)((rows + TILE - 1) / TILE) * tiles_c;
    unsigned v = 0;
    for (unsigned long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        unsigned r0 = (unsigned)(t / tiles_c) * TILE, c0 = (unsigned)(t % tiles_c) * TILE;
        v = max_bits(v, cast_tile<O, I, ROW>(out, tile, inp, s, rows, cols, r0, c0, vec_in, vec_out));
        if (COL) {
            __syncthreads();
            store_transposed(out_t, tile, rows, cols, r0, c0, vec_t);
            __syncthreads();
        }
    }
    block_amax(amax, v);
}

// Entry points: both outputs, the row-major one only, the transposed one only.
extern "C" __global__ void fp8_cast_transpose_f32_e4m3(e4m3* out, e4m3* out_t, float* amax, const float* inp,
                                                 const float* scale, unsigned rows, unsigned cols) {
    cast_transpose<e4m3, float, true, true>(out, out_t, amax, inp, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_rows_f32_e4m3(e4m3* out, float* amax, const float* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e4m3, float, true, false>(out, nullptr, amax, inp, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_cols_f32_e4m3(e4m3* out_t, float* amax, const float* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e4m3, float, false, true>(nullptr, out_t, amax, inp, scale, rows, cols);
}

extern "C" __global__ void fp8_cast_transpose_f32_e5m2(e5m2* out, e5m2* out_t, float* amax, const float* inp,
                                                 const float* scale, unsigned rows, unsigned cols) {
    cast_transpose<e5m2, float, true, true>(out, out_t, amax, inp, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_rows_f32_e5m2(e5m2* out, float* amax, const float* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e5m2, float, true, false>(out, nullptr, amax, inp, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_cols_f32_e5m2(e5m2* out_t, float* amax, const float* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e5m2, float, false, true>(nullptr, out_t, amax, inp, scale, rows, cols);
}

extern "C" __global__ void fp8_cast_transpose_bf16_e4m3(e4m3* out, e4m3* out_t, float* amax, const bf16* inp,
                                                 const float* scale, unsigned rows, unsigned cols) {
    cast_transpose<e4m3, bf16, true, true>(out, out_t, amax, inp, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_rows_bf16_e4m3(e4m3* out, float* amax, const bf16* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e4m3, bf16, true, false>(out, nullptr, amax, inp, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_cols_bf16_e4m3(e4m3* out_t, float* amax, const bf16* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e4m3, bf16, false, true>(nullptr, out_t, amax, inp, scale, rows, cols);
}

extern "C" __global__ void fp8_cast_transpose_bf16_e5m2(e5m2* out, e5m2* out_t, float* amax, const bf16* inp,
                                                 const float* scale, unsigned rows, unsigned cols) {
    cast_transpose<e5m2, bf16, true, true>(out, out_t, amax, inp, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_rows_bf16_e5m2(e5m2* out, float* amax, const bf16* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e5m2, bf16, true, false>(out, nullptr, amax, inp, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_cols_bf16_e5m2(e5m2* out_t, float* amax, const bf16* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e5m2, bf16, false, true>(nullptr, out_t, amax, inp, scale, rows, cols);
}
