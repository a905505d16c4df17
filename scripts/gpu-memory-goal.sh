#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here:
# issue 32's reserved-memory goal at L (graphed's reserved peak at most 0.8 of torch-sdpa-graphed's)
# with lent gradients (`--lend-gradients`) and recomputed activations (`--recompute`), in one lease.
# 1. The GPU tests of what it rests on: lent gradients, recomputation, offloading, the graphed
#    stack, and the FP8 and GEMM tests owed since the seventh session (tests.log).
# 2. `bench graphs --configs L --variants graphed` in bf16 four ways (none, lend, gelu-norm,
#    both, then none again), then torch-sdpa-graphed at L (graphs.log; JSON of none and both).
# 3. `bench memory` at 24 GiB, batch search, with lent gradients (memory.log, memory.json).
# Seven files in $OUT (the device tool returns eight).
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-memory-goal.sh
set -uo pipefail
source scripts/gpu-unpack.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels NCCL_NVLS_ENABLE=0
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; } | tee "$OUT/tests.log"
source scripts/gpu-libraries.sh > /dev/null
tests='(binary(graphed) | binary(offload) | binary(nn_modules) | test(lent) | test(recompute) | test(gemm) | test(fp8)
    | test(cast) | test(gelu) | test(matmul) | test(linear) | test(cudnn) | binary(nn_fp8)) & not test(two_gpus)'
.gpu/cargo-nextest nextest run --archive-file .gpu/tests.tar.zst --workspace-remap . --run-ignored all \
    -E "$tests" --no-fail-fast >> "$OUT/tests.log" 2>&1
grep -E "^\s+(FAIL|SIGSEGV|TIMEOUT)|Summary" "$OUT/tests.log" | tail -20
for run in none:"" lend:"--lend-gradients" gelu-norm:"--recompute gelu-norm" \
        both:"--recompute gelu-norm --lend-gradients" none-again:""; do
    name=${run%%:*}
    json=$(case $name in none|both) echo "--json $OUT/graphs-$name.json" ;; esac)
    echo "# graphed bench graphs --configs L --variants graphed ${run#*:}" | tee -a "$OUT/graphs.log"
    .gpu/graphed bench graphs --device cuda --configs L --variants graphed ${run#*:} --steps 10 $json 2>&1 \
        | tee -a "$OUT/graphs.log" | grep -E "^  graphed "
done
# PyTorch's side at L, fused attention: torch-sdpa-graphed's reserved peak is the goal's yardstick.
python3 bench/torch_reference.py graphs --configs L --attention fused --variants torch-graphed \
    > "$OUT/torch-graphs.json" 2>> "$OUT/graphs.log"
.gpu/graphed bench memory --device cuda --config L --budget 24GiB --search batch --lend-gradients \
    --variants graphed,graphed-recompute --json "$OUT/memory.json" > "$OUT/memory.log" 2>&1
grep -E "largest|against" "$OUT/memory.log"
