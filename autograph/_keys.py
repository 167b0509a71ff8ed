"""The key of a call: what must match for a captured graph to be replayed (SPEC 2.1).

>>> key, tensors, identities = call_key((x, w), {}, execution_state(None))
>>> describe_call(("x", "w"), (x, w), {}, execution_state(None))
'x: f32[8, 512] cuda:0, w: f32[512, 512] cuda:0'

Plain tensor arguments take a fast path that never walks a pytree; anything else is
flattened: tuples, lists, dicts, namedtuples, dataclasses and every type registered with
torch's pytree (HF ``ModelOutput`` among them). Non-tensor leaves enter the key by value and
type, so that values which compare equal but compute differently (``0.0`` and ``-0.0``,
``1`` and ``True``) get different keys. Objects without a value hash (a KV-cache object) are
keyed by identity: the key holds their ``id``, and the caller holds them weakly.
"""
from __future__ import annotations

import copy
import copyreg
import dataclasses
import enum
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.utils._pytree as _pytree

Tensor = torch.Tensor

_DTYPE_NAMES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_NO_AUTOCAST = (False, False)


def _autocast_state() -> tuple:
    if not _any_autocast():  # one C call on the common path, not four
        return _NO_AUTOCAST
    # torch >= 2.4 takes a device type; the dtype only matters while autocast is on.
    cuda = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
    cpu = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
    return (cuda, cpu)


# torch.cuda.current_device() re-checks initialisation in Python (about 0.2 us a call); once
# CUDA is initialised, the C getter answers alone. CPU-only builds have neither.
_cuda_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", lambda: -1)


