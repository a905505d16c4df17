// cp.async (sm_80 and later): copies from global to shared memory that hold no registers while
// they are in flight, so a kernel can keep several tiles or rows of reads outstanding while it
// computes on earlier ones. A thread's copies form groups (one commit each); wait_group N returns
// once at most N of its groups are pending, and then the data of the others is visible to the
// thread that issued them (to other threads only after a barrier). Prepended to the sources of
// attention.cu and layernorm.cu.

// The shared-memory address (state space offset) that cp.async and ldmatrix take.
__device__ __forceinline__ unsigned smem_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes from src (16-byte aligned) to shared address dst; with `valid` false, 16 zero bytes
// without reading src (which must still be a valid address).
__device__ __forceinline__ void copy16_async(unsigned dst, const void* src, bool valid = true) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

// 4 bytes from src (4-byte aligned) to shared address dst.
__device__ __forceinline__ void copy4_async(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// Closes this thread's current group of copies (an empty group is allowed).
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's groups are pending.
template <int N> __device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
