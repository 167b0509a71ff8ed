"""Where this thread is: the regions open in it, and whether a call runs inside a graphed one.

>>> with autograph.region(warmup=2) as outer:
...     current_region() is outer
True

Per thread, because regions are: a region opened in one thread never changes what another
thread's calls do. This module imports nothing of the engine, so both the engine and the
region can depend on it.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional


class _ThreadState(threading.local):
    # Set per thread on its first use: a missing attribute with getattr's default costs an
    # exception, about 0.4 us on every call.
    def __init__(self) -> None:
        self.regions: List[Any] = []
        self.depth = 0
        # Whether the innermost region is ``enabled=False``: the wrappers read this one flag
        # before anything else, so that a call in a disabled region costs what a disabled
        # process's does (docs/design.md, "A call's life").
        self.off = False


# The engine reads ``thread.regions`` inline on every call: a function call less.
thread = _ThreadState()


def current_region() -> Optional[Any]:
    """The innermost region open in this thread, or None."""
    stack = thread.regions
    return stack[-1] if stack else None


def enter_region(region: Any) -> None:
    thread.regions.append(region)
    thread.off = not region.enabled


def leave_region(region: Any) -> None:
    regions = thread.regions
    # The innermost entry: one region object may be entered again inside itself.
    del regions[len(regions) - 1 - regions[::-1].index(region)]
    thread.off = bool(regions) and not regions[-1].enabled


def inside_a_graphed_call() -> bool:
    """Whether this thread is running a graphed call's function (its module calls are part
    of that call, not top-level calls of their own)."""
    return thread.depth > 0


class nested_calls:
    """Module calls made inside this block belong to the enclosing graphed call."""

    def __enter__(self) -> None:
        thread.depth += 1

    def __exit__(self, *exc: Any) -> None:
        thread.depth -= 1
