"""Python state a call changes (docs/design.md, "Python state"): the plain-Python values that the
objects a call can reach hold, what a call changed of them, and taking those changes back.

>>> state = PythonState.of(roots_of(fn, model, names, args, kwargs), fn)
>>> fn(*args, **kwargs)
>>> state.changes()
['past_key_values.layers[1].cumulative_length_int: 10 -> 11']
>>> state.restore()          # every attribute, entry, item, cell and global as before

A replay runs none of the function's Python. A call that changes Python state which later
calls read (transformers' sliding-window cache layers count tokens in a Python int; a step
counter; a list that grows) would, replayed, leave that state where the capture left it. The
rule that keeps lazily made state out of it: compare a snapshot taken before a key's capture
(the second run of its Python) with the state after it. What changed there changes on every
call.

What counts as state: on every object reachable from the roots (the instance and its
submodules, non-tensor arguments such as an HF cache and its layers, closure cells, the
globals the code names), attributes set, changed or removed; the entries of dicts (their key
sets, and their values), the lengths and items of lists and tuples; ints, floats, bools,
strings, None, enums, dtypes, devices and tuples of those, by value. A tensor counts by its
presence only: its identity and its contents are the read watch's (``_reads``) and the undo's
(``_undo``) business. Not state: a module's ``training`` flag and torch's own module
bookkeeping, anything named like a hook, callables, Python modules, weak containers, and the
contents of objects that keep no ``__dict__`` or ``__slots__``. The walk is bounded as
``_reads.Survey`` is (depth and node budget): it is taken at a key's warmup and capture,
never on a replay.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ._names import describe_tensor
from ._python_values import (
    MAX_ITEMS,
    SEQUENCES,
    Summary,
    change,
    class_of,
    ignored,
    is_atom,
    same,
    show,
    summary,
    users_class,
)
from ._reads import free_names

Tensor = torch.Tensor

_MAX_NODES = 50_000
_MISSING = object()
# What nn.Module.__init__ sets: its bookkeeping, hooks and training flag. Its parameters,
# buffers and submodules are walked as the module's attributes.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"_parameters", "_buffers", "_modules"}
_MODULE_MEMBERS = ("_parameters", "_buffers", "_modules")


def _attributes(obj: Any) -> Optional[Dict[str, Any]]:
    """The attributes of ``obj`` that are state, by name; None for an object without any."""
    attributes = getattr(obj, "__dict__", None)
    if not isinstance(attributes, dict):
        names = [
            name
            for cls in type(obj).__mro__
            for name in (getattr(cls, "__slots__", None) or ())
            if isinstance(name, str)
        ]
        if not names:
            return None
        attributes = {name: getattr(obj, name, _MISSING) for name in names}
    internals = _MODULE_INTERNALS if issubclass(class_of(obj), torch.nn.Module) else ()
    return {
        name: value
        for name, value in list(attributes.items())
        if value is not _MISSING
        and not name.startswith("__")
        and name not in internals
        and name not in _MODULE_MEMBERS
        and "hook" not in name
        and not ignored(value)
    }


def _class_attributes(cls: type) -> Dict[str, Any]:
    """The class-level values of one of the caller's classes that are state (a counter kept as
    ``type(self).n``): not its methods, properties or other descriptors."""
    return {
        name: value
        for name, value in list(vars(cls).items())
        if not name.startswith("__") and not hasattr(type(value), "__get__") and not ignored(value)
    }


class _Holder:
    """One place that holds state, as it was: what ``restore()`` writes back."""

    __slots__ = ("kind", "target", "key", "before")

    def __init__(self, kind: str, target: Any, key: Any, before: Any):
        self.kind, self.target, self.key, self.before = kind, target, key, before

    def restore(self) -> None:
        kind, target, before = self.kind, self.target, self.before
        if kind == "attributes":
            now = (
                _class_attributes(target) if isinstance(target, type) else _attributes(target)
            ) or {}
            if isinstance(getattr(target, "__dict__", None), dict):
                namespace = target.__dict__
                for name in now.keys() - before.keys():
                    del namespace[name]
                for name, value in before.items():
                    if now.get(name, _MISSING) is not value:
                        namespace[name] = value
            else:
                for name in now.keys() - before.keys():
                    delattr(target, name)
                for name, value in before.items():
                    if now.get(name, _MISSING) is not value:
                        setattr(target, name, value)
        elif kind == "dict":
            if target.keys() != before.keys() or any(target[k] is not v for k, v in before.items()):
                for k in target.keys() - before.keys():
                    del target[k]
                for k, v in before.items():
                    if target.get(k, _MISSING) is not v:
                        target[k] = v
        elif kind == "sequence":
            if len(target) != len(before) or any(a is not b for a, b in zip(target, before)):
                target.clear()
                target.extend(before)
        elif kind == "set":
            if target != before:
                target.clear()
                target.update(before)
        elif kind == "cell":
            if before is _MISSING:
                del target.cell_contents
            else:
                target.cell_contents = before
        elif kind == "global":
            if before is _MISSING:
                target.pop(self.key, None)
            elif target.get(self.key, _MISSING) is not before:
                target[self.key] = before


class _Walk:
    """One walk of the state reachable from the roots: a summary per path."""

    def __init__(self, roots: Sequence[Tuple[str, Any]], fn: Any, depth: int, restorable: bool):
        self.summaries: Dict[str, Summary] = {}
        self.parents: Dict[str, Optional[str]] = {}
        self.names: Dict[int, str] = {}  # id of an object reached -> the first path to it
        self.key_labels: Dict[int, str] = {}
        self.holders: Optional[List[_Holder]] = [] if restorable else None
        self._seen: Set[int] = set()
        self._budget = _MAX_NODES
        bound: Set[str] = set()
        # Closure cells and globals are read afresh: the roots hold the values they had.
        for name, place, key in free_names(fn):
            if isinstance(place, dict):
                value = place.get(key, _MISSING)
                self._hold("global", place, key, value)
            else:
                try:
                    value = place.cell_contents
                except ValueError:  # an empty cell
                    value = _MISSING
                self._hold("cell", place, None, value)
            if value is not _MISSING:
                bound.add(name)
                if not ignored(value):
                    self._slot(None, name, value, depth)
        for name, root in roots:
            if name not in bound:
                self._slot(None, name, root, depth)

    def _hold(self, kind: str, target: Any, key: Any, before: Any) -> None:
        if self.holders is not None:
            self.holders.append(_Holder(kind, target, key, before))

    def _slot(self, parent: Optional[str], path: str, value: Any, left: int) -> None:
        if self._budget <= 0:
            return
        self._budget -= 1
        self.parents[path] = parent
        cls = class_of(value)
        self.summaries[path] = summary(value, cls)
        self._visit(path, value, left, cls)

    def _key_label(self, key: Any) -> str:
        if is_atom(key):
            return f"[{key!r}]"
        self.key_labels.setdefault(
            id(key), describe_tensor(key) if isinstance(key, Tensor) else f"a {type(key).__name__}"
        )
        return f"[#{id(key)}]"

    def _visit(self, path: str, obj: Any, left: int, cls: type) -> None:
        if is_atom(obj, cls=cls) or id(obj) in self._seen:
            return
        # The shortest path names it: self.weight, not optimizer.param_groups[0]['params'][0].
        if len(path) < len(self.names.get(id(obj), path + " ")):
            self.names[id(obj)] = path
        if issubclass(cls, Tensor) or left <= 0 or ignored(obj, cls):
            return
        self._seen.add(id(obj))
        if issubclass(cls, dict):
            self._hold("dict", obj, None, dict(obj))
            for key, value in list(obj.items())[:MAX_ITEMS]:
                if not ignored(value):
                    self._slot(path, path + self._key_label(key), value, left - 1)
            return
        if issubclass(cls, SEQUENCES):
            if not issubclass(cls, tuple):
                self._hold("sequence", obj, None, list(obj))
            for i, value in enumerate(list(obj)[:MAX_ITEMS]):
                if not ignored(value):
                    self._slot(path, f"{path}[{i}]", value, left - 1)
            return
        if issubclass(cls, (set, frozenset)):
            if issubclass(cls, set):
                self._hold("set", obj, None, set(obj))
            self.summaries[path] += (frozenset(v for v in obj if is_atom(v)),)
            return
        attributes = _attributes(obj)
        if attributes is None:
            return
        self._hold("attributes", obj, None, attributes)
        if issubclass(cls, torch.nn.Module):
            # A module's parameters, buffers and submodules are its attributes, and a module
            # tree costs no depth: a deep model's leaves are as much state as its root's.
            for members in _MODULE_MEMBERS:
                group = obj.__dict__.get(members)
                if isinstance(group, dict):
                    self._hold("dict", group, None, dict(group))
                    for key, value in group.items():
                        label = f"[{key}]" if key.isdigit() else f".{key}"
                        self._slot(
                            path,
                            path + label,
                            value,
                            left if isinstance(value, torch.nn.Module) else left - 1,
                        )
        for name, value in attributes.items():
            self._slot(path, f"{path}.{name}", value, left - 1)
        self._visit_classes(path, cls, left)

    def _visit_classes(self, path: str, cls: type, left: int) -> None:
        """The class-level state of an object's classes that are the caller's own."""
        for owner in cls.__mro__:
            if id(owner) in self._seen or not users_class(owner):
                continue
            self._seen.add(id(owner))
            attributes = _class_attributes(owner)
            self._hold("attributes", owner, None, attributes)
            for name, value in attributes.items():
                self._slot(path, f"type({path}).{name}", value, left - 1)


class PythonState:
    """The Python state reachable from a call's roots, taken before a run of its Python.

    >>> state = PythonState.of(roots, fn)    # roots as _reads.roots_of gives them
    >>> fn(*args)
    >>> state.changes()                      # ['self.steps: 3 -> 4'], or []
    """

    def __init__(self, roots: Sequence[Tuple[str, Any]], fn: Any, depth: int, restorable: bool):
        self._roots = list(roots)
        self._fn = fn
        self._depth = depth
        self._before = _Walk(self._roots, fn, depth, restorable)

    @classmethod
    def of(
        cls,
        roots: Sequence[Tuple[str, Any]],
        fn: Any = None,
        *,
        depth: int = 6,
        restorable: bool = False,
    ) -> "PythonState":
        """The state now. ``restorable`` keeps every place's contents for ``restore()``: it
        holds what they hold (tensors too), so keep such a state only across the run it
        takes back; without it, nothing reachable is kept alive by the snapshot but the
        roots."""
        return cls(roots, fn, depth, restorable)

    def changes(self) -> List[str]:
        """What differs now from the snapshot, one line per place, in the order reached.

        >>> state.changes()
        ['past_key_values.layers[1].cumulative_length_int: 10 -> 11',
         "optimizer.state[self.weight]: added (a dict)", 'self.history: length 2 -> 3']
        """
        return self._against(self._walk_now())

    def changes_with(self, earlier: "PythonState") -> Tuple[List[str], List[str]]:
        """``(self.changes(), earlier.changes())``, from one walk of the state now: ``earlier``
        was taken of the same roots (a walk is most of what a capture's survey costs)."""
        now = self._walk_now()
        return self._against(now), earlier._against(now)

    def _walk_now(self) -> _Walk:
        return _Walk(self._roots, self._fn, self._depth, False)

    def _against(self, after: _Walk) -> List[str]:
        before = self._before
        found: List[str] = []
        for path, now in after.summaries.items():
            old = before.summaries.get(path)
            if old is None:
                if self._reported_alone(path, after, before):
                    found.append(f"{path}: added ({show(now)})")
            elif not same(old, now):
                found.append(change(path, old, now))
        for path in before.summaries.keys() - after.summaries.keys():
            if self._reported_alone(path, before, after):
                found.append(f"{path}: removed")
        return [self._readable(line, after, before) for line in found]

    @staticmethod
    def _reported_alone(path: str, walk: _Walk, other: _Walk) -> bool:
        """Whether a path found in one walk only is a change of its own: not inside an object
        that is new or gone as a whole, nor an item of a sequence whose length says it."""
        parent = walk.parents[path]
        if parent is None:
            return True
        if parent not in other.summaries or other.summaries[parent] != walk.summaries[parent]:
            return False
        return walk.summaries[parent][0] != "sequence"

    @staticmethod
    def _readable(line: str, *walks: _Walk) -> str:
        """A dict key that is an object (a parameter in ``optimizer.state``) by its path."""

        def name(match: "re.Match[str]") -> str:
            key = int(match.group(1))
            for walk in walks:
                if key in walk.names:
                    return f"[{walk.names[key]}]"
            for walk in walks:
                if key in walk.key_labels:
                    return f"[<{walk.key_labels[key]}>]"
            return "[<an object>]"

        return re.sub(r"\[#(\d+)\]", name, line)

    def restore(self) -> None:
        """Put back every attribute, dict entry, list item, closure cell and global the
        snapshot reached, as it was (only for a state taken with ``restorable=True``)."""
        if self._before.holders is None:
            raise RuntimeError(
                "PythonState.restore(): this state was taken without "
                "restorable=True, so it kept nothing to restore"
            )
        for holder in self._before.holders:
            holder.restore()


def per_call_reason(changes: Sequence[str]) -> str:
    """The reason a key whose capture changed Python state runs eagerly.

    >>> per_call_reason(["self.steps: 3 -> 4"])
    'it changes self.steps (3 -> 4) on every call, and a replay runs no Python ...'
    """
    shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
    return (
        f"each call changes Python state that a replay would leave as it is ({shown}). "
        f"A replay runs none of the function's Python. Keep such state in a tensor "
        f"updated in place, or pass it as an argument"
    )
