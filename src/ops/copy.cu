// A copy of any element type as bytes (float.cu, prepended, for the grid-stride helpers): 16-byte
// chunks where both ends are aligned, bytes otherwise. A kernel rather than a memcpy node where a
// graph's copy is pointed elsewhere between replays: the driver updates a kernel node's
// parameters for less than half a memcpy node's (docs/offload.md).

extern "C" __global__ void copy_bytes(unsigned char* y, const unsigned char* x, unsigned long long n) {
    unsigned long long chunks = aligned16(y) && aligned16(x) ? n / 16 : 0;
    const unsigned long long step = grid_threads();
    for (unsigned long long j = first_thread(); j < chunks; j += step)
        reinterpret_cast<uint4*>(y)[j] = reinterpret_cast<const uint4*>(x)[j];
    for (unsigned long long i = chunks * 16 + first_thread(); i < n; i += step) y[i] = x[i];
}
