"""Islands: a key that runs eagerly still graphs the module calls inside it, as a region does.

>>> @autograph.graphed
... def f(x):
...     y = m(x)                 # an nn.Module: graphed, an island
...     if y.sum() > 0:          # a host read: f cannot be one graph, so its key runs eagerly
...         y = y * 2
...     return m(y)              # graphed too
>>> f.stats()                    # f's key (eager, with the reason), then "f > Linear" rows

When a key runs eagerly for good (a guard finding, a verify mismatch, state it changes),
its eager calls run inside a region of its own (``island``), made once per key with the
key's options (warmup, outputs, max_graphs, verify), so that its top-level module calls are
graphed with the same keys, warmup, capture, pool and fallbacks as in a region. The function's
own Python runs on every call, as eagerly. Not inside another graphed call (its module calls
belong to that call), not for warmups, and not with ``islands=False``. The region class lives
in ``_region``, which imports the engine: it registers how to make an island here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ContextManager, Dict, List, Optional

from .._scope import current_region, inside_a_graphed_call, nested_calls
from .._stats import KeyStats

# The options a key's island takes from the key: those that are not about its own arguments.
_CARRIED = ("warmup", "outputs", "max_graphs", "verify")

_make_island: Optional[Callable[[Dict[str, Any]], Any]] = None


def register(make_island: Callable[[Dict[str, Any]], Any]) -> None:
    """``make_island(options)``: a region with these options (``_region`` registers it)."""
    global _make_island
    _make_island = make_island


# A key whose graph did not pay (``_payoff``) gets no island: the graphs of the module calls
# inside it would save less than its own did, and measured on the H200 (benchmark (n), a
# GPU-bound MLP) its island's graphs made it 1.37x slower than eager.
NO_ISLAND = False


def eager_scope(life: Any) -> ContextManager[Any]:
    """Where ``life``'s eager call runs: its island, or inside the call (``nested_calls``).

    A key met in an island that runs eagerly because its calls free what they read
    (``frees_reads``) gets no island of its own: the state it rebinds is passed down to its
    module calls, which fall back in turn. An HF DynamicCache grown by ``torch.cat`` on every
    call, passed to every decoder layer and attention module, made islands inside islands down
    to the leaves: a decode loop in a region captured about 80 graphs of single Linear layers
    and norms in its first call (0.28x to 0.44x eager's speed on the H200), each timed by the
    payoff check and each replay dearer than the kernel it spared. Keys eager for another
    reason (a host read) keep their islands, at any depth."""
    if (
        life.phase != "eager"
        or not life.options.islands
        or life.backend is None
        or _make_island is None
        or life.island is NO_ISLAND
        or inside_a_graphed_call()
        or (life.frees_reads and in_an_island())
    ):
        return nested_calls()
    if life.island is None:
        life.island = _make_island({name: getattr(life.options, name) for name in _CARRIED})
    return life.island


# Eager calls of a key whose island made no module call before the island is dropped: a
# function may call its modules only on some calls (a branch on the data).
IDLE_CALLS = 8


def drop_an_idle_island(life: Any) -> None:
    """After an eager call of ``life``'s key: an island in which ``IDLE_CALLS`` calls have made
    no module call is dropped, and later eager calls run inside the call (``nested_calls``).
    Entering an island, as any region, puts autograph's dispatcher in ``nn.Module.__call__``
    and leaving it takes it out: a change of torch's base class, which empties the attribute
    caches of every module class, about 45 us each way on the H200's host (an eager key of a
    tiny function took 136 us a call, against 47 us for the bare function); a function that
    calls no module gains nothing from it. A function whose module calls come only after
    those calls (a rare branch) runs them eagerly, ungraphed, until ``reset``."""
    island = life.island
    if not island:
        return
    if island.captures or island.replays or island.eager_calls or island.passed_through:
        return
    island.idle_calls += 1
    if island.idle_calls >= IDLE_CALLS:
        life.island = NO_ISLAND


def in_an_island() -> bool:
    """Whether this thread's calls are made in a key's island: the key's own fallback was
    said; its module calls' fallbacks show in its stats, and are logged, not warned."""
    region = current_region()
    return region is not None and region.island


def island_rows(life: Any) -> List[KeyStats]:
    """The keys of ``life``'s island, as rows named ``function > Module``."""
    if not life.island:
        return []
    return [
        dataclasses.replace(row, function=f"{life.owner} > {row.function}")
        for row in life.island.stats().keys
    ]
