// The fused FP8 cast of a [rows, cols] matrix (after amax.cu): fp8(x · scale) row-major into
// `out`, its transpose ([cols, rows], row-major) into `out_t`, either or both, and max |x| into
// `amax` (accumulated, Note [Amax as integer bits]), in one read of x. Each element is
// converted once, as quantize converts it, so both outputs equal quantize's bytes.
//
// A block of 256 threads converts a CT_ROWS x CT_COLS tile, and the grid has a block per tile
// (cast_transpose.rs): on an H100, L's casts ran up to 17% faster this way than with the one-wave
// grid-stride grid of the elementwise kernels, whose blocks wait on each tile's loads in turn
// (the loop over tiles stays, for a grid smaller than the tiles). A thread loads 16 bytes of a
// tile row at a time (8 bf16 or 4 f32) and issues all its loads before it converts any, four
// values to a word by two paired conversions (fp8_quad). It
// stores the row-major bytes of each load at once and puts them in shared memory; the
// transposed tile then leaves in 4-byte stores, 4 consecutive rows of one column each, 16
// threads writing one whole 64-byte piece of a row of out_t (8-byte stores were no faster).
// Tiles that are not whole, and inputs or outputs whose widths or addresses do not allow the
// wide accesses, take the same steps one element at a time, with the same bytes.
//
// fp8_dgelu_cast_transpose_bf16_e5m2 reads GELU's backward instead of a matrix: each value is
// bf16(gelu'(pre) · dout), what gelu_backward_bf16 writes, cast as above; and each tile's column
// sums go to `tile_sums` ([row tiles, cols], f32) in a fixed order, which fp8_sum_tiles_bf16 adds
// up per column in tile order (the bias gradient of the layer whose output was `pre`). So FP8's MLP
// backward reads the pre-activation and the activation's gradient once, where GELU's backward
// wrote its result in bf16 and the cast and the bias GEMV each read that again
// (TransformerEngine's dgelu-cast-transpose-dbias). The order of the
// sums (dgelu_cast.rs repeats it on the CPU): each thread adds its rows of a column in row order
// from 0, the threads of a warp that share a column combine by xor shuffles (a balanced tree over
// their rows in order), and one thread per column adds the warps in order from 0.

constexpr unsigned CT_BLOCK = 256;
constexpr int CT_ROWS = 64;
constexpr int CT_COLS = 64;

__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
    return ((unsigned long long)p & (bytes - 1)) == 0;
}

