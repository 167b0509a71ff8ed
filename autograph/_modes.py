"""The base of autograph's dispatch modes, which see every op a call runs and leave
torch.compile to compile.

>>> class Watch(CompiledCodeRunsUnder):
...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
...         return func(*args, **(kwargs or {}))

Without ``ignore_compile_internals`` (torch >= 2.9), Dynamo skips every frame run under a
dispatch mode, and on torch <= 2.13 for good: a function compiled under autograph's guard stayed
uncompiled even when called directly later. With it, Dynamo compiles with the mode off and the
compiled code runs under the mode, which still sees the ops Inductor leaves to PyTorch. Older
torch ignores the method.
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class CompiledCodeRunsUnder(TorchDispatchMode):
    """A dispatch mode that Dynamo compiles around and runs compiled code under."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True
