"""How an output that views a tensor it did not make is rebuilt on every call: the same view,
dtype and autograd link, of the caller's tensor (docs/design.md, "Outputs").

>>> View.of_leaf(x.view(torch.int32), x).on(new_x).dtype
torch.int32
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch

from ..watch._reads import storage_ptr

Tensor = torch.Tensor


class UnplannableOutput(ValueError):
    """An output the plan cannot rebuild on every call; the message says why and the fix."""


class View(NamedTuple):
    """How an output views a tensor it did not make: its size, strides, offset in bytes from
    the base's own, its dtype (``x.view(torch.int32)``, ``torch.view_as_real(z)``), and
    whether it is cut from autograd (``x.detach()``).

    >>> View.of_leaf(x.detach()[1:], x).on(x).requires_grad
    False
    """

    size: torch.Size
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype
    detached: bool

    @classmethod
    def of_leaf(cls, leaf: Tensor, base: Tensor) -> "View":
        offset = (
            leaf.storage_offset() * leaf.element_size()
            - base.storage_offset() * base.element_size()
        )
        # The key holds each argument's requires_grad and the grad mode: an output that needs
        # no gradient never does in this key's calls.
        view = cls(leaf.size(), leaf.stride(), offset, leaf.dtype, not leaf.requires_grad)
        if leaf.requires_grad and not view.differentiable(base):
            raise UnplannableOutput(
                f"it returns a {leaf.dtype} view of a {base.dtype} tensor that needs "
                f"gradients, which the graph cannot rebuild with its autograd history; "
                f"return a copy (.clone())"
            )
        return view

    def differentiable(self, base: Tensor) -> bool:
        return self.dtype == base.dtype or _real_of(base) == self.dtype

    def on(self, base: Tensor) -> Tensor:
        """This view, of ``base`` (the caller's tensor)."""
        start = base.storage_offset() * base.element_size() + self.offset
        if self.detached or not self.differentiable(base):
            base = base.detach()
        if self.dtype != base.dtype:
            if _real_of(base) == self.dtype:
                base = torch.view_as_real(base)
            else:  # view(dtype) of the whole storage: view(dtype) has no gradient anyway
                whole = base.untyped_storage().nbytes() // base.element_size()
                base = base.as_strided((whole,), (1,), 0).view(self.dtype)
        return base.as_strided(self.size, self.stride, start // base.element_size())


def _real_of(t: Tensor) -> Optional[torch.dtype]:
    """The dtype ``torch.view_as_real`` gives for ``t``, or None if it is not complex."""
    return t.real.dtype if t.is_complex() else None


def held_storages(outside: Optional[Dict[int, Tensor]]) -> Dict[int, Tensor]:
    """The tensors held outside a call (``OutputPlan``'s ``outside``) by their storage."""
    return {
        storage_ptr(t): t
        for t in (outside or {}).values()
        if t.layout is torch.strided and t.numel()
    }
