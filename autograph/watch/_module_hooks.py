"""The module hooks a graph ran at capture, and whether they are still the ones registered.

>>> hooks = HookWatch.of(survey.modules)        # after capture: the modules the call reaches
>>> model[0].register_forward_hook(scale)        # a hook added after capture
>>> hooks.changed()
'the hooks of a Linear module it reaches (added or removed since capture)'

A module's hooks (forward pre-hooks, forward hooks, backward hooks, and the global ones) are
Python that ``Module.__call__`` runs around a submodule's forward: a graph captured their tensor
work once, and a replay runs none of it. A hook added after capture would never apply, and a
removed one would still apply. So the ids of the hooks of every module the call reaches (its
roots' modules and all their submodules) are kept, and a replay checks cheaply that they are
unchanged, the key being captured again if not:

- every registration of a hook anywhere (``register_*_hook``, tensor hooks too) makes a
  ``RemovableHandle``, whose class counter ``next_id`` grows: a replay compares it (one
  attribute read, about 20 ns), and only when it moved compares every module's hook ids
  (about 0.2 us per module on a CPU), once per registration;
- a removal (``handle.remove()``) makes no handle: only a dictionary that held hooks at
  capture can shrink, so a replay compares the length of those (none, commonly; about 0.2 us
  for a graph that has some).

The modules are those reached, not those called: no global hook is registered during the
capture (torch.compile guards on the global hooks, and warns of them). A hook dictionary
emptied or replaced without its handles (``m._forward_hooks.clear()``) is not seen (README,
Limits).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

_GROUPS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBALS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)

Ids = Tuple[Tuple[int, ...], ...]
_NONE: Ids = ((),) * len(_GROUPS)


def _ids(module: torch.nn.Module) -> Ids:
    if not (
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
    ):
        return _NONE  # most modules: four truth tests, no tuples
    return tuple(tuple(getattr(module, group)) for group in _GROUPS)


def _global_ids() -> Ids:
    return tuple(tuple(getattr(_module, name, None) or ()) for name in _GLOBALS)


class HookWatch:
    """The hook ids of the modules a call reaches, and the check that they still hold."""

    __slots__ = ("seen", "modules", "hooked", "globals", "held")

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self.modules: List[Tuple[Any, Ids]] = []
        # (module, group, length) of each dictionary that held hooks at capture
        self.hooked: List[Tuple[Any, str, int]] = []
        for module in modules:
            try:
                ref = weakref.ref(module)
            except TypeError:  # a module without weak references: its hooks are not watched
                continue
            ids = _ids(module)
            self.modules.append((ref, ids))
            self.hooked += [(ref, group, len(held)) for group, held in zip(_GROUPS, ids) if held]
        self.globals = _global_ids()
        # Dictionaries that held hooks at capture are compared on every replay.
        self.held = bool(self.hooked) or any(self.globals)
        self.seen = RemovableHandle.next_id

    @classmethod
    def of(cls, reached: Dict[int, torch.nn.Module]) -> Optional["HookWatch"]:
        """The watch of these modules and all their submodules, or None if there are none."""
        modules = {id(sub): sub for module in reached.values() for sub in module.modules()}
        return cls(modules.values()) if modules else None

    def changed(self) -> Optional[str]:
        """What changed among the hooks the graph ran with, or None."""
        for ref, group, length in self.hooked:
            module = ref()
            if module is not None and len(getattr(module, group)) != length:
                return _changed(module)
        if self.seen == RemovableHandle.next_id and not any(self.globals):
            return None
        return self.compare()

    def compare(self) -> Optional[str]:
        """Every module's hook ids against the capture's: O(modules), run only after a
        registration anywhere."""
        if self.globals != _global_ids():
            return "the global module hooks (added or removed since capture)"
        for ref, ids in self.modules:
            module = ref()
            if module is not None and _ids(module) != ids:
                return _changed(module)
        self.seen = RemovableHandle.next_id
        return None


def _changed(module: torch.nn.Module) -> str:
    return (
        f"the hooks of a {type(module).__name__} module it reaches (added or removed since capture)"
    )
