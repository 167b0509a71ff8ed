"""State read by address (docs/design.md, "State read by address"): which tensors a graph reads that
are not its arguments, their names, and a watch that notices when one of them is freed or rebound.

>>> with CallWatch(statics) as watch:       # during capture: sees every op's tensors
...     outputs = step(*statics)
>>> survey = Survey([("self", model), ("past_key_values", cache)])   # before capture
>>> graph.watch = ReadWatch(graph, watch.external, survey)          # after the first replay
>>> graph.invalid_reason                     # None, or the name of a tensor freed since

A CUDA graph reads every tensor that is not one of its static inputs (parameters, buffers,
closures, the tensors inside a cache object) at the address it had during capture. If such a
tensor's memory is freed (a cache that grows by ``torch.cat`` rebinds its tensors; ``model.to()``
swaps every parameter's storage), a replay would read freed memory. The watch holds each such
storage weakly, with a callback: the callback marks the graph invalid the moment the storage
dies, so the check before a replay is one attribute read. Storages stay alive (and replays
stay right) while anything still holds them; a tensor rebound while its old storage stays alive
elsewhere is not seen (docs/guide/limits.md).
"""

from __future__ import annotations

import dis
import functools
import types
import weakref
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from ._modes import Observer, tensors_in
from ._names import describe_tensor

Tensor = torch.Tensor


