"""Which output dims follow the batch, from one run of the function on fake tensors whose batch
dim is a symbol: evidence at a second size without running the function at that size.

>>> shapes_at = symbolic_shapes(step, args, kwargs, {0: 0}, bucket=4)   # args[0] padded at dim 0
>>> shapes_at(9)       # the output leaves step would give at 9 rows (meta tensors, numbers)

A key with per-bucket state (one StaticCache per bucket) runs only at its bucket's size, so
one run cannot tell a dim that follows the batch from one that equals the bucket by chance (a
hidden size of 4). torch's fake tensors run the function without computing, with the size of
each padded argument's batch dim a symbol of the ``ShapeEnv`` (not duck-sized: a dim of the
same size is another symbol). Every other tensor the run meets is made fake, its dims of the
bucket's size symbols too: an op that ties one to the batch (a cache's rows, by
``index_copy_``) unifies the two, and one that ties it to a constant (4 heads) makes it that
constant. An output dim whose expression is the batch's symbol follows the batch; a constant
does not. A symbol left free tells nothing: of a tensor the arguments hold (a cache of 4 rows,
or a weight in a plain object) it may be the bucket's size in every bucket or always 4, so an
output that shows one gives no evidence; of a tensor met on first use (a module's weight, a
closure: the same in every bucket) it is a constant.

The evidence holds only where the run's guards hold: if the batch's symbol was specialised
(a Python read of a real tensor's size compared with it), tied to a weight's size, an output
is a value read from the data (``.item()``), or no second size meets the guards, there is
none (``None``) and the key waits for a real run at another size, as before. The run takes the
capture's path through capture-aware code (``as_if_capturing``: transformers reads no prompt
offset on the host while a stream captures), since its outputs are to be the graph's. It executes
the function's Python once more, as a warmup does: the state its writes reach is put back
and what holds a fake value after it is found and said (``_fake_state``), so that nothing of
the run stays. The tensors it meets are not written (fake), the Python state it reaches and
the random generators are restored after it (``kept``, the caller's), and it runs outside the
caller's dispatch modes (a watched warmup's observers would see fake tensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..backends._as_if_capturing import as_if_capturing
from ._fake_state import QuietLogs, WritesKept, left_behind

Tensor = torch.Tensor

# What a symbol is of: a padded argument's batch dim, a tensor the arguments hold (per-bucket
# state or not: unknown), or a tensor met on first use (the same in every bucket).
BATCH, HELD, FIXED = "batch", "held", "fixed"


@dataclasses.dataclass
class FakeRun:
    """What a run on fake tensors gives: the outputs as a function of the batch size
    (``shapes_at(size)``: the output leaves at that size, or None where the run's guards do not
    hold there; ``shapes_at`` None where the run showed nothing of other sizes), and ``left``:
    where it left fake values that nothing put back (``left_behind``), each said in words."""

    shapes_at: Optional[Callable[[int], Optional[List[Any]]]]
    left: List[str]


def symbolic_shapes(
    call: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    padded: Sequence[Tuple[Tensor, int]],
    bucket: int,
    kept: ContextManager[Any] = contextlib.nullcontext(),
) -> FakeRun:
    """The outputs of ``call(*args, **kwargs)`` as a function of the batch size.

    ``padded``: the padded tensors among the arguments (wherever they are: a dataclass's
    field too), each with its batch dim, of ``bucket`` rows. ``kept``: the caller's own
    putting back of the state the call reaches, around the run; whatever still holds a fake
    value after it is ``FakeRun.left``."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv(duck_shape=False)
    with kept:
        shapes_at, leaves = _run(shape_env, call, args, kwargs, padded, bucket)
    return FakeRun(shapes_at, left_behind(shape_env, leaves))


