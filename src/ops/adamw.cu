// AdamW (decoupled weight decay, as PyTorch's torch.optim.AdamW) over one flat buffer of all
// parameters, one thread per parameter in a grid-stride loop: no reductions, no atomics. Compiled
// after float.cu. The master weights and both moments are f32 and the update is computed in f32;
// the gradients have the model's type M (f32, or bf16 widened exactly). For a bf16 model the same
// thread also writes bf16(updated master) into the model's weights, so they never drift from it.
// The learning rate and the step count t are read from device memory, so a captured optimizer
// graph follows a schedule and counts its steps across replays.

template <typename M>
__device__ void adamw(float* params, M* weights, float* m, float* v, const M* grads, const float* lr,
                      const unsigned long long* step, float beta1, float beta2, float eps, float weight_decay,
                      unsigned n) {
    float rate = *lr;
    float t = (float)*step;
    float bias1 = 1.0f - powf(beta1, t);
    float bias2_sqrt = sqrtf(1.0f - powf(beta2, t));
    for (unsigned long long i = first_thread(); i < n; i += grid_threads()) {
        float g = to_f32(grads[i]);
        float mi = m[i] + (1.0f - beta1) * (g - m[i]);  // PyTorch's lerp
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bias2_sqrt + eps;
        float p = params[i] * (1.0f - rate * weight_decay);
        p = p - (rate / bias1) * (mi / denom);
        params[i] = p;
        if (weights != nullptr) weights[i] = from_f32<M>(p);
    }
}

// An f32 model: its weights are the master weights.
extern "C" __global__ void adamw_f32(float* params, float* m, float* v, const float* grads, const float* lr,
                                     const unsigned long long* step, float beta1, float beta2, float eps,
                                     float weight_decay, unsigned n) {
    adamw<float>(params, nullptr, m, v, grads, lr, step, beta1, beta2, eps, weight_decay, n);
}

// A bf16 model: f32 master weights in params, bf16 gradients, the bf16 weights rewritten.
extern "C" __global__ void adamw_bf16(float* params, bf16* weights, float* m, float* v, const bf16* grads,
                                      const float* lr, const unsigned long long* step, float beta1, float beta2,
                                      float eps, float weight_decay, unsigned n) {
    adamw<bf16>(params, weights, m, v, grads, lr, step, beta1, beta2, eps, weight_decay, n);
}
