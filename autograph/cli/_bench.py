"""Timing helpers and the benchmark's row conventions, shared by ``benchmarks/`` and the demo
behind ``python -m autograph bench`` (``_demo``).

>>> per_call_us(lambda: step(x), calls=200)      # median over repeats, in microseconds
>>> side_by_side({"hand": lambda: hand(x), "autograph": lambda: step(x)})   # interleaved

Each figure is the wall time of many back-to-back calls divided by their number, with the GPU
synchronised before and after: what a Python loop calling the function sees, the CPU cost of
launching included. That cost is what CUDA graphs remove.

``AUTOGRAPH_BENCH_SMOKE=1`` runs the benchmark's code paths on the CPU with tiny call counts
(CUDA graphs emulated by ``autograph.testing``, hand-written graphs replayed eagerly): it
checks that the benchmark code runs, its figures mean nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

SMOKE = os.environ.get("AUTOGRAPH_BENCH_SMOKE", "") == "1"


# ---- where and how to time ----


def device() -> str:
    """The device the benchmark runs on: ``cuda``, or ``cpu`` for a smoke run."""
    return "cpu" if SMOKE or not torch.cuda.is_available() else "cuda"


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def reserved_bytes() -> int:
    """The CUDA caching allocator's reserved memory (0 without CUDA)."""
    return torch.cuda.memory_reserved() if device() == "cuda" else 0


def _counts(calls: int, repeats: int, warmup: int) -> Tuple[int, int, int]:
    return (min(calls, 2), 1, min(warmup, 1)) if SMOKE else (calls, repeats, warmup)


def per_call_us(
    call: Callable[[], Any], calls: int = 200, repeats: int = 7, warmup: int = 20
) -> float:
    """Median over ``repeats`` of the mean wall time of ``calls`` calls, in microseconds."""
    calls, repeats, warmup = _counts(calls, repeats, warmup)
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def interleaved_us(
    variants: Dict[str, Callable[[], Any]],
    calls: int = 200,
    rounds: int = 7,
    warmup: int = 20,
    contexts: Optional[Dict[str, Callable[[], Any]]] = None,
) -> Dict[str, List[float]]:
    """Each variant's mean microseconds per call in each of ``rounds`` rounds of ``calls``
    calls, the variants interleaved round by round (so that a drift of the machine hits all of
    them alike). ``contexts`` gives some variants a context manager factory, entered around
    their timed calls only."""
    calls, rounds, warmup = _counts(calls, rounds, warmup)
    contexts = contexts or {}
    for name, call in variants.items():
        with contexts.get(name, contextlib.nullcontext)():
            for _ in range(warmup):
                call()
    samples: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            with contexts.get(name, contextlib.nullcontext)():
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                sync()
                elapsed = time.perf_counter() - start
            samples[name].append(elapsed / calls * 1e6)
    return samples


def side_by_side(
    variants: Dict[str, Callable[[], Any]],
    calls: int = 200,
    rounds: int = 7,
    warmup: int = 20,
    contexts: Optional[Dict[str, Callable[[], Any]]] = None,
) -> Dict[str, float]:
    """Each variant's median over ``rounds`` interleaved rounds (``interleaved_us``)."""
    samples = interleaved_us(variants, calls, rounds, warmup, contexts)
    return {name: statistics.median(values) for name, values in samples.items()}


