"""One key's life, from its first call to its last: warmup, capture, replay, eager.

>>> life = KeyLife(function, "step", "x: f32[8] cuda:0", parts, options, CUDA, 0)
>>> life.serve(tensors, padding, region)        # a replay, or MISS when it cannot replay
>>> life.run(call)                              # everything else: warm up, capture, eager

Phases (docs/design.md, "A key's life"): ``warmup`` (eager calls, the last one watched),
``capture`` (the next call records the graph and replays it once for its result), ``graphed``
(calls replay), ``eager`` (every call runs eagerly, for the reason said). A graph whose reads
were freed is captured again, at most ``MAX_RECAPTURES`` times. Every call runs its GPU work
once, whichever step it hits. The region a call is made in is told of each event; verify mode
and profiler ranges wrap a replay (``_observed_replay``); ranks vote on a capture (``_ranks``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

from .._config import Options, logger
from .._errors import CaptureError
from .._profile import profile_range, torch_profiler
from .._scope import nested_calls
from .._stats import KeyStats
from .._warn import warn_user
from ..backends._pool import Pools
from ..buckets._bucket_runs import (
    capture_call,
    capture_replay,
    first_padded_replay,
    learn_state_written,
    run_call,
    slices_unknown,
    state_written,
)
from ..capture._call_record import record_call
from ..capture._graph import Graph
from ..capture._outputs import flatten_output, needs_gradients
from ..capture._recording import CaptureFailed, CaptureRequest
from ..distributed._ranks import CollectiveWatch, agreed_failure, distributed_is_on
from ..policy._islands import drop_an_idle_island, eager_scope, in_an_island
from ..policy._memory_budget import within_budget
from ..policy._payoff import measurement, timed_call
from ..policy._verify import checked_replay
from ..training._training import TrainingGraph
from ..watch._guard import LibraryUse
from ..watch._python_state import PythonState, per_call_reason
from ..watch._reads import (
    CallWatch,
    Survey,
    held_before,
    replaces_reason,
    roots_of,
    shares_state,
    shares_written_memory,
)
from ..watch._values_read import ValuesRead

Tensor = torch.Tensor

WARMUP, CAPTURE, GRAPHED, EAGER = "warmup", "capture", "graphed", "eager"
# A key whose graph keeps being invalidated (its reads freed) is captured again this often,
# then runs eagerly: no capture storm.
MAX_RECAPTURES = 2
MISS = object()  # ``serve``: this call cannot be a plain replay
# A tick per replay, for max_graph_memory's least recently replayed first: a list item, so that
# a replay pays no call; races between threads only blur the order.
_clock = [0]


def _aliases_what_it_uses(tensors: List[Tensor], written: List[int], by_address: set) -> bool:
    """Whether an argument it writes shares memory with another argument, or an argument
    shares memory with state it uses by address: a graph's static copy would not see it."""
    return (
        bool(written)
        and shares_written_memory(tensors, written)
        or bool(by_address)
        and shares_state(tensors, by_address)
    )


def _alive(storages: Dict[int, Any]) -> set:
    """The addresses of those weakly held storages that are still alive."""
    return {ptr for ptr, storage in storages.items() if storage() is not None}


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

    __slots__ = (
        "call",
        "instance",
        "args",
        "kwargs",
        "names",
        "tensors",
        "addressed",
        "padding",
        "region",
        "cache",
        "state",
    )

    def __init__(
        self,
        call: Callable,
        instance: Any,
        args: tuple,
        kwargs: dict,
        names: List[str],
        tensors: List[Tensor],
        addressed: List[int],
        padding: Any,
        region: Any,
        cache: Any,
        state: tuple,
    ):
        self.call, self.instance = call, instance
        self.args, self.kwargs, self.names = args, kwargs, names
        self.tensors, self.addressed, self.padding = tensors, addressed, padding
        self.region, self.cache, self.state = region, cache, state

    def note(self, life: "KeyLife", event: str) -> None:
        """Tell the region this call is made in (its observer) what happened."""
        if self.region is not None:
            self.region.note(life, event, self.cache)


def strict_words(call: str, reason: str) -> str:
    """``CaptureError``'s message under ``strict``: the call raises, it does not run eagerly."""
    return (
        f"{call} cannot be graphed, and strict mode raises instead of running it eagerly: {reason}"
    )


