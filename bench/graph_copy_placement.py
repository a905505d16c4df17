"""What a device-to-host copy costs the kernels of CUDA graphs, by where the copy runs.

A probe for issue 32's automatic offload policy at M, where six 4 MiB copies that fit their
windows cost 5.8% of the step. It captures, on one stream, a chain of bf16 GEMMs shaped like one
M layer's forward (2048 tokens of width 1024: QKV, projection, FC1, FC2) and times, over eight
graphs replayed back to back as the step replays its layers:

- alone: the layer graph only;
- tail: each layer graph with a 4 MiB copy into pinned memory on a stream forked at the graph's
  start and joined at its end, as graphed's offload graphs copy in their tails;
- beside: the layer graph alone, with the same copy captured in a graph of its own launched on
  another stream at the same time, as graphed's window probe times it;
- side: as tail, each graph also recording an external event after its compute (before the
  join), replayed on a side stream that waits for the caller's stream first, the caller waiting
  for the event: graphed's side-stream replay (where PyTorch has `Event(external=True)`), with
  and without the copy;
- which: the side-stream replay with the copy (2 KiB or 4 MiB) in the tails of only some of the
  eight graphs (the second; the second and third; the second to seventh, as the automatic policy
  picks at M; all), to tell a cost per copying graph from one per step.

Prints the median of 50 runs of each, in milliseconds, and the copy alone.
Usage (the GPU machine): python3 bench/graph_copy_placement.py
"""

import statistics

import torch

LAYERS = 8
RUNS = 50
COPY_ELEMENTS = 2 * 1024 * 1024  # 4 MiB of bf16
SMALL_ELEMENTS = 1024  # 2 KiB


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(2048, 1024, device=dev, dtype=bf16)
    shapes = [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]
    w = [torch.randn(*s, device=dev, dtype=bf16) * 0.02 for s in shapes]
    src = torch.randn(COPY_ELEMENTS, device=dev, dtype=bf16)
    host = torch.empty(COPY_ELEMENTS, dtype=bf16, pin_memory=True)
    small_src, small_host = src[:SMALL_ELEMENTS], host[:SMALL_ELEMENTS]
    main_s, fork, other = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def layer():
        qkv = x @ w[0]
        proj = qkv[:, :1024] @ w[1]
        hidden = proj @ w[2]
        return hidden @ w[3]

    def capture(body):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(main_s):
            body()  # warm up outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=main_s):
                body()
        return g

    def copy_only():
        host.copy_(src, non_blocking=True)

    def copy_small():
        small_host.copy_(small_src, non_blocking=True)

    def with_tail(compute, copy=copy_only):
        """`compute` with `copy` on a stream forked before it and joined after it."""

        def body():
            fork.wait_stream(main_s)
            with torch.cuda.stream(fork):
                copy()
            compute()
            main_s.wait_stream(fork)

        return body

    try:
        ready = torch.cuda.Event(external=True)
    except TypeError:
        ready = None

    def with_event():
        layer()
        ready.record(main_s)

    alone, tail = capture(layer), capture(with_tail(layer))
    side_stream = torch.cuda.Stream()
    evented = capture(with_tail(with_event)) if ready is not None else None
    evented_alone = capture(with_event) if ready is not None else None
    copy = torch.cuda.CUDAGraph()
    with torch.cuda.stream(other):
        torch.cuda.synchronize()
        with torch.cuda.graph(copy, stream=other):
            copy_only()

    def timed(step):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(main_s):
            start.record(main_s)
            step()
            end.record(main_s)
        end.synchronize()
        return start.elapsed_time(end)

    def run(graph, beside=False):
        for _ in range(LAYERS):
            if beside:
                other.wait_stream(main_s)
                with torch.cuda.stream(other):
                    copy.replay()
            graph.replay()
            if beside:
                main_s.wait_stream(other)

    def run_side(graph):
        run_list([graph] * LAYERS)

    def run_list(graphs):
        # The caller's stream is main_s (timed); the graphs replay on side_stream.
        for graph in graphs:
            side_stream.wait_stream(main_s)
            with torch.cuda.stream(side_stream):
                graph.replay()
            main_s.wait_event(ready)
        main_s.wait_stream(side_stream)

    def median(step):
        for _ in range(5):
            timed(step)
        return statistics.median(timed(step) for _ in range(RUNS))

    def copy_alone():
        with torch.cuda.stream(other):
            copy.replay()
        main_s.wait_stream(other)

    a = median(lambda: run(alone))
    t = median(lambda: run(tail))
    b = median(lambda: run(alone, beside=True))
    c = median(copy_alone)
    e = median(lambda: run_side(evented)) if evented is not None else None
    e0 = median(lambda: run_side(evented_alone)) if evented is not None else None
    print(f"{LAYERS} layer graphs back to back, median of {RUNS} (ms):")
    print(f"  alone  {a:.4f}  ({a / LAYERS:.4f} per layer)")
    print(f"  tail   {t:.4f}  (+{(t - a) / LAYERS * 1000:.1f} us per layer)")
    print(f"  beside {b:.4f}  (+{(b - a) / LAYERS * 1000:.1f} us per layer)")
    if e is None:
        print("  side   - (this PyTorch has no Event(external=True))")
    else:
        print(f"  side, no copy   {e0:.4f}  (+{(e0 - a) / LAYERS * 1000:.1f} us per layer)")
        print(f"  side, tail copy {e:.4f}  (+{(e - e0) / LAYERS * 1000:.1f} us per layer over side, no copy)")
    print(f"  one 4 MiB copy in a graph alone: {c:.4f} ms")
    if evented is None:
        return
    evented_small = capture(with_tail(with_event, copy_small))
    print(f"side-stream replay, the copy in some graphs' tails only, median of {RUNS} (over side, no copy):")

    def pattern(copying, graph, first=None):
        graphs = [graph if k in copying else evented_alone for k in range(LAYERS)]
        if first is not None:
            graphs[0] = first
        return graphs

    for name, copying in [("2nd", {1}), ("2nd-3rd", {1, 2}), ("2nd-7th", set(range(1, 7))), ("all", set(range(LAYERS)))]:
        big = median(lambda: run_list(pattern(copying, evented)))
        small = median(lambda: run_list(pattern(copying, evented_small)))
        print(f"  {name:<8} 4 MiB +{(big - e0) * 1000:.1f} us   2 KiB +{(small - e0) * 1000:.1f} us")
    warmed = median(lambda: run_list(pattern({1, 2}, evented, first=evented_small)))
    print(f"  2nd-3rd 4 MiB, a 2 KiB copy in the 1st: +{(warmed - e0) * 1000:.1f} us")


if __name__ == "__main__":
    main()
