// Casts between f32 and bf16, and the residual add, on float.cu's conversions (prepended):
// elementwise, no reductions, so results are bitwise equal to the CPU paths in cast.rs (casts
// are exactly half::bf16's from_f32 and to_f32; the add is one f32 add rounded once).

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
