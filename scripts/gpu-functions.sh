# Sourced by the scripts that run on the GPU machine: starting a group of ranks with torchrun's
# variables, waiting for it, and comparing runs by their loss lines.

# The lines of train's log $1 that a run's numbers are compared by.
loss_lines() {
    grep -E '^step|^final|accuracy' "$1"
}

# Says whether the runs logged in $1 and $2 have equal loss lines: "$3: loss lines equal to $4"
# (or DIFFER from); returns 1 when they differ.
same_loss() {
    if diff <(loss_lines "$1") <(loss_lines "$2") > /dev/null; then
        echo "$3: loss lines equal to $4"
    else
        echo "$3: loss lines DIFFER from $4"
        return 1
    fi
}

pids=()
# Starts the $1 ranks of a group meeting at port $2 of this host, each running `${@:3}`; rank r's
# log is $logs/rank<r>.log, their pids are in $pids. Rank r uses GPU r, or with ONE_GPU=1 GPU 0
# as a host of its own to NCCL (NCCL refuses two ranks of one host on one GPU).
run_ranks() {
    local rank
    pids=()
    for rank in $(seq 0 $(($1 - 1))); do
        if [ "${ONE_GPU:-0}" = 1 ]; then
            RANK=$rank LOCAL_RANK=0 NCCL_HOSTID=graphed-rank-$rank WORLD_SIZE=$1 MASTER_ADDR=127.0.0.1 \
                MASTER_PORT=$2 "${@:3}" > "$logs/rank$rank.log" 2>&1 &
        else
            RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$2 "${@:3}" \
                > "$logs/rank$rank.log" 2>&1 &
        fi
        pids+=($!)
    done
}

# Waits for every rank that run_ranks started; says each one's exit status.
finish() {
    local rank
    for rank in "${!pids[@]}"; do
        wait "${pids[$rank]}"
        echo "  rank $rank: exit $?"
    done
}
