#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here:
# every test (the CUDA variants included), train in each mode (with and without activation
# offloading) with their loss lines compared (bf16, the default on CUDA, and f32), the benchmarks
# named in $BENCHES (default: graphs; its `--configs` from $BENCH_ARGS; "none" for none) and
# PyTorch's side of `graphs` in the same run, after PyTorch's module is checked against graphed's
# on the same weights and inputs (`parity`, its JSON lines at the top of graphs.log), `inspect`
# with and without offloading. `graphs` and `layer` run graphed's side with each attention form:
# `--attention fused` (the default form) into <bench>.json, `--attention unfused` into
# <bench>-unfused.json; PyTorch's side of `graphs` runs both forms into torch-graphs.json (its
# torch-sdpa-* variants are the fused ones), and SDPA alone at L's attention shape, per backend
# (`torch_reference.py attention`), as one JSON line at the end of graphs.log. `graphed report`
# reads one graphed file of a benchmark per commit: keep the unfused one under bench/results as
# .txt, or it ties with the fused one. `memory` runs PyTorch's side of its searches into
# torch-memory.json (its budget and configuration from $BENCH_ARGS and $TORCH_ARGS alike). Logs and JSON go to $OUT; the device tool returns at most
# 8 files: ONLY_BENCHES=1 BENCHES=graphs writes 5; a whole run with BENCHES=graphs writes 10, so
# run it with BENCHES=none and the benchmarks as ONLY_BENCHES=1. ONLY_PARALLEL=1: the two-GPU
# tests and the several-GPU runs.
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-run.sh
set -uo pipefail
source scripts/gpu-unpack.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels
# NVLink multicast can take a shared host's GPUs out of service: never on here (tests included).
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L | wc -l)
# One step of the benchmark model by graphed and by PyTorch's module on the same weights, inputs
# and upstream gradient, compared tensor by tensor (`bench/torch_reference.py parity`: one JSON
# line each): bf16, as timed, at S, M and L, and f32 at S, whose tighter tolerance sees smaller
# mismatches. Fails if any comparison does, so that PyTorch's timings are of the same work.
parity() {
    local dir ok=0
    dir=$(mktemp -d)
    for run in S:bf16 M:bf16 L:bf16 S:f32; do
        .gpu/graphed bench parity --device cuda --config "${run%%:*}" --dtype "${run#*:}" \
            --out "$dir/parity.safetensors" > /dev/null || ok=1
        python3 bench/torch_reference.py parity "$dir/parity.safetensors" || ok=1
    done
    rm -rf "$dir"
    return $ok
}
# Bench $1 (and PyTorch's side of graphs, once parity passed), its output in $OUT/$1.log; graphs
# and layer once per attention form, the fused one into $1.json.
bench() {
    local same=0 form
    [ "$1" = none ] && return 0
    if [ "$1" = graphs ]; then
        parity > "$OUT/graphs.log" 2>&1 || same=1
    fi
    if [ "$1" = graphs ] || [ "$1" = layer ]; then
        for form in fused unfused; do
            echo "# graphed bench $1 --attention $form" | tee -a "$OUT/$1.log"
            .gpu/graphed bench "$1" --device cuda --attention $form ${BENCH_ARGS:-} \
                --json "$OUT/$1$([ $form = fused ] || echo -$form).json" 2>&1 | tee -a "$OUT/$1.log"
        done
    else
        .gpu/graphed bench "$1" --device cuda ${BENCH_ARGS:-} --json "$OUT/$1.json" 2>&1 | tee -a "$OUT/$1.log"
    fi
    if [ "$1" = graphs ] && [ "$same" = 0 ]; then
        # Both attention forms, each configuration's unfused variants then its torch-sdpa-* ones.
        python3 bench/torch_reference.py graphs --attention both ${TORCH_ARGS:-} > "$OUT/torch-graphs.json" \
            2>> "$OUT/graphs.log"
        { echo "# bench/torch_reference.py attention (L's attention shape: batch 2, 64 heads, 2048 tokens, causal)";
          python3 bench/torch_reference.py attention; } >> "$OUT/graphs.log" 2>&1
    elif [ "$1" = memory ]; then
        # PyTorch's side of the same searches, with the same budget and configuration.
        python3 bench/torch_reference.py memory ${TORCH_ARGS:-} > "$OUT/torch-memory.json" 2>> "$OUT/memory.log"
    elif [ "$1" = graphs ]; then
        echo "parity FAILED: PyTorch's side not timed (the parity lines at the top of graphs.log say where)" \
            | tee -a "$OUT/graphs.log"
    fi
}
# ONLY_BENCHES=1: the benchmarks alone (a run after one that tested the same code).
if [ "${ONLY_BENCHES:-0}" = 1 ]; then
    { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; } > "$OUT/device.txt"
    for name in ${BENCHES:-graphs}; do
        bench "$name"
    done
    exit 0
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; cat .gpu/commit.txt; } | tee "$OUT/tests.log"
source scripts/gpu-libraries.sh >> "$OUT/tests.log"
source scripts/gpu-functions.sh
tail -2 "$OUT/tests.log"
# The `two_gpus` tests need two GPUs: with one, they are left out (and the summary says so).
only=$([ "$gpus" -ge 2 ] || echo "not test(two_gpus)")
# ONLY_PARALLEL=1: the two-GPU tests and the several-GPU runs alone (after a run on one GPU that
# tested the same code).
if [ "${ONLY_PARALLEL:-0}" = 1 ]; then
    only=$([ "$gpus" -ge 2 ] && echo "test(two_gpus)" || echo "none()")
