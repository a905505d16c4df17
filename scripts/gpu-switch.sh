#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu-prepare.sh built .gpu/ here
# (or an archive of the offload and conformance tests only): the switch of offloading without a
# new capture (issue 35, item 5) on the real driver. The CUDA variants of the offload and
# conformance tests, the switch's among them, then `bench offload` at the configurations in
# $CONFIGS (default M) with its graphed-offload-resident row and the switch's host time. Where
# .gpu/probe-switch or .gpu/probe-setparams exist (probes of the driver calls, built outside the
# repository: the copy-node switch, and the host cost of kernel-node updates, the floor under
# `GraphExec::rebind` and `set_enabled`), they run first.
# Usage (device tool, carry [".gpu"]): bash scripts/gpu-switch.sh
set -uo pipefail
source scripts/gpu-unpack.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels
log=$OUT/switch.log
{ nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader; cat .gpu/commit.txt; } > "$log"
for probe in probe-switch probe-setparams; do
    if [ -x .gpu/$probe ]; then
        { echo "## .gpu/$probe"; timeout 40 .gpu/$probe; echo "rc $?"; } >> "$log" 2>&1
    fi
done
echo "## cargo nextest run --run-ignored all -E 'binary(offload) | binary(conformance)' and 'test(/cuda::/)'" >> "$log"
timeout 200 .gpu/cargo-nextest nextest run --archive-file .gpu/tests.tar.zst --workspace-remap . --run-ignored all \
    -E '(binary(offload) | binary(conformance)) & test(/cuda::/)' --no-fail-fast 2>&1 \
    | grep -E "PASS|FAIL|SIGSEGV|TIMEOUT|Summary|panicked" >> "$log"
echo "## graphed bench offload --configs ${CONFIGS:-M}" >> "$log"
timeout 300 .gpu/graphed bench offload --device cuda --configs "${CONFIGS:-M}" --json "$OUT/offload.json" >> "$log" 2>&1
echo "rc $?" >> "$log"
grep -E "^## |FAIL|Summary|^  graphed|switched|nodes: |rc " "$log" | cut -c1-220
