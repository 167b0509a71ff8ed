"""One capture sequence for every graph: static inputs, the guard, the read watch, the
backend's capture, and every refusal, for inference and training graphs alike.

>>> request = CaptureRequest(step, (x,), {}, [x], CUDA, 0, pool, "copy", "step(x: ...)", roots)
>>> recorded = record(request, InputPlan(request.tensors))
>>> recorded.capture.graph.replay()      # nothing of the call ran on the device until now

A training graph (``_training``) adds a watch of its forward's ops (``watches``) and its own
check of the function's error (``refuse_error``), and records its backward afterwards; all
else is here, so every refusal and every warm-up applies to both (docs/design.md, "One capture
sequence"). Nothing of the call runs: a caller that wants this call's effects replays once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from ..backends._backend import Capture
from ..watch._guard import Finding, UnsafeOpDetector, classify_capture_error
from ..watch._reads import CallWatch, Survey, storage_ptr
from ._outputs import flatten_output
from ._plan import InputPlan, OutputPlan, UnplannableOutput
from ._views import held_storages

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Refusal(Finding):
    """Why a key cannot be graphed, about the call as a whole rather than one line.

    >>> Refusal("", "its arguments are padded to a bucket, ...").message()
    'its arguments are padded to a bucket, ...'
    """

    def message(self) -> str:
        return self.consequence


def _refuse_if_padded(padding: Any, capture: Capture) -> None:
    """Raise ``CaptureFailed`` if the capture's run of the function raised on padded arguments
    where the call as given ran (its warmup): a guess of which arguments are batched (a weight
    whose dim 0 equals the rows by chance), not the caller's error. Nothing of the capture
    runs; the call runs eagerly, as called. A KeyboardInterrupt or SystemExit is no sign of
    a wrong guess: it comes out, as the function's own exception does."""
    if padding is None or not padding.runs_as_called or not isinstance(capture.error, Exception):
        return
    error, capture.graph = capture.error, None  # the graph dropped now, as ``record`` does
    raise refused(
        f"it raised when run on its arguments padded from {padding.rows} to {padding.bucket} "
        f"rows ({type(error).__name__}: {error}), and ran as called: an argument whose dim 0 "
        f"equals the rows by chance is padded too. Name the batched arguments with "
        f"bucket_args="
    )


class CaptureFailed(Exception):
    """The key cannot be graphed; ``finding`` says why and where."""

    def __init__(self, finding: Finding):
        super().__init__(finding.message())
        self.finding = finding


def refused(reason: str) -> CaptureFailed:
    return CaptureFailed(Refusal("", reason))


def capture_failure(detector: UnsafeOpDetector, capture: Capture) -> Optional[Finding]:
    """What stopped a capture: the guard's finding, a capture error of the backend's, or None
    (no failure, or the function's own exception, which the caller re-raises).

    >>> capture_failure(detector, backend.capture(run, 0, pool.handle))
    Finding(operation='.item()', consequence='synchronises with the host', ...)
    """
    finding = detector.finding
    for error in (capture.error, capture.hard_error):
        if finding is None and error is not None:
            finding = classify_capture_error(error, detector.device_type)
    if finding is None and capture.hard_error is not None:
        finding = Finding("the capture", f"failed: {capture.hard_error}")
    return finding


@dataclasses.dataclass
class CaptureRequest:
    """Everything one capture of a key needs, made by the key's life (``_key_life``)."""

    call: Callable
    args: tuple
    kwargs: dict
    tensors: Sequence[Tensor]
    backend: Any
    device: int
    pool: Any
    policy: str  # outputs="copy" or "static"
    label: str  # "step(x: f32[8] cuda:0)", for messages
    roots: Sequence[Tuple[str, Any]]  # where the tensors it reads may come from (_reads)
    uses_cudnn: bool = False
    padding: Any = None  # a bucket's Padding, or None
    addressed: Sequence[int] = ()  # arguments used by address (static_argnames)
    generators: Sequence[Any] = ()  # private random generators it draws from (its warmup's)

    @property
    def rows(self) -> Optional[int]:
        return None if self.padding is None else self.padding.rows


@dataclasses.dataclass
class Recorded:
    """A capture that succeeded, with what it learnt about the call."""

    capture: Capture
    inputs: InputPlan
    outputs: OutputPlan
    watch: CallWatch  # the storages it wrote, the tensors it read by address
    survey: Survey  # names of what it can reach, and .grad slots before the capture
    drawn: Sequence[Any] = ()  # the private random generators its capture drew from


