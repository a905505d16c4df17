#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here:
# `train` as a user meets it on CUDA (docs/train.md): refusals before anything runs (exit 2), an
# interrupt that saves (exit 130) and a resume that appends, a kill survived by --save-every, a
# non-finite step that stops the run (exit 1) without replacing a good checkpoint, a damaged
# checkpoint and a changed data file refused, and every mode's loss lines equal, dropout on.
# Prints one line per check, `ok` or `FAILED`.
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-trust.sh
# (GRAPHED=target/release/graphed DEVICE=sim tries it here, on the simulator.)
set -uo pipefail
source scripts/gpu-unpack.sh
dev=${DEVICE:-cuda}
work=$(mktemp -d)
failed=0
check() { # check NAME CONDITION-EXIT-CODE: prints ok or FAILED
    if [ "$2" = 0 ]; then echo "ok      $1"; else echo "FAILED  $1"; failed=1; fi
}
expect() { # expect CODE TEXT NAME -- ARGS...: the train exit code and a text of its stderr
    local code=$1 text=$2 name=$3
    shift 4
    local started=$(date +%s.%N)
    $g train --device $dev "$@" > "$work/out" 2> "$work/err"
    local got=$? took=$(python3 -c "import time; print(f'{time.time() - $started:.1f}')")
    grep -qF -- "$text" "$work/err"
    local found=$?
    check "$name: exit $got (want $code) in $took s; $(grep -m1 -F -- "$text" "$work/err" | cut -c1-160)" \
        $([ "$got" = "$code" ] && [ "$found" = 0 ] && echo 0 || echo 1)
    [ "$got" = "$code" ] && [ "$found" = 0 ] || tail -3 "$work/err"
}
root=$PWD
g=$(realpath "${GRAPHED:-.gpu/graphed}")
cd "$work" || exit 1
echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "$dev"); $(cat "$root/.gpu/commit.txt" 2>/dev/null || git -C "$root" rev-parse --short HEAD)"
echo "keep" > file
expect 2 "--save file is a file" "--save on a file" -- --save file
expect 2 "--metrics nowhere/m" "--metrics in a missing folder" -- --metrics nowhere/m.jsonl
expect 2 "are the same file" "--metrics and --plot one file" -- --metrics m.jsonl --plot ./m.jsonl
expect 2 "add --schedule" "--microbatches without --schedule" -- --microbatches 4
expect 2 "--dim 3" "--dim 3 --heads 1" -- --dim 3 --heads 1
expect 2 "--dim 8192" "--dim 8192" -- --dim 8192
expect 2 "need about" "a model too big for the GPU, before any allocation" -- --dim 4096 --layers 16 --batch 4096
expect 2 "attn.bogus" "an offload site the model does not save" -- --offload --offload-sites attn.bogus
# An interrupt: the step finishes, the state is saved, exit 130; the resume appends its metrics.
$g train --device $dev --steps 100000 --save ckpt --metrics m.jsonl > /dev/null 2> err &
pid=$!
for _ in $(seq 1 600); do [ "$(cat m.jsonl 2>/dev/null | wc -l)" -ge 3 ] && break; sleep 0.1; done
kill -INT $pid
wait $pid
code=$?
lines=$(wc -l < m.jsonl)
check "SIGINT: exit $code (want 130); $(grep -m1 interrupted err)" $([ $code = 130 ] && echo 0 || echo 1)
done=$(grep -o 'interrupted after step [0-9]*' err | grep -o '[0-9]*$')
$g train --device $dev --steps 100000 --resume ckpt --save ckpt --metrics m.jsonl --stop-at $((done + 60)) > out 2> err
code=$?
check "resume after the interrupt: exit $code; metrics $lines lines, then $(wc -l < m.jsonl); $(grep -m1 resumed out)" \
    $([ $code = 0 ] && [ "$(wc -l < m.jsonl)" -gt "$lines" ] && echo 0 || echo 1)
# A kill: --save-every keeps a state to resume from.
$g train --device $dev --steps 100000 --save every --save-every 50 --metrics k.jsonl > /dev/null 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q '"step":125' k.jsonl 2>/dev/null && break; sleep 0.1; done
kill -KILL $pid
wait $pid 2>/dev/null
$g train --device $dev --steps 100000 --resume every --stop-at 200 > out 2> err
code=$?
check "SIGKILL after step 125, --save-every 50: resume exit $code; $(grep -m1 resumed out)" \
    $([ $code = 0 ] && grep -q 'after 1[05]0 steps' out && echo 0 || echo 1)
# A non-finite step: exit 1 naming it; the good checkpoint stays; skip goes on.
$g train --device $dev --steps 100 --save good > /dev/null 2>&1
sum=$(md5sum < good/checkpoint.safetensors)
expect 1 "not finite" "--lr 1e30 stops at the first non-finite step" -- --steps 100 --lr 1e30 --save good
check "the good checkpoint is unchanged" $([ "$sum" = "$(md5sum < good/checkpoint.safetensors)" ] && echo 0 || echo 1)
$g train --device $dev --steps 100 --lr 1e30 --on-nonfinite skip > out 2> err
check "--on-nonfinite skip: exit $?; $(grep -m1 skipped out)" $(grep -q skipped out && echo 0 || echo 1)
expect 0 "diverges" "--lr 1e6 warns that the loss diverges" -- --steps 100 --lr 1e6 --on-nonfinite skip
# A damaged checkpoint: one bit flipped in the tensors' data is refused, naming the tensor.
cp -r good damaged
python3 -c "
import sys; p='damaged/checkpoint.safetensors'; b=bytearray(open(p,'rb').read()); b[-1000] ^= 0x10; open(p,'wb').write(b)"
expect 2 "tensor" "one flipped bit in a checkpoint" -- --steps 200 --resume damaged
# A data file edited in place after the save is refused, unless accepted.
cp "$root/README.md" data.txt
$g train --device $dev --data data.txt --steps 100 --stop-at 50 --save text > /dev/null 2>&1
echo "more" >> data.txt
expect 2 "data" "a --data file changed since the save" -- --data data.txt --steps 100 --resume text
expect 0 "" "the same with --accept-changed-data" -- --data data.txt --steps 100 --resume text --accept-changed-data
# Every mode trains to the same loss lines, dropout on (the optimizer's guard and the callables'
# own dropout counter are in every step).
source "$root/scripts/gpu-functions.sh"
for mode in graphed side-stream eager offload schedule schedule-eager; do
    flag=$(case $mode in graphed) ;; schedule-eager) echo "--schedule --eager" ;; *) echo "--$mode" ;; esac)
    $g train --device $dev $flag --steps 300 --dropout 0.1 > "$mode.log" 2>&1
done
for pair in graphed:side-stream graphed:eager graphed:offload schedule:schedule-eager; do
    same_loss "${pair%%:*}.log" "${pair#*:}.log" "train --${pair#*:} --dropout 0.1" "${pair%%:*}"
    check "same loss lines: ${pair%%:*} and ${pair#*:}" $?
done
cd "$root" && rm -rf "$work"
[ $failed = 0 ] && echo "every check passed" || echo "SOME CHECKS FAILED"
exit $failed
