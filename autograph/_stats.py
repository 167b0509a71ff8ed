"""What happened to each key of each graphed function (docs/design.md, "Seeing what happened"): the
rows, the registry of live engines, and the table.

>>> step.stats()[0]
KeyStats(function='step', key='x: f32[8, 512] cuda:0', state='graphed', calls=100,
         eager_calls=1, replays=99, capture_seconds=0.004, graph_bytes=2097152,
         fallback_reason=None, bucket=None, sizes=None, verified=0)
>>> print(format_table(step.stats(), width=100))     # wrapped to a 100-column terminal
>>> [dataclasses.asdict(row) for row in step.stats()]   # plain dicts, for scripts and JSON
"""

from __future__ import annotations

import dataclasses
import textwrap
import weakref
from typing import Any, Dict, List, Optional


@dataclasses.dataclass(frozen=True)
class KeyStats:
    """A snapshot of one key of one graphed function.

    ``calls`` counts every call of the key; ``eager_calls`` those that ran eagerly (warmup and
    fallback); ``replays`` those served by the graph (the capture call included).
    ``graph_bytes`` is what the capture added to the device's reserved memory: the new
    memory its pool took. Graphs of one function (or one region) share a pool, captured
    largest first a later graph reuses the earlier ones' blocks and adds little, so the sum
    over a function's keys is the memory its graphs hold (a key that trains, or runs a
    backward inside, has a pool of its own: its figure is all its own). ``bucket`` and
    ``sizes`` (calls by their real size) are set for bucketed keys; ``real_rows``, ``padded_rows``,
    ``padding_share`` (pad rows over all rows run) and ``padding_waste`` follow from them.
    ``verified`` counts the replays that verify mode checked against an eager run and found
    equal. ``gain`` is eager's time over the replay's as measured on the GPU clock after
    capture (``check_payoff``): 1.8 means the graph runs 1.8x as fast; below 1 the key went
    eager. ``emulated`` is True for a key graphed by the CPU emulation of CUDA graphs
    (``autograph.testing``), whose capture time and memory mean nothing. ``evictions`` counts
    its graphs dropped to keep its function's (or region's) graphs within
    ``max_graph_memory``. Every field is a plain value: ``dataclasses.asdict(row)`` is
    JSON-ready.
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
    bucket: Optional[int] = None  # bucketed keys: the capture size
    sizes: Optional[Dict[int, int]] = None  # bucketed keys: calls by their real size
    verified: int = 0  # replays checked against an eager run (verify=n) and found equal
    gain: Optional[float] = None  # eager time / replay time, measured after capture
    emulated: bool = False  # graphed by the CPU emulation: its timings and memory mean nothing
    evictions: int = 0  # its graphs dropped to keep within max_graph_memory

    @property
    def real_rows(self) -> Optional[int]:
        """A bucket's rows asked for by its calls, summed over its calls."""
        return None if not self.sizes else sum(size * n for size, n in self.sizes.items())

    @property
    def padded_rows(self) -> Optional[int]:
        """A bucket's pad rows, summed over its calls: the bucket's size less each call's."""
        if not self.sizes or not self.bucket:
            return None
        return sum((self.bucket - size) * n for size, n in self.sizes.items())

    @property
    def padding_share(self) -> Optional[float]:
        """The share of a bucket's rows that were padding: 0.2 means a fifth of the rows the
        GPU ran for its calls were pad rows."""
        padded, real = self.padded_rows, self.real_rows
        return None if padded is None or real is None else padded / (padded + real)

    @property
    def padding_waste(self) -> Optional[float]:
        """Padding rows over real rows, for a bucket: 0.25 means a quarter more rows ran."""
        if not self.sizes or not self.bucket:
            return None
        real = sum(size * n for size, n in self.sizes.items())
        return self.bucket * sum(self.sizes.values()) / real - 1


# Every live graphed function, held weakly so that the registry keeps nothing alive.
_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(engine: Any) -> None:
    _engines.add(engine)


def engines() -> List[Any]:
    """Every live engine."""
    return list(_engines)