def _run(
    shape_env: Any,
    call: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    padded: Sequence[Tuple[Tensor, int]],
    bucket: int,
) -> Tuple[Optional[Callable[[int], Optional[List[Any]]]], List[Any]]:
    """The run itself, ``shapes_at`` and the output leaves it keeps; every fake value it made
    that nothing outside holds dies with its frame."""
    # Private torch APIs (docs/design.md, "Private torch APIs"): fake tensors, symbolic
    # shapes and the mode stack are what torch.compile traces with.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    fakes = _Fakes(FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True), bucket)
    for tensor, dim in padded:
        fakes.of(tensor, BATCH, dim)
    swapped = _SwappedTensors(fakes)
    with _disable_current_modes(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the function's own warnings: this is not its call
        fake_args, fake_kwargs = tree_map_only(Tensor, swapped.held, (args, kwargs))
        try:
            for leaf in tree_flatten((args, kwargs))[0]:
                swapped.walk(leaf, _DEPTH)
            with as_if_capturing(), WritesKept(), QuietLogs(), fakes.mode, _FakeOnFirstUse(fakes):
                outputs = call(*fake_args, **fake_kwargs)
        except Exception:  # noqa: BLE001 - a host read, an op without a fake kernel: no evidence
            return None, []
        finally:
            swapped.restore()
            # A traceback the function kept (logged with exc_info) keeps this frame: then it
            # holds no fake tensor of the arguments' (``left_behind`` would find them).
            fakes.made.clear()
            fakes.reals.clear()
    leaves = [_recipe(leaf) for leaf in tree_flatten(outputs)[0]]
    return _of_the_batch(shape_env, fakes, leaves), [w for kind, w in leaves if kind == "other"]


def _recipe(leaf: Any) -> Tuple[str, Any]:
    """An output leaf without its fake values: ("tensor", its sizes as expressions or ints),
    (the type's name, the expression) for a symbolic number, or ("other", the leaf)."""
    if isinstance(leaf, Tensor):
        return ("tensor", [d.node.expr if isinstance(d, torch.SymInt) else d for d in leaf.shape])
    for kind in (torch.SymInt, torch.SymFloat, torch.SymBool):
        if isinstance(leaf, kind):
            return (kind.__name__, leaf.node.expr)
    return ("other", leaf)


def _of_the_batch(
    shape_env: Any, fakes: "_Fakes", output_leaves: List[Tuple[str, Any]]
) -> Optional[Callable[[int], Optional[List[Any]]]]:
    """The fake run's outputs (``_recipe``s) as a function of the batch size, or None where its
    guards, replacements and free symbols show nothing of other sizes."""
    # torch's own dependency (its symbolic shapes are sympy expressions), imported only here:
    # importing it after torch took 0.29 s on the development CPU, which `import autograph` skips
    from sympy import sympify

    canonical = {
        kind: {shape_env.replace(s) for s in symbols} for kind, symbols in fakes.symbols.items()
    }
    if len(canonical[BATCH]) != 1:
        return None  # the padded arguments' batch dims not tied into one
    batch = next(iter(canonical[BATCH]))
    if not batch.is_Symbol or batch in canonical[FIXED]:
        return None  # specialised (only the bucket's size shows), or a weight's size
    unknown = {s for s in canonical[HELD] if s.is_Symbol and s != batch} - canonical[FIXED]
    # The sizes of the bucket's run (``var_to_val`` before torch 2.12).
    hints = dict(getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val)
    expressions = [
        sympify(shape_env.replace(e)) for leaf in output_leaves for e in _expressions(leaf)
    ]
    if any(e.free_symbols & unknown or e.free_symbols - hints.keys() for e in expressions):
        return None  # a size of held state left free, or a value read from the data
    guards = [shape_env.replace(guard.expr) for guard in shape_env.guards]

    def evaluate(expression: Any, size: int) -> Any:
        # (a lone symbol's xreplace is its replacement as given: a Python int)
        value = sympify(sympify(shape_env.replace(expression)).xreplace({**hints, batch: size}))
        if value.free_symbols:
            raise _NoEvidence
        return value

    def shapes_at(size: int) -> Optional[List[Any]]:
        try:
            if not all(bool(evaluate(guard, size)) for guard in guards):
                return None
            return [_at(leaf, evaluate, size) for leaf in output_leaves]
        except (_NoEvidence, TypeError, ValueError):
            return None

    return shapes_at


class _NoEvidence(Exception):
    """An expression that is no number once the sizes are given."""


def _expressions(leaf: Tuple[str, Any]) -> List[Any]:
    kind, what = leaf
    if kind == "tensor":
        return [d for d in what if not isinstance(d, int)]
    return [] if kind == "other" else [what]


# How deep the objects an argument holds (a cache, its layers, their tensors) are searched.
_DEPTH = 4


class _Fakes:
    """One fake tensor per real one: a padded argument's batch dim a symbol, and every other
    dim of the bucket's size a symbol of its own, noted by what it is of."""

    def __init__(self, mode: Any, bucket: int):
        self.mode = mode
        self.bucket = bucket
        self.made: Dict[int, Tuple[Tensor, Tensor]] = {}  # id(real): (real, fake)
        self.reals: Dict[int, Tensor] = {}  # id(fake): real
        self.symbols: Dict[str, List[Any]] = {BATCH: [], HELD: [], FIXED: []}

    def of(self, tensor: Tensor, kind: str, batch_dim: Optional[int] = None) -> Tensor:
        made = self.made.get(id(tensor))
        if made is not None:
            return made[1]
        if tensor.layout is not torch.strided:
            return tensor
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

        if batch_dim is not None:
            dims = {batch_dim}
        else:
            dims = {d for d, size in enumerate(tensor.shape) if size == self.bucket}
        context = StatelessSymbolicContext(
            dynamic_sizes=[
                DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(tensor.dim())
            ]
        )
        fake = self.mode.from_tensor(tensor, symbolic_context=context)
        self.made[id(tensor)] = (tensor, fake)
        self.reals[id(fake)] = tensor
        self.symbols[kind] += [fake.shape[d].node.expr for d in dims]
        return fake


class _SwappedTensors:
    """The tensors the arguments hold, as fakes: those the arguments' objects hold (a
    StaticCache's layers' keys and values) swapped in their places while the function runs,
    since Python code reads their sizes (HF's ``repeat_kv``), and a real size there would tie
    the batch to the bucket's. Their places: list items, dict values, attributes (``__dict__``
    or ``__slots__``), and tuples of tensors in any of those (rebuilt, as tuples are
    immutable)."""

    def __init__(self, fakes: _Fakes):
        self.fakes = fakes
        self.containers: List[Any] = []  # where fakes were put, to put the reals back
        self.tuples: List[Tuple[Any, Any, tuple, tuple]] = []  # (container, key, real, fake)
        self.seen: Set[int] = set()

    def held(self, tensor: Tensor) -> Tensor:
        return self.fakes.of(tensor, HELD)

    def walk(self, value: Any, depth: int) -> None:
        if depth == 0 or id(value) in self.seen or isinstance(value, _ATOMS):
            return
        self.seen.add(id(value))
        container = _container(value)
        if container is None:
            return
        items = list(enumerate(container) if isinstance(container, list) else container.items())
        swapped = False
        for key, item in items:
            if _swappable(item):
                container[key] = self.held(item)
                swapped = True
            elif type(item) is tuple or _is_namedtuple(item):
                self._walk_tuple(container, key, item, depth)
            elif not isinstance(item, Tensor):  # (a parameter stays real)
                self.walk(item, depth - 1)
        if swapped:
            self.containers.append(container)

    def _walk_tuple(self, container: Any, key: Any, item: tuple, depth: int) -> None:
        fakes = tuple(self.held(part) if _swappable(part) else part for part in item)
        for part in item:
            if not isinstance(part, Tensor):
                self.walk(part, depth - 1)
        if any(f is not r for f, r in zip(fakes, item)):
            fake = type(item)(*fakes) if _is_namedtuple(item) else fakes
            container[key] = fake
            self.tuples.append((container, key, item, fake))

    def restore(self) -> None:
        """Every fake put back as its real tensor, wherever the run moved it in its container;
        a tuple rebuilt with fakes, as it was (or, rebound by the run, rebuilt with reals)."""
        reals = self.fakes.reals
        for container in self.containers:
            places = range(len(container)) if isinstance(container, list) else list(container)
            for key in places:
                real = reals.get(id(container[key]))
                if real is not None:
                    container[key] = real
        for container, key, real, fake in reversed(self.tuples):
            now = container[key]
            if now is fake:
                container[key] = real
            elif isinstance(now, tuple) and any(id(part) in reals for part in now):
                parts = [reals.get(id(part), part) for part in now]
                container[key] = type(now)(*parts) if _is_namedtuple(now) else tuple(parts)
        self.containers.clear()
        self.tuples.clear()


def _swappable(value: Any) -> bool:
    return isinstance(value, Tensor) and not isinstance(value, torch.nn.Parameter)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _slot_names(cls: type) -> Tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


class _Slots:
    """An object's ``__slots__`` as a container: its set slots by name."""

    def __init__(self, owner: Any, names: List[str]):
        self.owner, self.names = owner, names

    def items(self) -> List[Tuple[str, Any]]:
        return [(name, getattr(self.owner, name)) for name in self.names]

    def __iter__(self) -> Any:
        return iter(self.names)

    def __getitem__(self, name: str) -> Any:
        return getattr(self.owner, name)

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.owner, name, value)


