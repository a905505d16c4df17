#!/usr/bin/env bash
# The SM clock, power and throttle reasons sampled every 20 ms during L's step, graphed's then
# PyTorch's, on the same input (`bench graphs --configs L --steps 60`; `torch_reference.py graphs
# --configs L`, fused attention), with each side's median clock and power over the samples above
# 400 W: at L the H200 runs at its 700 W cap, and a side that draws more power per step clocks
# lower (bench/results/HISTORY.md, 2026-12-04 and 2026-12-05). Runs on the GPU machine after
# scripts/gpu-prepare.sh; logs and samples in $OUT.
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-clocks-L.sh
set -u
source scripts/gpu-unpack.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels NCCL_NVLS_ENABLE=0
source scripts/gpu-libraries.sh > /dev/null
sample() { nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 20 > "$1" & echo $!; }
p=$(sample $OUT/clocks-graphed.csv)
timeout 100 .gpu/graphed bench graphs --device cuda --configs L --steps 60 > $OUT/run-d.log 2>&1
kill $p
p=$(sample $OUT/clocks-torch.csv)
timeout 90 python3 bench/torch_reference.py graphs --configs L --attention fused --variants torch-graphed,torch-floor \
    >> $OUT/run-d.log 2>&1
kill $p
grep -E "^  graphed |^L torch" $OUT/run-d.log
for f in graphed torch; do
    awk -F', ' -v f=$f '$2 > 400 { n++; c[n] = $1; p[n] = $2 } END {
        asort(c); asort(p); printf "%s: %d samples above 400 W, median %d MHz, %.0f W\n", f, n, c[int((n+1)/2)], p[int((n+1)/2)] }' \
        $OUT/clocks-$f.csv
done
