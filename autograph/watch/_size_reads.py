"""Python numbers a bucketed function computes from its batch size (docs/design.md, "Buckets").

>>> numbers = {}
>>> with NumbersOf(numbers, 3):
...     f(x_of_3_rows)                     # return x * x.shape[0]: aten.mul gets the number 3
>>> with NumbersOf(numbers, 4):
...     f(x_of_4_rows)                     # a bucket's graph of 4 rows: the number 4
>>> size_read(numbers, 4)
'aten.mul.Tensor is passed the Python number 3 at 3 rows and 4 at 4 rows (argument other) ...'

A bucket's graph runs the function's Python once, at the bucket's size, and a number it
computes there from the size (``x * x.shape[0]``, ``x.sum(0) / x.shape[0]``,
``torch.full((k,), x.shape[0])``) is baked into the graph: a call of 3 rows replayed in the graph
of 4 gets 4 where eager gets 3, in its real rows, and the pad-row probe (``_row_mixing``) cannot
see it. So the runs of a function at two sizes (a stateless key's watched warmup as called and
its capture at the bucket; the buckets ``capture()`` warms up) note, in op order, the Python
numbers their ops are passed: arguments of schema type ``Scalar``/``float``/``complex``, and
numbers passed where a Tensor is expected (``x * 3`` reaches a dispatch mode as the plain
number for a wrapped-number tensor). Sizes (``int``/``SymInt`` and their lists: ``view``,
``reshape``, ``expand``, ``new_empty``, ``narrow``) legitimately follow the batch and are not
noted, nor are ``arange``'s bounds. A number that differs, at the same op and argument, between
runs at two sizes is read from the size (or from other Python state that changed between the
runs, which a graph would bake just as well): the key runs eagerly with the op named. Where the
op sequences part (the Python branches on the size), the comparison stops there.

A 0-dim CPU tensor handed to a device op (``x * torch.tensor(n)`` on CUDA) is baked by a
capture too, and is read as a number; on the CPU emulation every tensor is a CPU tensor, so
there such tensors are data and not read.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._modes import Observer

Tensor = torch.Tensor

# (op, argument, number) in op order.
Numbers = List[Tuple[Any, str, Any]]

_NUMBER_KINDS = ("NumberType", "FloatType", "ComplexType")
# Their Scalar arguments are a length, which follows the batch legitimately.
_LENGTH_OPS = ("arange", "range")


def _kind(argument: Any) -> str:
    kind = argument.type.kind()
    if kind == "OptionalType":
        kind = argument.type.getElementType().kind()
    return kind


def _number(value: Any, kind: str, on_device: bool) -> Optional[Any]:
    """The Python number ``value`` stands for in an argument of ``kind``, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, complex)) and kind in (*_NUMBER_KINDS, "TensorType"):
        return value
    if (
        on_device
        and kind == "TensorType"
        and isinstance(value, Tensor)
        and value.dim() == 0
        and value.device.type == "cpu"
    ):
        # Read with dispatch off: the modes around (the guard, the recorder) must not see it.
        with torch._C._DisableTorchDispatch():
            return value.item()
    return None


def numbers_passed(func: Any, args: tuple, kwargs: dict) -> List[Tuple[str, Any]]:
    """(argument, number) for each Python number ``func`` is passed.

    >>> numbers_passed(torch.ops.aten.full.default, ((2,), 3), {})
    [('fill_value', 3)]
    """
    places = _NUMBER_PLACES.get(func)
    if places is None:
        places = _number_places(func)
    if not places:
        return []
    on_device = any(isinstance(a, Tensor) and a.device.type != "cpu" for a in args)
    found = []
    for i, name, kind in places:
        value = args[i] if i < len(args) else kwargs.get(name)
        number = None if value is None else _number(value, kind, on_device)
        if number is not None:
            found.append((name, number))
    return found


# Per op, the arguments that may carry a Python number: (position, name, kind). Asked for
# every op of a watched run at a bucket's size; an op's schema is read once (a process-wide
# cache of facts, no state).
_NUMBER_PLACES: Dict[Any, Tuple[Tuple[int, str, str], ...]] = {}


def _number_places(func: Any) -> Tuple[Tuple[int, str, str], ...]:
    places: Tuple[Tuple[int, str, str], ...] = ()
    if func.overloadpacket.__name__ not in _LENGTH_OPS:
        places = tuple(
            (i, argument.name, _kind(argument))
            for i, argument in enumerate(func._schema.arguments)
            if _kind(argument) in (*_NUMBER_KINDS, "TensorType")
        )
    _NUMBER_PLACES[func] = places
    return places


class NumbersOf(Observer):
    """Note the Python numbers a run's ops are passed as ``numbers[size]``, once the run
    returns (a run that raised shows nothing); a size already noted is left as it is."""

    def __init__(self, numbers: Dict[int, Numbers], size: int):
        self.numbers, self.size = numbers, size
        self.seen: Numbers = []

    def before(self, func: Any, args: tuple, kwargs: dict, tensors: Sequence[Tensor]) -> None:
        for name, number in numbers_passed(func, args, kwargs):
            self.seen.append((func, name, number))

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        super().__exit__(kind, error, traceback)
        if kind is None:
            self.numbers.setdefault(self.size, self.seen)


def _same(a: Any, b: Any) -> bool:
    return a == b or (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    )


def _first_change(a: Numbers, b: Numbers) -> Optional[Tuple[Any, str, Any, Any]]:
    for (op, name, x), (other_op, other_name, y) in zip(a, b):
        if op is not other_op or name != other_name:
            return None  # its Python took another path: positions no longer match
        if not _same(x, y):
            return op, name, x, y
    return None


def size_read(numbers: Dict[int, Numbers], size: int) -> Optional[str]:
    """Why the run at ``size`` was passed a number that another size's run was not, or None."""
    if size not in numbers:
        return None
    for other in sorted(numbers):
        change = None if other == size else _first_change(numbers[other], numbers[size])
        if change is None:
            continue
        op, name, x, y = change
        read = (
            "the batch size read in Python (x.shape[0])"
            if (x, y) == (other, size)
            else "computed in Python from the batch size, or from other Python state"
        )
        return (
            f"{op} is passed the Python number {x!r} at {other} rows and {y!r} at {size} "
            f"rows (argument {name}): it is {read}, and a bucket's graph would replay the "
            f"bucket's number for calls of fewer rows. Pass it as a tensor argument "
            f"(torch.tensor(n, device=x.device), made outside the function), or leave "
            f"this function out of buckets="
        )
    return None
