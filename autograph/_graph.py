"""One key's graph: static inputs, capture, replay, and what the caller gets back.

>>> graph, outputs = KeyGraph.capture(step, args, {}, tensors, CUDA, 0, pool, "copy", "step(...)")
>>> outputs = graph.replay(new_tensors)         # copy in, replay, copy out

Static inputs are ``empty_strided`` copies of the arguments, so strides match the key. On replay
all arguments are copied in with one ``torch._foreach_copy_``, skipping any argument that already
is its static tensor. Arguments the function wrote to (their ``_version`` moved during capture)
are copied back to the caller's tensors after each replay (SPEC 2.7); outputs that are, or view,
an argument are rebuilt on the caller's tensor. Other outputs are cloned by default; with
``outputs="static"`` the caller gets fresh aliases of the graph's buffers, and the previous
call's aliases are poisoned so a stale read raises instead of showing new data (SPEC 2.5).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from ._capture import Capture
from ._config import logger
from ._guard import Finding, UnsafeOpDetector, classify_capture_error
from ._keys import flatten_output

Tensor = torch.Tensor

# torch >= 2.6 CUDA builds can poison a storage, which reaches every view of it.
_CAN_POISON = hasattr(torch._C, "_set_storage_data_ptr_access_error_msg")


def _expanded_dims(t: Tensor) -> Tuple[int, ...]:
    return tuple(d for d in range(t.dim()) if t.stride(d) == 0 and t.size(d) > 1)


def _narrow_expanded(t: Tensor, dims: Tuple[int, ...]) -> Tensor:
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


def _copy_all(dst: List[Tensor], src: List[Tensor]) -> None:
    if len(dst) == 1:
        dst[0].copy_(src[0])
    elif dst:
        torch._foreach_copy_(dst, src)


def _storage_ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _poison(storages: List[Any], message: str) -> None:
    for storage in storages:
        torch._C._set_storage_data_ptr_access_error_msg(storage._cdata, message)
    storages.clear()


class _Outputs:
    """How to turn the graph's static outputs into this call's return value."""

    def __init__(self, result: Any, statics: Sequence[Tensor], policy: str, label: str):
        leaves, self.rebuild = flatten_output(result)
        input_storages = {_storage_ptr(s): i for i, s in enumerate(statics) if s.numel()}
        self.plan: List[Tuple] = []
        self.owned: List[Tensor] = []
        storages = set()
        self.shared = False
        for leaf in leaves:
            if not isinstance(leaf, Tensor):
                self.plan.append(("const", leaf))
                continue
            index = next((i for i, s in enumerate(statics) if leaf is s), None)
            if index is not None:
                self.plan.append(("arg", index))
            elif leaf.numel() and _storage_ptr(leaf) in input_storages:
                i = input_storages[_storage_ptr(leaf)]
                offset = leaf.storage_offset() - statics[i].storage_offset()
                self.plan.append(("view", i, leaf.size(), leaf.stride(), offset))
            else:
                self.plan.append(("own", len(self.owned)))
                self.shared |= leaf.numel() > 0 and _storage_ptr(leaf) in storages
                storages.add(_storage_ptr(leaf))
                self.owned.append(leaf)
        self.only_owned = all(p[0] == "own" for p in self.plan)
        self.static = (policy == "static" and _CAN_POISON and bool(self.owned)
                       and self.owned[0].is_cuda)
        if policy == "static" and self.owned and not self.static:
            logger.info("%s: outputs='static' needs a CUDA build of torch >= 2.6 to protect "
                        "stale outputs; returning copies instead", label)
        self.stale_message = (
            f"autograph: this output of {label} was overwritten by a later call: "
            f"outputs='static' reuses the graph's buffers. Clone it before calling again, "
            f"or use outputs='copy'."
        )
        self.handed_out: List[Any] = []
        if self.static:
            # Aliases do not own their memory: poison them before this plan (and the graph's
            # buffers) goes away, even without reset().
            weakref.finalize(self, _poison, self.handed_out, self.stale_message)

    def _on_new_storages(self, make: Callable[[Any, Tensor], Any]) -> List[Tensor]:
        """The owned outputs rebuilt on new storages, one per storage they share."""
        made: Dict[int, Any] = {}
        outputs = []
        for o in self.owned:
            storage = o.untyped_storage()
            target = made.get(storage.data_ptr())
            if target is None:
                target = made[storage.data_ptr()] = make(storage, o)
            outputs.append(torch.empty(0, dtype=o.dtype, device=o.device)
                           .set_(target, o.storage_offset(), o.size(), o.stride()))
        return outputs

    def _copies(self) -> List[Tensor]:
        if not self.shared:
            return [o.clone() for o in self.owned]
        return self._on_new_storages(lambda storage, o: torch.empty(
            0, dtype=torch.uint8, device=o.device).set_(storage).clone().untyped_storage())

    def _aliases(self) -> List[Tensor]:
        self.poison()
        return self._on_new_storages(self._alias_storage)

    def _alias_storage(self, storage: Any, output: Tensor) -> Any:
        alias = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), output.device, storage.nbytes())
        self.handed_out.append(alias)
        return alias

    def poison(self) -> None:
        _poison(self.handed_out, self.stale_message)

    def produce(self, tensors: Sequence[Tensor]) -> Any:
        owned = self._aliases() if self.static else self._copies()
        if self.only_owned:
            return self.rebuild(owned)
        values = []
        for entry in self.plan:
            kind = entry[0]
            if kind == "own":
                values.append(owned[entry[1]])
            elif kind == "arg":
                values.append(tensors[entry[1]])
            elif kind == "view":
                _, i, size, stride, offset = entry
                values.append(tensors[i].as_strided(size, stride,
                                                    tensors[i].storage_offset() + offset))
            else:
                values.append(entry[1])
        return self.rebuild(values)


class CaptureFailed(Exception):
    """The key cannot be graphed; ``finding`` says why and where."""

    def __init__(self, finding: Finding):
        super().__init__(finding.message())
        self.finding = finding


class KeyGraph:
    """The captured graph of one key, with its static inputs and output plan."""

    def __init__(self, capture: Capture, statics: List[Tensor], expanded: List[Tuple[int, ...]],
                 mutated: List[int], outputs: _Outputs, pool: Any = None):
        self.graph = capture.graph
        self.pool = pool
        self.capture_seconds = capture.seconds
        self.memory_bytes = capture.memory_bytes
        self.statics = statics
        self.expanded = expanded if any(expanded) else None
        self.mutated = mutated
        self.outputs = outputs

    @classmethod
    def capture(cls, call: Callable, args: tuple, kwargs: dict, tensors: Sequence[Tensor],
                backend: Any, device: int, pool: Any, policy: str, label: str,
                uses_cudnn: bool = False) -> Tuple["KeyGraph", Any]:
        """Capture ``call`` on static copies of the arguments, replay once, return the outputs.

        Raises ``CaptureFailed`` when the guard or CUDA rejects the capture (nothing of the
        call has run: the caller runs it eagerly), or the function's own exception after
        replaying the part captured before it, as eager execution would have run it.
        """
        expanded = [_expanded_dims(t) for t in tensors]
        statics = []
        # Normal tensors even under inference_mode: their version counters reveal the
        # arguments the function writes to (inference tensors have none).
        with torch.inference_mode(False):
            for t, dims in zip(tensors, expanded):
                static = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                             device=t.device)
                _narrow_expanded(static, dims).copy_(_narrow_expanded(t, dims))
                statics.append(static)
        leaves, rebuild = flatten_output((args, kwargs))
        substitutes = iter(statics)
        static_args, static_kwargs = rebuild(
            [next(substitutes) if isinstance(leaf, Tensor) else leaf for leaf in leaves])
        versions = [s._version for s in statics]
        detector = UnsafeOpDetector(backend.device_type, raise_on_unsafe=True)

        def run() -> Any:
            with detector:
                return call(*static_args, **static_kwargs)

        capture = backend.capture(run, device, pool, uses_cudnn)
        finding = detector.finding
        for error in (capture.error, capture.hard_error):
            if finding is None and error is not None:
                finding = classify_capture_error(error)
        if finding is None and capture.hard_error is not None:
            finding = Finding("the capture", f"failed: {capture.hard_error}")
        if finding is not None:
            raise CaptureFailed(finding)
        mutated = [i for i, s in enumerate(statics) if s._version != versions[i]]
        if capture.error is not None:
            error = capture.error
            capture.graph.replay()
            partial = cls(capture, statics, expanded, mutated,
                          _Outputs(None, statics, "copy", label))
            partial._copy_back(tensors)
            # The traceback keeps this frame alive: drop the graph now, not at a later
            # garbage collection that could land inside another capture.
            del partial, capture
            raise error
        graph = cls(capture, statics, expanded, mutated,
                    _Outputs(capture.outputs, statics, policy, label), pool)
        return graph, graph._replay_and_produce(tensors)

    def writes_into_shared_memory(self, tensors: Sequence[Tensor]) -> bool:
        """Whether an argument the graph writes to shares memory with another argument.

        Eager code would see such a write through the other argument; separate static
        copies would not, so such a call must run eagerly.
        """
        storages = [_storage_ptr(t) for t in tensors]
        return any(storages.count(storages[i]) > 1 for i in self.mutated if tensors[i].numel())

    def replay(self, tensors: Sequence[Tensor]) -> Any:
        statics = self.statics
        if self.expanded is None:
            dst, src = [], []
            for static, t in zip(statics, tensors):
                if t.data_ptr() != static.data_ptr():
                    dst.append(static)
                    src.append(t)
        else:
            dst = [_narrow_expanded(s, d) for s, d in zip(statics, self.expanded)]
            src = [_narrow_expanded(t, d) for t, d in zip(tensors, self.expanded)]
        _copy_all(dst, src)
        return self._replay_and_produce(tensors)

    def _replay_and_produce(self, tensors: Sequence[Tensor]) -> Any:
        self.graph.replay()
        if self.mutated:
            self._copy_back(tensors)
        return self.outputs.produce(tensors)

    def _copy_back(self, tensors: Sequence[Tensor]) -> None:
        pairs = [(tensors[i], self.statics[i]) for i in self.mutated
                 if tensors[i].data_ptr() != self.statics[i].data_ptr()]
        _copy_all([p[0] for p in pairs], [p[1] for p in pairs])

    def release(self) -> None:
        """Poison outputs still handed out; the graph and its memory go with this object."""
        self.outputs.poison()
