"""Where a graph's state read by address lives, and whether something else lives there now.

>>> slots = SlotWatch(survey, external)      # after the first replay (``Graph.watch_reads``)
>>> model.weight = nn.Parameter(new)         # or load_state_dict(sd, assign=True)
>>> slots.changed(always=False)
'self.weight (replaced since capture)'

A graph reads the tensor it read at capture. The freed-read watch (``_reads.ReadWatch``) sees
a replaced tensor only once its memory is freed: never while anything else holds it (an
optimizer, the caller, a training graph's own autograd graph). So each tensor read by address
that was reached as an attribute (a module's parameter or buffer, an object's attribute) is
remembered with its owner (held weakly) and name, and a replay first checks that the owner
still holds that very tensor there.

A parameter can also keep its identity and move to other memory: ``p.data = other`` (an EMA
swap, ``p.data, e.data = e.data, p.data``, keeps both memories alive). So each slot's data
address is kept too, and compared after such an assignment to any parameter (about 0.1 us a
slot, once per assignment).

Checking every slot costs a dictionary look-up per tensor: a training graph checks on every
call (its backward dwarfs that); an inference graph checks only after a module registered a
parameter, buffer or submodule anywhere (torch's global registration hooks, installed while a
watch lives) or a parameter's ``.data`` assignment (torch has no hook for it: while a watch
lives, ``nn.Parameter.data`` is a Python property over the C one), so its replay costs one
integer comparison. An inference graph therefore misses a module's plain tensor attribute (not
a buffer) rebound while the old one stays alive, and a buffer's ``.data`` assigned while the
old memory stays alive; any graph misses memory swapped by ``p.set_(other)`` or
``torch.utils.swap_tensors`` while the old stays alive (docs/guide/limits.md).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.nn.modules import module as _module

Tensor = torch.Tensor


_tensor_data = torch._C.TensorBase.data  # the C property: ``t.data`` and ``t.data = d``


def _set_data(tensor: Tensor, data: Tensor) -> None:
    _tensor_data.__set__(tensor, data)
    Registrations.count += 1


class Registrations:
    """Counts parameter, buffer and submodule registrations, and ``p.data = d`` assignments to
    parameters (an EMA swap, ``p.data, e.data = e.data, p.data``, moves a parameter to other
    memory and keeps the old alive), while any watch lives."""

    count = 0
    _handles: List[Any] = []
    _watches = 0
    # Adding and dropping watches (a drop runs as a finalizer, in any thread, maybe inside an
    # add): unlocked, a drop could take away the property an add in another thread installed.
    _lock = threading.RLock()

    @classmethod
    def _bump(cls, *args: Any) -> None:
        cls.count += 1

    @classmethod
    def add_watch(cls) -> None:
        with cls._lock:
            if cls._watches == 0:
                cls._handles = [
                    register(cls._bump)
                    for register in (
                        _module.register_module_parameter_registration_hook,
                        _module.register_module_buffer_registration_hook,
                        _module.register_module_module_registration_hook,
                    )
                ]
                # torch has no hook for the setter: a parameter's ``.data`` is a Python
                # property over the C one while a watch lives (Dynamo traces ``.data`` by
                # name, not by this; plain tensors, and subclasses with a
                # ``__torch_function__``, keep theirs).
                torch.nn.Parameter.data = property(  # type: ignore[method-assign]
                    _tensor_data.__get__, _set_data, doc=_tensor_data.__doc__
                )
            cls._watches += 1

    @classmethod
    def drop_watch(cls) -> None:
        with cls._lock:
            cls._watches -= 1
            if cls._watches == 0:
                for handle in cls._handles:
                    handle.remove()
                cls._handles = []
                del torch.nn.Parameter.data  # the C property again


registrations = Registrations


class SlotWatch:
    """The owners, names and tensors of a graph's reads by address reached as attributes."""

    def __init__(self, survey: Any, external: Dict[int, Tensor]):
        self.slots: List[Tuple[Any, str, str, Any, int, str]] = []
        for ptr in external:
            found = survey.slots.get(ptr)
            if found is None:
                continue
            owner, group, key, tensor = found
            try:
                owner_ref = weakref.ref(owner)
            except TypeError:  # an object without weak references: the freed watch only
                continue
            self.slots.append(
                (owner_ref, group, key, weakref.ref(tensor), tensor.data_ptr(), survey.names[ptr])
            )
        self.seen = Registrations.count
        if self.slots:
            Registrations.add_watch()
            weakref.finalize(self, Registrations.drop_watch)

    def changed(self, always: bool) -> Optional[str]:
        """The name of a slot that no longer holds its tensor, or None. Unless ``always``,
        only checked after a registration since the last check."""
        moved = self.seen != Registrations.count
        if not always and not moved:
            return None
        self.seen = Registrations.count
        for owner_ref, group, key, tensor_ref, address, name in self.slots:
            owner = owner_ref()
            if owner is None:  # gone with its owner: the freed watch tells of its tensors
                continue
            held = getattr(owner, group, None)
            tensor = held.get(key) if isinstance(held, dict) else held
            if not isinstance(held, dict) or tensor is not tensor_ref():
                return f"{name} (replaced since capture)"
            if moved and tensor is not None and tensor.data_ptr() != address:
                return f"{name} (its .data replaced since capture)"
        return None


class GeneratorSlots:
    """Where the private generators a graph draws from were reached as attributes, checked on
    every replay: a generator swapped for another that stays alive elsewhere
    (``module.generator = other``) is freed never, and the graph would draw from the old one.

    >>> slots = GeneratorSlots.of(survey, drawn)     # None where none was an attribute
    >>> slots.changed()                              # 'self.generator (replaced since capture)'
    """

    def __init__(self, slots: List[Tuple[Any, str, str, int, str]]):
        self.slots = slots

    @classmethod
    def of(cls, survey: Any, drawn: Any) -> Optional["GeneratorSlots"]:
        slots = []
        for generator in drawn:
            found = survey.generators.get(generator._cdata)
            if found is None or found.slot is None:
                continue  # not reached as an attribute (a closure, a global): docs/guide/limits.md
            owner, group, key = found.slot
            try:
                slots.append((weakref.ref(owner), group, key, generator._cdata, found.path))
            except TypeError:  # an owner without weak references
                continue
        return cls(slots) if slots else None

    def changed(self) -> Optional[str]:
        """The name of an attribute that no longer holds its generator, or None."""
        for owner_ref, group, key, identity, name in self.slots:
            owner = owner_ref()
            held = None if owner is None else getattr(owner, group, None)
            if isinstance(held, dict) and getattr(held.get(key), "_cdata", None) != identity:
                return f"{name} (replaced since capture)"
        return None
