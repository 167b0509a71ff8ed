"""The call: scope, key, entry, step (SPEC 2).

>>> engine = Engine(step, {}, "step")
>>> engine(step, None, (x, w), {})       # key, then warm up, capture or replay

A call is keyed (``_keys``) and finds its entry (``_entry``). The hot path is a replay: the
entry has a graph that may still replay (no tensor it reads by address was freed, no argument
it writes shares memory with another, no earlier call's backward still needs a training graph's
activations) and the call copies in, replays and copies out. Everything else is a step of the
key's life: a new key is first checked for reasons it can never be graphed (no CUDA, CPU or
unusual tensors); its first ``warmup`` calls run eagerly; the next call records the graph
(``_graph``, or ``_training`` when its outputs need gradients) and replays it once; a key
whose graph was invalidated is captured again. Every call runs the function's GPU work
exactly once, whichever step it hits. One re-entrant lock per cache (per instance, for
methods) is held from the key lookup to the copy of the outputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import sys
import threading
import time
import warnings
import weakref
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _config, _stats
from ._capture import CUDA
from ._config import Options, logger
from ._cpu_graphs import CPU, is_emulating, is_recording
from ._entry import CAPTURE, EAGER, GRAPHED, WARMUP, Entry, KeyCache
from ._errors import AutographWarning, CaptureError
from ._graph import CaptureFailed, Graph
from ._guard import UnsafeOpDetector, is_user_file
from ._buckets import BucketRule, Padding, padded_key, resized_examples
from ._keys import (call_key, describe_parts, execution_state, flatten_arguments,
                    flatten_output, join_parts, unsupported_tensor)
from ._profile import profile_range, torch_profiler
from ._ranks import CollectiveWatch, agreed_failure, distributed_is_on
from ._progress import progress
from ._reads import CallWatch, roots_of, shares_written_memory
from ._scope import current_region, nested_calls
from ._training import TrainingGraph
from ._undo import UndoWrites
from ._verify import verified_replay

Tensor = torch.Tensor

# A key whose graph keeps being invalidated (its reads freed) is captured again this often,
# then runs eagerly: no capture storm.
MAX_RECAPTURES = 2
# This many new keys in a row, none of them repeated, and the cache says what keeps changing.
CHURN_WINDOW = 16

_NOT_CAPTURED = object()
_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)
# Dynamo's frame hook: set while compiled code runs. Where torch lacks the getter, assume it
# may be set (the safe, slower path).
_dynamo_callback: Callable[[], Any] = getattr(
    getattr(torch._C, "_dynamo", None) and torch._C._dynamo.eval_frame,
    "get_eval_frame_callback", lambda: True)

def _warn(message: str) -> None:
    """Warn at the user's call of the graphed function: the first frame outside autograph
    and torch (a module's forward is called from ``nn.Module.__call__``)."""
    frame: Optional[FrameType] = sys._getframe(1)
    level = 2
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, AutographWarning, stacklevel=level)


def _inside_a_capture() -> bool:
    """Inside a capture (ours, the user's own graph, or an emulated one) a call is part of
    the enclosing graph: it runs as written."""
    return is_recording() or (torch.cuda.is_initialized()
                              and torch._C._cuda_isCurrentStreamCapturing())


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    """torch.cuda.is_available(), asked once: it costs 0.6 us, and cannot change."""
    return torch.cuda.is_available()


_NO_CUDA = "CUDA is not available"
_ON_THE_CPU = "its tensors are on the CPU; CUDA graphs replay GPU work only"


