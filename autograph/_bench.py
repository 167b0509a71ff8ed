"""Timing helpers and the demo behind ``python -m autograph bench``.

>>> per_call_us(lambda: step(x), calls=200)      # median over repeats, in microseconds

Each figure is the wall time of many back-to-back calls divided by their number, with the GPU
synchronised before and after: what a Python loop calling the function sees, the CPU cost of
launching included. That cost is what CUDA graphs remove.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Sequence

import torch


def per_call_us(call: Callable[[], Any], calls: int = 200, repeats: int = 7,
                warmup: int = 20) -> float:
    """Median over ``repeats`` of the mean wall time of ``calls`` calls, in microseconds."""
    for _ in range(warmup):
        call()
    cuda = torch.cuda.is_available()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def hand_written(fn: Callable, example: Sequence[torch.Tensor], warmup: int = 3) -> Callable:
    """The loop every serving engine writes: static inputs, side-stream warmup, capture,
    then copy in, replay, clone out."""
    statics = [t.clone() for t in example]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(*statics)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = fn(*statics)

    def replay(*args: torch.Tensor) -> torch.Tensor:
        for static, arg in zip(statics, args):
            static.copy_(arg)
        graph.replay()
        return static_out.clone()

    return replay


def mlp(layers: int = 32, width: int = 512, dtype: torch.dtype = torch.bfloat16,
        device: str = "cuda") -> torch.nn.Module:
    blocks: List[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device=device, dtype=dtype).eval().requires_grad_(False)


def format_rows(rows: List[Dict[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table of ``rows`` (dicts) in ``columns`` order."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def demo() -> None:
    """Eager against graphed for a 32-layer MLP at batch 1, or an explanation without a GPU."""
    import autograph

    if not torch.cuda.is_available():
        model = mlp(device="cpu", dtype=torch.float32)
        step = autograph.graphed(mlp(device="cpu", dtype=torch.float32))
        x = torch.randn(1, 512)
        with torch.no_grad():
            eager = per_call_us(lambda: model(x), calls=20, repeats=3, warmup=2)
            graphed = per_call_us(lambda: step(x), calls=20, repeats=3, warmup=2)
        reason = step.forward.stats()[0].fallback_reason  # type: ignore[attr-defined]
        print("No CUDA GPU here, so autograph ran every call eagerly, as it should "
              f"(recorded reason: {reason!r}).\n"
              f"32-layer MLP at batch 1 on the CPU: eager {eager:.0f} us/call, through "
              f"autograph {graphed:.0f} us/call (the wrapper's own cost is the difference).\n"
              "On a CUDA GPU the same command captures the MLP into a CUDA graph and shows "
              "the launch overhead it removes.")
        return
    model = mlp()
    step = autograph.graphed(mlp())
    step.load_state_dict(model.state_dict())
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        hand = hand_written(model, [x])
        calls = [("eager", lambda: model(x)), ("hand-written capture/replay", lambda: hand(x)),
                 ("autograph.graphed", lambda: step(x))]
        rows = [{"variant": name, "us/call": f"{per_call_us(call):.1f}"} for name, call in calls]
        same = torch.equal(step(x), model(x))
    print(f"32-layer Linear(512)+GELU MLP, batch 1, bf16, on {torch.cuda.get_device_name()}"
          f" (torch {torch.__version__}):\n")
    print(format_rows(rows, ["variant", "us/call"]))
    print(f"\nautograph's output equals eager bitwise: {same}.")
    autograph.report()
