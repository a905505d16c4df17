#!/usr/bin/env bash
# Builds everything the GPU machine needs (it has no Rust toolchain) into .gpu/ and prints the
# one command that runs the GPU tests and benchmarks there. Usage: scripts/gpu-prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo nextest archive --cargo-profile release --archive-file .gpu/tests.tar.zst
cargo build --release --bin graphed --example pipeline --example data_parallel --example grid
cp target/release/graphed .gpu/graphed
mkdir -p .gpu/examples
cp target/release/examples/{pipeline,data_parallel,grid} .gpu/examples/
command -v cargo-nextest > /dev/null || cargo install cargo-nextest --locked
cp "$(command -v cargo-nextest)" .gpu/cargo-nextest
# The device tool carries at most 64 MiB with the tree: the binaries go without their symbols,
# packed (scripts/gpu-unpack.sh unpacks them there).
strip .gpu/graphed .gpu/cargo-nextest .gpu/examples/*
rm -rf .gpu/kernels
tar czf .gpu/bins.tar.gz -C .gpu graphed cargo-nextest examples
rm -rf .gpu/graphed .gpu/cargo-nextest .gpu/examples
# The device's copy of the tree has no reliable git state: say which commit was built.
git rev-parse --short HEAD > .gpu/commit.txt
carried=$(du -sm .gpu/tests.tar.zst .gpu/bins.tar.gz | awk '{s += $1} END {print s}')
echo "$carried MiB to carry in .gpu"
[ "$carried" -le 64 ] || echo "warning: more than the device tool's 64 MiB; carry less (the tree's own files count too)"
cat <<'CMD'
Run on the GPU machine (device tool, carry [".gpu"]): bash scripts/gpu-run.sh
(BENCHES="graphs launch alloc check gemm layer" for every benchmark; logs and JSON in $OUT)
CMD
