#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here,
# when only one GPU is lent: two ranks as two processes on GPU 0, started with torchrun's variables.
# NCCL refuses two ranks of one host on one GPU, so each rank says it is a host of its own
# (NCCL_HOSTID), and NCCL joins them through its socket transport on the loopback interface. That
# runs, with real NCCL and two real processes, what needs two ranks but not two GPUs: `train` data
# parallel (graphed, eager, under a schedule), `bench parallel`'s code paths, and a rank killed
# mid-run (rank 1, then rank 0). Its times say nothing of two GPUs: both ranks share one, and their
# exchanges go through host sockets.
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-two-ranks-one-gpu.sh > $OUT/two-ranks.log 2>&1
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels
# NVLink multicast can take a shared host's GPUs out of service: never on here.
export NCCL_NVLS_ENABLE=0 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
export WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
logs=$(mktemp -d)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; }
source scripts/gpu-libraries.sh
pids=()
# Starts both ranks of a group at port $1, each running `${@:2}`; their logs are
# $logs/rank0.log and $logs/rank1.log, their pids in $pids.
run_ranks() {
    pids=()
    for rank in 0 1; do
        RANK=$rank NCCL_HOSTID=graphed-rank-$rank MASTER_PORT=$1 "${@:2}" > "$logs/rank$rank.log" 2>&1 &
        pids+=($!)
    done
}
# As run_ranks, each running `graphed ${@:2}`.
start() {
    run_ranks "$1" .gpu/graphed "${@:2}"
}
# Waits for both ranks; says each one's exit status.
finish() {
    for rank in 0 1; do
        wait "${pids[$rank]}"
        echo "  rank $rank: exit $?"
    done
}
port=29700
# The examples as two ranks: a pipeline against the whole model, and data parallelism against one
# GPU with both microbatches, bit for bit (each checks and says so).
for example in pipeline data_parallel; do
    port=$((port + 1))
    echo "# two ranks on one GPU: examples/$example"
    run_ranks $port .gpu/examples/$example
    finish
    cat "$logs/rank0.log" "$logs/rank1.log" | grep -E "bit for bit|panicked|rror"
done
for mode in "" "--eager" "--schedule" "--schedule --eager"; do
    port=$((port + 1))
    echo "# two ranks on one GPU: graphed train $mode --steps 300"
    start $port train $mode --steps 300
    finish
    grep -vE '^step' "$logs/rank0.log" | head -12
    grep -E '^step|^final|accuracy' "$logs/rank0.log" > "$logs/loss${mode// /}.txt"
done
# Two ranks sum two values, which no order changes: eager and graphed steps give the same bits.
for pair in ":--eager" "--schedule:--schedule--eager"; do
    base=${pair%%:*} mode=${pair#*:}
    if diff "$logs/loss$base.txt" "$logs/loss$mode.txt" > /dev/null; then
        echo "two ranks, train $mode: loss lines equal to train $base"
    else
        echo "two ranks, train $mode: loss lines DIFFER from train $base"
    fi
done
# Two "hosts" of one rank each through `graphed launch --nnodes 2` (torchrun's flags): the same
# group as the two ranks started by hand, so the same loss lines.
port=$((port + 1))
echo "# two ranks on one GPU: graphed launch --nnodes 2 --node-rank <0 or 1> --gpus 1 -- train --steps 300"
nodes=()
for node in 0 1; do
    env -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR NCCL_HOSTID=graphed-node-$node .gpu/graphed launch --nnodes 2 \
        --node-rank $node --master-addr 127.0.0.1 --port $port --gpus 1 -- train --steps 300 > "$logs/node$node.log" 2>&1 &
    nodes+=($!)
done
for node in 0 1; do
    wait "${nodes[$node]}"
    echo "  launcher of node $node: exit $?; $(grep -m1 '^rank' "$logs/node$node.log")"
done
if diff "$logs/loss.txt" <(grep -E '^step|^final|accuracy' "$logs/node0.log") > /dev/null; then
    echo "launch --nnodes 2: loss lines equal to the two ranks started by hand"
else
    echo "launch --nnodes 2: loss lines DIFFER from the two ranks started by hand"
    tail -5 "$logs/node0.log"
fi
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