def _devices(tensors: List[Tensor]) -> Tuple[Any, int, Optional[str], bool]:
    """(backend, device index, reason not to graph, whether that reason deserves a warning)."""
    types = {t.device.type for t in tensors}
    if types == {"cuda"}:
        indices = {t.device.index for t in tensors}
        if len(indices) == 1:
            return CUDA, indices.pop(), None, False
        return None, -1, f"its tensors are on several GPUs ({sorted(indices)})", True
    if not tensors:
        if _cuda_available():
            return CUDA, torch.cuda.current_device(), None, False
        return None, -1, _NO_CUDA, False
    if types == {"cpu"}:
        if is_emulating():
            return CPU, -1, None, False
        if not _cuda_available():
            return None, -1, _NO_CUDA, False
        return None, -1, _ON_THE_CPU, False
    if "cuda" in types and "cpu" in types:
        return None, -1, ("it mixes CPU and CUDA tensors; the CPU work would not be replayed. "
                          "Move every tensor argument to the GPU"), True
    return None, -1, f"its tensors are on {sorted(types)}, not CUDA", False


def _eager_whatever_the_key(args: tuple, kwargs: dict) -> Optional[str]:
    """Why a call of plain CPU tensors runs eagerly whatever its key would be, or None; asked
    before keying, so that such calls cost about what the bare call does. (Other calls are
    keyed first: an unhashable argument is an error everywhere, with or without CUDA.)"""
    if kwargs or not args or is_emulating():
        return None
    for a in args:
        if type(a) is not Tensor or a.is_cuda:
            return None
    return _ON_THE_CPU if _cuda_available() else _NO_CUDA


def _needs_gradients(tensors: Sequence[Tensor], instance: Any) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in tensors):
        return True
    return isinstance(instance, torch.nn.Module) and any(
        p.requires_grad for p in instance.parameters())


class Call:
    """One call on its way through the engine: what it calls, with what, and where."""

    __slots__ = ("call", "instance", "args", "kwargs", "names", "tensors", "addressed",
                 "padding", "region", "cache", "state")

    def __init__(self, call: Callable, instance: Any, args: tuple, kwargs: dict,
                 names: List[str], tensors: List[Tensor], addressed: List[int],
                 padding: Optional[Padding], region: Any, cache: KeyCache, state: tuple):
        self.call, self.instance = call, instance
        self.args, self.kwargs, self.names = args, kwargs, names
        self.tensors, self.addressed, self.padding = tensors, addressed, padding
        self.region, self.cache, self.state = region, cache, state


