"""A memory budget for the graphs of one function or one region (``max_graph_memory=``,
docs/design.md, "Pools").

>>> step = autograph.graphed(fn, buckets=[1, 2, 4, 8, 16, 32, 64], max_graph_memory="512MiB")
>>> within_budget(life, c)        # after a capture: drop the least recently replayed graphs

A graph's memory is ``Graph.memory_bytes``, what its capture added to the device's reserved
memory. Once a new graph is adopted and its owner's graphs together hold more than the budget,
the least recently replayed of the others are dropped first, until they fit: their keys go
back to warmup and capture again at a later call, or, dropped ``MAX_EVICTIONS`` times already,
run eagerly with the reason (the traffic needs more graphs than the budget holds: capturing
and dropping them in turn would cost more than eager). A graph bigger than the whole budget is
not kept: its key runs eagerly, said with both figures.
"""

from __future__ import annotations

from typing import Any, Iterable

# A key whose graph was dropped this often under the budget runs eagerly: no capture storm.
MAX_EVICTIONS = 2


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def within_budget(life: Any, c: Any) -> bool:
    """After ``life`` adopted its graph for the call ``c``: keep its owner's graphs (its
    region's, called in one; else its function's) within ``max_graph_memory``."""
    budget = life.options.max_graph_memory
    if budget is None:
        return True
    lives = c.region.lives() if c.region is not None else list(c.cache.entries.values())
    return keep_within_budget(life, lives, budget)


def keep_within_budget(life: Any, lives: Iterable[Any], budget: int) -> bool:
    """After ``life`` adopted its graph, drop the least recently replayed graphs of ``lives``
    (its owner's keys) until their memory fits ``budget``; False if ``life``'s own graph does
    not fit alone and was dropped (the key now runs eagerly)."""
    own = life.graph.memory_bytes
    if own > budget:
        life.fall_back(
            f"its graph takes {_mib(own)}, more than max_graph_memory="
            f"{_mib(budget)} allows for all of {life.function.name}'s graphs; "
            f"raise max_graph_memory, or use smaller buckets",
            raise_now=False,
        )
        return False
    others = sorted(
        (other for other in lives if other is not life and other.graph is not None),
        key=lambda other: other.last_replay,
    )
    total = own + sum(other.graph.memory_bytes for other in others)
    for other in others:
        if total <= budget:
            break
        total -= other.graph.memory_bytes
        _evict(other, budget)
    return True


def _evict(life: Any, budget: int) -> None:
    """Drop ``life``'s graph: its key warms up and captures again (``_key_life``'s "warmup"
    phase), or runs eagerly once it was dropped ``MAX_EVICTIONS`` times."""
    life.evictions += 1
    if life.evictions > MAX_EVICTIONS:
        life.fall_back(
            f"its graph was dropped {life.evictions} times to keep "
            f"{life.function.name}'s graphs within max_graph_memory={_mib(budget)}: "
            f"its calls need more graphs than the budget holds, and capturing them "
            f"in turn costs more than eager; raise max_graph_memory, or use fewer "
            f"buckets",
            raise_now=False,
        )
        return
    graph, life.graph = life.graph, None
    graph.release()
    life.phase, life.warmups = "warmup", 0