def _container(value: Any) -> Any:
    """Where ``value`` keeps what it holds: itself (a list, a dict), its ``__dict__``, its
    ``__slots__``, or None."""
    if isinstance(value, (list, dict)):
        return value
    if isinstance(value, type):
        return None
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return attributes
    names = [
        name
        for cls in type(value).__mro__
        for name in _slot_names(cls)
        if name not in ("__dict__", "__weakref__") and hasattr(value, name)
    ]
    return _Slots(value, names) if names else None


_ATOMS = (str, bytes, int, float, bool, complex, type(None), Tensor, torch.nn.Module)


class _FakeOnFirstUse(torch.utils._python_dispatch.TorchDispatchMode):
    """Makes each real tensor an op meets fake: weights, buffers, closures (what no argument
    holds, the same in every bucket)."""

    def __init__(self, fakes: _Fakes):
        super().__init__()
        self.fakes = fakes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        from torch._subclasses.fake_tensor import FakeTensor

        def fake(tensor: Tensor) -> Tensor:
            return tensor if isinstance(tensor, FakeTensor) else self.fakes.of(tensor, FIXED)

        args, kwargs = tree_map_only(Tensor, fake, (args, kwargs or {}))
        return func(*args, **kwargs)


def _at(leaf: Tuple[str, Any], evaluate: Callable[[Any, int], Any], size: int) -> Any:
    """One output leaf (its ``_recipe``) as a run at ``size`` would give it: a meta tensor of
    its shape, a number, or the leaf itself."""
    kind, what = leaf
    if kind == "tensor":
        shape = [d if isinstance(d, int) else int(evaluate(d, size)) for d in what]
        return torch.empty(shape, device="meta")
    if kind == "other":
        return what
    return {"SymInt": int, "SymFloat": float, "SymBool": bool}[kind](evaluate(what, size))
