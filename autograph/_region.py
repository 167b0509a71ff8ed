"""``with autograph.region():`` graphs the top-level module calls inside it (SPEC 1).

>>> with autograph.region():
...     logits = model(ids)          # graphed as autograph.graphed(model) would graph it
>>> with autograph.region(enabled=False):
...     logits = model(ids)          # everything inside runs eagerly, decorated functions too

A region is a per-thread scope. While one is open anywhere, ``nn.Module.__call__`` is replaced
by a thin function that, in a thread with an open region, sends a module call made outside any
other module's forward (or graphed function) through that module's own graphed engine; every
other call goes to the original. The original is put back when the last region closes, so
torch's global state is as before. Graphs stay with their module (held weakly) for the next
region, and graphs captured in one region share one memory pool.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Dict, List, Optional

import torch

from . import _stats
from ._config import Options

_thread = threading.local()


def current() -> Optional["Region"]:
    """The innermost region open in this thread, or None."""
    stack = getattr(_thread, "stack", None)
    return stack[-1] if stack else None


class nested_calls:
    """Module calls made inside this block belong to the enclosing graphed call."""

    def __enter__(self) -> None:
        _thread.depth = getattr(_thread, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _thread.depth -= 1


@dataclasses.dataclass(frozen=True)
class RegionStats:
    """What one region did: counts of its calls, and snapshots of the keys it touched."""

    captures: int
    replays: int
    eager_calls: int
    keys: List[_stats.KeyStats]


class Region:
    """A scope that graphs module calls and sets options; see ``autograph.region``."""

    def __init__(self, enabled: bool, explicit: Dict[str, Any]):
        Options(**explicit)  # validate now, not at the first call
        self.enabled = enabled
        self.explicit = explicit
        self.options_key = tuple(sorted(explicit.items()))
        self.pools: Dict[int, Any] = {}
        self.captures = self.replays = self.eager_calls = 0
        self._touched: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._names: Dict[int, str] = {}
        self._lock = threading.Lock()

    def pool(self, backend: Any, device: int) -> Any:
        with self._lock:
            if device not in self.pools:
                self.pools[device] = backend.new_pool(device)
            return self.pools[device]

    def note(self, function: str, entry: Any, event: str) -> None:
        with self._lock:
            setattr(self, event, getattr(self, event) + 1)
            if id(entry) not in self._touched:
                self._touched[id(entry)] = entry
                self._names[id(entry)] = function

    def stats(self) -> RegionStats:
        """Counts of this region's captures, replays and eager calls, and its keys' stats."""
        with self._lock:
            keys = [entry.stats(self._names[i]) for i, entry in list(self._touched.items())]
            return RegionStats(self.captures, self.replays, self.eager_calls, keys)

    def __enter__(self) -> "Region":
        stack = getattr(_thread, "stack", None)
        if stack is None:
            stack = _thread.stack = []
        _install_module_call()
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _thread.stack.remove(self)
        _remove_module_call()


def region(*, enabled: bool = True, **options: Any) -> Region:
    """A ``with`` block whose top-level ``nn.Module`` calls are graphed.

    >>> with autograph.region():
    ...     for step in range(n):
    ...         logits = model(ids, past_key_values=cache, cache_position=pos).logits
    >>> with autograph.region(outputs="static", warmup=2) as r:
    ...     ...
    >>> r.stats()

    Takes the options of ``autograph.graphed``; a graphed function's own options win over the
    region's, an inner region's over an outer one's. ``enabled=False`` runs everything inside
    eagerly, decorated functions included (``AUTOGRAPH_DISABLE=1`` beats every region).
    Regions are per thread: enter and leave one in the same thread.
    """
    from ._graphed import check_option_names

    check_option_names(options, "autograph.region")
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r}: it must be True or False.")
    return Region(enabled, options)


# ---- the module-call patch ----

_patch_lock = threading.Lock()
_patch_users = 0
_original_call = torch.nn.Module.__call__
_module_engines: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def _region_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    if getattr(_thread, "depth", 0) or not getattr(_thread, "stack", None):
        return _original_call(module, *args, **kwargs)
    from ._graphed import BoundGraphedMethod, engine_for_module_calls

    if isinstance(module.__dict__.get("forward"), BoundGraphedMethod):
        return _original_call(module, *args, **kwargs)  # graphed(module): it graphs itself
    engine = _module_engines.get(module)
    if engine is None:
        engine = _module_engines[module] = engine_for_module_calls(module, _original_call)
    return engine(module, args, kwargs)


def _install_module_call() -> None:
    global _patch_users, _original_call
    with _patch_lock:
        if _patch_users == 0:
            _original_call = torch.nn.Module.__call__
            torch.nn.Module.__call__ = _region_call  # type: ignore[method-assign]
        _patch_users += 1


def _remove_module_call() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            torch.nn.Module.__call__ = _original_call  # type: ignore[method-assign]
