// A copy of any element type as bytes (float.cu, prepended, for the grid-stride helpers): 16-byte
// chunks where both ends are aligned, bytes otherwise. A kernel rather than a memcpy node where a
// graph's copy is pointed elsewhere between replays: the driver updates a kernel node's
// parameters for less than half a memcpy node's, and `copy_bytes_via` reads its addresses from a
// table, so that pointing it elsewhere updates no node at all (docs/offload.md).

__device__ __forceinline__ void copy_body(unsigned char* y, const unsigned char* x, unsigned long long n) {
    unsigned long long chunks = aligned16(y) && aligned16(x) ? n / 16 : 0;
    const unsigned long long step = grid_threads();
    for (unsigned long long j = first_thread(); j < chunks; j += step)
        reinterpret_cast<uint4*>(y)[j] = reinterpret_cast<const uint4*>(x)[j];
    for (unsigned long long i = chunks * 16 + first_thread(); i < n; i += step) y[i] = x[i];
}

extern "C" __global__ void copy_bytes(unsigned char* y, const unsigned char* x, unsigned long long n) {
    copy_body(y, x, n);
}

// Copies entry[2] bytes (none for 0) from address entry[1] to address entry[0]. `y` and `x` are
// what the node is bound to, which declare its accesses; the code reads the entry, which the
// caller keeps equal to them (the simulator checks that it does).
extern "C" __global__ void copy_bytes_via(unsigned char* y, const unsigned char* x, const unsigned long long* entry) {
    copy_body(reinterpret_cast<unsigned char*>(entry[0]), reinterpret_cast<const unsigned char*>(entry[1]), entry[2]);
}