def latencies_us(call: Callable[[], Any], n: int = 300, warmup: int = 10) -> List[float]:
    """Each call's own latency (GPU synchronised after it), sorted, in microseconds."""
    n, _, warmup = _counts(n, 1, warmup)
    for _ in range(warmup):
        call()
    out = []
    for _ in range(n):
        sync()
        start = time.perf_counter()
        call()
        sync()
        out.append((time.perf_counter() - start) * 1e6)
    return sorted(out)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` (0..100) percentile of sorted values, nearest rank."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def compile_for_bench(fn: Any, **kwargs: Any) -> Any:
    """``torch.compile(fn, **kwargs)``; in a smoke run the eager backend (no C++ build)."""
    if SMOKE:
        return torch.compile(fn, backend="eager", dynamic=kwargs.get("dynamic"))
    return torch.compile(fn, **kwargs)


def raise_recompile_limit(limit: int = 64) -> None:
    """Let one code object hold ``limit`` compiled entries (several modes, several sizes)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))


def dynamo_counters() -> Dict[str, Dict[str, int]]:
    """A copy of ``torch._dynamo.utils.counters``."""
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items()}


def counter_changes(
    before: Dict[str, Dict[str, int]],
    after: Dict[str, Dict[str, int]],
    groups: Sequence[str] = ("frames", "stats", "recompiles", "unimplemented", "graph_break"),
) -> Dict[str, int]:
    """The dynamo counters (of ``groups``) that changed between two ``dynamo_counters()``."""
    changes = {}
    for group in groups:
        for name, value in after.get(group, {}).items():
            delta = value - before.get(group, {}).get(name, 0)
            if delta:
                changes[f"{group}.{name}"] = delta
    return changes


# ---- hand-written graphs ----


class _EagerGraph:
    """A smoke run's stand-in for ``torch.cuda.CUDAGraph`` on the CPU: replay re-runs the
    recorded function and copies its results into the outputs of the "capture"."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        new, _ = torch.utils._pytree.tree_flatten(self.fn())
        old, _ = torch.utils._pytree.tree_flatten(self.output)
        for o, n in zip(old, new):
            if isinstance(o, torch.Tensor):
                o.copy_(n)


def capture_graph(
    fn: Callable[[], Any], warmup: int = 3, pool: Any = None, stream: Any = None
) -> Tuple[Any, Any]:
    """(graph, static outputs) of ``fn`` after ``warmup`` calls on a side stream: what every
    serving engine writes. ``pool`` shares a memory pool between graphs."""
    if device() != "cuda":
        for _ in range(warmup):
            fn()
        graph = _EagerGraph(fn)
        return graph, graph.output
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = fn()
    # The graph reads fn's tensors (a model's weights and buffers) by address: were fn the
    # last holder of the model, the model would be freed and replays would read whatever
    # reuses its memory. (Benchmark (e)'s hand-written buckets did: max error 4.84.)
    graph.keeps_alive = fn
    return graph, output


def new_pool() -> Any:
    return torch.cuda.graph_pool_handle() if device() == "cuda" else None


def hand_written(
    fn: Callable, example: Sequence[torch.Tensor], warmup: int = 3, batched: bool = False
) -> Callable:
    """The loop every serving engine writes: static inputs, side-stream warmup, capture,
    then copy in, replay, clone out. ``batched`` copies all inputs with one
    ``torch._foreach_copy_`` instead of one ``copy_`` each."""
    statics = [t.clone() for t in example]
    graph, static_out = capture_graph(lambda: fn(*statics), warmup)

    if batched:

        def replay(*args: torch.Tensor) -> torch.Tensor:
            torch._foreach_copy_(statics, args)
            graph.replay()
            return static_out.clone()

        return replay

    def replay_each(*args: torch.Tensor) -> torch.Tensor:
        for static, arg in zip(statics, args):
            static.copy_(arg)
        graph.replay()
        return static_out.clone()

    return replay_each


def mlp(
    layers: int = 32, width: int = 512, dtype: torch.dtype = torch.bfloat16, device: str = "cuda"
) -> torch.nn.Module:
    blocks: List[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device=device, dtype=dtype).eval().requires_grad_(False)


# ---- rows ----


def progress(message: str) -> None:
    """A progress line on stderr, flushed: a run cut off by a time limit still shows it."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def infer_kind(variant: str) -> str:
    """eager / hand / autograph / compile / other, from a variant's name."""
    text = variant.lower()
    if "compile" in text and "autograph" not in text:
        return "compile"
    if "autograph" in text or "region" in text:
        return "autograph"
    if "hand" in text or "make_graphed_callables" in text or "replay alone" in text:
        return "hand"
    if "eager" in text or "bare" in text:
        return "eager"
    return "other"


class Rows(list):
    """A case's result rows. Each row appended is printed as a progress line and, when a path
    is given, the rows so far are written there as JSON (a case cut off keeps its rows)."""

    def __init__(self, path: Optional[str] = None):
        super().__init__()
        self.path = path

    def append(self, row: Dict[str, Any]) -> None:  # type: ignore[override]
        row = dict(row)
        row.setdefault("kind", infer_kind(str(row.get("variant", ""))))
        super().append(row)
        progress(
            f"{row.get('case', '')} | {row.get('variant', '')} | {figure(row)} | "
            f"{row.get('note', '')}"
        )
        self.save()

    def extend(self, rows: Any) -> None:  # type: ignore[override]
        for row in rows:
            self.append(row)

    def note(self, text: str, sep: str = " ") -> None:
        """Add to the last row's note."""
        if self:
            old = self[-1].get("note", "")
            self[-1]["note"] = (old + sep + text) if old else text
            self.save()

    def save(self) -> None:
        if self.path:
            with open(self.path + ".tmp", "w") as fh:
                json.dump(list(self), fh)
            os.replace(self.path + ".tmp", self.path)


def figure(row: Dict[str, Any]) -> str:
    """A row's figure as the table shows it: ``158.2`` (us per call), ``3.21 ms/cycle``..."""
    value = row.get("value")
    if value is None:
        return str(row.get("us/call", "n/a"))
    unit = row.get("unit", "us/call")
    text = f"{value:.1f}" if abs(value) >= 10 or value == 0 else f"{value:.2f}"
    if abs(value) >= 10000:
        text = f"{value:.0f}"
    return text if unit == "us/call" else f"{text} {unit}"


def add_row(
    rows: List[Dict[str, Any]],
    case: str,
    variant: str,
    value: Optional[float],
    unit: str = "us/call",
    note: str = "",
    kind: Optional[str] = None,
    **extra: Any,
) -> None:
    row = {"case": case, "variant": variant, "value": value, "unit": unit, "note": note}
    if kind:
        row["kind"] = kind
    row.update(extra)
    rows.append(row)


def failure(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:100] if lines else ''}"


def timed(
    rows: List[Dict[str, Any]],
    case: str,
    variant: str,
    call: Callable[[], Any],
    note: str = "",
    kind: Optional[str] = None,
    timer: Optional[Callable] = None,
    **extra: Any,
) -> Optional[float]:
    """Time ``call`` (``per_call_us`` unless ``timer`` is given) and add its row; a variant
    that fails gets an ``n/a`` row with the error, and None is returned."""
    try:
        us = (timer or per_call_us)(call)
    except Exception as error:  # a reference that does not support the case
        add_row(rows, case, variant, None, note=failure(error), kind=kind, **extra)
        return None
    add_row(rows, case, variant, us, note=note, kind=kind, **extra)
    return us


def with_ratio(
    rows: List[Dict[str, Any]],
    value: Optional[float],
    reference: Optional[float],
    label: str = "hand-written",
    row: Optional[Dict[str, Any]] = None,
) -> None:
    """Note on ``row`` (default: the last) ``value / reference`` as ``1.004x hand-written``."""
    if value and reference:
        ratio = value / reference
        target = rows[-1] if row is None else row
        target["ratio"], target["ratio_to"] = ratio, label
        old = target.get("note", "").rstrip().rstrip(";")
        target["note"] = f"{old}; {ratio:.3f}x {label}" if old else f"{ratio:.3f}x {label}"
        if hasattr(rows, "save"):
            rows.save()  # type: ignore[attr-defined]


def format_rows(rows: List[Dict[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table of ``rows`` (dicts) in ``columns`` order."""
    # An unescaped "|" in a note ("max |error|") would split its cell in two.
    cells = [[str(r.get(c, "")).replace("|", "\\|") for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


# ---- python -m autograph bench ----


def compare(samples: Dict[str, List[float]], base: str, other: str) -> Tuple[float, bool]:
    """(median of ``other`` minus median of ``base``, whether the two differ beyond the noise:
    ``other`` was slower in every round, or faster in every round). Rounds are paired because
    ``interleaved_us`` runs a round's variants back to back, under the same load."""
    difference = statistics.median(samples[other]) - statistics.median(samples[base])
    slower = [o > b for b, o in zip(samples[base], samples[other])]
    return difference, len(slower) > 1 and (all(slower) or not any(slower))


def spread_table(samples: Dict[str, List[float]]) -> str:
    """A Markdown table: each variant's median and fastest-to-slowest round, us per call."""
    return format_rows(
        [
            {
                "variant": name,
                "median us/call": f"{statistics.median(values):.1f}",
                "rounds, fastest to slowest": f"{min(values):.1f} to {max(values):.1f}",
            }
            for name, values in samples.items()
        ],
        ["variant", "median us/call", "rounds, fastest to slowest"],
    )
