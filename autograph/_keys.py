"""The key of a call: what must match for a captured graph to be replayed (SPEC 2.1).

>>> key, tensors, keep_alive = call_key((x, w), {}, ())
>>> describe_call(("x", "w"), (x, w), {}, ())
'x: f32[8, 512] cuda:0, w: f32[512, 512] cuda:0'

Plain tensor arguments take a fast path that never walks a pytree; anything else is
flattened: tuples, lists, dicts, namedtuples, dataclasses and every type registered with
torch's pytree (HF ``ModelOutput`` among them). Non-tensor leaves enter the key by value.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.utils._pytree as _pytree

Tensor = torch.Tensor

_DTYPE_NAMES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def _autocast_state() -> tuple:
    # torch >= 2.4 takes a device type; the dtype only matters while autocast is on.
    cuda = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
    cpu = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
    return (cuda, cpu)


def execution_state(training: Any) -> tuple:
    """The global state that changes which kernels a call runs."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        _autocast_state(),
        torch.cuda.current_device() if torch.cuda.is_initialized() else -1,
        training,
    )


def tensor_meta(t: Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def call_key(args: tuple, kwargs: dict, state: tuple) -> Tuple[tuple, List[Tensor], list]:
    """The key of one call, its tensors in order, and the objects the key refers to by id.

    Objects hashed by identity are returned so that the cache can keep them alive: a graph
    keyed on ``id(obj)`` must never meet a new object that reuses a dead one's address.
    """
    if not kwargs:
        for a in args:
            if type(a) is not Tensor:
                break
        else:
            return (len(args), *map(tensor_meta, args), state), list(args), []
    tensors: List[Tensor] = []
    keep_alive: list = []
    spec = (_flatten(args, tensors, keep_alive, "args"),
            _flatten(kwargs, tensors, keep_alive, "kwargs"))
    return (spec, state), tensors, keep_alive


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


def _flatten(obj: Any, tensors: List[Tensor], keep_alive: list, path: str) -> Any:
    if isinstance(obj, Tensor):
        tensors.append(obj)
        return tensor_meta(obj)
    node = _children(obj)
    if node is not None:
        kind, children, context = node
        return (kind, _freeze(context),
                tuple(_flatten(c, tensors, keep_alive, f"{path}[{i}]")
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
        keep_alive.append(obj)
    return ("const", type(obj), obj)


# ---- outputs: flatten once at capture, rebuild on every call ----

def flatten_output(obj: Any) -> Tuple[list, Callable[[Sequence[Any]], Any]]:
    """The leaves of a returned pytree and a function that rebuilds it from new leaves."""
    leaves: list = []
    rebuild = _output_builder(obj, leaves)
    return leaves, rebuild


def _output_builder(obj: Any, leaves: list) -> Callable[[Sequence[Any]], Any]:
    if isinstance(obj, Tensor):
        index = len(leaves)
        leaves.append(obj)
        return lambda values: values[index]
    node = _children(obj)
    if node is None:
        leaves.append(obj)
        index = len(leaves) - 1
        return lambda values: values[index]
    kind, children, context = node
    builders = [_output_builder(c, leaves) for c in children]

    def rebuilt_children(values: Sequence[Any]) -> list:
        return [b(values) for b in builders]

    if kind is tuple or kind is list:
        return lambda values: kind(rebuilt_children(values))
    if kind is dict:
        return lambda values: dict(zip(context, rebuilt_children(values)))
    node_def = _pytree.SUPPORTED_NODES.get(kind)
    if node_def is not None:
        return lambda values: node_def.unflatten_fn(rebuilt_children(values), context)
    if isinstance(obj, tuple):
        return lambda values: kind(*rebuilt_children(values))
    template = copy.copy(obj)

    def rebuild_dataclass(values: Sequence[Any]) -> Any:
        new = copy.copy(template)
        for name, value in zip(context, rebuilt_children(values)):
            object.__setattr__(new, name, value)
        return new

    return rebuild_dataclass


# ---- readable keys for messages and stats ----

def describe_tensor(t: Tensor) -> str:
    dtype = _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))
    text = f"{dtype}[{', '.join(map(str, t.shape))}] {t.device}"
    if not t.is_contiguous():
        text += f" strides={tuple(t.stride())}"
    if t.requires_grad:
        text += " requires_grad"
    return text


def _short_repr(obj: Any, limit: int = 40) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(path: str, obj: Any, parts: List[str]) -> None:
    if isinstance(obj, Tensor):
        parts.append(f"{path}: {describe_tensor(obj)}")
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
        _describe(path + label, child, parts)


def describe_call(names: Sequence[str], args: tuple, kwargs: dict, state: tuple,
                  max_parts: int = 8) -> str:
    """A readable key: ``x: f32[8, 512] cuda:0, n=3 (no_grad)``."""
    parts: List[str] = []
    for i, a in enumerate(args):
        _describe(names[i] if i < len(names) else f"args[{i}]", a, parts)
    for k, v in kwargs.items():
        _describe(k, v, parts)
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
