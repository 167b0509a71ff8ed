"""Which output dims follow the batch, from one run of the function on fake tensors whose batch
dim is a symbol: evidence at a second size without running the function at that size.

>>> shapes_at = symbolic_shapes(step, args, kwargs, {0: 0}, bucket=4)   # args[0] padded at dim 0
>>> shapes_at(9)       # the output leaves step would give at 9 rows (meta tensors, numbers)

A key with per-bucket state (one StaticCache per bucket) runs only at its bucket's size, so
one run cannot tell a dim that follows the batch from one that equals the bucket by chance (a
hidden size of 4). torch's fake tensors run the function without computing, with the size of
each padded argument's batch dim a symbol of the ``ShapeEnv`` (not duck-sized: a dim of the
same size is another symbol). Every other tensor the run meets (the cache, weights) is made
fake on first use, its dims of the bucket's size symbols too: an op that ties one to the batch
(the cache's rows) unifies the two, and one that does not (4 heads) stays its own. An output
dim whose expression is the batch's symbol follows the batch; a constant does not.

The evidence holds only where the run's guards hold: if the batch's symbol was specialised
(a Python read of a real tensor's size compared with it), or no second size meets the
guards, there is none (``None``) and the key waits for a real run at another size, as before.
Nothing of the run stays: the tensors it meets are not written (fake), the Python state it
reaches and the random generators are restored after it, and it runs outside the caller's
dispatch modes (a watched warmup's observers would see fake tensors).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

Tensor = torch.Tensor


def symbolic_shapes(
    call: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    batch_dims: Dict[int, int],
    addressed: Sequence[int],
    bucket: int,
) -> Optional[Callable[[int], Optional[List[Any]]]]:
    """The outputs of ``call(*args, **kwargs)`` as a function of the batch size, or None.

    ``batch_dims`` maps the position of a tensor among the flattened arguments to its batch
    dim (the padded ones); the arguments have ``bucket`` rows there. ``addressed``: the
    positions of the tensors used by address, per-bucket state like what the arguments'
    objects hold."""
    # Private torch APIs (docs/design.md, "Private torch APIs"): fake tensors, symbolic
    # shapes and the mode stack are what torch.compile traces with.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._python_dispatch import _disable_current_modes

    shape_env = ShapeEnv(duck_shape=False)
    fakes = _Fakes(FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True), bucket)
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    padded = {id(tensors[i]): dim for i, dim in batch_dims.items()}
    with _disable_current_modes(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the function's own warnings: this is not its call
        for i in addressed:
            fakes.of(tensors[i], per_bucket=True)
        fake_leaves = [
            fakes.of(leaf, padded.get(id(leaf))) if isinstance(leaf, Tensor) else leaf
            for leaf in leaves
        ]
        batch_symbols = [
            fakes.of(tensors[i], dim).shape[dim].node.expr for i, dim in batch_dims.items()
        ]
        fake_args, fake_kwargs = spec.unflatten(fake_leaves)
        swapped = _SwappedTensors(fakes)
        try:
            for leaf in leaves:
                swapped.walk(leaf, _DEPTH)
            with fakes.mode, _FakeOnFirstUse(fakes):
                outputs = call(*fake_args, **fake_kwargs)
        except Exception:  # noqa: BLE001 - a host read, an op without a fake kernel: no evidence
            return None
        finally:
            swapped.restore()
    return _of_the_batch(shape_env, fakes, batch_symbols, tree_flatten(outputs)[0])


def _of_the_batch(
    shape_env: Any, fakes: "_Fakes", batch_symbols: List[Any], output_leaves: List[Any]
) -> Optional[Callable[[int], Optional[List[Any]]]]:
    """The fake run's outputs as a function of the batch size, or None where its guards and
    replacements show nothing of other sizes."""
    batches = {shape_env.replace(symbol) for symbol in batch_symbols}
    if len(batches) != 1 or not next(iter(batches)).is_Symbol:
        return None  # specialised (the run only shows the bucket's size), or not one batch
    batch = batches.pop()
    # Per-bucket state has the bucket's size where no op tied it to another size: a run at
    # another size meets that size's state, as each bucket's runs meet their own. A size tied
    # to a weight's (a symbol of a tensor met on first use) stays that size.
    fixed = {shape_env.replace(symbol) for symbol in fakes.symbols[False]}
    if batch in fixed:
        return None  # the batch has a weight's size: no other size runs
    resized = {shape_env.replace(symbol) for symbol in fakes.symbols[True]} | {batch}
    resized = {symbol for symbol in resized if symbol.is_Symbol and symbol not in fixed}
    # The sizes of the bucket's run (``var_to_val`` before torch 2.12).
    hints = dict(getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val)
    guards = [guard.expr for guard in shape_env.guards]

    def evaluate(expression: Any, size: int) -> Any:
        return shape_env.replace(expression).xreplace(
            {**hints, **{symbol: size for symbol in resized}}
        )

    def shapes_at(size: int) -> Optional[List[Any]]:
        if not all(bool(evaluate(guard, size)) for guard in guards):
            return None
        return [_at(leaf, evaluate, size) for leaf in output_leaves]

    return shapes_at


# How deep the objects an argument holds (a cache, its layers, their tensors) are searched.
_DEPTH = 4


class _Fakes:
    """One fake tensor per real one: a padded argument's batch dim a symbol, and every other
    dim of the bucket's size a symbol of its own; those of per-bucket state noted."""

    def __init__(self, mode: Any, bucket: int):
        self.mode = mode
        self.bucket = bucket
        self.made: Dict[int, Tuple[Tensor, Tensor]] = {}  # id(real): (real, fake)
        # The symbols made, by whether they are of per-bucket state (or the batch's).
        self.symbols: Dict[bool, List[Any]] = {True: [], False: []}

    def of(
        self, tensor: Tensor, batch_dim: Optional[int] = None, per_bucket: bool = False
    ) -> Tensor:
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
        self.symbols[per_bucket or batch_dim is not None] += [fake.shape[d].node.expr for d in dims]
        return fake


