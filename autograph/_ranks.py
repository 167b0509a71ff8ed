"""Every rank decides alike (SPEC 10): a key whose calls run collectives is graphed on every
rank of their process groups, or on none.

>>> watch = CollectiveWatch()
>>> with watch:                              # the last warmup call
...     step(x)                              # runs dist.all_reduce(...)
>>> agreed_failure(watch.groups, None)       # after the capture, on every rank
'rank 1 of its process group could not graph it, and every rank must decide alike ...'

A capture records collectives without running them, and a replay or an eager call runs each
once, so a key graphed on one rank and eager on another still matches collectives call for
call. What the ranks must agree on is the decision itself: with ``strict=True`` a rank whose
capture fails raises while the others would go on into a collective and wait for it forever;
and a rank left eager is the slow rank every step. So at the one point where a key's fate is
decided (after its capture, success or not) the ranks of each group its warmup used exchange
one small vector, and a key graphed here but not on another rank runs eagerly here too, with
that rank's reason. Only keys whose warmup ran a collective pay for it, once per capture.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Namespaces of the ops that torch.distributed's collectives reach the dispatcher as: the
# process-group API (dist.all_reduce) and the functional collectives (tensor parallelism).
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


def distributed_is_on() -> bool:
    """Whether a default process group exists: only then can a call run collectives."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized()


def _group_of(func: Any, args: tuple, kwargs: dict) -> Any:
    """The process group a collective op runs on, or None if it names none this code knows."""
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _resolve_process_group

    named = zip(func._schema.arguments, args)
    for argument, value in [*named, *((a, kwargs[a.name]) for a in func._schema.arguments
                                       if a.name in kwargs)]:
        if isinstance(value, ProcessGroup):
            return value
        if argument.name == "process_group" and hasattr(ProcessGroup, "unbox"):
            return ProcessGroup.unbox(value)  # the op's TorchBind handle (torch >= 2.2)
        if argument.name == "group_name" and isinstance(value, str):
            return _resolve_process_group(value)
    return None


class CollectiveWatch(TorchDispatchMode):
    """The process groups a call's collectives ran on, in the order of their first use."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.groups: List[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            group = _group_of(func, args, kwargs)
            if group is not None and all(group is not known for known in self.groups):
                self.groups.append(group)
        return func(*args, **kwargs)


def agreed_failure(groups: List[Any], failure: Optional[str]) -> Optional[str]:
    """Tell the other ranks of ``groups`` whether this rank graphed the key (``failure`` is
    None) and return why it must run eagerly: this rank's ``failure``, or the first other rank
    that could not graph it. Every rank of these groups must call this for the same key."""
    import torch.distributed as dist

    for group in groups:
        ranks = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        device = "cpu" if "gloo" in backend or not torch.cuda.is_available() \
            else torch.device("cuda", torch.cuda.current_device())
        failed = torch.zeros(ranks, dtype=torch.int32, device=device)
        if failure is not None:
            failed[dist.get_rank(group)] = 1
        dist.all_reduce(failed, group=group)
        if failure is None:
            others = [rank for rank, flag in enumerate(failed.tolist()) if flag]
            if others:
                global_rank = dist.get_global_rank(group, others[0]) \
                    if hasattr(dist, "get_global_rank") else others[0]
                failure = (f"rank {global_rank} of its process group could not graph it, "
                           f"and every rank must decide alike (a graph on some ranks and "
                           f"eager calls on others would wait on each other); see that "
                           f"rank's warning for the cause")
    return failure
