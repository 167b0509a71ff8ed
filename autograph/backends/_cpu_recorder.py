"""The CPU emulation's recorder: every ATen op of a recording that writes memory or makes new
tensors, held as a CUDA graph holds its kernels, and what to undo after.

>>> with Recorder() as recorder:
...     outputs = step(static_x)
>>> recorder.undo_effects()               # as a CUDA capture, which computes nothing
>>> for op in recorder.ops: op.run(*op.arguments())     # a replay

Tensors made during the recording are the graph's pool, held by it; tensors that existed
before are read by address and held weakly (``_OutsideTensor``), so that a replay that finds
one freed or moved raises instead of reading stale memory. See ``_cpu_graphs`` for the backend.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..distributed._ranks import COLLECTIVE_NAMESPACES
from ..watch._modes import CompiledCodeRunsUnder, run_apart, tensors_in
from ..watch._reads import made_of_python_values, written_tensors
from ..watch._unsafe_ops import SPARSE_LAYOUTS, composite_keys

_aten = torch.ops.aten

_Layout = Tuple[torch.dtype, Tuple[int, ...], Tuple[int, ...], int, bool, bool]


def _returns_only_views(func: Any) -> bool:
    """Whether every output of ``func`` aliases an input without writing it (``view``, ``t``).

    >>> _returns_only_views(_aten.t.default), _returns_only_views(_aten.t_.default)
    (True, False)
    """
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def _rebuildable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is plain strided memory, so that a view can be rebuilt from its storage.

    >>> _rebuildable(torch.ones(2)), _rebuildable(torch.ones(2).to_sparse())
    (True, False)
    """
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and type(tensor).__torch_dispatch__ is torch._C._disabled_torch_dispatch_impl
    )


def _storage_key(tensor: torch.Tensor) -> int:
    """The address of the storage object ``tensor`` views, shared by all views of its memory.

    >>> _storage_key(x) == _storage_key(x.t())
    True
    """
    return tensor.untyped_storage()._cdata


def _layout(tensor: torch.Tensor) -> _Layout:
    """Everything but the memory that a view needs: what ``_view`` rebuilds from.

    >>> _layout(torch.ones(2, 3).t())
    (torch.float32, (3, 2), (1, 3), 0, False, False)
    """
    return (
        tensor.dtype,
        tuple(tensor.size()),
        tuple(tensor.stride()),
        tensor.storage_offset(),
        tensor.is_conj(),
        tensor.is_neg(),
    )


def _view(storage: torch.UntypedStorage, layout: _Layout) -> torch.Tensor:
    """A fresh tensor on ``storage`` with ``layout``: same memory, private metadata.

    >>> _view(x.untyped_storage(), _layout(x.t())).add_(1)    # adds 1 to x
    """
    dtype, size, stride, offset, conj, neg = layout
    # A normal tensor even under inference_mode: a replay outside it may write to this one.
    with torch.inference_mode(False):
        view = torch.empty(0, dtype=dtype, device=storage.device)
        view.set_(storage, offset, size, stride)
    if conj:
        torch._C._set_conj(view, True)
    if neg:
        torch._C._set_neg(view, True)
    return view