// The elements of one 16-byte load as f32, taken apart only when converted.
__device__ __forceinline__ void load_values(uint4 u, const float*, float* v) {
    v[0] = __uint_as_float(u.x);
    v[1] = __uint_as_float(u.y);
    v[2] = __uint_as_float(u.z);
    v[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void load_values(uint4 u, const bf16*, float* v) {
    unsigned words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        bf16 h;
        h.bits = (unsigned short)(words[e / 2] >> (16 * (e % 2)));
        v[e] = to_f32(h);
    }
}

// Where a tile's values come from: a matrix of I, as cast_transpose reads it...
template <typename I> struct Plain {
    using Elem = I;
    using Raw = uint4;
    const I* inp;
    __device__ __forceinline__ bool aligned() const { return aligned_to(inp, 16); }
    __device__ __forceinline__ Raw load(unsigned long long at) const { return *reinterpret_cast<const uint4*>(inp + at); }
    __device__ __forceinline__ void values(const Raw& r, float* v) const { load_values(r, inp, v); }
    __device__ __forceinline__ float value(unsigned long long at) const { return to_f32(inp[at]); }
};

// ...or GELU's backward in bf16, rounded as gelu_backward_bf16 rounds it.
struct DGelu {
    using Elem = bf16;
    struct Raw {
        uint4 dout, pre;
    };
    const bf16* dout;
    const bf16* pre;
    __device__ __forceinline__ bool aligned() const { return aligned_to(dout, 16) && aligned_to(pre, 16); }
    __device__ __forceinline__ Raw load(unsigned long long at) const {
        return Raw{*reinterpret_cast<const uint4*>(dout + at), *reinterpret_cast<const uint4*>(pre + at)};
    }
    // Widened by a shift alone, without to_f32's quieting of NaNs: arithmetic on any NaN gives
    // the canonical one, so the bf16 results are gelu_backward_bf16's all the same, and the
    // rounded bf16 (whose NaNs are quiet) widens by a shift too. The kernel is bound by its
    // arithmetic (tanhf), so every operation saved per element counts.
    __device__ __forceinline__ void values(const Raw& r, float* v) const {
        const unsigned ds[4] = {r.dout.x, r.dout.y, r.dout.z, r.dout.w}, ps[4] = {r.pre.x, r.pre.y, r.pre.z, r.pre.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const unsigned shift = e % 2 ? 0u : 16u, mask = 0xffff0000u;
            const float d = __uint_as_float((ds[e / 2] << shift) & mask), p = __uint_as_float((ps[e / 2] << shift) & mask);
            v[e] = __uint_as_float((unsigned)from_f32<bf16>(gelu_grad(p) * d).bits << 16);
        }
    }
    __device__ __forceinline__ float value(unsigned long long at) const {
        return to_f32(from_f32<bf16>(gelu_grad(to_f32(pre[at])) * to_f32(dout[at])));
    }
};

// The tile geometry for input type I: E elements per load, TPR threads per tile row, RPP rows
// per pass of the block, LOADS loads per thread.
template <typename I> struct CtGeometry {
    static constexpr int E = 16 / sizeof(I), TPR = CT_COLS / E, RPP = CT_BLOCK / TPR, LOADS = CT_ROWS / RPP;
};

using CtTile = unsigned[CT_ROWS][CT_COLS / 4 + 1];

// Converts the tile at (r0, c0) of `src`: row-major bytes to `out` (when ROW) and to `tile` (when
// COL), whose word [r][w] holds columns 4w..4w+3 of row r, low byte first; returns the thread's
// amax bits. With SUMS, `sums` gets the thread's column sums (its rows in order, from 0).
// `fast`: the tile is whole and every access may be wide.
template <typename O, bool ROW, bool COL, bool SUMS, typename Src>
__device__ unsigned cast_tile(O* out, CtTile& tile, float* sums, const Src& src, float s, unsigned rows,
                              unsigned cols, unsigned r0, unsigned c0, bool fast) {
    using G = CtGeometry<typename Src::Elem>;
    const unsigned q = threadIdx.x % G::TPR, first = threadIdx.x / G::TPR, col = c0 + G::E * q;
    unsigned v = 0;
    if (SUMS) {
#pragma unroll
        for (int e = 0; e < G::E; ++e) sums[e] = 0.0f;
    }
    if (fast) {
        typename Src::Raw raw[G::LOADS];
#pragma unroll
        for (int k = 0; k < G::LOADS; ++k) {
            unsigned long long at = (unsigned long long)(r0 + first + k * G::RPP) * cols + col;
            raw[k] = src.load(at);
        }
#pragma unroll
        for (int k = 0; k < G::LOADS; ++k) {
            const unsigned r = first + k * G::RPP;
            float x[G::E];
            src.values(raw[k], x);
            if (SUMS) {
#pragma unroll
                for (int e = 0; e < G::E; ++e) sums[e] += x[e];
            }
            unsigned words[G::E / 4];
#pragma unroll
            for (int w = 0; w < G::E / 4; ++w) {
#pragma unroll
                for (int e = 0; e < 4; ++e) v = max_bits(v, amax_bits(x[4 * w + e]));
                const float* quad = x + 4 * w;
                const unsigned word = fp8_quad<O>(quad[0] * s, quad[1] * s, quad[2] * s, quad[3] * s);
                words[w] = word;
                if (COL) tile[r][(G::E / 4) * q + w] = word;
            }
            if (ROW) {
                O* at = out + (unsigned long long)(r0 + r) * cols + col;
                if (G::E == 8) *reinterpret_cast<uint2*>(at) = make_uint2(words[0], words[G::E / 4 - 1]);
                else *reinterpret_cast<unsigned*>(at) = words[0];
            }
        }
        return v;
    }
    for (int k = 0; k < G::LOADS; ++k) {
        const unsigned r = first + k * G::RPP, row = r0 + r;
        for (int w = 0; w < G::E / 4; ++w) {
            unsigned word = 0;
            for (int e = 0; e < 4; ++e) {
                const unsigned c = col + 4 * w + e;
                if (row < rows && c < cols) {
                    const unsigned long long at = (unsigned long long)row * cols + c;
                    const float x = src.value(at);
                    const unsigned char b = fp8_bits<O>(x * s);
                    if (SUMS) sums[4 * w + e] += x;
                    v = max_bits(v, amax_bits(x));
                    word |= (unsigned)b << (8 * e);
                    if (ROW) out[at].bits = b;
                }
            }
            if (COL) tile[r][(G::E / 4) * q + w] = word;
        }
    }
    return v;
}

// Writes the tile at (r0, c0) transposed: row c0 + c of `out_t` gets rows r0.. of column c,
// 4 consecutive rows per thread and store.
template <typename O>
__device__ void store_transposed(O* out_t, CtTile& tile, unsigned rows, unsigned cols, unsigned r0, unsigned c0,
                                 bool fast) {
    constexpr int TPC = CT_ROWS / 4, CPP = CT_BLOCK / TPC;
    const unsigned rq = threadIdx.x % TPC;
#pragma unroll
    for (int p = 0; p < CT_COLS / CPP; ++p) {
        const unsigned c = threadIdx.x / TPC + p * CPP, col = c0 + c, row = r0 + 4 * rq;
        unsigned word = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) word |= ((tile[4 * rq + e][c / 4] >> (8 * (c % 4))) & 0xffu) << (8 * e);
        O* at = out_t + (unsigned long long)col * rows + row;
        if (fast) {
            *reinterpret_cast<unsigned*>(at) = word;
        } else if (col < cols) {
            for (unsigned e = 0; e < 4 && row + e < rows; ++e) at[e].bits = (unsigned char)(word >> (8 * e));
        }
    }
}

