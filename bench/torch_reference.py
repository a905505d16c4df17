#!/usr/bin/env python3
"""PyTorch side of graphed's benchmarks: the same computation, timed the same way, on the same GPU.

Usage: python3 bench/torch_reference.py gemm [--d 4096] [--reps 50]
       python3 bench/torch_reference.py layer [--configs S,M,L] [--attention unfused|fused|both]
       python3 bench/torch_reference.py graphs [--configs S,M,L] [--dtype bf16|f32] [--attention unfused|fused|both]
       python3 bench/torch_reference.py attention [--batch 2] [--heads 64] [--seq 2048] [--head-dim 64]
       python3 bench/torch_reference.py kernels [--config L] [--dtype bf16] [--steps 3]
       python3 bench/torch_reference.py memory [--config L] [--budget 24GiB] [--search batch,layers]
       python3 bench/torch_reference.py parity FILE [--device cuda|cpu]
Prints one JSON object on stdout; parity exits 1 if PyTorch's module and graphed's disagree.

--attention (layer and graphs; default both): unfused is the layer with attention as GEMM, masked
softmax, GEMM (variants torch-eager, torch-graphed, torch-floor, torch-compile), fused the same
layer with F.scaled_dot_product_attention(q, k, v, is_causal=True) (torch-sdpa-eager,
torch-sdpa-graphed, torch-sdpa-floor, torch-sdpa-compile), both runs each configuration's unfused
variants and then its fused ones into the one file, which is what scripts/gpu-run.sh keeps. Each
row says its form ("attention"); with a fused form, "sdpa" says per configuration which SDPA
backends run alone at the layer's shape and which kernels PyTorch picks by default.
attention: SDPA alone (causal unless --no-causal), forward and forward+backward of every backend
that runs, in ms and TFLOP/s (causal FLOPs counted as half: forward 4*b*h*s^2*d/2, backward 2.5
times that).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import warnings

try:
    import torch
    import torch.nn.functional as F
except ModuleNotFoundError:  # --help still works; main() refuses to run anything
    torch = F = None

def layer_shapes(tokens: int, d: int) -> list:
    """The twelve GEMMs of one layer as `graphed bench gemm --configs` lists them: (name, m, n, k,
    trans_a, trans_b, graphed's epilogue), row-major op(A) @ op(B) with weights (out, in)."""
    fwd = lambda name, out, inp, epi: (name, tokens, out, inp, False, True, epi)
    data = lambda name, out, inp, epi: (name, tokens, inp, out, False, False, epi)
    weight = lambda name, out, inp, epi: (name, out, inp, tokens, True, False, epi)
    return [fwd("qkv", 3 * d, d, "bias"), fwd("proj", d, d, "bias+residual"), fwd("fc1", 4 * d, d, "bias+gelu_aux"),
            fwd("fc2", d, 4 * d, "bias+residual"), data("fc2.dx", d, 4 * d, "dgelu"), weight("fc2.dw", d, 4 * d, "none"),
            data("fc1.dx", 4 * d, d, "none"), weight("fc1.dw", 4 * d, d, "bgrad_a"), data("proj.dx", d, d, "none"),
            weight("proj.dw", d, d, "none"), data("qkv.dx", 3 * d, d, "none"), weight("qkv.dw", 3 * d, d, "bgrad_a")]


def gemm_layer(config: str, reps: int, fp8: bool = False) -> list:
    """The twelve GEMMs of one layer of `config` through torch.mm in graphed's layouts (plain:
    `epilogue` none), and the forward ones also as F.linear with its bias (PyTorch's cuBLASLt bias
    epilogue), each timed alone with CUDA events: the per-shape anchor for `graphed bench gemm
    --configs`. With `fp8`, each shape also through torch._scaled_mm as `graphed bench gemm --fp8`
    runs it: A (m x k) row-major times B (n x k) transposed, E4M3 x E4M3 with fast accumulation for
    the forward's shapes, an E5M2 gradient times E4M3 for the backward's, bf16 out."""
    d, _, b, t = SHAPES[config]
    rows = []
    for name, m, n, k, ta, tb, epi in layer_shapes(b * t, d):
        a = torch.randn((k, m) if ta else (m, k), device="cuda", dtype=torch.bfloat16)
        w = torch.randn((n, k) if tb else (k, n), device="cuda", dtype=torch.bfloat16)
        calls = {"none": lambda: torch.mm(a.t() if ta else a, w.t() if tb else w)}
        if tb:
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            calls["bias"] = lambda: F.linear(a, w, bias)
        for epilogue, call in calls.items():
            ms = sorted(timed_ms(call, reps))[reps // 2]
            rows.append({"config": config, "gemm": name, "m": m, "n": n, "k": k, "trans_a": ta, "trans_b": tb,
                         "epilogue": epilogue, "dtype": "bf16", "median_ms": ms,
                         "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12})
        if fp8:
            forward = tb and not ta
            left = torch.float8_e4m3fn if forward else torch.float8_e5m2
            a8 = (torch.rand(m, k, device="cuda") - 0.5).to(left)
            b8 = (torch.rand(n, k, device="cuda") - 0.5).to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            call = lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                            use_fast_accum=forward)
            ms = sorted(timed_ms(call, reps))[reps // 2]
            rows.append({"config": config, "gemm": name, "m": m, "n": n, "k": k, "trans_a": False, "trans_b": True,
                         "epilogue": "none", "dtype": "e4m3×e4m3" if forward else "e5m2×e4m3", "median_ms": ms,
                         "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12})
    return rows


# The modules below subclass torch.nn.Module; without PyTorch they are never built.
Module = torch.nn.Module if torch is not None else object


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


class Attention(Module):
    """graphed's `nn::CausalSelfAttention`: one QKV projection whose output holds q, k and v as
    column blocks (head h in columns h*hd..(h+1)*hd of each), heads of 64 features (one head below
    64), scores scaled by 1/sqrt(hd), a causal softmax, the output projection. Unfused (the
    default): GEMM, masked softmax, GEMM; fused: F.scaled_dot_product_attention with is_causal,
    whose default scale is the same 1/sqrt(hd), on the same strided q, k and v."""

    def __init__(self, d: int, fused: bool = False):
        super().__init__()
        self.heads, self.fused = max(d // 64, 1), fused
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, t, d = u.shape
        hd = d // self.heads
        q, k, v = self.qkv(u).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * hd**-0.5
            mask = torch.ones(t, t, device=u.device, dtype=torch.bool).triu(1)
            out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Mlp(Module):
    """graphed's `nn::Mlp`: fc2(GELU_tanh(fc1(x))), fc1 d -> 4d, fc2 4d -> d."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(u), approximate="tanh"))


class Layer(Module):
    """BENCH.md's pre-LN GPT layer as graphed's `nn::TransformerLayer`, its parameters named as
    graphed names them (ln1, attn.qkv, attn.proj, ln2, mlp.fc1, mlp.fc2): LayerNorm eps 1e-5,
    GELU (tanh), no dropout; attention unfused unless `fused`."""

    def __init__(self, d: int, fused: bool = False):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d, eps=1e-5), torch.nn.LayerNorm(d, eps=1e-5)
        self.attn, self.mlp = Attention(d, fused), Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


class Stack(Module):
    """n layers, named as graphed's benchmark model names them (layer0, layer1, ...), so that a
    state dict of graphed's names loads as it is."""

    def __init__(self, d: int, n: int, fused: bool = False):
        super().__init__()
        for i in range(n):
            self.add_module(f"layer{i}", Layer(d, fused))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.children():
            x = m(x)
        return x


def match_graphed_numerics() -> None:
    """GEMMs as graphed runs them: IEEE f32 (no TF32), and bf16 with f32 accumulation throughout
    (no reduced-precision split-K reductions, which PyTorch allows by default)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


# The attention forms of --attention, in the order `both` runs them.
FORMS = {"unfused": ["unfused"], "fused": ["fused"], "both": ["unfused", "fused"]}
VARIANTS = ["torch-eager", "torch-graphed", "torch-floor", "torch-compile"]


def variant_name(variant: str, form: str) -> str:
    """A variant's name with `form`'s attention: torch-graphed, or torch-sdpa-graphed when fused."""
    return variant.replace("torch-", "torch-sdpa-", 1) if form == "fused" else variant


def layer(configs: list, reps: int, forms: list) -> dict:
    """Forward + backward of one layer in f32 (TF32 off, as graphed's IEEE f32 GEMMs), CUDA events,
    with each attention form of `forms` (the rows of a configuration in that order)."""
    match_graphed_numerics()
    shapes = {"S": (256, 2, 64), "M": (1024, 4, 512), "L": (4096, 2, 2048)}
    rows = []
    for name in configs:
        for form in forms:
            d, b, t = shapes[name]
            m = Layer(d, fused=form == "fused").cuda()
            # Uniform in [-1, 1) from a fixed seed, as graphed's `bench layer` (a constant input
            # makes every LayerNorm row its bias, and GEMMs over it clock higher than a step's).
            g = torch.Generator(device="cuda").manual_seed(0)
            x = (torch.rand(b, t, d, device="cuda", generator=g) * 2 - 1).requires_grad_()
            dy = torch.rand(b, t, d, device="cuda", generator=g) * 2 - 1
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
            rows.append({"config": name, "attention": form, "impl": variant_name("torch-eager", form), "dim": d,
                         "batch": b, "seq": t, "gpu_ms": times[len(times) // 2]})
            del m, x, dy
            torch.cuda.empty_cache()
    return {"bench": "layer", "impl": "torch-eager", "dtype": "f32", "attention": forms, "rows": rows,
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}


SHAPES = {"S": (256, 8, 2, 64), "M": (1024, 8, 4, 512), "L": (4096, 4, 2, 2048)}


def sdpa_backends() -> list:
    """PyTorch's fused SDPA backends by our names, those this PyTorch has."""
    from torch.nn.attention import SDPBackend

    names = [("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION")]
    return [(name, getattr(SDPBackend, attr)) for name, attr in names if hasattr(SDPBackend, attr)]


def backend_of(kernels: list) -> str:
    """Which backend ran, from the names of the CUDA kernels of a call (the names are reported too:
    this is a reading of them, not something PyTorch states)."""
    text = " ".join(kernels).lower()
    if "pytorch_flash" in text or "flash_fwd" in text or "flash_bwd" in text:
        return "flash"
    if "cudnn" in text or "fprop" in text or "bprop" in text or "sdpa" in text:
        return "cudnn"
    if "fmha" in text or "cutlass" in text or "mem_eff" in text or "efficient" in text:
        return "efficient"
    return "math" if kernels else "unknown"


def cuda_kernels(call) -> list:
    """The distinct CUDA kernel names (first-seen order) that `call()` runs, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if str(e.device_type).endswith("CUDA") and e.name not in names:
            names.append(e.name)
    return names


KERNEL_CLASSES = [("attention", ("flash", "fmha", "cudnn", "sdpa", "attention")),
                  ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_")),
                  ("layernorm", ("layer_norm", "layernorm")),
                  ("copy", ("copy", "transpose", "cat", "memcpy", "memset", "fill"))]


def kernel_class(name: str) -> str:
    """The class a CUDA kernel's name reads as: attention, gemm, layernorm, copy or elementwise."""
    low = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "elementwise")


def kernels(name: str, dtype: str, steps: int) -> dict:
    """Where one eager step of configuration `name` with fused attention (torch-sdpa-eager's step)
    spends its GPU time, from torch.profiler: per kernel class (see `kernel_class`) and the ten
    longest kernels, in ms per step, averaged over `steps` profiled steps after three warm ones.
    The same breakdown as `graphed bench layer --profile`, for the side that is ahead."""
    from torch.profiler import ProfilerActivity, profile

    match_graphed_numerics()
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    d, n, b, t = SHAPES[name]
    layers = list(Stack(d, n, True).cuda().to(dt).children())
    x = bench_input(b, t, d, dt)
    dy = torch.ones(b, t, d, device="cuda", dtype=dt)

    def step():
        h = x
        for m in layers:
            h = m(h)
        h.backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel = {}
    for e in prof.events():
        if str(e.device_type).endswith("CUDA"):
            ms, count = per_kernel.get(e.name, (0.0, 0))
            per_kernel[e.name] = (ms + e.time_range.elapsed_us() / 1e3 / steps, count + 1)
    classes = {}
    for kname, (ms, count) in per_kernel.items():
        c = classes.setdefault(kernel_class(kname), {"ms": 0.0, "launches": 0})
        c["ms"] += ms
        c["launches"] += count // steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:10]
    return {"bench": "kernels", "config": name, "dtype": dtype, "attention": "fused", "torch": torch.__version__,
            "ms_per_step": sum(ms for ms, _ in per_kernel.values()), "classes": classes,
            "top": [{"kernel": k[:120], "ms": ms, "launches": c // steps} for k, (ms, c) in top]}


def sdpa_probe(q, k, v, causal: bool = True) -> dict:
    """Which fused SDPA backends run alone (sdpa_kernel with one backend) on q, k, v (leaf tensors
    of the shape and strides to ask about), forward and backward, with the reason PyTorch gives for
    one that does not; and the kernels of its default choice, forward and backward (profiled after
    one warm call), with the backend they read as."""
    from torch.nn.attention import sdpa_kernel

    def call():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()

    works, reasons = {}, {}
    for name, backend in sdpa_backends():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]):
                    call()
                torch.cuda.synchronize()
                works[name] = True
            except RuntimeError as e:
                works[name] = False
                said = [str(w.message).strip() for w in caught] + [str(e).strip()]
                reasons[name] = " | ".join(line.splitlines()[0] for line in said if line)[:500]
    result = {"shape": list(q.shape), "dtype": str(q.dtype).removeprefix("torch."), "causal": causal,
              "works": works, "reasons": reasons}
    try:
        call()
        out = {}
        q.grad = k.grad = v.grad = None
        forward = cuda_kernels(lambda: out.update(y=F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
        dy = torch.ones_like(out["y"])
        backward = cuda_kernels(lambda: out["y"].backward(dy))
        result.update(default_forward_kernels=forward, default_backward_kernels=backward,
                      default=backend_of(forward))
    except Exception as e:  # the profiler needs CUPTI; the rest of the probe stands without it
        result.update(default=None, default_error=f"{type(e).__name__}: {e}"[:500])
    return result


def layer_sdpa_probe(name: str, dt: torch.dtype) -> dict:
    """sdpa_probe at configuration `name`'s attention: q, k and v as the layer makes them (views of
    one QKV output, heads transposed out), in its element type."""
    d, _, b, t = SHAPES[name]
    heads = max(d // 64, 1)
    qkv = torch.randn(b, t, 3 * d, device="cuda", dtype=dt)
    q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2).detach().requires_grad_() for z in qkv.split(d, -1))
    probe = sdpa_probe(q, k, v)
    del q, k, v, qkv
    torch.cuda.empty_cache()
    print(f"{name} sdpa: alone {probe['works']}, default {probe['default']}", file=sys.stderr)
    return probe


def bench_input(b: int, t: int, d: int, dt: torch.dtype, constant: bool = False) -> "torch.Tensor":
    """The step's input x, graphed's (`BenchModel`'s): element i is (i * 7919 mod 1000) / 1000 - 0.5,
    rounded from f32, so that both sides time the same data. `constant`: every element 0.5, what
    this file timed before 2026-12-05; LayerNorm turns such rows into its bias (zeros), so every
    GEMM after it reads degenerate data, which draws less power, and at L, where the H200 runs at
    its power cap, clocks higher (bench/results/HISTORY.md)."""
    if constant:
        return torch.full((b, t, d), 0.5, device="cuda", dtype=dt, requires_grad=True)
    i = torch.arange(b * t * d, device="cuda", dtype=torch.int64)
    x = ((i * 7919 % 1000).to(torch.float32) / 1000 - 0.5).to(dt).view(b, t, d)
    return x.requires_grad_()


def held_breakdown(layers: list) -> dict:
    """Where the variant's reserved bytes are, after its timed steps: the parameters, their
    gradients, the reserved segments of graph pools (a nonzero pool id; `None` where this PyTorch's
    snapshot has no pool ids) and how many gradient bytes lie inside those segments. graphed's
    gradients live outside its graph pool; this says whether PyTorch's share the pool with the
    activations."""
    params = [p for m in layers for p in m.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    segments = torch.cuda.memory_snapshot()
    pooled = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    has_ids = all("segment_pool_id" in s for s in segments)

    def in_pool(t: torch.Tensor) -> bool:
        at = t.untyped_storage().data_ptr()
        return any(s["address"] <= at < s["address"] + s["total_size"] for s in pooled)

    size = lambda t: t.untyped_storage().nbytes()
    return {"param_bytes": sum(size(p) for p in params), "grad_bytes": sum(size(g) for g in grads),
            "graph_pool_reserved_bytes": sum(s["total_size"] for s in pooled) if has_ids else None,
            "grad_bytes_in_graph_pools": sum(size(g) for g in grads if in_pool(g)) if has_ids else None}


def held_or_why(layers: list) -> dict:
    """`held_breakdown`, or why this PyTorch could not say: a diagnostic never ends a timed run."""
    try:
        return held_breakdown(layers)
    except (KeyError, TypeError, RuntimeError, AttributeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def graphs_variant(name: str, variant: str, dt: torch.dtype, steps: int, warmup: int,
                   constant: bool = False) -> dict:
    """One (configuration, variant) of `graphs`, in a function so that its memory goes on return;
    a torch-sdpa-* variant is its torch-* variant with fused attention. Peak memory is the
    variant's: the peaks are reset at its start."""
    d, n, b, t = SHAPES[name]
    fused = variant.startswith("torch-sdpa-")
    mode = variant.replace("torch-sdpa-", "torch-", 1)
    torch.cuda.reset_peak_memory_stats()
    layers = list(Stack(d, n, fused).cuda().to(dt).children())
    x = bench_input(b, t, d, dt, constant)
    dy = torch.ones(b, t, d, device="cuda", dtype=dt)
    capture_ms = None

    def eager_step():
        h = x
        for m in layers:
            h = m(h)
        h.backward(dy)

    step = eager_step
    if mode == "torch-graphed":
        began = time.perf_counter()
        samples = tuple((torch.full((b, t, d), 0.5, device="cuda", dtype=dt, requires_grad=True),) for _ in layers)
        layers = list(torch.cuda.make_graphed_callables(tuple(layers), samples))
        torch.cuda.synchronize()
        capture_ms = (time.perf_counter() - began) * 1e3
    elif mode == "torch-floor":
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
    elif mode == "torch-compile":
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
    row = {"config": name, "variant": variant, "attention": "fused" if fused else "unfused",
           "dtype": str(dt).removeprefix("torch."),
           "wall_ms": statistics.median(wall), "wall_min_ms": min(wall), "wall_max_ms": max(wall),
           "host_us": statistics.median(host), "host_min_us": min(host), "host_max_us": max(host),
           "gpu_ms": statistics.median(gpu), "gpu_min_ms": min(gpu), "gpu_max_ms": max(gpu),
           "reserved_bytes": torch.cuda.memory_reserved(),
           "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "capture_ms": capture_ms,
           "held": held_or_why(layers)}
    print(f"{name} {variant:19} wall {row['wall_ms']:.3f} ms  host {row['host_us']:.1f} us  "
          f"gpu {row['gpu_ms']:.3f} ms  peak allocated / reserved {row['peak_allocated_bytes'] / 2**20:.0f} / "
          f"{row['peak_reserved_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    return row


def graphs(configs: list, dtype: str, steps: int, warmup: int, variants: list, forms: list,
           constant: bool = False) -> dict:
    """BENCH.md's step (every layer's forward, then backward from ones; no optimizer), as
    `graphed bench graphs` runs it: torch-eager, torch-graphed (make_graphed_callables, one
    callable per layer), torch-floor (the whole step in one torch.cuda.graph) and torch-compile
    (torch.compile with mode="reduce-overhead"; its capture time includes compilation), for each
    attention form of `forms` (fused: the torch-sdpa-* names). GEMMs as graphed's
    (`match_graphed_numerics`); `parity` checks this module against graphed's, in its form.
    Between variants the compiler's caches are dropped (each torch-compile variant compiles anew,
    with the shapes of its own configuration) and the freed memory is handed back, so that each
    variant's peaks are its own. The input is graphed's (`bench_input`; `constant`: all 0.5)."""
    match_graphed_numerics()
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    rows, sdpa = [], {}
    for name in configs:
        for form in forms:
            if form == "fused":
                sdpa[name] = layer_sdpa_probe(name, dt)
            for variant in variants:
                row = graphs_variant(name, variant_name(variant, form), dt, steps, warmup, constant)
                row["input"] = "constant" if constant else "graphed"
                if form == "fused":
                    row["sdpa_backend"] = sdpa[name]["default"]
                rows.append(row)
                torch.cuda.synchronize()
                if variant == "torch-compile":
                    from torch import _dynamo

                    _dynamo.reset()
                gc.collect()
                torch.cuda.empty_cache()
    return {"bench": "graphs", "impl": "torch", "attention": forms, "rows": rows, "sdpa": sdpa,
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}


def timed_ms(call, reps: int, warmup: int = 3) -> list:
    """CUDA-event times of `call()`, in ms, after `warmup` untimed calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def attention(b: int, heads: int, seq: int, hd: int, dtype: str, causal: bool, reps: int) -> dict:
    """F.scaled_dot_product_attention alone on contiguous (b, heads, seq, hd) q, k, v: the forward
    (with autograd recording, as in training), and the forward plus backward (from a fixed random
    upstream gradient), timed with CUDA events
    for PyTorch's default choice and for each backend alone (cudnn, flash, efficient, and math,
    the unfused composition, for scale), medians and minima over `reps`. FLOPs: the forward's two
    GEMMs, 4*b*heads*seq^2*hd, halved when causal (the masked half is skipped by the fused
    kernels); the backward 2.5 times the forward (five GEMMs to the forward's two)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    q, k, v = (torch.randn(b, heads, seq, hd, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    dy = torch.randn(b, heads, seq, hd, device="cuda", dtype=dt)
    fwd_flops = 4 * b * heads * seq * seq * hd * (0.5 if causal else 1.0)
    bwd_flops = 2.5 * fwd_flops

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def forward_backward():
        q.grad = k.grad = v.grad = None
        forward().backward(dy)

    rows = []
    for name, backend in [("default", None)] + sdpa_backends() + [("math", SDPBackend.MATH)]:
        row = {"backend": name}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                    fwd = timed_ms(forward, reps)
                    both = timed_ms(forward_backward, reps)
            except RuntimeError as e:
                said = [str(w.message).strip() for w in caught] + [str(e).strip()]
                row.update(available=False, reason=" | ".join(s.splitlines()[0] for s in said if s)[:500])
                rows.append(row)
                print(f"attention {name:9} not available", file=sys.stderr)
                continue
        f_ms, fb_ms = statistics.median(fwd), statistics.median(both)
        row.update(available=True, fwd_ms=f_ms, fwd_min_ms=min(fwd), fwd_tflops=fwd_flops / (f_ms * 1e-3) / 1e12,
                   fwd_bwd_ms=fb_ms, fwd_bwd_min_ms=min(both),
                   fwd_bwd_tflops=(fwd_flops + bwd_flops) / (fb_ms * 1e-3) / 1e12,
                   bwd_ms=fb_ms - f_ms, bwd_tflops=bwd_flops / ((fb_ms - f_ms) * 1e-3) / 1e12 if fb_ms > f_ms else None)
        rows.append(row)
        print(f"attention {name:9} forward {f_ms:.3f} ms ({row['fwd_tflops']:.0f} TFLOP/s), forward+backward "
              f"{fb_ms:.3f} ms ({row['fwd_bwd_tflops']:.0f} TFLOP/s)", file=sys.stderr)
        torch.cuda.empty_cache()
    probe = sdpa_probe(q, k, v, causal)
    return {"bench": "attention", "impl": "torch", "batch": b, "heads": heads, "seq": seq, "head_dim": hd,
            "causal": causal, "dtype": dtype, "reps": reps, "fwd_flops": fwd_flops, "bwd_flops": bwd_flops,
            "rows": rows, "default": probe.get("default"),
            "default_forward_kernels": probe.get("default_forward_kernels"),
            "default_backward_kernels": probe.get("default_backward_kernels"), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}


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
    gradient, in the file's element type, and graphed's attention form (the file's
    `attention_form`: fused runs SDPA with is_causal=True and no dropout, unfused GEMM, masked
    softmax, GEMM). For the output, the input's gradient and every
    parameter's: the largest absolute difference and that difference relative to the largest
    |graphed| value of the tensor; it passes if every relative one is within TOLERANCE."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["graphed"])
    for key, value in CONVENTIONS.items():
        if meta.get(key) != value:
            raise SystemExit(f"{path}: graphed's {key} is {meta.get(key)!r}, this module's {value!r}; make them agree")
    # A file from before graphed stated its attention form ran the unfused one, its only form then.
    form = meta.get("attention_form", "unfused")
    if form not in ("fused", "unfused"):
        raise SystemExit(f"{path}: graphed's attention_form is {form!r}; this script knows fused and unfused")
    match_graphed_numerics()
    t = load_file(path, device=device)
    fused = form == "fused"
    model = Stack(int(meta["dim"]), int(meta["layers"]), fused).to(device=device, dtype=t["input"].dtype)
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
    return {"bench": "parity", "config": meta["config"], "attention": form, "dtype": meta["dtype"],
            "graphed_device": meta["device"],
            "device": str(device), "tolerance": tolerance, "pass": tensors[worst]["max_rel"] <= tolerance,
            "worst": {"tensor": worst, **tensors[worst]}, "tensors": tensors, "torch": torch.__version__}


MEMORY_VARIANTS = ["torch-sdpa-graphed", "torch-sdpa-save-on-cpu", "torch-sdpa-checkpoint"]


def host_available_bytes() -> int:
    """The host memory the kernel says new allocations may take without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("memory: /proc/meminfo has no MemAvailable; the host-memory bound needs it")


def host_refused(e: Exception) -> bool:
    """Whether `e` is a pinned host allocation the driver refused (save_on_cpu's copies): PyTorch raises
    it as an out-of-memory error that is not the device's OutOfMemoryError."""
    return "out of memory" in str(e) and not isinstance(e, torch.cuda.OutOfMemoryError)


def memory_probe(name: str, search: str, size: int, variant: str, dt: torch.dtype, steps: int, warmup: int,
                 budget: int, graphed: bool, host_start: int) -> dict:
    """One size of `memory`: configuration `name` with its batch or its layer count (`search`) set to
    `size`, built anew and stepped as `variant` says, graphed per layer (make_graphed_callables) when
    `graphed`: torch-sdpa-graphed as `graphs` runs it, torch-sdpa-save-on-cpu with every saved
    activation in pinned host memory (torch.autograd.graph.save_on_cpu), torch-sdpa-checkpoint with
    each layer's activations recomputed in the backward (torch.utils.checkpoint, non-reentrant). The
    peaks are this probe's alone: freed memory is handed back and the peaks reset first. `host_bytes`
    is how far the host's available memory fell below `host_start` by the end of the steps: the
    pinned copies save_on_cpu keeps (PyTorch's host allocator caches them), which the search bounds
    as the device's free memory bounds the rest; the cache is emptied after, where PyTorch can."""
    d, n, b, t = SHAPES[name]
    b, n = (size, n) if search == "batch" else (b, size)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    getattr(torch.cuda, "reset_peak_host_memory_stats", lambda: None)()
    layers = list(Stack(d, n, True).cuda().to(dt).children())
    if variant == "torch-sdpa-checkpoint":
        from torch.utils.checkpoint import checkpoint

        class Checkpointed(Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, h):
                return checkpoint(self.inner, h, use_reentrant=False)

        layers = [Checkpointed(m) for m in layers]
    offload = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)) if variant == "torch-sdpa-save-on-cpu" \
        else contextlib.nullcontext
    x = bench_input(b, t, d, dt)
    dy = torch.ones(b, t, d, device="cuda", dtype=dt)
    if graphed:
        samples = tuple((torch.full((b, t, d), 0.5, device="cuda", dtype=dt, requires_grad=True),) for _ in layers)
        with offload():
            layers = list(torch.cuda.make_graphed_callables(tuple(layers), samples))

    def step():
        h = x
        with offload():
            for m in layers:
                h = m(h)
        h.backward(dy)

    wall = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        issued = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= warmup:
            wall.append((time.perf_counter() - issued) * 1e3)
    peak = torch.cuda.max_memory_reserved()
    # The pinned allocator's own peak where PyTorch reports it (its key changed between versions),
    # else what the host's available memory says.
    pinned = getattr(torch.cuda, "host_memory_stats", dict)()
    pinned_peak = max(pinned.get("allocated_bytes.peak", 0), pinned.get("reserved_bytes.peak", 0))
    host_bytes = max(host_start - host_available_bytes(), pinned_peak, 0)
    gc.collect()
    getattr(torch._C, "_host_emptyCache", lambda: None)()
    return {"size": size, "fits": peak <= budget, "peak_reserved_bytes": peak,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "host_bytes": host_bytes,
            "wall_ms": statistics.median(wall)}


def secant(probes: list, target: int, key: str = "peak_allocated_bytes"):
    """As `graphed bench memory`: the size where the line through the last two probes of different
    sizes reaches `target`, of their allocated peaks plus the last one's reserved excess (or, with
    another `key`, of that alone); None if it does not rise."""
    last = probes[-1]
    other = next((p for p in reversed(probes) if p["size"] != last["size"]), None)
    if other is None:
        return None
    slope = (last[key] - other[key]) / (last["size"] - other["size"])
    if slope <= 0:
        return None
    excess = max(last["peak_reserved_bytes"] - last["peak_allocated_bytes"], 0) if key == "peak_allocated_bytes" else 0
    return max(int((last["size"] + (target - excess - last[key]) / slope) // 1), 1)


def largest_fitting(budget: int, limit: int, probe, host_limit: int) -> tuple:
    """`graphed bench memory`'s search: sizes from 1 until the largest that fits is next to one that
    does not, each guessed by the secant, kept inside the bracket and below the device's free memory
    (`limit`) and the host memory the probes may take (`host_limit`: save_on_cpu's pinned copies,
    which grow with the size where the device's memory barely does). Returns the probes, and what
    ended the search: "budget", or "host memory" where the next size would not fit the host or a
    probe's pinned allocation was refused (a probe returning `host_over`)."""
    probes, fits, over, size = [], 0, None, 1
    # Whether the smallest size that did not fit failed for the host's memory (a pinned allocation
    # refused), not the budget.
    host_over = False
    while True:
        p = probe(size)
        if p["fits"]:
            fits = max(fits, p["size"])
        elif over is None or p["size"] < over:
            over, host_over = p["size"], bool(p.get("host_over"))
        probes.append(p)
        bound = "host memory" if host_over else "budget"
        if (fits == 0 and over is not None) or over == fits + 1 or fits >= 1 << 16:
            return probes, bound
        if p.get("host_over"):
            # No peaks to extrapolate from: halve the bracket.
            size = (fits + over) // 2
            continue
        measured = [q for q in probes if not q.get("host_over")]
        guess = secant(measured, budget)
        n = max(guess if guess is not None else 2 * fits, fits + 1)
        if over is not None:
            n = min(n, over - 1)
        else:
            safe = secant(measured, limit)
            if safe is not None and safe <= fits:
                raise SystemExit(f"memory: size {fits + 1} would exceed the device's free memory before the budget")
            n = min(n, safe if safe is not None else n)
        host = secant(measured, host_limit, "host_bytes") if p["host_bytes"] > 0 else None
        if host is not None and host <= fits:
            return probes, "host memory"
        if any(q["host_bytes"] > 0 for q in measured) and over is None:
            # Host memory in use and no size over yet: at most double, since a size the host
            # cannot hold may be killed by the kernel rather than refused.
            n = min(n, 2 * fits)
        size = min(n, host if host is not None else n, 1 << 16)


def memory(name: str, budget: int, searches: list, variants: list, steps: int, warmup: int, path=None) -> dict:
    """`graphed bench memory`'s PyTorch side: per variant of MEMORY_VARIANTS and per search (the batch
    with the layers kept, the layers with the batch kept), the largest size whose peak reserved memory
    fits `budget`, with its step time. Each variant is tried graphed per layer first; one that
    make_graphed_callables cannot capture runs eagerly instead, and its rows say so ("graphed": false,
    with the error). With `path`, the results so far are written there after every search, so that a
    run stopped midway keeps what it found."""
    match_graphed_numerics()
    free, _ = torch.cuda.mem_get_info()
    if budget > free:
        raise SystemExit(f"memory: the budget {budget} is more than the device's free memory ({free}); lower it")
    # What the probes' pinned host copies may take: most of what the host has free now.
    host_start = host_available_bytes()
    host_limit = int(0.8 * host_start)
    rows = []
    for variant in variants:
        graphed, why = True, None
        for search in searches:
            def probe(size):
                nonlocal graphed, why
                try:
                    p = memory_probe(name, search, size, variant, torch.bfloat16, steps, warmup, budget, graphed,
                                     host_start)
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as e:  # noqa: BLE001: a capture PyTorch refuses; the variant runs eagerly
                    if host_refused(e):
                        # save_on_cpu's pinned copies: the host, not the device, ran out at this size.
                        print(f"  {variant} {search} {size}: pinned host memory refused ({e})"[:200], file=sys.stderr)
                        gc.collect()
                        torch.cuda.synchronize()
                        getattr(torch._C, "_host_emptyCache", lambda: None)()
                        return {"size": size, "fits": False, "host_over": True}
                    if not graphed:
                        raise
                    graphed, why = False, f"{type(e).__name__}: {e}"[:300]
                    gc.collect()
                    torch.cuda.synchronize()
                    p = memory_probe(name, search, size, variant, torch.bfloat16, steps, warmup, budget, graphed,
                                     host_start)
                print(f"  {variant} {search} {size}: peak reserved {p['peak_reserved_bytes'] / 2**30:.2f} GiB "
                      f"({'fits' if p['fits'] else 'over'}), {p['wall_ms']:.3f} ms", file=sys.stderr)
                return p

            probes, bound = largest_fitting(budget, free, probe, host_limit)
            best = max((p for p in probes if p["fits"]), key=lambda p: p["size"], default=None)
            rows.append({"config": name, "variant": variant, "search": search, "budget_bytes": budget,
                         "graphed": graphed, "graphed_error": why, "largest": best and best["size"],
                         "bound": bound, "host_limit_bytes": host_limit,
                         "at_largest": best, "ms_per_unit": best and best["wall_ms"] / best["size"],
                         "probes": probes})
            bounded = "" if bound == "budget" else " (the host's memory, not the budget, bounds it)"
            print(f"{variant} ({'graphed' if graphed else 'eager'}): largest {search} "
                  f"{best and best['size']}{bounded}", file=sys.stderr)
            result = {"bench": "memory", "impl": "torch", "rows": rows, "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name()}
            if path:
                with open(path, "w") as f:
                    json.dump(result, f)
    return result


def parse_bytes(text: str) -> int:
    """A size as `graphed bench memory --budget` takes it: 24GiB, 512MiB, 64KiB, or plain bytes."""
    units = {"": 0, "B": 0, "KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}
    number = text.rstrip("KMGTiB")
    unit = text[len(number):]
    if unit not in units:
        raise argparse.ArgumentTypeError(f"unknown unit `{unit}`: write the size as 24GiB, 512MiB or plain bytes")
    return int(float(number) * (1 << units[unit]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    sub = p.add_subparsers(dest="which", required=True, metavar="{gemm,layer,graphs,attention,kernels,parity}")
    g = sub.add_parser("gemm", help="TFLOP/s of a d x d x d bf16 GEMM")
    g.add_argument("--d", type=int, default=4096)
    g.add_argument("--reps", type=int, default=50)
    g.add_argument("--configs", default=None,
                   help="instead of the square product, the twelve GEMMs of one layer of each (e.g. M,L)")
    g.add_argument("--fp8", action="store_true",
                   help="with --configs, also each GEMM in FP8 through torch._scaled_mm")
    forms = dict(default="both", choices=list(FORMS),
                 help="attention as GEMM, masked softmax, GEMM (unfused), as F.scaled_dot_product_attention "
                      "(fused: the torch-sdpa-* variants), or each configuration with both, unfused first "
                      "(default: %(default)s)")
    la = sub.add_parser("layer", help="one layer's forward and backward, eager, f32")
    la.add_argument("--configs", default="S,M,L")
    la.add_argument("--reps", type=int, default=10, help="timed repetitions, at most 10 (default: %(default)s)")
    la.add_argument("--attention", **forms)
    gr = sub.add_parser("graphs", help="BENCH.md's step in every variant")
    gr.add_argument("--configs", default="S,M,L")
    gr.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    gr.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated variants, each run with every form of --attention (default: %(default)s)")
    gr.add_argument("--attention", **forms)
    gr.add_argument("--input", default="graphed", choices=["graphed", "constant"],
                    help="x as graphed's bench sets it (default), or every element 0.5 (the older, degenerate input)")
    at = sub.add_parser("attention", help="SDPA alone, per backend: forward and forward+backward, ms and TFLOP/s")
    at.add_argument("--batch", type=int, default=2)
    at.add_argument("--heads", type=int, default=64)
    at.add_argument("--seq", type=int, default=2048)
    at.add_argument("--head-dim", type=int, default=64)
    at.add_argument("--dtype", default="bf16", choices=["f32", "bf16", "f16"])
    at.add_argument("--causal", default=True, action=argparse.BooleanOptionalAction)
    at.add_argument("--reps", type=int, default=50)
    ke = sub.add_parser("kernels", help="where one eager step with SDPA spends its GPU time, per kernel class")
    ke.add_argument("--config", default="L", choices=list(SHAPES))
    ke.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    ke.add_argument("--steps", type=int, default=3)
    me = sub.add_parser("memory", help="the largest batch and layer count whose step fits a memory budget")
    me.add_argument("--config", default="L", choices=list(SHAPES))
    me.add_argument("--budget", type=parse_bytes, default=parse_bytes("24GiB"))
    me.add_argument("--search", default="batch,layers")
    me.add_argument("--variants", default=",".join(MEMORY_VARIANTS))
    me.add_argument("--steps", type=int, default=5)
    me.add_argument("--warmup", type=int, default=2)
    me.add_argument("--json", default=None, help="also write the results so far to this file after every search")
    pa = sub.add_parser("parity", help="PyTorch's module against a file of `graphed bench parity`")
    pa.add_argument("file", help="the file `graphed bench parity --out FILE` wrote")
    pa.add_argument("--device", default=None, help="where to run (default: cuda if there is one, else cpu)")
    args = p.parse_args()
    if torch is None:
        raise SystemExit("bench/torch_reference.py needs PyTorch (pip install torch)")
    if args.which == "gemm":
        if args.configs:
            rows = [r for c in args.configs.split(",") for r in gemm_layer(c, args.reps, args.fp8)]
            print(json.dumps({"bench": "gemm", "impl": "torch", "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(), "rows": rows}))
        else:
            print(json.dumps(gemm(args.d, args.reps)))
    elif args.which == "parity":
        result = parity(args.file, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        print(json.dumps(result))
        sys.exit(0 if result["pass"] else 1)
    elif args.which == "graphs":
        variants = args.variants.split(",")
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            p.error(f"graphs: unknown variants {unknown}: name them as {VARIANTS} and pick the attention form "
                    "with --attention (fused runs them as torch-sdpa-*)")
        print(json.dumps(graphs(args.configs.split(","), args.dtype, 20, 5, variants, FORMS[args.attention],
                                args.input == "constant")))
    elif args.which == "memory":
        print(json.dumps(memory(args.config, args.budget, args.search.split(","), args.variants.split(","), args.steps,
                                args.warmup, args.json)))
    elif args.which == "kernels":
        print(json.dumps(kernels(args.config, args.dtype, args.steps)))
    elif args.which == "attention":
        print(json.dumps(attention(args.batch, args.heads, args.seq, args.head_dim, args.dtype, args.causal,
                                   args.reps)))
    else:
        print(json.dumps(layer(args.configs.split(","), min(args.reps, 10), FORMS[args.attention])))


if __name__ == "__main__":
    main()
