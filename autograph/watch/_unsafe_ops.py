"""Which ATen ops a CUDA graph cannot capture, judged one op at a time (the guard's dispatch
mode asks, ``_guard``), and the facts about an op that the judgement needs.

>>> unsafe_op(torch.ops.aten.nonzero.default, (x,), {}, "cuda")
('torch.nonzero (or one-argument torch.where)', 'returns a shape that depends on ...')

An op's schema, tags and kernel registrations are read once per op (``traits_of``): a watched
run asks for every op it makes, and reading them each time was most of the guard's own cost.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Container, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from ._host_calls import SYNC_CONSEQUENCE as _SYNC_CONSEQUENCE
from ._modes import tensors_in

_aten = torch.ops.aten

_DATA_DEPENDENT_NAMES = {
    "nonzero": "torch.nonzero (or one-argument torch.where)",
    "argwhere": "torch.argwhere",
    "masked_select": "torch.masked_select",
    "index": "boolean-mask indexing",
    "index_put": "boolean-mask assignment",
    "_unique2": "torch.unique",
    "unique_dim": "torch.unique",
    "unique_consecutive": "torch.unique_consecutive",
    "repeat_interleave": "torch.repeat_interleave without output_size",
}
# A graph replays GPU work only: CPU results, and CPU values passed to GPU kernels, are
# frozen at capture. Making a constant (torch.tensor([...])) is not computing.
_CPU_CONSTANT_OPS = (
    _aten.lift_fresh,
    _aten.lift,
    _aten.lift_fresh_copy,
    _aten.detach,
    _aten.clone,
    _aten.empty_like,
    _aten.zeros_like,
    _aten.ones_like,
)
CPU_OPERATION = "computing with a CPU tensor"
CPU_CONSEQUENCE = (
    "runs on the CPU, or feeds a CPU value to the GPU, which a graph freezes "
    "at capture: make the tensor on the GPU (device=...), or pass it as an "
    "argument"
)

# Indexing is capturable with integer indices; a boolean mask becomes nonzero() inside.
_INDEX_OPS = {
    "index": "index",
    "index_put": "index_put",
    "index_put_": "index_put",
    "_index_put_impl_": "index_put",
    "_unsafe_index_put": "index_put",
}
_SHAPE_CONSEQUENCE = (
    "returns a shape that depends on the data, which needs the host to wait: "
    "use a fixed-shape form (torch.where(mask, x, 0) or x * mask instead of "
    "x[mask]), or run it outside the graphed function"
)


def is_view(func: Any) -> bool:
    """Whether an ATen op returns an alias of an input (``OpOverload.is_view`` is newer)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


# Op names whose CUDA kernels may come from cuDNN; composite ones by their own names too (under
# inference_mode a warmup sees them whole): instance_norm is a batch norm inside, grid_sampler,
# affine_grid and ctc_loss have cuDNN parts.
_CUDNN_OPS = (
    "conv",
    "cudnn",
    "batch_norm",
    "rnn",
    "lstm",
    "gru",
    "instance_norm",
    "grid_sampler",
    "affine_grid",
    "ctc_loss",
)
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
# Composite ops whose parts, for any arguments, are views and arithmetic on the arguments'
# own device: judged whole, what their parts would show (a CPU tensor computed on) shows on
# the whole. They were 232 of the 250 composite ops an HF Llama decode step makes under
# inference_mode, each taken apart at a cost (docs/design.md, "The guard"). Not ``to`` in
# general (to a device copies between devices), nor ``type_as`` (to another tensor's device);
# and not with a CPU tensor while graphing another device (``judged_apart``).
_WHOLE_COMPOSITES = (
    _aten.reshape.default,
    _aten.linear.default,
    _aten.matmul.default,
    _aten.to.dtype,
)


class _Traits(NamedTuple):
    """What the guard asks of an op that its schema and registrations answer once."""

    host_read: bool  # tagged data_dependent_output
    copy: Any  # the overload packet of a copy between devices, or None
    cpu_checked: bool  # whether a CPU tensor among its arguments is a CPU operation
    index: Optional[str]  # its _INDEX_OPS entry
    dynamic_shape: bool  # tagged dynamic_output_shape
    name: str
    cudnn: bool  # whose CUDA kernels may come from cuDNN
    composite: bool  # with a CompositeImplicitAutograd kernel
    judged_whole: bool  # a composite op the guard judges whole (_WHOLE_COMPOSITES)


