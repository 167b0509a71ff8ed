"""``@autograph.graphed``: key each call, warm up, capture, replay, fall back (SPEC 1 and 2).

>>> @autograph.graphed
... def step(x, w):
...     return torch.relu(x @ w).sum(-1)
>>> model = autograph.graphed(model)       # an nn.Module: its forward, per instance

Each call is keyed (``_keys``). A new key is first checked for reasons it can never be
graphed (no CUDA, CPU tensors, gradients needed, ``max_graphs`` reached); otherwise its first
``warmup`` calls run eagerly, the last one watched by the guard, the next call captures
(``_graph``) and later calls replay. Every call of a key runs the function's GPU work exactly
once, whichever phase it hits. The state of one function (per instance, for methods) is
guarded by one re-entrant lock, held from the key lookup to the copy of the outputs.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import sys
import threading
import warnings
import weakref
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar, overload

import torch
import wrapt

from . import _config, _region, _stats
from ._capture import CUDA
from ._config import Options, logger
from ._cpu_graphs import CPU, is_emulating
from ._errors import AutographWarning, CaptureError
from ._graph import CaptureFailed, KeyGraph
from ._guard import UnsafeOpDetector, is_user_file
from ._keys import call_key, describe_call, execution_state, flatten_output

F = TypeVar("F", bound=Callable[..., Any])

WARMUP, CAPTURE, GRAPHED, EAGER = "warmup", "capture", "graphed", "eager"


def _warn(message: str) -> None:
    """Warn at the user's call of the graphed function: the first frame outside autograph
    and torch (a module's forward is called from ``nn.Module.__call__``)."""
    frame: Optional[FrameType] = sys._getframe(1)
    level = 2
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, AutographWarning, stacklevel=level)


def _inside_a_capture() -> bool:
    """Whether this thread's stream is being captured (by us or by the user's own graph)."""
    return torch.cuda.is_initialized() and torch._C._cuda_isCurrentStreamCapturing()


class _Entry:
    """One key of one cache: its phase, counters and, once captured, its graph."""

    __slots__ = ("label", "options", "state", "calls", "eager_calls", "replays", "warmups",
                 "reason", "strict_error", "graph", "backend", "device", "keep_alive",
                 "uses_cudnn", "__weakref__")

    def __init__(self, label: str, options: Options, keep_alive: list):
        self.label = label
        self.options = options
        self.state = WARMUP
        self.calls = self.eager_calls = self.replays = self.warmups = 0
        self.reason: Optional[str] = None
        self.strict_error: Optional[str] = None  # raised on every call under strict=True
        self.graph: Optional[KeyGraph] = None
        self.backend: Any = None
        self.device = -1
        self.keep_alive = keep_alive  # objects keyed by identity: their ids must stay unique
        self.uses_cudnn = False  # seen at warmup: the capture thread needs a cuDNN handle

    def stats(self, function: str) -> _stats.KeyStats:
        graph = self.graph
        return _stats.KeyStats(
            function=function, key=self.label,
            state=WARMUP if self.state == CAPTURE else self.state,
            calls=self.calls, eager_calls=self.eager_calls, replays=self.replays,
            capture_seconds=graph.capture_seconds if graph else None,
            graph_bytes=graph.memory_bytes if graph else 0,
            fallback_reason=self.reason)


