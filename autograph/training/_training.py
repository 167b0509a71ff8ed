"""Graphed forward and backward for calls whose outputs need gradients (docs/design.md, "Training
graphs").

>>> graph = TrainingGraph.record(request)        # a _recording.CaptureRequest
>>> out = graph.replay([x], copy_in=False)       # an autograd.Function's output
>>> out.sum().backward()                         # replays the backward graph

Per key, two graphs in the key's pool, tied by the ``autograd.Function`` ``_Replay``:
- the forward, captured on static inputs (those of arguments that require grad are leaves
  that require grad) with autograd recording, by the one capture sequence
  (``_recording.record``) that every graph goes through;
- the backward: ``torch.autograd.grad`` of the forward's outputs that need grad, with
  respect to those static inputs and to the leaves the forward read that require grad (a
  module's parameters, closed-over weights), from static output gradients, captured under
  the guard like the forward (``make_graphed_callables`` captures its backward the same way).
A call replays the forward and returns clones of its outputs; their backward copies the
incoming gradients in (``None`` becomes zeros), replays the backward and hands the gradients
to autograd, which accumulates them into ``.grad`` as eager execution would: views of fresh
copies (``_packed_grads``), never a buffer autograd or a hook could keep (pytorch issue
181723, fixed likewise in TransformerEngine).

The graph keeps the forward's activations (its saved tensors) in the pool for the graph's
life, so other graphs of the pool never reuse them; one graph holds one call's activations,
so a call made while the previous call's backward may still run (two forwards, then one
backward; ``retain_graph=True``) runs eagerly instead (``busy``). A key whose forward ran a
backward itself (a whole training step that returns its loss undetached), or whose outputs
need no gradient, gets no backward graph: it replays as a ``Graph`` does, outputs detached.

A key runs eagerly, said once, when its backward cannot be graphed faithfully: the guard
stops the backward's capture (``.item()`` in a custom backward), its forward uses saved-tensor
hooks (``torch.utils.checkpoint``; recomputation is Python) or runs inside them, it reads a
tensor computed with gradients outside the call, it writes in place to an argument that
requires grad, or it is bucketed. Double backward through a replay raises with the fix.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._config import logger
from ..backends._backend import Capture
from ..backends._streams import on_stream
from ..capture._graph import Graph
from ..capture._plan import InputPlan, copy_all
from ..capture._recording import CaptureFailed, CaptureRequest, Recorded, capture_failure, record
from ..capture._recording import refused as _refused
from ..watch._guard import Finding, UnsafeOpDetector, location_in_traceback, location_of_caller
from ..watch._modes import tensors_in
from ..watch._reads import Survey
from ._hooks import ModuleBackwardHooks, lifted_tensor_hooks
from ._packed_grads import PackedGradients

Tensor = torch.Tensor


_WRITES_TRAINED = (
    "it writes in place to an argument that requires grad, which a graphed "
    "backward cannot follow. Write to a copy (x = x.clone()) or run it eagerly"
)


_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _user_saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks (checkpoint, offloading) apply to what runs now.

    >>> with torch.autograd.graph.save_on_cpu():
    ...     _user_saved_tensor_hooks()
    True
    """
    return _top_hooks(True) is not None  # True: also while compiled autograd traces


class _ForwardWatch(TorchDispatchMode):
    """What a forward's ops read that its backward depends on: the leaves that require grad
    (gradients go to them), the parameters that do not (turning one on later changes what
    the backward must compute), and whether saved-tensor hooks were active inside it.

    Deliberately not a ``CompiledCodeRunsUnder``: under it, torch.compile would run fused
    kernels this mode cannot see, and a parameter read only inside one would get no gradient;
    with this mode active Dynamo runs the forward's frames eagerly, so every op is seen."""

    def __init__(self, statics: Sequence[Tensor]):
        super().__init__()
        self.skip = {id(s) for s in statics}
        self.trained: Dict[int, Tensor] = {}
        self.frozen: Dict[int, Tensor] = {}
        self.hooked = False
        self.module_hooks = ModuleBackwardHooks()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        for t in tensors_in((*args, *kwargs.values())):
            if id(t) in self.skip or not t.is_leaf:
                continue
            if t.requires_grad:
                self.trained[id(t)] = t
            elif isinstance(t, torch.nn.Parameter):
                self.frozen[id(t)] = t
        if not self.hooked:
            self.hooked = _user_saved_tensor_hooks()
        return func(*args, **kwargs)


