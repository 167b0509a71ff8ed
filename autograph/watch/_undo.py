"""Run a call for real, then take its effects back: for warmups that must leave no trace.

>>> with UndoWrites() as undo:
...     step(x, cache)           # writes the cache, draws random numbers
>>> undo.restore()               # the cache and the generators are as before the call

Used where autograph runs a function the caller did not ask to run: the warmup of
``fn.capture(...)`` ahead of time, and the eager check of verify mode. Every tensor that
existed before the call and is written by it (by its schema, or batch norm's running
statistics) has its whole storage saved before the first write; the CPU and CUDA default
generators have their state saved. Python-side effects (a counter in the function) are not
taken back.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Set, Tuple

import torch

from ._modes import PARTS, Observer
from ._reads import written_tensors

Tensor = torch.Tensor


def generator_states() -> List[Tuple[Any, Any]]:
    generators = [torch.default_generator]
    if torch.cuda.is_initialized():
        generators += list(torch.cuda.default_generators)
    return [(g, g.get_state()) for g in generators]


class UndoWrites(Observer):
    """Save what a call overwrites, so that ``restore()`` can put it back."""

    # Under the guard a composite op is run apart: its writes are made by its parts.
    sees = PARTS

    def __init__(self) -> None:
        self.saved: Dict[int, Tuple[Any, Any]] = {}
        self.created: Set[int] = set()
        self.generators = generator_states()

    def before(self, func: Any, args: tuple, kwargs: dict, tensors: Sequence[Tensor]) -> Set[int]:
        for value in (*args, *kwargs.values()):
            # A private generator (torch.rand(..., generator=g)) is state the call advances,
            # like the default ones: saved before its first draw. An op is handed its own
            # Python object for a generator (the default one too, passed explicitly): told
            # apart by the generator's identity, or a later state would be saved over it.
            if type(value) is torch.Generator and all(
                value._cdata != g._cdata for g, _ in self.generators
            ):
                self.generators.append((value, value.get_state()))
        for tensor in written_tensors(func, args, kwargs):
            storage = tensor.untyped_storage()
            # The storage's own identity (private: docs/design.md, "Private torch APIs"): its
            # data_ptr() changes when an op resizes it, and a Python storage object is not kept.
            key = storage._cdata
            if key not in self.created and key not in self.saved and storage.nbytes():
                # The whole storage: later writes may go through other views of it.
                self.saved[key] = (storage, storage.clone())
        # A view (t(), a slice) or an in-place op returns an input's storage: not new memory,
        # and a later write through it must be saved too.
        return {t.untyped_storage()._cdata for t in tensors if t.layout is torch.strided}

    def after(self, inputs: Set[int], out: Any) -> None:
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, Tensor) and t.layout is torch.strided:
                key = t.untyped_storage()._cdata
                if key not in inputs:
                    self.created.add(key)

    def restore(self) -> None:
        """Put every saved storage and generator back as it was."""
        with torch.no_grad():
            for storage, before in self.saved.values():
                storage.copy_(before)
        for generator, state in self.generators:
            generator.set_state(state)
        self.saved.clear()