def _padding(row: KeyStats) -> str:
    """A bucket's pad rows as a share of the rows it ran, and the counts: ``20% 3/15``."""
    if row.padded_rows is None or row.real_rows is None:
        return ""
    ran = row.padded_rows + row.real_rows
    return f"{row.padded_rows / ran:.0%} {row.padded_rows}/{ran}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


# A key is not wrapped narrower than this: a table wider than the terminal then wraps
# around, which still beats one word per line.
_NARROWEST_KEY = 16
_INDENT = "    "


def _lines(cells: List[str], widths: List[int], wrapped: Optional[int]) -> List[str]:
    """One table row; the cell of column ``wrapped`` wraps within its width."""
    columns = [
        textwrap.wrap(cell, widths[i], break_on_hyphens=False) or [""]
        if i == wrapped and len(cell) > widths[i]
        else [cell]
        for i, cell in enumerate(cells)
    ]
    return [
        "  ".join((c[n] if n < len(c) else "").ljust(w) for c, w in zip(columns, widths)).rstrip()
        for n in range(max(len(c) for c in columns))
    ]


def format_table(rows: List[KeyStats], width: Optional[int] = None) -> str:
    """The rows as a text table, one key per row.

    >>> print(format_table(step.stats(), width=80))     # for a terminal 80 columns wide
    function   key                    state  calls  replays  eager
    ---------  ---------------------  -----  -----  -------  -----
    normalise  x: f32[8, 512] cuda:0  eager  3      0        3
        fallback reason: .item() at why_eager.py:14 synchronises with the host

    Without ``width`` (a file, a pipe) every column is there and each key is one line. With
    it, columns empty in every row are left out and, if the table is still wider, each
    fallback reason goes on wrapped lines under its row and long keys wrap in their column.
    The ``verified`` column appears once verify mode checked a replay, ``gain`` once a key's
    payoff was measured, ``evicted`` once ``max_graph_memory`` dropped a graph.
    """
    header = [
        "function",
        "key",
        "state",
        "calls",
        "replays",
        "verified",
        "eager",
        "gain",
        "capture ms",
        "MiB",
        "evicted",
        "padding",
        "fallback reason",
    ]
    body = [
        [
            r.function,
            r.key,
            r.state,
            str(r.calls),
            str(r.replays),
            str(r.verified) if r.verified else "",
            str(r.eager_calls),
            "" if r.gain is None else f"{r.gain:.2f}x",
            "" if r.capture_seconds is None else f"{r.capture_seconds * 1e3:.1f}",
            _mib(r.graph_bytes) if r.graph_bytes else "",
            str(r.evictions) if r.evictions else "",
            _padding(r),
            r.fallback_reason or "",
        ]
        for r in rows
    ]
    optional = (
        {"verified", "gain", "evicted"}
        if width is None
        else {"verified", "gain", "capture ms", "MiB", "evicted", "padding", "fallback reason"}
    )
    keep = [
        i for i, name in enumerate(header) if name not in optional or any(line[i] for line in body)
    ]
    header, body = [header[i] for i in keep], [[line[i] for i in keep] for line in body]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    reasons: List[str] = []
    if width is not None and sum(widths) + 2 * len(widths) - 2 > width:
        if header[-1] == "fallback reason":
            header, widths = header[:-1], widths[:-1]
            reasons = [line.pop() for line in body]
        over = sum(widths) + 2 * len(widths) - 2 - width
        if over > 0:
            widths[1] = max(min(widths[1], _NARROWEST_KEY), widths[1] - over)
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(header, widths)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    for n, line in enumerate(body):
        lines += _lines(line, widths, wrapped=1)
        if reasons and reasons[n]:
            lines += textwrap.wrap(
                f"fallback reason: {reasons[n]}",
                width,
                initial_indent=_INDENT,
                subsequent_indent=_INDENT,
                break_on_hyphens=False,
            )
    return "\n".join(lines)


def memory_lines(rows: List[KeyStats]) -> List[str]:
    """Per function, the memory its live graphs hold together (their pool's share)."""
    held: Dict[str, List[int]] = {}
    for r in rows:
        if r.graph_bytes:
            held.setdefault(r.function, []).append(r.graph_bytes)
    return [
        f"{name}: {len(sizes)} graph(s) hold {_mib(sum(sizes))} MiB" for name, sizes in held.items()
    ]