def _key_stats(life: "KeyLife") -> KeyStats:
    """A snapshot of ``life``'s counters."""
    graph = life.graph
    return KeyStats(
        function=life.owner,
        key=life.label,
        state=WARMUP if life.phase == CAPTURE else life.phase,
        calls=life.calls,
        eager_calls=life.eager_calls,
        replays=life.replays,
        capture_seconds=graph.capture_seconds if graph else None,
        graph_bytes=graph.memory_bytes if graph else 0,
        fallback_reason=life.reason,
        bucket=life.bucket,
        sizes=dict(life.sizes) or None,
        verified=life.verified,
        gain=life.gain,
        evictions=life.evictions,
        emulated=getattr(life.backend, "device_type", None) == "cpu",
    )


class KeyLife:
    """One key of one cache: its phase, counters and graph, and every step of its life."""

    __slots__ = (
        "function",
        "owner",
        "label",
        "parts",
        "options",
        "backend",
        "device",
        "phase",
        "calls",
        "eager_calls",
        "replays",
        "warmups",
        "watch_later",  # a new key not expected to repeat: its first call runs unwatched
        "frees_reads",  # its watched warmup freed what it read: the next call is watched too
        "recaptures",
        "reason",
        "strict_error",
        "graph",
        "written",
        "by_address",
        "uses_cudnn",
        "generators",
        "warmup_thread",
        "strong_identities",
        "identity_ids",
        "bucket",
        "sizes",
        "trains",
        "builds_graph",
        "payoff",
        "gain",
        "checks_left",
        "verified",
        "padded_runs",
        "state_written",
        "groups",
        "island",
        "last_replay",
        "evictions",
        "example",
        "__weakref__",
    )

    def __init__(
        self,
        function: Function,
        owner: str,
        label: str,
        parts: List[str],
        options: Options,
        backend: Any,
        device: int,
        bucket: Optional[int] = None,
    ):
        self.function = function
        self.owner = owner  # the cache's name: "step", or "Net.forward#2" for an instance
        self.label, self.parts = label, parts  # parts: to say what differs between two keys
        self.options, self.backend, self.device = options, backend, device
        self.phase = WARMUP
        self.calls = self.eager_calls = self.replays = self.warmups = self.recaptures = 0
        self.watch_later = self.frees_reads = False
        self.reason: Optional[str] = None
        self.strict_error: Optional[str] = None  # raised on every call under strict=True
        self.graph: Any = None
        self.written: List[int] = []  # arguments the watched warmup wrote to
        self.by_address: dict = {}  # and the storages it used by address, held weakly
        self.uses_cudnn, self.generators = False, ()  # seen at warmup: see watched_warmup
        self.warmup_thread: Optional[int] = None  # the thread whose handles the warmup made
        self.strong_identities: list = []  # identity-keyed objects that have no weakref
        self.identity_ids: List[int] = []  # ids of the objects it keys by identity
        # Buckets (``_bucket_runs``): its runs padded? The state its watched warmup wrote.
        self.padded_runs = True
        self.state_written: List[Tensor] = []
        self.bucket = bucket  # the capture size, for a bucketed key
        self.trains = False  # its outputs need gradients: forward and backward are graphed
        # Whether its watched warmup could build an autograd graph (None: no warmup ran); an
        # eager call that cannot runs on the caller's stream (``run_eagerly``).
        self.builds_graph: Optional[bool] = None
        # The process groups its warmup ran collectives on: their ranks agree on its capture.
        self.groups: List[Any] = []
        self.sizes: Dict[int, int] = {}  # a bucket's calls by their real size
        # Verify mode: replays still to check (set at each capture), and those that matched.
        self.checks_left = self.verified = 0
        self.island: Any = None  # the region its eager calls run in (``_islands``)
        self.payoff = self.gain = None  # check_payoff: measured until a verdict (``_payoff``)
        # max_graph_memory (``_memory_budget``): when it last replayed, and its graphs dropped.
        self.last_replay = self.evictions = 0
        self.example: Optional[dict] = None  # its capture's call, as JSON (``_call_record``)

    # ---- replays ----

    def serve(self, tensors: List[Tensor], padding: Any, region: Any) -> Any:
        """Count the call, and replay if that is all it takes; else MISS (``run`` it)."""
        self.calls += 1
        if padding is not None:
            self.sizes[padding.rows] = self.sizes.get(padding.rows, 0) + 1
        graph = self.graph
        if (
            graph is None
            or self.checks_left
            or self.payoff
            or torch_profiler._is_profiler_enabled
            or not self._may_replay(graph, tensors)
            or padding is not None
            and padding.rows < padding.bucket
            and padding.rows not in graph.rows_checked
        ):
            return MISS
        self.replays += 1
        _clock[0] += 1
        self.last_replay = _clock[0]
        if region is not None:
            region.note(self, "replays")
        return graph.replay(tensors, padding)

    def _may_replay(self, graph: Graph, tensors: List[Tensor]) -> bool:
        """Nothing read by address freed or aliased, no written argument aliased, the Python
        values its capture read as they were (``_values_read``; else the call runs eagerly)."""
        return (
            graph.may_replay()
            and not (
                graph.aliasing and _aliases_what_it_uses(tensors, graph.mutated, graph.by_address)
            )
            and not (self.trains and graph.busy())
            and (graph.values is None or graph.values.same())
        )

    def run(self, c: Call) -> Any:
        """Everything but a plain replay: a checked or profiled replay, or a step of the
        key's life."""
        graph = self.graph  # the one checked (another thread may drop it: ``_memory_budget``)
        if graph is not None and self._may_replay(graph, c.tensors):
            padding = c.padding  # a bucket's first call with pad rows: probed (_bucket_runs)
            if padding and padding.rows < padding.bucket and padding.rows not in graph.rows_checked:
                return first_padded_replay(self, c, graph)
            return self._observed_replay(c, graph)
        if graph is not None:
            if graph.may_replay():  # aliased, busy, or a Python value read changed: eager
                return self.run_eagerly(c)
            _invalidate(self, graph)
        if self.phase == WARMUP:
            return _unwatched_first_call(self, c) if self.watch_later else _warm_up(self, c)
        if self.phase == CAPTURE:
            if _aliases_what_it_uses(c.tensors, self.written, _alive(self.by_address)):
                return self.run_eagerly(c)
            outputs = self._capture(c)
            if outputs is not MISS:
                return outputs
        if self.strict_error is not None:
            raise CaptureError(self.strict_error)
        return self.run_eagerly(c)

    def _observed_replay(self, c: Call, graph: Graph) -> Any:
        """A replay verify mode checks against an eager run first, timed, or profiled."""
        if self.checks_left:  # verify's checks first, then the payoff
            return checked_replay(self, c, graph, run_call)
        if self.payoff:
            return timed_call(self, c, graph)
        self.replays += 1
        _clock[0] += 1
        self.last_replay = _clock[0]
        c.note(self, "replays")
        with profile_range("replay", self.function.name, self.label):
            return graph.replay(c.tensors, c.padding)

    # ---- eager calls ----

    def run_eagerly(self, c: Call, watched: bool = False) -> Any:
        self.eager_calls += 1
        c.note(self, "eager_calls")
        # On the capture stream, where an autograd graph it builds belongs (``eager_stream``);
        # on the caller's when its watched warmup showed it reads nothing that needs gradients
        # (no AccumulateGrad node is made): two cross-stream waits less a call.
        streams = (
            contextlib.nullcontext()
            if self.backend is None or self.builds_graph is False
            else self.backend.eager_stream(self.device)
        )
        with eager_scope(self), profile_range("eager", self.function.name, self.label), streams:
            outputs = run_call(self, c, watched)
        drop_an_idle_island(self)
        if (
            self.builds_graph is False
            and torch.is_grad_enabled()
            and needs_gradients(
                [outputs] if isinstance(outputs, Tensor) else flatten_output(outputs)[0]
            )
        ):
            # Its warmup read nothing that needs gradients, but this call made a graph (a
            # branch its warmup did not take, a parameter unfrozen since): from now on its
            # calls run where autograd nodes belong.
            self.builds_graph = True
        return outputs

    def _warmup(self, c: Call) -> Any:
        self.eager_calls += 1
        c.note(self, "eager_calls")
        with (
            nested_calls(),
            profile_range("warmup", self.function.name, self.label),
            self.backend.eager_stream(self.device),
        ):
            if self.warmups + 1 < self.options.warmup:
                outputs = run_call(self, c)
                self.warmups += 1
                return outputs
            outputs = self.watched_warmup(c)
        # Not where the warmup made the key eager (a bucket refused), nor where it freed what
        # it read, once: the next call is watched again.
        if self.phase == WARMUP and not self.frees_reads:
            self.phase = CAPTURE
        return outputs

    def watched_warmup(self, c: Call) -> Any:
        """The last warmup: watched, not judged (capture-aware code may skip a host read seen
        here: the capture's guard decides); it notes what the capture must prepare."""
        uses = LibraryUse()
        watch = CallWatch(c.tensors)
        collectives = CollectiveWatch() if distributed_is_on() else contextlib.nullcontext()
        # Watched again because the last watch saw the call free what it read: what the
        # caller held before the call, as attributes, by storage (a weak reference) and name.
        survey = Survey(self.function.roots(c)) if self.frees_reads else None
        with uses, watch, collectives:
            outputs = run_call(self, c, watched=True)
        if isinstance(collectives, CollectiveWatch):
            self.groups = collectives.groups
        self.warmups += 1
        self.uses_cudnn, self.generators = uses.uses_cudnn, tuple(uses.generators)
        self.warmup_thread = threading.get_ident()
        held = None if survey is None else held_before(survey)
        del survey  # it holds the tensors it reached: what the call let go of must die
        _learn_from_the_watch(self, c, watch, flatten_output(outputs)[0], held)
        return outputs

    # ---- capture ----

    def _capture(self, c: Call) -> Any:
        """Record the graph and replay it once for this call's result; MISS if it cannot be
        graphed (the key now runs eagerly)."""
        if c.padding is not None and slices_unknown(c.padding):
            return self.run_eagerly(c)  # which outputs to slice shows in this call's run
        # The capture is the second run of the function's Python: a change it makes to the
        # state the call reaches is made by every call, and a replay would not make it.
        # Restorable: a capture that fails ran some of the Python (a layer's counter += 1 before
        # the op CUDA refused), and the eager run that follows must find the state as it was.
        state = PythonState.of(self.function.roots(c), self.function.fn, restorable=True)
        graph = self.agreed_record(c)
        if graph is None:
            state.restore()
            return MISS
        changes = state.changes()
        del state  # before watch_reads: nothing of the snapshot may keep a read tensor alive
        outputs, kept = capture_replay(self, c, graph)
        if not kept:
            return outputs
        graph.watch_reads()
        if changes:  # this call is right (its Python ran once, its GPU work once); not later
            graph.release()
            self.fall_back(per_call_reason(changes), raise_now=False)
            return outputs
        if graph.invalid_reason is not None:
            # Freed by the call itself: the function rebinds what it reads on every call.
            graph.release()
            self.frees_reads = True
            self.fall_back(replaces_reason(graph.invalid_reason), raise_now=False)
            return outputs
        self.adopt(graph, c)
        c.note(self, "captures")
        c.note(self, "replays")
        within_budget(self, c)
        return outputs

    def adopt(self, graph: Graph, c: Call) -> None:
        graph.values = ValuesRead.of(c.names, c.args, c.kwargs, self.function.fn)
        self.graph, self.phase = graph, GRAPHED
        options = self.options  # what fn.save_plan() writes for a warm restart
        try:
            self.example = record_call(
                c.names,
                c.args,
                c.kwargs,
                c.state,
                options.static_argnames,
                options.static_argnums,
                c.padding,
            )
        except Exception:  # noqa: BLE001 - a record that fails leaves the key out of a plan only
            self.example = None
        self.checks_left = self.options.replays_to_verify
        self.payoff = measurement(self)

    def agreed_record(self, c: Call) -> Optional[Graph]:
        """Record the key's graph, and if its calls run collectives, agree with the other
        ranks of their groups (``_ranks``); None (the key now runs eagerly) if this rank or
        another could not graph it, or its function has max_graphs graphs already."""
        if c.cache.past_max_graphs(self):
            return None
        try:
            graph: Optional[Graph] = _record(self, c)
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
        if c.padding is not None and graph is not None:
            learn_state_written(self, c, graph)
        return graph

    # ---- eager for good ----

    def fall_back(
        self, reason: str, *, warn: bool = True, strict: bool = True, raise_now: bool = True
    ) -> None:
        """Run this key eagerly from now on, said once (``strict``: raise ``CaptureError``)."""
        self.phase, self.reason = EAGER, reason
        graph, self.graph = self.graph, None
        if graph is not None:
            graph.release()
        message = f"{self.function.name}({self.label}) runs eagerly: {reason}"
        logger.info(message)
        if strict and self.options.raises_on_fallback:
            self.strict_error = strict_words(f"{self.function.name}({self.label})", reason)
            if raise_now:
                raise CaptureError(self.strict_error)
        elif warn and not in_an_island():  # an island's fallbacks: in stats, not warned
            warn_user(message)

    def stats(self) -> KeyStats:
        return _key_stats(self)