// The tile's column sums from each thread's `sums`, in the order the header describes, into row
// r0 / CT_ROWS of `tile_sums`.
template <typename I>
__device__ void store_tile_sums(float* tile_sums, float (&warps)[CT_BLOCK / 32][CT_COLS], float* sums, unsigned cols,
                                unsigned r0, unsigned c0) {
    using G = CtGeometry<I>;
    const unsigned q = threadIdx.x % G::TPR, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int e = 0; e < G::E; ++e) {
#pragma unroll
        for (int o = G::TPR; o < 32; o *= 2) sums[e] += __shfl_xor_sync(0xffffffffu, sums[e], o);
        if (lane < G::TPR) warps[warp][G::E * q + e] = sums[e];
    }
    __syncthreads();
    if (threadIdx.x < CT_COLS && c0 + threadIdx.x < cols) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < CT_BLOCK / 32; ++w) total += warps[w][threadIdx.x];
        tile_sums[(unsigned long long)(r0 / CT_ROWS) * cols + c0 + threadIdx.x] = total;
    }
}

template <typename O, bool ROW, bool COL, bool SUMS, typename Src>
__device__ void cast_transpose(O* out, O* out_t, float* amax, float* tile_sums, const Src& src, const float* scale,
                               unsigned rows, unsigned cols) {
    using G = CtGeometry<typename Src::Elem>;
    __shared__ CtTile tile;
    __shared__ float warps[SUMS ? CT_BLOCK / 32 : 1][CT_COLS];
    float sums[G::E];
    const float s = *scale;
    // Whether whole tiles may take the wide accesses: 16-byte loads, G::E-byte row stores,
    // 4-byte transposed stores.
    const bool wide = cols % G::E == 0 && src.aligned() && (!ROW || aligned_to(out, G::E)) &&
                      (!COL || (rows % 4 == 0 && aligned_to(out_t, 4)));
    const unsigned tiles_c = (cols + CT_COLS - 1) / CT_COLS;
    const unsigned long long tiles = (unsigned long long)((rows + CT_ROWS - 1) / CT_ROWS) * tiles_c;
    unsigned v = 0;
    for (unsigned long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        const unsigned r0 = (unsigned)(t / tiles_c) * CT_ROWS, c0 = (unsigned)(t % tiles_c) * CT_COLS;
        const bool fast = wide && r0 + CT_ROWS <= rows && c0 + CT_COLS <= cols;
        v = max_bits(v, cast_tile<O, ROW, COL, SUMS>(out, tile, sums, src, s, rows, cols, r0, c0, fast));
        if constexpr (SUMS) store_tile_sums<typename Src::Elem>(tile_sums, warps, sums, cols, r0, c0);
        if (COL || SUMS) {
            __syncthreads();
            if (COL) store_transposed(out_t, tile, rows, cols, r0, c0, fast);
            __syncthreads();
        }
    }
    block_amax(amax, v);
}
// Entry points: both outputs, the row-major one only, the transposed one only.
extern "C" __global__ void fp8_cast_transpose_f32_e4m3(e4m3* out, e4m3* out_t, float* amax, const float* inp,
                                                 const float* scale, unsigned rows, unsigned cols) {
    cast_transpose<e4m3, true, true, false>(out, out_t, amax, nullptr, Plain<float>{inp}, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_rows_f32_e4m3(e4m3* out, float* amax, const float* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e4m3, true, false, false>(out, nullptr, amax, nullptr, Plain<float>{inp}, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_cols_f32_e4m3(e4m3* out_t, float* amax, const float* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e4m3, false, true, false>(nullptr, out_t, amax, nullptr, Plain<float>{inp}, scale, rows, cols);
}

extern "C" __global__ void fp8_cast_transpose_f32_e5m2(e5m2* out, e5m2* out_t, float* amax, const float* inp,
                                                 const float* scale, unsigned rows, unsigned cols) {
    cast_transpose<e5m2, true, true, false>(out, out_t, amax, nullptr, Plain<float>{inp}, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_rows_f32_e5m2(e5m2* out, float* amax, const float* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e5m2, true, false, false>(out, nullptr, amax, nullptr, Plain<float>{inp}, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_cols_f32_e5m2(e5m2* out_t, float* amax, const float* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e5m2, false, true, false>(nullptr, out_t, amax, nullptr, Plain<float>{inp}, scale, rows, cols);
}

extern "C" __global__ void fp8_cast_transpose_bf16_e4m3(e4m3* out, e4m3* out_t, float* amax, const bf16* inp,
                                                 const float* scale, unsigned rows, unsigned cols) {
    cast_transpose<e4m3, true, true, false>(out, out_t, amax, nullptr, Plain<bf16>{inp}, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_rows_bf16_e4m3(e4m3* out, float* amax, const bf16* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e4m3, true, false, false>(out, nullptr, amax, nullptr, Plain<bf16>{inp}, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_cols_bf16_e4m3(e4m3* out_t, float* amax, const bf16* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e4m3, false, true, false>(nullptr, out_t, amax, nullptr, Plain<bf16>{inp}, scale, rows, cols);
}

extern "C" __global__ void fp8_cast_transpose_bf16_e5m2(e5m2* out, e5m2* out_t, float* amax, const bf16* inp,
                                                 const float* scale, unsigned rows, unsigned cols) {
    cast_transpose<e5m2, true, true, false>(out, out_t, amax, nullptr, Plain<bf16>{inp}, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_rows_bf16_e5m2(e5m2* out, float* amax, const bf16* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e5m2, true, false, false>(out, nullptr, amax, nullptr, Plain<bf16>{inp}, scale, rows, cols);
}
extern "C" __global__ void fp8_cast_cols_bf16_e5m2(e5m2* out_t, float* amax, const bf16* inp, const float* scale,
                                            unsigned rows, unsigned cols) {
    cast_transpose<e5m2, false, true, false>(nullptr, out_t, amax, nullptr, Plain<bf16>{inp}, scale, rows, cols);
}

// GELU's backward cast to E5M2 (or E4M3) in both layouts, with its amax and its tiles' column sums.
extern "C" __global__ void fp8_dgelu_cast_transpose_bf16_e4m3(e4m3* out, e4m3* out_t, float* amax, float* tile_sums,
                                                        const bf16* dout, const bf16* pre, const float* scale,
                                                        unsigned rows, unsigned cols) {
    cast_transpose<e4m3, true, true, true>(out, out_t, amax, tile_sums, DGelu{dout, pre}, scale, rows, cols);
}
extern "C" __global__ void fp8_dgelu_cast_transpose_bf16_e5m2(e5m2* out, e5m2* out_t, float* amax, float* tile_sums,
                                                        const bf16* dout, const bf16* pre, const float* scale,
                                                        unsigned rows, unsigned cols) {
    cast_transpose<e5m2, true, true, true>(out, out_t, amax, tile_sums, DGelu{dout, pre}, scale, rows, cols);
}

// out[c] = bf16(sum over t in order, from 0, of tile_sums[t, c]) (float.cu's column_sum): a
// thread per column, with small blocks (sum_tiles in dgelu_cast.rs) so that a few thousand
// columns spread over the SMs.
extern "C" __global__ void fp8_sum_tiles_bf16(bf16* out, const float* tile_sums, unsigned tiles, unsigned cols) {
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    out[c] = from_f32<bf16>(column_sum(tile_sums, tiles, cols, c));
}
