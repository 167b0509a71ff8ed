"""``with autograph.region():`` graphs the top-level module calls inside it.

>>> with autograph.region():
...     logits = model(ids)          # graphed as autograph.graphed(model) would graph it
>>> with autograph.region(enabled=False):
...     logits = model(ids)          # everything inside runs eagerly, decorated functions too

A region is a per-thread scope of options and a pool owner. While one is open anywhere,
``nn.Module.__call__`` is replaced by a thin dispatcher that, in a thread with an open region,
sends a module call made outside any other graphed call through that module's own engine;
every other call goes to the original. The original is put back when the last region closes,
so torch's global state is as before. Graphs stay with their module (held weakly) for the
next region; graphs captured in one region share one memory pool.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
import weakref
from typing import Any, Dict, List, Set

import torch
from torch.nn.modules import module as _torch_module

from .. import _config
from .._config import Options, check_option_names
from .._profile import torch_profiler
from .._scope import enter_region, leave_region, thread
from .._stats import KeyStats
from ..backends._pool import Pools
from ..engine._engine import Engine, _dynamo_callback, _is_compiling
from ..policy._islands import register as register_islands
from ._graphed import GraphedForward, forward_signature, installed_forward, module_label


@dataclasses.dataclass(frozen=True)
class RegionStats:
    """What one region did: counts of its calls, and snapshots of the keys it touched.

    ``passed_through`` counts the calls that ran as plain calls, unkeyed, because their
    function's keys churn (``report()`` has their row); they are among ``eager_calls``.
    """

    captures: int
    replays: int
    eager_calls: int
    keys: List[KeyStats]
    passed_through: int = 0


class Region:
    """A scope that graphs module calls and sets options; see ``autograph.region``."""

    def __init__(self, enabled: bool, explicit: Dict[str, Any], island: bool = False):
        self.enabled = enabled
        self.explicit = explicit
        self.island = island  # a key's island (``_islands``): its fallbacks are not warned
        self.idle_calls = 0  # an island's calls that made no module call (``_islands``)
        self.options_key = Options(**explicit)  # validated now, not at the first call
        self.pools = Pools()
        self.captures = self.replays = self.eager_calls = self.passed_through = 0
        # The keys its calls touched, held weakly: a region keeps no graph alive.
        self._touched: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._tallied: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._caches: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def note(self, life: Any, event: str, cache: Any = None) -> None:
        """A key's life tells the region of each event of a call made in it: ``captures``,
        ``replays`` or ``eager_calls``; and the cache that holds it, where the call knows."""
        with self._lock:
            setattr(self, event, getattr(self, event) + 1)
            if id(life) not in self._touched:
                self._touched[id(life)] = life
            if cache is not None and id(cache) not in self._caches:
                self._caches[id(cache)] = cache

    def release_keys(self) -> Set[int]:
        """Drop the keys its calls made or touched, graphs and all, from their caches (a
        key's island, when the key's function is reset); return their devices."""
        with self._lock:
            lives = {id(life) for life in self._touched.values()}
            caches = list(self._caches.values())
        return {device for cache in caches for device in cache.release_entries(lives)}

    def lives(self) -> List[Any]:
        """The keys its calls touched that are still alive (``max_graph_memory``'s scope)."""
        with self._lock:
            return list(self._touched.values())

    def note_tallied(self, engine: Any) -> None:
        """A call of ``engine`` that ran eagerly before being keyed (no CUDA, CPU tensors):
        counted here, its engine's tally rows in ``stats()``."""
        with self._lock:
            self.eager_calls += 1
            self._tallied[id(engine)] = engine

    def pass_through(self) -> None:
        """A call made in the region ran as a plain call: its function's keys churn."""
        with self._lock:
            self.eager_calls += 1
            self.passed_through += 1

    def stats(self) -> RegionStats:
        """Counts of this region's captures, replays and eager calls, and its keys' stats."""
        with self._lock:
            keys = [life.stats() for life in list(self._touched.values())]
            engines = list(self._tallied.values())
        keys += [row for engine in engines for row in engine.tally_rows()]
        return RegionStats(self.captures, self.replays, self.eager_calls, keys, self.passed_through)

    def __enter__(self) -> "Region":
        # A disabled region graphs no module call: it leaves nn.Module.__call__ as it is, so
        # that its module calls cost what they cost outside (an enabled region open around
        # or beside it has put the dispatcher in, which sends them to the original).
        if self.enabled:
            _install_module_call()
        enter_region(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            leave_region(self)
        finally:
            if self.enabled:
                _remove_module_call()  # torch's global state comes back even if that failed


register_islands(lambda options: Region(True, options, island=True))


def region(*, enabled: bool = True, **options: Any) -> Region:
    """A ``with`` block whose top-level ``nn.Module`` calls are graphed.

    >>> with autograph.region():
    ...     for step in range(n):
    ...         logits = model(ids, past_key_values=cache, cache_position=pos).logits
    >>> with autograph.region(outputs="static", warmup=2) as r:
    ...     ...
    >>> r.stats()

    Takes the options of ``autograph.graphed``; a graphed function's own options win over the
    region's, an inner region's over an outer one's. ``enabled=False`` runs everything inside
    eagerly, decorated functions included (``AUTOGRAPH_DISABLE=1`` beats every region).
    Regions are per thread: enter and leave one in the same thread.
    """
    check_option_names(options, "autograph.region")
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r}: it must be True or False.")
    return Region(enabled, options)


# ---- the module-call dispatcher ----

_patch_lock = threading.Lock()
_patch_users = 0
_original_call = torch.nn.Module.__call__
# Whether the __call__ a region replaced is torch's own (no other library patched it), whose
# body a nested call may then run inline (``_region_call``); torch >= 2.1 has it. Known by its
# code, compiled from torch's module file: a library may have replaced the function before
# autograph was imported, and a wrapper made with functools.wraps copies its names.
_torch_call_code = getattr(getattr(torch.nn.Module, "_wrapped_call_impl", None), "__code__", None)
if _torch_call_code is not None and _torch_call_code.co_filename != _torch_module.__file__:
    _torch_call_code = None
_torch_call_is_original = False
_module_engines: "weakref.WeakKeyDictionary[torch.nn.Module, Engine]" = weakref.WeakKeyDictionary()


def engine_of(module: torch.nn.Module) -> Any:
    """The engine a region made for this module, or None."""
    return _module_engines.get(module)


def _region_call(module: torch.nn.Module, /, *args: Any, **kwargs: Any) -> Any:
    # Dynamo first: the plain call, no guard on engines or on this thread's state.
    if _config.ENV.disable or _is_compiling():
        return _original_call(module, *args, **kwargs)
    if thread.depth:
        # A submodule's call inside a graphed or passed-through one (a hundred a token for a
        # Llama decoder, whose generate() in a region passes its calls through): one
        # thread-local read, and what torch's own __call__ does, in this frame instead of a
        # second one (0.44 us a call on a CPU, 2.5% of a token of a Llama of 8 layers). Not
        # while torch's profiler runs: with_stack finds module calls by that frame.
        if (
            _torch_call_is_original
            and not torch_profiler._is_profiler_enabled
            and module._compiled_call_impl is None
        ):
            return module._call_impl(*args, **kwargs)
        return _original_call(module, *args, **kwargs)
    if (
        not thread.regions
        or thread.off
        or isinstance(installed_forward(module), GraphedForward)  # graphs itself
        or _dynamo_callback() is not None  # run by compiled code: torch's ("_tell_dynamo")
    ):
        return _original_call(module, *args, **kwargs)
    engine = _module_engines.get(module)
    if engine is None:
        # Whole calls, hooks included, with the region's options.
        engine = _module_engines[module] = Engine(
            _class_forward(module),
            {},
            module_label(module),
            signature_of=forward_signature(module),
            instance_label=type(module).__name__,
            automatic=True,
        )
    # Engine.__call__'s checks were made above: straight to the route, a frame less a call.
    return engine.route(_original_call.__get__(module), module, args, kwargs)


def _class_forward(module: torch.nn.Module) -> Any:
    """The forward a module's class defines. A TorchScript module's is a descriptor that
    works only on an instance (``type(m).forward`` raises): the descriptor itself stands for
    it, as its compiled code reads no Python globals and its tensors are on the module."""
    try:
        return type(module).forward
    except AttributeError:
        return inspect.getattr_static(type(module), "forward")


def _install_module_call() -> None:
    global _patch_users, _original_call, _torch_call_is_original
    with _patch_lock:
        if _patch_users == 0:
            # The dispatcher may be there already: a library that saved it while a region was
            # open and put it back after. The call under it is then still the one saved last.
            if torch.nn.Module.__call__ is not _region_call:
                _original_call = torch.nn.Module.__call__
            _torch_call_is_original = (
                _torch_call_code is not None
                and getattr(_original_call, "__code__", None) is _torch_call_code
            )
            torch.nn.Module.__call__ = _region_call  # type: ignore[method-assign]
            _tell_dynamo(_original_call, _region_call)
            _keep_out_of_dynamos_frames()
        _patch_users += 1


def _remove_module_call() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            torch.nn.Module.__call__ = _original_call  # type: ignore[method-assign]
            _tell_dynamo(_region_call, _original_call)


def _tell_dynamo(was: Any, now: Any) -> None:
    """Have Dynamo take ``now`` for torch's own ``nn.Module.__call__`` where it took ``was``.

    Dynamo traces a module's call as a call of its forward (its hooks checked as it traces)
    only where ``__call__`` is the function it found at its import; through the dispatcher it
    traces torch's whole call of every submodule, each adding guards that every later call of
    the compiled code checks: transformers' compiled decode step (``generate()`` with a static
    cache) ran 0.92x as fast in a region as outside on an H100, with 43 us more of Dynamo's
    cache lookup a token. Under Dynamo the dispatcher is torch's call (``_region_call``
    steps aside), so Dynamo may take one for the other. Its own tracing must see the dispatcher
    all the same: code that names ``nn.Module.__call__`` (``super().__call__()``, transformers'
    decoder layers) is guarded on it. Dynamo imported while a region is open took the
    dispatcher at its import, and gets the original back when the last region closes. Dynamo is
    never imported for this (a second of start-up); without the private name, nothing is done.
    """
    dynamo_modules = sys.modules.get("torch._dynamo.variables.nn_module")
    if getattr(dynamo_modules, "unpatched_nn_module_call", None) is was:
        dynamo_modules.unpatched_nn_module_call = now  # type: ignore[union-attr]


def _keep_out_of_dynamos_frames() -> None:
    """Have Dynamo run the dispatcher's frame as written and compile the frames it calls.

    Where compiled code runs a module call eagerly (after a graph break, a module compiled on
    its own, transformers' compiled ``model.__call__`` made in a region), Dynamo compiled the
    dispatcher as the frame it starts from, as it would torch's call were it not in its skip
    list: every module type then took an entry of the one code object's cache, and past
    Dynamo's recompile limit (8) compiled code in a region ran uncompiled; and a module's full
    backward hooks were lost, so gradients came out wrong (torch does this to any function
    put in ``nn.Module.__call__``). Skipped, the dispatcher hands such a call to torch's call
    (it runs under Dynamo's frame hook), whose module's forward Dynamo compiles as it does
    outside a region. Only the frame is skipped: Dynamo still traces the dispatcher where it
    is inlined (a module with hooks, ``super().__call__()``). Set through torch's C extension
    (what ``torch._dynamo.eval_frame.skip_code`` calls), so that it holds from the first
    compile even where Dynamo is first imported inside a region (``torch.compile`` called
    there), and again at each first region, as ``torch._dynamo.reset()`` may forget it.
    """
    eval_frame = torch._C._dynamo.eval_frame
    try:
        skip = eval_frame._FrameExecStrategy(
            eval_frame._FrameAction.SKIP, eval_frame._FrameAction.DEFAULT
        )
    except AttributeError:  # a torch without it: Dynamo may start compiles at the dispatcher
        return
    eval_frame.set_code_exec_strategy(_region_call.__code__, skip)
