"""A key's example call, recorded at its capture as plain JSON values, and rebuilt from them in
another process (docs/design.md, "Capture ahead": warm restarts).

>>> record = record_call(("x", "cache"), (x, cache), {}, state, ("cache",), (), None)
>>> record["args"]
[{'tensor': {'shape': [8, 512], 'stride': [512, 1], 'dtype': 'float32', 'device': 'cuda:0',
  'requires_grad': False, 'padded': None}}, {'object': 'cache', 'is': 'f32[8, 64] cuda:0'}]
>>> args, kwargs = rebuilt_call(record, {"cache": cache})      # zeros of each spec
>>> with entered_state(record["state"]): ...                          # its grad mode, autocast

Keys are compared, never decoded (docs/design.md, "Keys"): so the call that made a key is
described on its own, once per capture, from the same walk of the arguments as the keying
(``_keys._children``, tensors counted in the keying's order for a bucket's padded dims). Each
top-level argument is a spec: a tensor's shape, strides, dtype, device and ``requires_grad``
(for a bucket's key, the padded tensors at the bucket's size); a plain value (None, bool, int,
str, a float by its bits, a dtype); tuples, lists and dicts of those. An argument the plan
cannot hold (an object keyed by identity, a tensor used by address, any other container) is
an ``{"object": name, "is": "f32[4, 8] cuda:0"}`` placeholder (a tensor's shape, else the
object's type), which the caller supplies by that name. Values of
tensors are not kept: a capture's result does not depend on them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from ..watch._names import describe_tensor
from ._keys import _children

Tensor = torch.Tensor


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is no torch dtype")
    return dtype


def _tensor_spec(t: Tensor, padding: Any, index: int) -> Optional[dict]:
    if t.layout is not torch.strided or t.is_nested:
        return None  # never graphed anyway
    shape, stride = list(t.shape), list(t.stride())
    spec = padding.dims[index] if padding is not None and index < len(padding.dims) else None
    if spec is not None:  # a bucket's static: the bucket's rows, contiguous
        shape = list(padding.padded_shape(t, index))
        stride, running = [], 1
        for n in reversed(shape):
            stride.insert(0, running)
            running *= max(n, 1)
    return {
        "tensor": {
            "shape": shape,
            "stride": stride,
            "dtype": dtype_name(t.dtype),
            "device": str(t.device),
            "requires_grad": t.requires_grad,
            "padded": None if spec is None else spec[0],
        }
    }


def _plain(obj: Any) -> Optional[dict]:
    """A leaf the key holds by value, as JSON; None for any other."""
    kind = type(obj)
    if obj is None or kind in (bool, int, str):
        return {"value": obj}
    if kind is float:
        return {"float": obj.hex()}  # its bits: 0.0 and -0.0, NaN and inf survive JSON
    if kind is torch.dtype:
        return {"dtype": dtype_name(obj)}
    return None


class _Recording:
    """The walk of one call's arguments, counting tensors in the keying's order."""

    def __init__(self, padding: Any):
        self.padding, self.index = padding, 0

    def spec(self, obj: Any, by_address: bool) -> Optional[dict]:
        """The spec of ``obj``, or None: the argument it is part of must be supplied."""
        if isinstance(obj, Tensor):
            self.index += 1
            return None if by_address else _tensor_spec(obj, self.padding, self.index - 1)
        node = _children(obj)
        if node is None:
            return _plain(obj)
        kind, children, context = node
        specs = [self.spec(child, by_address) for child in children]  # every tensor counted
        if any(s is None for s in specs) or kind not in (tuple, list, dict):
            return None
        if kind is not dict:
            return {kind.__name__: specs}
        keys = [_plain(k) for k in context]
        if any(k is None for k in keys):
            return None
        return {"dict": [[k, s] for k, s in zip(keys, specs)]}


def _placeholder(name: str, obj: Any) -> dict:
    """An argument the caller supplies, by name; with what it was (a tensor's shape and dtype,
    else its type), so that a record made from another object can be told apart."""
    seen = describe_tensor(obj) if isinstance(obj, Tensor) else type(obj).__qualname__
    return {"object": name, "is": seen}


def record_state(state: tuple) -> dict:
    """The execution state of a key (``_keys.execution_state``) as JSON."""
    grad, inference, (cuda_autocast, cpu_autocast), device, training, default_dtype = state
    return {
        "grad": grad,
        "inference": inference,
        "autocast": {
            "cuda": dtype_name(cuda_autocast) if cuda_autocast else None,
            "cpu": dtype_name(cpu_autocast) if cpu_autocast else None,
        },
        "device": device,
        "training": training,
        "default_dtype": dtype_name(default_dtype),
    }


def record_call(
    names: Sequence[str],
    args: tuple,
    kwargs: dict,
    state: tuple,
    static_names: Sequence[str],
    static_nums: Sequence[int],
    padding: Any,
) -> dict:
    """The JSON description of one key's example call: its arguments' specs (placeholders for
    what the caller supplies), its execution state, its bucket."""
    walk = _Recording(padding)
    positional: List[dict] = []
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"args[{i}]"
        spec = walk.spec(a, i in static_nums or name in static_names)
        positional.append(spec or _placeholder(name, a))
    keywords = {k: walk.spec(v, k in static_names) or _placeholder(k, v) for k, v in kwargs.items()}
    return {
        "args": positional,
        "kwargs": keywords,
        "state": record_state(state),
        "bucket": None if padding is None else padding.bucket,
    }


def _zeros(spec: dict) -> Tensor:
    """A tensor of the spec's shape, strides, dtype and device, all zeros."""
    shape, stride = spec["shape"], spec["stride"]
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    dtype, device = _dtype(spec["dtype"]), torch.device(spec["device"])
    t = torch.zeros(extent, dtype=dtype, device=device).as_strided(shape, stride)
    return t.requires_grad_() if spec["requires_grad"] else t


