"""The guard: find what a CUDA graph cannot replay faithfully, and say where it happened.

>>> with UnsafeOpDetector("cuda", raise_on_unsafe=False) as detector:
...     step(x)                      # a real call: nothing is changed, findings are recorded
>>> detector.finding.message()
'.item() at model.py:42 synchronises with the host'

Two layers (docs/design.md, "The guard"):
- a ``TorchDispatchMode`` sees every ATen op of the calling thread: host reads
  (``.item()``, ``bool(t)``), device-to-host copies, pageable host-to-device copies, ops
  whose output shape depends on the data (``nonzero``, boolean masks, ``unique``) and CPU
  tensors computed on; a CPU computation inside a ``torch.optim`` optimizer's ``step()`` is
  named after the optimizer (``capturable=False`` keeps its step count on the CPU). Under
  ``torch.inference_mode()`` composite ops reach the mode whole (``bool(t)`` arrives as
  ``aten.is_nonzero``), so the mode runs their parts under itself and sees the same ops as
  under ``torch.no_grad()`` (but for four judged whole, ``_unsafe_ops.judged_apart``);
- temporary, thread-checked patches of host calls that are not ATen ops (``_host_calls``):
  synchronisation, the allocator, and reseeding or restoring a random generator.
The detector raises ``GuardError`` during capture, so a capture stops before CUDA fails; with
``raise_on_unsafe=False`` it only records (nothing of the call changes). The last warmup runs
under ``LibraryUse`` instead, which notes what a capture must prepare and judges nothing.
What slips past both (code that disables dispatch modes, C extensions, a ``Generator``
object's own ``manual_seed()`` and ``seed()``, which are C methods that cannot be patched, a
seeding function imported by name before the detector started) makes CUDA or torch reject the
capture; ``classify_capture_error`` turns those errors into findings too. Not everything is
rejected: torch captures a CUDA generator's ``set_state()`` without complaint (torch 2.11), so
a ``Generator`` object's ``set_state()`` goes unseen.
"""

from __future__ import annotations

import dataclasses
import dis
import linecache
import os
import re
import sys
import traceback
import weakref
from types import FrameType, TracebackType
from typing import Any, Container, Dict, List, Optional, Sequence, Tuple

import torch

from .._warn import is_user_file
from ._host_calls import RESEEDS as _RESEEDS
from ._host_calls import SYNC_CONSEQUENCE as _SYNC_CONSEQUENCE
from ._host_calls import watch_host_calls
from ._modes import BOTH, Observer, tensors_in
from ._reads import LIFT_FRESH, made_of_python_values, storage_ptr, written_tensors
from ._unsafe_ops import CPU_OPERATION, TRAITS, judged_apart, traits_of, unsafe_op

_OPTIM_DIR = os.path.join(os.path.dirname(torch.__file__), "optim") + os.sep


@dataclasses.dataclass(frozen=True)
class Finding:
    """One unsafe operation: what it was, what it does, and where in the user's code."""

    operation: str
    consequence: str
    location: str = "an unknown line"
    source: str = ""

    def message(self) -> str:
        return f"{self.operation} at {self.location} {self.consequence}"


class GuardError(RuntimeError):
    """Raised inside a capture to stop it before CUDA sees an unsafe operation."""

    def __init__(self, finding: Finding):
        super().__init__(f"autograph stopped a capture: {finding.message()}")
        self.finding = finding


def _location(filename: str, lineno: int) -> Tuple[str, str]:
    source = linecache.getline(filename, lineno).strip()
    return f"{os.path.basename(filename)}:{lineno}", source


