"""A CPU stand-in for CUDA graphs, so that the engine and its tests run without a GPU.

>>> with emulate_graphs_on_cpu():
...     capture = CPU.capture(lambda: step(static_x), device=-1, pool=CPU.new_pool(-1))
...     capture.graph.replay()          # step's ATen ops again, on the same memory

"Capture" runs the function once under a dispatch mode that records every ATen op, then undoes
its effects as a CUDA capture (which computes nothing) would: every tensor that existed before
and was written to gets its contents back, and every random generator its state. "Replay" runs
the recorded ops again, without re-running Python, on the memory they used:

- addresses are fixed: tensors made during the recording are the graph's pool, held by the
  graph; tensors that existed before (parameters, buffers, closure and cache tensors) are read
  by address and held weakly, as a CUDA graph holds nothing of them. A replay that finds one
  freed or moved raises ``RuntimeError`` instead of reading stale memory;
- in-place effects happen on every replay, including batch norm's running statistics, which
  its ops write without their schemas saying so;
- random ops draw fresh numbers on every replay from the generator's current state, so a
  capture plus one replay advances the generator exactly as one eager call does;
- metadata changes (``t_``, ``squeeze_``) happen once, at capture, like any CPU-side work;
  views and ops with no effect on memory (``sym_size``, profiler ranges) are not replayed.

Outside ``emulate_graphs_on_cpu()`` CPU calls are not graphed at all: they run eagerly.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any, Callable, ContextManager, Iterator, List, Sequence, Set

import torch

from . import _devices
from ._as_if_capturing import as_if_capturing
from ._backend import Capture
from ._cpu_recorder import RecordedOp, Recorder

# Emulated captures save and restore the process-wide random generator: one at a time.
_capture_lock = threading.RLock()


class CpuGraph:
    """The recorded ops of one capture; ``replay()`` runs them again.

    >>> capture.graph.replay()      # RuntimeError if a tensor it reads was freed since capture
    """

    def __init__(self, ops: List[RecordedOp]):
        self.ops = ops

    def replay(self) -> None:
        # Resolve every argument first, so that a freed tensor fails the replay before it
        # has written anything.
        arguments = [op.arguments() for op in self.ops]
        # The ops were recorded below autocast (already cast, or deliberately not): run as
        # recorded, as a CUDA graph replays its kernels, whatever autocast the caller is in.
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for op, (args, kwargs) in zip(self.ops, arguments):
                op.run(args, kwargs)


@contextlib.contextmanager
def _counting_inductor_runs(runs: List[int]) -> Iterator[None]:
    """Count runs of Inductor-compiled graphs: their fused CPU kernels are no ATen ops, so the
    recorder can neither see nor replay them (on CUDA the capture records their kernels)."""
    classes = {
        getattr(sys.modules.get(name), "CompiledFxGraph", None)
        for name in ("torch._inductor.output_code", "torch._inductor.codecache")
    }
    patched = [(cls, cls.__call__) for cls in classes if cls is not None]

    def counting(original: Callable) -> Callable:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            runs[0] += 1
            return original(self, *args, **kwargs)

        return call

    for cls, original in patched:
        cls.__call__ = counting(original)
    try:
        yield
    finally:
        for cls, original in patched:
            cls.__call__ = original


class CpuGraphs:
    """The emulated backend: the interface of ``_backend.Backend``, on CPU tensors.

    >>> capture = CPU.capture(run, device=-1, pool=CPU.new_pool(-1))
    >>> capture.graph.replay()
    """

    device_type = "cpu"
    # CPU timings of emulated replays mean nothing, so keys are never judged by them; a test
    # sets a fake clock here to drive the engine's payoff logic (``_payoff``).
    clock: Any = None

    def new_pool(self, device: int) -> Any:
        return None

    def payoff_clock(self, device: int) -> Any:
        return self.clock

    def reserved_bytes(self, device: int) -> int:
        return 0

    @staticmethod
    def is_capturing() -> bool:
        return _recording.active

    def prepare_backward(self, device: int, cudnn: bool) -> None:
        """No library handles to make on the CPU."""

    def eager_stream(self, device: int) -> ContextManager[None]:
        """No streams on the CPU: an eager call runs where it is."""
        return contextlib.nullcontext()

    def autograd_stream(self, device: int) -> None:
        """No streams on the CPU: autograd nodes are made where the call runs."""
        return None

    def capture(
        self,
        run: Callable[[], Any],
        device: int,
        pool: Any,
        uses_cudnn: bool = False,
        generators: Sequence[Any] = (),
    ) -> Capture:
        """Record ``run()`` and undo its effects; its exception goes to ``error``, not raised.

        Every generator the recording draws from is put back after it and drawn from afresh
        by each replay, as CUDA does with the generators registered with its graph
        (``generators``); one not among them (made inside the call) is refused, as CUDA
        refuses an unregistered generator.

        ``memory_bytes`` is the memory the recording allocated, which the graph holds.
        """
        recorder = Recorder(generators)
        result = Capture(None)
        with _capture_lock:
            started = time.perf_counter()
            # As on CUDA: autocast's weight cache would hand the graph casts made before the
            # capture, which die when the autocast block ends; without it they are recorded.
            cache_enabled = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(cache_enabled and not torch.is_autocast_enabled("cpu"))
            inductor_runs = [0]
            _recording.active = True
            try:
                with _counting_inductor_runs(inductor_runs), as_if_capturing(), recorder:
                    # Caught inside the generator context managers, which would set the
                    # error's __traceback__ (refused by a frozen dataclass exception).
                    try:
                        result.outputs = run()
                    except BaseException as error:  # noqa: B902 - re-raised by the caller
                        result.error = error
            finally:
                _recording.active = False
                torch.set_autocast_cache_enabled(cache_enabled)
                recorder.undo_effects()
            if inductor_runs[0]:
                result.hard_error = RuntimeError(
                    "the CPU emulation cannot record Inductor's fused CPU kernels; under "
                    "emulate_graphs_on_cpu() compile with backend='eager' or 'aot_eager'"
                )
            result.graph = CpuGraph(recorder.ops)
            result.seconds = time.perf_counter() - started
            result.memory_bytes = recorder.pool_bytes()
        return result

    def allocated_in_pool(self, pool: Any, device: int, addresses: List[int]) -> Set[int]:
        """None: the recorder sees every tensor a recording makes."""
        return set()

    def free(self, device: int) -> None:
        """Nothing to give back: the graphs' memory goes with the graphs."""


