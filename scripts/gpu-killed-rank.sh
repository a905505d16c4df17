#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here:
# two ranks of `train` on the one GPU (each its own NCCL host), rank 1 killed with SIGKILL the
# moment rank 0 prints its first step line (the timing of tests/ranks.rs), then how long rank 0
# takes to end and with which message: at once with `RankGone` ("rank 1 left the group"), or by the
# 10 s grace ("still blocked on work that waited for it"). Two seconds after the kill it lists
# what each of rank 0's threads waits in (/proc/PID/task/*/wchan), and their stacks where gdb is. RUNS (default 3) repeats it;
# NCCL_RUNTIME_CONNECT is passed through (default 1).
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-killed-rank.sh
set -uo pipefail
source scripts/gpu-unpack.sh
G=$PWD/.gpu/graphed
fifo=$(mktemp -u)
env_of() { # env_of RANK PORT: the rank's environment, as tests/ranks.rs sets it
    echo RANK=$1 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$2 NCCL_HOSTID=killed-rank-$1 \
        NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_RUNTIME_CONNECT=${NCCL_RUNTIME_CONNECT:-1}
}
for run in $(seq 1 "${RUNS:-3}"); do
    port=$((29600 + run))
    rm -f "$fifo"
    mkfifo "$fifo"
    env $(env_of 0 $port) "$G" train --steps 100000 > "$fifo" 2> /tmp/killed-rank-0.err &
    p0=$!
    env $(env_of 1 $port) "$G" train --steps 100000 > /dev/null 2> /dev/null &
    p1=$!
    exec 3< "$fifo"
    while read -r line <&3; do case $line in step*) kill -9 $p1; break ;; esac; done
    t0=$(date +%s.%N)
    (cat <&3 > /dev/null &)
    sleep 2
    for t in /proc/$p0/task/*; do
        [ -d "$t" ] && echo "  thread $(cat "$t/comm" 2> /dev/null): $(cat "$t/wchan" 2> /dev/null)"
    done
    # The threads' user stacks, where the machine has gdb or cuda-gdb (libraries' symbols only: the binary
    # travels stripped).
    dbg=$(command -v gdb || command -v cuda-gdb)
    [ -n "$dbg" ] && timeout 30 "$dbg" -batch -p $p0 -ex "thread apply all bt 12" 2> /dev/null \
        | grep -E '^Thread|^#' | cut -c1-160 | head -120
    wait $p0
    code=$?
    echo "run $run: rank 0 exit $code after $(python3 -c "import time; print(round(time.time() - $t0, 2))") s: $(tail -1 /tmp/killed-rank-0.err | cut -c1-200)"
    exec 3<&-
done
rm -f "$fifo"
