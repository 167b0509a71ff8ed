"""Host calls that are not ATen ops, watched while the guard runs: synchronisation, the
allocator, and reseeding or restoring random generators.

>>> with watch_host_calls(detector):
...     torch.cuda.synchronize()       # detector.report("torch.cuda.synchronize()", ...)

The guard's dispatch mode sees every ATen op; these calls never reach it, so they are patched,
temporarily and per thread: ``torch.cuda.synchronize``, ``empty_cache``, the ``Stream`` and
``Event`` waits, ``print()`` of a tensor on the graphed device, and the calls that reseed or
restore a random generator (``torch.manual_seed``, ``torch.seed``, ``torch.set_rng_state``, their
``torch.random`` and ``torch.cuda`` forms and ``torch.random.fork_rng``): a replay does not run
Python, so a reseed would happen at capture only. The outermost call is reported, at the
user's line. The patches are installed while any thread watches, and report only to the
thread that watches.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType
from typing import Any, Callable, Optional

import torch

SYNC_CONSEQUENCE = "synchronises with the host"
READS_VALUES = "reads the tensor's values in Python, which a graph freezes at capture"
RESEEDS = (
    "reseeds the random generator, which a graph does only at capture: replays would "
    "not restart the random sequence"
)
SETS_STATE = (
    "sets the random generator's state, which a graph does only at capture: replays "
    "would not restart the random sequence"
)
FORKS = (
    "restores the random generator's state on exit, which a graph does only at capture: "
    "replays would not restore it"
)

_COMPILER_DIRS = tuple(
    os.path.join(os.path.dirname(torch.__file__), name) + os.sep
    for name in ("_inductor", "_dynamo")
)


def in_compiled_code_runtime(frame: Optional[FrameType]) -> bool:
    """Whether a host call comes from torch.compile itself: Inductor times a kernel's
    configurations at its first run, synchronising; Dynamo saves and restores the random
    generators around a compile. Like the dispatch mode (``ignore_compile_internals``), the
    patches leave the compiler alone; a sync that reached a capture would still be caught as a
    CUDA capture error."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_COMPILER_DIRS):
            return True
        frame = frame.f_back
    return False


_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_originals: dict = {}


def _on_device(args: tuple, device_type: str) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == device_type


def _always(args: tuple, device_type: str) -> bool:
    return True


def _patch_targets() -> list:
    """Host calls that are not ATen ops: (owner, attribute, operation, consequence, applies)."""
    # torch.manual_seed (torch.random.manual_seed under another name) calls
    # torch.cuda.manual_seed_all: the outermost call reports first, and only the first
    # finding is kept.
    seeding = [
        (
            owner,
            name,
            f"{prefix}.{name}()",
            SETS_STATE if name.startswith("set_") else RESEEDS,
            _always,
        )
        for owner, prefix, names in (
            (torch, "torch", ("manual_seed", "seed", "set_rng_state")),
            (torch.random, "torch.random", ("manual_seed", "seed", "set_rng_state")),
            (
                torch.cuda,
                "torch.cuda",
                (
                    "manual_seed",
                    "manual_seed_all",
                    "seed",
                    "seed_all",
                    "set_rng_state",
                    "set_rng_state_all",
                ),
            ),
        )
        for name in names
    ]
    return seeding + [
        # Reported where the user enters it: its restore runs from contextlib, on exit.
        (torch.random, "fork_rng", "torch.random.fork_rng()", FORKS, _always),
        (torch.cuda, "synchronize", "torch.cuda.synchronize()", "waits for the whole GPU", _always),
        (
            torch.cuda,
            "empty_cache",
            "torch.cuda.empty_cache()",
            "changes the allocator, which a graph cannot replay",
            _always,
        ),
        (torch.cuda.Stream, "synchronize", "Stream.synchronize()", SYNC_CONSEQUENCE, _always),
        (torch.cuda.Stream, "query", "Stream.query()", "polls the GPU from the host", _always),
        (torch.cuda.Event, "synchronize", "Event.synchronize()", SYNC_CONSEQUENCE, _always),
        (torch.cuda.Event, "query", "Event.query()", "polls the GPU from the host", _always),
        # Tensor.__repr__ turns dispatch modes off before it reads the values.
        (torch._tensor_str, "_str", _printed, None, _on_device),
        # On a CUDA tensor the dispatch mode sees their copy to the host; on the CPU (the
        # emulation) there is no copy to see, and the value would be frozen at capture.
        (torch.Tensor, "tolist", ".tolist()", READS_VALUES, _on_device),
        (torch.Tensor, "numpy", ".numpy()", READS_VALUES, _on_device),
    ]


def _printed(device_type: str) -> tuple:
    """(operation, consequence) of ``print(t)``: a CUDA tensor is copied to the host; a CPU
    tensor (the emulation's) is read in Python."""
    fix = "print outside the graphed function (a print inside it runs at warmup and capture only)"
    if device_type == "cuda":
        return (
            "print() or repr() of a GPU tensor",
            f"copies it to the host, which synchronises: {fix}",
        )
    return "print() or repr() of a CPU tensor", f"{READS_VALUES}: {fix}"


def _guarded(
    original: Callable,
    operation: Any,
    consequence: Optional[str],
    applies: Callable[[tuple, str], bool],
) -> Callable:
    """``original``, reporting to the thread's detector; ``operation`` is a name, or a
    function of the graphed device type giving (operation, consequence)."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        detector = getattr(_local, "detector", None)
        if (
            detector is not None
            and applies(args, detector.device_type)
            and not in_compiled_code_runtime(sys._getframe(1))
        ):
            words = (
                operation(detector.device_type) if callable(operation) else (operation, consequence)
            )
            detector.report(*words, sys._getframe(1))
        return original(*args, **kwargs)

    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    return guarded


def _install_patches() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users += 1
        if _patch_users > 1:
            return
        for owner, name, operation, consequence, applies in _patch_targets():
            # None: inherited (Tensor.tolist is TensorBase's), so removing the patch deletes it.
            _originals[(owner, name)] = owner.__dict__.get(name)
            setattr(owner, name, _guarded(getattr(owner, name), operation, consequence, applies))


def _remove_patches() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users:
            return
        for (owner, name), original in _originals.items():
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _originals.clear()


class watch_host_calls:
    """Report this thread's host calls to ``detector`` (its ``report(operation, consequence,
    frame)``) inside the block; blocks nest, the inner detector reporting."""

    def __init__(self, detector: Any):
        self.detector = detector

    def __enter__(self) -> None:
        self._outer = getattr(_local, "detector", None)
        _local.detector = self.detector
        _install_patches()

    def __exit__(self, *exc: Any) -> None:
        _local.detector = self._outer
        _remove_patches()
