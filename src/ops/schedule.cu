// One optimizer step's bookkeeping on the device: the step counter t advances by one and the
// learning rate of step t is written, so that a captured optimizer step follows its schedule on
// every replay. One thread. The schedule is computed in double and rounded once to float, so
// the CPU path (which does the same) agrees bit for bit in practice.

extern "C" __global__ void lr_schedule_step(unsigned long long* step, float* lr, unsigned kind, float peak,
                                            unsigned long long warmup, unsigned long long total, float floor_frac) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long t = *step + 1;
    *step = t;
    unsigned long long s = t - 1;  // 0-based index of this step
    double rate = (double)peak;
    if (kind == 1) {
        if (s < warmup) {
            rate = (double)peak * (double)(s + 1) / (double)warmup;
        } else {
            unsigned long long span = total > warmup ? total - warmup : 1;
            double progress = (double)(s - warmup) / (double)span;
            if (progress > 1.0) progress = 1.0;
            double f = (double)floor_frac;
            rate = (double)peak * (f + (1.0 - f) * 0.5 * (1.0 + cos(3.141592653589793 * progress)));
        }
    }
    *lr = (float)rate;
}
