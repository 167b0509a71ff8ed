"""What a run on fake tensors (``_symbolic_batch``) must leave as it was, and what it left: the
Python state it writes a fake value to, put back, and the places still holding one after it,
found and named.

>>> with WritesKept(), QuietLogs():
...     outputs = fn(*fake_args)                # Served.rows += x.shape[0]: a fake value
>>> left_behind(shape_env)                      # Served.rows is an int again
[]

The run executes the function's Python once more, with fake tensors and symbolic sizes in
place of real ones. Whatever it writes to state that outlives it (a module's counter, a class
attribute, an attribute of a module-level object) would leave the caller's program holding
a symbolic size (``s26 + 4``, which ``range()`` later reads as its hint) or a fake tensor. What
the copies taken during the run reach is put back; what they do not is found by the garbage
collector after it, and said (docs/design.md, "Buckets").
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import types
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

from ..watch._python_values import users_module

Tensor = torch.Tensor


class WritesKept:
    """Python state the run writes a fake value to, put back as it was: a helper's counter
    (``TOKENS += n``), a debug dict (``LAST["x"] = x``), a class-level counter
    (``Stats.rows += x.shape[0]``), an attribute of a module-level object (``REGISTRY.last =
    n``). A profile hook (this thread and this run only) copies, when the run first calls into
    a module, that module's globals and, in the caller's modules (``users_module``: not
    Python's, torch's or autograph's), the attributes of the classes and plain objects among
    them; the lists and dicts they hold are copied too. What holds a fake value
    after the run is restored; other writes stay, as a warmup's would. What the copies do not
    reach (an attribute of an object only an argument holds, beyond ``PythonState``'s walk) is
    found after the run by ``left_behind``. Under another profile function (cProfile, a
    debugger's), the hook is not installed, so as not to take its place: then only
    ``left_behind`` stands guard.

    One copy per module, not per call: copying each call's arguments made the run of a 2-layer
    HF Llama three times slower (its Python calls are many), and a copied frame's locals
    outlived the run in any traceback that kept it."""

    def __init__(self) -> None:
        self.kept: Dict[int, _Kept] = {}
        self.installed = False

    def __enter__(self) -> "WritesKept":
        if sys.getprofile() is None:
            sys.setprofile(self._on_event)
            self.installed = True
        return self

    def _on_event(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            names = frame.f_globals
            if id(names) not in self.kept:
                self._keep(names, names)
                if users_module(str(names.get("__name__", ""))):
                    for value in list(names.values()):
                        if _plain_object(value):
                            self._keep(value, _attributes_of(value))

    def _keep(self, owner: Any, attributes: Any) -> None:
        if attributes is not None and id(attributes) not in self.kept:
            self.kept[id(attributes)] = _Kept(owner, attributes)

    def __exit__(self, *exc: Any) -> None:
        if self.installed:
            sys.setprofile(None)
        for kept in self.kept.values():
            kept.restore()


def _plain_object(value: Any) -> bool:
    """A class or an object whose attributes may be state: not a module, function, tensor or
    torch's module (whose state ``PythonState`` walks), nor a built-in value."""
    return not isinstance(value, _NOT_PLAIN) and (
        isinstance(value, type) or isinstance(getattr(value, "__dict__", None), dict)
    )


_NOT_PLAIN = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    Tensor,
    torch.nn.Module,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
)


def _attributes_of(owner: Any) -> Optional[Any]:
    """The mapping an object or a class keeps its attributes in (a class's as a read-only
    proxy), or None."""
    attributes = getattr(owner, "__dict__", None)
    return attributes if isinstance(attributes, (dict, types.MappingProxyType)) else None


class _Kept:
    """A copy of one mapping of names (a module's globals, an object's or a class's attributes)
    and of the small lists and dicts it holds, to put back what the run made fake."""

    __slots__ = ("owner", "attributes", "copied", "held")

    def __init__(self, owner: Any, attributes: Any):
        self.owner, self.attributes = owner, attributes
        self.copied = dict(attributes)
        self.held = {
            key: (list(value) if isinstance(value, list) else dict(value))
            for key, value in self.copied.items()
            if isinstance(value, (list, dict)) and len(value) <= _KEPT_CONTAINER
        }

    def restore(self) -> None:
        for key, value in list(self.attributes.items()):
            if _is_fake(value):
                if key in self.copied:
                    self._set(key, self.copied[key])
                else:
                    self._delete(key)
            elif key in self.held and any(map(_is_fake, _values(value))):
                value.clear()
                if isinstance(value, list):
                    value.extend(self.held[key])
                else:
                    value.update(self.held[key])

    def _set(self, key: str, value: Any) -> None:
        if isinstance(self.attributes, dict):
            self.attributes[key] = value
        else:  # a class's attributes: set through the class
            setattr(self.owner, key, value)

    def _delete(self, key: str) -> None:
        if isinstance(self.attributes, dict):
            del self.attributes[key]
        else:
            delattr(self.owner, key)


# The largest list or dict of a module's globals or an object's attributes copied whole
# (registries are larger).
_KEPT_CONTAINER = 256


def _values(container: Any) -> List[Any]:
    return list(container.values()) if isinstance(container, dict) else list(container)


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool))


