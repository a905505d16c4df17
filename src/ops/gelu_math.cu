// GELU with the tanh approximation and its derivative, as device functions (after float.cu): the
// kernels of gelu.cu and FP8's fused GELU backward (fp8/cast_transpose.cu) share them, so both
// compute the same f32 values. gelu.rs's CPU paths use the same formulas and constants.

#define GELU_K 0.7978846f       // sqrt(2 / pi) as f32; GELU_K in gelu.rs is the same value
#define GELU_CUBE 0.044715f
#define GELU_CUBE3 0.134145f    // 3 * GELU_CUBE, the derivative of the cubic term

__device__ float gelu(float x) {
    float cube = GELU_CUBE * x * x * x;
    return 0.5f * x * (1.0f + tanhf(GELU_K * (x + cube)));
}

// d gelu / dx, with sech^2 = 1 - tanh^2 (no coshf, which overflows for large arguments).
__device__ float gelu_grad(float x) {
    float cube = GELU_CUBE * x * x * x;
    float t = tanhf(GELU_K * (x + cube));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_K * (1.0f + GELU_CUBE3 * x * x);
}
