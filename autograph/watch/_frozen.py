"""The frozen parameters a graph captured with gradients on reads, and whether one was unfrozen.

>>> frozen = FrozenReads.of(external, survey)   # None without gradients, or none frozen
>>> backbone.requires_grad_(True)                # unfrozen after capture
>>> frozen.unfrozen()
'self.0.weight.requires_grad (turned on since capture)'

A graph captured while gradients are on, from a call whose outputs needed none (a frozen
backbone under a trained head), replays detached outputs. Once one of the parameters it reads
requires grad again, eager outputs would carry a gradient to it: the graph must be captured
again, as a training graph. ``requires_grad`` is set in C++ and raises no event, so each such
parameter is read on every replay, about 70 ns each on a CPU (torch 2.13); graphs captured
without gradients (``no_grad``, ``inference_mode``) pay nothing, as their key says how the
call runs. (A training graph's backward checks its own frozen parameters: ``_training``.)
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

Tensor = torch.Tensor


class FrozenReads:
    """Weak references to the frozen parameters a graph reads, with their names."""

    __slots__ = ("parameters",)

    def __init__(self, parameters: List[Tuple[Any, str]]):
        self.parameters = parameters

    @classmethod
    def of(cls, external: Dict[int, Tensor], survey: Any) -> Optional["FrozenReads"]:
        """Those of the tensors read by address, where gradients are on now (the capture's
        call), or None."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return None
        frozen = [
            (weakref.ref(t), survey.name(t))
            for t in external.values()
            if isinstance(t, torch.nn.Parameter) and not t.requires_grad
        ]
        return cls(frozen) if frozen else None

    def unfrozen(self) -> Optional[str]:
        """The name of a parameter that requires grad now, or None."""
        for ref, name in self.parameters:
            parameter = ref()
            if parameter is not None and parameter.requires_grad:
                return f"{name}.requires_grad (turned on since capture)"
        return None
