"""``torch.cuda.is_current_stream_capturing()`` saying True in this thread, as it does during a
CUDA capture, for the runs that stand in for one.

>>> with as_if_capturing():
...     torch.cuda.is_current_stream_capturing()
True

Capture-aware code takes another path while a stream captures: transformers skips its host
reads of padding masks and prompt lengths (``is_tracing``). A run that stands in for a capture
must take that path too: the CPU emulation's recording (on a machine with CUDA as without), and
the buckets' fake run, whose outputs are to be the captured graph's. Only the Python function
is replaced, for this thread's block; autograph's own checks ask torch's C function.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

_here = threading.local()
# The patch is process-wide: installed by the first block of any thread, removed by the last.
_lock = threading.Lock()
_users = 0
_original: Callable[[], bool] = torch.cuda.is_current_stream_capturing  # set at install


def _is_current_stream_capturing() -> bool:
    return getattr(_here, "depth", 0) > 0 or _original()


@contextlib.contextmanager
def as_if_capturing() -> Iterator[None]:
    global _users, _original
    with _lock:
        if _users == 0:
            _original = torch.cuda.is_current_stream_capturing
            torch.cuda.is_current_stream_capturing = _is_current_stream_capturing
        _users += 1
    _here.depth = getattr(_here, "depth", 0) + 1
    try:
        yield
    finally:
        _here.depth -= 1
        with _lock:
            _users -= 1
            if _users == 0:
                torch.cuda.is_current_stream_capturing = _original
