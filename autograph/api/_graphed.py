"""``@autograph.graphed``: the public wrappers around an engine (docs/design.md, "A call's life").

>>> @autograph.graphed
... def step(x, w):
...     return torch.relu(x @ w).sum(-1)
>>> model = autograph.graphed(model)       # an nn.Module: its forward, on this instance

Functions and methods are wrapped with ``wrapt``: the wrapper looks like the function (name,
docstring, signature) and binds like it (methods get graphs per instance, held weakly;
``staticmethod`` and ``classmethod`` bind as they would). A module gets a ``GraphedForward``
as its instance's ``forward``: it graphs whatever ``module.forward`` was on that instance (the
class's method, a forward set on the instance, a compiled module's forward).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import threading
import weakref
from types import MethodType
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar, Union, cast, overload

import torch
import wrapt

from .. import _config
from .._config import Options, check_option_names, check_static_arguments
from .._scope import thread
from .._stats import KeyStats
from ..buckets._suggest import BucketSuggestion, suggest
from ..engine._engine import Engine, _dynamo_callback, _is_compiling
from ._ahead import capture_ahead
from ._plan_file import Path, save_plan
from ._warm_restart import capture_from_plan

F = TypeVar("F", bound=Callable[..., Any])


class GraphedFunction(wrapt.FunctionWrapper):
    """A function whose calls are graphed; see ``autograph.graphed``.

    It behaves as the wrapped function and adds ``stats()`` and ``reset()``. On a class it
    binds like a method, with separate graphs per instance.
    """

    def __init__(self, fn: Callable, options: Dict[str, Any]):
        function = getattr(fn, "__func__", fn)  # a staticmethod's or classmethod's function
        name = getattr(function, "__qualname__", None) or repr(fn)
        engine = Engine(function, options, name, per_instance=True)
        super().__init__(fn, engine)
        self._self_engine = engine

    def capture(self, *args: Any, plan: Optional[Path] = None, **kwargs: Any) -> List[KeyStats]:
        """Warm up and capture ahead of time, for this example call's keys, or for every key
        of a plan file that ``save_plan`` wrote.

        >>> step.capture(torch.zeros(8, 512, device="cuda"), w)   # buckets: every size
        >>> step.capture(plan="step.plan.json", cache=autograph.per_bucket(caches))

        With ``buckets``, every size is captured, largest first, into the function's one pool
        (the example is cut or padded to each size). The warmup runs the function for real
        and then its effects are undone (arguments, tensors it writes by address such as a
        KV cache, module buffers, random generators), and capturing runs nothing: the caller's
        state is as before. Returns the stats of the keys captured.

        With ``plan=path`` (and no example), the keys the plan lists are captured, each from
        its recorded call: keyword arguments give, by argument name, what the plan cannot
        hold (an object keyed by identity, a tensor used by address; ``autograph.per_bucket``
        for one per bucket). ``ValueError`` for a plan from another torch or GPU, other
        options that shape keys, or an object missing. An argument of the function named
        ``plan`` is given to ``capture`` positionally.
        """
        if plan is not None:
            _no_example(self._self_engine.name, args)
            return capture_from_plan(self._self_engine, self.__wrapped__, None, plan, kwargs)
        return capture_ahead(self._self_engine, self.__wrapped__, None, args, kwargs)

    def save_plan(self, path: Path) -> int:
        """Write the keys this function captured to a plan file; return how many it lists.

        >>> step.save_plan("step.plan.json")     # then, in a new process:
        >>> step.capture(plan="step.plan.json", cache=autograph.per_bucket(caches))

        The file is JSON: torch's version, the GPU's name, the options that shape keys and,
        per graphed key, its call's shapes, dtypes, plain values, bucket and modes (no
        tensor's values; what is passed by identity or address by its argument's name).
        Keys that are not graphed are left out. A method's keys are its instance's: save and
        load them through the bound method (``server.step.save_plan(path)``).
        """
        engine = self._self_engine
        return save_plan(engine.name, engine.options, engine.cache, path)

    def stats(self) -> List[KeyStats]:
        """Snapshots of this function's keys (every instance's, for a method)."""
        return self._self_engine.stats()

    def reset(self) -> None:
        """Drop this function's graphs and give their memory back; later calls start over."""
        self._self_engine.reset()

    def suggest_buckets(self, max_graphs: int) -> BucketSuggestion:
        """The capture sizes, at most ``max_graphs``, that would have padded the fewest rows
        for the batch sizes this function's bucketed calls had; with the padding share.

        >>> step.suggest_buckets(max_graphs=4).buckets     # e.g. [3, 8, 17, 32]
        """
        return suggest(
            self.stats(),
            self._self_engine.options.buckets or (),
            max_graphs,
            self._self_engine.name,
        )

    def __copy__(self) -> "GraphedFunction":
        """The same function graphed anew, with the same options and no graphs.

        >>> step_copy = copy.deepcopy(step)       # its first calls warm up and capture anew

        Graphs are never shared or copied: a copy (``copy.copy`` or ``copy.deepcopy``, of the
        function or of what holds it) captures its own, and the original keeps its own."""
        return type(self)(self.__wrapped__, dict(self._self_engine.explicit))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "GraphedFunction":
        return self.__copy__()  # a function is copied as itself, as copy.deepcopy does


