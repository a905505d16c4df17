# Sourced by the scripts that run on the GPU machine, from the repository root: the libraries the
# binaries load at run time, found on that machine, and what it says of them on two lines.
# NVTX's library, for the profiler ranges: cudarc loads libnvToolsExt.so(.1); CUDA 13 ships
# libnvtx3interop.so.1 instead, with the same entry points, so it is linked under that name. With
# it on the path, the CUDA tests and train push and pop real NVTX ranges (train's device line
# says whether they do).
nvtx=$(ls /usr/local/cuda*/targets/x86_64-linux/lib/libnvtx3interop.so.1 2>/dev/null | head -1)
if [ -n "$nvtx" ]; then
    mkdir -p .gpu/nvtx && ln -sf "$nvtx" .gpu/nvtx/libnvToolsExt.so
    export LD_LIBRARY_PATH="$PWD/.gpu/nvtx:${LD_LIBRARY_PATH:-}"
fi
echo "# NVTX: ${nvtx:-none}"
# NCCL for the tests: the system's libnccl.so, else PyTorch's libnccl.so.2 linked under the name
# cudarc loads (as `graphed launch` does for its ranks).
if ! ls /usr/lib/x86_64-linux-gnu/libnccl.so > /dev/null 2>&1; then
    nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
    if [ -n "$nccl" ] && [ -e "$nccl" ]; then
        mkdir -p .gpu/nccl && ln -sf "$nccl" .gpu/nccl/libnccl.so
        export LD_LIBRARY_PATH="$PWD/.gpu/nccl:${LD_LIBRARY_PATH:-}"
    fi
fi
echo "# NCCL: $(ls /usr/lib/x86_64-linux-gnu/libnccl.so.2.* .gpu/nccl/libnccl.so 2>/dev/null | tr '\n' ' ')"
