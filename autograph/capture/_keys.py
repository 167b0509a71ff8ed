"""The key of a call: what must match for a captured graph to be replayed (docs/design.md, "Keys").

>>> key, tensors, identities, addressed = call_key((x, w), {}, execution_state(None))
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

import collections.abc
import dataclasses
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as _pytree

from ..backends import _devices
from ..watch._names import DTYPE_NAMES, describe_tensor

Tensor = torch.Tensor

_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_NO_AUTOCAST = (False, False)


def _autocast_state() -> tuple:
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
        _autocast_state() if _any_autocast() else _NO_AUTOCAST,  # one C call, commonly
        # Before CUDA starts, the device that will be current is 0: a key made then must not
        # change when something (a compile saving the CUDA generators) starts CUDA lazily.
        _cuda_device() if _devices.cuda._initialized else 0,
        training,
        # A factory call without a dtype (torch.full(..., 0.1)) makes the default dtype's
        # tensor: a replay would make the capture's (docs/design.md, "What a replay assumes").
        torch.get_default_dtype(),
    )


def tensor_meta(t: Tensor) -> tuple:
    """What must match for a graph to take ``t`` through a static copy. Part of a key, never
    read back: keys are compared, not decoded."""
    try:
        return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
    except RuntimeError:  # sparse and nested tensors have no strides: they run eagerly
        return (t.layout, t.dtype, t.device, t.requires_grad, t.dim())


def _contiguous_strides(size: Sequence[int]) -> Tuple[int, ...]:
    strides, running = [], 1
    for n in reversed(size):
        strides.append(running)
        running *= max(n, 1)
    return tuple(reversed(strides))


def resized_meta(t: Tensor, dim: int, size: int) -> tuple:
    """The meta of ``t``'s static copy padded to ``size`` along ``dim`` (a new, contiguous
    tensor of the bucket's size)."""
    shape = list(t.shape)
    shape[dim] = size
    return (torch.Size(shape), _contiguous_strides(shape), t.dtype, t.device, t.requires_grad)


# ---- the typed parts of a key: each kind of leaf and node its own class ----


@dataclasses.dataclass(frozen=True)
class Node:
    """A container: its type, its context (dict keys, field names) and its children's parts."""

    kind: type
    context: Any
    children: tuple


@dataclasses.dataclass(frozen=True)
class Value:
    """A hashable leaf, by type and value (``1`` and ``True`` differ)."""

    kind: type
    value: Any


@dataclasses.dataclass(frozen=True)
class FloatBits:
    """A float or complex scalar by its bits: ``0.0`` and ``-0.0`` differ, and NaN has one
    spelling (NaN != NaN as a dict key)."""

    kind: type
    bits: Any


@dataclasses.dataclass(frozen=True)
class Identity:
    """An object without a value hash (a KV-cache object), by identity; held weakly."""

    kind: type
    object_id: int


@dataclasses.dataclass(frozen=True)
class Unkeyable:
    """A leaf with neither a value hash nor a sound identity (a numpy array, an object with
    ``__hash__ = None``): its key runs eagerly, with ``reason`` said once."""

    kind: type
    path: str
    reason: str = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class AtAddress:
    """A tensor used by address (``static_argnames``): a new address is a new key."""

    address: int
    meta: tuple


class KeyedCall(NamedTuple):
    """One call's key and what keying it found."""

    key: Any
    tensors: List[Tensor]
    identities: list  # objects keyed by identity
    addressed: List[int]  # indices of the tensors used by address
    plain: bool = False  # only plain tensors, positionally: C++ guards can check it (_last_key)


Resize = Optional[Dict[int, Tuple[int, int]]]  # tensor index -> (dim, size) of its static


