"""Every rank decides alike (docs/design.md, "Ranks"): a key whose calls run collectives is graphed
on every rank of their process groups, or on none.

>>> watch = CollectiveWatch()
>>> with watch:                              # the last warmup call
...     step(x)                              # runs dist.all_reduce(...)
>>> agreed_failure(watch.groups, None)       # after the capture, on every rank
'rank 1 could not graph it, and every rank of its process group must decide alike ...'

A capture records collectives without running them, and a replay or an eager call runs each
once, so a key graphed on one rank and eager on another still matches collectives call for
call. What the ranks must agree on is the decision itself: with ``strict=True`` a rank whose
capture fails raises while the others would go on into a collective and wait for it forever;
and a rank left eager is the slow rank every step. So at the one point where a key's fate is
decided (after its capture, success or not) each rank of every group its warmup used posts
its verdict in the process group's store and reads the others'; a key graphed here but not on
another rank runs eagerly here too, with that rank named. Only keys whose warmup ran a
collective pay for it, once per capture.

The votes go through the store (the rendezvous's key-value store), not a collective: a vote
never pairs with a user's collective, whatever the ranks do in between. Votes are matched by
their order in each group (the n-th capture decision of a rank with the n-th of the others),
which holds for SPMD code; a rank whose vote does not come within ``VOTE_TIMEOUT`` is taken to
have failed, and this rank's vote is turned into a failure, so that it too decides eagerly.
"""

from __future__ import annotations

import datetime
import itertools
import threading
from typing import Any, Dict, List, Optional

import torch

from .._config import logger
from ..watch._modes import CompiledCodeRunsUnder

# Namespaces of the ops that torch.distributed's collectives reach the dispatcher as: the
# process-group API (dist.all_reduce) and the functional collectives (tensor parallelism).
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})

# How long a rank waits for the others' votes on one capture.
VOTE_TIMEOUT = datetime.timedelta(seconds=60)

_OK, _FAILED = b"ok", b"failed"
_votes: Dict[tuple, "itertools.count[int]"] = {}  # per group: the number of this rank's votes
_votes_lock = threading.Lock()


def distributed_is_on() -> bool:
    """Whether a default process group exists: only then can a call run collectives."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized()


def _group_of(func: Any, args: tuple, kwargs: dict) -> Any:
    """The process group a collective op runs on, or None if it names none this code knows."""
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _resolve_process_group

    named = zip(func._schema.arguments, args)
    for argument, value in [
        *named,
        *((a, kwargs[a.name]) for a in func._schema.arguments if a.name in kwargs),
    ]:
        if isinstance(value, ProcessGroup):
            return value
        if argument.name == "process_group" and hasattr(ProcessGroup, "unbox"):
            return ProcessGroup.unbox(value)  # the op's TorchBind handle (torch >= 2.2)
        if argument.name == "group_name" and isinstance(value, str):
            return _resolve_process_group(value)
    return None


class CollectiveWatch(CompiledCodeRunsUnder):
    """The process groups a call's collectives ran on, in the order of their first use."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: List[Any] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            group = _group_of(func, args, kwargs)
            if group is not None and all(group is not known for known in self.groups):
                self.groups.append(group)
        return func(*args, **kwargs)


def _vote(group: Any, failed: bool) -> Optional[int]:
    """Post this rank's vote on its next capture decision in ``group`` and read the others';
    the global rank of the first that failed (or did not vote in time), or None."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    ranks = tuple(dist.get_process_group_ranks(group))
    with _votes_lock:
        number = next(_votes.setdefault(ranks, itertools.count()))
    store = _get_default_store()
    prefix = f"autograph/vote/{','.join(map(str, ranks))}/{number}/"
    me = dist.get_rank()
    store.set(prefix + str(me), _FAILED if failed else _OK)
    for rank in ranks:
        if rank == me:
            continue
        try:
            store.wait([prefix + str(rank)], VOTE_TIMEOUT)
            vote = store.get(prefix + str(rank))
        except RuntimeError:  # no vote in time: that rank is not deciding this key now
            logger.warning(
                "autograph: rank %d did not vote on a capture within %s; this "
                "rank runs the key eagerly",
                rank,
                VOTE_TIMEOUT,
            )
            store.set(prefix + str(me), _FAILED)
            return rank
        if vote != _OK:
            return rank
    return None


def agreed_failure(groups: List[Any], failure: Optional[str]) -> Optional[str]:
    """Tell the other ranks of ``groups`` whether this rank graphed the key (``failure`` is
    None) and return why it must run eagerly: this rank's ``failure``, or the first other rank
    that could not graph it. Every rank of these groups must call this for the same key, as
    SPMD code does; with several groups, each is asked in the order the warmup used them."""
    for group in groups:
        other = _vote(group, failure is not None)
        if failure is None and other is not None:
            failure = (
                f"rank {other} could not graph it, and every rank of its process "
                f"group must decide alike (a graph on some ranks and eager calls on "
                f"others make the eager ranks the slow ones, and under strict=True "
                f"would leave ranks waiting); see that rank's warning for the cause"
            )
    return failure