class BoundGraphedFunction(wrapt.BoundFunctionWrapper):
    """A graphed method bound to an instance (made by wrapt on attribute access)."""

    def capture(self, *args: Any, plan: Optional[Path] = None, **kwargs: Any) -> List[KeyStats]:
        """``GraphedFunction.capture`` for this instance's graphs."""
        engine, instance = self._self_parent._self_engine, self._self_instance
        if plan is not None:
            _no_example(engine.name, args)
            return capture_from_plan(engine, self.__wrapped__, instance, plan, kwargs)
        return capture_ahead(engine, self.__wrapped__, instance, args, kwargs)

    def save_plan(self, path: Path) -> int:
        """``GraphedFunction.save_plan`` for this instance's graphs."""
        engine, instance = self._self_parent._self_engine, self._self_instance
        cache = engine.cache_for(instance) if engine.per_instance else engine.cache
        return save_plan(engine.name, engine.options, cache, path)

    def stats(self) -> List[KeyStats]:
        return self._self_parent.stats()

    def reset(self) -> None:
        self._self_parent.reset()

    def suggest_buckets(self, max_graphs: int) -> BucketSuggestion:
        return self._self_parent.suggest_buckets(max_graphs)


# wrapt reads the bound wrapper's class from this attribute (it has no constructor argument).
GraphedFunction.__bound_function_wrapper__ = BoundGraphedFunction  # type: ignore[misc]


class _GraphedPlainFunction(GraphedFunction):
    """A graphed plain function: called directly, it goes straight to its engine.

    wrapt's general call (which also serves classmethods, staticmethods and builtins) costs
    about 0.3 us more per call than this one Python call; through a class or an instance the
    function still binds through wrapt, as a method."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _config.ENV.disable or thread.off:  # the bare call, one frame over it
            return self.__wrapped__(*args, **kwargs)
        if _is_compiling() or _dynamo_callback() is not None:
            return self._self_engine(self.__wrapped__, None, args, kwargs)  # Dynamo's cases
        # Engine.__call__'s checks passed: straight to the route, a frame less on every call.
        return self._self_engine.route(self.__wrapped__, None, args, kwargs)


def _no_example(name: str, args: tuple) -> None:
    if args:
        raise TypeError(
            f"{name}.capture(plan=...) takes no example call: the plan's records are the "
            f"examples; pass only the objects it cannot hold, by argument name."
        )


_numbers: Dict[str, "itertools.count[int]"] = {}
_numbers_lock = threading.Lock()


def module_label(module: torch.nn.Module) -> str:
    """``Linear`` for the first module of a class that is graphed, then ``Linear#2``, ..."""
    name = type(module).__name__
    with _numbers_lock:
        number = next(_numbers.setdefault(name, itertools.count(1)))
    return name if number == 1 else f"{name}#{number}"


