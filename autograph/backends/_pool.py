"""One owner per memory pool: its device, the static outputs handed out of it, stream order.

>>> pools = Pools()
>>> pool = pools.get(CUDA, device=0)      # created on first use, one per device
>>> pool.before_replay()                  # order after the last replay; stale outputs raise

Graphs of one function (per instance, for methods) or of one region share a pool: a graph
captured later may reuse blocks that an earlier graph used as scratch. Two consequences live
here, because only the pool sees every graph in it:
- a static output handed out by one graph can be overwritten by the replay of *another*
  graph of the pool, so every replay poisons every static output handed out before it;
- one graph's memory must not be used by two streams at once, so a replay on a new stream
  first waits for the stream of the previous replay in the pool;
- a replay, from that wait to the copy of its outputs, is one step in the pool's order: a
  replay of another graph issued in between (from another thread: a region's modules each
  have their cache and its lock, and a training graph's backward runs in autograd's thread)
  would overwrite an output or an activation before it is read, on one stream as on two. So
  every replay holds the pool's ``lock`` from its wait to its copy.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Optional

import torch

from ._streams import current_stream


class Pool:
    """The memory pool of one owner on one device."""

    def __init__(self, backend: Any, device: int):
        self.backend = backend
        self.device = device
        self.handle = backend.new_pool(device)
        self.graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the live graphs in it
        # Output plans that handed out static aliases, held weakly: a plan dies with its
        # graph, which poisons its own aliases then. A dict: its emptiness is one cheap test
        # on every replay.
        self.static_plans: Dict[int, "weakref.ref[Any]"] = {}
        self.last_stream: Any = None
        self.last_raw_stream: Optional[int] = None
        self._switch_event: Any = None  # made at the first switch of streams
        # Held by every replay from its stream order to its outputs' copy; re-entrant: a
        # bucket's probe replays again inside its own hold.
        self.lock = threading.RLock()
        # Whether a replay has work to do first (``before_replay``): read inline on the replay
        # path, so that a pool with nothing to do costs no call.
        self.on_cuda = backend.device_type == "cuda"

    def handle_for_capture(self) -> Any:
        """The pool handle a new capture goes into.

        Once no graph of a pool is alive, torch may keep the pool's bookkeeping with a use
        count of zero until its blocks are freed, and a capture into it then fails an
        internal assertion (seen on torch 2.11 after a capture that the user's own exception
        ended): such a pool is left to be freed, and captures go to a new one.
        """
        if not self.graphs:
            self.handle = self.backend.new_pool(self.device)
        return self.handle

    def before_replay(self) -> None:
        """Run before every replay (the capture call's included) of a graph of this pool,
        under ``lock``; the replay path may skip it when neither ``static_plans`` nor
        ``on_cuda`` is set."""
        if self.static_plans:
            for key, plan_ref in list(self.static_plans.items()):
                plan = plan_ref()
                if plan is None:
                    del self.static_plans[key]
                else:
                    plan.poison()
        # Private, on every replay: the public ``current_stream(device).cuda_stream`` makes a
        # Stream object per call (docs/design.md, "Private torch APIs").
        if self.on_cuda:
            raw = torch._C._cuda_getCurrentRawStream(self.device)
            if raw != self.last_raw_stream:
                self._order_after_last_stream(raw)

    def _order_after_last_stream(self, raw: int) -> None:
        """A replay on a stream other than the last replay's waits for that one first.

        Through one event per pool, recorded again at each switch (a wait orders after the
        record made before it; later records do not move it): ``Stream.wait_stream`` makes,
        records and destroys a new event each time, about 25 us of host time on an H100's
        host, and a training step switches twice (its forward replays on the caller's stream,
        its backward on autograd's)."""
        current = current_stream(self.device)
        if self.last_stream is not None:  # under ``lock``: no other record comes between
            if self._switch_event is None:
                self._switch_event = torch.cuda.Event()
            self._switch_event.record(self.last_stream)
            self._switch_event.wait(current)
        self.last_stream, self.last_raw_stream = current, raw


class Pools:
    """The pools of one owner (a graphed function, a graphed instance or a region)."""

    def __init__(self) -> None:
        self._pools: Dict[int, Pool] = {}
        self._lock = threading.Lock()

    def get(self, backend: Any, device: int) -> Pool:
        pool = self._pools.get(device)
        if pool is None:
            with self._lock:
                pool = self._pools.get(device)
                if pool is None:
                    pool = self._pools[device] = Pool(backend, device)
        return pool

    def clear(self) -> None:
        with self._lock:
            self._pools.clear()