# Per op: asked for every op of a watched run or a capture; an op's schema, tags and
# registrations do not change while it runs (a process-wide cache of facts, no state).
TRAITS: Dict[Any, _Traits] = {}


def traits_of(func: Any) -> _Traits:
    packet, tags = func.overloadpacket, func.tags
    name = packet.__name__
    traits = TRAITS[func] = _Traits(
        host_read=torch.Tag.data_dependent_output in tags,
        copy=packet if packet in (_aten._to_copy, _aten.copy_, _aten._copy_from) else None,
        cpu_checked=not is_view(func) and packet not in _CPU_CONSTANT_OPS,
        index=_INDEX_OPS.get(name),
        dynamic_shape=torch.Tag.dynamic_output_shape in tags,
        name=name,
        cudnn=any(part in func.__name__ for part in _CUDNN_OPS),
        composite=torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE),
        judged_whole=func in _WHOLE_COMPOSITES,
    )
    return traits


# Not torch.jagged: a nested tensor's ops reach the modes as ops on its strided parts.
SPARSE_LAYOUTS = (
    torch.sparse_coo,
    torch.sparse_csr,
    torch.sparse_csc,
    torch.sparse_bsr,
    torch.sparse_bsc,
)
_SPARSE_CONSEQUENCE = (
    "would be read by a graph at the addresses of its indices and values, which autograph "
    "does not watch (a sparse tensor rebound or made anew would replay the old one): make it "
    "dense (.to_dense()) or run the sparse op outside the graphed function"
)


def unsafe_op(
    func: Any,
    args: tuple,
    kwargs: dict,
    device_type: str,
    tensors: Optional[Sequence[torch.Tensor]] = None,
    numbers: Container[torch.Tensor] = (),
) -> Optional[Tuple[str, str]]:
    """(operation, consequence) when ``func`` cannot be captured on ``device_type``;
    ``tensors`` are those it is passed, when the caller has found them already; ``numbers``
    the CPU scalars made of Python numbers in the run, which a GPU op may take as it takes a
    Python number."""
    if tensors is None:
        tensors = list(tensors_in((*args, *kwargs.values())))
    for tensor in tensors:
        if tensor.layout in SPARSE_LAYOUTS:
            # Sparse state (a buffer, a global) and sparse tensors made inside: arguments are
            # refused by their key. Read by address without a storage to watch (_reads).
            return f"a {_layout_name(tensor)} tensor", _SPARSE_CONSEQUENCE
    traits = TRAITS.get(func) or traits_of(func)
    on_device = (traits.host_read or traits.index is not None or traits.dynamic_shape) and any(
        t.device.type == device_type and t not in numbers for t in tensors_in(args)
    )
    if traits.host_read and on_device:
        return "host read", _SYNC_CONSEQUENCE
    packet = traits.copy
    if packet is not None:
        if packet is _aten._to_copy:
            src, dst_type = args[0], torch.device(kwargs.get("device") or args[0].device).type
        else:
            src, dst_type = args[1] if packet is _aten.copy_ else args[0], args[0].device.type
            if packet is _aten._copy_from:
                dst_type = args[1].device.type
        if src.device.type == device_type and dst_type == "cpu" != device_type:
            return (
                ".cpu() / .tolist() / .to('cpu')",
                "copies GPU data to the host, which synchronises",
            )
        if (
            src.device.type == "cpu"
            and dst_type == device_type != "cpu"
            and src.numel() > 0
            and not src.is_pinned()
        ):
            return (
                "a copy from pageable host memory to the GPU",
                "cannot be captured: create the tensor on the GPU or pin it",
            )
        return None
    if device_type != "cpu" and traits.cpu_checked:
        on_the_cpu = [t for t in tensors_in(args) if t.device.type == "cpu"]
        if on_the_cpu and traits.index is not None:
            # Indices and values copied to the GPU inside the op, whatever made them
            # (x[i] = 7.0, x[torch.tensor(1)]): no Python number is taken as such there.
            if traits.index == "index_put":
                return _number_assigned(args, kwargs) or (CPU_OPERATION, CPU_CONSEQUENCE)
            return CPU_OPERATION, CPU_CONSEQUENCE
        if any(t not in numbers for t in on_the_cpu):
            return CPU_OPERATION, CPU_CONSEQUENCE
    name = traits.name
    if traits.index is not None and on_device:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return _DATA_DEPENDENT_NAMES[traits.index], _SHAPE_CONSEQUENCE
        return None
    if traits.dynamic_shape and on_device:
        if name == "repeat_interleave" and kwargs.get("output_size") is not None:
            return None
        return _DATA_DEPENDENT_NAMES.get(name, f"torch.{name}"), _SHAPE_CONSEQUENCE
    return None