def call_key(
    args: tuple,
    kwargs: dict,
    state: tuple,
    names: Sequence[str] = (),
    static_names: Sequence[str] = (),
    static_nums: Sequence[int] = (),
    resize: Resize = None,
) -> KeyedCall:
    """The key of one call, its tensors in order, the objects it keys by identity, and the
    indices of the tensors used by address (``static_argnames`` / ``static_argnums``).

    >>> call_key((x, w), {}, execution_state(None)).key
    (2, (torch.Size([8, 512]), (512, 1), torch.float32, device(type='cuda', index=0), False),
     (...), (True, False, (False, False), 0, None, torch.float32))

    ``names`` are the function's parameter names: they name an argument in errors and find
    ``static_names``. ``resize`` gives some tensors (by index) the shape of the static they are
    padded into, for the key of a bucket's graph.
    """
    if not kwargs and not static_names and not static_nums:
        for a in args:
            if type(a) is not Tensor:
                break
        else:
            if resize is None:
                return KeyedCall(
                    (len(args), *map(tensor_meta, args), state), list(args), [], [], True
                )
            metas = [
                tensor_meta(t) if i not in resize else resized_meta(t, *resize[i])
                for i, t in enumerate(args)
            ]
            return KeyedCall((len(args), *metas, state), list(args), [], [], True)
    keying = _Keying(resize)
    parts = []
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"args[{i}]"
        by_address = i in static_nums or name in static_names
        parts.append(keying.part(a, name, by_address))
    keywords = tuple((k, keying.part(v, k, k in static_names)) for k, v in kwargs.items())
    return KeyedCall(
        ((tuple(parts), keywords), state), keying.tensors, keying.identities, keying.addressed
    )


def unsupported_tensor(tensors: Sequence[Tensor]) -> Optional[str]:
    """Why a graph cannot stand in for these arguments with plain static copies, or None."""
    for t in tensors:
        kind = type(t)
        if kind is not Tensor and kind is not torch.nn.Parameter:
            return (
                f"an argument is a {kind.__name__}, a tensor subclass: its own "
                f"__torch_function__/__torch_dispatch__ would not run at replay"
            )
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
    if isinstance(obj, collections.abc.MutableMapping):  # UserDict, HF BatchEncoding
        return kind, list(obj.values()), tuple(obj.keys())
    return None


def is_mapping(kind: type) -> bool:
    """Whether a container kind of ``_children`` is a dict or another mutable mapping."""
    return kind is dict or issubclass(kind, collections.abc.MutableMapping)


def _child_path(path: str, kind: Any, context: Any, index: int) -> str:
    if is_mapping(kind) and isinstance(context[index], str):
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
        return FloatBits(kind, obj.hex())
    if isinstance(obj, complex):
        return FloatBits(kind, (float(obj.real).hex(), float(obj.imag).hex()))
    numpy = sys.modules.get("numpy")  # numpy stays optional: its scalars exist only if loaded
    if numpy is not None and isinstance(obj, numpy.inexact):
        # float16, float32, longdouble, complex64: their bytes tell -0.0 and NaN apart too.
        return FloatBits(kind, obj.tobytes())
    return Value(kind, obj)


class _Keying:
    """The walk of one call's arguments into key parts, collecting what the key needs."""

    def __init__(self, resize: Resize):
        self.resize = resize
        self.tensors: List[Tensor] = []
        self.identities: list = []
        self.addressed: List[int] = []

    def part(self, obj: Any, path: str, by_address: bool) -> Any:
        if isinstance(obj, Tensor):
            index = len(self.tensors)
            self.tensors.append(obj)
            if by_address:
                self.addressed.append(index)
                self.identities.append(obj)  # its key dies with it
                return AtAddress(obj.data_ptr(), tensor_meta(obj))
            if self.resize is not None and index in self.resize:
                return resized_meta(obj, *self.resize[index])
            return tensor_meta(obj)
        node = _children(obj)
        if node is not None:
            kind, children, context = node
            return Node(
                kind,
                _freeze(context),
                tuple(
                    self.part(c, _child_path(path, kind, context, i), by_address)
                    for i, c in enumerate(children)
                ),
            )
        try:
            hash(obj)
        except TypeError:
            return _unhashable_part(obj, path)
        if type(obj).__hash__ is object.__hash__:
            self.identities.append(obj)
            return Identity(type(obj), id(obj))
        return _leaf_key(obj)


