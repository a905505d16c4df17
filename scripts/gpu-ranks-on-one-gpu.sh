#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here,
# when only one GPU is lent: several ranks as processes on GPU 0, started with torchrun's
# variables. NCCL refuses two ranks of one host on one GPU, so each rank says it is a host of its
# own (NCCL_HOSTID), and NCCL joins them through its socket transport on the loopback interface.
# That runs, with real NCCL and real processes, what needs several ranks but not several GPUs: the
# pipeline, data-parallel and grid (four ranks) examples against one GPU, `train` data parallel
# (graphed, eager, under a schedule), `launch --nnodes 2`, `bench parallel`'s code paths, and a rank
# killed mid-run (rank 1, then rank 0). Its times say nothing of several GPUs: the ranks share one,
# and their exchanges go through host sockets.
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-ranks-on-one-gpu.sh > $OUT/ranks.log 2>&1
set -uo pipefail
source scripts/gpu-unpack.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels
# NVLink multicast can take a shared host's GPUs out of service: never on here.
export NCCL_NVLS_ENABLE=0 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
export ONE_GPU=1
logs=$(mktemp -d)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; }
source scripts/gpu-libraries.sh
source scripts/gpu-functions.sh
# Two ranks at port $1, each running `graphed ${@:2}`.
start() {
    run_ranks 2 "$1" .gpu/graphed "${@:2}"
}
port=29700
# The examples: a pipeline against the whole model and data parallelism against one GPU with both
# microbatches (two ranks), the grid of 2 stages × 2 replicas against both replicas summed (four
# ranks), bit for bit; each rank checks and says so.
for example in pipeline:2 data_parallel:2 grid:4; do
    port=$((port + 1))
    echo "# ${example#*:} ranks on one GPU: examples/${example%%:*}"
    run_ranks "${example#*:}" $port ".gpu/examples/${example%%:*}"
    finish
    cat "$logs"/rank*.log | grep -E "bit for bit|panicked|rror"
done
for mode in "" "--eager" "--schedule" "--schedule --eager"; do
    port=$((port + 1))
    echo "# two ranks on one GPU: graphed train $mode --steps 300"
    start $port train $mode --steps 300
    finish
    grep -vE '^step' "$logs/rank0.log" | head -12
    cp "$logs/rank0.log" "$logs/train${mode// /}.log"
done
# Two ranks sum two values, which no order changes: eager and graphed steps give the same bits.
for pair in ":--eager" "--schedule:--schedule--eager"; do
    base=${pair%%:*} mode=${pair#*:}
    same_loss "$logs/train$base.log" "$logs/train$mode.log" "two ranks, train $mode" "train ${base:-(graphed)}"
done
# Two "hosts" of one rank each through `graphed launch --nnodes 2` (torchrun's flags): the same
# group as the two ranks started by hand, so the same loss lines.
port=$((port + 1))
echo "# two ranks on one GPU: graphed launch --nnodes 2 --node-rank <0 or 1> --gpus 1 -- train --steps 300"
nodes=()
for node in 0 1; do
    NCCL_HOSTID=graphed-node-$node .gpu/graphed launch --nnodes 2 \
        --node-rank $node --master-addr 127.0.0.1 --port $port --gpus 1 -- train --steps 300 > "$logs/node$node.log" 2>&1 &
    nodes+=($!)
done
for node in 0 1; do
    wait "${nodes[$node]}"
    echo "  launcher of node $node: exit $?; $(grep -m1 '^rank' "$logs/node$node.log")"
done
same_loss "$logs/train.log" "$logs/node0.log" "launch --nnodes 2" "the two ranks started by hand" \
    || tail -5 "$logs/node0.log"
port=$((port + 1))
echo "# two ranks on one GPU: graphed bench parallel --configs M --steps 5 --warmup 2"
start $port bench parallel --configs M --steps 5 --warmup 2
finish
grep -vE '^step' "$logs/rank0.log" | tail -14
# A rank killed mid-run: the other must end by itself within seconds, with an error naming it.
for dead in 1 0; do
    port=$((port + 1))
    echo "# two ranks on one GPU: train --steps 100000, rank $dead killed with SIGKILL after the first step"
    start $port train --steps 100000
    for _ in $(seq 1 240); do grep -q '^step' "$logs/rank0.log" && break; sleep 0.5; done
    killed=$(date +%s.%N)
    kill -9 "${pids[$dead]}"
    survivor=$((1 - dead))
    wait "${pids[$survivor]}"
    code=$?
    took=$(python3 -c "import time; print(f'{time.time() - $killed:.2f}')")
    wait "${pids[$dead]}" 2> /dev/null
    echo "  rank $survivor: exit $code, $took s after rank $dead was killed"
    grep -vE '^step' "$logs/rank$survivor.log" | tail -6
done
rm -rf "$logs"
