"""A CPU stand-in for CUDA graphs, so that the test suite runs the real engine without a GPU.

>>> with emulate_graphs_on_cpu():
...     step(torch.ones(4))     # warmup, "capture", replay: the same code path as on CUDA

"Capture" runs the function once under a dispatch mode that records every ATen op with the
tensors it touched, then restores every pre-existing tensor the run wrote to: like a CUDA
capture, it leaves no effect behind. "Replay" runs the recorded ops again on the same tensor
objects: Python is not re-run, addresses are fixed, in-place effects and fresh random numbers
happen on every replay. Outside ``emulate_graphs_on_cpu()`` CPU calls simply run eagerly.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._capture import Capture
from ._guard import is_view


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> List[torch.Tensor]:
    written = []
    for i, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
        elif isinstance(value, (list, tuple)):
            written.extend(v for v in value if isinstance(v, torch.Tensor))
    return written


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[Any, tuple, dict, Any]] = []
        self.created: set = set()  # storages allocated during the recording
        self.saved: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def _storage(self, t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in _written_tensors(func, args, kwargs):
            if self._storage(t) not in self.created and t.numel():
                self.saved.append((t, t.detach().clone()))
                self.created.add(self._storage(t))  # save each outside storage once
        out = func(*args, **kwargs)
        if torch.Tag.inplace_view in func.tags:
            return out  # metadata changes (t_, squeeze_) persist on the tensor, as on CUDA
        if not is_view(func) and not _written_tensors(func, args, kwargs):
            for t in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.created.add(self._storage(t))
            self.ops.append((func, args, kwargs, out))
        elif not is_view(func):
            self.ops.append((func, args, kwargs, None))
        return out

    def undo_outside_writes(self) -> None:
        with torch.no_grad():
            for tensor, before in reversed(self.saved):
                tensor.copy_(before)


class CpuGraph:
    """The recorded ops of one capture; ``replay()`` runs them again."""

    def __init__(self, ops: List[Tuple[Any, tuple, dict, Any]]):
        self.ops = ops

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                result = func(*args, **kwargs)
                if out is None:
                    continue
                if isinstance(out, torch.Tensor):
                    out.copy_(result)
                else:
                    for o, r in zip(out, result):
                        if isinstance(o, torch.Tensor):
                            o.copy_(r)


class CpuGraphs:
    """The emulated backend: same interface as ``_capture.CudaGraphs``."""

    device_type = "cpu"

    def new_pool(self, device: int) -> Any:
        return None

    def reserved_bytes(self, device: int) -> int:
        return 0

    def capture(self, run: Callable[[], Any], device: int, pool: Any,
                uses_cudnn: bool = False) -> Capture:
        recorder = _Recorder()
        result = Capture(None)
        started = time.perf_counter()
        try:
            with recorder:
                result.outputs = run()
        except BaseException as error:  # noqa: B902 - re-raised by the caller
            result.error = error
        recorder.undo_outside_writes()
        result.graph = CpuGraph(recorder.ops)
        result.seconds = time.perf_counter() - started
        return result

    def free(self, device: int) -> None:
        pass


CPU = CpuGraphs()
_emulating = [False]


def is_emulating() -> bool:
    return _emulating[0]


@contextlib.contextmanager
def emulate_graphs_on_cpu() -> Iterator[None]:
    """Graph CPU calls with the emulation above (for tests), restoring the setting after."""
    before = _emulating[0]
    _emulating[0] = True
    try:
        yield
    finally:
        _emulating[0] = before
