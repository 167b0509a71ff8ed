"""Buckets (docs/design.md, "Buckets"): a call of size B replays the graph of the smallest capture
size >= B, its inputs padded, its outputs sliced back.

>>> rule = BucketRule(buckets=(1, 2, 4, 8), explicit=None)
>>> padding, reason = rule.padding(names, args, kwargs, tensors, addressed)
>>> padding.rows, padding.bucket, padding.dims       # 3 real rows replay the graph of 4
(3, 4, ((0, 0), None))

By default the call's size is dim 0 of its first tensor, and every tensor whose dim 0 has that
size is padded with zeros; ``bucket_args={"ids": 0, "mask": (0, pad)}`` names the arguments,
dims and pad values instead. Which output dims are sliced back to the call's size is decided
from the runs of the key's family (``_batch_dims``): keys equal but for the padded size and
their per-bucket state. The result is cached per call key, so a call pays for this once per
distinct shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..capture._keys import call_key
from ..capture._outputs import flatten_arguments

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Padding:
    """How one call shape maps onto its bucket's graph."""

    rows: int  # the call's size
    bucket: int  # the capture size it replays
    dims: Tuple[Optional[Tuple[int, Any]], ...]  # per tensor: (dim, pad value), or None
    # The output shapes of the key's family, by run size (which output dims follow the batch).
    shapes: Any = dataclasses.field(default=None, compare=False)
    # It has per-bucket state (an argument used by address, an object keyed by identity):
    # every run of its function sees the padded arguments.
    stateful: bool = False

    @property
    def runs_as_called(self) -> bool:
        """Whether the call has pad rows and its function runs on its arguments as called
        (no per-bucket state): that run is the truth a replay with pad rows is checked
        against, and a capture that raised on the padded arguments only is the padding's."""
        return self.rows != self.bucket and not self.stateful

    def padded_shape(self, tensor: Tensor, index: int) -> torch.Size:
        spec = self.dims[index]
        if spec is None:
            return tensor.shape
        shape = list(tensor.shape)
        shape[spec[0]] = self.bucket
        return torch.Size(shape)


class BucketRule:
    """The capture sizes of one function and how to find a call's size."""

    def __init__(
        self, buckets: Tuple[int, ...], explicit: Optional[Tuple[Tuple[str, int, Any], ...]]
    ):
        self.buckets = buckets
        self.explicit = {name: (dim, pad) for name, dim, pad in explicit} if explicit else None

    def padding(
        self,
        names: Sequence[str],
        args: tuple,
        kwargs: dict,
        tensors: Sequence[Tensor],
        addressed: Sequence[int],
    ) -> Tuple[Optional[Padding], Optional[str]]:
        """(how to pad this call, None), or (None, why it runs eagerly)."""
        specs = self._specs(names, args, kwargs, tensors, addressed)
        if isinstance(specs, str):
            return None, specs
        first = next((i for i, s in enumerate(specs) if s is not None), None)
        if first is None:
            return None, "it has no tensor to pad to a bucket"
        dim = specs[first][0]
        rows = tensors[first].shape[dim]
        if rows == 0:  # nothing to pad, and no run of 0 rows says which output dims follow
            return None, "it has 0 rows: an empty batch runs as called"
        for i, spec in enumerate(specs):
            if spec is not None and tensors[i].shape[spec[0]] != rows:
                return None, (
                    f"its padded arguments disagree on the size: {rows} and "
                    f"{tensors[i].shape[spec[0]]}; name them in bucket_args"
                )
        bucket = next((size for size in self.buckets if size >= rows), None)
        if bucket is None:
            return None, (
                f"its size {rows} is above the largest of buckets={list(self.buckets)}"
                f"; add a larger bucket to graph it"
            )
        return Padding(rows, bucket, tuple(specs)), None

    def _specs(
        self,
        names: Sequence[str],
        args: tuple,
        kwargs: dict,
        tensors: Sequence[Tensor],
        addressed: Sequence[int],
    ) -> Any:
        skipped = set(addressed)
        if self.explicit is None:
            first = next((t for i, t in enumerate(tensors) if i not in skipped and t.dim()), None)
            if first is None:
                return [None] * len(tensors)
            rows = first.shape[0]
            return [
                (0, 0) if i not in skipped and t.dim() and t.shape[0] == rows else None
                for i, t in enumerate(tensors)
            ]
        owners = _tensor_owners(names, args, kwargs)
        unknown = sorted(set(self.explicit) - set(owners) - set(names) - set(kwargs))
        if unknown:
            return f"bucket_args names {unknown}, which are not its arguments"
        specs: List[Optional[Tuple[int, Any]]] = []
        for i, owner in enumerate(owners):
            spec = self.explicit.get(owner) if i not in skipped else None
            if spec is not None and not -tensors[i].dim() <= spec[0] < tensors[i].dim():
                return (
                    f"bucket_args[{owner!r}] pads dim {spec[0]}, but {owner} has "
                    f"{tensors[i].dim()} dims"
                )
            specs.append(None if spec is None else (spec[0] % tensors[i].dim(), spec[1]))
        return specs


