"""One key's life (its phase, counters and graph) and the bounded cache of keys.

>>> cache = KeyCache("step")
>>> entry = cache.add(key, Entry("x: f32[8] cuda:0", options, CUDA, 0), identities)
>>> entry.phase
'warmup'

Phases: ``warmup`` (eager calls, the last one watched), ``capture`` (the next call records
the graph), ``graphed`` (calls replay), ``eager`` (every call runs eagerly, for the reason
said). A cache holds at most ``max_keys`` keys: past that, the oldest keys without a graph are
forgotten (keys with graphs are bounded by ``max_graphs``). Objects a key refers to by
identity are held weakly where Python allows: when one dies, its keys are forgotten, so a
new object that reuses its ``id`` can never meet a graph made for the old one.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

from ._config import Options
from ._pool import Pools
from ._stats import KeyStats

WARMUP, CAPTURE, GRAPHED, EAGER = "warmup", "capture", "graphed", "eager"


class Entry:
    """One key of one cache."""

    __slots__ = ("label", "parts", "options", "backend", "device", "phase", "calls",
                 "eager_calls", "replays", "warmups", "recaptures", "reason", "strict_error",
                 "graph", "written", "uses_cudnn", "warmup_thread", "strong_identities",
                 "identity_ids", "bucket", "sizes", "trains", "verify_left", "verified",
                 "warmup_shapes", "groups", "__weakref__")

    def __init__(self, label: str, parts: List[str], options: Options, backend: Any,
                 device: int, bucket: Optional[int] = None):
        self.label = label
        self.parts = parts  # the label's pieces, to say what differs between two keys
        self.options = options
        self.backend = backend
        self.device = device
        self.phase = WARMUP
        self.calls = self.eager_calls = self.replays = self.warmups = self.recaptures = 0
        self.reason: Optional[str] = None
        self.strict_error: Optional[str] = None  # raised on every call under strict=True
        self.graph: Any = None
        self.written: List[int] = []  # arguments the warmup wrote to
        self.uses_cudnn = False  # seen at warmup: a capture thread needs a cuDNN handle
        self.warmup_thread: Optional[int] = None  # the thread whose handles the warmup made
        self.strong_identities: list = []  # identity-keyed objects that have no weakref
        self.identity_ids: List[int] = []  # ids of the objects it keys by identity, held weakly
        # The output shapes of the watched warmup, run at the call's real size: for a bucket,
        # they tell which outputs follow the padded dimension.
        self.warmup_shapes: Optional[List[Any]] = None
        self.bucket = bucket  # the capture size, for a bucketed key
        self.trains = False  # its outputs need gradients: forward and backward are graphed
        # The process groups its warmup ran collectives on: their ranks agree on its capture.
        self.groups: List[Any] = []
        self.sizes: Dict[int, int] = {}  # a bucket's calls by their real size
        # Verify mode: replays still to check against an eager run, set at each capture (the
        # replay path tests this one attribute); replays found to match.
        self.verify_left = self.verified = 0

    def stats(self, function: str) -> KeyStats:
        graph = self.graph
        return KeyStats(
            function=function, key=self.label,
            state=WARMUP if self.phase == CAPTURE else self.phase,
            calls=self.calls, eager_calls=self.eager_calls, replays=self.replays,
            capture_seconds=graph.capture_seconds if graph else None,
            graph_bytes=graph.memory_bytes if graph else 0,
            fallback_reason=self.reason, bucket=self.bucket, sizes=dict(self.sizes) or None,
            verified=self.verified)


def _object_died(cache_ref: "weakref.ref[KeyCache]", object_id: int, keys: Set[Any]) -> None:
    cache = cache_ref()
    if cache is not None:
        cache._watchers.pop(object_id, None)
        cache.dead_keys.extend(keys)


class KeyCache:
    """The keys of one graphed function, or of one instance for a graphed method."""

    def __init__(self, name: str, max_keys: int = 256):
        self.name = name
        self.max_keys = max_keys
        self.entries: Dict[Any, Entry] = {}
        # Bucketed functions: call key -> (entry key, padding, reason to run eagerly).
        self.routes: Dict[Any, Any] = {}
        self.lock = threading.RLock()
        self.pools = Pools()
        self.said: set = set()  # notices given once per cache
        # Keys whose identity-keyed object died: forgotten before the next lookup, so that a
        # new object reusing the dead one's id never meets its graph.
        self.dead_keys: List[Any] = []
        # One finalizer per live identity-keyed object, with the keys that name it.
        self._watchers: Dict[int, Tuple[Any, Set[Any]]] = {}

    def add(self, key: Any, entry: Entry, identities: list) -> Entry:
        self.forget_dead()
        for obj in identities:
            watcher = self._watchers.get(id(obj))
            if watcher is None:
                try:
                    keys: Set[Any] = set()
                    watcher = self._watchers[id(obj)] = (weakref.finalize(
                        obj, _object_died, weakref.ref(self), id(obj), keys), keys)
                except TypeError:
                    entry.strong_identities.append(obj)
                    continue
            watcher[1].add(key)
            entry.identity_ids.append(id(obj))
        self.entries[key] = entry
        if len(self.entries) > self.max_keys:
            self._evict()
        return entry

    def _drop(self, key: Any) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        if entry.graph is not None:
            entry.graph.release()
        for object_id in entry.identity_ids:
            watcher = self._watchers.get(object_id)
            if watcher is not None:
                watcher[1].discard(key)
                if not watcher[1]:
                    watcher[0].detach()
                    del self._watchers[object_id]

    def graphs(self) -> int:
        return sum(e.graph is not None for e in self.entries.values())

    def _evict(self) -> None:
        # Oldest first (dicts keep insertion order); keys with a graph stay.
        for key in [k for k, e in self.entries.items() if e.graph is None]:
            if len(self.entries) <= self.max_keys:
                break
            self._drop(key)

    def forget_dead(self) -> None:
        """Drop the keys of identity-keyed objects that died (and routes, which may name them)."""
        if self.dead_keys:
            self.routes.clear()
        while self.dead_keys:
            self._drop(self.dead_keys.pop())

    def stats(self) -> List[KeyStats]:
        with self.lock:
            self.forget_dead()
            return [entry.stats(self.name) for entry in self.entries.values()]

    def release(self) -> List[int]:
        """Drop every key and graph; return the devices whose graphs were freed."""
        with self.lock:
            devices = {e.device for e in self.entries.values() if e.graph is not None}
            for entry in self.entries.values():
                if entry.graph is not None:
                    entry.graph.release()
            self.entries.clear()
            self.routes.clear()
            self.pools.clear()
            self.said.clear()
            self.dead_keys.clear()
            for finalizer, _ in self._watchers.values():
                finalizer.detach()
            self._watchers.clear()
            return sorted(devices)