def _built(spec: dict) -> Any:
    ((kind, body),) = spec.items()
    if kind == "tensor":
        return _zeros(body)
    if kind == "value":
        return body
    if kind == "float":
        return float.fromhex(body)
    if kind == "dtype":
        return _dtype(body)
    if kind == "dict":
        return {_built(k): _built(v) for k, v in body}
    if kind in ("tuple", "list"):
        items = [_built(s) for s in body]
        return tuple(items) if kind == "tuple" else items
    raise ValueError(f"an argument spec of kind {kind!r}, which this autograph does not know")


def placeholders(record: dict) -> List[str]:
    """The names of the arguments the caller supplies for this record."""
    return [s["object"] for s in [*record["args"], *record["kwargs"].values()] if "object" in s]


def rebuilt_call(record: dict, objects: Mapping[str, Any]) -> Tuple[tuple, dict]:
    """The example call of ``record``: zeros for its tensors, its values, and ``objects`` (by
    argument name) for its placeholders; ``KeyError`` names a missing one."""

    def value(spec: dict) -> Any:
        return objects[spec["object"]] if "object" in spec else _built(spec)

    return (
        tuple(value(s) for s in record["args"]),
        {k: value(s) for k, s in record["kwargs"].items()},
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def entered_state(state: Dict[str, Any]) -> Iterator[None]:
    """The recorded grad or inference mode, autocast, current CUDA device and default dtype
    (a module's ``training`` flag is its caller's: ``_warm_restart``)."""
    with contextlib.ExitStack() as stack:
        if state["inference"]:
            stack.enter_context(torch.inference_mode())
        else:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.set_grad_enabled(state["grad"]))
        for device_type, dtype in state["autocast"].items():
            if dtype is not None or torch.is_autocast_enabled(device_type):
                stack.enter_context(
                    torch.autocast(
                        device_type, dtype=_dtype(dtype or "float16"), enabled=dtype is not None
                    )
                )
        if torch.cuda.is_available() and state["device"] >= 0:
            stack.enter_context(torch.cuda.device(state["device"]))
        stack.enter_context(_default_dtype(_dtype(state["default_dtype"])))
        yield