def _learn_from_the_watch(
    life: KeyLife, c: Call, watch: CallWatch, leaves: List[Any], held: Optional[dict]
) -> None:
    """What a watched warmup tells the capture, and whether the call frees what it reads
    (``held``: ``_reads.held_before``, where it was watched again)."""
    life.written = watch.written_arguments(c.tensors)
    # Weakly: a storage freed before the capture is no state, and the allocator may hand
    # its address to a later argument (an argument there is no alias of anything).
    life.by_address = {ptr: weakref.ref(t.untyped_storage()) for ptr, t in watch.external.items()}
    life.state_written = [] if c.padding is None else state_written(c, watch)
    if torch.is_grad_enabled() and needs_gradients(leaves):
        life.trains = True  # a closed-over parameter needs gradients
    # No leaf that needs gradients among its arguments and what it read by address, and
    # none among its outputs (a tensor made inside with requires_grad=True): no graph.
    life.builds_graph = life.trains or any(
        t.requires_grad for t in itertools.chain(c.tensors, watch.external.values())
    )
    # Held by the watch alone now: a storage the call read and let go (an HF DynamicCache's
    # keys, rebound to a longer torch.cat) dies here, and a graph would read it freed. Seen
    # twice in a row (once could be a lazy first-call conversion), the key runs eagerly now,
    # before a capture that would be thrown away (the capture finds it too: ``_capture``).
    watch.external.clear()
    if held is None:
        life.frees_reads = any(storage() is None for storage in life.by_address.values())
        return
    # Watched again, only a tensor the caller held before the call counts (one the call made
    # of the caller's memory, torch.from_numpy(array), dies with the call: the capture's guard
    # judges it).
    rebound = [
        name
        for ptr, (name, storage) in held.items()
        if ptr in life.by_address and storage() is None
    ]
    life.frees_reads = bool(rebound)
    if rebound:
        life.fall_back(replaces_reason(rebound[0]), raise_now=False)


