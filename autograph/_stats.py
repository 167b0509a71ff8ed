"""What happened to each key of each graphed function (SPEC 5).

>>> step.stats()[0]
KeyStats(function='step', key='x: f32[8, 512] cuda:0', state='graphed', calls=100,
         eager_calls=1, replays=99, capture_seconds=0.004, graph_bytes=2097152,
         fallback_reason=None)
>>> autograph.report()
"""
from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any, List, Optional, TextIO


@dataclasses.dataclass(frozen=True)
class KeyStats:
    """A snapshot of one key of one graphed function.

    ``calls`` counts every call of the key; ``eager_calls`` those that ran eagerly (warmup and
    fallback); ``replays`` those served by the graph (the capture call included).
    ``graph_bytes`` is the growth of the device's reserved memory during capture: graphs of
    one function share a pool, so a later graph often adds little.
    """

    function: str
    key: str
    state: str  # "warmup", "graphed" or "eager"
    calls: int
    eager_calls: int
    replays: int
    capture_seconds: Optional[float]
    graph_bytes: int
    fallback_reason: Optional[str]


# Every live graphed function, held weakly so that the registry keeps nothing alive.
_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(engine: Any) -> None:
    _engines.add(engine)


def stats() -> List[KeyStats]:
    """Snapshots of every key of every live graphed function.

    Each function's counters are read under that function's lock, so one function's rows are
    consistent with each other; rows of different functions are read one after another.
    """
    rows: List[KeyStats] = []
    for engine in list(_engines):
        rows.extend(engine.stats())
    return rows


def reset() -> None:
    """Drop every graph of every graphed function and give their memory back."""
    for engine in list(_engines):
        engine.reset()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def format_table(rows: List[KeyStats]) -> str:
    header = ("function", "key", "state", "calls", "replays", "eager", "capture ms", "MiB",
              "fallback reason")
    body = [
        (r.function, r.key, r.state, str(r.calls), str(r.replays), str(r.eager_calls),
         "" if r.capture_seconds is None else f"{r.capture_seconds * 1e3:.1f}",
         _mib(r.graph_bytes) if r.graph_bytes else "", r.fallback_reason or "")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
             for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(file: Optional[TextIO] = None) -> None:
    """Print ``stats()`` as a table (to stdout unless ``file`` is given)."""
    rows = stats()
    text = format_table(rows) if rows else "autograph: no graphed function has been called."
    print(text, file=file or sys.stdout)
