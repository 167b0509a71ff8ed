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
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ._capture import Capture
from ._modes import CompiledCodeRunsUnder
from ._ranks import COLLECTIVE_NAMESPACES
from ._reads import written_tensors

_aten = torch.ops.aten

# Emulated captures save and restore the process-wide random generator: one at a time.
_capture_lock = threading.RLock()

_Layout = Tuple[torch.dtype, Tuple[int, ...], Tuple[int, ...], int, bool, bool]


def _returns_only_views(func: Any) -> bool:
    """Whether every output of ``func`` aliases an input without writing it (``view``, ``t``).

    >>> _returns_only_views(_aten.t.default), _returns_only_views(_aten.t_.default)
    (True, False)
    """
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _rebuildable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is plain strided memory, so that a view can be rebuilt from its storage.

    >>> _rebuildable(torch.ones(2)), _rebuildable(torch.ones(2).to_sparse())
    (True, False)
    """
    return (tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested
            and type(tensor).__torch_dispatch__ is torch._C._disabled_torch_dispatch_impl)


def _storage_key(tensor: torch.Tensor) -> int:
    """The address of the storage object ``tensor`` views, shared by all views of its memory.

    >>> _storage_key(x) == _storage_key(x.t())
    True
    """
    return tensor.untyped_storage()._cdata


def _layout(tensor: torch.Tensor) -> _Layout:
    """Everything but the memory that a view needs: what ``_view`` rebuilds from.

    >>> _layout(torch.ones(2, 3).t())
    (torch.float32, (3, 2), (1, 3), 0, False, False)
    """
    return (tensor.dtype, tuple(tensor.size()), tuple(tensor.stride()),
            tensor.storage_offset(), tensor.is_conj(), tensor.is_neg())


def _view(storage: torch.UntypedStorage, layout: _Layout) -> torch.Tensor:
    """A fresh tensor on ``storage`` with ``layout``: same memory, private metadata.

    >>> _view(x.untyped_storage(), _layout(x.t())).add_(1)    # adds 1 to x
    """
    dtype, size, stride, offset, conj, neg = layout
    # A normal tensor even under inference_mode: a replay outside it may write to this one.
    with torch.inference_mode(False):
        view = torch.empty(0, dtype=dtype, device=storage.device)
        view.set_(storage, offset, size, stride)
    if conj:
        torch._C._set_conj(view, True)
    if neg:
        torch._C._set_neg(view, True)
    return view


class _OutsideTensor:
    """A tensor that existed before the capture: its memory held weakly, read by address.

    >>> argument = _OutsideTensor(weight)
    >>> argument.resolve(torch.ops.aten.mm.default)     # a view of weight's memory
    """

    __slots__ = ("_storage", "_address", "_layout")

    def __init__(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        self._storage = StorageWeakRef(storage)
        self._address = storage.data_ptr()
        self._layout = _layout(tensor)

    def resolve(self, func: Any) -> torch.Tensor:
        """A view of the memory, as captured; ``RuntimeError`` if that memory is gone."""
        storage = torch.UntypedStorage._new_with_weak_ptr(self._storage.cdata)
        if storage is None:
            raise RuntimeError(
                f"the emulated graph reads a tensor that was freed since capture: "
                f"{self._description(func)}; on CUDA this would read freed memory")
        if storage.data_ptr() != self._address:
            raise RuntimeError(
                f"the emulated graph reads a tensor whose memory moved since capture (its "
                f"storage was resized): {self._description(func)}; on CUDA this would read "
                f"memory the tensor no longer owns")
        return _view(storage, self._layout)

    def _description(self, func: Any) -> str:
        dtype, size = self._layout[:2]
        dtype_name = str(dtype).replace("torch.", "")
        return f"a {dtype_name} tensor of shape {size}, an argument of {func}"


class _RecordedOp:
    """One op of the recording, with its arguments as the graph holds them.

    >>> args, kwargs = op.arguments()       # weakly held tensors resolved, or RuntimeError
    >>> op.run(args, kwargs)
    """

    __slots__ = ("func", "leaves", "spec", "outside", "results")

    def __init__(self, func: Any, leaves: List[Any], spec: TreeSpec,
                 results: List[Tuple[int, torch.Tensor]]):
        self.func = func
        self.leaves = leaves  # the flattened (args, kwargs); tensors as _view or _OutsideTensor
        self.spec = spec
        self.outside = [i for i, leaf in enumerate(leaves) if isinstance(leaf, _OutsideTensor)]
        self.results = results  # (index in the flattened output, the pool tensor it goes to)

    def arguments(self) -> Tuple[tuple, dict]:
        leaves = list(self.leaves)
        for index in self.outside:
            leaves[index] = leaves[index].resolve(self.func)
        return tree_unflatten(leaves, self.spec)

    def run(self, args: tuple, kwargs: dict) -> None:
        output = self.func(*args, **kwargs)
        if self.func.namespace in COLLECTIVE_NAMESPACES:
            # A collective's result is ready once waited on, as the eager call waited on it
            # (dist.all_reduce waits on its Work; a functional collective's result on its
            # first use), and it is copied into the graph's memory below only then.
            for leaf in tree_flatten(output)[0]:
                if isinstance(leaf, torch.ScriptObject) and hasattr(leaf, "wait"):
                    leaf.wait()
                elif isinstance(leaf, torch.Tensor) and self.func.namespace != "c10d":
                    torch.ops._c10d_functional.wait_tensor(leaf)
        if self.results:
            flat_output, _ = tree_flatten(output)
            for index, destination in self.results:
                destination.copy_(flat_output[index])


class _Recorder(CompiledCodeRunsUnder):
    """Records the ops that write memory or make new tensors, and what to undo after."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[_RecordedOp] = []
        # Storages made during the recording, by _storage_key: the graph's pool. Holding them
        # also keeps their keys from being reused by later storages.
        self.pool: Dict[int, torch.UntypedStorage] = {}
        # What the recording wrote that existed before, with its contents before the write.
        self.saved: Dict[int, Tuple[Any, Any]] = {}
        default = torch.default_generator
        self.generators: Dict[int, Tuple[torch.Generator, torch.Tensor]] = {
            id(default): (default, default.get_state())}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket is _aten.lift_fresh:
            # torch.tensor(...) made this tensor during the recording, outside any op: pool
            # memory, whose value each replay restores first (a CUDA graph's copy of a
            # constant runs on every replay), in case the function then writes to it.
            out = func(*args, **kwargs)
            storage = self.pool[_storage_key(out)] = out.untyped_storage()
            leaves, spec = tree_flatten(((_view(storage, _layout(out)), out.detach().clone()),
                                         {}))
            self.ops.append(_RecordedOp(_aten.copy_.default, leaves, spec, []))
            return out
        if torch.Tag.inplace_view in func.tags or _returns_only_views(func):
            return func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        for leaf in leaves:
            if isinstance(leaf, torch.Generator) and id(leaf) not in self.generators:
                self.generators[id(leaf)] = (leaf, leaf.get_state())
        written = written_tensors(func, args, kwargs)
        for tensor in written:
            self._save_before_write(tensor)
        # Taken before the op runs: an out= op may resize its output.
        held = [self._hold(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        output = func(*args, **kwargs)
        results = self._new_tensors(output, inputs)
        if written or results or func.namespace in COLLECTIVE_NAMESPACES:
            # (a collective that writes nothing new still runs, and waits, at every replay)
            self.ops.append(_RecordedOp(func, held, spec, results))
        return output

    def _hold(self, tensor: torch.Tensor) -> Any:
        if not _rebuildable(tensor):
            return tensor  # no storage to hold instead; rare on graphed paths
        if _storage_key(tensor) in self.pool:
            return _view(tensor.untyped_storage(), _layout(tensor))
        return _OutsideTensor(tensor)

    def _save_before_write(self, tensor: torch.Tensor) -> None:
        if not _rebuildable(tensor):
            if id(tensor) not in self.saved:
                self.saved[id(tensor)] = (tensor, tensor.clone())
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.pool and key not in self.saved and storage.nbytes():
            # The whole storage: later writes may go through other views of it.
            self.saved[key] = (storage, storage.clone())

    def _new_tensors(self, output: Any, inputs: List[torch.Tensor]
                     ) -> List[Tuple[int, torch.Tensor]]:
        """The outputs that are new memory (not an input written in place or viewed)."""
        input_keys = {_storage_key(t) for t in inputs if _rebuildable(t)}
        flat_output, _ = tree_flatten(output)
        results = []
        for index, value in enumerate(flat_output):
            if not isinstance(value, torch.Tensor) or any(value is t for t in inputs):
                continue
            if not _rebuildable(value):
                results.append((index, value))
                continue
            key = _storage_key(value)
            if key not in input_keys:
                self.pool[key] = value.untyped_storage()
                results.append((index, _view(self.pool[key], _layout(value))))
        return results

    def undo_effects(self) -> None:
        """Give every tensor that existed before, and every generator, its state before."""
        with torch.no_grad():
            for target, before in self.saved.values():
                target.copy_(before)
        for generator, state in self.generators.values():
            generator.set_state(state)
        self.saved.clear()

    def pool_bytes(self) -> int:
        return sum(storage.nbytes() for storage in self.pool.values())


class CpuGraph:
    """The recorded ops of one capture; ``replay()`` runs them again.

    >>> capture.graph.replay()      # RuntimeError if a tensor it reads was freed since capture
    """

    def __init__(self, ops: List[_RecordedOp]):
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
    classes = {getattr(sys.modules.get(name), "CompiledFxGraph", None)
               for name in ("torch._inductor.output_code", "torch._inductor.codecache")}
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


@contextlib.contextmanager
def _capturing_as_cuda_says() -> Iterator[None]:
    """``torch.cuda.is_current_stream_capturing()`` says True in this thread while it records,
    as it does during a CUDA capture: capture-aware code (transformers skips its host reads of
    padding masks and prompt lengths) then takes the path it takes on CUDA."""
    original = torch.cuda.is_current_stream_capturing

    def is_current_stream_capturing() -> bool:
        return _recording.active or original()

    torch.cuda.is_current_stream_capturing = is_current_stream_capturing
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original


class CpuGraphs:
    """The emulated backend: the interface of ``_capture.CudaGraphs``, on CPU tensors.

    >>> capture = CPU.capture(run, device=-1, pool=CPU.new_pool(-1))
    >>> capture.graph.replay()
    """

    device_type = "cpu"

    def new_pool(self, device: int) -> Any:
        return None

    def reserved_bytes(self, device: int) -> int:
        return 0

    def eager_stream(self, device: int) -> ContextManager[None]:
        """No streams on the CPU: an eager call runs where it is."""
        return contextlib.nullcontext()

    def autograd_stream(self, device: int) -> None:
        """No streams on the CPU: autograd nodes are made where the call runs."""
        return None

    def capture(self, run: Callable[[], Any], device: int, pool: Any,
                uses_cudnn: bool = False) -> Capture:
        """Record ``run()`` and undo its effects; its exception goes to ``error``, not raised.

        ``memory_bytes`` is the memory the recording allocated, which the graph holds.
        """
        recorder = _Recorder()
        result = Capture(None)
        with _capture_lock:
            started = time.perf_counter()
            # As on CUDA: autocast's weight cache would hand the graph casts made before the
            # capture, which die when the autocast block ends; without it they are recorded.
            cache_enabled = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(cache_enabled
                                             and not torch.is_autocast_enabled("cpu"))
            inductor_runs = [0]
            _recording.active = True
            try:
                with _counting_inductor_runs(inductor_runs), _capturing_as_cuda_says(), \
                        recorder:
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
                    "emulate_graphs_on_cpu() compile with backend='eager' or 'aot_eager'")
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


_emulating = False


def is_emulating() -> bool:
    """Whether CPU calls are graphed with the emulation (inside ``emulate_graphs_on_cpu()``).

    >>> with emulate_graphs_on_cpu():
    ...     assert is_emulating()
    """
    return _emulating


@contextlib.contextmanager
def emulate_graphs_on_cpu() -> Iterator[None]:
    """Graph CPU calls with the emulation inside the block; the setting before comes back after.

    >>> with emulate_graphs_on_cpu():
    ...     step(torch.ones(4))     # warmup, capture and replays, as on CUDA

    Blocks nest, and the setting comes back on an exception too. Also usable as a decorator.
    The setting is process-wide, so that graphed calls in other threads are emulated too.
    """
    global _emulating
    before = _emulating
    _emulating = True
    try:
        yield
    finally:
        _emulating = before
