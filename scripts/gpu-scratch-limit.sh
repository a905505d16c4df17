#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here:
# how much of L's step the scratch limit of cuDNN's deterministic attention backward costs
# (issues 31 and 34). `bench graphs --configs L --variants graphed`, alternating the default limit
# (the call's operands, 256 MiB at L: four executions per layer) with 1 GiB (one execution), in
# FP8 then bf16, and FP8 with the nondeterministic backward (no scratch) as the bound. About three
# minutes; the lines in $OUT/scratch.log.
# Usage (device tool, carry [".gpu/bins.tar.gz", ".gpu/commit.txt"]): bash scripts/gpu-scratch-limit.sh
set -uo pipefail
source scripts/gpu-unpack.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels
source scripts/gpu-libraries.sh > /dev/null
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; } | tee "$OUT/scratch.log"
for run in "fp8 default" "fp8 1024" "fp8 default" "fp8 1024" "fp8 nondeterministic" "bf16 default" "bf16 1024" \
    "bf16 default" "bf16 1024"; do
    set -- $run
    case "$2" in
        default) extra=() ;;
        1024) extra=(--scratch-limit-mib 1024) ;;
        nondeterministic) extra=(--attention-backend cudnn-nondeterministic) ;;
    esac
    echo "## $1, $2" | tee -a "$OUT/scratch.log"
    timeout 60 .gpu/graphed bench graphs --device cuda --configs L --variants graphed --dtype "$1" "${extra[@]}" 2>&1 |
        grep -E "graphed |ran on" | cut -c1-260 | tee -a "$OUT/scratch.log"
done