def _layout_name(tensor: torch.Tensor) -> str:
    """``'sparse_coo'`` for a COO tensor: the layout as torch names it, without ``torch.``."""
    return str(tensor.layout).replace("torch.", "")


def _number_assigned(args: tuple, kwargs: dict) -> Optional[Tuple[str, str]]:
    """``x[index] = number`` on the GPU: torch makes the number a CPU tensor, which index_put_
    copies from pageable memory (a capture refuses it) or, for one boolean mask, hands to
    ``masked_fill_`` (a graph would freeze it: it may be state, not the literal). None when
    the index or the value is not of that kind, or when it accumulates (no assignment)."""
    target = args[0] if args else kwargs.get("self")
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate or not (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.dim() == 0
        and isinstance(target, torch.Tensor)
        and target.device.type != "cpu"
        and all(i is None or i.device.type != "cpu" for i in indices)
    ):
        return None
    if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return (
            "x[mask] = number",
            "passes the number as a CPU tensor, whose value a graph "
            "freezes at capture: write x.masked_fill_(mask, number) with a bool mask of "
            "x's shape (a mask over x's leading dims as mask[..., None])",
        )
    return (
        "x[index] = number",
        "copies the number from the host to the GPU, which a CUDA "
        "graph cannot capture: write x.index_fill_(dim, index, number), or "
        "x[index] = x.new_full((), number)",
    )


_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


def composite_keys(func: Any, tensors: Sequence[torch.Tensor]) -> Optional[Any]:
    """The dispatch keys to run a composite op's own kernel with, or None to run it whole;
    ``tensors`` are those it is passed.

    >>> composite_keys(torch.ops.aten.is_nonzero.default, [torch.ones(())])
    DispatchKeySet(CPU)

    Autograd normally decomposes composite ops before any dispatch mode sees them; under
    ``torch.inference_mode()`` (and for inference tensors) they reach the mode whole.
    Tensor subclasses keep the whole op: their own ``__torch_dispatch__`` may handle it.
    """
    if not (TRAITS.get(func) or traits_of(func)).composite:
        return None
    keys = [torch._C._dispatch_keys(t) for t in tensors]
    if not keys or any(k.has(torch._C.DispatchKey.Python) for k in keys):
        return None
    below = functools.reduce(operator.or_, keys) & _BELOW_PYTHON
    # An op with a kernel of its own for these tensors (silu_backward) is no composite here:
    # run whole, it stays visible to the modes below this one (the CPU emulation's recorder).
    if torch._C._dispatch_has_kernel_for_any_dispatch_key(func.name(), below):
        return None
    return below


def judged_apart(func: Any, tensors: Sequence[torch.Tensor], device_type: str) -> Optional[Any]:
    """``composite_keys`` for the guard graphing ``device_type``, which judges
    ``_WHOLE_COMPOSITES`` whole (None) unless one of their tensors is a CPU tensor while it
    graphs another device: a reshape that copies a CPU tensor computes, and its schema says
    only that its result may alias (a view is no CPU work)."""
    if (TRAITS.get(func) or traits_of(func)).judged_whole and (
        device_type == "cpu" or not any(t.is_cpu for t in tensors)
    ):
        return None
    return composite_keys(func, tensors)
