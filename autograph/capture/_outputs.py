"""What the caller gets back: a returned value flattened once at capture, rebuilt on every call.

>>> leaves, rebuild = flatten_output(Out(v=x))      # Out has __slots__ = ("v",)
>>> rebuild([y]).v is y, rebuild([y]) is rebuild([y])
(True, False)

Every container and object in an output is new on every call, as eager execution would
return it (docs/design.md, "Outputs"); tensors are planned by ``_plan.OutputPlan``.
"""

from __future__ import annotations

import copy
import copyreg
import enum
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.utils._pytree as _pytree

from ._keys import _children, is_mapping

Tensor = torch.Tensor

# Values that are safe to hand out again on every call: nothing can change them.
_IMMUTABLE = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
    enum.Enum,
    frozenset,
    range,
    type,
)

# (labels, children, rebuild): a container's children, what each is called in messages
# (".logits", "[0]", "['past']"), and how to make the container anew from new children.
OutputNode = Tuple[List[str], list, Callable[[list], Any]]


def needs_gradients(leaves: Sequence[Any]) -> bool:
    """Whether any tensor among a call's output leaves needs gradients."""
    return any(isinstance(o, Tensor) and o.requires_grad for o in leaves)


def flatten_output(
    obj: Any, given: Sequence[Any] = ()
) -> Tuple[list, Callable[[Sequence[Any]], Any]]:
    """The leaves of a returned pytree and a function that rebuilds it from new leaves.

    >>> leaves, rebuild = flatten_output(Out(v=x))      # Out has __slots__ = ("v",)
    >>> rebuild([y]).v is y, rebuild([y]) is rebuild([y])
    (True, False)

    Containers are new on every rebuild, as eager execution would return them: tuples,
    lists, dicts, pytree nodes, and every other object, remade as ``copy.copy`` would make
    it (its ``__dict__``, its ``__slots__``, the items of a tuple, list or dict subclass,
    whatever its ``__reduce_ex__`` gives) with its children rebuilt. Objects the call was
    ``given`` (a cache passed in and returned) come back as themselves, as do modules,
    callables, immutable values and objects that cannot be copied.
    """
    leaves: list = []
    rebuild = _output_builder(obj, leaves, {id(o) for o in given}, set())
    return leaves, rebuild


def flatten_arguments(obj: Any) -> Tuple[list, Callable[[Sequence[Any]], Any]]:
    """Like ``flatten_output``, with the leaves the key has: objects other than containers
    (a cache keyed by identity) are leaves, passed on as themselves."""
    leaves: list = []
    rebuild = _output_builder(obj, leaves, None, set())
    return leaves, rebuild


def output_node(obj: Any, given: Optional[Set[int]]) -> Optional[OutputNode]:
    """How a returned value is walked and remade; None for a leaf.

    >>> output_node({"a": x}, set())[:2]
    (["['a']"], [x])

    ``given``: the ids of objects returned as themselves, or None to walk only the
    containers a key walks (tuples, lists, dicts, pytree nodes, namedtuples, dataclasses).
    """
    kind = type(obj)
    if (
        given is None
        or kind is tuple
        or kind is list
        or kind is dict
        or kind in _pytree.SUPPORTED_NODES
    ):
        return _container_node(obj)
    # Modules, functions and classes are returned as themselves: eager returns the object
    # the function holds, not a new one.
    if id(obj) in given or callable(obj) or isinstance(obj, (Tensor, torch.nn.Module, _IMMUTABLE)):
        return None
    return _object_node(obj)


def _container_node(obj: Any) -> Optional[OutputNode]:
    node = _children(obj)
    if node is None:
        return None
    kind, children, context = node
    if kind is dict:
        return [f"[{k!r}]" for k in context], children, lambda values: dict(zip(context, values))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        labels = [f".{f}" for f in obj._fields]
    elif (
        isinstance(context, (list, tuple))
        and len(context) == len(children)
        and all(isinstance(c, str) for c in context)
    ):
        labels = [f".{c}" for c in context]  # dataclasses, HF ModelOutput
    else:
        labels = [f"[{i}]" for i in range(len(children))]
    if kind is tuple or kind is list:
        return labels, children, kind
    node_def = _pytree.SUPPORTED_NODES.get(kind)
    if node_def is not None:
        return labels, children, lambda values: node_def.unflatten_fn(values, context)
    if isinstance(obj, tuple):
        return labels, children, lambda values: kind(*values)
    template = copy.copy(obj)
    if is_mapping(kind):  # a UserDict, an HF BatchEncoding: its attributes kept, items new
        return (
            [f"[{k!r}]" for k in context],
            children,
            lambda values: _with_items(template, context, values),
        )

    def with_fields(values: list) -> Any:
        new = copy.copy(template)
        for name, value in zip(context, values):
            object.__setattr__(new, name, value)
        return new

    return labels, children, with_fields