def execution_state(training: Any) -> tuple:
    """The global state that changes which kernels a call runs."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        _autocast_state(),
        _cuda_device() if torch.cuda.is_initialized() else -1,
        training,
    )


def tensor_meta(t: Tensor) -> tuple:
    try:
        return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
    except RuntimeError:  # sparse and nested tensors have no strides: they run eagerly
        return (t.layout, t.dtype, t.device, t.requires_grad, t.dim())


def call_key(args: tuple, kwargs: dict, state: tuple, names: Sequence[str] = (),
             static_names: Sequence[str] = (), static_nums: Sequence[int] = ()
             ) -> Tuple[tuple, List[Tensor], list, List[int]]:
    """The key of one call, its tensors in order, the objects it keys by identity, and the
    indices of the tensors used by address (``static_argnames`` / ``static_argnums``).

    ``names`` are the function's parameter names: they name an argument in errors and find
    ``static_names``. A tensor used by address enters the key with its address.
    """
    if not kwargs and not static_names and not static_nums:
        for a in args:
            if type(a) is not Tensor:
                break
        else:
            return (len(args), *map(tensor_meta, args), state), list(args), [], []
    tensors: List[Tensor] = []
    identities: list = []
    addressed: List[int] = []
    parts = []
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"args[{i}]"
        by_address = i in static_nums or name in static_names
        parts.append(_flatten(a, tensors, identities, name, addressed if by_address else None))
    keywords = tuple((k, _flatten(v, tensors, identities, k,
                                  addressed if k in static_names else None))
                     for k, v in kwargs.items())
    return ((tuple(parts), keywords), state), tensors, identities, addressed


def unsupported_tensor(tensors: Sequence[Tensor]) -> Optional[str]:
    """Why a graph cannot stand in for these arguments with plain static copies, or None."""
    for t in tensors:
        kind = type(t)
        if kind is not Tensor and kind is not torch.nn.Parameter:
            return (f"an argument is a {kind.__name__}, a tensor subclass: its own "
                    f"__torch_function__/__torch_dispatch__ would not run at replay")
        if t.layout is not torch.strided:
            return f"an argument is a {t.layout} tensor; graphs take strided (dense) tensors"
        if t.is_nested:
            return "an argument is a nested tensor; graphs take strided (dense) tensors"
    return None


def _freeze(context: Any) -> Any:
    if isinstance(context, (list, tuple)):
        return tuple(_freeze(c) for c in context)
    try:
        hash(context)
    except TypeError:
        return repr(context)
    return context


def _dataclass_fields(obj: Any) -> List[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _children(obj: Any) -> Tuple[Any, list, Any] | None:
    """(node kind, children, context) for a container, or None for a leaf."""
    kind = type(obj)
    if kind is tuple or kind is list:
        return kind, list(obj), None
    if kind is dict:
        return kind, list(obj.values()), tuple(obj.keys())
    node = _pytree.SUPPORTED_NODES.get(kind)
    if node is not None:
        children, context = node.flatten_fn(obj)
        return kind, list(children), context
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return kind, list(obj), None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _dataclass_fields(obj)
        return kind, [getattr(obj, n) for n in names], tuple(names)
    return None


def _child_path(path: str, kind: Any, context: Any, index: int) -> str:
    if kind is dict and isinstance(context[index], str):
        return context[index] if not path else f"{path}[{context[index]!r}]"
    return f"{path}[{index}]"


def _leaf_key(obj: Any) -> Any:
    """A scalar's key, equal only for values that compute alike.

    >>> _leaf_key(-0.0) == _leaf_key(0.0), _leaf_key(complex(0, -0.0)) == _leaf_key(0j)
    (False, False)
    """
    kind = type(obj)
    # hex() tells 0.0 from -0.0 and gives NaN one spelling (NaN != NaN as a dict key);
    # numpy's float64 and complex128 are Python floats and complexes.
    if kind is float or isinstance(obj, float):
        return ("float", kind, obj.hex())
    if isinstance(obj, complex):
        return ("complex", kind, float(obj.real).hex(), float(obj.imag).hex())
    numpy = sys.modules.get("numpy")  # numpy stays optional: its scalars exist only if loaded
    if numpy is not None and isinstance(obj, numpy.inexact):
        # float16, float32, longdouble, complex64: their bytes tell -0.0 and NaN apart too.
        return ("numpy", kind, obj.tobytes())
    return ("const", kind, obj)


def _flatten(obj: Any, tensors: List[Tensor], identities: list, path: str,
             addressed: Optional[List[int]] = None) -> Any:
    if isinstance(obj, Tensor):
        tensors.append(obj)
        if addressed is not None:
            addressed.append(len(tensors) - 1)
            return ("address", obj.data_ptr(), tensor_meta(obj))
        return tensor_meta(obj)
    node = _children(obj)
    if node is not None:
        kind, children, context = node
        return (kind, _freeze(context),
                tuple(_flatten(c, tensors, identities, _child_path(path, kind, context, i),
                               addressed)
                      for i, c in enumerate(children)))
    try:
        hash(obj)
    except TypeError:
        raise TypeError(
            f"argument {path} is an unhashable {type(obj).__name__} ({_short_repr(obj)}); "
            f"autograph keys each call on its non-tensor arguments by value. Pass it as a "
            f"tuple, a tensor or a hashable object, or bind it outside the graphed function."
        ) from None
    if type(obj).__hash__ is object.__hash__:
        identities.append(obj)
        return ("id", type(obj), id(obj))
    return _leaf_key(obj)


# ---- outputs: flatten once at capture, rebuild on every call ----

# Values that are safe to hand out again on every call: nothing can change them.
_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device,
              torch.layout, torch.memory_format, torch.Size, enum.Enum, frozenset, range,
              type)

# (labels, children, rebuild): a container's children, what each is called in messages
# (".logits", "[0]", "['past']"), and how to make the container anew from new children.
Node = Tuple[List[str], list, Callable[[list], Any]]


def flatten_output(obj: Any, given: Sequence[Any] = ()
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


def output_node(obj: Any, given: Optional[Set[int]]) -> Optional[Node]:
    """How a returned value is walked and remade; None for a leaf.

    >>> output_node({"a": x}, set())[:2]
    (["['a']"], [x])

    ``given``: the ids of objects returned as themselves, or None to walk only the
    containers a key walks (tuples, lists, dicts, pytree nodes, namedtuples, dataclasses).
    """
    kind = type(obj)
    if given is None or kind is tuple or kind is list or kind is dict \
            or kind in _pytree.SUPPORTED_NODES:
        return _container_node(obj)
    # Modules, functions and classes are returned as themselves: eager returns the object
    # the function holds, not a new one.
    if id(obj) in given or callable(obj) or isinstance(obj, (Tensor, torch.nn.Module,
                                                             _IMMUTABLE)):
        return None
    return _object_node(obj)


def _container_node(obj: Any) -> Optional[Node]:
    node = _children(obj)
    if node is None:
        return None
    kind, children, context = node
    if kind is dict:
        return [f"[{k!r}]" for k in context], children, lambda values: dict(zip(context,
                                                                                  values))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        labels = [f".{f}" for f in obj._fields]
    elif (isinstance(context, (list, tuple)) and len(context) == len(children)
          and all(isinstance(c, str) for c in context)):
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

    def with_fields(values: list) -> Any:
        new = copy.copy(template)
        for name, value in zip(context, values):
            object.__setattr__(new, name, value)
        return new

    return labels, children, with_fields


def _object_node(obj: Any) -> Optional[Node]:
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
    arguments = list(args[len(fixed):])
    fields = getattr(obj, "_fields", None) if isinstance(obj, tuple) else None
    labels = [f".{f}" for f in fields] if fields and len(fields) == len(arguments) else \
        [f"[{i}]" for i in range(len(arguments))]
    # State as copy._reconstruct takes it: a __dict__, (__dict__, slots), or anything else.
    if isinstance(state, dict):
        parts: List[Optional[dict]] = [state]
    elif (isinstance(state, tuple) and len(state) == 2
          and all(s is None or isinstance(s, dict) for s in state)):
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
    children = [*arguments, *[p[n] for p, part_names in zip(parts, names)
                             for n in part_names]]
    children += [state] * other + items + [v for _, v in pairs]

    def remade(new: list) -> Any:
        at = iter(new)
        new_args = fixed + tuple(next(at) for _ in arguments)
        if parts:
            new_parts = [None if p is None else {n: next(at) for n in part_names}
                         for p, part_names in zip(parts, names)]
            new_state: Any = new_parts[0] if isinstance(state, dict) else tuple(new_parts)
        else:
            new_state = next(at) if other else None
        new_items = [next(at) for _ in items]
        new_pairs = [(k, next(at)) for k, _ in pairs]
        # copy._reconstruct without a memo is copy.copy's own rebuild (shallow).
        return copy._reconstruct(obj, None, func, new_args, new_state, iter(new_items),
                                 iter(new_pairs))

    return labels, children, remade


def _output_builder(obj: Any, leaves: list, given: Optional[Set[int]], active: Set[int]
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


# ---- readable keys for messages and stats ----

def describe_tensor(t: Tensor, shape: Optional[torch.Size] = None) -> str:
    dtype = _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))
    if t.is_nested:
        return f"{dtype} nested tensor of {t.dim()} dims {t.device}"
    text = f"{dtype}[{', '.join(map(str, t.shape if shape is None else shape))}] {t.device}"
    if t.layout is not torch.strided:
        text += f" {str(t.layout).replace('torch.', '')}"
    elif shape is None and not t.is_contiguous():
        text += f" strides={tuple(t.stride())}"
    if t.requires_grad:
        text += " requires_grad"
    return text


def _short_repr(obj: Any, limit: int = 40) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(path: str, obj: Any, parts: List[str], resized: Dict[int, torch.Size]) -> None:
    if isinstance(obj, Tensor):
        parts.append(f"{path}: {describe_tensor(obj, resized.get(id(obj)))}")
        return
    node = _children(obj)
    if node is None:
        keyed_by_identity = type(obj).__hash__ is object.__hash__
        parts.append(f"{path}=<{type(obj).__name__}>" if keyed_by_identity
                     else f"{path}={_short_repr(obj)}")
        return
    kind, children, context = node
    if kind is dict or (isinstance(context, tuple) and len(context) == len(children)
                        and all(isinstance(c, str) for c in context)):
        labels = [f"[{k!r}]" if kind is dict else f".{k}" for k in context]
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        labels = [f".{f}" for f in obj._fields]
    else:
        labels = [f"[{i}]" for i in range(len(children))]
    for label, child in zip(labels, children):
        _describe(path + label, child, parts, resized)


def describe_parts(names: Sequence[str], args: tuple, kwargs: dict,
                   resized: Optional[Dict[int, torch.Size]] = None) -> List[str]:
    """One ``name: f32[8, 512] cuda:0`` or ``name=3`` part per leaf of the call; ``resized``
    gives some tensors (by ``id``) the shape they are padded to."""
    parts: List[str] = []
    resized = resized or {}
    for i, a in enumerate(args):
        _describe(names[i] if i < len(names) else f"args[{i}]", a, parts, resized)
    for k, v in kwargs.items():
        _describe(k, v, parts, resized)
    return parts


def describe_call(names: Sequence[str], args: tuple, kwargs: dict, state: tuple,
                  max_parts: int = 8) -> str:
    """A readable key: ``x: f32[8, 512] cuda:0, n=3 (no_grad)``."""
    return join_parts(describe_parts(names, args, kwargs), state, max_parts)


def join_parts(parts: List[str], state: tuple, max_parts: int = 8) -> str:
    if len(parts) > max_parts:
        parts = parts[:max_parts] + [f"... {len(parts) - max_parts} more"]
    text = ", ".join(parts)
    modes = describe_state(state)
    return f"{text} ({modes})" if modes else text


def describe_state(state: tuple) -> str:
    grad, inference, (cuda_autocast, cpu_autocast), _, training = state
    modes = []
    if inference:
        modes.append("inference_mode")
    elif not grad:
        modes.append("no_grad")
    for device, dtype in (("cuda", cuda_autocast), ("cpu", cpu_autocast)):
        if dtype:
            modes.append(f"autocast {device} {_DTYPE_NAMES.get(dtype, dtype)}")
    if training is not None:
        modes.append("train" if training else "eval")
    return ", ".join(modes)