fi
echo "# $gpus GPU(s); filter: ${only:-none}" | tee -a "$OUT/tests.log"
.gpu/cargo-nextest nextest run --archive-file .gpu/tests.tar.zst --workspace-remap . --run-ignored all \
    ${only:+-E "$only"} --no-fail-fast 2>&1 | tee -a "$OUT/tests.log" \
    | grep -E "^\s+(FAIL|SIGSEGV|TIMEOUT)|Summary|passed|failed|two_gpus" | tail -60
# The device tool returns at most 8 files: train's logs go into one.
logs=$(mktemp -d)
if [ "${ONLY_PARALLEL:-0}" != 1 ]; then
    for mode in graphed side-stream pool-per-layer whole-step eager f32 offload offload-side offload-eager schedule \
            schedule-eager; do
        flag=$(case $mode in
            graphed) ;;
            f32) echo "--dtype f32" ;;
            # Margin 0: the default two-layer model would keep both layers (the margin of two).
            offload) echo "--offload --offload-margin 0" ;;
            offload-side) echo "--offload --offload-margin 0 --side-stream" ;;
            offload-eager) echo "--offload --offload-margin 0 --eager" ;;
            schedule-eager) echo "--schedule --eager" ;;
            *) echo "--$mode" ;;
        esac)
        .gpu/graphed train $flag > "$logs/$mode.log" 2>&1
        { echo "# graphed train $flag"; cat "$logs/$mode.log"; } >> "$OUT/train.log"
        tail -3 "$logs/$mode.log"
    done
    # Microbatches change the GEMMs' shapes: the schedule's modes compare with each other.
    for pair in graphed:side-stream graphed:pool-per-layer graphed:whole-step graphed:eager graphed:offload \
            graphed:offload-side graphed:offload-eager schedule:schedule-eager; do
        base=${pair%%:*} mode=${pair#*:}
        same_loss "$logs/$base.log" "$logs/$mode.log" "train $mode" "$base"
    done | tee -a "$OUT/train.log"
fi
# Several GPUs: every GPU of this machine, one process each through `graphed launch` (data
# parallel, NCCL from PyTorch's package when the system has none), with and without a schedule;
# with one GPU, the group of one must train exactly as a plain run (its all-reduce is the
# identity).
{
    echo "# $gpus GPU(s); system NCCL: $(ls /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null | tr '\n' ' ')"
    echo "# python's NCCL: $(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>&1 | tail -1)"
    for mode in "" "--schedule"; do
        .gpu/graphed launch --gpus "$gpus" -- train $mode --steps 300 > "$logs/launch$mode.log" 2>&1
        echo "graphed launch --gpus $gpus -- train $mode --steps 300: exit $?"
        grep -vE '^step' "$logs/launch$mode.log"
        if [ "$gpus" = 1 ]; then
            .gpu/graphed train $mode --steps 300 > "$logs/plain.log" 2>&1
            same_loss "$logs/plain.log" "$logs/launch$mode.log" "launch --gpus 1 -- train $mode" "a plain run"
        fi
    done
    # Two "hosts" of one GPU each (a launcher per GPU, torchrun's flags): the same group, so the
    # same loss lines as one launcher of two.
    if [ "$gpus" -ge 2 ]; then
        nodes=()
        for node in 0 1; do
            CUDA_VISIBLE_DEVICES=$node .gpu/graphed launch --nnodes 2 --node-rank $node --master-addr 127.0.0.1 \
                --port 29610 --gpus 1 -- train --steps 300 > "$logs/node$node.log" 2>&1 &
            nodes+=($!)
        done
        for node in 0 1; do
            wait "${nodes[$node]}"
            echo "launch --nnodes 2 --node-rank $node: exit $?; $(grep -m1 '^rank' "$logs/node$node.log")"
        done
        same_loss "$logs/launch.log" "$logs/node0.log" "launch --nnodes 2 (one GPU per launcher)" \
            "launch --gpus 2" || tail -5 "$logs/node0.log"
    fi
    .gpu/graphed launch --gpus "$gpus" -- bench parallel --configs "${PARALLEL_CONFIGS:-M,L}" --json "$OUT/parallel.json" 2>&1
    echo "bench parallel: exit $?"
    # $NCCL_CTAS_SWEEP: the same at L with NCCL held to that many CTAs each (less contention with
    # the GEMMs the reductions overlap, slower reductions), rows in this log only. It is about the
    # data-parallel rows: two microbatches keep the pipelines' rows short.
    for ctas in ${NCCL_CTAS_SWEEP:-}; do
        echo "# NCCL_MAX_CTAS=$ctas"
        NCCL_MAX_CTAS=$ctas .gpu/graphed launch --gpus "$gpus" -- bench parallel --configs L --steps 10 --warmup 2 \
            --microbatches 2 2>&1
    done
    # The examples as two ranks, one GPU each (torchrun's variables by hand): each checks its
    # results against one GPU, bit for bit, and says so.
    if [ "$gpus" -ge 2 ]; then
        port=29630
        for example in pipeline data_parallel; do
            port=$((port + 1))
            echo "# two ranks, one GPU each: examples/$example"
            run_ranks 2 $port .gpu/examples/$example
            finish
            cat "$logs"/rank*.log | grep -E "bit for bit|panicked|rror"
        done
    fi
    # A rank killed mid-run (rank 1, then rank 0, whose death the others see directly): the other
    # must end by itself within seconds with an error naming it, and the launcher with a failure.
    if [ "$gpus" -ge 2 ]; then
        for dead in 1 0; do
            .gpu/graphed launch --gpus 2 --port $((29620 + dead)) -- train --steps 100000 > "$logs/killed.log" 2>&1 &
            launcher=$!
            for _ in $(seq 1 240); do grep -q '^step' "$logs/killed.log" && break; sleep 0.5; done
            victim=
            for p in $(pgrep -P "$launcher"); do
                tr '\0' '\n' < "/proc/$p/environ" | grep -qx "RANK=$dead" && victim=$p
            done
            killed=$(date +%s.%N)
            kill -9 "$victim"
            # Where the survivor is, if it has not ended 15 s later.
            sleep 15
            for p in $(pgrep -P "$launcher"); do
                echo "the survivor (pid $p) still runs 15 s after; its threads:"
                for t in /proc/$p/task/*; do echo "  $(cat $t/comm) $(cat $t/wchan)"; done | sort | uniq -c | head -20
                command -v gdb > /dev/null && timeout 30 gdb -p "$p" -batch -ex "thread apply all bt 12" 2>/dev/null \
                    | grep -E "^Thread|^#" | head -120
            done
            wait "$launcher"
            code=$?
            took=$(python3 -c "import time; print(f'{time.time() - $killed:.2f}')")
            echo "rank $dead (pid $victim) killed with SIGKILL: launch exit $code after $took s"
            grep -vE '^step' "$logs/killed.log" | tail -8
        done
    fi
} 2>&1 | tee "$OUT/parallel.log"
[ "${ONLY_PARALLEL:-0}" = 1 ] && exit 0
# A byte-level model of a local text file (this README).
{ echo "# graphed train --data README.md --steps 300"; .gpu/graphed train --data README.md --steps 300 2>&1 | tail -6; } \
    | tee -a "$OUT/train.log"
# A run stopped halfway, saved and resumed against one that never stopped: equal checkpoints.
{
    for mode in "" "--eager"; do
        .gpu/graphed train $mode --steps 300 --dropout 0.1 --save "$logs/whole" > /dev/null 2>&1
        .gpu/graphed train $mode --steps 300 --dropout 0.1 --stop-at 150 --save "$logs/half" > /dev/null 2>&1
        .gpu/graphed train $mode --steps 300 --dropout 0.1 --resume "$logs/half" --save "$logs/resumed" 2>&1 | grep -E resumed
        if cmp -s "$logs/whole/checkpoint.safetensors" "$logs/resumed/checkpoint.safetensors"; then
            echo "train $mode --resume: checkpoint equal to the run that never stopped"
        else
            echo "train $mode --resume: checkpoint DIFFERS from the run that never stopped"
        fi
    done
} 2>&1 | tee -a "$OUT/train.log"
# Misuse on the real thing: the checker on in every mode (it must report nothing), a damaged
# kernel cache (recompiled with a warning, never loaded), a model too big for the GPU (a typed
# error, exit 2).
{
    for mode in graphed side-stream pool-per-layer eager; do
        flag=$([ "$mode" = graphed ] || echo "--$mode")
        GRAPHED_CHECK=1 .gpu/graphed train $flag --steps 200 > "$logs/checked.log" 2>&1
        echo "GRAPHED_CHECK=1 graphed train $flag --steps 200: exit $?, $(grep -c WARN "$logs/checked.log") warnings;" \
            "$(grep checker "$logs/checked.log")"
    done
    for damage in truncate overwrite; do
        for f in "$GRAPHED_KERNEL_CACHE"/*.cubin; do
            size=$(stat -c %s "$f")
            if [ "$damage" = truncate ]; then
                truncate -s $((size / 2)) "$f"
            else
                dd if=/dev/urandom of="$f" bs=1 count=64 seek=$((size / 2)) conv=notrunc status=none
            fi
        done
        .gpu/graphed train --steps 50 > "$logs/cache.log" 2>&1
        echo "kernel cache, every file damaged ($damage): train exit $?, $(grep -c damaged "$logs/cache.log") damaged-entry warnings, $(grep -c '^step' "$logs/cache.log") loss lines"
    done
    .gpu/graphed train --device cuda --dim 4096 --layers 64 --batch 65536 2>&1 | tail -2
    echo "too big for the GPU: exit ${PIPESTATUS[0]}"
} 2>&1 | tee "$OUT/misuse.log"
for name in ${BENCHES:-graphs}; do
    bench "$name"
done
{
    .gpu/graphed inspect --device cuda --side-stream 2>&1 | tail -30
    .gpu/graphed inspect --device cuda --side-stream --offload --config M 2>&1 | tail -30
    .gpu/graphed demo 2>&1 | tail -3
} | tee "$OUT/inspect.log"
