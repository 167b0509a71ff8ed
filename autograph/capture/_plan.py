"""How arguments get into a graph and how its outputs come back to the caller.

>>> inputs = InputPlan(tensors)                 # static copies, strides as the key says
>>> inputs.copy_in(new_tensors); graph.replay(); inputs.copy_back(new_tensors)
>>> outputs = OutputPlan(result, inputs.statics, "copy", "step(x: f32[8] cuda:0)", pool)
>>> outputs.produce(new_tensors)                # the caller's return value

Inputs: ``empty_strided`` copies of the arguments. All arguments are copied in with one
``torch._foreach_copy_`` (but each of 65536 elements or more with a ``copy_`` of its own: see
``FOREACH_CHUNK``), skipping any that already is its static tensor; stride-0
(expanded) arguments are copied through narrowed views. Arguments the function wrote to are
copied back to the caller's tensors after each replay (docs/design.md, "Inputs").

Outputs: those that are, or view, an argument are rebuilt on the caller's tensor; others are
cloned (``outputs="copy"``), or handed out as fresh aliases of the graph's buffers
(``outputs="static"``). An alias does not own its memory: the pool poisons it before the next
replay of any of its graphs, and the plan poisons it when the graph is released, so reading it
then raises instead of showing another call's data or freed memory (docs/design.md, "Outputs").
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._config import logger
from ..watch._reads import storage_ptr
from ._outputs import flatten_arguments, flatten_output, real_rows
from ._views import UnplannableOutput, View, held_storages

Tensor = torch.Tensor

# torch >= 2.6 CUDA builds can poison a storage, which reaches every view of it.
_CAN_POISON = hasattr(torch._C, "_set_storage_data_ptr_access_error_msg")


def _expanded_dims(t: Tensor) -> Tuple[int, ...]:
    return tuple(d for d in range(t.dim()) if t.stride(d) == 0 and t.size(d) > 1)


def _narrow_expanded(t: Tensor, dims: Tuple[int, ...]) -> Tensor:
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


# torch's _foreach_copy_ gives each block of its one kernel a chunk of 65536 elements
# (MultiTensorApply.cuh's kChunkSize), so a tensor of a few chunks is copied by as few blocks:
# a batch of 64 x 4096 by 4 of the H200's 132 SMs. A tensor that large gets a copy_ of its own,
# which spreads over the whole GPU; the small ones still share one launch.
FOREACH_CHUNK = 65536


def copy_all(dst: List[Tensor], src: List[Tensor]) -> None:
    if len(dst) == 1:
        dst[0].copy_(src[0])
        return
    small = [i for i, d in enumerate(dst) if d.numel() < FOREACH_CHUNK]
    if len(small) == len(dst):
        if dst:
            torch._foreach_copy_(dst, src)
        return
    if small:
        torch._foreach_copy_([dst[i] for i in small], [src[i] for i in small])
    for d, t in zip(dst, src):
        if d.numel() >= FOREACH_CHUNK:
            d.copy_(t)


class InputPlan:
    """The static tensors that stand in for a key's tensor arguments.

    ``padding`` (buckets) makes the padded arguments' statics the bucket's size; each call
    copies its rows in and the pad value into the rest. ``addressed`` arguments
    (``static_argnames``) are their own statics: used by address, never copied.
    """

    def __init__(
        self, tensors: Sequence[Tensor], padding: Any = None, addressed: Sequence[int] = ()
    ):
        self.padding = padding
        self.addressed = set(addressed)
        expanded = [
            () if padding is not None and padding.dims[i] is not None else _expanded_dims(t)
            for i, t in enumerate(tensors)
        ]
        self.expanded = expanded if any(expanded) else None
        # Normal tensors even under inference_mode: their version counters reveal the
        # arguments the function writes to (inference tensors have none).
        with torch.inference_mode(False):
            self.statics = [
                t if i in self.addressed else self._static_for(t, i) for i, t in enumerate(tensors)
            ]
            self.templates = (
                {}
                if padding is None
                else {
                    i: torch.full_like(self.statics[i], spec[1])
                    for i, spec in enumerate(padding.dims)
                    if spec is not None
                }
            )
        self._recipes: Dict[int, Tuple[List[Tensor], List[Any], List[Tuple[int, int, Any]]]] = {}
        self._shapes = [s.shape for s in self.statics]
        # The arguments copied in on every replay (those used by address are their statics).
        self._copied = [i for i in range(len(self.statics)) if i not in self.addressed]
        self._copied_statics = [self.statics[i] for i in self._copied]
        # Every argument copied whole into its static, none of them large: one C call per
        # replay (``copy_in``); large ones go through ``copy_all``.
        self._copies_all = (
            self.expanded is None
            and not self.addressed
            and bool(self.statics)
            and all(s.numel() < FOREACH_CHUNK for s in self.statics)
        )
        self.mutated: List[int] = []
        if padding is not None:
            self.copy_in(tensors, padding.rows)
        elif self.expanded is None:
            copy_all(self.statics, list(tensors))
        else:
            copy_all(
                [_narrow_expanded(s, d) for s, d in zip(self.statics, expanded)],
                [_narrow_expanded(t, d) for t, d in zip(tensors, expanded)],
            )

    def _static_for(self, t: Tensor, index: int) -> Tensor:
        if self.padding is not None and self.padding.dims[index] is not None:
            return torch.empty(self.padding.padded_shape(t, index), dtype=t.dtype, device=t.device)
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)

    def substitute(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict, list]:
        """The call's arguments with every tensor replaced by its static tensor, and the
        other objects it was given (caches, configs: passed on as themselves)."""
        leaves, rebuild = flatten_arguments((args, kwargs))
        statics = iter(self.statics)
        static_args, static_kwargs = rebuild(
            [next(statics) if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        )
        return static_args, static_kwargs, [leaf for leaf in leaves if not isinstance(leaf, Tensor)]

    def resized(self) -> Optional[int]:
        """The index of an argument whose static the capture resized, or None."""
        return next(
            (
                i
                for i, (s, shape) in enumerate(zip(self.statics, self._shapes))
                if i not in self.addressed and s.shape != shape
            ),
            None,
        )

    def versions(self) -> List[int]:
        return [-1 if i in self.addressed else s._version for i, s in enumerate(self.statics)]

    def note_writes(self, before: List[int], written: Any = frozenset()) -> None:
        """Note the arguments the capture wrote: by their version counters, and by the storages
        that ops' schemas say they write (``written``): ``_foreach_add_`` and its kin move no
        version counter under a dispatch mode."""
        self.mutated = [
            i
            for i, s in enumerate(self.statics)
            if i not in self.addressed
            and (
                s._version != before[i] or (s.numel() and s.untyped_storage().data_ptr() in written)
            )
        ]

    def forget_addressed(self) -> None:
        """Let go of the arguments used by address, once captured: the graph reads them by
        address, and their key is forgotten when they die (a dropped KV cache)."""
        for i in self.addressed:
            self.statics[i] = None

    def copy_in(self, tensors: Sequence[Tensor], rows: Optional[int] = None) -> None:
        if rows is None and self._copies_all:  # the steady state: no Python call but this one
            torch._foreach_copy_(self.statics, tensors)
            return
        if rows is not None:
            self._copy_rows_in(tensors, rows)
            return
        if self.expanded is None:
            if self.addressed:
                copy_all(self._copied_statics, [tensors[i] for i in self._copied])
            else:
                copy_all(self.statics, tensors)
        else:
            copy_all(
                [_narrow_expanded(self.statics[i], self.expanded[i]) for i in self._copied],
                [_narrow_expanded(tensors[i], self.expanded[i]) for i in self._copied],
            )

    def _copy_rows_in(self, tensors: Sequence[Tensor], rows: int) -> None:
        recipe = self._recipes.get(rows)
        if recipe is None:
            recipe = self._recipes[rows] = self._recipe(rows)
        dst, fixed, sources = recipe
        src = list(fixed)
        for position, index, dims in sources:
            src[position] = _narrow_expanded(tensors[index], dims) if dims else tensors[index]
        copy_all(dst, src)

    def _recipe(self, rows: int) -> Tuple[List[Tensor], List[Any], List[Tuple[int, int, Any]]]:
        """For calls of ``rows`` rows: the destinations, the fixed sources (pad rows) and
        where each argument goes (narrowed where it is expanded), so that a call builds one
        ``_foreach_copy_``."""
        dst: List[Tensor] = []
        fixed: List[Any] = []
        sources: List[Tuple[int, int, Any]] = []
        for i, static in enumerate(self.statics):
            if i in self.addressed:
                continue
            spec = self.padding.dims[i]
            if spec is None:
                dims = self.expanded[i] if self.expanded else ()
                sources.append((len(dst), i, dims))
                dst.append(_narrow_expanded(static, dims))
                fixed.append(None)
                continue
            dim = spec[0]
            sources.append((len(dst), i, ()))
            dst.append(static.narrow(dim, 0, rows))
            fixed.append(None)
            if rows < static.shape[dim]:
                dst.append(static.narrow(dim, rows, static.shape[dim] - rows))
                fixed.append(self.templates[i].narrow(dim, rows, static.shape[dim] - rows))
        return dst, fixed, sources

    def copy_back(self, tensors: Sequence[Tensor], rows: Optional[int] = None) -> None:
        pairs = []
        for i in self.mutated:
            static = self.statics[i]
            if rows is not None and self.padding.dims[i] is not None:
                static = static.narrow(self.padding.dims[i][0], 0, rows)
            if tensors[i].data_ptr() != static.data_ptr():
                pairs.append((tensors[i], static))
        copy_all([p[0] for p in pairs], [p[1] for p in pairs])


def _poison(storages: List[Any], message: str) -> None:
    for storage in storages:
        torch._C._set_storage_data_ptr_access_error_msg(storage._cdata, message)
    storages.clear()


class _Owned(NamedTuple):
    """An output the graph made: the call gets its copy (or alias), the ``index``-th owned."""

    index: int

    def value(self, owned: Sequence[Tensor], tensors: Sequence[Tensor]) -> Any:
        return owned[self.index]


class _Argument(NamedTuple):
    """An output that is the ``index``-th argument itself: the caller's tensor."""

    index: int

    def value(self, owned: Sequence[Tensor], tensors: Sequence[Tensor]) -> Any:
        return tensors[self.index]


