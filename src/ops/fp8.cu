// FP8 storage types and their conversions (prepended after float.cu): bit for bit cuda_fp8.hpp's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...) and its widening to f32, done by integer
// operations because NVRTC has no cuda_fp8.h without the toolkit's headers. The simulator's
// `Float8` does the same conversions (Note [FP8 conversions] in device/dtype.rs); the GPU test in
// tests/ops_fp8.rs compares both with the GPU's own cvt.rn.satfinite instruction.

struct __align__(1) e4m3 {
    unsigned char bits;
};

struct __align__(1) e5m2 {
    unsigned char bits;
};

// A format: M mantissa bits, the exponent bias, the largest finite code MAX, the first NaN code
// (every code from it to 0x7f is NaN) and the infinity's code (none in E4M3: past 0x7f).
template <typename T> struct Fp8;
template <> struct Fp8<e4m3> {
    static constexpr int M = 3, BIAS = 7;
    static constexpr unsigned MAX = 0x7e, NAN_FROM = 0x7f, INF = 0x100;
};
template <> struct Fp8<e5m2> {
    static constexpr int M = 2, BIAS = 15;
    static constexpr unsigned MAX = 0x7b, NAN_FROM = 0x7d, INF = 0x7c;
};

// Round to nearest, ties to even; magnitudes that round past MAX (infinity included) saturate to
// it; every NaN becomes 0x7f (cuda_fp8.hpp makes NaNs canonical before converting). This is the
// conversion of GPUs before sm_89, which have no FP8 instruction (fp8_bits below).
template <typename T> __device__ __forceinline__ unsigned char fp8_bits_by_integers(float x) {
    constexpr int M = Fp8<T>::M, BIAS = Fp8<T>::BIAS, EMIN = 1 - BIAS;
    constexpr int EMAX = (int)(Fp8<T>::MAX >> M) - BIAS;
    unsigned u = __float_as_uint(x), a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
    if (a > 0x7f800000u) return 0x7f;
    if (a >= (unsigned)(EMAX + 1 + 127) << 23) return (unsigned char)(sign | Fp8<T>::MAX);
    // x = sig · 2^(e − 23); the result is n · 2^q, q = max(e, EMIN) − M, so n = sig / 2^s rounded.
    // Below EMIN (f32 zeros and subnormals included) s grows until nothing is left (s ≥ 25).
    int e = (int)(a >> 23) - 127, ee = e > EMIN ? e : EMIN, s = 23 - M + (ee - e);
    unsigned sig = (a & 0x7fffffu) | 0x800000u, n = 0;
    if (s < 25) {
        unsigned rem = sig & ((1u << s) - 1), half = 1u << (s - 1);
        n = sig >> s;
        if (rem > half || (rem == half && (n & 1u))) n += 1;
    }
    // Code (E − 1, n) read as bits: a subnormal's n is its mantissa, a normal's n carries the
    // implicit bit into the exponent, and a round-up past a binade's end carries on.
    unsigned code = ((unsigned)(ee + BIAS - 1) << M) + n;
    return (unsigned char)(sign | (code < Fp8<T>::MAX ? code : Fp8<T>::MAX));
}

// The conversion: on sm_89 and later the GPU's own instruction (cvt.rn.satfinite, as cuda_fp8.h
// issues it), which gives fp8_bits_by_integers' bytes (tests/ops_fp8.rs checks both against the
// simulator's) at a fraction of its instructions: the casts of a training step are bound by
// memory with it and by integer throughput without.
template <typename T> struct Cvt;
template <> struct Cvt<e4m3> {
    __device__ static __forceinline__ unsigned short pair(float lo, float hi) {
        unsigned short p;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p) : "f"(hi), "f"(lo));
        return p;
    }
};
template <> struct Cvt<e5m2> {
    __device__ static __forceinline__ unsigned short pair(float lo, float hi) {
        unsigned short p;
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(p) : "f"(hi), "f"(lo));
        return p;
    }
};

