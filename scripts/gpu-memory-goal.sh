#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here:
# issue 32's reserved-memory goal at L (graphed's reserved peak at most 0.8 of torch-sdpa-graphed's)
# with lent gradients (`--lend-gradients`) and recomputed activations (`--recompute`), in one lease.
# 1. The GPU tests of what it rests on: lent gradients, recomputation, offloading, the graphed
#    stack, and the FP8 and GEMM tests owed since the seventh session (tests.log).
# 2. `bench graphs --configs L --variants graphed` in bf16 four ways (none, lend, gelu-norm,
#    both, then none again; RUNS="name:flag,flag … name:flag" for others),
#    then torch-sdpa-graphed at L (graphs.log; JSON of the runs named none, both and kernels-both).
# 3. `bench memory` at 24 GiB, batch search, with lent gradients (memory.log, memory.json).
# Seven files in $OUT (the device tool returns eight). Parts 1 and 2 take about six minutes
# and part 3 about four, so a call of the device tool (ten at most) runs PART=1 (1 and 2) or
# PART=3; without PART, all three.
# Usage (device tool, carry [".gpu"]): PART=1 bash scripts/gpu-memory-goal.sh
set -uo pipefail
source scripts/gpu-unpack.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels NCCL_NVLS_ENABLE=0
source scripts/gpu-libraries.sh > /dev/null
part=${PART:-all}
if [ "$part" != 3 ]; then
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; } | tee "$OUT/tests.log"
tests='(binary(graphed) | binary(offload) | binary(nn_modules) | test(lent) | test(lend) | test(recompute) | test(gemm)'
tests+=' | test(fp8) | test(cast) | test(gelu) | test(matmul) | test(linear) | test(cudnn) | binary(nn_fp8))'
tests+=' & not test(two_gpus)'
.gpu/cargo-nextest nextest run --archive-file .gpu/tests.tar.zst --workspace-remap . --run-ignored all \
    -E "$tests" --no-fail-fast >> "$OUT/tests.log" 2>&1
grep -E "^\s+(FAIL|SIGSEGV|TIMEOUT)|Summary" "$OUT/tests.log" | tail -20
runs="none: lend:--lend-gradients gelu-norm:--recompute,gelu-norm both:--recompute,gelu-norm,--lend-gradients none-again:"
for run in ${RUNS:-$runs}; do
    name=${run%%:*}
    flags=${run#*:}
    flags=${flags//,/ }
    json=$(case $name in none|both|kernels-both) echo "--json $OUT/graphs-$name.json" ;; esac)
    echo "# graphed bench graphs --configs L --variants graphed $flags" | tee -a "$OUT/graphs.log"
    .gpu/graphed bench graphs --device cuda --configs L --variants graphed $flags --steps 10 $json 2>&1 \
        | tee -a "$OUT/graphs.log" | grep -E "^  graphed |ran on"
done
# PyTorch's side at L, fused attention: torch-sdpa-graphed's reserved peak is the goal's yardstick.
python3 bench/torch_reference.py graphs --configs L --attention fused --variants torch-graphed \
    > "$OUT/torch-graphs.json" 2>> "$OUT/graphs.log"
python3 -c 'import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["config"], r["variant"], "wall %.3f ms" % r["wall_ms"], "peak reserved %d MiB" % (r["peak_reserved_bytes"] >> 20))' \
    "$OUT/torch-graphs.json" | tee -a "$OUT/graphs.log"
fi
[ "$part" = 1 ] && exit 0
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; } > "$OUT/memory.log"
.gpu/graphed bench memory --device cuda --config L --budget 24GiB --search batch --lend-gradients \
    --variants graphed,graphed-recompute --json "$OUT/memory.json" >> "$OUT/memory.log" 2>&1
grep -E "largest|against" "$OUT/memory.log"