class _ArgumentView(NamedTuple):
    """An output that views an argument: the same view of the caller's tensor."""

    index: int
    view: View

    def value(self, owned: Sequence[Tensor], tensors: Sequence[Tensor]) -> Any:
        return self.view.on(tensors[self.index])


class _HeldView(NamedTuple):
    """An output that views a tensor held outside the call (a module's buffer): the same
    view of that tensor, so that writes through it land there as in eager execution. Held
    weakly: the read watch invalidates the graph when it dies or is replaced."""

    ref: Any
    view: View

    def value(self, owned: Sequence[Tensor], tensors: Sequence[Tensor]) -> Any:
        return self.view.on(self.ref())


class _Constant(NamedTuple):
    """A non-tensor leaf, returned as it was at capture."""

    leaf: Any

    def value(self, owned: Sequence[Tensor], tensors: Sequence[Tensor]) -> Any:
        return self.leaf


class _Given(NamedTuple):
    """A leaf returned as itself, held weakly: an object the call was given (a cache: its
    key is an identity key, forgotten when it dies), or a tensor read by address (a
    parameter: the read watch invalidates the graph when it dies or is replaced)."""

    ref: Any

    def value(self, owned: Sequence[Tensor], tensors: Sequence[Tensor]) -> Any:
        return self.ref()


