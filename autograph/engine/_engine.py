"""The engine of one graphed function, method, module or region module: it routes each call to
its key's life, and does nothing else.

>>> engine = Engine(step, {}, "step")
>>> engine(step, None, (x, w), {})       # keyed, then served by the key's life

A call that cannot be graphed whatever its key (disabled, inside torch.compile's tracing or
another capture, plain CPU tensors without the emulation) runs as written. Any other call is
keyed (``_keys``; for buckets, routed to its bucket's key, ``_buckets``), finds its key's life
in the cache (``_key_cache``, one per instance for methods) or makes it, and that life serves
it: a replay, or a step of its life (``_key_life``). One re-entrant lock per cache is held
from the key lookup to the copy of the outputs (docs/design.md, "A call's life").
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import itertools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .. import _config, _stats
from .._config import Options
from .._scope import nested_calls, thread
from .._warn import warn_user
from ..backends import _devices
from ..buckets._buckets import BucketRule, Padding, bucket_key, family_key
from ..capture._keys import (
    call_key,
    describe_parts,
    execution_state,
    join_parts,
    unkeyable_reason,
    unsupported_tensor,
)
from ._key_cache import KeyCache
from ._key_life import EAGER, MISS, Call, Function, KeyLife

Tensor = torch.Tensor

_is_compiling: Callable[[], bool] = torch.compiler.is_compiling
# Dynamo's frame hook: set while compiled code runs.
_dynamo_callback: Callable[[], Any] = torch._C._dynamo.eval_frame.get_eval_frame_callback


def _needs_gradients(tensors: Sequence[Tensor], instance: Any) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in tensors):
        return True
    return isinstance(instance, torch.nn.Module) and any(
        p.requires_grad for p in instance.parameters()
    )


class Engine:
    """The caches and options of one graphed function, method, module or region module."""

    def __init__(
        self,
        fn: Callable,
        explicit: Dict[str, Any],
        name: str,
        *,
        signature_of: Optional[Callable] = None,
        per_instance: bool = False,
        instance_label: str = "self",
        automatic: bool = False,
    ):
        self.function = Function(name, fn, instance_label)
        self.explicit = explicit  # the options the user set, which win over a region's
        # Under a region's own: a module call the region graphs of itself (``automatic``, not
        # a function or module the user graphed) warms up longer.
        self.defaults = {"warmup": _config.REGION_WARMUP} if automatic else {}
        self.options = Options(**explicit)
        self.region_options: Dict[tuple, Options] = {}
        self.name = name
        self.per_instance = per_instance
        try:
            params = list(inspect.signature(signature_of or fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        self.names = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.method_names = self.names[1:]  # a bound method's, without self or cls
        self.cache = KeyCache(name)
        self.instance_caches: "weakref.WeakKeyDictionary[Any, KeyCache]" = (
            weakref.WeakKeyDictionary()
        )
        self.instance_numbers = itertools.count(1)
        self.lock = threading.Lock()
        # Calls that ran eagerly before being keyed (no CUDA, CPU tensors): a count per
        # reason. next() of an itertools.count is one C call, atomic, cheaper than a lock.
        self.eager_tally: Dict[str, "itertools.count[int]"] = {}
        _stats.register(self)

    def __call__(self, call: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``call(*args, **kwargs)`` (the bound function) through its key's graph.

        The signature is wrapt's wrapper signature, so an engine is its own wrapper.
        """
        if _config.ENV.disable or thread.off or _is_compiling():
            # Under torch.compile's tracing, step aside: Dynamo inlines the function, and its
            # fusion (and its own graphs, mode="reduce-overhead") apply.
            return call(*args, **kwargs)
        if _dynamo_callback() is not None:
            return _outside_dynamo()(self, call, instance, args, kwargs)
        return self.route(call, instance, args, kwargs)

    def route(self, call: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        """Key the call and hand it to its key's life. Its callers have stepped aside for a
        disabled region (``thread.off``)."""
        regions = thread.regions
        region = regions[-1] if regions else None
        reason = _devices.why_not_keyed(args, kwargs)
        if reason is not None:
            if reason is _devices.INSIDE_A_CAPTURE:
                return call(*args, **kwargs)
            next(self.eager_tally.get(reason) or self._tally(reason))
            if region is None:
                return call(*args, **kwargs)
            region.note_tallied(self)
            with nested_calls():  # its submodules' calls are part of it, not top-level
                return call(*args, **kwargs)
        if region is None and (instance is None or not self.per_instance):
            # A plain function's call (the common case: no isinstance call) or a graphed
            # module's own forward: the engine's own options and cache.
            options, cache, names = self.options, self.cache, self.names
            state = execution_state(
                None
                if instance is None
                else instance.training
                if isinstance(instance, torch.nn.Module)
                else None
            )
        else:
            options, cache, names, state = self.call_options(instance, region)
        churn = cache.churn
        if churn.left > 0:  # its keys churn: a plain call, unkeyed and unwatched (``_churn``)
            churn.left -= 1
            if region is not None:
                region.pass_through()
            with nested_calls():
                return call(*args, **kwargs)
        last = cache.last
        if last is not None and last.matches(args, kwargs, state, options):
            key, tensors, identities, addressed = last.key, args, (), ()  # no Python key
        else:
            last = None
            key, tensors, identities, addressed, plain = call_key(
                args, kwargs, state, names, options.static_argnames, options.static_argnums
            )
            if options is not self.options and options != self.options:
                key = (key, options)
        with cache.lock:
            if cache.dead_keys:
                cache.forget_dead()
            padding = reason = None
            if options.buckets is not None:
                key, padding, reason = cache.routes.get(key) or self._route(
                    cache, key, options, names, args, kwargs, tensors, addressed, state
                )
            life = last.life if last is not None and cache.last is last else cache.entries.get(key)
            if life is not None:
                outputs = life.serve(tensors, padding, region)
                if outputs is not MISS:
                    if last is None and plain and options.buckets is None:
                        cache.remember(key, life, tensors, state, options)
                    return outputs
            c = Call(
                call,
                instance,
                args,
                kwargs,
                names,
                tensors,
                addressed,
                padding,
                region,
                cache,
                state,
            )
            if life is None:
                life = self._new_life(cache, key, c, identities, options, reason)
                life.serve(tensors, padding, region)  # counts it; a new key cannot replay
            return life.run(c)

    def _tally(self, reason: str) -> "itertools.count[int]":
        with self.lock:
            return self.eager_tally.setdefault(reason, itertools.count())

    def _route(
        self,
        cache: KeyCache,
        key: Any,
        options: Options,
        names: List[str],
        args: tuple,
        kwargs: dict,
        tensors: List[Tensor],
        addressed: List[int],
        state: tuple,
    ) -> Tuple[Any, Optional[Padding], Optional[str]]:
        """Which key a call of a bucketed function goes to, and how it is padded."""
        rule = BucketRule(options.buckets, options.bucket_args)
        padding, reason = rule.padding(names, args, kwargs, tensors, addressed)
        if padding is None:
            route: Tuple[Any, Optional[Padding], Optional[str]] = (key, None, reason)
        else:
            padded = bucket_key(
                args, kwargs, state, names, options.static_argnames, options.static_argnums, padding
            )
            family, stateful = family_key(
                args, kwargs, state, names, options.static_argnames, options.static_argnums, padding
            )
            padding = dataclasses.replace(
                padding, stateful=stateful, shapes=cache.batch_shapes_of(family, options)
            )
            route = (
                padded if options is self.options or options == self.options else (padded, options),
                padding,
                None,
            )
        if len(cache.routes) >= 4 * cache.max_keys:
            cache.routes.clear()
            cache.batch_shapes.clear()
        cache.routes[key] = route
        return route

    def _new_life(
        self,
        cache: KeyCache,
        key: Any,
        c: Call,
        identities: list,
        options: Options,
        reason: Optional[str],
        ahead: bool = False,
    ) -> KeyLife:
        resized = (
            {}
            if c.padding is None
            else {id(t): c.padding.padded_shape(t, i) for i, t in enumerate(c.tensors)}
        )
        parts = describe_parts(c.names, c.args, c.kwargs, resized)
        backend, device, device_reason, loud = _devices.choose_backend(c.tensors)
        life = cache.add(
            key,
            KeyLife(
                self.function,
                cache.name,
                join_parts(parts, c.state),
                parts,
                options,
                backend,
                device,
                None if c.padding is None else c.padding.bucket,
            ),
            identities,
        )
        if reason is not None:  # above the largest bucket
            first = "buckets" not in cache.said
            cache.said.add("buckets")
            life.fall_back(
                reason, warn=first and device_reason is None, strict=device_reason is None
            )
            return life
        reason = device_reason
        if reason is None:
            reason = unsupported_tensor(c.tensors) or unkeyable_reason(key)
            loud = reason is not None
        life.trains = reason is None and _needs_gradients(c.tensors, c.instance)
        if reason is not None:
            life.fall_back(reason, warn=loud, strict=loud)
        elif not ahead:  # capture()'s keys are the user's choice, never churn
            self._note_new_key(cache, life)
        return life

    @staticmethod
    def _note_new_key(cache: KeyCache, life: KeyLife) -> None:
        """Count a new key for the churn policy (``_churn``); say once when calls start to pass
        through."""
        churn = cache.churn
        passes = churn.new_key(cache.entries.values(), life.parts)
        # Growth by one, or the key that starts a pass-through: it is not expected to repeat.
        # (With warmup >= 2 its first call is a plain warmup anyway.)
        life.watch_later = (
            (passes or churn.growing > 0) and life.bucket is None and life.options.warmup < 2
        )
        if not passes or "churn" in cache.said:
            return
        cache.said.add("churn")
        warn_user(churn.warning(life.label))

    def new_life(
        self, cache: KeyCache, key: Any, c: Call, identities: list, options: Options
    ) -> KeyLife:
        """A new key for ``capture()`` (``_ahead``)."""
        return self._new_life(cache, key, c, identities, options, None, ahead=True)

    def call_options(
        self, instance: Any, region: Any
    ) -> Tuple[Options, KeyCache, List[str], tuple]:
        """The options, cache, parameter names and execution state of a call made now, in
        ``region``."""
        options = self.options if region is None else self.options_in(region)
        bound = self.per_instance and instance is not None
        cache = self.cache_for(instance) if bound else self.cache
        names = self.method_names if bound else self.names
        state = execution_state(
            instance.training if isinstance(instance, torch.nn.Module) else None
        )
        return options, cache, names, state

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
            options = Options(**{**self.defaults, **region.explicit, **self.explicit})
            if options == self.options:
                options = self.options  # so that a call tests identity, not nine fields
            self.region_options[region.options_key] = options
        return options

    # ---- inspection ----

    def caches(self) -> List[KeyCache]:
        with self.lock:
            return [self.cache, *self.instance_caches.values()]

    def stats(self, islands: bool = True) -> List[_stats.KeyStats]:
        """A row per key (its island's keys under it, with ``islands``), and a row per reason
        for the calls that ran eagerly before being keyed."""
        return [row for cache in self.caches() for row in cache.stats(islands)] + self.tally_rows()

    def tally_rows(self) -> List[_stats.KeyStats]:
        """A row per reason for the calls that ran eagerly before being keyed."""
        with self.lock:
            tally = [
                (reason, int(repr(count)[6:-1]))  # "count(7)": 7 calls so far
                for reason, count in self.eager_tally.items()
            ]
        return [
            _stats.KeyStats(
                function=self.name,
                key="every call",
                state=EAGER,
                calls=count,
                eager_calls=count,
                replays=0,
                capture_seconds=None,
                graph_bytes=0,
                fallback_reason=reason,
            )
            for reason, count in tally
        ]

    def reset(self) -> None:
        free(self.release())

    def release(self) -> Set[int]:
        """Drop every key and graph; return the devices to ``free`` (once, for many)."""
        with self.lock:
            self.eager_tally.clear()
        return {device for cache in self.caches() for device in cache.release()}


def free(devices: Any) -> None:
    """Give the memory of released graphs back to these devices."""
    if devices:
        # A graph in a reference cycle holds its pool until the collector runs: one made by a
        # traceback that keeps the frames of a call (torch stores some, for example on the
        # first ``import torch._dynamo`` inside a call). Reset is rare and asked for its
        # memory: collect first, once for all the functions reset.
        gc.collect()
    for device in devices:
        if device >= 0:
            _devices.CUDA.free(device)


_outside_dynamo_call: Optional[Callable[..., Any]] = None


def _outside_dynamo() -> Callable[..., Any]:
    """``Engine.route`` with Dynamo's frame hook off, made on first use.

    A compiled caller that could not trace a call (a graph break) runs it with Dynamo's frame
    hook still set: without this, the engine's own frames would be compiled piecemeal, with
    trace-time values baked in (the static inputs' _version: written arguments were then
    never copied back). Made lazily: ``torch.compiler.disable`` imports Dynamo (and Inductor,
    sympy, triton), about 1.4 s, which ``import autograph`` must not pay; a process that gets
    here is running Dynamo already.
    """
    global _outside_dynamo_call
    if _outside_dynamo_call is None:
        _outside_dynamo_call = torch.compiler.disable(Engine.route)
    return _outside_dynamo_call