template <typename T> __device__ __forceinline__ unsigned char fp8_bits(float x) {
#if __CUDA_ARCH__ >= 890
    return (unsigned char)(Cvt<T>::pair(x, 0.0f) & 0xffu);
#else
    return fp8_bits_by_integers<T>(x);
#endif
}

// Four values' codes in one word, the first in the low byte: on sm_89 and later two paired
// conversions (each cvt converts two values), half the instructions of four fp8_bits.
template <typename T> __device__ __forceinline__ unsigned fp8_quad(float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 890
    return (unsigned)Cvt<T>::pair(a, b) | ((unsigned)Cvt<T>::pair(c, d) << 16);
#else
    return (unsigned)fp8_bits_by_integers<T>(a) | ((unsigned)fp8_bits_by_integers<T>(b) << 8) |
           ((unsigned)fp8_bits_by_integers<T>(c) << 16) | ((unsigned)fp8_bits_by_integers<T>(d) << 24);
#endif
}

// Exact; NaNs as the canonical f32 NaN (0x7fffffff), as the GPU's f32 arithmetic returns them.
template <typename T> __device__ __forceinline__ float fp8_value(unsigned char b) {
    constexpr int M = Fp8<T>::M, BIAS = Fp8<T>::BIAS;
    unsigned sign = (unsigned)(b & 0x80u) << 24, mag = b & 0x7fu, e = mag >> M, m = mag & ((1u << M) - 1);
    if (mag >= Fp8<T>::NAN_FROM) return __uint_as_float(0x7fffffffu);
    if (mag == Fp8<T>::INF) return __uint_as_float(sign | 0x7f800000u);
    // Subnormals are m · 2^(1 − BIAS − M), exact in f32.
    float v = e == 0 ? (float)m * __uint_as_float((unsigned)(127 + 1 - BIAS - M) << 23)
                     : __uint_as_float(((e + 127 - BIAS) << 23) | (m << (23 - M)));
    return __uint_as_float(__float_as_uint(v) | sign);
}

__device__ __forceinline__ float to_f32(e4m3 x) { return fp8_value<e4m3>(x.bits); }
__device__ __forceinline__ float to_f32(e5m2 x) { return fp8_value<e5m2>(x.bits); }

template <> __device__ __forceinline__ e4m3 from_f32<e4m3>(float x) {
    e4m3 r;
    r.bits = fp8_bits<e4m3>(x);
    return r;
}

template <> __device__ __forceinline__ e5m2 from_f32<e5m2>(float x) {
    e5m2 r;
    r.bits = fp8_bits<e5m2>(x);
    return r;
}

// NaN as the GPU's f32 arithmetic returns it; a CPU's multiply may return another NaN.
__device__ __forceinline__ float canonical(float x) { return x != x ? __uint_as_float(0x7fffffffu) : x; }

// 16 one-byte elements to and from one uint4 (float.cu's pack and unpack for FP8).
template <typename T> __device__ __forceinline__ void unpack_bytes(uint4 u, T* out) {
    unsigned words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int b = 0; b < 16; ++b) out[b].bits = (unsigned char)(words[b / 4] >> (8 * (b % 4)));
}

template <typename T> __device__ __forceinline__ uint4 pack_bytes(const T* in) {
    unsigned words[4] = {0, 0, 0, 0};
#pragma unroll
    for (int b = 0; b < 16; ++b) words[b / 4] |= (unsigned)in[b].bits << (8 * (b % 4));
    return make_uint4(words[0], words[1], words[2], words[3]);
}

__device__ __forceinline__ void unpack(uint4 u, e4m3* out) { unpack_bytes(u, out); }
__device__ __forceinline__ void unpack(uint4 u, e5m2* out) { unpack_bytes(u, out); }
__device__ __forceinline__ uint4 pack(const e4m3* in) { return pack_bytes(in); }
__device__ __forceinline__ uint4 pack(const e5m2* in) { return pack_bytes(in); }