CPU = CpuGraphs()


class _Recording(threading.local):
    active = False  # a class default: no exception for a thread that never recorded


_recording = _Recording()


def is_recording() -> bool:
    """Whether this thread is inside an emulated capture, as a CUDA stream can be capturing.

    >>> with emulate_graphs_on_cpu():
    ...     CPU.capture(lambda: is_recording(), -1, None).outputs
    True
    """
    return _recording.active


def is_emulating() -> bool:
    """Whether CPU calls are graphed with the emulation (inside ``emulate_graphs_on_cpu()``).

    >>> with emulate_graphs_on_cpu():
    ...     assert is_emulating()
    """
    return _devices.emulation() is CPU


class emulate_graphs_on_cpu(contextlib.ContextDecorator):
    """Graph CPU calls with the emulation inside the block; the setting before comes back after.

    >>> with emulate_graphs_on_cpu():
    ...     step(torch.ones(4))     # warmup, capture and replays, as on CUDA

    Blocks nest, and the setting comes back on an exception too. Also usable as a decorator.
    The setting is process-wide, so that graphed calls in other threads are emulated too: it
    registers this backend as the one of CPU tensors (``_devices.use_emulation``). A class,
    not a generator, so that an exception passes through untouched (``contextmanager`` sets
    its ``__traceback__``, which a frozen dataclass exception refuses).
    """

    def __init__(self) -> None:
        self._before: List[Any] = []  # a stack: one decorator's function may call itself

    def __enter__(self) -> None:
        self._before.append(_devices.use_emulation(CPU))

    def __exit__(self, *exc: Any) -> None:
        _devices.use_emulation(self._before.pop())