def storage_ptr(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested or fake tensors
        return 0


def made_of_python_values(t: Tensor) -> bool:
    """Whether ``t``, given to ``aten.lift_fresh``, is memory torch.tensor(...) has just made
    of Python values: not a numpy array's (``torch.as_tensor(array)``, ``torch.from_numpy``),
    whose memory is the caller's (not resizable), nor pinned (a copy from pinned memory to the
    GPU is captured reading it by address)."""
    storage = t.untyped_storage()
    return storage.resizable() and not t.is_pinned()


_aten = torch.ops.aten
# torch.tensor(...)'s op: it hands the dispatcher memory made of Python values (or a numpy array's)
LIFT_FRESH = _aten.lift_fresh.default
# In training mode these update running_mean and running_var in place, although their schemas
# do not mark them as written (those of _native_batch_norm_legit and _batch_norm_with_update
# do), by the name of the argument that says training. The composite ones reach a dispatch
# mode whole under inference_mode, where nothing takes them apart (a warmup, verify's run).
_UPDATES_RUNNING_STATS = {
    _aten.native_batch_norm: "training",
    _aten.cudnn_batch_norm: "training",
    _aten.miopen_batch_norm: "training",
    _aten.batch_norm: "training",
    _aten._batch_norm_impl_index: "training",
    _aten.instance_norm: "use_input_stats",
}


def written_tensors(func: Any, args: tuple, kwargs: dict) -> List[Tensor]:
    """The tensors an ATen op writes to: those its schema marks written, and hidden writes.

    >>> written_tensors(torch.ops.aten.add_.Tensor, (x, y), {})
    [x]
    """
    written, training, stats = _WRITES.get(func) or _writes_of(func)
    if training is not None and _argument(args, kwargs, training):
        written += stats
    if not written:
        return []
    return list(tensors_in(_argument(args, kwargs, place) for place in written))


Place = Tuple[int, str]  # an argument's position in an op's schema, and its name


def _argument(args: tuple, kwargs: dict, place: Place) -> Any:
    position, name = place
    return args[position] if position < len(args) else kwargs.get(name)


# Per op, what its schema says it writes: (written, where ``training`` is or None, the running
# stats written in training). Asked for every op of a watched run; an op's schema never
# changes, so it is read once per op (a process-wide cache of facts, no state).
_WRITES: Dict[Any, Tuple[Tuple[Place, ...], Optional[Place], Tuple[Place, ...]]] = {}


def _writes_of(func: Any) -> Tuple[Tuple[Place, ...], Optional[Place], Tuple[Place, ...]]:
    places = {
        argument.name: (i, argument.name) for i, argument in enumerate(func._schema.arguments)
    }
    written = [
        places[argument.name]
        for argument in func._schema.arguments
        if argument.alias_info is not None and argument.alias_info.is_write
    ]
    training, stats = None, ()
    flag = _UPDATES_RUNNING_STATS.get(func.overloadpacket)
    if flag is not None:
        training = places.get(flag)
        stats = tuple(places[name] for name in ("running_mean", "running_var") if name in places)
    if func.namespace == "c10d" and func._schema.name.endswith("_"):
        # torch.distributed's in-place collectives (allreduce_, allgather_, recv_...) write
        # their tensors, and their schemas do not say so.
        written += [
            place
            for name, place in places.items()
            if name == "tensors" or name.startswith("output")
        ]
    facts = _WRITES[func] = (tuple(written), training, stats)
    return facts


class CallWatch(Observer):
    """Record, for one run of a function, the storages it wrote and the tensors it read that
    it neither received (``statics``) nor created."""

    def __init__(self, statics: Sequence[Tensor] = ()):
        self.known = {storage_ptr(t) for t in statics} | {0}
        self.written: Set[int] = set()
        # Strong references until the caller has replayed once: a tensor the function
        # itself rebinds during capture must stay alive for that first replay.
        self.external: Dict[int, Tensor] = {}

    def before(self, func: Any, args: tuple, kwargs: dict, tensors: Sequence[Tensor]) -> bool:
        if func is LIFT_FRESH:
            # torch.tensor(2.0) in the run: made of Python values outside the dispatcher, it
            # first reaches a mode here. The run made it (its value is the call's Python, which
            # the key and the values read cover); a graph reads no state by its address.
            self.known.update(storage_ptr(t) for t in tensors if made_of_python_values(t))
        for t in tensors:
            ptr = storage_ptr(t)
            if ptr not in self.known:
                self.external[ptr] = t
                self.known.add(ptr)
        for t in written_tensors(func, args, kwargs):
            self.written.add(storage_ptr(t))
        return True

    def after(self, token: bool, out: Any) -> None:
        for t in tensors_in(out if isinstance(out, (list, tuple)) else (out,)):
            self.known.add(storage_ptr(t))

    def written_arguments(self, tensors: Sequence[Tensor]) -> List[int]:
        """Indices of the arguments whose storage the run wrote to."""
        return [i for i, t in enumerate(tensors) if t.numel() and storage_ptr(t) in self.written]


def shares_written_memory(tensors: Sequence[Tensor], written: Sequence[int]) -> bool:
    """Whether an argument the function writes shares memory with another argument.

    Eager code would see such a write through the other argument; separate static copies
    would not, so such a call must run eagerly.
    """
    storages = [storage_ptr(t) for t in tensors]
    return any(storages.count(storages[i]) > 1 for i in written if tensors[i].numel())


def shares_state(tensors: Sequence[Tensor], storages: Set[int]) -> bool:
    """Whether an argument shares memory with state the function reads or writes by address.

    Eagerly, the function would see its writes to that state through the argument, or its
    writes to the argument through that state; a graph's static copy of the argument is
    separate memory, so such a call must run eagerly (issue 21, item 5).
    """
    # Without storage_ptr's guard: sparse and nested arguments never reach a graph.
    return any(t.untyped_storage().data_ptr() in storages for t in tensors if t.numel())


# ---- what a function can reach: names for messages, and leaves whose .grad it may set ----

_MAX_NODES = 50_000


class ReachedGenerator(NamedTuple):
    """A random generator a call can reach: the caller's object, its path, and where it was
    reached as an attribute (owner, the owner's dictionary, key), or None."""

    generator: torch.Generator
    path: str
    slot: Optional[Tuple[Any, str, str]]


class Survey:
    """The tensors reachable from a call's roots, taken before its capture.

    ``names`` maps storage addresses to the first path that reaches them, e.g.
    ``past_key_values.layers[0].keys`` or ``self.linear.weight``; ``leaves`` maps the
    reachable leaves that require grad to their ``.grad`` at that moment.
    """

    def __init__(self, roots: Sequence[Tuple[str, Any]], depth: int = 6):
        self.names: Dict[int, str] = {}
        # Per storage address, where it was first reached as an object's attribute: the
        # owner, the attribute's dictionary (``_parameters``, ``_buffers``, ``__dict__``),
        # its key, and the tensor found there (``_slots``).
        self.slots: Dict[int, Tuple[Any, str, str, Tensor]] = {}
        self.leaves: Dict[int, Tuple[Tensor, Optional[Tensor], str]] = {}
        # The random generators reachable, by the generator's identity: the caller's objects
        # (an op is handed its own Python object for a generator).
        self.generators: Dict[int, ReachedGenerator] = {}
        self.modules: Dict[int, torch.nn.Module] = {}  # the modules reached, by id
        self._seen: Set[int] = set()
        self._budget = _MAX_NODES
        for path, root in roots:
            self._visit(path, root, depth)

    def _visit(
        self, path: str, obj: Any, left: int, slot: Optional[Tuple[Any, str, str]] = None
    ) -> None:
        if self._budget <= 0 or id(obj) in self._seen:
            return
        self._budget -= 1
        if isinstance(obj, Tensor):
            ptr = storage_ptr(obj)
            if ptr and ptr not in self.names:
                self.names[ptr] = path
                if slot is not None:
                    self.slots[ptr] = (*slot, obj)
            if obj.requires_grad and obj.is_leaf and id(obj) not in self.leaves:
                self.leaves[id(obj)] = (obj, obj.grad, path)
            return
        if isinstance(obj, torch.Generator):
            self.generators.setdefault(obj._cdata, ReachedGenerator(obj, path, slot))
            return
        if left == 0 or isinstance(
            obj, (str, bytes, int, float, type, type(None), types.ModuleType)
        ):
            return
        self._seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            self.modules[id(obj)] = obj
            for group in ("_parameters", "_buffers", "_modules"):
                for key, value in getattr(obj, group).items():
                    if value is not None:
                        self._visit(f"{path}.{key}", value, left - 1, (obj, group, key))
            # A module's own internals start with "_"; a private generator kept there
            # (self._generator) is state the call draws from, and is reached.
            children: Iterable[Tuple[str, Any, Any]] = (
                (f"{path}.{k}", v, (obj, "__dict__", k))
                for k, v in vars(obj).items()
                if not k.startswith("_") or isinstance(v, torch.Generator)
            )
        elif isinstance(obj, dict):
            children = ((f"{path}[{k!r}]", v, None) for k, v in list(obj.items())[:256])
        elif isinstance(obj, (list, tuple)):
            children = ((f"{path}[{i}]", v, None) for i, v in enumerate(obj[:256]))
        else:
            attributes = getattr(obj, "__dict__", None)
            if not isinstance(attributes, dict) or callable(obj):
                return
            children = (
                (f"{path}.{k}", v, (obj, "__dict__", k))
                for k, v in list(attributes.items())
                if not k.startswith("__")
            )
        for child_path, child, slot in children:
            self._visit(child_path, child, left - 1, slot)

    def tensors(self) -> Dict[int, Tensor]:
        """The tensors found as attributes or as leaves that require grad, by id."""
        found = {id(t): t for *_, t in self.slots.values()}
        found.update((id(t), t) for t, _, _ in self.leaves.values())
        return found

    def restore_grads(self) -> None:
        """Give each leaf back the ``.grad`` it had before a capture that failed: a backward in
        the capture set ``.grad`` in Python to memory of a graph that is being discarded."""
        for tensor, before, _ in self.leaves.values():
            if tensor.grad is not before:
                tensor.grad = before

    def name(self, tensor: Tensor) -> str:
        return self.names.get(storage_ptr(tensor)) or (
            f"a {describe_tensor(tensor)} tensor that is not an argument"
        )


def held_before(survey: Survey) -> Dict[int, Tuple[str, Any]]:
    """By storage address, the name and a weak reference to the storage of each tensor the
    survey reached as an attribute: a call that rebinds one lets the storage die."""
    return {
        ptr: (survey.names[ptr], weakref.ref(tensor.untyped_storage()))
        for ptr, (*_, tensor) in survey.slots.items()
    }


def replaces_reason(name: str) -> str:
    """Why a key whose calls rebind what they read by address runs eagerly."""
    return (
        f"it replaces {name} on every call (a cache that grows with torch.cat does), and a "
        f"graph would keep reading the old tensor. Use a fixed-size cache updated in place "
        f"(transformers' StaticCache), or pass the tensor as an argument"
    )


def roots_of(
    fn: Any,
    instance: Any,
    names: Sequence[str],
    args: tuple,
    kwargs: dict,
    instance_label: str = "self",
) -> List[Tuple[str, Any]]:
    """Where the tensors a function reads may come from: its instance, its arguments, its
    default parameter values, its closure and the globals its code names.

    >>> def fwd_bwd(inp, weight=weight, *, scaler=scaler): ...
    >>> [name for name, _ in roots_of(fwd_bwd, None, ["inp"], (x,), {})]
    ['inp', 'weight', 'scaler']
    """
    roots: List[Tuple[str, Any]] = []
    if instance is not None:
        roots.append((instance_label, instance))
    for i, a in enumerate(args):
        roots.append((names[i] if i < len(names) else f"args[{i}]", a))
    roots.extend(kwargs.items())
    owner = getattr(fn, "__self__", None)
    if owner is not None and owner is not instance:
        roots.append((instance_label, owner))
    function = getattr(fn, "__func__", fn)
    code = getattr(function, "__code__", None)
    if code is not None:
        # A default value is bound at definition and read by address like a global: a
        # ``weight=weight`` parameter's .grad is set by the graph's backward.
        defaults = getattr(function, "__defaults__", None) or ()
        positional = code.co_varnames[: code.co_argcount]
        roots.extend(zip(positional[len(positional) - len(defaults) :], defaults))
        roots.extend((getattr(function, "__kwdefaults__", None) or {}).items())
    for name, place, key in free_names(fn):
        try:
            roots.append((name, place[key] if isinstance(place, dict) else place.cell_contents))
        except (KeyError, ValueError):  # a global not (yet) defined, an empty cell
            pass
    return roots


def free_names(fn: Any) -> Iterator[Tuple[str, Any, Any]]:
    """``(name, place, key)`` for each name a function reads from outside: its closure cells
    (``place`` the cell, ``key`` None) and the names its code looks up in its module's globals
    (``place`` that dict, ``key`` the name, whether it is bound yet or not).

    >>> list(free_names(lambda x: x * scale))
    [('scale', {...the module's globals...}, 'scale')]
    """
    function = getattr(fn, "__func__", fn)
    code = getattr(function, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or ()):
        yield name, cell, None
    module_globals = getattr(function, "__globals__", None)
    if isinstance(module_globals, dict):
        for name in _global_names(code):
            yield name, module_globals, name


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> Tuple[str, ...]:
    """The names ``code`` and the code nested in it (a comprehension's, a lambda's) read or
    bind as globals, in order (``co_names`` also holds attribute names: ``self.weight`` is no
    global ``weight``)."""
    names = [
        instruction.argval
        for instruction in dis.get_instructions(code)
        if instruction.opname in _GLOBAL_OPS
    ]
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names.extend(_global_names(constant))
    return tuple(dict.fromkeys(names))


def _mark_invalid(graph_ref: "weakref.ref[Any]", name: str, _: Any) -> None:
    graph = graph_ref()
    if graph is not None and graph.invalid_reason is None:
        graph.invalid_reason = name


class ReadWatch:
    """Weak references to the storages a graph reads by address, and to the private random
    generators it draws from (those the survey reached), each with a callback that marks the
    graph invalid when it is freed: a generator rebound to a new one (``g =
    torch.Generator(...)`` again) leaves the graph drawing from the old one, which it holds.
    Generators take weak references from torch 2.12 on; before, a rebound one goes unseen."""

    def __init__(
        self,
        graph: Any,
        external: Dict[int, Tensor],
        survey: Survey,
        drawn: Sequence[torch.Generator] = (),
    ):
        graph_ref = weakref.ref(graph)
        self.refs: List[Any] = [
            weakref.ref(
                tensor.untyped_storage(),
                functools.partial(_mark_invalid, graph_ref, survey.name(tensor)),
            )
            for tensor in external.values()
        ]
        for reached in filter(None, (survey.generators.get(g._cdata) for g in drawn)):
            try:
                self.refs.append(
                    weakref.ref(
                        reached.generator, functools.partial(_mark_invalid, graph_ref, reached.path)
                    )
                )
            except TypeError:  # torch < 2.12 (pytorch#180290): unseen, docs/guide/limits.md
                break


_ANY = object()  # a slot whose graph does not depend on the .grad it finds


class GradSlots:
    """The ``.grad`` of leaves that a graph's backward writes: a graph replays Python's
    effect on ``.grad`` only as captured (docs/design.md, "State read by address": ``.grad`` too).

    Per leaf the capture found one of: it stole a fresh gradient into a ``.grad`` that was
    None (replays need ``.grad`` None again, then get the graph's buffer bound to it); it
    set ``.grad`` afresh after clearing it itself (``zero_grad()`` inside the function: any
    ``.grad`` will do, and the buffer is bound after each replay); or it accumulated into an
    existing ``.grad`` (replays need that same tensor there).
    """

    def __init__(self, survey: Survey, written: Set[int]):
        self.slots: List[Tuple[Any, Any, Any, str]] = []
        for tensor, before, path in survey.leaves.values():
            after = tensor.grad
            if after is before:
                if before is None or storage_ptr(before) not in written:
                    continue  # untouched by the graph
                expect, bind = weakref.ref(before), _ANY
            else:
                expect = None if before is None else _ANY
                bind = after
            self.slots.append((weakref.ref(tensor), expect, bind, path))

    def __bool__(self) -> bool:
        return bool(self.slots)

    def mismatch(self) -> Optional[str]:
        """Why the leaves' ``.grad`` no longer fit the graph, or None."""
        for tensor_ref, expect, _, path in self.slots:
            tensor = tensor_ref()
            if tensor is None:
                return f"{path} (freed)"
            grad = tensor.grad
            if expect is None:
                if grad is not None:
                    return (
                        f"{path}.grad, which the graph expects to be None (as at capture) "
                        f"and found set"
                    )
            elif expect is not _ANY and grad is not expect():
                return f"{path}.grad, which was {'set to None' if grad is None else 'replaced'}"
        return None

    def bind(self) -> None:
        """Give each leaf the ``.grad`` its graph just wrote, as eager execution would."""
        for tensor_ref, _, bind, _ in self.slots:
            if bind is not _ANY:
                tensor = tensor_ref()
                if tensor is not None and tensor.grad is not bind:
                    tensor.grad = bind
