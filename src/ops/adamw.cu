// AdamW (decoupled weight decay, as PyTorch's torch.optim.AdamW) over one flat f32 buffer of
// all parameters, one thread per parameter: no reductions, no atomics. The learning rate and
// the step count t (for bias correction) are read from device memory, so a captured optimizer
// graph follows a schedule and counts its steps across replays.

extern "C" __global__ void adamw_f32(float* params, float* m, float* v, const float* grads,
                                     const float* lr, const unsigned long long* step, float beta1,
                                     float beta2, float eps, float weight_decay, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float rate = *lr;
    float t = (float)*step;
    float g = grads[i];
    float mi = m[i] + (1.0f - beta1) * (g - m[i]);  // PyTorch's lerp
    float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float bias1 = 1.0f - powf(beta1, t);
    float bias2_sqrt = sqrtf(1.0f - powf(beta2, t));
    float denom = sqrtf(vi) / bias2_sqrt + eps;
    float p = params[i] * (1.0f - rate * weight_decay);
    params[i] = p - (rate / bias1) * (mi / denom);
}
