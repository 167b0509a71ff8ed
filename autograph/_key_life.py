"""One key's life, from its first call to its last: warmup, capture, replay, eager.

>>> life = KeyLife(function, "step", "x: f32[8] cuda:0", parts, options, CUDA, 0)
>>> life.serve(tensors, padding, region)        # a replay, or MISS when it cannot replay
>>> life.run(call)                              # everything else: warm up, capture, eager

Phases (docs/design.md, "A key's life"): ``warmup`` (eager calls, the last one watched),
``capture`` (the next call records the graph and replays it once for its result), ``graphed``
(calls replay), ``eager`` (every call runs eagerly, for the reason said). A graph whose reads
were freed is captured again, at most ``MAX_RECAPTURES`` times. Every call runs the function's
GPU work exactly once, whichever step it hits. The key's counters live here; the region a call
is made in is told of each event (``Region.note``); verify mode and profiler ranges wrap a
replay (``_observed_replay``); ranks vote on its capture (``_ranks``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

from ._config import Options, logger
from ._errors import CaptureError
from ._graph import Graph
from ._guard import UnsafeOpDetector
from ._outputs import flatten_output
from ._payoff import measurement, timed_call
from ._profile import profile_range, torch_profiler
from ._ranks import CollectiveWatch, agreed_failure, distributed_is_on
from ._reads import CallWatch, roots_of, shares_written_memory
from ._recording import CaptureFailed, CaptureRequest
from ._scope import nested_calls
from ._stats import KeyStats
from ._training import TrainingGraph
from ._verify import checked_replay
from ._warn import warn_user

Tensor = torch.Tensor

WARMUP, CAPTURE, GRAPHED, EAGER = "warmup", "capture", "graphed", "eager"
# A key whose graph keeps being invalidated (its reads freed) is captured again this often,
# then runs eagerly: no capture storm.
MAX_RECAPTURES = 2
MISS = object()  # ``serve``: this call cannot be a plain replay


@dataclasses.dataclass(frozen=True)
class Function:
    """What a key needs of the function it belongs to: its name for messages, and where the
    tensors it reads may come from (its closure and globals, its instance)."""

    name: str
    fn: Callable
    instance_label: str = "self"

    def roots(self, c: "Call") -> list:
        """Where the tensors a call of it reads may come from (``_reads.roots_of``)."""
        return roots_of(self.fn, c.instance, c.names, c.args, c.kwargs, self.instance_label)


class Call:
    """One call on its way: what it calls, with what, and where."""

    __slots__ = ("call", "instance", "args", "kwargs", "names", "tensors", "addressed",
                 "padding", "region", "cache", "state")

    def __init__(self, call: Callable, instance: Any, args: tuple, kwargs: dict,
                 names: List[str], tensors: List[Tensor], addressed: List[int],
                 padding: Any, region: Any, cache: Any, state: tuple):
        self.call, self.instance = call, instance
        self.args, self.kwargs, self.names = args, kwargs, names
        self.tensors, self.addressed, self.padding = tensors, addressed, padding
        self.region, self.cache, self.state = region, cache, state

    def note(self, life: "KeyLife", event: str) -> None:
        """Tell the region this call is made in (its observer) what happened."""
        if self.region is not None:
            self.region.note(life, event)


class KeyLife:
    """One key of one cache: its phase, counters and graph, and every step of its life."""

    __slots__ = ("function", "owner", "label", "parts", "options", "backend", "device",
                 "phase", "calls", "eager_calls", "replays", "warmups", "recaptures", "reason",
                 "strict_error", "graph", "written", "uses_cudnn", "warmup_thread",
                 "strong_identities", "identity_ids", "bucket", "sizes", "trains", "payoff",
                 "gain", "checks_left", "verified", "warmup_shapes", "groups", "__weakref__")

    def __init__(self, function: Function, owner: str, label: str, parts: List[str],
                 options: Options, backend: Any, device: int, bucket: Optional[int] = None):
        self.function = function
        self.owner = owner  # the cache's name: "step", or "Net.forward#2" for an instance
        self.label, self.parts = label, parts  # parts: to say what differs between two keys
        self.options, self.backend, self.device = options, backend, device
        self.phase = WARMUP
        self.calls = self.eager_calls = self.replays = self.warmups = self.recaptures = 0
        self.reason: Optional[str] = None
        self.strict_error: Optional[str] = None  # raised on every call under strict=True
        self.graph: Any = None
        self.written: List[int] = []  # arguments the watched warmup wrote to
        self.uses_cudnn = False  # seen at warmup: a capture thread needs a cuDNN handle
        self.warmup_thread: Optional[int] = None  # the thread whose handles the warmup made
        self.strong_identities: list = []  # identity-keyed objects that have no weakref
        self.identity_ids: List[int] = []  # ids of the objects it keys by identity
        self.warmup_shapes: Optional[List[Any]] = None  # buckets: the watched warmup's outputs
        self.bucket = bucket  # the capture size, for a bucketed key
        self.trains = False  # its outputs need gradients: forward and backward are graphed
        # The process groups its warmup ran collectives on: their ranks agree on its capture.
        self.groups: List[Any] = []
        self.sizes: Dict[int, int] = {}  # a bucket's calls by their real size
        # Verify mode: replays still to check (set at each capture), and those that matched.
        self.checks_left = self.verified = 0
        self.payoff = self.gain = None  # check_payoff: measured until a verdict (``_payoff``)

    # ---- replays ----

    def count(self, padding: Any) -> None:
        self.calls += 1
        if padding is not None:
            self.sizes[padding.rows] = self.sizes.get(padding.rows, 0) + 1

    def serve(self, tensors: List[Tensor], padding: Any, region: Any) -> Any:
        """Count the call, and replay if that is all it takes; else MISS (``run`` it)."""
        self.count(padding)
        graph = self.graph
        if graph is None or self.checks_left or self.payoff or torch_profiler._is_profiler_enabled \
                or not self._may_replay(graph, tensors):
            return MISS
        self.replays += 1
        if region is not None:
            region.note(self, "replays")
        return graph.replay(tensors, padding)

    def _may_replay(self, graph: Graph, tensors: List[Tensor]) -> bool:
        """Nothing it reads by address freed, no written argument aliased, no backward due."""
        return graph.may_replay() and not (
            graph.mutated and shares_written_memory(tensors, graph.mutated)) and not (
            self.trains and graph.busy())

    def run(self, c: Call) -> Any:
        """Everything but a plain replay: a checked or profiled replay, or a step of the
        key's life."""
        graph = self.graph
        if graph is not None and self._may_replay(graph, c.tensors):
            return self._observed_replay(c)
        if graph is not None:
            if graph.may_replay():  # shares written memory, or its graph is busy: eager
                return self.run_eagerly(c)
            self._invalidate()
        if self.phase == WARMUP:
            return self._warmup(c)
        if self.phase == CAPTURE:
            if self.written and shares_written_memory(c.tensors, self.written):
                return self.run_eagerly(c)
            outputs = self._capture(c)
            if outputs is not MISS:
                return outputs
        if self.strict_error is not None:
            raise CaptureError(self.strict_error)
        return self.run_eagerly(c)

    def _observed_replay(self, c: Call) -> Any:
        """A replay that verify mode checks against an eager run first, or that a profiler
        records as a named range."""
        if self.checks_left or self.payoff:  # verify's checks first, then the payoff
            return (checked_replay if self.checks_left else timed_call)(self, c)
        self.replays += 1
        c.note(self, "replays")
        with profile_range("replay", self.function.name, self.label):
            return self.graph.replay(c.tensors, c.padding)

    # ---- eager calls ----

    def run_eagerly(self, c: Call) -> Any:
        self.eager_calls += 1
        c.note(self, "eager_calls")
        streams = contextlib.nullcontext() if self.backend is None else \
            self.backend.eager_stream(self.device)
        with nested_calls(), profile_range("eager", self.function.name, self.label), streams:
            return c.call(*c.args, **c.kwargs)

    def _warmup(self, c: Call) -> Any:
        self.eager_calls += 1
        c.note(self, "eager_calls")
        with nested_calls(), profile_range("warmup", self.function.name, self.label), \
                self.backend.eager_stream(self.device):
            if self.warmups + 1 < self.options.warmup:
                outputs = c.call(*c.args, **c.kwargs)
                self.warmups += 1
                return outputs
            outputs = self.watched_warmup(c)
        self.phase = CAPTURE
        return outputs

    def watched_warmup(self, c: Call) -> Any:
        """The last warmup: watched, not judged. A host read seen here may be skipped during
        capture by capture-aware code, so the capture's guard decides."""
        detector = UnsafeOpDetector(self.backend.device_type, raise_on_unsafe=False)
        watch = CallWatch()
        collectives = CollectiveWatch() if distributed_is_on() else contextlib.nullcontext()
        with detector, watch, collectives:
            outputs = c.call(*c.args, **c.kwargs)
        if isinstance(collectives, CollectiveWatch):
            self.groups = collectives.groups
        self.warmups += 1
        self.uses_cudnn = detector.uses_cudnn
        self.warmup_thread = threading.get_ident()
        leaves = flatten_output(outputs)[0]
        if c.padding is not None:
            self.warmup_shapes = [c.padding.rows, [
                tuple(o.shape) if isinstance(o, Tensor) else None for o in leaves]]
        self.written = watch.written_arguments(c.tensors)
        if torch.is_grad_enabled() and any(isinstance(o, Tensor) and o.requires_grad
                                           for o in leaves):
            self.trains = True  # a closed-over parameter needs gradients
        return outputs

    # ---- capture ----

    def _capture(self, c: Call) -> Any:
        """Record the graph and replay it once for this call's result; MISS if it cannot be
        graphed (the key now runs eagerly)."""
        graph = self.agreed_record(c)
        if graph is None:
            return MISS
        self.replays += 1
        with profile_range("replay", self.function.name, self.label):
            outputs = graph.replay(c.tensors, c.padding, copy_in=False)
        graph.watch_reads()
        if graph.invalid_reason is not None:
            # Freed by the call itself: the function rebinds what it reads on every call.
            graph.release()
            self.fall_back(
                f"it replaces {graph.invalid_reason} on every call (a cache that grows with "
                f"torch.cat does), and a graph would keep reading the old tensor. Use a "
                f"fixed-size cache updated in place (transformers' StaticCache), or pass the "
                f"tensor as an argument", raise_now=False)
            return outputs
        self.adopt(graph)
        c.note(self, "captures")
        c.note(self, "replays")
        return outputs

    def adopt(self, graph: Graph) -> None:
        self.graph, self.phase = graph, GRAPHED
        self.checks_left = self.options.replays_to_verify
        self.payoff = measurement(self)

    def agreed_record(self, c: Call) -> Optional[Graph]:
        """Record the key's graph, and if its calls run collectives, agree with the other
        ranks of their groups (``_ranks``); None (the key now runs eagerly) if this rank or
        another could not graph it, or its function has max_graphs graphs already."""
        if c.cache.past_max_graphs(self):
            return None
        try:
            graph: Optional[Graph] = self._record(c)
            failure = None
        except CaptureFailed as failed:
            graph, failure = None, failed.finding.message()
        except BaseException:  # the user's own exception: the other ranks must not wait
            if self.groups:
                agreed_failure(self.groups, "it raised")
            raise
        if self.groups:
            failure = agreed_failure(self.groups, failure)
        if failure is not None:
            if graph is not None:
                graph.release()
            self.fall_back(failure)
            return None
        return graph

    def _record(self, c: Call) -> Graph:
        """Record the key's graph (nothing runs); ``CaptureFailed`` if it cannot be."""
        label = f"{self.function.name}({self.label})"
        pool = (c.region.pools if c.region is not None else c.cache.pools).get(
            self.backend, self.device)
        # The warmup's cuDNN ops made this thread's handle; another thread needs one made
        # before its capture, and making it (a small convolution) costs a fraction of a second.
        cudnn = self.uses_cudnn and self.warmup_thread != threading.get_ident()
        request = CaptureRequest(c.call, c.args, c.kwargs, c.tensors, self.backend,
                                 self.device, pool, self.options.outputs, label, self.function.roots(c),
                                 cudnn, c.padding, c.addressed, self.warmup_shapes)
        with nested_calls(), profile_range("capture", self.function.name, self.label):
            graph = (TrainingGraph if self.trains else Graph).record(request)
        logger.info("captured %s in %.1f ms (%.1f MiB)", label, graph.capture_seconds * 1e3,
                    graph.memory_bytes / 2**20)
        return graph

    def _invalidate(self) -> None:
        graph, self.graph = self.graph, None
        graph.release()
        self.recaptures += 1
        if self.recaptures > MAX_RECAPTURES:
            self.fall_back(
                f"{graph.invalid_reason}, which its graph reads by address, was freed or "
                f"replaced again after {MAX_RECAPTURES} captures; update it in place instead "
                f"of replacing it")
            return
        logger.info("%s(%s): %s was freed or replaced since capture; capturing again",
                    self.function.name, self.label, graph.invalid_reason)
        self.phase = CAPTURE

    # ---- eager for good ----

    def fall_back(self, reason: str, *, warn: bool = True, strict: bool = True,
                  raise_now: bool = True) -> None:
        """Run this key eagerly from now on, said once (``strict``: raise ``CaptureError``)."""
        self.phase, self.reason = EAGER, reason
        if self.graph is not None:
            self.graph.release()
            self.graph = None
        message = f"{self.function.name}({self.label}) runs eagerly: {reason}"
        logger.info(message)
        if strict and self.options.raises_on_fallback:
            self.strict_error = message
            if raise_now:
                raise CaptureError(message)
        elif warn:
            warn_user(message)

    def stats(self) -> KeyStats:
        graph = self.graph
        return KeyStats(
            function=self.owner, key=self.label, state=WARMUP if self.phase == CAPTURE
            else self.phase, calls=self.calls, eager_calls=self.eager_calls, replays=self.replays,
            capture_seconds=graph.capture_seconds if graph else None,
            graph_bytes=graph.memory_bytes if graph else 0,
            fallback_reason=self.reason, bucket=self.bucket, sizes=dict(self.sizes) or None,
            verified=self.verified, gain=self.gain)
