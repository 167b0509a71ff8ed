"""The bounded cache of one function's keys, and their weakly held identities.

>>> cache = KeyCache("step")
>>> life = cache.add(key, KeyLife(function, "step", label, parts, options, CUDA, 0), identities)
>>> cache.entries[key] is life
True

A cache holds at most ``max_keys`` keys: past that, the oldest keys without a graph are
forgotten (keys with graphs are bounded by ``max_graphs``). Objects a key refers to by
identity are held weakly where Python allows: when one dies, its keys are forgotten, so a
new object that reuses its ``id`` can never meet a graph made for the old one.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Set, Tuple

from .._config import Options
from .._stats import KeyStats
from ..backends._pool import Pools
from ..buckets._batch_dims import BatchShapes
from ..policy._churn import Churn
from ..policy._islands import island_rows
from ._key_life import KeyLife
from ._last_key import LastKey


def _object_died(cache_ref: "weakref.ref[KeyCache]", object_id: int, keys: Set[Any]) -> None:
    cache = cache_ref()
    if cache is not None:
        # In whichever thread dropped the object, at any point (a lock here could wait on a
        # thread that waits on this one): each step one C call, and readers take copies.
        cache._watchers.pop(object_id, None)
        cache.dead_keys.extend(keys)


class KeyCache:
    """The keys of one graphed function, or of one instance for a graphed method."""

    def __init__(self, name: str, max_keys: int = 256):
        self.name = name
        self.max_keys = max_keys
        self.entries: Dict[Any, KeyLife] = {}
        # Bucketed functions: call key -> (entry key, padding, reason to run eagerly).
        self.routes: Dict[Any, Any] = {}
        # Bucketed functions: family key -> the output shapes of its runs (``_batch_dims``).
        self.batch_shapes: Dict[Any, BatchShapes] = {}
        self.lock = threading.RLock()
        self.pools = Pools()
        self.said: set = set()  # notices given once per cache
        self.churn = Churn(name)  # whether calls pass through, unkeyed (``_churn``)
        # The key last replayed, tried first (``_last_key``), and those made so far by key.
        self.last: Any = None
        self._last_keys: Dict[Any, Any] = {}
        # Keys whose identity-keyed object died: forgotten before the next lookup, so that a
        # new object reusing the dead one's id never meets its graph.
        self.dead_keys: List[Any] = []
        # One finalizer per live identity-keyed object, with the keys that name it.
        self._watchers: Dict[int, Tuple[Any, Set[Any]]] = {}

    def add(self, key: Any, entry: KeyLife, identities: list) -> KeyLife:
        self.forget_dead()
        for obj in identities:
            watcher = self._watchers.get(id(obj))
            if watcher is None:
                try:
                    keys: Set[Any] = set()
                    watcher = self._watchers[id(obj)] = (
                        weakref.finalize(obj, _object_died, weakref.ref(self), id(obj), keys),
                        keys,
                    )
                except TypeError:
                    entry.strong_identities.append(obj)
                    continue
            watcher[1].add(key)
            entry.identity_ids.append(id(obj))
        self.entries[key] = entry
        if len(self.entries) > self.max_keys:
            self._evict()
        return entry

    def remember(
        self, key: Any, life: KeyLife, tensors: List[Any], state: tuple, options: Any
    ) -> None:
        """After a replay of a key of plain tensor arguments found by its Python key: the
        next call tries it first."""
        last = self._last_keys.get(key, self)
        if last is self:
            last = self._last_keys[key] = LastKey.of(key, life, tensors, state, options)
        self.last = last

    def _drop(self, key: Any) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        self._last_keys.pop(key, None)
        if self.last is not None and self.last.key == key:
            self.last = None
        graph = entry.graph  # read once: a region's budget may drop it from another thread
        if graph is not None:
            graph.release()
        for object_id in entry.identity_ids:
            watcher = self._watchers.get(object_id)
            if watcher is not None:
                watcher[1].discard(key)
                if not watcher[1]:
                    watcher[0].detach()
                    self._watchers.pop(object_id, None)

    def batch_shapes_of(self, family: Any, options: Options) -> BatchShapes:
        """The output shapes seen so far of a bucketed family's runs."""
        shapes = self.batch_shapes.get((family, options))
        if shapes is None:
            shapes = self.batch_shapes[(family, options)] = BatchShapes(options.bucket_outputs)
        return shapes

    def graphs(self) -> int:
        return sum(e.graph is not None for e in self.entries.values())

    def past_max_graphs(self, life: KeyLife) -> bool:
        """Whether ``life``'s key may not have a graph, because its function has max_graphs
        already; it then runs eagerly, said once per cache."""
        if self.graphs() < life.options.max_graphs:
            return False
        first = "max_graphs" not in self.said
        self.said.add("max_graphs")
        life.fall_back(
            f"{life.function.name} already has max_graphs={life.options.max_graphs} graphs; "
            f"raise max_graphs, or pad inputs to fewer shapes (buckets=)",
            warn=first,
        )
        return True

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
            key = self.dead_keys.pop()
            entry = self.entries.get(key)
            if entry is not None:
                self.churn.key_died(entry)
            self._drop(key)

    def stats(self, islands: bool = True) -> List[KeyStats]:
        """A row per key, each followed by its island's rows (``islands``)."""
        with self.lock:
            self.forget_dead()
            passed = self.churn.stats()
            return [
                row
                for entry in self.entries.values()
                for row in [entry.stats(), *(island_rows(entry) if islands else ())]
            ] + ([] if passed is None else [passed])

    def release_entries(self, lives: Set[int]) -> Set[int]:
        """Drop the keys whose lives have these ids; return their devices."""
        with self.lock:
            keys = [key for key, entry in self.entries.items() if id(entry) in lives]
            devices = {self.entries[key].device for key in keys}
            for key in keys:
                self._drop(key)
            return devices

    def release(self) -> List[int]:
        """Drop every key and graph, and those of its keys' islands; return the devices of
        its keys (for ``_engine.free``)."""
        with self.lock:
            islands = [e.island for e in self.entries.values() if e.island]
        devices = {device for island in islands for device in island.release_keys()}
        with self.lock:
            # Every key's device, graphed or not: a graph released before (a key gone eager)
            # may still hold its pool, from a reference cycle that ``free`` collects.
            devices |= {e.device for e in self.entries.values()}
            for entry in self.entries.values():
                if entry.graph is not None:
                    entry.graph.release()
            self.entries.clear()
            self.last = None
            self._last_keys.clear()
            self.routes.clear()
            self.batch_shapes.clear()
            self.pools.clear()
            self.said.clear()
            self.churn.reset()
            self.dead_keys.clear()
            for finalizer, _ in list(self._watchers.values()):  # a copy: see _object_died
                finalizer.detach()
            self._watchers.clear()
            return sorted(devices)
