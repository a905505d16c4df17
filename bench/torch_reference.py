#!/usr/bin/env python3
"""PyTorch side of graphed's benchmarks: the same computation, timed the same way, on the same GPU.

Usage: python3 bench/torch_reference.py gemm [--d 4096] [--reps 50]
       python3 bench/torch_reference.py layer [--configs S,M,L]
       python3 bench/torch_reference.py graphs [--configs S,M,L] [--dtype bf16|f32]
Prints one JSON object on stdout.
"""
import argparse
import json
import statistics
import sys
import time

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


SHAPES = {"S": (256, 8, 2, 64), "M": (1024, 8, 4, 512), "L": (4096, 4, 2, 2048)}


def graphs_variant(name: str, variant: str, dt: torch.dtype, steps: int, warmup: int) -> dict:
    """One (configuration, variant) of `graphs`, in a function so that its memory goes on return."""
    d, n, b, t = SHAPES[name]
    layers = [Layer(d).cuda().to(dt) for _ in range(n)]
    x = torch.full((b, t, d), 0.5, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.ones(b, t, d, device="cuda", dtype=dt)
    capture_ms = None

    def eager_step():
        h = x
        for m in layers:
            h = m(h)
        h.backward(dy)

    step = eager_step
    if variant == "torch-graphed":
        began = time.perf_counter()
        samples = tuple((torch.full((b, t, d), 0.5, device="cuda", dtype=dt, requires_grad=True),) for _ in layers)
        layers = list(torch.cuda.make_graphed_callables(tuple(layers), samples))
        torch.cuda.synchronize()
        capture_ms = (time.perf_counter() - began) * 1e3
    elif variant == "torch-floor":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                eager_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        began = time.perf_counter()
        with torch.cuda.graph(graph):
            eager_step()
        torch.cuda.synchronize()
        capture_ms = (time.perf_counter() - began) * 1e3
        step = graph.replay
    elif variant == "torch-compile":
        # What a user would pick instead: Inductor's fusion and CUDA graph trees. A new step is
        # marked each time, and gradients are set to None, as the reduce-overhead docs ask.
        model = torch.compile(torch.nn.Sequential(*layers), mode="reduce-overhead")
        params = [p for m in layers for p in m.parameters()]

        def compiled_step():
            torch.compiler.cudagraph_mark_step_begin()
            model(x).backward(dy)
            for p in params:
                p.grad = None
            x.grad = None

        began = time.perf_counter()
        for _ in range(3):
            compiled_step()
        torch.cuda.synchronize()
        capture_ms = (time.perf_counter() - began) * 1e3
        step = compiled_step
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall, host, gpu = [], [], []
    for i in range(warmup + steps):
        start.record()
        issued = time.perf_counter()
        step()
        issuing = time.perf_counter() - issued
        end.record()
        torch.cuda.synchronize()
        total = time.perf_counter() - issued
        if i >= warmup:
            wall.append(total * 1e3)
            host.append(issuing * 1e6)
            gpu.append(start.elapsed_time(end))
    row = {"config": name, "variant": variant, "dtype": str(dt).removeprefix("torch."),
           "wall_ms": statistics.median(wall), "wall_min_ms": min(wall), "host_us": statistics.median(host),
           "host_min_us": min(host), "gpu_ms": statistics.median(gpu),
           "reserved_bytes": torch.cuda.memory_reserved(), "capture_ms": capture_ms}
    print(f"{name} {variant:14} wall {row['wall_ms']:.3f} ms  host {row['host_us']:.1f} us  "
          f"gpu {row['gpu_ms']:.3f} ms  reserved {row['reserved_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    return row


def graphs(configs: list, dtype: str, steps: int, warmup: int, variants: list) -> dict:
    """BENCH.md's step (every layer's forward, then backward from ones; no optimizer), as
    `graphed bench graphs` runs it: torch-eager, torch-graphed (make_graphed_callables, one
    callable per layer), torch-floor (the whole step in one torch.cuda.graph) and torch-compile
    (torch.compile with mode="reduce-overhead"; its capture time includes compilation). TF32
    off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    rows = []
    for name in configs:
        for variant in variants:
            rows.append(graphs_variant(name, variant, dt, steps, warmup))
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return {"bench": "graphs", "impl": "torch", "rows": rows, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("which", choices=["gemm", "layer", "graphs"])
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--configs", default="S,M,L")
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    p.add_argument("--variants", default="torch-eager,torch-graphed,torch-floor,torch-compile",
                   help="graphs: comma-separated variants to run")
    args = p.parse_args()
    if args.which == "gemm":
        print(json.dumps(gemm(args.d, args.reps)))
    elif args.which == "graphs":
        print(json.dumps(graphs(args.configs.split(","), args.dtype, 20, 5, args.variants.split(","))))
    else:
        print(json.dumps(layer(args.configs.split(","), min(args.reps, 10))))


if __name__ == "__main__":
    main()
