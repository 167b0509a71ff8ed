"""Python values a graph was captured with, that the caller may change between calls: checked
before each replay (docs/design.md, "What a replay assumes").

>>> values = ValuesRead.of(["x", "past_key_values"], (x, cache), {}, step)  # at capture
>>> cache.reset()                    # transformers: clears cache.is_updated's flags
>>> values.same()                    # False: this call runs eagerly, and the graph stays
False
>>> values.changed()
'past_key_values.is_updated[0]: True -> False'

A replay runs none of the function's Python, so it takes every branch the capture took. What
the call itself changes is found at capture (``_python_state``: such a key runs eagerly);
what the caller changes between calls (``cache.reset()`` clears the flag that says whether
cross-attention K/V are computed or read; a global ``DEBUG = True``) is read here: the atoms
(``_python_values.is_atom``) held by the objects a call is keyed on by identity (an HF cache
and everything it holds: the containers of its arguments are in the key by value, new on every
call), by its default values, and by the globals and closure cells the code names, with the
lengths of the dicts and lists of atoms among them, and the attributes of a class the code
names (a global ``Cfg`` whose ``scale`` the caller sets) among the names its code uses. Each
place is one C-level read (``operator.itemgetter`` over a namespace), compared as one list:
1.7 us for the 8 places of a 2-layer ``EncoderDecoderCache`` on a loaded development CPU
(about 0.2 us a place).
Not read: the attributes of modules (their ``training`` flag is part of the key; a plain
attribute a caller flips between calls is a documented limit, README, that ``verify=``
catches), the contents of a container the caller rebinds (the one the capture saw is read),
and places past ``MAX_PLACES``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import types
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import torch

from .._config import logger
from ._python_values import MAX_ITEMS, SEQUENCES, class_of, ignored, is_atom, users_class
from ._reads import free_names, roots_of

MAX_PLACES = 16  # namespaces read before each replay (the shallowest): ~1 us on a host
_DEPTH = 5

Reader = Callable[[], Any]


class ValuesRead:
    """The atoms a graph's Python saw, where the caller can change them, as at capture."""

    __slots__ = ("_readers", "_labels", "_expected")

    def __init__(self, readers: List[Reader], labels: List[Tuple[str, ...]]):
        self._readers, self._labels = readers, labels
        self._expected = [read() for read in readers]

    @classmethod
    def of(cls, names: Sequence[str], args: tuple, kwargs: dict, fn: Any) -> Optional["ValuesRead"]:
        """The places that hold atoms reachable from a call's arguments (past the containers
        its key holds by value: they are new on every call) and from ``fn``'s default values,
        globals and cells; None where there is none (nothing to check)."""
        places = _Places(_names_used(getattr(getattr(fn, "__func__", fn), "__code__", None)))
        for name, place, key in free_names(fn):
            places.add_free(name, place, key)
        arguments = [
            (names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(args)
        ] + list(kwargs.items())
        for name, root in arguments:
            places.walk(name, root, _DEPTH, keyed=True)
        for name, root in roots_of(fn, None, (), (), {}):
            places.walk(name, root, _DEPTH, keyed=False)
        return cls(places.readers, places.labels) if places.readers else None

    def same(self) -> bool:
        """Whether every place holds what it held at capture (the check before a replay)."""
        try:
            if [read() for read in self._readers] == self._expected:
                return True
        except Exception:  # a key or an attribute gone, an __eq__ that raises: not the same
            pass
        logger.debug("a call runs eagerly, its graph kept: %s", self.changed())
        return False

    def changed(self) -> Optional[str]:
        """The first place that differs, for messages: ``cache.flag: True -> False``."""
        for read, labels, expected in zip(self._readers, self._labels, self._expected):
            try:
                now = read()
            except Exception:
                return f"{labels[0]} (gone)"
            if len(labels) == 1:
                now, expected = (now,), (expected,)
            for label, a, b in zip(labels, expected, now):
                if not a == b:
                    return f"{label}: {a!r} -> {b!r}"
        return None


class _Places:
    """One walk from a call's roots, collecting a reader per namespace that holds atoms."""

    def __init__(self, names: FrozenSet[str] = frozenset()) -> None:
        self._names = names  # the attribute names the code uses: those of a class it reads
        self.readers: List[Reader] = []
        self.labels: List[Tuple[str, ...]] = []
        self._seen: Set[int] = set()

    def _add(self, reader: Reader, labels: Tuple[str, ...]) -> None:
        if len(self.readers) < MAX_PLACES:
            self.readers.append(reader)
            self.labels.append(labels)

    def _add_items(self, namespace: Any, keys: List[Any], label: Callable[[Any], str]) -> None:
        if keys:
            self._add(
                functools.partial(operator.itemgetter(*keys), namespace),
                tuple(label(k) for k in keys),
            )

    def _add_table(self, obj: Any, path: str, items: List[Tuple[Any, Any]]) -> None:
        """The length of a table of atoms (``is_updated``, a list of flags), read as its
        entries are. Not that of a container of objects: a caller's own bookkeeping
        (GradScaler's per-optimizer states, filled by ``step()``) is no value the call read."""
        if items and all(is_atom(v) for _, v in items):
            self._add(obj.__len__, (f"len({path})",))

    def add_free(self, name: str, place: Any, key: Any) -> None:
        """A global (``place`` the module's dict) or a closure cell, read if it holds an atom."""
        try:
            value = place[key] if isinstance(place, dict) else place.cell_contents
        except (KeyError, ValueError):  # not defined (yet), an empty cell
            return
        if not is_atom(value):
            return
        if isinstance(place, dict):
            self._add_items(place, [key], lambda _: name)
        else:
            self._add(functools.partial(operator.attrgetter("cell_contents"), place), (name,))

    def walk(self, path: str, root: Any, depth: int, keyed: bool) -> None:
        """Breadth first, so that the shallow places (``cache.is_updated``) come before the
        layers past ``MAX_PLACES``. ``keyed``: the root is an argument, whose containers
        (and the atoms in them) the key holds by value."""
        queue = collections.deque([(path, root, depth, keyed)])
        while queue and len(self.readers) < MAX_PLACES:
            path, obj, left, keyed = queue.popleft()
            queue.extend(self._visit(path, obj, left, keyed))

    def _visit(
        self, path: str, obj: Any, left: int, keyed: bool
    ) -> List[Tuple[str, Any, int, bool]]:
        """Add ``obj``'s places; its children to walk."""
        if left <= 0 or id(obj) in self._seen:
            return []
        if isinstance(obj, type):
            self._seen.add(id(obj))
            return self._visit_class(path, obj)
        cls = class_of(obj)
        if (
            is_atom(obj, cls=cls)
            or issubclass(cls, (torch.Tensor, torch.nn.Module))
            or ignored(obj, cls)
        ):
            return []
        self._seen.add(id(obj))
        if issubclass(cls, dict):
            items = list(obj.items())[:MAX_ITEMS]
            if not keyed:
                self._add_table(obj, path, items)
                self._add_items(
                    obj, [k for k, v in items if is_atom(v)], lambda k: f"{path}[{k!r}]"
                )
            return [(f"{path}[{k!r}]", v, left - 1, keyed) for k, v in items]
        if issubclass(cls, SEQUENCES):
            items = list(obj)[:MAX_ITEMS]
            if not keyed and not issubclass(cls, tuple):
                self._add_table(obj, path, list(enumerate(items)))
                self._add_items(
                    obj, [i for i, v in enumerate(items) if is_atom(v)], lambda i: f"{path}[{i}]"
                )
            return [(f"{path}[{i}]", v, left - 1, keyed) for i, v in enumerate(items)]
        if keyed and dataclasses.is_dataclass(obj):
            return [
                (f"{path}.{f.name}", getattr(obj, f.name), left - 1, keyed)
                for f in dataclasses.fields(obj)
            ]
        namespace = getattr(obj, "__dict__", None)
        if not isinstance(namespace, dict):
            return []  # no attributes, or __slots__ only: not read (README, Limits)
        attributes = _state_attributes(namespace)
        self._add_items(
            namespace, [k for k, v in attributes.items() if is_atom(v)], lambda k: f"{path}.{k}"
        )
        return [(f"{path}.{k}", v, left - 1, False) for k, v in attributes.items()]

    def _visit_class(self, path: str, cls: type) -> List[Tuple[str, Any, int, bool]]:
        """A class the code names (``Cfg.scale``, set by the caller between calls): the atoms
        among its own attributes that the code names, read as an object's are (a method of
        the class that reads another is not followed). Not Python's, torch's or
        autograph's classes, nor a module's class (its attributes are its code's), nor the
        classes of the objects walked (an HF cache's class-level flags would take the places
        its ``is_updated`` needs, past ``MAX_PLACES``)."""
        if users_class(cls) and not issubclass(cls, torch.nn.Module):
            namespace = vars(cls)  # a live view of the class's attributes
            attributes = _state_attributes(namespace)
            self._add_items(
                namespace,
                [k for k, v in attributes.items() if k in self._names and is_atom(v)],
                lambda k: f"{path}.{k}",
            )
        return []


@functools.lru_cache(maxsize=1024)
def _names_used(code: Optional[types.CodeType]) -> FrozenSet[str]:
    """The global and attribute names ``code`` and the code nested in it use."""
    if code is None:
        return frozenset()
    nested = (_names_used(c) for c in code.co_consts if isinstance(c, types.CodeType))
    return frozenset(code.co_names).union(*nested)


def _state_attributes(namespace: Mapping[str, Any]) -> Dict[str, Any]:
    return {
        name: value
        for name, value in list(namespace.items())
        if not name.startswith("__") and "hook" not in name
    }