class _Backward:
    """A key's backward graph and the static tensors around it.

    >>> grads = backward.replay(incoming, needed)    # copy in, replay, fresh gradients
    """

    def __init__(
        self,
        capture: Capture,
        outputs: List[Tensor],
        needs: List[bool],
        grad_outputs: List[Tensor],
        trained: List[int],
        leaves: List[Tensor],
        frozen: List[Tensor],
        survey: Survey,
    ):
        self.graph = capture.graph
        self.seconds, self.memory_bytes = capture.seconds, capture.memory_bytes
        # The forward's outputs keep its autograd graph, and so its activations, alive: the
        # pool must not hand their memory to another graph.
        self.outputs = outputs
        self.needs = needs  # per output of the Function: whether it needs grad
        self.grad_outputs = grad_outputs  # static gradients of the outputs that need grad
        self.results: PackedGradients = capture.outputs
        self.trained = trained  # the arguments that require grad
        self.leaves = [(weakref.ref(t), survey.name(t)) for t in leaves]
        self.frozen = [(weakref.ref(t), survey.name(t)) for t in frozen]

    def changed(self) -> Optional[str]:
        """Which leaf no longer fits the backward graph: freed, or a parameter unfrozen whose
        gradient the graph does not compute. (A leaf frozen since capture still gets its
        gradient computed, and autograd drops it, as its Function input needs none.)"""
        for ref, name in self.leaves:
            if ref() is None:
                return f"{name} (freed)"
        for ref, name in self.frozen:
            leaf = ref()
            if leaf is not None and leaf.requires_grad:
                return f"{name}.requires_grad (turned on since capture)"
        return None

    def replay(
        self, grads: Sequence[Optional[Tensor]], needed: Sequence[bool]
    ) -> List[Optional[Tensor]]:
        dst, src = [], []
        for static, grad in zip(
            self.grad_outputs, (g for g, need in zip(grads, self.needs) if need)
        ):
            if grad is None:
                static.zero_()
            elif grad.data_ptr() != static.data_ptr():
                dst.append(static)
                src.append(grad)
        copy_all(dst, src)
        self.graph.replay()
        return self.results.hand_out(needed)


class _Replay(torch.autograd.Function):
    """One call of a training graph: the forward graph's replay, and the backward graph's."""

    @staticmethod
    def forward(
        ctx: Any,
        graph: "TrainingGraph",
        tensors: Sequence[Tensor],
        copy_in: bool,
        caller: Any,
        *differentiable: Tensor,
    ) -> Tuple[Tensor, ...]:
        ctx.graph = graph
        ctx.set_materialize_grads(False)
        # Held only by this call's autograd graph, until its backward ran (without
        # retain_graph) or the graph was dropped: while it lives, the activations in the
        # graph's memory are still this call's to use.
        token = torch.empty(0)
        ctx.save_for_backward(token)
        graph.last_call = weakref.ref(token)
        if caller is None:
            outputs = graph.replay_forward(tensors, copy_in)
        else:  # the replay runs in the caller's stream order; only the node is on the other
            with on_stream(caller):
                outputs = graph.replay_forward(tensors, copy_in)
        ctx.mark_non_differentiable(
            *(o for o, need in zip(outputs, graph.backward.needs) if not need)
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        graph = ctx.graph
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"autograph: {graph.label} was graphed, and a graphed backward cannot be "
                f"differentiated again (create_graph=True, double backward, gradient "
                f"penalties). Run this call eagerly: call it inside "
                f"autograph.region(enabled=False)."
            )
        with graph.pool.lock:  # from the stream order to the gradients' copy (``Pool.lock``)
            graph.pool.before_replay()
            handed = graph.backward.replay(grads, ctx.needs_input_grad[4:])
        return (None, None, None, None, *handed)


def _refuse_before_capture(request: CaptureRequest) -> None:
    if request.padding is not None:
        raise _refused(
            "its outputs need gradients, and a bucketed call does not get a graphed "
            "backward: the padding rows would flow into reductions and parameter "
            "gradients. Leave out buckets= for training, or call it under "
            "torch.no_grad() for inference"
        )
    if _user_saved_tensor_hooks():
        raise _refused(
            "saved-tensor hooks are active around the call (torch.utils.checkpoint or "
            "torch.autograd.graph.save_on_cpu wrapping it), and a graph keeps its "
            "activations in its own memory. Checkpoint inside the module instead, or "
            "call it outside those hooks"
        )


def _trained_statics(tensors: Sequence[Tensor], inputs: InputPlan) -> List[int]:
    """The arguments that require grad; their statics become leaves that require grad."""
    trained = [i for i, t in enumerate(tensors) if t.requires_grad]
    for i in trained:
        if i in inputs.addressed:
            if not tensors[i].is_leaf:
                raise _refused(
                    f"argument {i} is passed by address (static_argnames) and was "
                    f"computed with gradients, which could then not flow back through "
                    f"it. Leave it out of static_argnames, so that it is copied in"
                )
        else:
            inputs.statics[i].requires_grad_()
    return trained