def _unwatched_first_call(life: KeyLife, c: Call) -> Any:
    """The first call of a new key the churn policy expects never to repeat (``watch_later``,
    set by ``Engine._note_new_key``), run as a plain call: watched op by op, a warmup costs
    several eager calls (HF generate()'s decode keys, each one position longer: docs/design.md,
    "Never slower"), wasted on a key never called again. A second call is its warmup."""
    life.watch_later = False
    life.eager_calls += 1
    c.note(life, "eager_calls")
    with nested_calls():
        return c.call(*c.args, **c.kwargs)


def _warm_up(life: KeyLife, c: Call) -> Any:
    """A warmup; a key's second call (its first ran unwatched, or was a plain warmup of a
    ``warmup >= 2``) tells the churn policy that the key repeats (``Churn.met_again``),
    unless its watch sent it eager or saw it free what it reads (a DynamicCache's decode step:
    it repeats within one generate() and dies with its cache, never graphed)."""
    outputs = life._warmup(c)
    if life.calls == 2 and life.phase != EAGER and not life.frees_reads:
        c.cache.churn.met_again()
    return outputs


def _invalidate(life: KeyLife, graph: Graph) -> None:
    """``graph``, whose reads were freed, is dropped; its key captures again, at most
    ``MAX_RECAPTURES`` times."""
    life.graph = None
    graph.release()
    life.trains = life.trains or graph.unfrozen  # its outputs will need gradients now
    life.builds_graph = life.builds_graph or graph.unfrozen
    life.recaptures += 1
    if life.recaptures > MAX_RECAPTURES:
        life.fall_back(graph.changed_again(MAX_RECAPTURES))
        return
    logger.info(
        "%s(%s): %s was freed or replaced since capture; capturing again",
        life.function.name,
        life.label,
        graph.invalid_reason,
    )
    life.phase = CAPTURE


