#!/usr/bin/env python3
"""PyTorch side of graphed's benchmarks: the same computation, timed the same way, on the same GPU.

Usage: python3 bench/torch_reference.py gemm [--d 4096] [--reps 50]
       python3 bench/torch_reference.py layer [--configs S,M,L]
       python3 bench/torch_reference.py graphs [--configs S,M,L] [--dtype bf16|f32]
       python3 bench/torch_reference.py parity FILE [--device cuda|cpu]
Prints one JSON object on stdout; parity exits 1 if PyTorch's module and graphed's disagree.
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


# What a file of `graphed bench parity` states about graphed's model (its metadata), and what the
# modules below share with it: `parity` refuses a file that states anything else.
CONVENTIONS = {
    "linear_weight": "[out, in]",
    "attention": "qkv column blocks q|k|v, head-major within each; causal; scale 1/sqrt(head_dim)",
    "layernorm_eps": "1e-5",
    "gelu": "tanh",
}


class Attention(torch.nn.Module):
    """graphed's `nn::CausalSelfAttention`, unfused: one QKV projection whose output holds q, k
    and v as column blocks (head h in columns h*hd..(h+1)*hd of each), heads of 64 features (one
    head below 64), scores scaled by 1/sqrt(hd), a causal softmax, the output projection."""

    def __init__(self, d: int):
        super().__init__()
        self.heads = max(d // 64, 1)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, t, d = u.shape
        hd = d // self.heads
        q, k, v = self.qkv(u).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * hd**-0.5
        mask = torch.ones(t, t, device=u.device, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, t, d))


class Mlp(torch.nn.Module):
    """graphed's `nn::Mlp`: fc2(GELU_tanh(fc1(x))), fc1 d -> 4d, fc2 4d -> d."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(u), approximate="tanh"))


class Layer(torch.nn.Module):
    """BENCH.md's pre-LN GPT layer as graphed's `nn::TransformerLayer`, its parameters named as
    graphed names them (ln1, attn.qkv, attn.proj, ln2, mlp.fc1, mlp.fc2): LayerNorm eps 1e-5,
    GELU (tanh), no dropout."""

    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d, eps=1e-5), torch.nn.LayerNorm(d, eps=1e-5)
        self.attn, self.mlp = Attention(d), Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


