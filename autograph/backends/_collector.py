"""Python's garbage collector held off while graphs are captured (docs/design.md, "Capture
ahead").

>>> with collector_paused():          # one capture, or a whole ``capture()`` of many buckets
...     ...                           # no collection runs; objects made before are not scanned

A collection during a capture could destroy an unreachable CUDA graph (or finalize a compiled
kernel whose module is then unloaded), and freeing one inside another capture invalidates that
capture. A collection between the captures of one ``capture()`` call frees next to nothing and
costs a scan of every object in the process (vLLM and SGLang freeze the collector likewise):
so the collector is disabled, and what existed before is frozen (``gc.freeze``: moved out of
the generations a collection scans), until the outermost pause ends. Nothing is collected
before or after: garbage made meanwhile is collected by the next ordinary collection, once
``gc.unfreeze`` has put the frozen objects back in the oldest generation. A process that froze
objects itself (a server after its start-up) keeps them frozen: nothing is frozen or thawed then,
the collector only disabled.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

_lock = threading.Lock()


class _Pauses:
    """The pauses open in any thread: the collector is process-wide, so the outermost pause
    restores it as it found it."""

    depth = 0
    was_enabled = False
    froze = False  # not if something was frozen before: gc.unfreeze would thaw that too


class collector_paused:  # noqa: N801 - used as a context manager, named like one
    """A class, not a generator: ``contextlib.contextmanager`` sets ``__traceback__`` on an
    exception passing through, which one that takes no attribute (a frozen dataclass) refuses,
    replacing the function's own exception."""

    __slots__ = ()

    def __enter__(self) -> None:
        with _lock:
            if _Pauses.depth == 0:
                _Pauses.was_enabled = gc.isenabled()
                _Pauses.froze = gc.get_freeze_count() == 0
                gc.disable()
                if _Pauses.froze:
                    gc.freeze()
            _Pauses.depth += 1

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            _Pauses.depth -= 1
            if _Pauses.depth == 0:
                if _Pauses.froze:
                    gc.unfreeze()
                if _Pauses.was_enabled:
                    gc.enable()
