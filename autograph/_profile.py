"""Named ranges in profiler traces: each replay, capture, warmup, eager call and verify check.

>>> with torch.profiler.profile() as prof:
...     step(x)
>>> [e.key for e in prof.key_averages() if e.key.startswith("autograph.")]
['autograph.replay step(x: f32[8, 512] cuda:0)']

A range is a ``torch.profiler.record_function``, so it shows in ``torch.profiler`` traces and
``key_averages()``, and in Nsight Systems under ``torch.autograd.profiler.emit_nvtx()``, whose
NVTX callbacks turn every record_function into an NVTX range. Ranges exist only while a torch
profiler runs: otherwise ``profile_range`` returns a shared no-op context, and the replay path
reads one module attribute.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

# Every torch profiler (kineto, emit_nvtx, emit_itt) sets and clears its
# ``_is_profiler_enabled`` on start and stop: a few nanoseconds to read, where
# ``torch._C._autograd._profiler_enabled()`` costs a C call (about 50 ns).
from torch.autograd import profiler as torch_profiler

_OFF: ContextManager[Any] = contextlib.nullcontext()


def profile_range(what: str, function: str, key: str) -> ContextManager[Any]:
    """``autograph.{what} {function}({key})`` as a profiler range, or a no-op when no profiler
    runs.

    >>> with profile_range("replay", "step", "x: f32[8, 512] cuda:0"):
    ...     graph.replay(tensors)
    """
    if not torch_profiler._is_profiler_enabled:
        return _OFF
    return torch.profiler.record_function(f"autograph.{what} {function}({key})")