class _Cache:
    """The keys of one graphed function, or of one instance for a graphed method."""

    def __init__(self, name: str, instance: Any):
        self.name = name
        self.entries: Dict[tuple, _Entry] = {}
        self.lock = threading.RLock()
        self.pools: Dict[int, Any] = {}
        self.said_max_graphs = False
        # An nn.Module's parameters and buffers are read by address: if one is replaced
        # (model.to(), p.data = ...) every graph of the instance must be captured again.
        self.module_ref = weakref.ref(instance) if isinstance(instance, torch.nn.Module) else None
        self.tracked: List[torch.Tensor] = []
        self.tracked_ptrs: List[int] = []
        self.last_stream: Any = None
        self.last_raw_stream: Optional[int] = None

    def graphed_keys(self) -> int:
        return sum(e.state != EAGER for e in self.entries.values())

    def pool(self, backend: Any, device: int) -> Any:
        if device not in self.pools:
            self.pools[device] = backend.new_pool(device)
        return self.pools[device]

    def track_module_tensors(self) -> None:
        module = self.module_ref() if self.module_ref else None
        if module is not None and not self.tracked:
            self.tracked = [*module.parameters(), *module.buffers()]
            self.tracked_ptrs = [t.data_ptr() for t in self.tracked]

    def module_tensors_moved(self) -> bool:
        return bool(self.tracked) and [t.data_ptr() for t in self.tracked] != self.tracked_ptrs

    def recapture_all(self) -> None:
        logger.info("%s: a parameter or buffer was replaced; capturing its graphs again",
                    self.name)
        self.tracked, self.tracked_ptrs = [], []
        for entry in self.entries.values():
            if entry.graph is not None:
                entry.graph.release()
                entry.graph, entry.state = None, CAPTURE

    def order_after_last_stream(self, device: int) -> None:
        # One graph's memory must not be used by two streams at once: a replay on a new
        # stream first waits for everything queued on the stream of the previous replay.
        raw = torch._C._cuda_getCurrentRawStream(device)
        if raw != self.last_raw_stream:
            current = torch.cuda.current_stream(device)
            if self.last_stream is not None:
                current.wait_stream(self.last_stream)
            self.last_stream, self.last_raw_stream = current, raw

    def release(self) -> bool:
        had_graphs = False
        for entry in self.entries.values():
            if entry.graph is not None:
                entry.graph.release()
                had_graphs = True
        self.entries.clear()
        self.pools.clear()
        self.tracked, self.tracked_ptrs = [], []
        self.said_max_graphs = False
        return had_graphs


def _devices(tensors: List[torch.Tensor]) -> Tuple[Any, int, Optional[str], bool]:
    """(backend, device index, reason not to graph, whether that reason deserves a warning)."""
    types = {t.device.type for t in tensors}
    if types == {"cuda"}:
        indices = {t.device.index for t in tensors}
        if len(indices) == 1:
            return CUDA, indices.pop(), None, False
        return None, -1, f"its tensors are on several GPUs ({sorted(indices)})", True
    if not tensors:
        if torch.cuda.is_available():
            return CUDA, torch.cuda.current_device(), None, False
        return None, -1, "CUDA is not available", False
    if types == {"cpu"}:
        if is_emulating():
            return CPU, -1, None, False
        if not torch.cuda.is_available():
            return None, -1, "CUDA is not available", False
        return None, -1, "its tensors are on the CPU; CUDA graphs replay GPU work only", False
    if "cuda" in types and "cpu" in types:
        return None, -1, ("it mixes CPU and CUDA tensors; the CPU work would not be replayed. "
                          "Move every tensor argument to the GPU"), True
    return None, -1, f"its tensors are on {sorted(types)}, not CUDA", False


_AUTOGRAD_REASON = (
    "its outputs need gradients, and graphed backward is not supported yet. For inference, "
    "call it under torch.no_grad() or torch.inference_mode()"
)


