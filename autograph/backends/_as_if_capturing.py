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
from typing import Iterator

import torch

_here = threading.local()


@contextlib.contextmanager
def as_if_capturing() -> Iterator[None]:
    original = torch.cuda.is_current_stream_capturing

    def is_current_stream_capturing() -> bool:
        return getattr(_here, "capturing", False) or original()

    before = getattr(_here, "capturing", False)
    _here.capturing = True
    torch.cuda.is_current_stream_capturing = is_current_stream_capturing
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original
        _here.capturing = before