def _tensor_owners(names: Sequence[str], args: tuple, kwargs: dict) -> List[str]:
    """The name of the top-level argument each tensor of the call belongs to, in key order."""
    owners: List[str] = []
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"args[{i}]"
        owners += [name] * sum(isinstance(leaf, Tensor) for leaf in flatten_arguments(a)[0])
    for k, v in kwargs.items():
        owners += [k] * sum(isinstance(leaf, Tensor) for leaf in flatten_arguments(v)[0])
    return owners


def bucket_key(
    args: tuple,
    kwargs: dict,
    state: tuple,
    names: Sequence[str],
    static_names: Sequence[str],
    static_nums: Sequence[int],
    padding: Padding,
) -> Any:
    """The key of the bucket's graph: the call keyed with each padded tensor at the shape of
    its static, and the padding's choice of tensors.

    >>> bucket_key((ids,), {}, state, ["ids"], (), (), padding)     # 3 rows, bucket 4
    ((1, (torch.Size([4, 16]), (16, 1), torch.int64, ...), state), ((0, 0),))

    The padded tensors are part of the key: with the default rule a tensor whose dim 0
    happens to equal the call's size is padded too, and a graph serves one such choice.
    """
    resize = {
        i: (spec[0], padding.bucket) for i, spec in enumerate(padding.dims) if spec is not None
    }
    keyed = call_key(args, kwargs, state, names, static_names, static_nums, resize)
    return keyed.key, padding.dims


def resized_examples(tensors: Sequence[Tensor], padding: Padding, size: int) -> Dict[int, Tensor]:
    """Example tensors of ``size`` rows made from a call's (for ``capture()``): the first
    rows, or all of them padded with the pad value."""
    made: Dict[int, Tensor] = {}
    for i, spec in enumerate(padding.dims):
        if spec is None:
            continue
        dim, pad = spec
        t = tensors[i]
        if size <= t.shape[dim]:
            made[i] = t.narrow(dim, 0, size).clone()
        else:
            shape = list(t.shape)
            shape[dim] = size - t.shape[dim]
            made[i] = torch.cat([t, t.new_full(shape, pad)], dim)
    return made


class _PerBucket:
    """Stands in, in a family's key, for an object each bucket has its own of (a KV cache)."""

    def __eq__(self, other: Any) -> bool:
        return type(other) is _PerBucket

    def __hash__(self) -> int:
        return hash(_PerBucket)


# The size a family's key gives every padded dim: one family holds every bucket's keys.
_ANY_SIZE = -1


def family_key(
    args: tuple,
    kwargs: dict,
    state: tuple,
    names: Sequence[str],
    static_names: Sequence[str],
    static_nums: Sequence[int],
    padding: Padding,
) -> Tuple[Any, bool]:
    """The key shared by a bucketed call's family (keys equal but for the padded size and the
    objects used by address or identity, each bucket's own KV cache), and whether the call
    has such per-bucket objects.

    >>> family_key((ids, cache_of_4), {}, state, ["ids", "cache"], ("cache",), (), padding)
    ((..., (torch.Size([-1, 16]), ...), ...), True)

    Made by keying the call again with those objects replaced by one marker, so that no key
    is ever decoded.
    """
    keyed = call_key(args, kwargs, state, names, static_names, static_nums)
    per_bucket = {id(keyed.tensors[i]) for i in keyed.addressed}
    per_bucket |= {id(obj) for obj in keyed.identities}
    if not per_bucket:
        resize = {
            i: (spec[0], _ANY_SIZE) for i, spec in enumerate(padding.dims) if spec is not None
        }
        return call_key(args, kwargs, state, names, (), (), resize).key, False
    leaves, rebuild = flatten_arguments((args, kwargs))
    kept = iter(range(len(keyed.tensors)))
    resize, index = {}, 0
    replaced = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            spec = padding.dims[next(kept)]
            if id(leaf) in per_bucket:
                leaf = _PerBucket()
            else:
                if spec is not None:
                    resize[index] = (spec[0], _ANY_SIZE)
                index += 1
        elif id(leaf) in per_bucket:
            leaf = _PerBucket()
        replaced.append(leaf)
    family_args, family_kwargs = rebuild(replaced)
    return call_key(family_args, family_kwargs, state, names, (), (), resize).key, True


def padded_arguments(
    args: tuple, kwargs: dict, tensors: Sequence[Tensor], padding: Padding, size: int
) -> Tuple[tuple, dict, Dict[int, Tensor]]:
    """The call's arguments with each padded tensor resized to ``size`` rows
    (``resized_examples``), and those tensors by index.

    >>> args, kwargs, padded = padded_arguments((x,), {}, [x], padding, 4)   # x: 3 rows
    >>> args[0].shape[0], list(padded)
    (4, [0])
    """
    resized = resized_examples(tensors, padding, size)
    leaves, rebuild = flatten_arguments((args, kwargs))
    index = iter(range(len(tensors)))
    new_args, new_kwargs = rebuild(
        [resized.get(next(index), leaf) if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    )
    return new_args, new_kwargs, resized