def _with_items(template: Any, keys: Sequence[Any], values: Sequence[Any]) -> Any:
    new = copy.copy(template)
    for key, value in zip(keys, values):
        new[key] = value
    return new


def _object_node(obj: Any) -> Optional[OutputNode]:
    """Any other object, walked and remade from what ``__reduce_ex__`` gives, as ``copy.copy``
    remakes it: the arguments of its constructor (a namedtuple's or a tuple subclass's
    items), its state (``__dict__`` and ``__slots__``, or ``__getstate__()``), the items of a
    list or dict subclass. None (a leaf, returned as itself) if it cannot be copied."""
    try:
        reduced = obj.__reduce_ex__(4)
    except Exception:  # noqa: BLE001 - a lock, a C object: copy.copy would fail alike
        return None
    if not isinstance(reduced, tuple) or len(reduced) < 2:
        return None  # a global, by name
    func, args, state, items, pairs = (*reduced, None, None, None)[:5]
    fixed = tuple(args[:1]) if func is copyreg.__newobj__ else ()  # the class
    arguments = list(args[len(fixed) :])
    fields = getattr(obj, "_fields", None) if isinstance(obj, tuple) else None
    labels = (
        [f".{f}" for f in fields]
        if fields and len(fields) == len(arguments)
        else [f"[{i}]" for i in range(len(arguments))]
    )
    # State as copy._reconstruct takes it: a __dict__, (__dict__, slots), or anything else.
    if isinstance(state, dict):
        parts: List[Optional[dict]] = [state]
    elif (
        isinstance(state, tuple)
        and len(state) == 2
        and all(s is None or isinstance(s, dict) for s in state)
    ):
        parts = list(state)
    else:
        parts = []
    names = [list(p) if p is not None else [] for p in parts]
    for part_names in names:
        labels += [f".{n}" for n in part_names]
    other = 1 if state is not None and not parts else 0
    labels += [".__getstate__()"] * other
    items = list(items) if items is not None else []
    labels += [f"[{i}]" for i in range(len(items))]
    pairs = list(pairs) if pairs is not None else []
    labels += [f"[{k!r}]" for k, _ in pairs]
    children = [*arguments, *[p[n] for p, part_names in zip(parts, names) for n in part_names]]
    children += [state] * other + items + [v for _, v in pairs]

    def remade(new: list) -> Any:
        at = iter(new)
        new_args = fixed + tuple(next(at) for _ in arguments)
        if parts:
            new_parts = [
                None if p is None else {n: next(at) for n in part_names}
                for p, part_names in zip(parts, names)
            ]
            new_state: Any = new_parts[0] if isinstance(state, dict) else tuple(new_parts)
        else:
            new_state = next(at) if other else None
        new_items = [next(at) for _ in items]
        new_pairs = [(k, next(at)) for k, _ in pairs]
        # copy._reconstruct without a memo is copy.copy's own rebuild (shallow).
        return copy._reconstruct(
            obj, None, func, new_args, new_state, iter(new_items), iter(new_pairs)
        )

    return labels, children, remade


def _output_builder(
    obj: Any, leaves: list, given: Optional[Set[int]], active: Set[int]
) -> Callable[[Sequence[Any]], Any]:
    """``given``: see ``output_node``; ``active``: the objects being walked, so that an
    object that holds itself is a leaf, not an endless walk."""
    node = None if id(obj) in active else output_node(obj, given)
    if node is None:
        index = len(leaves)
        leaves.append(obj)
        return lambda values: values[index]
    _, children, rebuild = node
    active.add(id(obj))
    builders = [_output_builder(c, leaves, given, active) for c in children]
    active.discard(id(obj))
    return lambda values: rebuild([b(values) for b in builders])


def real_rows(output: Tensor, dims: Tuple[int, ...], rows: int) -> Tensor:
    """An output of a padded run with each dim that follows the batch narrowed to ``rows``.

    >>> real_rows(torch.zeros(2, 4, 5), (1,), 3).shape
    torch.Size([2, 3, 5])
    """
    for d in dims:
        output = output.narrow(d, 0, rows)
    return output