def _record(life: KeyLife, c: Call) -> Graph:
    """Record ``life``'s graph for the call ``c`` (nothing runs); ``CaptureFailed`` if it
    cannot be."""
    label = f"{life.function.name}({life.label})"
    owner = c.region.pools if c.region is not None else c.cache.pools
    if torch.is_grad_enabled() and life.builds_graph is not False:  # trains, or a whole step
        owner = Pools()  # memory outliving its replay (activations, .grad): see "Pools"
    pool = owner.get(life.backend, life.device)
    # The warmup's cuDNN ops made this thread's handle; another thread needs one made
    # before its capture, and making it (a small convolution) costs a fraction of a second.
    cudnn = life.uses_cudnn and life.warmup_thread != threading.get_ident()
    # The private random generators the warmup drew from: CUDA registers them with the graph.
    request = CaptureRequest(
        capture_call(c),
        c.args,
        c.kwargs,
        c.tensors,
        life.backend,
        life.device,
        pool,
        life.options.outputs,
        label,
        life.function.roots(c),
        cudnn,
        c.padding,
        c.addressed,
        life.generators,
    )
    with nested_calls(), profile_range("capture", life.function.name, life.label):
        graph = (TrainingGraph if life.trains else Graph).record(request)
    logger.info(
        "captured %s in %.1f ms (%.1f MiB)",
        label,
        graph.capture_seconds * 1e3,
        graph.memory_bytes / 2**20,
    )
    return graph
