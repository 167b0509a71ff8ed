"""One key's graph: made from a recording, replayed, and known to be no longer replayable.

>>> graph = Graph.record(request)                    # nothing runs (``_recording``)
>>> outputs = graph.replay(tensors, copy_in=False)   # the capture call's own result
>>> graph.watch_reads()                             # from now on, a freed read invalidates it
>>> outputs = graph.replay(new_tensors)             # copy in, replay, copy back, outputs

A graph reads every tensor that is not one of its arguments at the address it had during
capture (docs/design.md, "State read by address"): ``watch_reads`` holds those weakly, and a
freed one marks the graph invalid, so that the check before a replay is one attribute read.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Set, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from ..watch._frozen import FrozenReads
from ..watch._module_hooks import HookWatch
from ..watch._reads import GradSlots, ReadWatch, Survey
from ..watch._slots import GeneratorSlots, SlotWatch, registrations
from ..watch._values_read import ValuesRead
from ._plan import InputPlan
from ._recording import CaptureRequest, Recorded, record

Tensor = torch.Tensor


class Graph:
    """The captured graph of one key, with its input and output plans and its pool."""

    def __init__(self, recorded: Recorded, pool: Any):
        capture = recorded.capture
        self.graph = capture.graph
        self.pool = pool
        self.capture_seconds = capture.seconds
        self.memory_bytes = capture.memory_bytes
        self.inputs: InputPlan = recorded.inputs
        self.outputs = recorded.outputs
        self.mutated = recorded.inputs.mutated
        # The storages it reads or writes by address: an argument sharing one runs eagerly.
        self.by_address = set(recorded.watch.external)
        self.written_storages = recorded.watch.written  # the storages its capture wrote
        # Whether a call's arguments must be checked for aliasing before a replay (either set).
        self.aliasing = bool(self.mutated or self.by_address)
        # Set (by the read watch) to the name of a tensor read by address that was freed.
        self.invalid_reason: Optional[str] = None
        self._unwatched: Optional[Tuple[Dict[int, Tensor], Survey, Sequence[Any]]] = (
            recorded.watch.external,
            recorded.survey,
            recorded.drawn,
        )
        # The .grad of leaves its backward writes, if it ran one (None if none: asked per call).
        grads = GradSlots(recorded.survey, recorded.watch.written)
        self.grads: Optional[GradSlots] = grads if grads else None
        self.handle = pool.handle  # the pool handle it was captured into
        pool.graphs.add(self)
        self.watch: Optional[ReadWatch] = None
        self.slots: Optional[SlotWatch] = None  # where its reads by address live (_slots)
        self.generators: Optional[GeneratorSlots] = None  # where its generators live
        # The hooks of the modules it reaches, and the frozen parameters it read with
        # gradients on: a replay checks both are as captured (``_module_hooks``, ``_frozen``).
        self.hooks = HookWatch.of(recorded.survey.modules)
        self.frozen = FrozenReads.of(recorded.watch.external, recorded.survey)
        # Set when a replay found a frozen parameter requiring grad, or hooks changed.
        self.unfrozen = self.rehooked = False
        # The Python values its capture read that a caller may change (``_values_read``).
        self.values: Optional[ValuesRead] = None
        # A bucket's row counts whose first replay with pad rows was probed, and checked
        # against an eager run where it has no per-bucket state (``_bucket_runs``).
        self.rows_checked: Set[int] = set()

    @classmethod
    def record(cls, request: CaptureRequest) -> "Graph":
        """Capture ``request.call`` on static copies of its arguments; nothing of it runs yet.
        ``CaptureFailed`` if it cannot be graphed (see ``_recording.record``)."""
        inputs = InputPlan(request.tensors, request.padding, request.addressed)
        return cls(record(request, inputs), request.pool)

    def replay(self, tensors: Sequence[Tensor], padding: Any = None, copy_in: bool = True) -> Any:
        """Copy ``tensors`` in (the real rows, for a bucket), replay, copy written arguments
        back, and return this call's outputs."""
        rows = None if padding is None else padding.rows
        pool = self.pool
        with pool.lock:  # from the stream order to the outputs' copy (``Pool.lock``)
            if pool.static_plans or pool.on_cuda:  # else it has nothing to do: no call
                pool.before_replay()
            if copy_in:
                self.inputs.copy_in(tensors, rows)
            self.graph.replay()
            if self.mutated:
                self.inputs.copy_back(tensors, rows)
            if self.grads is not None:
                self.grads.bind()
            return self.outputs.produce(tensors, padding)

    def may_replay(self) -> bool:
        """Whether nothing the graph reads by address changed in a way it cannot follow."""
        if self.invalid_reason is None and self.grads is not None:
            self.invalid_reason = self.grads.mismatch()
        slots = self.slots
        if self.invalid_reason is None and slots is not None and slots.seen != registrations.count:
            self.invalid_reason = slots.changed(always=False)
        if self.invalid_reason is None and self.generators is not None:
            self.invalid_reason = self.generators.changed()
        hooks = self.hooks
        if (
            self.invalid_reason is None
            and hooks is not None
            and (hooks.seen != RemovableHandle.next_id or hooks.held)
        ):
            self.invalid_reason = hooks.changed()
            self.rehooked = self.invalid_reason is not None
        if self.invalid_reason is None and self.frozen is not None:
            self.invalid_reason = self.frozen.unfrozen()
            self.unfrozen = self.invalid_reason is not None
        return self.invalid_reason is None

    def changed_again(self, captures: int) -> str:
        """Why its key runs eagerly: what it reads changed once more after ``captures``
        captures."""
        if self.unfrozen or self.rehooked:
            return (
                f"{self.invalid_reason}, again after {captures} captures; keep its "
                f"modules' hooks and their parameters' requires_grad as they are between "
                f"calls, or run it eagerly"
            )
        return (
            f"{self.invalid_reason}, which its graph reads by address, was freed or "
            f"replaced again after {captures} captures; update it in place instead of "
            f"replacing it"
        )

    def watched_external(self) -> Dict[int, Tensor]:
        """The tensors its capture read by address, by storage, until ``watch_reads``."""
        return {} if self._unwatched is None else dict(self._unwatched[0])

    def watch_reads(self) -> None:
        """Hold the tensors read by address, and the private generators drawn from, weakly
        from now on (call after the first replay: until then the recording keeps them alive,
        even those the function rebound)."""
        if self._unwatched is not None:
            external, survey, drawn = self._unwatched
            self._unwatched = None
            # Buffers that compiled code allocates outside the dispatcher (Inductor's) reach
            # the watch as if they were older than the capture: those in the graph's own pool
            # are its memory, not state read by address.
            own = self.pool.backend.allocated_in_pool(self.handle, self.pool.device, list(external))
            external = {ptr: t for ptr, t in external.items() if ptr not in own}
            self.watch = ReadWatch(self, external, survey, drawn)
            self.slots = SlotWatch(survey, external)
            self.generators = GeneratorSlots.of(survey, drawn)
            self.inputs.forget_addressed()

    def release(self) -> None:
        """Poison outputs still handed out; the graph and its memory go with this object."""
        self.outputs.release()