def record(
    request: CaptureRequest,
    inputs: InputPlan,
    watches: Sequence[Any] = (),
    refuse_error: Callable[[BaseException], Optional[str]] = lambda error: None,
) -> Recorded:
    """Capture ``request.call`` on ``inputs``' statics under the guard, the read watch and
    ``watches``; nothing runs yet.

    Raises ``CaptureFailed`` when the guard or the backend rejects the capture, when the call
    resizes an argument, when ``refuse_error`` names a reason for the function's exception, or
    when its outputs cannot be planned (nothing of the call has run: the caller runs it
    eagerly); or the function's own exception after replaying the part captured before it, as
    eager execution would have run it.
    """
    static_args, static_kwargs, given = inputs.substitute(request.args, request.kwargs)
    before = inputs.versions()
    # Before the capture: the function may rebind what it reads, or set the .grad of leaves.
    survey = Survey(request.roots)
    detector = UnsafeOpDetector(request.backend.device_type, raise_on_unsafe=True)
    watch = CallWatch(inputs.statics)

    def run() -> Any:
        with detector, watch, contextlib.ExitStack() as stack:
            for extra in watches:
                stack.enter_context(extra)
            return request.call(*static_args, **static_kwargs)

    try:
        capture = request.backend.capture(
            run,
            request.device,
            request.pool.handle_for_capture(),
            request.uses_cudnn,
            _generators(request.generators, survey),
        )
        _refuse(capture, detector, refuse_error)
        inputs.note_writes(before, watch.written)
        resized = inputs.resized()
        if resized is not None:
            raise refused(
                f"it resizes its argument {resized} (an out= tensor of another size, or "
                f"resize_()), and a graph's inputs keep their size and address. Pass a tensor "
                f"of the output's size"
            )
        if capture.error is not None:  # the function's own: run what it did before, raise it
            _refuse_if_padded(request.padding, capture)
            error = capture.error
            with torch.no_grad(), request.pool.lock:
                request.pool.before_replay()
                capture.graph.replay()
                inputs.copy_back(request.tensors, request.rows)
            # The traceback keeps this frame alive: drop the graph now, not at a later garbage
            # collection that could land inside another capture.
            del capture
            raise error
        outside = survey.tensors()
        outputs = OutputPlan(
            capture.outputs,
            inputs.statics,
            request.policy,
            request.label,
            request.pool,
            given,
            request.padding,
            outside,
        )
        _watch_returned(capture.outputs, given, outside, watch)
    except UnplannableOutput as unplannable:
        survey.restore_grads()
        raise refused(str(unplannable)) from None
    except CaptureFailed:
        # A backward in the capture set .grad (in Python) to the memory of this discarded
        # graph; the eager run that follows must find .grad as it was.
        survey.restore_grads()
        raise
    return Recorded(capture, inputs, outputs, watch, survey, detector.generators)


def _generators(drawn: Sequence[torch.Generator], survey: Survey) -> list:
    """The generators a capture registers: those the warmup drew from, and those the call can
    reach (a generator rebound since the warmup, which a recapture meets first), once each.
    A generator registered and not drawn from costs a replay nothing."""
    found = {g._cdata: g for g in drawn}
    for reached in survey.generators.values():
        found.setdefault(reached.generator._cdata, reached.generator)
    return list(found.values())


def _watch_returned(result: Any, given: list, outside: dict, watch: CallWatch) -> None:
    """Watch a tensor that existed before the call and is returned as it is (a parameter) or
    viewed (a slice of a buffer) as a read by address, though no op read it: a replay hands
    out that very tensor, or a view of it."""
    held = held_storages(outside)
    for leaf in flatten_output(result, given)[0]:
        if not isinstance(leaf, Tensor):
            continue
        if outside.get(id(leaf)) is leaf:
            watch.external.setdefault(storage_ptr(leaf), leaf)
        elif leaf.layout is torch.strided and leaf.numel() and storage_ptr(leaf) in held:
            watch.external.setdefault(storage_ptr(leaf), held[storage_ptr(leaf)])


def _refuse(
    capture: Capture,
    detector: UnsafeOpDetector,
    refuse_error: Callable[[BaseException], Optional[str]],
) -> None:
    """``CaptureFailed`` if the guard or the backend stopped the capture, or ``refuse_error``
    names a reason for the function's exception."""
    finding = capture_failure(detector, capture)
    if finding is not None:
        raise CaptureFailed(finding)
    reason = None if capture.error is None else refuse_error(capture.error)
    if reason is not None:
        raise refused(reason)