class Engine:
    """The state and logic of one graphed function, method, module or region module."""

    def __init__(self, fn: Callable, explicit: Dict[str, Any], name: str, *,
                 signature_of: Optional[Callable] = None, per_instance: bool = False,
                 instance_label: str = "self"):
        self.fn = fn  # where the function's closure and globals are (for names in messages)
        self.explicit = explicit  # the options the user set, which win over a region's
        self.options = Options(**explicit)
        self.region_options: Dict[tuple, Options] = {}
        self.name = name
        self.per_instance = per_instance
        self.instance_label = instance_label
        try:
            params = list(inspect.signature(signature_of or fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        self.names = [p.name for p in params
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.method_names = self.names[1:]  # a bound method's, without self or cls
        self.cache = KeyCache(name)
        self.instance_caches: "weakref.WeakKeyDictionary[Any, KeyCache]" = \
            weakref.WeakKeyDictionary()
        self.instance_numbers = itertools.count(1)
        self.lock = threading.Lock()
        # Calls that ran eagerly before being keyed (no CUDA, CPU tensors): count per reason.
        self.eager_tally: Dict[str, int] = {}
        _stats.register(self)

    # ---- the call ----

    def __call__(self, call: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``call(*args, **kwargs)`` (the bound function) through the key's graph.

        The signature is wrapt's wrapper signature, so an engine is its own wrapper.
        """
        if _config.ENV.disable or _is_compiling():
            # Under torch.compile's tracing, step aside: Dynamo inlines the function, and its
            # fusion (and its own graphs, mode="reduce-overhead") apply (SPEC 8).
            return call(*args, **kwargs)
        if _dynamo_callback() is not None:
            return self._call_outside_dynamo(call, instance, args, kwargs)
        return self._call(call, instance, args, kwargs)

    # A compiled caller that could not trace this call (a graph break) runs it with Dynamo's
    # frame hook still set: without this, the engine's own frames would be compiled piecemeal,
    # with trace-time values baked in (the static inputs' _version: written arguments were
    # then never copied back). Only then: the wrapper costs about a microsecond.
    @torch.compiler.disable
    def _call_outside_dynamo(self, call: Callable, instance: Any, args: tuple,
                             kwargs: dict) -> Any:
        return self._call(call, instance, args, kwargs)

    def _call(self, call: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        region = current_region()
        if region is not None and not region.enabled:
            return call(*args, **kwargs)
        reason = _eager_whatever_the_key(args, kwargs)
        if reason is not None:
            with self.lock:
                self.eager_tally[reason] = self.eager_tally.get(reason, 0) + 1
            return call(*args, **kwargs)
        if _inside_a_capture():
            return call(*args, **kwargs)
        cache = self.cache_for(instance) if self.per_instance and instance is not None \
            else self.cache
        state = execution_state(instance.training if isinstance(instance, torch.nn.Module)
                                else None)
        names = self.method_names if self.per_instance and instance is not None else self.names
        options = self.options if region is None else self.options_in(region)
        key, tensors, identities, addressed = call_key(
            args, kwargs, state, names, options.static_argnames, options.static_argnums)
        if options is not self.options and options != self.options:
            key = (key, options)
        with cache.lock:
            if cache.dead_keys:
                cache.forget_dead()
            padding = reason = None
            if options.buckets is not None:
                key, padding, reason = cache.routes.get(key) or self._route(
                    cache, key, options, names, args, kwargs, tensors, addressed)
            entry = cache.entries.get(key)
            c = None
            if entry is None:
                c = Call(call, instance, args, kwargs, names, tensors, addressed, padding,
                         region, cache, state)
                entry = self._new_entry(cache, key, c, identities, options, reason)
            entry.calls += 1
            if padding is not None:
                entry.sizes[padding.rows] = entry.sizes.get(padding.rows, 0) + 1
            graph = entry.graph
            if graph is not None and graph.may_replay() and not (
                    graph.mutated and shares_written_memory(tensors, graph.mutated)) and not (
                    entry.trains and graph.busy()):
                if entry.verify_left or torch_profiler._is_profiler_enabled:
                    return self._observed_replay(entry, c or Call(
                        call, instance, args, kwargs, names, tensors, addressed, padding,
                        region, cache, state))
                entry.replays += 1
                if region is not None:
                    region.note(cache.name, entry, "replays")
                return graph.replay(tensors, padding)
            return self._step(entry, c or Call(call, instance, args, kwargs, names, tensors,
                                               addressed, padding, region, cache, state))

    def _step(self, entry: Entry, c: "Call") -> Any:
        graph = entry.graph
        if graph is not None:
            if graph.may_replay():  # shares written memory, or its graph is busy: eager
                return self._run_eagerly(entry, c)
            self._invalidate(entry)
        if entry.phase == WARMUP:
            return self._warmup(entry, c)
        if entry.phase == CAPTURE:
            if entry.written and shares_written_memory(c.tensors, entry.written):
                return self._run_eagerly(entry, c)
            outputs = self._capture(entry, c)
            if outputs is not _NOT_CAPTURED:
                return outputs
        if entry.strict_error is not None:
            raise CaptureError(entry.strict_error)
        return self._run_eagerly(entry, c)

    def _run_eagerly(self, entry: Entry, c: "Call") -> Any:
        entry.eager_calls += 1
        if c.region is not None:
            c.region.note(c.cache.name, entry, "eager_calls")
        streams = contextlib.nullcontext() if entry.backend is None else \
            entry.backend.eager_stream(entry.device)
        with nested_calls(), profile_range("eager", self.name, entry.label), streams:
            return c.call(*c.args, **c.kwargs)

    def _observed_replay(self, entry: Entry, c: "Call") -> Any:
        """A replay that verify mode checks against an eager run first, or that a profiler
        records as a named range."""
        if not entry.verify_left:
            entry.replays += 1
            if c.region is not None:
                c.region.note(c.cache.name, entry, "replays")
            with profile_range("replay", self.name, entry.label):
                return entry.graph.replay(c.tensors, c.padding)
        entry.verify_left -= 1
        outputs, mismatch = verified_replay(
            entry.graph, c, self.name, entry.label,
            lambda: roots_of(self.fn, c.instance, c.names, c.args, c.kwargs,
                             self.instance_label))
        if mismatch is not None:  # the caller got the eager run's outputs and effects
            entry.eager_calls += 1
            if c.region is not None:
                c.region.note(c.cache.name, entry, "eager_calls")
            self._fall_back(entry, mismatch)
            return outputs
        entry.replays += 1
        entry.verified += 1
        if c.region is not None:
            c.region.note(c.cache.name, entry, "replays")
        if not entry.verify_left:
            logger.info("%s(%s): its first %d replays after capture matched eager runs",
                        self.name, entry.label, entry.options.replays_to_verify)
        return outputs

    def _route(self, cache: KeyCache, key: Any, options: Options, names: List[str],
               args: tuple, kwargs: dict, tensors: List[Tensor], addressed: List[int]
               ) -> Tuple[Any, Optional[Padding], Optional[str]]:
        """Which entry a call key of a bucketed function goes to, and how it is padded."""
        rule = BucketRule(options.buckets, options.bucket_args)
        padding, reason = rule.padding(names, args, kwargs, tensors, addressed)
        route = (key, None, reason) if padding is None else (padded_key(key, padding),
                                                              padding, None)
        if len(cache.routes) >= 4 * cache.max_keys:
            cache.routes.clear()
        cache.routes[key] = route
        return route

    def _new_entry(self, cache: KeyCache, key: Any, c: "Call", identities: list,
                   options: Options, reason: Optional[str]) -> Entry:
        resized = {} if c.padding is None else {
            id(t): c.padding.padded_shape(t, i) for i, t in enumerate(c.tensors)}
        parts = describe_parts(c.names, c.args, c.kwargs, resized)
        backend, device, device_reason, loud = _devices(c.tensors)
        entry = cache.add(key, Entry(join_parts(parts, c.state), parts, options, backend,
                                     device, None if c.padding is None else c.padding.bucket),
                          identities)
        if reason is not None:  # above the largest bucket
            first = "buckets" not in cache.said
            cache.said.add("buckets")
            self._fall_back(entry, reason, warn=first and device_reason is None,
                            strict=device_reason is None)
            return entry
        reason = device_reason
        if reason is None:
            reason = unsupported_tensor(c.tensors)
            loud = reason is not None
        entry.trains = reason is None and _needs_gradients(c.tensors, c.instance)
        if reason is not None:
            self._fall_back(entry, reason, warn=loud, strict=loud)
        else:
            self._say_if_keys_never_repeat(cache, entry)
        return entry

    def _say_if_keys_never_repeat(self, cache: KeyCache, entry: Entry) -> None:
        if "churn" in cache.said or len(cache.entries) < CHURN_WINDOW:
            return
        recent = list(cache.entries.values())[-CHURN_WINDOW:]
        if not all(e.calls == 1 and e.graph is None for e in recent[:-1]):
            return
        cache.said.add("churn")
        previous = recent[-2]
        changes = [f"{before} became {after}" for before, after in zip(previous.parts,
                                                                      entry.parts)
                   if before != after] if len(previous.parts) == len(entry.parts) else []
        what = "; ".join(changes[:3]) or f"the key became {entry.label}"
        _warn(f"{cache.name}: the last {CHURN_WINDOW} calls each had a new key, so none was "
              f"graphed (a key is captured once it repeats). From one call to the next: "
              f"{what}. Give that argument a fixed size (pad it; for a KV cache use a "
              f"fixed-size one such as transformers' StaticCache), or call it outside "
              f"autograph.")

    def _fall_back(self, entry: Entry, reason: str, *, warn: bool = True, strict: bool = True,
                   raise_now: bool = True) -> None:
        entry.phase, entry.reason = EAGER, reason
        if entry.graph is not None:
            entry.graph.release()
            entry.graph = None
        message = f"{self.name}({entry.label}) runs eagerly: {reason}"
        logger.info(message)
        if strict and entry.options.raises_on_fallback:
            entry.strict_error = message
            if raise_now:
                raise CaptureError(message)
        elif warn:
            _warn(message)

    def _warmup(self, entry: Entry, c: "Call") -> Any:
        entry.eager_calls += 1
        if c.region is not None:
            c.region.note(c.cache.name, entry, "eager_calls")
        with nested_calls(), profile_range("warmup", self.name, entry.label), \
                entry.backend.eager_stream(entry.device):
            if entry.warmups + 1 < entry.options.warmup:
                outputs = c.call(*c.args, **c.kwargs)
                entry.warmups += 1
                return outputs
            outputs = self._watched_warmup(entry, c)
        entry.phase = CAPTURE
        return outputs

    def _watched_warmup(self, entry: Entry, c: "Call") -> Any:
        # The last warmup is watched, not judged: a host read seen here may be skipped
        # during capture by capture-aware code, so the capture's guard decides.
        detector = UnsafeOpDetector(entry.backend.device_type, raise_on_unsafe=False)
        watch = CallWatch()
        collectives = CollectiveWatch() if distributed_is_on() else contextlib.nullcontext()
        with detector, watch, collectives:
            outputs = c.call(*c.args, **c.kwargs)
        if isinstance(collectives, CollectiveWatch):
            entry.groups = collectives.groups
        entry.warmups += 1
        entry.uses_cudnn = detector.uses_cudnn
        entry.warmup_thread = threading.get_ident()
        if c.padding is not None:
            entry.warmup_shapes = [c.padding.rows, [
                tuple(o.shape) if isinstance(o, Tensor) else None
                for o in flatten_output(outputs)[0]]]
        entry.written = watch.written_arguments(c.tensors)
        if torch.is_grad_enabled() and any(isinstance(o, Tensor) and o.requires_grad
                                           for o in flatten_output(outputs)[0]):
            entry.trains = True  # a closed-over parameter needs gradients
        return outputs

    def _record(self, entry: Entry, c: "Call") -> Graph:
        """Record the key's graph (nothing runs); ``CaptureFailed`` if it cannot be."""
        label = f"{self.name}({entry.label})"
        pool = (c.region.pools if c.region is not None else c.cache.pools).get(
            entry.backend, entry.device)
        roots = roots_of(self.fn, c.instance, c.names, c.args, c.kwargs, self.instance_label)
        kind = TrainingGraph if entry.trains else Graph
        with nested_calls(), profile_range("capture", self.name, entry.label):
            graph = kind.record(c.call, c.args, c.kwargs, c.tensors, entry.backend,
                                entry.device, pool, entry.options.outputs, label, roots,
                                self._needs_cudnn_handle(entry), c.padding, c.addressed,
                                entry.warmup_shapes)
        logger.info("captured %s in %.1f ms (%.1f MiB)", label, graph.capture_seconds * 1e3,
                    graph.memory_bytes / 2**20)
        return graph

    @staticmethod
    def _needs_cudnn_handle(entry: Entry) -> bool:
        # The warmup's cuDNN ops made this thread's handle; another thread needs one made
        # before its capture, and making it (a small convolution) costs a fraction of a second.
        return entry.uses_cudnn and entry.warmup_thread != threading.get_ident()

    def _over_max_graphs(self, entry: Entry, cache: KeyCache) -> bool:
        if cache.graphs() < entry.options.max_graphs:
            return False
        first = "max_graphs" not in cache.said
        cache.said.add("max_graphs")
        self._fall_back(entry, (
            f"{self.name} already has max_graphs={entry.options.max_graphs} graphs; raise "
            f"max_graphs, or pad inputs to fewer shapes (buckets=)"), warn=first)
        return True

    def _capture(self, entry: Entry, c: "Call") -> Any:
        if self._over_max_graphs(entry, c.cache):
            return _NOT_CAPTURED
        graph = self._agreed_record(entry, c)
        if graph is None:
            return _NOT_CAPTURED
        entry.replays += 1
        with profile_range("replay", self.name, entry.label):
            outputs = graph.replay(c.tensors, c.padding, copy_in=False)
        graph.watch_reads()
        if graph.invalid_reason is not None:
            # Freed by the call itself: the function rebinds what it reads on every call.
            graph.release()
            self._fall_back(entry, (
                f"it replaces {graph.invalid_reason} on every call (a cache that grows with "
                f"torch.cat does), and a graph would keep reading the old tensor. Use a "
                f"fixed-size cache updated in place (transformers' StaticCache), or pass the "
                f"tensor as an argument"), raise_now=False)
            return outputs
        entry.graph, entry.phase = graph, GRAPHED
        entry.verify_left = entry.options.replays_to_verify
        if c.region is not None:
            c.region.note(c.cache.name, entry, "captures")
            c.region.note(c.cache.name, entry, "replays")
        return outputs

    # ---- ahead of time ----

    def capture_ahead(self, call: Callable, instance: Any, args: tuple, kwargs: dict
                      ) -> List[_stats.KeyStats]:
        """Warm up and capture the keys of this example call (every bucket, largest first)
        without leaving its effects behind; see ``GraphedFunction.capture``."""
        if _config.ENV.disable:
            return []
        region = current_region()
        options = self.options if region is None else self.options_in(region)
        cache = self.cache_for(instance) if self.per_instance and instance is not None \
            else self.cache
        names = self.method_names if self.per_instance and instance is not None else self.names
        state = execution_state(instance.training if isinstance(instance, torch.nn.Module)
                                else None)
        examples: List[Tuple[tuple, dict, Optional[Padding]]] = [(args, kwargs, None)]
        if options.buckets is not None:
            examples = self._bucket_examples(options, names, args, kwargs, state)
        rows = []
        started = time.perf_counter()
        for example_args, example_kwargs, padding in progress(examples,
                                                              f"capturing {self.name}"):
            key, tensors, identities, addressed = call_key(
                example_args, example_kwargs, state, names, options.static_argnames,
                options.static_argnums)
            if options is not self.options and options != self.options:
                key = (key, options)
            if padding is not None:
                # The example's own choice of padded tensors at every size (the default rule
                # could add one whose dim happens to equal a bucket), as real calls make it.
                key = padded_key(key, padding)
            with cache.lock:
                if cache.dead_keys:
                    cache.forget_dead()
                c = Call(call, instance, example_args, example_kwargs, names, tensors,
                         addressed, padding, region, cache, state)
                entry = cache.entries.get(key) or self._new_entry(cache, key, c, identities,
                                                                  options, None)
                if entry.graph is None and entry.phase in (WARMUP, CAPTURE):
                    self._capture_without_effects(entry, c)
                rows.append(entry.stats(cache.name))
        captured = [r for r in rows if r.state == GRAPHED]
        logger.info("%s: captured %d graph(s) in %.2f s, %.1f MiB", self.name, len(captured),
                    time.perf_counter() - started,
                    sum(r.graph_bytes for r in captured) / 2**20)
        return rows

    def _bucket_examples(self, options: Options, names: List[str], args: tuple,
                         kwargs: dict, state: tuple
                         ) -> List[Tuple[tuple, dict, Optional[Padding]]]:
        """The example call resized to every bucket, largest first, with its padding."""
        _, tensors, _, addressed = call_key(args, kwargs, state, names,
                                            options.static_argnames, options.static_argnums)
        padding, reason = BucketRule(options.buckets, options.bucket_args).padding(
            names, args, kwargs, tensors, addressed)
        if padding is None:
            raise ValueError(f"{self.name}.capture(): the example call cannot be bucketed: "
                             f"{reason}.")
        examples = []
        for size in reversed(options.buckets):
            resized = resized_examples(tensors, padding, size)
            leaves, rebuild = flatten_arguments((args, kwargs))
            index = iter(range(len(tensors)))
            resized_args, resized_kwargs = rebuild([resized.get(next(index), leaf)
                                                    if isinstance(leaf, Tensor) else leaf
                                                    for leaf in leaves])
            examples.append((resized_args, resized_kwargs,
                             dataclasses.replace(padding, rows=size, bucket=size)))
        return examples

    def _agreed_record(self, entry: Entry, c: "Call") -> Optional[Graph]:
        """Record the key's graph, and if its calls run collectives, agree with the other
        ranks of their groups (``_ranks``); None (the key now runs eagerly) if this rank or
        another could not graph it."""
        try:
            graph: Optional[Graph] = self._record(entry, c)
            failure = None
        except CaptureFailed as failed:
            graph, failure = None, failed.finding.message()
        except BaseException:  # the user's own exception: the other ranks must not wait
            if entry.groups:
                agreed_failure(entry.groups, "it raised")
            raise
        if entry.groups:
            failure = agreed_failure(entry.groups, failure)
        if failure is not None:
            if graph is not None:
                graph.release()
            self._fall_back(entry, failure)
            return None
        return graph

    def _capture_without_effects(self, entry: Entry, c: "Call") -> None:
        if self._over_max_graphs(entry, c.cache):
            return
        undo = UndoWrites()
        try:
            with nested_calls(), undo, entry.backend.eager_stream(entry.device):
                while entry.warmups < entry.options.warmup - 1:
                    c.call(*c.args, **c.kwargs)
                    entry.warmups += 1
                self._watched_warmup(entry, c)
        finally:
            undo.restore()
        graph = self._agreed_record(entry, c)
        if graph is None:
            return
        graph.watch_reads()
        if graph.invalid_reason is None:
            entry.graph, entry.phase = graph, GRAPHED
            entry.verify_left = entry.options.replays_to_verify

    def _invalidate(self, entry: Entry) -> None:
        graph, entry.graph = entry.graph, None
        graph.release()
        entry.recaptures += 1
        if entry.recaptures > MAX_RECAPTURES:
            self._fall_back(entry, (
                f"{graph.invalid_reason}, which its graph reads by address, was freed or "
                f"replaced again after {MAX_RECAPTURES} captures; update it in place instead "
                f"of replacing it"))
            return
        logger.info("%s(%s): %s was freed or replaced since capture; capturing again",
                    self.name, entry.label, graph.invalid_reason)
        entry.phase = CAPTURE

    # ---- caches and options ----

    def cache_for(self, instance: Any) -> KeyCache:
        try:
            cache = self.instance_caches.get(instance)
        except TypeError:
            raise TypeError(
                f"autograph.graphed: {self.name} is bound to a {type(instance).__name__}, "
                f"which cannot be weakly referenced; graphs are kept per instance without "
                f"keeping instances alive. Add '__weakref__' to its __slots__."
            ) from None
        if cache is None:
            with self.lock:
                cache = self.instance_caches.get(instance)
                if cache is None:
                    name = f"{self.name}#{next(self.instance_numbers)}"
                    cache = self.instance_caches[instance] = KeyCache(name)
        return cache

    def options_in(self, region: Any) -> Options:
        options = self.region_options.get(region.options_key)
        if options is None:
            options = Options(**{**region.explicit, **self.explicit})
            if options == self.options:
                options = self.options  # so that a call tests identity, not nine fields
            self.region_options[region.options_key] = options
        return options

    # ---- inspection ----

    def caches(self) -> List[KeyCache]:
        with self.lock:
            return [self.cache, *self.instance_caches.values()]

    def stats(self) -> List[_stats.KeyStats]:
        with self.lock:
            tally = list(self.eager_tally.items())
        tallied = [_stats.KeyStats(
            function=self.name, key="every call", state=EAGER, calls=count, eager_calls=count,
            replays=0, capture_seconds=None, graph_bytes=0, fallback_reason=reason)
            for reason, count in tally]
        return [row for cache in self.caches() for row in cache.stats()] + tallied

    def reset(self) -> None:
        with self.lock:
            self.eager_tally.clear()
        self.free({device for cache in self.caches() for device in cache.release()})

    @staticmethod
    def free(devices: Any) -> None:
        """Give the memory of released graphs back to these devices."""
        for device in devices:
            if device >= 0:
                CUDA.free(device)
