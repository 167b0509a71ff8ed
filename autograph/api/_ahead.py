"""Capture ahead of time: ``fn.capture(*example_args)`` warms up and captures without leaving
the warmups' effects behind, every bucket largest first.

>>> step.capture(torch.zeros(8, 512, device="cuda"), w)     # -> the captured keys' stats

The example call is keyed as a real call would be (with ``buckets``, resized to every size and
keyed as its bucket), each key warms up under ``UndoWrites`` (arguments, tensors it writes by
address such as a KV cache, module buffers and random generators come back as they were), and
capturing runs nothing. Keys already graphed or eager are left as they are. State each bucket
holds its own of (a KV cache per bucket) is given as ``autograph.per_bucket(caches)``
(``_per_bucket``): each bucket's example gets its own.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch

from .. import _config
from .._config import Options, logger
from .._scope import current_region, nested_calls
from .._stats import KeyStats
from .._warn import warn_user
from ..backends._collector import collector_paused
from ..buckets._bucket_runs import note_capture, run_call
from ..buckets._buckets import BucketRule, Padding, bucket_key, family_key, padded_arguments
from ..capture._graph import Graph
from ..capture._keys import call_key
from ..engine._key_cache import KeyCache
from ..engine._key_life import CAPTURE, EAGER, GRAPHED, WARMUP, Call, KeyLife
from ..policy._memory_budget import within_budget
from ..watch._python_state import PythonState, per_call_reason
from ..watch._undo import UndoWrites
from ._per_bucket import check_markers, for_bucket
from ._progress import progress

Tensor = torch.Tensor


def capture_ahead(
    engine: Any,
    call: Callable,
    instance: Any,
    args: tuple,
    kwargs: dict,
    sizes: Optional[Sequence[int]] = None,
) -> List[KeyStats]:
    """Warm up and capture the keys of this example call of ``engine``'s function: with
    buckets, at every bucket, or at ``sizes`` only (a plan's, ``_warm_restart``)."""
    if _config.ENV.disable:
        return []
    region = current_region()
    options, cache, names, state = engine.call_options(instance, region)
    sizes = options.buckets if sizes is None or options.buckets is None else sizes
    check_markers(engine.name, names, args, kwargs, options.buckets, sizes)
    examples: List[Tuple[tuple, dict, Optional[Padding]]] = [(args, kwargs, None)]
    if options.buckets is not None:
        examples = _bucket_examples(
            engine.name, options, names, args, kwargs, state, cache, sizes or ()
        )
    rows: List[KeyStats] = []
    started = time.perf_counter()
    # No collection between the captures, and the objects made before not scanned by any
    # (docs/design.md, "Capture ahead"): a scan of the process per capture frees next to nothing.
    watched: Dict[int, KeyLife] = {}  # by family (its BatchShapes): its key watched first
    with collector_paused():
        for example in progress(examples, f"capturing {engine.name}"):
            rows.append(
                _capture_example(
                    engine, call, instance, example, options, cache, names, state, region, watched
                )
            )
    captured = [r for r in rows if r.state == GRAPHED]
    logger.info(
        "%s: captured %d graph(s) in %.2f s, %.1f MiB",
        engine.name,
        len(captured),
        time.perf_counter() - started,
        sum(r.graph_bytes for r in captured) / 2**20,
    )
    return rows


def _capture_example(
    engine: Any,
    call: Callable,
    instance: Any,
    example: Tuple[tuple, dict, Optional[Padding]],
    options: Options,
    cache: KeyCache,
    names: List[str],
    state: tuple,
    region: Any,
    watched: Dict[int, KeyLife],
) -> KeyStats:
    """Key one example call as a real call would be keyed, and capture that key."""
    example_args, example_kwargs, padding = example
    keyed = call_key(
        example_args, example_kwargs, state, names, options.static_argnames, options.static_argnums
    )
    key = keyed.key
    if padding is not None:
        # The example's own choice of padded tensors at every size (the default rule
        # could add one whose dim happens to equal a bucket), as real calls make it.
        key = bucket_key(
            example_args,
            example_kwargs,
            state,
            names,
            options.static_argnames,
            options.static_argnums,
            padding,
        )
    if options is not engine.options and options != engine.options:
        key = (key, options)
    with cache.lock:
        if cache.dead_keys:
            cache.forget_dead()
        c = Call(
            call,
            instance,
            example_args,
            example_kwargs,
            names,
            keyed.tensors,
            keyed.addressed,
            padding,
            region,
            cache,
            state,
        )
        life = cache.entries.get(key) or engine.new_life(cache, key, c, keyed.identities, options)
        _capture_key(life, c, watched)
        return life.stats()


def _capture_key(life: KeyLife, c: Call, watched: Dict[int, KeyLife]) -> None:
    """Warm ``life``'s key up and take the warmups' effects back, then capture it. A later
    bucket of a family in ``watched`` runs its last warmup unwatched (docs/design.md,
    "Capture ahead")."""
    if (
        life.graph is not None
        or life.phase not in (WARMUP, CAPTURE)
        or c.cache.past_max_graphs(life)
    ):
        return
    family = None if c.padding is None else id(c.padding.shapes)
    like = watched.get(family) if family is not None else None
    roots = life.function.roots(c)
    before = PythonState.of(roots, life.function.fn, restorable=True)
    try:
        undo = UndoWrites()
        try:
            with nested_calls(), undo, life.backend.eager_stream(life.device):
                while life.warmups < life.options.warmup - 1:
                    c.call(*c.args, **c.kwargs)
                    life.warmups += 1
                if like is None:
                    life.watched_warmup(c)
                else:
                    _plain_warmup(life, c, like)
        finally:
            undo.restore()
        if life.phase == EAGER:  # refused by its warmup (outputs that cannot be sliced back)
            return
        state = PythonState.of(roots, life.function.fn)
        graph = life.agreed_record(c)
        # Made by the capture's run (so by every call), and by the warmups and the capture
        # (taken back below).
        changes, made = state.changes_with(before)
    finally:
        before.restore()
    if graph is None:
        return
    # Noted and let go: the captured outputs may hold objects the call was given.
    if c.padding is not None and not note_capture(life, graph, c.padding):
        return
    if changes or made:
        graph.release()
        _refuse_graph(life, changes, made)
        return
    if like is not None:
        _learn_from_capture(life, c, graph)
    graph.watch_reads()
    if graph.invalid_reason is None:
        life.adopt(graph, c)
        if within_budget(life, c) and family is not None:
            watched.setdefault(family, life)


def _plain_warmup(life: KeyLife, c: Call, like: KeyLife) -> None:
    """The last warmup run unwatched, for a later bucket of a family whose key ``like`` was
    watched in the same ``capture()`` (docs/design.md, "Capture ahead"): what the watch learns
    of the code (libraries, generators, collectives) is ``like``'s; what it learns of the
    state is taken from this key's capture (``_learn_from_capture``)."""
    run_call(life, c)
    life.warmups += 1
    life.uses_cudnn, life.generators, life.groups = like.uses_cudnn, like.generators, like.groups
    life.trains, life.warmup_thread = like.trains, threading.get_ident()


def _learn_from_capture(life: KeyLife, c: Call, graph: Graph) -> None:
    """What an unwatched warmup did not note, from the capture's own watch of the same ops at
    the same size: the arguments it writes, the state it uses by address (the state it writes
    the capture noted, ``learn_state_written``)."""
    life.written = list(graph.mutated)
    external = graph.watched_external()
    life.by_address = {ptr: weakref.ref(t.untyped_storage()) for ptr, t in external.items()}


def _refuse_graph(life: KeyLife, changes: List[str], made: List[str]) -> None:
    """A capture whose runs changed Python state is not kept: with ``changes`` (every call
    changes it) the key runs eagerly; with ``made`` only (its warmups created state, such as
    an optimizer's momentum buffers, which is taken back now) the graph would have recorded
    the branch a later call takes, not the first call's, so the key warms up again from its
    first real call."""
    if changes:
        life.fall_back(per_call_reason(changes))
        return
    life.warmups, life.phase = 0, WARMUP
    shown = "; ".join(made[:3]) + (f"; and {len(made) - 3} more" if len(made) > 3 else "")
    warn_user(
        f"{life.function.name}.capture({life.label}): not captured: its warmup changed "
        f"Python state ({shown}), now undone, and a graph captured after it would "
        f"replay what later calls do, not the first call. Call it once before capture(),"
        f" or let its first calls warm up and capture."
    )


def _bucket_examples(
    name: str,
    options: Options,
    names: List[str],
    args: tuple,
    kwargs: dict,
    state: tuple,
    cache: KeyCache,
    sizes: Sequence[int],
) -> List[Tuple[tuple, dict, Optional[Padding]]]:
    """The example call resized to every size (the buckets), largest first, with its padding;
    each ``per_bucket`` marker swapped for that bucket's value."""
    return [
        _bucket_example(name, options, names, *for_bucket(args, kwargs, size), state, cache, size)
        for size in sorted(sizes, reverse=True)
    ]


def _bucket_example(
    name: str,
    options: Options,
    names: List[str],
    args: tuple,
    kwargs: dict,
    state: tuple,
    cache: KeyCache,
    size: int,
) -> Tuple[tuple, dict, Optional[Padding]]:
    """The example resized to ``size`` rows, keyed as a real call of that size: keyed once
    per bucket, since its per-bucket values (each bucket's KV cache) differ."""
    keyed = call_key(args, kwargs, state, names, options.static_argnames, options.static_argnums)
    buckets = cast(Tuple[int, ...], options.buckets)  # capture() resizes only with buckets
    padding, reason = BucketRule(buckets, options.bucket_args).padding(
        names, args, kwargs, keyed.tensors, keyed.addressed
    )
    if padding is None:
        raise ValueError(f"{name}.capture(): the example call cannot be bucketed: {reason}.")
    family, stateful = family_key(
        args, kwargs, state, names, options.static_argnames, options.static_argnums, padding
    )
    resized_args, resized_kwargs, _ = padded_arguments(args, kwargs, keyed.tensors, padding, size)
    return (
        resized_args,
        resized_kwargs,
        dataclasses.replace(
            padding,
            rows=size,
            bucket=size,
            shapes=cache.batch_shapes_of(family, options),
            stateful=stateful,
        ),
    )