class _OutsideTensor:
    """A tensor that existed before the capture: its memory held weakly, read by address.

    >>> argument = _OutsideTensor(weight)
    >>> argument.resolve(torch.ops.aten.mm.default)     # a view of weight's memory
    """

    __slots__ = ("_storage", "_address", "_layout")

    def __init__(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        self._storage = weakref.ref(storage)
        self._address = storage.data_ptr()
        self._layout = _layout(tensor)

    def resolve(self, func: Any) -> torch.Tensor:
        """A view of the memory, as captured; ``RuntimeError`` if that memory is gone."""
        storage = self._storage()
        if storage is None:
            raise RuntimeError(
                f"the emulated graph reads a tensor that was freed since capture: "
                f"{self._description(func)}; on CUDA this would read freed memory"
            )
        if storage.data_ptr() != self._address:
            raise RuntimeError(
                f"the emulated graph reads a tensor whose memory moved since capture (its "
                f"storage was resized): {self._description(func)}; on CUDA this would read "
                f"memory the tensor no longer owns"
            )
        return _view(storage, self._layout)

    def _description(self, func: Any) -> str:
        dtype, size = self._layout[:2]
        dtype_name = str(dtype).replace("torch.", "")
        return f"a {dtype_name} tensor of shape {size}, an argument of {func}"


class RecordedOp:
    """One op of the recording, with its arguments as the graph holds them.

    >>> args, kwargs = op.arguments()       # weakly held tensors resolved, or RuntimeError
    >>> op.run(args, kwargs)
    """

    __slots__ = ("func", "leaves", "spec", "outside", "results")

    def __init__(
        self, func: Any, leaves: List[Any], spec: TreeSpec, results: List[Tuple[int, torch.Tensor]]
    ):
        self.func = func
        self.leaves = leaves  # the flattened (args, kwargs); tensors as _view or _OutsideTensor
        self.spec = spec
        self.outside = [i for i, leaf in enumerate(leaves) if isinstance(leaf, _OutsideTensor)]
        self.results = results  # (index in the flattened output, the pool tensor it goes to)

    def arguments(self) -> Tuple[tuple, dict]:
        leaves = list(self.leaves)
        for index in self.outside:
            leaves[index] = leaves[index].resolve(self.func)
        return tree_unflatten(leaves, self.spec)

    def run(self, args: tuple, kwargs: dict) -> None:
        output = self.func(*args, **kwargs)
        if self.func.namespace in COLLECTIVE_NAMESPACES:
            # A collective's result is ready once waited on, as the eager call waited on it
            # (dist.all_reduce waits on its Work; a functional collective's result on its
            # first use), and it is copied into the graph's memory below only then.
            for leaf in tree_flatten(output)[0]:
                if isinstance(leaf, torch.ScriptObject) and hasattr(leaf, "wait"):
                    leaf.wait()
                elif isinstance(leaf, torch.Tensor) and self.func.namespace != "c10d":
                    torch.ops._c10d_functional.wait_tensor(leaf)
        if self.results:
            flat_output, _ = tree_flatten(output)
            for index, destination in self.results:
                destination.copy_(flat_output[index])


class Recorder(CompiledCodeRunsUnder):
    """Records the ops that write memory or make new tensors, and what to undo after."""

    def __init__(self, generators: Sequence[torch.Generator] = ()) -> None:
        super().__init__()
        # The generators the capture may draw from (the default one, and those a CUDA capture
        # would register): another is refused as CUDA refuses an unregistered generator.
        self.known = {torch.default_generator._cdata, *(g._cdata for g in generators)}
        self.ops: List[RecordedOp] = []
        # Storages made during the recording, by _storage_key: the graph's pool. Holding them
        # also keeps their keys from being reused by later storages.
        self.pool: Dict[int, torch.UntypedStorage] = {}
        # What the recording wrote that existed before, with its contents before the write.
        self.saved: Dict[int, Tuple[Any, Any]] = {}
        # Each generator drawn from, by its identity (an op is handed its own Python object
        # for a generator), with its state before the recording.
        default = torch.default_generator
        self.generators: Dict[int, Tuple[torch.Generator, torch.Tensor]] = {
            default._cdata: (default, default.get_state())
        }

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket is _aten.lift_fresh and made_of_python_values(args[0]):
            # torch.tensor(...) made this tensor during the recording, outside any op: pool
            # memory, whose value each replay restores first (a CUDA graph's copy of a
            # constant runs on every replay), in case the function then writes to it. Not a
            # numpy array's memory (torch.as_tensor(array)): the caller's, read by address.
            out = func(*args, **kwargs)
            storage = self.pool[_storage_key(out)] = out.untyped_storage()
            leaves, spec = tree_flatten(((_view(storage, _layout(out)), out.detach().clone()), {}))
            self.ops.append(RecordedOp(_aten.copy_.default, leaves, spec, []))
            return out
        if torch.Tag.inplace_view in func.tags or _returns_only_views(func):
            keys = composite_keys(func, list(tensors_in((*args, *kwargs.values()))))
            if keys is not None:
                # A composite op the guard judged whole (``to``, ``reshape``): its schema
                # says its result may alias, but its parts may compute, and they are what a
                # graph records.
                return run_apart(self, func, keys, args, kwargs)
            return func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        for leaf in leaves:
            if isinstance(leaf, torch.Generator) and leaf._cdata not in self.generators:
                if leaf._cdata not in self.known:
                    raise RuntimeError(
                        "the emulated capture draws from a random generator that its warmup "
                        "did not draw from and the call cannot reach (made inside the call?): "
                        "on CUDA this is an unregistered CUDA generator, which torch refuses"
                    )
                self.generators[leaf._cdata] = (leaf, leaf.get_state())
        written = written_tensors(func, args, kwargs)
        for tensor in written:
            self._save_before_write(tensor)
        # Taken before the op runs: an out= op may resize its output.
        held = [self._hold(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        output = func(*args, **kwargs)
        results = self._new_tensors(output, inputs)
        if written or results or func.namespace in COLLECTIVE_NAMESPACES:
            # (a collective that writes nothing new still runs, and waits, at every replay)
            self.ops.append(RecordedOp(func, held, spec, results))
        return output

    def _hold(self, tensor: torch.Tensor) -> Any:
        if tensor.layout in SPARSE_LAYOUTS:
            # Held strongly, a rebound sparse tensor would replay the old one; the guard
            # refuses sparse work before any capture (_unsafe_ops), and so does this graph.
            raise RuntimeError(
                f"the emulated capture records an op on a {tensor.layout} tensor, which a "
                f"graph could only read by address: autograph graphs no sparse work"
            )
        if not _rebuildable(tensor):
            return tensor  # no storage to hold instead; rare on graphed paths
        if _storage_key(tensor) in self.pool:
            return _view(tensor.untyped_storage(), _layout(tensor))
        return _OutsideTensor(tensor)

    def _save_before_write(self, tensor: torch.Tensor) -> None:
        if not _rebuildable(tensor):
            if id(tensor) not in self.saved:
                self.saved[id(tensor)] = (tensor, tensor.clone())
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.pool and key not in self.saved and storage.nbytes():
            # The whole storage: later writes may go through other views of it.
            self.saved[key] = (storage, storage.clone())

    def _new_tensors(
        self, output: Any, inputs: List[torch.Tensor]
    ) -> List[Tuple[int, torch.Tensor]]:
        """The outputs that are new memory (not an input written in place or viewed)."""
        input_keys = {_storage_key(t) for t in inputs if _rebuildable(t)}
        flat_output, _ = tree_flatten(output)
        results = []
        for index, value in enumerate(flat_output):
            if not isinstance(value, torch.Tensor) or any(value is t for t in inputs):
                continue
            if not _rebuildable(value):
                results.append((index, value))
                continue
            key = _storage_key(value)
            if key not in input_keys:
                self.pool[key] = value.untyped_storage()
                results.append((index, _view(self.pool[key], _layout(value))))
        return results

    def undo_effects(self) -> None:
        """Give every tensor that existed before, and every generator, its state before."""
        with torch.no_grad():
            for target, before in self.saved.values():
                target.copy_(before)
        for generator, state in self.generators.values():
            generator.set_state(state)
        self.saved.clear()

    def pool_bytes(self) -> int:
        return sum(storage.nbytes() for storage in self.pool.values())