class _Engine:
    """The state and logic of one graphed function (shared by all its bound methods)."""

    def __init__(self, fn: Callable, explicit: Dict[str, Any], name: str,
                 number_instances: bool = True, signature_of: Optional[Callable] = None):
        self.fn = fn
        self.number_instances = number_instances
        self.explicit = explicit  # the options the user set, which win over a region's
        self.options = Options(**explicit)
        self.region_options: Dict[tuple, Options] = {}
        self.name = name
        try:
            params = list(inspect.signature(signature_of or fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        self.names = [p.name for p in params
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.cache = _Cache(name, None)
        self.instance_caches: "weakref.WeakKeyDictionary[Any, _Cache]" = \
            weakref.WeakKeyDictionary()
        self.instance_numbers = itertools.count(1)
        self.lock = threading.Lock()
        _stats.register(self)

    # ---- the call ----

    def cache_for(self, instance: Any) -> _Cache:
        if instance is None:
            return self.cache
        cache = self.instance_caches.get(instance)
        if cache is None:
            with self.lock:
                cache = self.instance_caches.get(instance)
                if cache is None:
                    name = f"{self.name}#{next(self.instance_numbers)}" \
                        if self.number_instances else self.name
                    cache = self.instance_caches[instance] = _Cache(name, instance)
        return cache

    def options_in(self, region: _region.Region) -> Options:
        options = self.region_options.get(region.options_key)
        if options is None:
            options = Options(**{**region.explicit, **self.explicit})
            self.region_options[region.options_key] = options
        return options

    def __call__(self, instance: Any, args: tuple, kwargs: dict) -> Any:
        region = None if _config.ENV.disable else _region.current()
        if _config.ENV.disable or _inside_a_capture() or (region and not region.enabled):
            return self.fn(*args, **kwargs) if instance is None \
                else self.fn(instance, *args, **kwargs)
        cache = self.cache_for(instance)
        training = instance.training if cache.module_ref is not None else None
        modes = execution_state(training)
        key, tensors, keep_alive = call_key(args, kwargs, modes)
        options = self.options if region is None else self.options_in(region)
        if options is not self.options and options != self.options:
            key = (key, options)
        with cache.lock:
            entry = cache.entries.get(key)
            if entry is None:
                entry = self._new_entry(cache, key, modes, instance, args, kwargs, tensors,
                                        keep_alive, options)
            entry.calls += 1
            state, graph = entry.state, entry.graph
            if graph is not None:
                if cache.module_tensors_moved():
                    cache.recapture_all()
                elif graph.mutated and graph.writes_into_shared_memory(tensors):
                    state = EAGER
                else:
                    if entry.backend is CUDA:
                        cache.order_after_last_stream(entry.device)
                    entry.replays += 1
                    if region is not None:
                        region.note(cache.name, entry, "replays")
                    return graph.replay(tensors)
            fn = self.fn if instance is None else functools.partial(self.fn, instance)
            if state == WARMUP:
                return self._warmup(entry, fn, args, kwargs, region, cache.name)
            if entry.state == CAPTURE:
                outputs = self._capture(cache, entry, fn, args, kwargs, tensors, region)
                if entry.state == GRAPHED:
                    return outputs
            if entry.strict_error is not None:
                raise CaptureError(entry.strict_error)
            entry.eager_calls += 1
            if region is not None:
                region.note(cache.name, entry, "eager_calls")
        with _region.nested_calls():
            return fn(*args, **kwargs)

    def _new_entry(self, cache: _Cache, key: tuple, modes: tuple, instance: Any, args: tuple,
                   kwargs: dict, tensors: List[torch.Tensor], keep_alive: list,
                   options: Options) -> _Entry:
        names = self.names[1:] if instance is not None else self.names
        entry = _Entry(describe_call(names, args, kwargs, modes), options, keep_alive)
        cache.entries[key] = entry
        entry.backend, entry.device, reason, loud = _devices(tensors)
        if reason is None and torch.is_grad_enabled() and (
                any(t.requires_grad for t in tensors) or any(
                    p.requires_grad for p in (instance.parameters() if cache.module_ref else ()))):
            reason, loud = _AUTOGRAD_REASON, True
        if reason is None and cache.graphed_keys() > options.max_graphs:
            reason = (f"{self.name} already has max_graphs={options.max_graphs} graphs; raise "
                      f"max_graphs, or pad inputs to fewer shapes")
            loud, cache.said_max_graphs = not cache.said_max_graphs, True  # said once
        if reason is not None:
            self._fall_back(entry, reason, loud)
        return entry

    def _fall_back(self, entry: _Entry, reason: str, loud: bool) -> None:
        entry.state, entry.reason, entry.graph = EAGER, reason, None
        message = f"{self.name}({entry.label}) runs eagerly: {reason}"
        if loud and entry.options.raises_on_fallback:
            entry.strict_error = message
            raise CaptureError(message)
        if loud:
            _warn(message)
        logger.info(message)

    def _warmup(self, entry: _Entry, fn: Callable, args: tuple, kwargs: dict,
                region: Optional[_region.Region], name: str) -> Any:
        entry.eager_calls += 1
        if region is not None:
            region.note(name, entry, "eager_calls")
        with _region.nested_calls():
            if entry.warmups + 1 < entry.options.warmup:
                outputs = fn(*args, **kwargs)
                entry.warmups += 1
                return outputs
            with UnsafeOpDetector(entry.backend.device_type, raise_on_unsafe=False) as detector:
                outputs = fn(*args, **kwargs)
        entry.warmups += 1
        entry.uses_cudnn = detector.uses_cudnn
        if detector.finding is not None:
            self._fall_back(entry, detector.finding.message(), loud=True)
        elif torch.is_grad_enabled() and any(
                isinstance(o, torch.Tensor) and o.requires_grad
                for o in flatten_output(outputs)[0]):
            self._fall_back(entry, _AUTOGRAD_REASON, loud=True)
        else:
            entry.state = CAPTURE
        return outputs

    def _capture(self, cache: _Cache, entry: _Entry, fn: Callable, args: tuple, kwargs: dict,
                 tensors: List[torch.Tensor], region: Optional[_region.Region]) -> Any:
        cache.track_module_tensors()
        label = f"{self.name}({entry.label})"
        pool = (region or cache).pool(entry.backend, entry.device)
        try:
            with _region.nested_calls():
                graph, outputs = KeyGraph.capture(
                    fn, args, kwargs, tensors, entry.backend, entry.device, pool,
                    entry.options.outputs, label, entry.uses_cudnn)
        except CaptureFailed as failed:
            self._fall_back(entry, failed.finding.message(), loud=True)
            return None
        entry.graph, entry.state = graph, GRAPHED
        entry.replays += 1
        if entry.backend is CUDA:
            cache.order_after_last_stream(entry.device)
        if region is not None:
            region.note(cache.name, entry, "captures")
            region.note(cache.name, entry, "replays")
        logger.info("captured %s in %.1f ms (%.1f MiB)", label, graph.capture_seconds * 1e3,
                    graph.memory_bytes / 2**20)
        return outputs

    # ---- inspection ----

    def _caches(self) -> List[_Cache]:
        with self.lock:
            return [self.cache, *self.instance_caches.values()]

    def stats(self) -> List[_stats.KeyStats]:
        rows: List[_stats.KeyStats] = []
        for cache in self._caches():
            with cache.lock:
                rows.extend(entry.stats(cache.name) for entry in cache.entries.values())
        return rows

    def reset(self) -> None:
        freed = {}
        for cache in self._caches():
            with cache.lock:
                devices = {e.device for e in cache.entries.values() if e.graph is not None}
                if cache.release():
                    freed.update(dict.fromkeys(devices, CUDA))
        for device in freed:
            if device >= 0:
                CUDA.free(device)


class GraphedFunction(wrapt.ObjectProxy):
    """A function whose calls are graphed; see ``autograph.graphed``.

    It behaves as the wrapped function (name, docstring, signature) and adds ``stats()`` and
    ``reset()``. On a class it binds like a method, with separate graphs per instance.
    """

    def __init__(self, fn: Callable, options: Dict[str, Any]):
        super().__init__(fn)
        self._self_engine = _Engine(fn, options, getattr(fn, "__qualname__", repr(fn)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_engine(None, args, kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return BoundGraphedMethod(self._self_engine, instance)

    def stats(self) -> List[_stats.KeyStats]:
        """Snapshots of this function's keys (every instance's, for a method)."""
        return self._self_engine.stats()

    def reset(self) -> None:
        """Drop this function's graphs and give their memory back; later calls start over."""
        self._self_engine.reset()


class BoundGraphedMethod:
    """A graphed method bound to one instance, which it holds weakly."""

    __slots__ = ("_self_engine", "_self_instance", "__weakref__")

    def __init__(self, engine: _Engine, instance: Any):
        self._self_engine = engine
        try:
            self._self_instance = weakref.ref(instance)
        except TypeError:
            raise TypeError(
                f"autograph.graphed: {engine.name} is bound to a {type(instance).__name__}, "
                f"which cannot be weakly referenced; graphs are kept per instance without "
                f"keeping instances alive. Add '__weakref__' to its __slots__."
            ) from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        instance = self._self_instance()
        if instance is None:
            raise ReferenceError(f"{self._self_engine.name}: its instance no longer exists")
        return self._self_engine(instance, args, kwargs)

    @property
    def __wrapped__(self) -> Callable:
        return self._self_engine.fn.__get__(self._self_instance())

    def __repr__(self) -> str:
        return f"<graphed method {self._self_engine.name} of {self._self_instance()!r}>"

    def stats(self) -> List[_stats.KeyStats]:
        return self._self_engine.stats()

    def reset(self) -> None:
        self._self_engine.reset()


def _graph_module(module: torch.nn.Module, options: Dict[str, Any]) -> torch.nn.Module:
    forward = type(module).forward
    engine = _Engine(forward, options, type(module).__name__, number_instances=False)
    # An instance attribute: nn.Module.__call__ finds it first; the module stays itself.
    module.forward = BoundGraphedMethod(engine, module)
    return module


def engine_for_module_calls(module: torch.nn.Module, call: Callable) -> _Engine:
    """The engine a region uses for one module: whole calls, hooks included, region options."""
    return _Engine(call, {}, type(module).__name__, number_instances=False,
                   signature_of=type(module).forward)


def check_option_names(options: Dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {unknown}; "
                        f"the options are {sorted(known)}.")


@overload
def graphed(fn: F) -> F: ...


@overload
def graphed(*, warmup: int = ..., outputs: str = ..., max_graphs: int = ...,
            strict: Optional[bool] = ...) -> Callable[[F], F]: ...


def graphed(fn: Any = None, /, **options: Any) -> Any:
    """Graph a function, a method or an ``nn.Module``: capture once per key, then replay.

    >>> @autograph.graphed
    ... def step(x, w):
    ...     return torch.relu(x @ w).sum(-1)
    >>> @autograph.graphed(warmup=2, outputs="static")
    ... def decode(ids, pos): ...
    >>> model = autograph.graphed(model)      # same module; its forward is graphed

    Options: ``warmup`` (eager calls per key before capture, >= 1, default 1), ``outputs``
    (``"copy"``: the caller owns the outputs, the default; ``"static"``: the graph's buffers,
    valid until the next call, stale reads raise), ``max_graphs`` (graphs per function, or
    per instance for methods; later keys run eagerly, default 16), ``strict`` (raise
    ``CaptureError`` instead of falling back; default from ``AUTOGRAPH_STRICT``). Options set
    here win over those of an enclosing ``autograph.region``.
    """
    check_option_names(options, "autograph.graphed")
    Options(**options)  # validate now, not at the first call
    if fn is None:
        return lambda f: _graph(f, options)
    return _graph(fn, options)


def _graph(fn: Any, options: Dict[str, Any]) -> Any:
    if isinstance(fn, torch.nn.Module):
        return _graph_module(fn, options)
    if not callable(fn):
        raise TypeError(f"autograph.graphed expects a function, a method or an nn.Module, "
                        f"not {type(fn).__name__} ({fn!r}).")
    return GraphedFunction(fn, options)