def _refuse_backward(reads: "_ForwardWatch", recorded: Recorded) -> None:
    reason = reads.module_hooks.reason()
    if reason is not None:
        raise _refused(reason)
    if reads.hooked:
        raise _refused(
            "it uses saved-tensor hooks inside (torch.utils.checkpoint with "
            "use_reentrant=False, activation offloading), whose backward runs Python "
            "(recomputation, copies back) that a graph would capture once and replay "
            "unfaithfully. Turn gradient checkpointing off for this module, or run it "
            "eagerly under autograph.region(enabled=False)"
        )
    for t in recorded.watch.external.values():
        if t.requires_grad and not t.is_leaf:
            raise _refused(
                f"it reads {recorded.survey.name(t)}, which was computed with gradients "
                f"outside the call, so gradients could not flow back through it. Pass it as "
                f"an argument"
            )


class TrainingGraph(Graph):
    """A key's forward graph and backward graph, tied by an ``autograd.Function``."""

    def __init__(self, recorded: Recorded, pool: Any, label: str):
        super().__init__(recorded, pool)
        self.label = label
        self.backward: Optional[_Backward] = None  # set once the backward is recorded
        self.last_call: Optional[Callable[[], Any]] = None
        self._said_busy = False

    @classmethod
    def record(cls, request: CaptureRequest) -> "TrainingGraph":
        """Capture the forward of ``request.call`` on static copies of the arguments, then its
        backward; nothing runs. ``CaptureFailed`` (the caller runs the key eagerly) when the
        guard or the backend rejects either capture, or the call cannot have a graphed
        backward."""
        _refuse_before_capture(request)
        with torch.no_grad():  # statics are leaves, not copies with the caller's history
            inputs = InputPlan(request.tensors, None, request.addressed)
        trained = _trained_statics(request.tensors, inputs)
        reads = _ForwardWatch([inputs.statics[i] for i in trained])
        watches = [reads, reads.module_hooks]
        recorded = record(
            request,
            inputs,
            watches=watches,
            refuse_error=lambda error: (
                _WRITES_TRAINED if "leaf Variable that requires grad" in str(error) else None
            ),
        )
        try:
            return cls._with_backward(request, recorded, trained, reads)
        except BaseException:  # CaptureFailed, or a Ctrl-C in the backward's capture
            # A backward in the capture set .grad (in Python) to the memory of this discarded
            # graph; the eager run that follows (or the caller's next call) must find .grad
            # as it was.
            recorded.survey.restore_grads()
            raise

    @classmethod
    def _with_backward(
        cls, request: CaptureRequest, recorded: Recorded, trained: List[int], reads: "_ForwardWatch"
    ) -> "TrainingGraph":
        inputs, outputs = recorded.inputs, recorded.outputs
        if any(i in trained for i in inputs.mutated):
            raise _refused(_WRITES_TRAINED)
        needs = [o.requires_grad for o in outputs.owned]
        graph = cls(recorded, request.pool, request.label)
        if graph.grads or not any(needs):
            # No backward to graph: the call ran its own (a whole step), or gradients reach
            # its arguments only through outputs that are views of them. It replays as a
            # Graph, copying into plain statics and handing out detached outputs.
            for i in trained:
                if i not in inputs.addressed:
                    inputs.statics[i].requires_grad_(False)
            outputs.owned[:] = [o.detach() for o in outputs.owned]
            return graph
        _refuse_backward(reads, recorded)
        if request.policy == "static":
            logger.info(
                "%s: its outputs need gradients, so it returns copies "
                "(outputs='static' applies to calls without gradients)",
                request.label,
            )
        leaves = list(reads.trained.values())
        grad_outputs, backward_capture = cls._record_backward(
            request, outputs.owned, needs, [inputs.statics[i] for i in trained], leaves
        )
        graph.backward = _Backward(
            backward_capture,
            outputs.owned,
            needs,
            grad_outputs,
            trained,
            leaves,
            list(reads.frozen.values()),
            recorded.survey,
        )
        graph.frozen = None  # its backward checks the frozen parameters its forward's ops read
        graph.capture_seconds += graph.backward.seconds
        graph.memory_bytes += graph.backward.memory_bytes
        return graph

    @staticmethod
    def _record_backward(
        request: CaptureRequest,
        outputs: List[Tensor],
        needs: List[bool],
        statics: List[Tensor],
        leaves: List[Tensor],
    ) -> Tuple[List[Tensor], Capture]:
        """Capture the gradients of ``outputs`` with respect to ``statics`` and ``leaves``
        from static output gradients; return those and the capture."""
        backend = request.backend
        differentiable = [o for o, need in zip(outputs, needs) if need]
        grad_outputs = [torch.empty_like(o) for o in differentiable]
        detector = UnsafeOpDetector(backend.device_type, raise_on_unsafe=True)

        # Autocast off: eager backward runs where loss.backward() is called, outside autocast
        # (the forward's casts are recorded in its autograd graph either way).
        # Without the leaves' own hooks: those run on the replay's gradients (``_hooks``).
        def run_backward() -> Any:
            with torch.autocast(backend.device_type, enabled=False), lifted_tensor_hooks(leaves):
                return PackedGradients(
                    torch.autograd.grad(
                        differentiable,
                        statics + leaves,
                        grad_outputs,
                        retain_graph=True,
                        allow_unused=True,
                    ),
                    alone=len(statics),
                )

        backend.prepare_backward(request.device, request.uses_cudnn)
        # The guard around the capture, not inside it: backward kernels such as silu_backward
        # reach dispatch modes whole, and the guard runs such an op's own kernel below the
        # modes under it, so the CPU emulation's recorder must see each op before the guard.
        with detector:
            capture = backend.capture(
                run_backward,
                request.device,
                request.pool.handle,
                request.uses_cudnn,
                request.generators,
            )
        finding = capture_failure(detector, capture)
        if not isinstance(capture.error, (Exception, type(None))):
            raise capture.error  # a KeyboardInterrupt or SystemExit: no capture failure
        if finding is None and capture.error is not None:
            location, source = location_in_traceback(capture.error.__traceback__)
            first = (str(capture.error).strip().splitlines() or [""])[0]
            finding = Finding(
                "its backward",
                f"could not be captured ({type(capture.error).__name__}: {first})",
                location,
                source,
            )
        if finding is not None:
            if finding.source == "":  # raised inside torch: name the user's call instead
                location, source = location_of_caller(sys._getframe())
                finding = dataclasses.replace(finding, location=location, source=source)
            raise CaptureFailed(finding)
        return grad_outputs, capture

    def replay(self, tensors: Sequence[Tensor], padding: Any = None, copy_in: bool = True) -> Any:
        """This call's outputs: from the autograd Function, whose backward replays the
        backward graph (or, without a backward graph, as ``Graph.replay``)."""
        if self.backward is None:
            return super().replay(tensors, padding, copy_in)
        backward = self.backward
        differentiable = [tensors[i] for i in backward.trained]
        differentiable += [ref() for ref, _ in backward.leaves]
        # The Function's backward node belongs to the stream current while it is made: the
        # stream the parameters' AccumulateGrad nodes were made on (``eager_stream``), so
        # that the backward replays there and hands each gradient over without a wait.
        stream = self.pool.backend.autograd_stream(self.pool.device)
        if stream is None:
            owned = _Replay.apply(self, tensors, copy_in, None, *differentiable)
        else:
            with on_stream(stream) as caller:
                owned = _Replay.apply(self, tensors, copy_in, caller, *differentiable)
        return self.outputs.assemble(owned, tensors)

    def replay_forward(self, tensors: Sequence[Tensor], copy_in: bool) -> List[Tensor]:
        """Copy in, replay the forward graph, copy written arguments back; fresh outputs."""
        with self.pool.lock:  # from the stream order to the outputs' copy (``Pool.lock``)
            self.pool.before_replay()
            if copy_in:
                self.inputs.copy_in(tensors)
            self.graph.replay()
            if self.mutated:
                self.inputs.copy_back(tensors)
            return [o.clone() for o in self.outputs.owned]

    def may_replay(self) -> bool:
        if self.invalid_reason is None and self.backward is not None:
            # Its autograd graph holds the leaves it read: a replaced one is never freed.
            self.invalid_reason = (
                self.backward.changed()
                or (self.slots is not None and self.slots.changed(always=True))
                or None
            )
        return super().may_replay()

    def busy(self) -> bool:
        """Whether this call must run eagerly: the activations in the graph's memory still
        belong to an earlier call whose backward may run, or saved-tensor hooks wrap it."""
        if self.backward is None:
            return False
        last = self.last_call
        busy = (last is not None and last() is not None) or _user_saved_tensor_hooks()
        if busy and not self._said_busy:
            self._said_busy = True
            logger.info(
                "%s: called again while an earlier call's backward may still run (or inside "
                "saved-tensor hooks), so this call runs eagerly: its graph holds one call's "
                "activations. Call backward after each forward to keep calls graphed",
                self.label,
            )
        return busy