def location_of_caller(frame: Optional[FrameType]) -> Tuple[str, str]:
    """The first frame outside torch and autograph, walking outwards from ``frame``."""
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return _location(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return "an unknown line", ""


def location_in_traceback(tb: Optional[TracebackType]) -> Tuple[str, str]:
    """The innermost frame of a traceback that is outside torch and autograph."""
    found = ("an unknown line", "")
    for entry in traceback.extract_tb(tb):
        if is_user_file(entry.filename) and entry.lineno is not None:
            found = _location(entry.filename, entry.lineno)
    return found


_UNNAMED_READ = "reading a tensor's value in Python"


def _host_read_name(source: str) -> str:
    """Name the Python construct behind ``aten._local_scalar_dense`` from the source line."""
    for pattern, name in (
        (r"\.item\(\)", ".item()"),
        (r"\.tolist\(\)", ".tolist()"),
        (r"(?<![\w.])bool\(", "bool(tensor)"),
        (r"(?<![\w.])int\(", "int(tensor)"),
        (r"(?<![\w.])float\(", "float(tensor)"),
    ):
        if re.search(pattern, source):
            return name
    if source.startswith(("if ", "elif ", "while ", "assert ")) or " if " in source:
        return "a tensor used as a Python condition"
    return _UNNAMED_READ


def optimizer_running(frame: Optional[FrameType]) -> Optional[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizer whose ``step()`` made the op at ``frame``, if any.

    >>> optimizer_running(sys._getframe(1))   # in a dispatch mode, for an op of Adam.step()
    Adam (...)

    Walks outwards from ``frame`` through torch's own frames, stopping at the user's code.
    """
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        if frame.f_code.co_filename.startswith(_OPTIM_DIR):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.optim.Optimizer):
                return owner
        frame = frame.f_back
    return None


def _not_capturable(name: str) -> str:
    return f"{name}.step() with capturable=False"


def _capturable_fix(name: str, device_type: str) -> str:
    """What to do about optimizer class ``name`` made with capturable=False, graphing
    ``device_type``."""
    fix = f"create it with {name}(..., capturable=True)"
    if device_type == "cpu":  # the emulation: torch refuses capturable with CPU parameters
        fix = f"on CUDA, {fix}; in the CPU emulation, step it outside the graphed function"
    return fix


def _optimizer_words(optimizer: torch.optim.Optimizer, device_type: str) -> Tuple[str, str]:
    """(operation, consequence) for a CPU computation or a host read inside
    ``optimizer.step()``, graphing ``device_type``."""
    name = type(optimizer).__name__
    if "capturable" in optimizer.defaults and not all(
        group.get("capturable") for group in optimizer.param_groups
    ):
        return _not_capturable(name), (
            "keeps its step count on the CPU, which a graph freezes at capture: "
            + _capturable_fix(name, device_type)
        )
    return f"{name}.step()", (
        "runs on the CPU, which a graph freezes at capture: step this "
        "optimizer outside the graphed function"
    )


def host_read_fix(operation: str) -> str:
    """What to write instead of a host read named ``operation`` (``_host_read_name``)."""
    if operation == "a tensor used as a Python condition":
        return (
            "a graph would freeze the branch taken at capture: choose on the GPU with "
            "torch.where(condition, a, b), or decide outside the graphed function"
        )
    without = f" (without {operation})" if operation == ".item()" else ""
    return (
        "a graph would freeze the value read at capture: keep it a tensor"
        + without
        + ", or read it outside the graphed function"
    )


def _finding(
    operation: str, consequence: str, frame: Optional[FrameType], device_type: str = "cuda"
) -> Finding:
    location, source = location_of_caller(frame)
    # Inside optimizer.step(), the optimizer is the cause: with capturable=False it keeps its
    # step count on the CPU, computed with on CUDA and read with .item() where the graphed
    # device is the CPU (the emulation).
    optimizer = optimizer_running(frame) if operation in ("host read", CPU_OPERATION) else None
    if optimizer is not None:
        operation, consequence = _optimizer_words(optimizer, device_type)
    elif operation == "host read":
        operation = _host_read_name(source)
        consequence = f"{consequence}, and {host_read_fix(operation)}"
    return Finding(operation, consequence, location, source)


class LibraryUse(Observer):
    """What a capture of the run must prepare for: a cuDNN handle, private random generators.

    >>> with LibraryUse() as uses:
    ...     step(x)                      # a warmup: judged by nothing, its ops run whole
    >>> uses.uses_cudnn, uses.generators
    (False, [])
    """

    def __init__(self) -> None:
        self.uses_cudnn = False  # whether a capture must first create a cuDNN handle
        # The private random generators the call draws from: a CUDA capture registers them.
        self.generators: List[torch.Generator] = []

    def before(self, func: Any, args: tuple, kwargs: dict, tensors: Sequence[torch.Tensor]) -> None:
        if not self.uses_cudnn and (TRAITS.get(func) or traits_of(func)).cudnn:
            self.uses_cudnn = True
        generator = kwargs.get("generator")
        # An op sees a new Python object for the same generator at each draw: told apart by
        # the generator's own identity (``_cdata``, docs/design.md "Private torch APIs").
        if generator is not None and all(generator._cdata != g._cdata for g in self.generators):
            self.generators.append(generator)


class PythonNumbers:
    """CPU scalars holding Python numbers, by identity (a set would compare tensors by value),
    held weakly, with their storages: a write through any view of one (``n.view(1).copy_(s)``)
    makes it state.

    >>> numbers = PythonNumbers(); numbers.add(t)
    >>> t in numbers, torch.tensor(1.0) in numbers
    (True, False)
    """

    def __init__(self) -> None:
        self._held: Dict[int, Tuple["weakref.ref[torch.Tensor]", int]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        self._held[id(tensor)] = (weakref.ref(tensor), storage_ptr(tensor))

    def __len__(self) -> int:
        return len(self._held)

    def discard_written(self, written: Sequence[torch.Tensor]) -> bool:
        """Forget those held here that share memory with ``written``; whether there were any."""
        storages = {storage_ptr(t) for t in written} - {0}
        found = [key for key, (_, storage) in self._held.items() if storage in storages]
        for key in found:
            del self._held[key]
        return bool(found)

    def __contains__(self, tensor: object) -> bool:
        held = self._held.get(id(tensor))
        return held is not None and held[0]() is tensor


class UnsafeOpDetector(LibraryUse):
    """Record (or stop at) the first unsafe operation made by the current thread.

    ``device_type`` is the device whose work is being graphed ("cuda"; the CPU emulation used
    by the test suite passes "cpu"). With ``raise_on_unsafe`` the first finding raises
    ``GuardError``; otherwise calls proceed unchanged and the first finding is kept.
    """

    # Composite ops are run apart (``_modes.OpWatch``), each part judged: bool(t) is
    # aten.is_nonzero, whose part aten._local_scalar_dense reads the host.
    sees = BOTH

    def __init__(self, device_type: str, raise_on_unsafe: bool):
        super().__init__()
        self.device_type = device_type
        self.raise_on_unsafe = raise_on_unsafe
        self.finding: Optional[Finding] = None
        # CPU scalars made of Python numbers in this run (torch.tensor(2.0)), and those
        # computed from them alone: what a graph freezes of them is Python's numbers.
        self.constants = PythonNumbers()

    def report(self, operation: str, consequence: str, frame: Optional[FrameType]) -> None:
        if self.finding is None:
            self.finding = _finding(operation, consequence, frame, self.device_type)
        if self.raise_on_unsafe:
            raise GuardError(self.finding)

    before_split = LibraryUse.before

    def split(self, func: Any, tensors: Sequence[torch.Tensor]) -> Optional[Any]:
        return judged_apart(func, tensors, self.device_type)

    def before(self, func: Any, args: tuple, kwargs: dict, tensors: Sequence[torch.Tensor]) -> Any:
        super().before(func, args, kwargs, tensors)
        if func is LIFT_FRESH:
            # Its result: a number made into a CPU tensor (``after``), if its memory is new
            # (not a numpy array's, torch.as_tensor(array): the caller's, read by address).
            return True if all(made_of_python_values(t) for t in tensors) else None
        # Such a number computed with (x * torch.tensor(scale)) or read back (torch.compile's
        # code does so with a float argument) is no CPU work: the graph freezes Python's
        # value, as it freezes any Python number the call computes with (the key and the
        # values read cover them). Not one written in place: a count kept from the run
        # (an optimizer's first step makes its step count so, then adds 1 to it) is state.
        numbers: Container[torch.Tensor] = self.constants
        if self.constants and self.constants.discard_written(written_tensors(func, args, kwargs)):
            numbers = ()
        unsafe = unsafe_op(func, args, kwargs, self.device_type, tensors, numbers)
        if unsafe is not None:
            self.report(*unsafe, sys._getframe(1))
        # An op of such numbers alone makes such numbers (torch.tensor(d).sqrt()); not a
        # random one (torch.bernoulli(torch.tensor(0.5))), whose draw a graph would freeze.
        if (
            numbers
            and tensors
            and all(t in numbers for t in tensors)
            and torch.Tag.nondeterministic_seeded not in func.tags
        ):
            return True
        return None

    def after(self, token: Any, out: Any) -> None:
        if token:
            for tensor in tensors_in(out if isinstance(out, (list, tuple)) else (out,)):
                if tensor.device.type == "cpu" and tensor.dim() == 0:
                    self.constants.add(tensor)

    def __enter__(self) -> "UnsafeOpDetector":
        self._host_calls = watch_host_calls(self)
        self._host_calls.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._host_calls.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._host_calls.__exit__(None, None, None)


# Errors that CUDA or PyTorch raise when work cannot be captured, with plain words for each.
_NOT_PERMITTED = "operation not permitted when stream is capturing"
_CAPTURE_ERRORS = (
    (_NOT_PERMITTED, "made a CUDA call that stream capture does not allow"),
    (
        "operation failed due to a previous error during capture",
        "made a CUDA call that invalidated the capture",
    ),
    ("called a synchronizing CUDA operation", _SYNC_CONSEQUENCE),
    (
        "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
        "copies between pageable host memory and the GPU, which cannot be captured",
    ),
    ("Offset increment outside graph capture", "left the CUDA random generator unusable"),
    ("during CUDA graph capture", "is not allowed during CUDA graph capture"),
    ("graph capture", "failed during CUDA graph capture"),
    (
        "CUDA generator",
        "uses a CUDA random generator that the capture does not know (one "
        "made inside the function, or first drawn from in the capture; torch < 2.4 graphs no "
        "private generator). Make the generator once, outside the function",
    ),
)
_OPTIMIZER_REFUSED = re.compile(
    r"graph capture of step\(\) for an instance of (\w+) but param_groups' capturable is False"
)
# Autograd accumulates a parameter's gradient on the stream its AccumulateGrad node was made
# on (torch >= 2.9). A node made on the default stream before autograph first saw the call,
# and kept alive since, makes the default stream wait on the capture, which CUDA refuses.
_LEGACY_STREAM = "operation would make the legacy stream depend on a capturing"
_STALE_ACCUMULATOR = (
    "is tied to the default stream by an autograd graph made before autograph first saw this "
    "call and still alive (the output or loss of an earlier eager call, or DDP built on the "
    "default stream), and a graph cannot capture the default stream. Drop references to "
    "earlier outputs before the first graphed call (del loss), or build DDP inside "
    "`with torch.cuda.stream(autograph.capture_stream()):`"
)
_SEEDING_CALL = re.compile(r"[\w.]*(?:seed|set_rng_state|set_state|fork_rng)\w*\(")


def _named_cause(text: str, source: str, device_type: str) -> Optional[Tuple[str, str]]:
    """(operation, consequence) when the error's text or the user's line names the cause.

    >>> _named_cause("... set_current_seed can be called during stream capture only if ...",
    ...              "g.manual_seed(1)", "cuda")
    ('g.manual_seed()', 'reseeds the random generator, ...')
    """
    refused = _OPTIMIZER_REFUSED.search(text)
    if refused:
        name = refused.group(1)
        return _not_capturable(name), (f"cannot be captured: {_capturable_fix(name, device_type)}")
    if "set_current_seed" in text or "CUDAGeneratorImpl::seed" in text:
        call = _SEEDING_CALL.search(source)
        return (call.group(0) + ")" if call else "reseeding a random generator"), _RESEEDS
    if _LEGACY_STREAM in text:
        return "gradient accumulation into a parameter", _STALE_ACCUMULATOR
    if _NOT_PERMITTED in text and _host_read_name(source) != _UNNAMED_READ:
        operation = _host_read_name(source)
        return operation, (
            f"{_SYNC_CONSEQUENCE}: CUDA stopped the capture ({_NOT_PERMITTED}); "
            f"{host_read_fix(operation)}"
        )
    return None


_RAISES = {dis.opmap[name] for name in ("RAISE_VARARGS", "RERAISE") if name in dis.opmap}


def raised_by_user(error: BaseException) -> bool:
    """Whether a ``raise`` statement in the user's code raised ``error``: the innermost frame
    of its traceback is in a file outside torch and autograph, stopped at a raise.

    >>> def check(x):
    ...     raise ValueError("no graph capture here")
    >>> raised_by_user(error_of(check))      # a C function's error stops at a call instead
    True
    """
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if not is_user_file(code.co_filename):
        return False
    return any(
        instruction.offset == tb.tb_lasti and instruction.opcode in _RAISES
        for instruction in dis.get_instructions(code)
    )


def classify_capture_error(error: BaseException, device_type: str = "cuda") -> Optional[Finding]:
    """A finding when ``error`` comes from capturing ``device_type``'s work (the CPU
    emulation: "cpu"), or None for the user's own error.

    Told apart by type and origin, not by words: the guard's ``GuardError``; an error the
    user's own ``raise`` made is the user's (whatever its message says) unless it was raised
    while handling a capture error; anything else (torch's C++ and Python, CUDA) is a capture
    error when its message or type says so.
    """
    if isinstance(error, GuardError):
        return error.finding
    if raised_by_user(error):
        cause = error.__cause__ or error.__context__
        return (
            None if cause is None or cause is error else classify_capture_error(cause, device_type)
        )
    text = str(error)
    location, source = location_in_traceback(error.__traceback__)
    named = _named_cause(text, source, device_type)
    if named is not None:
        return Finding(*named, location, source)
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    consequence = next((words for needle, words in _CAPTURE_ERRORS if needle in text), None)
    if consequence is None:
        accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8
        if not (isinstance(error, accelerator_error) or "CUDA error" in text):
            return None
        consequence = "failed during CUDA graph capture"
    return Finding(f"a CUDA call ({first_line})", consequence, location, source)