class QuietLogs:
    """torch's fake tensors log an op that fails on them with its traceback
    (``log.exception``): the run's own failure, not the caller's, and a log record that a
    handler keeps (pytest's does) would keep the run's frames and its fake values alive. Its
    records from this thread are dropped for the block."""

    _LOGGERS = ("torch._subclasses.fake_tensor",)

    def __enter__(self) -> "QuietLogs":
        self.thread = threading.get_ident()
        for name in self._LOGGERS:
            logging.getLogger(name).addFilter(self._keep)
        return self

    def _keep(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread

    def __exit__(self, *exc: Any) -> None:
        for name in self._LOGGERS:
            logging.getLogger(name).removeFilter(self._keep)


def left_behind(shape_env: Any, outputs: Sequence[Any] = ()) -> List[str]:
    """Where fake values of the run over ``shape_env`` are still held once it is over and its
    state put back: a fake tensor or symbolic number in an attribute, an entry or an item that
    nothing copied before the run (an object only an argument's attribute holds), in words
    (``'Stats.rows'``, ``"the .last of a Holder"``). Not state: the run's own outputs
    (``outputs``, and what they hold), a frame (of a traceback kept somewhere), a log record's
    arguments (a handler that keeps records: pytest's; its text shows the symbol, but nothing
    reads it as a number).

    One pass over the objects the garbage collector tracks (about 0.1-0.2 s for 350,000 on the
    development CPU), once per fake run; the places are looked up only if some are held."""
    found = _fakes_of(shape_env)
    if not found:
        return []
    del found
    gc.collect()  # a cycle the run left as garbage is no one's
    found = _fakes_of(shape_env)
    mine = {id(found), id(sys._getframe())}
    holders = [h for h in gc.get_referrers(*found) if id(h) not in mine]
    # (before ``_place``, which makes an object's inline attributes a dict of their own)
    held = {id(f) for h in holders for f in gc.get_referents(h)}
    not_state = {id(o) for o in outputs} | {id(getattr(o, "__dict__", None)) for o in outputs}
    not_state |= {id(o) for o in found} | _logged(holders)
    places = {
        _place(holder, found)
        for holder in holders
        if id(holder) not in not_state and not isinstance(holder, _FRAME)
    }
    if any(id(f) not in held for f in found):
        # Alive, yet held by nothing the collector shows: an object frozen by gc.freeze()
        # (a pre-forking server's, autograph's own during a capture) is not searched.
        places.add("an object autograph cannot name (one frozen by gc.freeze() is not searched)")
    return sorted(places)


# What keeps the run's leftovers without being anyone's state: a traceback's frames, an
# exception raised inside the run (its arguments), a log record.
_LEFTOVERS = (types.FrameType, types.TracebackType, BaseException, logging.LogRecord)


def _logged(holders: List[Any]) -> Set[int]:
    """The ids of the tuples, lists and dicts among ``holders`` that only ``_LEFTOVERS`` hold
    (a record's arguments, an exception's, a traceback's locals): no one's state."""
    containers = [h for h in holders if type(h) in (tuple, list, dict)]
    if not containers:
        return set()
    wanted = {id(c) for c in containers}
    owners: Dict[int, List[Any]] = {i: [] for i in wanted}
    skipped = {id(holders), id(containers), id(sys._getframe())}
    for referrer in gc.get_referrers(*containers):
        if id(referrer) not in skipped:
            for held in gc.get_referents(referrer):
                if id(held) in owners:
                    owners[id(held)].append(referrer)
    dicts = [o for found in owners.values() for o in found if type(o) is dict]
    records = {
        id(d)
        for record in (gc.get_referrers(*dicts) if dicts else ())
        if isinstance(record, logging.LogRecord)
        for d in dicts
        if record.__dict__ is d
    }
    return {
        i
        for i, found in owners.items()
        if all(isinstance(o, _LEFTOVERS) or id(o) in records for o in found)
    }


def _fakes_of(shape_env: Any) -> List[Any]:
    from torch._subclasses.fake_tensor import FakeTensor

    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    found = []
    for o in gc.get_objects():
        kind = type(o)
        if kind in symbolic:
            if o.node.shape_env is shape_env:
                found.append(o)
        elif issubclass(kind, FakeTensor) and o.fake_mode.shape_env is shape_env:
            found.append(o)
    return found


# What holds a fake value without being anyone's state: a frame, of a traceback that a log
# record keeps (torch logs a fake kernel's error with it) or of a suspended generator.
_FRAME = types.FrameType


def _place(holder: Any, found: List[Any]) -> str:
    """Where in ``holder`` one of ``found`` is, in words."""
    fakes = {id(f) for f in found}
    if isinstance(holder, dict):
        key = next((k for k, v in holder.items() if id(v) in fakes), "?")
        for owner in gc.get_referrers(holder):
            if isinstance(owner, types.ModuleType) and owner.__dict__ is holder:
                return f"{owner.__name__}.{key}"
            if isinstance(owner, type) and owner.__dict__.get(key) is holder.get(key):
                return f"{owner.__qualname__}.{key}"
            if getattr(owner, "__dict__", None) is holder:
                return f"the .{key} of a {type(owner).__qualname__}"
        return f"the entry {key!r} of a dict"
    attributes = getattr(holder, "__dict__", None)  # an object whose attributes are inline
    if isinstance(attributes, dict):
        key = next((k for k, v in attributes.items() if id(v) in fakes), "?")
        return f"the .{key} of a {type(holder).__qualname__}"
    return f"an item of a {type(holder).__qualname__}"