class Stack(torch.nn.Module):
    """n layers, named as graphed's benchmark model names them (layer0, layer1, ...), so that a
    state dict of graphed's names loads as it is."""

    def __init__(self, d: int, n: int):
        super().__init__()
        for i in range(n):
            self.add_module(f"layer{i}", Layer(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.children():
            x = m(x)
        return x


def match_graphed_numerics() -> None:
    """GEMMs as graphed runs them: IEEE f32 (no TF32), and bf16 with f32 accumulation throughout
    (no reduced-precision split-K reductions, which PyTorch allows by default)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def layer(configs: list, reps: int) -> dict:
    """Forward + backward of one layer in f32 (TF32 off, as graphed's IEEE f32 GEMMs), CUDA events."""
    match_graphed_numerics()
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
    layers = list(Stack(d, n).cuda().to(dt).children())
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
    (torch.compile with mode="reduce-overhead"; its capture time includes compilation). GEMMs as
    graphed's (`match_graphed_numerics`); `parity` checks this module against graphed's."""
    match_graphed_numerics()
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    rows = []
    for name in configs:
        for variant in variants:
            rows.append(graphs_variant(name, variant, dt, steps, warmup))
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return {"bench": "graphs", "impl": "torch", "rows": rows, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name()}


# Largest difference allowed between PyTorch's and graphed's tensors, relative to the tensor's
# largest |graphed| value.
# bf16 keeps 8 significant bits: one rounding moves a value by up to u = 2^-8 (0.39%) of it. The
# two sides round in different places (PyTorch after every op: the projection before its residual
# add, the scores before the scale; graphed once per fused GEMM epilogue, LayerNorm and softmax
# statistics in f32), so a value differs by the sum of the roundings on its path, which grows with
# depth: a gradient of S's first layer has passed about 150 roundings forward and back, a random
# walk of sqrt(150) * u = 4.8%, and a parameter gradient sums B*T rows that can nearly cancel. At
# S, graphed's simulator against PyTorch on the CPU measured at most 4.9% (grad.layer5.ln1.bias),
# 1.5% for the output. 0.1 (about 25 u) leaves room for M's and L's wider tensors and stays far
# below what a real mismatch gives: a transposed weight 160%, a weight 10% off 17%. Smaller
# mismatches hide in bf16's noise (GELU with erf instead of tanh measured 6.3%, within it); the
# f32 check catches those.
# f32 keeps 24 bits (u = 2^-24 = 6e-8); sums of up to 4d terms (B*T for weight gradients)
# accumulate in different orders on the two sides. S measured at most 4.8e-6 (as above); 1e-4
# allows 20 times that, and GELU with erf instead of tanh gives 1.2e-3.
TOLERANCE = {"bf16": 0.1, "f32": 1e-4}


def parity(path: str, device: str) -> dict:
    """PyTorch's Stack against graphed's benchmark model, from a file of `graphed bench parity`:
    the same weights (graphed's names are this module's, and both store Linear weights [out, in]:
    they load as they are, with no renaming and no transposes), the same input and upstream
    gradient, in the file's element type. For the output, the input's gradient and every
    parameter's: the largest absolute difference and that difference relative to the largest
    |graphed| value of the tensor; it passes if every relative one is within TOLERANCE."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["graphed"])
    for key, value in CONVENTIONS.items():
        if meta.get(key) != value:
            raise SystemExit(f"{path}: graphed's {key} is {meta.get(key)!r}, this module's {value!r}; make them agree")
    match_graphed_numerics()
    t = load_file(path, device=device)
    model = Stack(int(meta["dim"]), int(meta["layers"])).to(device=device, dtype=t["input"].dtype)
    model.load_state_dict({k: v for k, v in t.items() if k not in ("input", "output") and not k.startswith("grad.")})
    x = t["input"].clone().requires_grad_()
    y = model(x)
    y.backward(t["grad.output"])
    theirs = {"output": y, "grad.input": x.grad} | {f"grad.{n}": p.grad for n, p in model.named_parameters()}
    expected = {k for k in t if k == "output" or (k.startswith("grad.") and k != "grad.output")}
    if set(theirs) != expected:
        raise SystemExit(f"{path}: tensors {sorted(expected ^ set(theirs))} are on one side only")
    tensors = {}
    for name, got in theirs.items():
        ref, got = t[name].double(), got.detach().double()
        max_abs = (got - ref).abs().max().item()
        scale = ref.abs().max().item()
        tensors[name] = {"max_abs": max_abs, "max_rel": max_abs / scale if scale > 0 else float(max_abs > 0)}
    worst = max(tensors, key=lambda n: tensors[n]["max_rel"])
    tolerance = TOLERANCE[meta["dtype"]]
    return {"bench": "parity", "config": meta["config"], "dtype": meta["dtype"], "graphed_device": meta["device"],
            "device": str(device), "tolerance": tolerance, "pass": tensors[worst]["max_rel"] <= tolerance,
            "worst": {"tensor": worst, **tensors[worst]}, "tensors": tensors, "torch": torch.__version__}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("which", choices=["gemm", "layer", "graphs", "parity"])
    p.add_argument("file", nargs="?", help="parity: a file of `graphed bench parity`")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="parity: where to run")
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--configs", default="S,M,L")
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    p.add_argument("--variants", default="torch-eager,torch-graphed,torch-floor,torch-compile",
                   help="graphs: comma-separated variants to run")
    args = p.parse_args()
    if args.which == "gemm":
        print(json.dumps(gemm(args.d, args.reps)))
    elif args.which == "parity":
        if args.file is None:
            p.error("parity needs the file `graphed bench parity --out FILE` wrote")
        result = parity(args.file, args.device)
        print(json.dumps(result))
        sys.exit(0 if result["pass"] else 1)
    elif args.which == "graphs":
        print(json.dumps(graphs(args.configs.split(","), args.dtype, 20, 5, args.variants.split(","))))
    else:
        print(json.dumps(layer(args.configs.split(","), min(args.reps, 10))))


if __name__ == "__main__":
    main()
