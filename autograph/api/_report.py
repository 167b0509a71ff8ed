"""What happened, for one graphed function, method, module or region, or for everything.

>>> autograph.stats(step)         # one function's keys (every instance's, for a method)
>>> autograph.stats(model)        # a module graphed by autograph.graphed or in a region
>>> autograph.report()            # every live graphed function, as a table
>>> autograph.reset(model)        # drop graphs and give their memory back

Under ``AUTOGRAPH_LOG``, the interpreter's exit logs which functions ran keys eagerly, and why.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import textwrap
from collections import Counter
from typing import Any, List, Optional, Set, TextIO

import torch

from .. import _config, _stats
from .._stats import KeyStats
from ..engine._engine import Engine, free
from ._graphed import GraphedForward, installed_forward
from ._region import Region, engine_of


def _engines_and_caches(target: Any) -> List[Any]:
    """The engines (or, for one instance of a graphed method, the cache) behind ``target``."""
    if target is None:
        return _stats.engines()
    if isinstance(target, torch.nn.Module):
        found: List[Any] = []
        forward = installed_forward(target)
        if isinstance(forward, GraphedForward):
            found.append(forward._self_engine)
        method_engine = getattr(type(target).__dict__.get("forward"), "_self_engine", None)
        if isinstance(method_engine, Engine) and target in method_engine.instance_caches:
            found.append(method_engine.instance_caches[target])
        region_engine = engine_of(target)
        if region_engine is not None:
            found.append(region_engine)
        return found
    engine = getattr(target, "_self_engine", None)
    if engine is None:
        parent = getattr(target, "_self_parent", None)  # a method bound by wrapt
        engine = getattr(parent, "_self_engine", None)
    if engine is None:
        raise TypeError(
            f"autograph: {target!r} is not graphed: pass a function or module "
            f"made by autograph.graphed, a module called in a region, or a region."
        )
    return [engine]


def stats(target: Any = None) -> List[KeyStats]:
    """Snapshots of the keys of ``target`` (a graphed function or module, a module called in
    a region, a region), or of every live graphed function.

    A function whose keys ran eagerly lists the module calls graphed inside them (its
    islands) under each such key, as ``function > Module`` rows; the list of every function
    leaves those out, as the modules have rows of their own. Each function's counters are
    read under that function's lock, so one function's rows are consistent with each other;
    rows of different functions are read one after another.
    """
    if isinstance(target, Region):
        return target.stats().keys
    islands = target is not None
    return [row for owner in _engines_and_caches(target) for row in owner.stats(islands)]


def reset(target: Any = None) -> None:
    """Drop the graphs of ``target`` (or of every graphed function) and give their memory back.

    Later calls start over, from warmup.
    """
    devices: Set[int] = set()
    for owner in _engines_and_caches(target):
        devices.update(owner.release())
    free(devices)


def report(target: Any = None, file: Optional[TextIO] = None) -> None:
    """Print ``stats(target)`` as a table (to stdout unless ``file`` is given).

    >>> autograph.report(model)

    On a terminal, long keys and fallback reasons wrap to its width; elsewhere (a file, a
    pipe) each key is one line. A last line per function with graphs gives the memory they
    hold together (``graph_bytes`` summed: their share of the pool they were captured into).
    ``stats()`` has the same rows as dataclasses. A note under the table says when keys ran
    on the CPU emulation, whose capture times and memory mean nothing; under
    ``AUTOGRAPH_DISABLE=1`` it says that autograph is disabled.
    """
    rows = stats(target)
    file = file or sys.stdout
    isatty = getattr(file, "isatty", None)
    width = shutil.get_terminal_size().columns if isatty is not None and isatty() else None
    notes = (
        [DISABLED]
        if _config.ENV.disable
        else []
        if rows
        else ["autograph: no graphed function has been called."]
    )
    if any(row.emulated and row.capture_seconds is not None for row in rows):
        notes.append(EMULATED)
    lines = [_stats.format_table(rows, width), *_stats.memory_lines(rows)] if rows else []
    lines += [textwrap.fill(note, width) if width else note for note in notes]
    print("\n".join(lines), file=file)


DISABLED = (
    "autograph is disabled (AUTOGRAPH_DISABLE=1 in the environment): every graphed "
    "function and region runs eagerly, and nothing is captured or counted."
)
EMULATED = (
    "Keys on cpu ran on the CPU emulation of CUDA graphs (autograph.testing): their "
    "capture times and memory are the emulation's and mean nothing for a GPU."
)


def _log_fallbacks_at_exit() -> None:
    """One log line per function and reason for the keys that ran eagerly, if any did."""
    keys: Counter = Counter()
    calls: Counter = Counter()
    for row in stats():
        if row.state == "eager":
            keys[row.function, row.fallback_reason] += 1
            calls[row.function, row.fallback_reason] += row.eager_calls
    if not keys:
        return
    functions = len({function for function, _ in keys})
    lines = [
        f"  {function}: {n} key{'s' * (n > 1)}, {calls[function, reason]} eager "
        f"call{'s' * (calls[function, reason] != 1)}: {reason}"
        for (function, reason), n in sorted(keys.items(), key=str)
    ]
    _config.logger.info(
        "at exit, %d graphed function%s had keys that ran eagerly:\n%s",
        functions,
        "s" * (functions > 1),
        "\n".join(lines),
    )


if _config.ENV.log_level is not None:
    atexit.register(_log_fallbacks_at_exit)
