"""Backward hooks around a graphed backward: each must run exactly as often as eagerly.

>>> with lifted_tensor_hooks(leaves):           # around the backward's capture
...     grads = torch.autograd.grad(outputs, leaves, grad_outputs)
>>> with ModuleBackwardHooks() as hooked:        # around the forward's capture
...     outputs = model(*statics)
>>> hooked.found                                 # "self.encoder (LayerNorm), hook log_grad"

A hook on a leaf (``Tensor.register_hook``) runs when a gradient reaches the leaf: in
``torch.autograd.grad`` as well as in ``AccumulateGrad``. A graphed backward is
``autograd.grad`` of the leaves, captured, and its gradients reach the leaves through the
replay's ``AccumulateGrad``: the hook would run at capture, inside the graph, and again on each
replay's gradient. So the capture runs without the leaves' hooks, which then run once per
backward, on the replayed gradient, as eagerly. (``register_post_accumulate_grad_hook`` runs in
``AccumulateGrad`` only, so never at capture.)

A module's backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
``register_backward_hook`` and the global ones) are Python run by nodes inside the forward's
autograd graph: a graph would run them once, at capture, and never on replays.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.nn.modules import module as _module

Tensor = torch.Tensor


class lifted_tensor_hooks:
    """Run the block with the leaves' tensor hooks taken off, and put them back after. A
    class, not a generator: the block's exception (a custom backward's) passes through
    untouched, which ``contextlib.contextmanager`` would not do for one that takes no
    ``__traceback__`` (a frozen dataclass)."""

    def __init__(self, leaves: Sequence[Tensor]):
        self.lifted = [(leaf, leaf._backward_hooks) for leaf in leaves if leaf._backward_hooks]

    def __enter__(self) -> None:
        for leaf, _ in self.lifted:
            leaf._backward_hooks = None

    def __exit__(self, *exc: Any) -> None:
        for leaf, hooks in self.lifted:
            leaf._backward_hooks = hooks


def _hook_names(hooks: Any) -> str:
    return ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks.values())


def global_backward_hooks() -> Optional[str]:
    """The module backward hooks registered for every module, named, or None."""
    hooks = {**_module._global_backward_pre_hooks, **_module._global_backward_hooks}
    return _hook_names(hooks) if hooks else None


class ModuleBackwardHooks:
    """Notes, while active, the first module called that has a backward hook of its own."""

    def __init__(self) -> None:
        self.found: Optional[str] = None
        self._handle: Any = None

    def _note(self, module: torch.nn.Module, args: Any) -> None:
        hooks = {**module._backward_pre_hooks, **module._backward_hooks}
        if hooks and self.found is None:
            self.found = f"a {type(module).__name__} module's backward hook {_hook_names(hooks)}"

    def __enter__(self) -> "ModuleBackwardHooks":
        self._handle = _module.register_module_forward_pre_hook(self._note)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()

    def reason(self) -> Optional[str]:
        """Why the backward cannot be graphed for a module backward hook, or None."""
        found = self.found
        if found is None and global_backward_hooks() is not None:
            found = f"the global module backward hook {global_backward_hooks()}"
        if found is None:
            return None
        return (
            f"{found} is Python that runs inside the backward, which a graph would run "
            f"once at capture and never on replays. Register a hook on the tensors "
            f"instead (Tensor.register_hook on a parameter runs as eagerly), or run this "
            f"module eagerly under autograph.region(enabled=False)"
        )