def forward_signature(module: torch.nn.Module) -> Callable:
    """The forward whose parameters name a module call's arguments (a compiled module's
    own forward only takes ``*args``)."""
    return getattr(module, "_orig_mod", module).forward


class GraphedForward:
    """A module's forward, graphed; installed as ``module.forward`` by ``autograph.graphed``.

    >>> model = autograph.graphed(model)
    >>> model.forward.stats()        # or autograph.stats(model)
    """

    __slots__ = ("_self_engine", "_self_module", "_self_function", "_self_bound", "__weakref__")

    def __init__(self, module: torch.nn.Module, forward: Callable, options: Dict[str, Any]):
        self._self_module = weakref.ref(module)
        # A forward bound to this module is kept unbound, so that the module (which holds
        # this object) is not held by it in a cycle.
        self._self_bound = getattr(forward, "__self__", None) is module
        self._self_function = cast(MethodType, forward).__func__ if self._self_bound else forward
        self._self_engine = Engine(
            self._self_function,
            options,
            module_label(module),
            signature_of=forward_signature(module),
            instance_label=type(module).__name__,
        )

    def _bound(self) -> tuple:
        module = self._self_module()
        if module is None:
            raise ReferenceError(f"{self._self_engine.name}: its module no longer exists")
        if self._self_bound:
            return self._self_function.__get__(module), module
        return self._self_function, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _config.ENV.disable or thread.off or _is_compiling():
            # Disabled (everywhere, or in this region), or inside a compiled model: the
            # plainest call (for Dynamo, the simplest to trace), without a bound method made
            # or the engine, which would step aside anyway.
            if self._self_bound:
                return self._self_function(self._self_module(), *args, **kwargs)
            return self._self_function(*args, **kwargs)
        forward, module = self._bound()
        if _dynamo_callback() is not None:
            return self._self_engine(forward, module, args, kwargs)
        return self._self_engine.route(forward, module, args, kwargs)  # a frame less

    @property
    def __wrapped__(self) -> Callable:
        return self._bound()[0]

    def __repr__(self) -> str:
        return f"<graphed forward of {self._self_engine.name}>"

    def capture(self, *args: Any, plan: Optional[Path] = None, **kwargs: Any) -> List[KeyStats]:
        """Warm up and capture ahead of time; see ``GraphedFunction.capture``.

        >>> model.forward.capture(ids, past_key_values=cache)
        >>> model.forward.capture(plan="model.plan.json", past_key_values=cache)
        """
        forward, module = self._bound()
        if plan is not None:
            _no_example(self._self_engine.name, args)
            return capture_from_plan(self._self_engine, forward, module, plan, kwargs)
        return capture_ahead(self._self_engine, forward, module, args, kwargs)

    def save_plan(self, path: Path) -> int:
        """Write this module's captured keys to a plan file; see ``GraphedFunction.save_plan``.

        >>> model.forward.save_plan("model.plan.json")
        """
        engine = self._self_engine
        return save_plan(engine.name, engine.options, engine.cache, path)

    def stats(self) -> List[KeyStats]:
        """Snapshots of this module's keys."""
        return self._self_engine.stats()

    def reset(self) -> None:
        """Drop this module's graphs and give their memory back."""
        self._self_engine.reset()

    def suggest_buckets(self, max_graphs: int) -> BucketSuggestion:
        """See ``GraphedFunction.suggest_buckets``: from this module's bucketed calls."""
        return suggest(
            self.stats(),
            self._self_engine.options.buckets or (),
            max_graphs,
            self._self_engine.name,
        )

    def __deepcopy__(self, memo: Dict[int, Any]) -> "GraphedForward":
        """The forward of a module's deep copy (an EMA model), graphed anew: same options,
        no graphs; its first calls warm up and capture on the copy's own parameters.

        >>> ema = copy.deepcopy(model)            # model = autograph.graphed(model)
        """
        module = self._self_module()
        if module is None:
            raise ReferenceError(f"{self._self_engine.name}: its module no longer exists")
        copied = memo.get(id(module))
        if copied is None:  # this forward copied alone: copy its module, which holds it
            copied = copy.deepcopy(module, memo)
            return memo.get(id(self)) or installed_forward(copied)
        forward = (
            self._self_function.__get__(copied)
            if self._self_bound
            else copy.deepcopy(self._self_function, memo)
        )
        return GraphedForward(copied, forward, dict(self._self_engine.explicit))

    def __reduce__(self) -> tuple:
        """Pickled (``torch.save(model)``) as ``deepcopy`` copies it: the options, no graphs;
        the loaded module graphs anew. Unpickling may meet the module before its state is
        set: only its class is read then."""
        module = self._self_module()
        if module is None:
            raise ReferenceError(f"{self._self_engine.name}: its module no longer exists")
        bound_to_class = (
            self._self_bound and getattr(type(module), "forward", None) is self._self_function
        )
        return _forward_again, (
            module,
            None if bound_to_class else self.__wrapped__,
            dict(self._self_engine.explicit),
        )


