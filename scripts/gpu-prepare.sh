#!/usr/bin/env bash
# Builds everything the GPU machine needs (it has no Rust toolchain) into .gpu/ and prints the
# one command that runs the GPU tests and benchmarks there. Usage: scripts/gpu-prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo nextest archive --cargo-profile release --archive-file .gpu/tests.tar.zst
cargo build --release
cp target/release/graphed .gpu/graphed
cp "$(command -v cargo-nextest)" .gpu/cargo-nextest
du -sh .gpu
cat <<'CMD'
Run on the GPU machine (device tool: carry [".gpu"]):
  set -o pipefail; export GRAPHED_KERNEL_CACHE=$PWD/.gpu/kernels;
  .gpu/cargo-nextest nextest run --archive-file .gpu/tests.tar.zst --workspace-remap . --run-ignored all --no-fail-fast 2>&1 | tee $OUT/tests.log;
  .gpu/graphed bench launch --device cuda --json $OUT/launch.json 2>&1 | tee $OUT/bench.log;
  .gpu/graphed bench alloc --device cuda --json $OUT/alloc.json 2>&1 | tee -a $OUT/bench.log;
  .gpu/graphed bench check --device cuda --json $OUT/check.json 2>&1 | tee -a $OUT/bench.log;
  .gpu/graphed bench gemm --device cuda --json $OUT/gemm.json 2>&1 | tee -a $OUT/bench.log;
  python3 bench/torch_reference.py gemm > $OUT/gemm-torch.json; cat $OUT/gemm-torch.json;
  .gpu/graphed bench layer --device cuda --json $OUT/layer.json 2>&1 | tee -a $OUT/bench.log;
  python3 bench/torch_reference.py layer > $OUT/layer-torch.json; cat $OUT/layer-torch.json;
  .gpu/graphed train 2>&1 | tee $OUT/train.log;
  .gpu/graphed train --side-stream 2>&1 | tee $OUT/train-side.log;
  .gpu/graphed train --eager 2>&1 | tee $OUT/train-eager.log;
  .gpu/graphed bench graphs --device cuda --json $OUT/graphs.json 2>&1 | tee $OUT/graphs.log;
  .gpu/graphed inspect --device cuda --side-stream --dot $OUT/dot 2>&1 | tee $OUT/inspect.log;
  .gpu/graphed demo 2>&1 | tee $OUT/demo.log
CMD