def _constant(leaf: Any, given: Sequence[Any]) -> Any:
    if any(leaf is g for g in given):
        try:
            return _Given(weakref.ref(leaf))
        except TypeError:  # no weak references: its key holds it anyway
            pass
    return _Constant(leaf)


class OutputPlan:
    """How to turn the graph's outputs into this call's return value. ``outside``: tensors by
    id that existed before the call (parameters, state read by address); one returned as it
    is comes back as that very tensor, held weakly."""

    def __init__(
        self,
        result: Any,
        statics: Sequence[Tensor],
        policy: str,
        label: str,
        pool: Any = None,
        given: Sequence[Any] = (),
        padding: Any = None,
        outside: Optional[Dict[int, Tensor]] = None,
    ):
        leaves, self.rebuild = flatten_output(result, given)
        input_storages = {storage_ptr(s): i for i, s in enumerate(statics) if s.numel()}
        held = held_storages(outside)
        padded = (
            set()
            if padding is None
            else {i for i, spec in enumerate(padding.dims) if spec is not None}
        )
        self.plan: List[Any] = []  # per leaf: _Owned, _Argument, _ArgumentView, _Given...
        self.owned: List[Tensor] = []
        # Buckets: the capture's output leaves (evidence of which dims follow the batch, taken
        # once: they may hold objects the call was given), and per owned output the dims
        # sliced back to a call's real rows, once decided.
        self.captured_leaves: Optional[list] = leaves if padding is not None else None
        self.follows: Optional[List[Tuple[int, ...]]] = None
        self._owned_leaves: List[int] = []  # the leaf index of each owned output
        storages = set()
        self.shared = False
        for leaf in leaves:
            if not isinstance(leaf, Tensor):
                self.plan.append(_constant(leaf, given))
                continue
            index = next((i for i, s in enumerate(statics) if leaf is s), None)
            if index is not None:
                self.plan.append(_Argument(index))
            elif outside is not None and outside.get(id(leaf)) is leaf:
                self.plan.append(_Given(weakref.ref(leaf)))
            elif leaf.numel() and storage_ptr(leaf) in input_storages:
                i = input_storages[storage_ptr(leaf)]
                if i in padded:
                    raise UnplannableOutput(
                        "it returns a view of an argument padded to a bucket, whose layout "
                        "differs from call to call; return a copy (.clone()) or name the "
                        "arguments to pad with bucket_args"
                    )
                self.plan.append(_ArgumentView(i, View.of_leaf(leaf, statics[i])))
            elif leaf.numel() and storage_ptr(leaf) in held:
                base = held[storage_ptr(leaf)]
                self.plan.append(_HeldView(weakref.ref(base), View.of_leaf(leaf, base)))
            else:
                self.plan.append(_Owned(len(self.owned)))
                self.shared |= leaf.numel() > 0 and storage_ptr(leaf) in storages
                storages.add(storage_ptr(leaf))
                self.owned.append(leaf)
                self._owned_leaves.append(len(self.plan) - 1)
        self.only_owned = all(type(p) is _Owned for p in self.plan)
        self.pool = pool
        self.handed_out: List[Any] = []
        self._protect_static(policy, label)
        # A lone tensor returned as itself, copied: ``produce`` clones it and builds nothing.
        self.lone = isinstance(result, Tensor) and self.only_owned and not self.static

    def _protect_static(self, policy: str, label: str) -> None:
        """With outputs='static' (on a CUDA build that can), the messages that stale aliases
        raise, and their poisoning when this plan (and the graph's buffers) goes away."""
        self.static = (
            policy == "static" and _CAN_POISON and bool(self.owned) and self.owned[0].is_cuda
        )
        if policy == "static" and self.owned and not self.static:
            logger.info(
                "%s: outputs='static' needs a CUDA build of torch >= 2.6 to protect "
                "stale outputs; returning copies instead",
                label,
            )
        self.overwritten_message = (
            f"autograph: this output of {label} was overwritten by a later call: with "
            f"outputs='static', graphs of one function (or one region) reuse their buffers. "
            f"Clone it before the next call, or use outputs='copy'."
        )
        if self.static:
            self.released_message = (
                f"autograph: this output of {label} belonged to a graph that was released "
                f"(reset(), or its function or module was deleted), and with "
                f"outputs='static' an output lives in the graph's memory. Clone it before "
                f"releasing the graph, or use outputs='copy'."
            )
            # Aliases do not own their memory: poison them before this plan (and the graph's
            # buffers) goes away, even without reset().
            weakref.finalize(self, _poison, self.handed_out, self.released_message)

    def _on_new_storages(self, make: Callable[[Any, Tensor], Any]) -> List[Tensor]:
        """The owned outputs rebuilt on new storages, one per storage they share."""
        made: Dict[int, Any] = {}
        outputs = []
        for o in self.owned:
            storage = o.untyped_storage()
            target = made.get(storage.data_ptr())
            if target is None:
                target = made[storage.data_ptr()] = make(storage, o)
            outputs.append(
                torch.empty(0, dtype=o.dtype, device=o.device).set_(
                    target, o.storage_offset(), o.size(), o.stride()
                )
            )
        return outputs

    def _copies(self) -> List[Tensor]:
        if not self.shared:
            return [o.clone() for o in self.owned]
        return self._on_new_storages(
            lambda storage, o: (
                torch.empty(0, dtype=torch.uint8, device=o.device)
                .set_(storage)
                .clone()
                .untyped_storage()
            )
        )

    def _aliases(self) -> List[Tensor]:
        if self.pool is not None and id(self) not in self.pool.static_plans:
            self.pool.static_plans[id(self)] = weakref.ref(self)
        return self._on_new_storages(self._alias_storage)

    def _alias_storage(self, storage: Any, output: Tensor) -> Any:
        alias = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), output.device, storage.nbytes()
        )
        self.handed_out.append(alias)
        return alias

    def poison(self) -> None:
        """Make the aliases handed out so far raise when read: their buffers are reused."""
        _poison(self.handed_out, self.overwritten_message)

    def release(self) -> None:
        """Make the aliases handed out so far raise when read: the graph is going away."""
        if self.static:
            _poison(self.handed_out, self.released_message)

    def slice_dims(self, dims: Optional[Sequence[Tuple[int, ...]]]) -> None:
        """Slice these dims of each output leaf (``_batch_dims``) back to a call's rows; None
        while undecided (only calls of the bucket's own size may then replay)."""
        self.follows = None if dims is None else [dims[leaf] for leaf in self._owned_leaves]

    def produce(self, tensors: Sequence[Tensor], padding: Any = None) -> Any:
        if padding is None or padding.rows == padding.bucket:
            if self.lone:
                return self.owned[0].clone()  # owned, not a leaf kept: training detaches it
            owned = self._aliases() if self.static else self._copies()
        elif self.static or self.shared:
            owned = [
                real_rows(o, dims, padding.rows)
                for o, dims in zip(self._aliases() if self.static else self._copies(), self.follows)
            ]
        else:  # only the real rows are copied
            owned = [
                real_rows(o, dims, padding.rows).clone()
                for o, dims in zip(self.owned, self.follows)
            ]
        return self.assemble(owned, tensors)

    def assemble(self, owned: Sequence[Tensor], tensors: Sequence[Tensor]) -> Any:
        """The call's return value from its owned outputs and its arguments."""
        if self.only_owned:
            return self.rebuild(owned)
        return self.rebuild([entry.value(owned, tensors) for entry in self.plan])