def _forward_again(
    module: torch.nn.Module, function: Optional[Callable], options: Dict[str, Any]
) -> "GraphedForward":
    """A pickled module's forward, graphed anew on the loaded module (``__reduce__``)."""
    forward = type(module).forward.__get__(module) if function is None else function
    return GraphedForward(module, forward, options)


def installed_forward(module: torch.nn.Module) -> Any:
    """The forward set on this instance (a ``GraphedForward``), or None."""
    return vars(module).get("forward")


def _graph_module(module: torch.nn.Module, options: Dict[str, Any]) -> torch.nn.Module:
    existing = installed_forward(module)
    if isinstance(existing, GraphedForward):
        existing.reset()
        forward = existing.__wrapped__  # graphed again, with the new options
    else:
        forward = module.forward  # what nn.Module.__call__ would run on this instance
    # An instance attribute: nn.Module.__call__ finds it first; the module stays itself.
    check_static_arguments(
        Options(**options),
        forward_signature(module),
        f"{type(module).__name__}.forward",
        bound=False,
    )
    # On the instance itself: a traced module's __setattr__ would set it on the script
    # module inside, where stats(module) and regions would not find it.
    graphed_forward = GraphedForward(module, forward, options)
    torch.nn.Module.__setattr__(module, "forward", graphed_forward)  # type: ignore[arg-type]
    return module


def _binds_first(fn: Any) -> bool:
    """Whether a graphed function's first parameter will be bound (``self``, ``cls``): a
    classmethod's is, and so is a function defined in a class body (``Model.step``)."""
    if isinstance(fn, (staticmethod, classmethod)):
        return isinstance(fn, classmethod)
    scope = getattr(fn, "__qualname__", "").split(".")[:-1]
    return bool(scope) and scope[-1] != "<locals>"


def _refuse_generators(fn: Callable) -> None:
    function = getattr(fn, "__func__", fn)
    for check, kind in (
        (inspect.isgeneratorfunction, "a generator function"),
        (inspect.iscoroutinefunction, "an async function"),
        (inspect.isasyncgenfunction, "an async generator function"),
    ):
        if check(function):
            raise TypeError(
                f"autograph.graphed: {getattr(function, '__qualname__', fn)} is {kind}; a "
                f"graph replays GPU work, not Python, so its later calls would hand back the "
                f"capture's {'coroutine' if 'async' in kind else 'generator'}. Graph the "
                f"function it calls for each step instead."
            )


@overload
def graphed(fn: F) -> F: ...


