#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here:
# issue 36's soak, STEPS (default 100 000) graphed data-parallel steps of `train` as two ranks
# (on two GPUs when there are two, else both on GPU 0 through NCCL's sockets), with a 60 s
# `--comm-timeout`, so that a stall ends the run with its report instead of hanging it. Prints
# each rank's exit status, its last lines (the final loss, the step times), and the wall time.
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-soak-ranks.sh > $OUT/soak.log 2>&1
set -uo pipefail
source scripts/gpu-unpack.sh
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels
# NVLink multicast can take a shared host's GPUs out of service: never on here.
export NCCL_NVLS_ENABLE=0
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    export ONE_GPU=1 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
fi
logs=$(mktemp -d)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; }
source scripts/gpu-libraries.sh
source scripts/gpu-functions.sh
steps=${STEPS:-100000}
echo "# two ranks (ONE_GPU=${ONE_GPU:-0}), graphed train, $steps steps"
start=$(date +%s.%N)
# The soak looks for stalls, not for learning: a step whose gradients are not finite (the
# 2026-12-05 soak's loss diverged at step 16 225 at the constant learning rate) is skipped and
# counted, on both ranks alike, instead of ending the run.
run_ranks 2 29800 .gpu/graphed train --steps "$steps" --comm-timeout 60 --layers 2 --dim 64 --heads 1 --batch 16 \
    --on-nonfinite skip
finish
python3 -c "import time; print(f'wall {time.time() - $start:.1f} s')"
for rank in 0 1; do
    echo "# rank $rank"
    tail -6 "$logs/rank$rank.log"
done