class _SwappedTensors:
    """The tensors the arguments' objects hold (a StaticCache's layers' keys and values),
    swapped for their fakes while the function runs: Python code reads their sizes (HF's
    ``repeat_kv``), and a real size there would tie the batch to the bucket's."""

    def __init__(self, fakes: _Fakes):
        self.fakes = fakes
        self.undo: List[Tuple[Any, Any, Any]] = []  # (container, key, the real value)
        self.seen: Set[int] = set()

    def walk(self, value: Any, depth: int) -> None:
        if depth == 0 or id(value) in self.seen or isinstance(value, _ATOMS):
            return
        self.seen.add(id(value))
        if isinstance(value, list):
            places: Any = enumerate(value)
            container = value
        elif isinstance(value, dict):
            places, container = list(value.items()), value
        elif isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, type):
            places, container = list(vars(value).items()), vars(value)
        else:
            return
        for key, item in list(places):
            if isinstance(item, Tensor):
                if not isinstance(item, torch.nn.Parameter):
                    self.undo.append((container, key, item))
                    container[key] = self.fakes.of(item, per_bucket=True)
            else:
                self.walk(item, depth - 1)

    def restore(self) -> None:
        for container, key, real in reversed(self.undo):
            container[key] = real
        self.undo.clear()


_ATOMS = (str, bytes, int, float, bool, complex, type(None), Tensor, torch.nn.Module)


class _FakeOnFirstUse(torch.utils._python_dispatch.TorchDispatchMode):
    """Makes each real tensor an op meets fake (weights, buffers: what no argument holds)."""

    def __init__(self, fakes: _Fakes):
        super().__init__()
        self.fakes = fakes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        from torch._subclasses.fake_tensor import FakeTensor

        def fake(tensor: Tensor) -> Tensor:
            return tensor if isinstance(tensor, FakeTensor) else self.fakes.of(tensor)

        args, kwargs = tree_map_only(Tensor, fake, (args, kwargs or {}))
        return func(*args, **kwargs)


def _at(leaf: Any, evaluate: Callable[[Any, int], Any], size: int) -> Any:
    """One output leaf as a run at ``size`` would give it: a meta tensor of its shape, a
    number, or the leaf itself."""
    if isinstance(leaf, Tensor):
        shape = [
            int(evaluate(d.node.expr, size)) if isinstance(d, torch.SymInt) else d
            for d in leaf.shape
        ]
        return torch.empty(shape, device="meta")
    if isinstance(leaf, torch.SymInt):
        return int(evaluate(leaf.node.expr, size))
    if isinstance(leaf, torch.SymFloat):
        return float(evaluate(leaf.node.expr, size))
    if isinstance(leaf, torch.SymBool):
        return bool(evaluate(leaf.node.expr, size))
    return leaf