def _unhashable_part(obj: Any, path: str) -> Any:
    """A set of hashable values by value; any other unhashable leaf ``Unkeyable``."""
    if isinstance(obj, (set, frozenset)):
        try:
            return Value(type(obj), frozenset(map(_leaf_key, obj)))
        except TypeError:
            pass
    return Unkeyable(
        type(obj),
        path,
        (
            f"its argument {path} is an unhashable {type(obj).__name__}, "
            f"which autograph can key neither by value nor by identity. Pass it as a tensor or a "
            f"tuple, or bind it outside the graphed function, to graph these calls"
        ),
    )


def unkeyable_reason(key: Any) -> Optional[str]:
    """Why a key made by ``call_key`` cannot be graphed (an ``Unkeyable`` leaf in it), or None."""
    if isinstance(key, Unkeyable):
        return key.reason
    children = key.children if isinstance(key, Node) else key if isinstance(key, tuple) else ()
    for child in children:
        reason = unkeyable_reason(child)
        if reason is not None:
            return reason
    return None


# ---- readable keys for messages and stats ----


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
        parts.append(
            f"{path}=<{type(obj).__name__}>" if keyed_by_identity else f"{path}={_short_repr(obj)}"
        )
        return
    kind, children, context = node
    if is_mapping(kind) or (
        isinstance(context, tuple)
        and len(context) == len(children)
        and all(isinstance(c, str) for c in context)
    ):
        labels = [f"[{k!r}]" if is_mapping(kind) else f".{k}" for k in context]
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        labels = [f".{f}" for f in obj._fields]
    else:
        labels = [f"[{i}]" for i in range(len(children))]
    for label, child in zip(labels, children):
        _describe(path + label, child, parts, resized)


def describe_parts(
    names: Sequence[str], args: tuple, kwargs: dict, resized: Optional[Dict[int, torch.Size]] = None
) -> List[str]:
    """One ``name: f32[8, 512] cuda:0`` or ``name=3`` part per leaf of the call; ``resized``
    gives some tensors (by ``id``) the shape they are padded to."""
    parts: List[str] = []
    resized = resized or {}
    for i, a in enumerate(args):
        _describe(names[i] if i < len(names) else f"args[{i}]", a, parts, resized)
    for k, v in kwargs.items():
        _describe(k, v, parts, resized)
    return parts


def describe_call(
    names: Sequence[str], args: tuple, kwargs: dict, state: tuple, max_parts: int = 8
) -> str:
    """A readable key: ``x: f32[8, 512] cuda:0, n=3 (no_grad)``."""
    return join_parts(describe_parts(names, args, kwargs), state, max_parts)


def join_parts(parts: List[str], state: tuple, max_parts: int = 8) -> str:
    if len(parts) > max_parts:
        parts = parts[:max_parts] + [f"... {len(parts) - max_parts} more"]
    text = ", ".join(parts)
    modes = describe_state(state)
    return f"{text} ({modes})" if modes else text


def describe_state(state: tuple) -> str:
    grad, inference, (cuda_autocast, cpu_autocast), _, training, default_dtype = state
    modes = []
    if inference:
        modes.append("inference_mode")
    elif not grad:
        modes.append("no_grad")
    for device, dtype in (("cuda", cuda_autocast), ("cpu", cpu_autocast)):
        if dtype:
            modes.append(f"autocast {device} {DTYPE_NAMES.get(dtype, dtype)}")
    if training is not None:
        modes.append("train" if training else "eval")
    if default_dtype is not torch.float32:
        modes.append(f"default dtype {DTYPE_NAMES.get(default_dtype, default_dtype)}")
    return ", ".join(modes)
