"""Which backend graphs a call, decided from where its tensors are.

>>> choose_backend([x_on_cuda0])
(CUDA, 0, None, False)                       # backend, device, reason not to graph, loud
>>> choose_backend([torch.ones(3)])          # on the CPU, without the emulation
(None, -1, 'its tensors are on the CPU; CUDA graphs replay GPU work only', False)

CUDA graphs are the backend of GPU tensors. CPU tensors are graphed only while
``autograph.testing`` has registered its emulation (``use_emulation``): the engine asks this
module, and never imports the emulation itself (docs/design.md, "Backends").
"""

from __future__ import annotations

import functools
import os
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ._backend import Backend
from ._cuda_graphs import CUDA

Tensor = torch.Tensor

NO_CUDA = "CUDA is not available"
ON_THE_CPU = "its tensors are on the CPU; CUDA graphs replay GPU work only"

# The backend of CPU tensors while the emulation is on (process-wide, so that graphed calls
# in other threads are emulated too), else None.
_emulation: Optional[Backend] = None


def use_emulation(backend: Optional[Backend]) -> Optional[Backend]:
    """Make ``backend`` the one of CPU tensors (None: CPU calls run eagerly); return the one
    before, to restore it."""
    global _emulation
    before, _emulation = _emulation, backend
    return before


def emulation() -> Optional[Backend]:
    return _emulation


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """torch.cuda.is_available(), asked once: it costs 0.6 us, and cannot change."""
    return torch.cuda.is_available()


def choose_backend(tensors: List[Tensor]) -> Tuple[Optional[Backend], int, Optional[str], bool]:
    """(backend, device index, reason not to graph, whether that reason deserves a warning)."""
    types = {t.device.type for t in tensors}
    if types == {"cuda"}:
        indices = {t.device.index for t in tensors}
        if len(indices) == 1:
            return CUDA, indices.pop(), None, False
        return None, -1, f"its tensors are on several GPUs ({sorted(indices)})", True
    if not tensors:
        if cuda_available():
            return CUDA, torch.cuda.current_device(), None, False
        return None, -1, NO_CUDA, False
    if types == {"cpu"}:
        if _emulation is not None:
            return _emulation, -1, None, False
        return None, -1, ON_THE_CPU if cuda_available() else NO_CUDA, False
    if "cuda" in types and "cpu" in types:
        return (
            None,
            -1,
            (
                "it mixes CPU and CUDA tensors; the CPU work would not be replayed. "
                "Move every tensor argument to the GPU"
            ),
            True,
        )
    return None, -1, f"its tensors are on {sorted(types)}, not CUDA", False


INSIDE_A_CAPTURE = "it is called inside a capture, of which it is part"


class _AskTorch:
    """``cuda._initialized`` answered by torch's public check (a Python frame and a C call)."""

    @property
    def _initialized(self) -> bool:
        return torch.cuda.is_initialized()


# Whether CUDA has started, read twice on every call (``why_not_keyed``, ``execution_state``)
# as ``cuda._initialized``: torch's own flag, one attribute read, where the public
# ``torch.cuda.is_initialized()`` adds a frame and a C call (``_is_in_bad_fork``). In a child
# forked after CUDA started the flag still says True while CUDA cannot be used there, so a
# child asks torch (``_AskTorch``), as does a torch without the flag.
cuda: Any = (
    torch.cuda if isinstance(getattr(torch.cuda, "_initialized", None), bool) else _AskTorch()
)


def _in_a_forked_child() -> None:
    global cuda
    cuda = _AskTorch()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_a_forked_child)


def why_not_keyed(args: Sequence[Any], kwargs: dict) -> Optional[str]:
    """Why a call runs as written before it is keyed, or None: it is part of an enclosing
    capture (ours, the user's own graph, or an emulated one: ``INSIDE_A_CAPTURE``), or it has
    only plain CPU tensors, which run eagerly whatever their key would be (asked before keying,
    so that such calls cost about what the bare call does; other calls are keyed first: an
    unhashable argument is an error everywhere, with or without CUDA)."""
    emulation = _emulation
    if emulation is None and args and not kwargs:
        # Plain CPU tensors first: such a call runs as written whether or not a capture is
        # running (inside one, it is counted with the calls on the CPU), at the least cost.
        for a in args:
            if type(a) is not Tensor or a.is_cuda:
                break
        else:
            return _cpu_reason or _first_cpu_reason()
    if (emulation is not None and emulation.is_capturing()) or (
        cuda._initialized and _current_raw_stream(-1) != 0 and _capturing()
    ):
        return INSIDE_A_CAPTURE
    return None


_cpu_reason: Optional[str] = None  # why plain CPU tensors are not keyed, once asked


def _first_cpu_reason() -> str:
    global _cpu_reason
    _cpu_reason = ON_THE_CPU if cuda_available() else NO_CUDA
    return _cpu_reason


# torch.cuda.is_current_stream_capturing() without its Python wrapper (asked on every call);
# absent from CPU-only builds, where CUDA is never initialised. It asks the CUDA driver (0.33
# us on an H100's host): first the current stream, read from torch's thread state (0.16 us),
# since CUDA never captures on the legacy default stream (raw handle 0), where most calls are.
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)