@overload
def graphed(
    *,
    warmup: int = ...,
    outputs: str = ...,
    max_graphs: int = ...,
    strict: Optional[bool] = ...,
    buckets: Optional[Sequence[int]] = ...,
    bucket_args: Optional[Dict[str, Any]] = ...,
    static_argnames: Sequence[str] = ...,
    static_argnums: Sequence[int] = ...,
    bucket_outputs: Any = ...,
    verify: Optional[int] = ...,
    islands: bool = ...,
    check_payoff: bool = ...,
    max_graph_memory: Optional[Union[int, str]] = ...,
) -> Callable[[F], F]: ...


def graphed(fn: Any = None, /, **options: Any) -> Any:
    """Graph a function, a method or an ``nn.Module``: capture once per key, then replay.

    >>> @autograph.graphed
    ... def step(x, w):
    ...     return torch.relu(x @ w).sum(-1)
    >>> @autograph.graphed(warmup=2, outputs="static")
    ... def decode(ids, pos): ...
    >>> model = autograph.graphed(model)      # same module; its forward is graphed
    >>> serve = autograph.graphed(decode, buckets=[1, 2, 4, 8], max_graph_memory="512MiB")

    Options, all keyword-only (docs/guide/options.md has the details):

    - ``warmup=1``: eager calls of each new key before it is captured (>= 1).
    - ``outputs="copy"``: the caller owns the outputs; ``"static"`` returns the graph's own
      buffers, valid until the next call of a graph of the same function, and reading a
      stale one raises.
    - ``max_graphs=16``: graphs per function (per instance, for methods); keys past it run
      eagerly, said once. Keys that never got a graph do not count.
    - ``max_graph_memory=None``: bytes, or a string such as ``"512MiB"``, that the graphs of
      the function (or region) may hold; past it the least recently replayed graphs are
      dropped first.
    - ``strict``: raise ``autograph.CaptureError`` instead of running a key eagerly; the
      default comes from ``AUTOGRAPH_STRICT``.
    - ``buckets=[1, 2, 4, ...]``: capture sizes for a dynamic dimension; a call of size B
      replays the graph of the smallest bucket >= B, padded, its outputs sliced back to B.
    - ``bucket_args={"ids": 0, "mask": (0, pad_value)}``: which arguments are padded, along
      which dim, with which value (default: dim 0 of every tensor whose dim 0 is the call's
      size, padded with zeros).
    - ``bucket_outputs=0`` (or one entry per output: an int, a tuple of ints, or ``None`` for
      an output returned whole): the output dims that follow the batch and are sliced back,
      checked against every run; without it they are found from runs at two sizes.
    - ``static_argnames`` / ``static_argnums``: tensors used by address (a KV cache), never
      copied in or out; a new address is a new key.
    - ``verify``: the first n replays of each key are checked against an eager run of the
      same call; the default comes from ``AUTOGRAPH_VERIFY``.
    - ``islands=True``: a key that runs eagerly still graphs the top-level module calls it
      makes, as a region would.
    - ``check_payoff=True``: on CUDA, a key's first calls after capture time its replay
      against its eager run, and a graph that does not beat eager is dropped, said once.

    Options set here win over those of an enclosing ``autograph.region``.
    """
    check_option_names(options, "autograph.graphed")
    Options(**options)  # validate now, not at the first call
    if fn is None:
        return lambda f: _graph(f, options)
    return _graph(fn, options)


def _graph(fn: Any, options: Dict[str, Any]) -> Any:
    if isinstance(fn, torch.nn.Module):
        return _graph_module(fn, options)
    if not callable(fn) and not isinstance(fn, (staticmethod, classmethod)):
        raise TypeError(
            f"autograph.graphed expects a function, a method or an nn.Module, "
            f"not {type(fn).__name__} ({fn!r})."
        )
    _refuse_generators(fn)
    function = getattr(fn, "__func__", fn)
    check_static_arguments(
        Options(**options),
        function,
        getattr(function, "__qualname__", repr(fn)),
        bound=_binds_first(fn),
    )
    if inspect.isfunction(fn):
        return _GraphedPlainFunction(fn, options)
    return GraphedFunction(fn, options)
