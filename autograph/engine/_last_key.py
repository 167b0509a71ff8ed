"""The last key a cache replayed, checked first by torch's C++ tensor guards: a call that
matches it skips the Python key (its attribute reads and its hash).

>>> last = LastKey.of(key, life, tensors, state, options)   # after a replay, plain tensors
>>> last.matches(args, kwargs, state, options)              # the next call: one C++ check

Only calls whose arguments are all plain tensors, passed positionally, take it (their key is
``(len(args), *tensor_meta(t), state)``, ``_keys.call_key``'s fast path). torch's
``TensorGuards`` (torch.compile's guard object) checks, for every argument in one C++ call,
its exact Python type, dispatch keys (device type, layout, autograd), dtype, device index,
``requires_grad``, sizes and strides: everything the Python key holds, and more, so a match
is the same key; a mismatch (or a tensor made under other dispatch settings) only sends the
call to the Python key. ``TensorGuards`` is private: where torch lacks it or its signature
differs (it is checked on a few tensors at import), ``LastKey.of`` returns None and every
call is keyed in Python. Measured on a CPU with torch 2.13: 0.06-0.1 us per tensor, against
0.4-0.8 us for the Python key's reads and hash.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

Tensor = torch.Tensor


def _guards_factory() -> Optional[Callable[..., Any]]:
    """torch's TensorGuards, if it is there and checks what a key holds; else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None

    def make(tensors: Sequence[Tensor]) -> Any:
        return TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )

    try:
        x = torch.zeros(2, 3)
        check = make([x]).check
        same = check(torch.ones(2, 3))
        differs = (
            check(torch.zeros(3, 2)),
            check(torch.zeros(3, 2).t()),
            check(torch.zeros(2, 3, dtype=torch.float64)),
            check(torch.zeros(2, 3, requires_grad=True)),
            check(torch.nn.Parameter(torch.zeros(2, 3))),
            check(2),
        )
    except Exception:  # another signature, or another behaviour: key in Python
        return None
    return make if same is True and not any(differs) else None


_make_guards = _guards_factory()


class LastKey:
    """A key of plain tensor arguments with its life, and the C++ check that finds it."""

    __slots__ = ("key", "life", "size", "state", "options", "check")

    def __init__(
        self, key: Any, life: Any, size: int, state: tuple, options: Any, check: Callable[..., bool]
    ):
        self.key, self.life, self.size = key, life, size
        self.state, self.options, self.check = state, options, check

    @classmethod
    def of(
        cls, key: Any, life: Any, tensors: List[Tensor], state: tuple, options: Any
    ) -> Optional["LastKey"]:
        """The last key for a call of these plain tensor arguments, or None where torch has
        no usable guards."""
        if _make_guards is None:
            return None
        try:
            check = _make_guards(tensors).check
        except Exception:  # a tensor the guards cannot describe
            return None
        return cls(key, life, len(tensors), state, options, check)

    def matches(self, args: tuple, kwargs: dict, state: tuple, options: Any) -> bool:
        """Whether a call has this key: the same options and state, and arguments that the
        guards pass."""
        return (
            len(args) == self.size
            and not kwargs
            and options is self.options
            and state == self.state
            and self.check(*args)
        )
