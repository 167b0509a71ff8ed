"""One key's graph: record it (no replay), replay it, and know when it may no longer replay.

>>> graph = Graph.record(step, args, {}, tensors, CUDA, 0, pool, "copy", "step(...)", roots)
>>> outputs = graph.replay(tensors, copy_in=False)   # the capture call's own result
>>> graph.watch_reads()                             # from now on, a freed read invalidates it
>>> outputs = graph.replay(new_tensors)             # copy in, replay, copy back, outputs

Recording runs the function once on static copies of the arguments under the guard (which
stops what a graph cannot replay) and a ``CallWatch`` (which notes what the graph reads by
address). Nothing runs on the GPU: a caller that wants this call's effects replays once.
"""
from __future__ import annotations

import dataclasses

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._capture import Capture
from ._guard import Finding, UnsafeOpDetector, classify_capture_error
from ._plan import InputPlan, OutputPlan, UnplannableOutput
from ._reads import CallWatch, GradSlots, ReadWatch, Survey

Tensor = torch.Tensor


def capture_failure(detector: UnsafeOpDetector, capture: Capture) -> Optional[Finding]:
    """What stopped a capture: the guard's finding, a capture error of CUDA's, or None (no
    failure, or the function's own exception, which the caller re-raises).

    >>> capture_failure(detector, backend.capture(run, 0, pool.handle))
    Finding(operation='.item()', consequence='synchronises with the host', ...)
    """
    finding = detector.finding
    for error in (capture.error, capture.hard_error):
        if finding is None and error is not None:
            finding = classify_capture_error(error)
    if finding is None and capture.hard_error is not None:
        finding = Finding("the capture", f"failed: {capture.hard_error}")
    return finding


@dataclasses.dataclass(frozen=True)
class Refusal(Finding):
    """Why a key cannot be graphed, about the call as a whole rather than one line.

    >>> Refusal("", "its arguments are padded to a bucket, ...").message()
    'its arguments are padded to a bucket, ...'
    """

    def message(self) -> str:
        return self.consequence


class CaptureFailed(Exception):
    """The key cannot be graphed; ``finding`` says why and where."""

    def __init__(self, finding: Finding):
        super().__init__(finding.message())
        self.finding = finding


class Graph:
    """The captured graph of one key, with its input and output plans and its pool."""

    def __init__(self, capture: Capture, inputs: InputPlan, outputs: OutputPlan, pool: Any,
                 external: Dict[int, Tensor], survey: Survey, grads: GradSlots):
        self.graph = capture.graph
        self.pool = pool
        self.capture_seconds = capture.seconds
        self.memory_bytes = capture.memory_bytes
        self.inputs = inputs
        self.outputs = outputs
        self.mutated = inputs.mutated
        # Set (by the read watch) to the name of a tensor read by address that was freed.
        self.invalid_reason: Optional[str] = None
        self._unwatched: Optional[Tuple[Dict[int, Tensor], Survey]] = (external, survey)
        self.grads = grads  # the .grad of leaves its backward writes, if it has one
        self.handle = pool.handle  # the pool handle it was captured into
        pool.graphs.add(self)
        self.watch: Optional[ReadWatch] = None

    @classmethod
    def record(cls, call: Callable, args: tuple, kwargs: dict, tensors: Sequence[Tensor],
               backend: Any, device: int, pool: Any, policy: str, label: str,
               roots: Sequence[Tuple[str, Any]], uses_cudnn: bool = False,
               padding: Any = None, addressed: Sequence[int] = (),
               warmup_shapes: Optional[List[Any]] = None) -> "Graph":
        """Capture ``call`` on static copies of the arguments; nothing of it runs yet.

        Raises ``CaptureFailed`` when the guard or CUDA rejects the capture (nothing of the
        call has run: the caller runs it eagerly), or the function's own exception after
        replaying the part captured before it, as eager execution would have run it.
        """
        inputs = InputPlan(tensors, padding, addressed)
        static_args, static_kwargs, given = inputs.substitute(args, kwargs)
        before = inputs.versions()
        # Surveyed before the capture: the function may rebind what it reads (a growing
        # cache) or set the .grad of what it trains.
        survey = Survey(roots)
        detector = UnsafeOpDetector(backend.device_type, raise_on_unsafe=True)
        watch = CallWatch(inputs.statics)

        def run() -> Any:
            with detector, watch:
                return call(*static_args, **static_kwargs)

        capture = backend.capture(run, device, pool.handle_for_capture(), uses_cudnn)
        finding = capture_failure(detector, capture)
        if finding is not None:
            survey.restore_grads()
            raise CaptureFailed(finding)
        inputs.note_writes(before, watch.written)
        resized = inputs.resized()
        if resized is not None:
            survey.restore_grads()
            raise CaptureFailed(Refusal("", (
                f"it resizes its argument {resized} (an out= tensor of another size, or "
                f"resize_()), and a graph's inputs keep their size and address. Pass a tensor "
                f"of the output's size")))
        if capture.error is not None:
            error = capture.error
            capture.graph.replay()
            inputs.copy_back(tensors, None if padding is None else padding.rows)
            # The traceback keeps this frame alive: drop the graph now, not at a later
            # garbage collection that could land inside another capture.
            del capture
            raise error
        try:
            outputs = OutputPlan(capture.outputs, inputs.statics, policy, label, pool, given,
                                 padding, warmup_shapes)
        except UnplannableOutput as refused:
            survey.restore_grads()
            raise CaptureFailed(Refusal("", str(refused))) from None
        return cls(capture, inputs, outputs, pool, watch.external, survey,
                   GradSlots(survey, watch.written))

    def replay(self, tensors: Sequence[Tensor], padding: Any = None,
               copy_in: bool = True) -> Any:
        """Copy ``tensors`` in (the real rows, for a bucket), replay, copy written arguments
        back, and return this call's outputs."""
        rows = None if padding is None else padding.rows
        self.pool.before_replay()
        if copy_in:
            self.inputs.copy_in(tensors, rows)
        self.graph.replay()
        if self.mutated:
            self.inputs.copy_back(tensors, rows)
        if self.grads:
            self.grads.bind()
        return self.outputs.produce(tensors, padding)

    def may_replay(self) -> bool:
        """Whether nothing the graph reads by address changed in a way it cannot follow."""
        if self.invalid_reason is None and self.grads:
            self.invalid_reason = self.grads.mismatch()
        return self.invalid_reason is None

    def watch_reads(self) -> None:
        """Hold the tensors read by address weakly from now on (call after the first replay:
        until then the recording keeps them alive, even those the function rebound)."""
        if self._unwatched is not None:
            external, survey = self._unwatched
            self._unwatched = None
            # Buffers that compiled code allocates outside the dispatcher (Inductor's) reach
            # the watch as if they were older than the capture: those in the graph's own pool
            # are its memory, not state read by address.
            own = self.pool.backend.allocated_in_pool(self.handle, self.pool.device,
                                                      list(external))
            self.watch = ReadWatch(self, {ptr: t for ptr, t in external.items()
                                          if ptr not in own}, survey)

    def release(self) -> None:
        """Poison outputs still handed out; the graph and its memory go with this object."""
        self.outputs.release()
