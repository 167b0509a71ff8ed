"""A backward graph's gradients, packed into few buffers, and handed to autograd per replay
(docs/design.md, "A replay's gradients").

>>> packed = PackedGradients(torch.autograd.grad(outputs, inputs))  # inside the capture
>>> packed.hand_out(needed)     # after a replay: views of fresh copies
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors

Tensor = torch.Tensor


class PackedGradients:
    """A backward graph's gradients, packed by the graph itself into one buffer per dtype and
    device (and one per argument), handed out per replay as views of fresh copies.

    >>> packed = PackedGradients(torch.autograd.grad(outputs, inputs))  # inside the capture
    >>> packed.hand_out(needed)   # views of fresh copies of the buffers

    The gradients live in the graph's memory, which the next replay overwrites, so autograd
    must get copies wherever it may keep one (``AccumulateGrad`` adopts a gradient as a
    ``.grad`` that is None: pytorch issue 181723). A clone per gradient would cost a launch
    each: a replay clones each packed buffer once, and its gradients are views of it, which
    keep it alive while any of them lives (one step's gradients). In a buffer, gradients of one
    shape lie side by side, so that one ``unbind`` cuts a run of them: an op per gradient, as
    ``make_graphed_callables``' ``detach`` is, not two (``narrow`` and ``view``).

    Never the graph's own buffers, even where autograd would only add a gradient into an
    existing ``.grad``: a hook on a parameter's ``AccumulateGrad`` node (DDP's older reducer,
    DeepSpeed) is handed the gradient itself and may keep it, and nothing cheap tells such
    hooks apart; measured on the H200, handing out the graph's own views gained nothing over
    the copies (benchmark (t), ``.grad`` kept between steps).
    """

    def __init__(self, grads: Sequence[Optional[Tensor]], alone: int = 0):
        # The first ``alone`` (the arguments' gradients) get a buffer each: a kept x.grad must
        # not keep a whole step of parameter gradients alive.
        groups: Dict[Any, List[int]] = {}
        for i, grad in enumerate(grads):
            if grad is not None:
                groups.setdefault(i if i < alone else (grad.dtype, grad.device), []).append(i)
        self.groups: List[Tuple[Tensor, List[Tuple[int, int, torch.Size]]]] = []
        order: List[int] = []
        for members in groups.values():
            members.sort(key=lambda i: tuple(grads[i].shape))  # stable: same shapes together
            order += members
            self.groups.append(
                (
                    _flatten_dense_tensors([grads[i] for i in members]),
                    _runs([grads[i].shape for i in members]),
                )
            )
        # Where each gradient is in the list of views (the last entry stands for None).
        where = [len(order)] * len(grads)
        for position, i in enumerate(order):
            where[i] = position
        self._pick = operator.itemgetter(*where, len(order))  # a tuple, even for one

    def hand_out(self, needed: Sequence[bool]) -> List[Optional[Tensor]]:
        views: List[Optional[Tensor]] = []
        for packed, runs in self.groups:
            views += _cut(packed.clone(), runs)
        views.append(None)
        picked = list(self._pick(views))[:-1]
        if not all(needed):
            picked = [grad if need else None for grad, need in zip(picked, needed)]
        return picked


def _runs(shapes: Sequence[torch.Size]) -> List[Tuple[int, int, torch.Size]]:
    """(offset, count, shape) of each run of equal shapes, in order, in a packed buffer."""
    runs: List[Tuple[int, int, torch.Size]] = []
    offset = 0
    for shape in shapes:
        if runs and runs[-1][2] == shape:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, shape)
        else:
            runs.append((offset, 1, shape))
        offset += shape.numel()
    return runs


def _cut(packed: Tensor, runs: Sequence[Tuple[int, int, torch.Size]]) -> List[Tensor]:
    """The gradients packed in ``packed``: a view each, one ``unbind`` per run of a shape."""
    views: List[Tensor] = []
    for offset, count, shape in runs:
        run = packed.narrow(0, offset, count * shape.numel())
        if count > 1:
            run = run.view(count, *shape)
        views += run.unbind(0) if count > 1 else (run.view(shape),)
    return views
