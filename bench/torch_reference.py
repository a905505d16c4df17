#!/usr/bin/env python3
"""PyTorch side of graphed's benchmarks: the same computation, timed the same way, on the same GPU.

Usage: python3 bench/torch_reference.py gemm [--d 4096] [--reps 50]
       python3 bench/torch_reference.py layer [--configs S,M,L]
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


class Layer(torch.nn.Module):
    """BENCH.md's pre-LN GPT layer, unfused attention, GELU (tanh), no dropout."""

    def __init__(self, d: int):
        super().__init__()
        self.d, self.heads = d, d // 64
        self.ln1, self.ln2 = torch.nn.LayerNorm(d, eps=1e-5), torch.nn.LayerNorm(d, eps=1e-5)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def attn(self, u: torch.Tensor) -> torch.Tensor:
        b, t, d = u.shape
        q, k, v = self.qkv(u).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, 64).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / 8.0
        mask = torch.ones(t, t, device=u.device, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.ln1(x))
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(h)), approximate="tanh"))


def layer(configs: list, reps: int) -> dict:
    """Forward + backward of one layer in f32 (TF32 off, as graphed's IEEE f32 GEMMs), CUDA events."""
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = {"S": (256, 2, 64), "M": (1024, 4, 512), "L": (4096, 2, 2048)}
    rows = []
    for name in configs:
        d, b, t = shapes[name]
        m = Layer(d).cuda()
        x = torch.full((b, t, d), 0.5, device="cuda", requires_grad=True)
        dy = torch.ones(b, t, d, device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for rep in range(reps + 3):
            start.record()
            m(x).backward(dy)
            end.record()
            end.synchronize()
            if rep >= 3:
                times.append(start.elapsed_time(end))
        times.sort()
        rows.append({"config": name, "dim": d, "batch": b, "seq": t, "gpu_ms": times[len(times) // 2]})
    return {"bench": "layer", "impl": "torch-eager", "dtype": "f32", "rows": rows, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("which", choices=["gemm", "layer"])
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--configs", default="S,M,L")
    args = p.parse_args()
    if args.which == "gemm":
        print(json.dumps(gemm(args.d, args.reps)))
    else:
        print(json.dumps(layer(args.configs.split(","), min(args.reps, 10))))


if __name__ == "__main__":
    main()
