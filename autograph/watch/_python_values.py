"""What a plain-Python value is, as far as a call's state goes (docs/design.md, "Python state"):
atoms compared by value, containers by type, length and the identity of what they hold,
and what is no state at all (functions, modules, loggers, weak caches).

>>> summary(3, int), summary([t, t2], list)
(('=', 3), ('sequence', <class 'list'>, 2, (id(t), id(t2))))
>>> same(summary(0.0, float), summary(-0.0, float)), ignored(print)
(True, True)

Shared by the survey of what a call changes (``_python_state``) and the check of what a
replay reads (``_values_read``).
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import types
import weakref
from typing import Any, Dict, Optional, Tuple

import torch

Tensor = torch.Tensor

MAX_ITEMS = 256  # entries compared per dict or list; their key sets and lengths beyond

ATOMS = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    range,
)
WEAK = (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)
SEQUENCES = (list, tuple, collections.deque)

Summary = Tuple[Any, ...]


# Types are asked of ``class_of(value)``, not by ``isinstance``: an ``isinstance`` that fails
# asks the object for its ``__class__``, through its own ``__getattribute__`` (a transformers
# config answers in Python, and the survey met it at every module holding it: a third of a
# walk). Only a class that defines ``__class__`` itself (a proxy, ``wrapt.ObjectProxy``) is
# asked, so that a proxied list is walked as the list it stands for.
_CLASS_DEFINED: Dict[type, bool] = {}


def class_of(value: Any) -> type:
    cls = type(value)
    defined = _CLASS_DEFINED.get(cls)
    if defined is None:
        defined = _CLASS_DEFINED[cls] = any("__class__" in vars(c) for c in cls.__mro__[:-1])
    return value.__class__ if defined else cls


def is_atom(value: Any, depth: int = 3, cls: Optional[type] = None) -> bool:
    if cls is None:
        cls = class_of(value)
    if issubclass(cls, ATOMS):
        return True
    if issubclass(cls, (tuple, frozenset)) and depth and len(value) <= 64:
        return all(is_atom(v, depth - 1) for v in value)
    return False


def summary(value: Any, cls: type) -> Summary:
    """What a slot holds (of class ``cls``, ``class_of``), as far as it is compared: an atom
    by value, a tensor by presence, a list or deque by length and the identity of the objects
    it holds (a full ``deque(maxlen=k)`` appended to keeps its length), a dict of more than
    ``MAX_ITEMS`` entries (whose entries are not walked) by its length and key set, anything
    else by type."""
    if issubclass(cls, Tensor):
        return ("tensor",)
    if is_atom(value, cls=cls):
        return ("=", value)
    if issubclass(cls, SEQUENCES):
        held = (
            ()
            if issubclass(cls, tuple)
            else tuple(id(v) for v in list(value)[:MAX_ITEMS] if not is_atom(v))
        )
        return ("sequence", type(value), len(value), held)
    if issubclass(cls, dict) and len(value) > MAX_ITEMS:
        return ("object", type(value), len(value), hash(frozenset(value)))
    return ("object", type(value))


def same(a: Summary, b: Summary) -> bool:
    if a[0] != "=" or b[0] != "=":
        return a == b
    x, y = a[1], b[1]
    if x is y:  # an atom is immutable: itself is no change, NaN or not (an argument's value)
        return True
    if type(x) is not type(y):
        return False
    try:
        return bool(x == y) or _both_nan(x, y)
    except Exception:  # an atom whose __eq__ fails: compare by identity
        return False


def _both_nan(x: Any, y: Any) -> bool:
    """NaN is not equal to itself; a NaN that stays a NaN (real or complex part, or in a tuple
    made afresh) is no change."""
    if isinstance(x, tuple):
        return (
            isinstance(y, tuple)
            and len(x) == len(y)
            and all(a is b or a == b or _both_nan(a, b) for a, b in zip(x, y))
        )
    if isinstance(x, complex):
        return (x.real == y.real or _both_nan(x.real, y.real)) and (
            x.imag == y.imag or _both_nan(x.imag, y.imag)
        )
    return isinstance(x, float) and math.isnan(x) and math.isnan(y)


def change(path: str, old: Summary, new: Summary) -> str:
    """One line of what changed at ``path``: ``self.steps: 3 -> 4``, ``seen: length 2 -> 3``."""
    if old[0] == new[0] and old[0] != "=" and old[1] is new[1]:
        if len(old) > 2 and len(new) > 2 and old[2] != new[2]:
            return f"{path}: length {old[2]} -> {new[2]}"
        return (
            f"{path}: {'its items were replaced' if old[0] == 'sequence' else 'its keys changed'}"
        )
    return f"{path}: {show(old)} -> {show(new)}"


def show(summary: Summary) -> str:
    kind = summary[0]
    if kind == "=":
        text = repr(summary[1])
        return text if len(text) <= 60 else text[:57] + "..."
    if kind == "tensor":
        return "a tensor"
    if kind == "sequence":
        return f"a {summary[1].__name__} of {summary[2]}"
    return f"a {summary[1].__name__}"


def ignored(value: Any, cls: Optional[type] = None) -> bool:
    """Values that are no state of a call's: functions, methods and classes (their state is
    their code), modules, weak caches, loggers (a module's ``logger`` caches which levels are
    enabled as it is first asked). An object of the caller's own class that is callable (a
    schedule whose ``__call__`` returns its next value) is state like any other object."""
    if cls is None:
        cls = class_of(value)
    if issubclass(cls, _IGNORED_TYPES):
        return True
    if not callable(value) or issubclass(cls, torch.nn.Module):
        return False
    return issubclass(cls, _CODE) or not users_class(cls)


def users_class(cls: type) -> bool:
    """Whether ``cls`` is the caller's, not Python's, torch's or autograph's own."""
    known = _USERS_CLASS.get(cls)
    if known is None:
        known = _USERS_CLASS[cls] = users_module(getattr(cls, "__module__", None) or "builtins")
    return known


def users_module(name: str) -> bool:
    """Whether the module named ``name`` is the caller's, not Python's, torch's (sympy, its
    symbolic shapes' own, too) or autograph's."""
    return name.partition(".")[0] not in _NOT_USERS


_USERS_CLASS: Dict[type, bool] = {}
_NOT_USERS = frozenset(
    {
        "builtins",
        "functools",
        "_functools",
        "typing",
        "abc",
        "torch",
        "sympy",
        "autograph",
        "operator",
        "collections",
        "weakref",
        "types",
    }
)
_CODE = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    type,
)
_IGNORED_TYPES = (types.ModuleType, logging.Logger, logging.Manager) + WEAK
