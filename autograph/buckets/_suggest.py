"""Capture sizes for the batch sizes a bucketed function has seen: the fewest padded rows within
a number of graphs (docs/design.md, "Buckets").

>>> step.suggest_buckets(max_graphs=4)
BucketSuggestion(buckets=[3, 8, 17, 32], padding_share=0.041, current=[1, 2, 4, 8, 16, 32],
                 current_padding_share=0.118, calls=5000)

A call of ``n`` rows in the bucket ``b`` makes the GPU run ``b - n`` pad rows. Over the sizes
seen (``KeyStats.sizes`` of every bucketed key), the best set of at most ``k`` capture sizes is
found exactly by a dynamic programme: sorted, the sizes a bucket serves are a run of
consecutive sizes ending at the bucket, which is itself a size seen (a bucket between two
seen sizes pads more than the larger one), and the largest size seen is always a bucket.
O(k m^2) for m distinct sizes: milliseconds for the sizes of a server (m <= a few hundred).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Sequence

from .._stats import KeyStats


@dataclasses.dataclass(frozen=True)
class BucketSuggestion:
    """Suggested capture sizes and the share of the GPU's rows they would spend on padding
    (pad rows over all rows run, for the calls seen), against the current buckets'."""

    buckets: List[int]
    padding_share: float
    current: List[int]
    current_padding_share: float
    calls: int


def size_histogram(rows: Iterable[KeyStats]) -> Dict[int, int]:
    """Calls by their real size, over every bucketed key of these rows."""
    seen: Dict[int, int] = {}
    for row in rows:
        for size, n in (row.sizes or {}).items():
            seen[size] = seen.get(size, 0) + n
    return seen


def padding_share(histogram: Dict[int, int], buckets: Sequence[int]) -> float:
    """Pad rows over all rows run, with each size in its smallest bucket (sizes above the
    largest bucket run eagerly, unpadded)."""
    ordered = sorted(buckets)
    ran = padded = 0
    for size, n in histogram.items():
        bucket = next((b for b in ordered if b >= size), size)
        ran += bucket * n
        padded += (bucket - size) * n
    return padded / ran if ran else 0.0


def best_buckets(histogram: Dict[int, int], max_graphs: int) -> List[int]:
    """The at most ``max_graphs`` capture sizes that minimise the pad rows over ``histogram``."""
    sizes = sorted(histogram)
    if len(sizes) <= max_graphs:
        return sizes
    counts = [histogram[s] for s in sizes]
    calls, rows = [0], [0]  # prefix sums: calls, and real rows, of the first i sizes
    for s, n in zip(sizes, counts):
        calls.append(calls[-1] + n)
        rows.append(rows[-1] + s * n)

    def pad(i: int, j: int) -> int:  # sizes[i..j] all in the bucket sizes[j]
        return sizes[j] * (calls[j + 1] - calls[i]) - (rows[j + 1] - rows[i])

    # With more sizes than graphs, the best plan uses all k graphs (one more bucket at a size
    # seen never adds padding). best[j]: the fewest pad rows for sizes[0..j] in g buckets, the
    # last sizes[j]; before[g][j]: the index of the bucket before it.
    m = len(sizes)
    best = [pad(0, j) for j in range(m)]
    before: List[List[int]] = [[-1] * m]
    for g in range(1, max_graphs):
        row, back = [0] * m, [-1] * m
        for j in range(g, m):
            row[j], back[j] = min((best[i] + pad(i + 1, j), i) for i in range(g - 1, j))
        best, before = row, before + [back]
    buckets, j = [], m - 1
    for back in reversed(before):
        buckets.append(sizes[j])
        j = back[j]
    return sorted(buckets)


def suggest(
    rows: List[KeyStats], current: Sequence[int], max_graphs: int, name: str
) -> BucketSuggestion:
    """``fn.suggest_buckets(max_graphs=)``: the best capture sizes for the sizes seen."""
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise ValueError(
            f"{name}.suggest_buckets(max_graphs={max_graphs!r}): it must be an "
            f"int >= 1, the number of graphs the sizes may take"
        )
    histogram = size_histogram(rows)
    if not histogram:
        raise ValueError(
            f"{name}.suggest_buckets(): no bucketed calls seen yet; it suggests "
            f"capture sizes from the batch sizes of real calls, so call it after "
            f"serving some traffic with buckets=[...]"
        )
    buckets = best_buckets(histogram, max_graphs)
    return BucketSuggestion(
        buckets,
        round(padding_share(histogram, buckets), 4),
        sorted(current),
        round(padding_share(histogram, current), 4),
        sum(histogram.values()),
    )
