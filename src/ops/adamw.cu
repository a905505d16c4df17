// AdamW (decoupled weight decay, as PyTorch's torch.optim.AdamW) over one flat buffer of all
// parameters, one thread per parameter in a grid-stride loop: no reductions, no atomics (the scan
// below has one order-independent atomicMin). Compiled after float.cu. The master weights and both moments are f32 and the update is computed in f32;
// the gradients have the model's type M (f32, or bf16 widened exactly). For a bf16 model the same
// thread also writes bf16(updated master) into the model's weights, so they never drift from it.
// The learning rate and the step count t are read from device memory, so a captured optimizer
// graph follows a schedule and counts its steps across replays.
//
// Before the update, nonfinite_scan reads every gradient once and writes the guard (four u64, as
// PyTorch's GradScaler keeps found_inf on the device): the update kernel then reads the guard and
// skips the whole step (parameters, moments, bf16 weights untouched), with no host sync.

// The guard's slots (adamw.rs: GUARD_*).
enum {
    GUARD_LAST = 0,     // the last step t with a non-finite gradient; 0 for none
    GUARD_FIRST = 1,    // the first such step; 0 for none
    GUARD_INDEX = 2,    // the flat index of the first non-finite gradient of step GUARD_FIRST; ~0 for none
    GUARD_SKIPPED = 3,  // steps whose update was skipped
};

// Neither infinite nor NaN: an exponent that is not all ones.
__device__ __forceinline__ bool finite_f32(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// Each thread finds the lowest index of a non-finite gradient among its elements (it visits them
// in increasing order and stops at the first), then records the step. Deterministic: every thread
// that writes GUARD_LAST and GUARD_FIRST writes the same t, GUARD_FIRST is only 0 or t while the
// kernel runs (earlier launches have finished), and GUARD_INDEX is the minimum over the threads
// (atomicMin, whose result does not depend on their order).
template <typename M>
__device__ void nonfinite_scan(unsigned long long* guard, const M* grads, const unsigned long long* step,
                               unsigned n) {
    constexpr int W = Lanes<M>::N;
    const unsigned long long none = ~0ull;
    unsigned long long bad = none;
    unsigned long long chunks = aligned16(grads) ? n / W : 0;
    for (unsigned long long j = first_thread(); j < chunks && bad == none; j += grid_threads()) {
        Chunk<M, W> c = load_chunk<M, W>(grads + j * W);
        for (int e = 0; e < W; ++e) {
            if (!finite_f32(to_f32(c.v[e]))) {
                bad = j * W + e;
                break;
            }
        }
    }
    // The tail's indices are above every chunk's, so a thread's first find stays its lowest.
    for (unsigned long long i = chunks * W + first_thread(); i < n && bad == none; i += grid_threads()) {
        if (!finite_f32(to_f32(grads[i]))) bad = i;
    }
    if (bad == none) return;
    unsigned long long t = *step;
    guard[GUARD_LAST] = t;
    unsigned long long first = guard[GUARD_FIRST];
    if (first == 0 || first == t) {
        guard[GUARD_FIRST] = t;
        atomicMin(&guard[GUARD_INDEX], bad);
    }
}

extern "C" __global__ void nonfinite_scan_f32(unsigned long long* guard, const float* grads,
                                              const unsigned long long* step, unsigned n) {
    nonfinite_scan<float>(guard, grads, step, n);
}

extern "C" __global__ void nonfinite_scan_bf16(unsigned long long* guard, const bf16* grads,
                                               const unsigned long long* step, unsigned n) {
    nonfinite_scan<bf16>(guard, grads, step, n);
}

// The update reads the guard that nonfinite_scan wrote for this step: with `stop`, any recorded
// non-finite step skips it (the guard is sticky: the state stays that of the last good step);
// without, only a non-finite gradient of this step t does. Every thread reads the same two
// slots; thread 0 alone counts the skipped step, in a slot no thread reads.
template <typename M>
__device__ void adamw(float* params, M* weights, float* m, float* v, const M* grads, const float* lr,
                      const unsigned long long* step, unsigned long long* guard, float beta1, float beta2, float eps,
                      float weight_decay, unsigned stop, unsigned n) {
    unsigned long long step_t = *step;
    bool skip = stop ? guard[GUARD_FIRST] != 0 : guard[GUARD_LAST] == step_t;
    if (skip) {
        if (first_thread() == 0) guard[GUARD_SKIPPED] += 1;
        return;
    }
    float rate = *lr;
    float t = (float)step_t;
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
                                     const unsigned long long* step, unsigned long long* guard, float beta1,
                                     float beta2, float eps, float weight_decay, unsigned stop, unsigned n) {
    adamw<float>(params, nullptr, m, v, grads, lr, step, guard, beta1, beta2, eps, weight_decay, stop, n);
}

// A bf16 model: f32 master weights in params, bf16 gradients, the bf16 weights rewritten.
extern "C" __global__ void adamw_bf16(float* params, bf16* weights, float* m, float* v, const bf16* grads,
                                      const float* lr, const unsigned long long* step, unsigned long long* guard,
                                      float beta1, float beta2, float eps, float weight_decay, unsigned stop,
                                      unsigned n) {
    adamw<bf16>(params, weights, m, v, grads, lr, step, guard, beta1, beta2, eps, weight_decay, stop, n);
}
