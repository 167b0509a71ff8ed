"""autograph's dispatch modes, which see every op a call runs and leave torch.compile to
compile; and the one mode that shows each op to every concern watching a run.

>>> with UnsafeOpDetector("cuda", raise_on_unsafe=False), CallWatch(statics) as watch:
...     step(x)          # one mode on the stack: each op goes to the read watch, then the guard

Without ``ignore_compile_internals`` (torch >= 2.9), Dynamo skips every frame run under a
dispatch mode, and on torch <= 2.13 for good: a function compiled under autograph's guard stayed
uncompiled even when called directly later. With it, Dynamo compiles with the mode off and the
compiled code runs under the mode, which still sees the ops Inductor leaves to PyTorch. Older
torch ignores the method.

The guard, the read and write watch, a bucket's numbers and the undo are ``Observer``s, not
modes: entered inside one another (``capture()``'s warmup runs under all four), they join the
one ``OpWatch`` on top of the thread's mode stack instead of pushing a mode each. Each mode
level costs every op about 3 us in torch's own machinery (its push and pop, the lookup of a
rule, Dynamo's guard around ``__torch_dispatch__``) before any work of ours, and a watched run
makes hundreds of ops (docs/design.md, "Dispatch modes").
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # torch's own reader of the thread's mode stack, private (docs/design.md)
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - every observer then pushes a mode of its own

    def _get_current_dispatch_mode() -> Any:
        return None


Tensor = torch.Tensor


def tensors_in(values: Iterable[Any]) -> Iterable[Tensor]:
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from tensors_in(v)


def _op_tensors(args: tuple, kwargs: dict) -> List[Tensor]:
    """The tensors an op is passed, found once for all observers."""
    found = []
    for values in (args, kwargs.values()):
        for v in values:
            if isinstance(v, Tensor):
                found.append(v)
            elif isinstance(v, (list, tuple)):
                found.extend(tensors_in(v))
    return found


def run_apart(mode: TorchDispatchMode, func: Any, keys: Any, args: tuple, kwargs: dict) -> Any:
    """Run a composite op's own kernel with ``mode`` on top again, so its parts reach it
    (``keys``: ``_unsafe_ops.composite_keys``)."""
    with mode:
        return func.redispatch(keys, *args, **kwargs)


class CompiledCodeRunsUnder(TorchDispatchMode):
    """A dispatch mode that Dynamo compiles around and runs compiled code under."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


# How an observer sees a composite op that a run takes apart (under ``torch.inference_mode``
# composite ops reach a mode whole; the guard runs their parts under the mode, ``_guard``).
WHOLE, PARTS, BOTH = "whole", "parts", "both"


class Observer:
    """One concern watching the ops of a run: ``before`` each op (its result is handed to
    ``after`` unless None), ``after`` it. As a context manager it joins the ``OpWatch`` on
    top of the thread's mode stack, or pushes one.

    ``sees``: WHOLE, a composite op taken apart is seen whole and its parts are not (reads and
    numbers are the caller's); PARTS, its parts are seen and not the whole (writes land in
    the parts); BOTH, the whole (``before_split``) and the parts. An observer that takes
    composite ops apart (the guard) says how with ``split``.
    """

    sees = WHOLE
    split: Optional[Callable[[Any, Sequence[Tensor]], Any]] = None

    def before(self, func: Any, args: tuple, kwargs: dict, tensors: Sequence[Tensor]) -> Any:
        return None

    def before_split(self, func: Any, args: tuple, kwargs: dict, tensors: Sequence[Tensor]) -> Any:
        return self.before(func, args, kwargs, tensors)

    def after(self, token: Any, out: Any) -> None:
        pass

    def __enter__(self) -> Any:
        top = _get_current_dispatch_mode()
        watch = top if isinstance(top, OpWatch) else OpWatch()
        watch.join(self)
        self._watch = watch
        return self

    def __exit__(self, *exc: Any) -> None:
        self._watch.leave(self)


class OpWatch(CompiledCodeRunsUnder):
    """The dispatch mode of every observer of a run: each op is shown to each observer, the
    last joined first (as the innermost of nested modes would see it first), and run once."""

    def __init__(self) -> None:
        super().__init__()
        self.observers: Tuple[Observer, ...] = ()  # the last joined first
        self.split: Optional[Callable[[Any, Sequence[Tensor]], Any]] = None
        # The mode a split op's parts run under: one of the observers that see parts (itself
        # if all do). A mode of its own, not a depth count here: autograd's device threads
        # share a thread's mode stack.
        self.parts: OpWatch = self

    def join(self, observer: Observer) -> None:
        if not self.observers:
            super().__enter__()
        self._set((observer, *self.observers))

    def leave(self, observer: Observer) -> None:
        kept = tuple(o for o in self.observers if o is not observer)
        if len(kept) == len(self.observers):
            return  # left already: the mode must not be popped twice
        self._set(kept)
        if not kept:
            super().__exit__(None, None, None)

    def _set(self, observers: Tuple[Observer, ...]) -> None:
        self.observers = observers
        self.split = next((o.split for o in observers if o.split is not None), None)
        of_parts = tuple(o for o in observers if o.sees != WHOLE)
        self.parts = self
        if of_parts != observers:
            self.parts = OpWatch()
            self.parts._set(of_parts)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = _op_tensors(args, kwargs)
        keys = None if self.split is None else self.split(func, tensors)
        if keys is not None:
            return self._split(func, keys, args, kwargs, tensors)
        tokens: List[Tuple[Observer, Any]] = []
        for observer in self.observers:
            token = observer.before(func, args, kwargs, tensors)
            if token is not None:
                tokens.append((observer, token))
        out = func(*args, **kwargs)
        for observer, token in tokens:
            observer.after(token, out)
        return out

    def _split(
        self, func: Any, keys: Any, args: tuple, kwargs: dict, tensors: Sequence[Tensor]
    ) -> Any:
        """Run a composite op apart, its parts shown to the observers that see parts: bool(t)
        is aten.is_nonzero, whose part aten._local_scalar_dense reads the host."""
        tokens: List[Tuple[Observer, Any]] = []
        for observer in self.observers:
            if observer.sees != PARTS:
                token = observer.before_split(func, args, kwargs, tensors)
                if token is not None:
                    tokens.append((observer, token))
        out = run_apart(self.parts, func, keys, args, kwargs)
        for observer, token in tokens:
            observer.after(token, out)
        return out
