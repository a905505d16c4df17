// Casts between f32 and bf16, FP8 quantization, and the residual add, on float.cu's and
// fp8.cu's conversions (prepended): elementwise, no reductions, so results are bitwise equal to
// the CPU paths in cast.rs (casts are exactly half::bf16's from_f32 and to_f32; the add is one
// f32 add rounded once; FP8 conversions are `Float8`'s).

// out = O(inp), eight elements (one or two 16-byte accesses per side) per chunk.
template <typename O, typename I> __device__ void cast(O* out, const I* inp, unsigned n) {
    map1<8>(out, inp, n, [](float v) { return v; });
}

extern "C" __global__ void cast_f32_to_bf16(bf16* out, const float* inp, unsigned n) { cast(out, inp, n); }
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16* inp, unsigned n) { cast(out, inp, n); }

template <typename T> __device__ void residual_add(T* out, const T* a, const T* b, unsigned n) {
    map2<Lanes<T>::N>(out, a, b, n, [](float x, float y) { return x + y; });
}

extern "C" __global__ void residual_add_f32(float* out, const float* a, const float* b, unsigned n) {
    residual_add(out, a, b, n);
}
extern "C" __global__ void residual_add_bf16(bf16* out, const bf16* a, const bf16* b, unsigned n) {
    residual_add(out, a, b, n);
}

// out = fp8(inp · scale[0]): one f32 multiply, rounded once. The scale is read from device memory
// by every thread, so a graph replays with the scale of its replay. 16 elements per chunk: one
// 16-byte access of FP8.
template <typename O, typename I> __device__ void quantize(O* out, const I* inp, const float* scale, unsigned n) {
    float s = *scale;
    map1<16>(out, inp, n, [s](float v) { return v * s; });
}

extern "C" __global__ void quantize_f32_to_e4m3(e4m3* out, const float* inp, const float* scale, unsigned n) {
    quantize(out, inp, scale, n);
}
extern "C" __global__ void quantize_f32_to_e5m2(e5m2* out, const float* inp, const float* scale, unsigned n) {
    quantize(out, inp, scale, n);
}
extern "C" __global__ void quantize_bf16_to_e4m3(e4m3* out, const bf16* inp, const float* scale, unsigned n) {
    quantize(out, inp, scale, n);
}
extern "C" __global__ void quantize_bf16_to_e5m2(e5m2* out, const bf16* inp, const float* scale, unsigned n) {
    quantize(out, inp, scale, n);
}

// out = O(f32(inp) · scale_inv[0]), NaNs canonical (so that bf16 outputs agree too).
template <typename O, typename I>
__device__ void dequantize(O* out, const I* inp, const float* scale_inv, unsigned n) {
    float s = *scale_inv;
    map1<16>(out, inp, n, [s](float v) { return canonical(v * s); });
}

extern "C" __global__ void dequantize_e4m3_to_f32(float* out, const e4m3* inp, const float* scale_inv, unsigned n) {
    dequantize(out, inp, scale_inv, n);
}
extern "C" __global__ void dequantize_e5m2_to_f32(float* out, const e5m2* inp, const float* scale_inv, unsigned n) {
    dequantize(out, inp, scale_inv, n);
}
extern "C" __global__ void dequantize_e4m3_to_bf16(bf16* out, const e4m3* inp, const float* scale_inv, unsigned n) {
    dequantize(out, inp, scale_inv, n);
}
extern "C" __global__ void dequantize_e5m2_to_bf16(bf16* out, const e5m2* inp, const float* scale_inv, unsigned n) {
    dequantize(out, inp, scale_inv, n);
}
