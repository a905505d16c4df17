#!/usr/bin/env python3
"""PyTorch side of graphed's benchmarks: the same computation, timed the same way, on the same GPU.

Usage: python3 bench/torch_reference.py gemm [--d 4096] [--reps 50]
Prints one JSON object on stdout.
"""
import argparse
import json

import torch


def gemm(d: int, reps: int) -> dict:
    """C = A @ B in bf16 with fp32 accumulation, d x d x d, timed with CUDA events."""
    a = torch.randn(d, d, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(d, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        c = a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        c = a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    ms = times[len(times) // 2]
    del c
    return {"bench": "gemm", "impl": "torch", "d": d, "dtype": "bf16", "median_ms": ms,
            "tflops": 2 * d**3 / (ms * 1e-3) / 1e12, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("which", choices=["gemm"])
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    print(json.dumps(gemm(args.d, args.reps)))


if __name__ == "__main__":
    main()
