"""Verify mode (``verify=n``): check a replay against an eager run of the same call.

>>> outputs, mismatch = verified_replay(lambda: graph.replay(c.tensors), c, "step",
...                                     "x: f32[8] cuda:0", roots)
>>> mismatch        # None, or what differs: "out[1].logits (f32[1, 1024] cuda:0) differs ..."

One checked call runs the function eagerly under ``UndoWrites`` (which saves every storage
that existed before and is written, and the random generators), keeps a copy of its outputs
and of what it wrote, puts the state and the generators back, then replays the graph, which
thereby draws the same random numbers and writes the same state once. The replay's outputs
and the state it wrote are compared with the eager run's, within ``VERIFY_TOLERANCES``. On a
match the caller gets the replay's outputs. On a mismatch the eager run's writes and
generator states are put back and the caller gets the eager outputs, so the call's effects
happened once, as eager execution would have made them.

Writes that no ATen schema declares (a custom kernel writing through a raw pointer) are not
saved, so such a function would see them twice.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from .._config import logger
from .._profile import profile_range
from .._scope import nested_calls
from ..capture._outputs import flatten_arguments, output_node
from ..watch._names import describe_tensor
from ..watch._reads import Survey, written_tensors
from ..watch._undo import UndoWrites

Tensor = torch.Tensor

# (rtol, atol) per dtype, as torch.testing.assert_close uses by default; edit the table to
# loosen a dtype (kernels with atomics may not be bitwise repeatable). Other floating dtypes
# get (their machine epsilon, 1e-5); integers and bool must match exactly.
VERIFY_TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex32: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

_CAUSES = (
    "A replay runs none of the function's Python, so the likely causes are a Python value it "
    "reads that changed since capture (a float, a list item, an attribute), a tensor it reads "
    "that was rebound since capture while the old one lives on, or a branch on Python-side "
    "state (a counter, a flag). Pass what changes as an argument, and update tensors in place "
    "instead of rebinding them"
)

Roots = Callable[[], Sequence[Tuple[str, Any]]]


def tolerance(dtype: torch.dtype) -> Tuple[float, float]:
    """(rtol, atol) for comparing values of ``dtype``; (0, 0) for integers and bool.

    >>> tolerance(torch.bfloat16), tolerance(torch.int64)
    ((0.016, 1e-05), (0.0, 0.0))
    """
    if dtype in VERIFY_TOLERANCES:
        return VERIFY_TOLERANCES[dtype]
    if dtype.is_floating_point:
        return torch.finfo(dtype).eps, 1e-5
    return 0.0, 0.0


class EagerRun(UndoWrites):
    """``UndoWrites`` that also knows each written storage's dtype, and can take the run back
    while keeping what it wrote, to compare with the replay and to redo on a mismatch.

    >>> with EagerRun() as run:
    ...     outputs = step(x, cache)
    >>> written = run.take_back()     # state and generators as before; the writes kept aside
    >>> run.redo(written)             # the eager run's writes and generators again
    """

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: Dict[int, torch.dtype] = {}
        self.generators_after: List[Tuple[Any, Any]] = []

    def before(self, func: Any, args: tuple, kwargs: dict, tensors: Sequence[Tensor]) -> Set[int]:
        for tensor in written_tensors(func, args, kwargs):
            self.dtypes.setdefault(tensor.untyped_storage()._cdata, tensor.dtype)
        return super().before(func, args, kwargs, tensors)

    def take_back(self) -> List[Tuple[Any, torch.dtype, Any, Any]]:
        """Restore the state and generators; return (storage, dtype, contents after the run,
        contents before it) for every storage the run wrote: a loose check measures the
        replay's error against what the call changed, not against the accumulated value."""
        written = []
        with torch.no_grad():
            for key in list(self.saved):
                storage, before = self.saved.pop(key)
                written.append(
                    (storage, self.dtypes.get(key, torch.uint8), storage.clone(), before)
                )
                storage.copy_(before)
        self.generators_after = [(g, g.get_state()) for g, _ in self.generators]
        self.restore()
        return written

    def redo(self, written: List[Tuple[Any, torch.dtype, Any, Any]]) -> None:
        """Put the eager run's writes and generator states back."""
        with torch.no_grad():
            for storage, _, after, _ in written:
                storage.copy_(after)
        for generator, state in self.generators_after:
            generator.set_state(state)


# ---- the leaves of an output, with their paths ----


def leaves(
    obj: Any, given: Set[int], path: str = "out", depth: int = 0
) -> Iterator[Tuple[str, Any]]:
    """(path, leaf) for each leaf of a returned pytree, walked as ``flatten_output`` walks it.

    >>> list(leaves((x, {"logits": y}), set()))
    [('out[0]', x), ("out[1]['logits']", y)]
    """
    node = None if depth > 32 else output_node(obj, given)
    if node is None:
        yield path, obj
        return
    labels, children, _ = node
    for label, child in zip(labels, children):
        yield from leaves(child, given, path + label, depth + 1)


def _snapshot(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


# ---- comparing ----

# Loose: a padded run against the call's own rows, whose kernels may differ with the row count
# (another GEMM algorithm, another reduction order); what it is for, a value computed from
# the batch size, differs by far more.
_LOOSE = (1e-2, 1e-3)


def _error(
    expected: Tensor, actual: Tensor, loose: bool = False, before: Optional[Tensor] = None
) -> Optional[str]:
    """How ``actual`` differs from ``expected`` (same shape and dtype), or None if it is
    within the dtype's tolerance (``loose``: at least ``_LOOSE``'s). ``before``: state as it
    was before the call, for a loose check, whose relative part then scales with what the
    call changed (a running mean of 100 moved by 0.1 with 25% of it wrong is wrong) plus the
    dtype's own rtol of the value (rounding)."""
    with torch.no_grad():
        if expected.layout is not torch.strided:
            expected, actual = expected.to_dense(), actual.to_dense()
        if torch.equal(expected, actual):
            return None
        dtype = expected.dtype
        if not (dtype.is_floating_point or dtype.is_complex):
            bad = expected != actual
            count = int(bad.sum())
            if dtype == torch.bool:
                return f"{count} of {bad.numel()} elements differ"
            error = int((expected[bad].long() - actual[bad].long()).abs().max())
            return (
                f"max abs error {error} in {count} of {bad.numel()} elements (integers "
                f"must match exactly)"
            )
        rtol, atol = tolerance(dtype)
        if loose:
            rtol, atol = max(rtol, _LOOSE[0]), max(atol, _LOOSE[1])
        wide = (
            torch.complex128
            if dtype.is_complex
            else torch.float64
            if dtype == torch.float64
            else torch.float32
        )
        e, a = expected.to(wide), actual.to(wide)
        error = (a - e).abs()
        scale = rtol * e.abs()
        if loose and before is not None:
            scale = rtol * (e - before.to(wide)).abs() + tolerance(dtype)[0] * e.abs()
        bad = ~(error <= atol + scale) & (a != e) & ~(a.isnan() & e.isnan())
        count = int(bad.sum())
        if not count:
            return None
        worst = float(error[bad].max())
        of = " of what the call changed" if loose and before is not None else ""
        return (
            f"max abs error {'nan' if math.isnan(worst) else f'{worst:.3g}'} in {count} "
            f"of {bad.numel()} elements (tolerance rtol={rtol:g}{of}, atol={atol:g})"
        )


def _difference(path: str, expected: Any, actual: Any, loose: bool) -> Optional[str]:
    if isinstance(expected, Tensor) and isinstance(actual, Tensor):
        if (expected.shape, expected.dtype, expected.device) != (
            actual.shape,
            actual.dtype,
            actual.device,
        ):
            return (
                f"{path} is {describe_tensor(expected)} in the eager run and "
                f"{describe_tensor(actual)} in the replay"
            )
        error = _error(expected, actual, loose)
        return None if error is None else f"{path} ({describe_tensor(expected)}): {error}"
    if isinstance(expected, Tensor) or isinstance(actual, Tensor):
        return (
            f"{path} is {type(expected).__name__} in the eager run and "
            f"{type(actual).__name__} in the replay"
        )
    simple = (bool, int, float, complex, str, bytes, type(None))
    if (
        isinstance(expected, simple)
        and isinstance(actual, simple)
        and not (
            type(expected) is type(actual)
            and (expected == actual or expected != expected and actual != actual)
        )
    ):
        return f"{path} is {expected!r} in the eager run and {actual!r} in the replay"
    return None


def _first_output_difference(
    expected: List[Tuple[str, Any]], actual: List[Tuple[str, Any]], loose: bool = False
) -> Optional[str]:
    for (path, e), (actual_path, a) in zip(expected, actual):
        if path != actual_path:
            return (
                f"the outputs differ in structure: {path} in the eager run where the "
                f"replay has {actual_path}"
            )
        difference = _difference(path, e, a, loose)
        if difference is not None:
            return difference
    if len(expected) != len(actual):
        longer = expected if len(expected) > len(actual) else actual
        return (
            f"the outputs differ in structure: {longer[min(len(expected), len(actual))][0]}"
            f" is only in the {'eager run' if longer is expected else 'replay'}"
        )
    return None


def _as_tensor(storage: Any, dtype: torch.dtype) -> Tensor:
    """The whole storage as a flat tensor of ``dtype`` (bytes, if it does not divide)."""
    size = dtype.itemsize
    if storage.nbytes() % size:
        dtype, size = torch.uint8, 1
    # A normal tensor even under inference_mode, so that set_ may take the storage.
    with torch.inference_mode(False):
        return torch.empty(0, dtype=dtype, device=storage.device).set_(
            storage, 0, (storage.nbytes() // size,), (1,)
        )


def _first_state_difference(
    written: List[Tuple[Any, torch.dtype, Any, Any]], roots: Roots, loose: bool = False
) -> Optional[str]:
    for storage, dtype, after, before in written:
        replayed = _as_tensor(storage, dtype)
        error = _error(_as_tensor(after, dtype), replayed, loose, _as_tensor(before, dtype))
        if error is not None:
            name = Survey(roots()).name(replayed)
            return f"{name}, which the call writes, holds other values after the replay: {error}"
    return None


def _verify_says(difference: str) -> str:
    return f"verify: its replay differs from an eager run of the same call: {difference}. {_CAUSES}"


def verified_replay(
    replay: Callable[[], Any],
    c: Any,
    function: str,
    key: str,
    roots: Roots,
    eager: Optional[Callable[[], Any]] = None,
    explain: Callable[[str], str] = _verify_says,
    loose: bool = False,
) -> Tuple[Any, Optional[str]]:
    """Run the call ``c`` eagerly (``eager``, by default ``c.call`` on its arguments) and take
    it back, ``replay`` the graph, and compare (``loose``: within ``_LOOSE`` at least);
    ``explain`` makes the reason from what differs.

    >>> outputs, mismatch = verified_replay(lambda: life.graph.replay(c.tensors, c.padding),
    ...                                     c, "step", life.label, roots)

    Returns the replay's outputs and None, or, on a mismatch, the eager outputs and what
    differs (the reason to run the key eagerly from now on).
    """
    given = {
        id(leaf)
        for leaf in flatten_arguments((c.args, c.kwargs))[0]
        if not isinstance(leaf, Tensor)
    }
    run = EagerRun()
    with profile_range("verify", function, key):
        with nested_calls(), run:
            expected_outputs = eager() if eager is not None else c.call(*c.args, **c.kwargs)
        expected = [(path, _snapshot(leaf)) for path, leaf in leaves(expected_outputs, given)]
        written = run.take_back()
    with profile_range("replay", function, key):
        outputs = replay()
    difference = _first_output_difference(
        expected, list(leaves(outputs, given)), loose
    ) or _first_state_difference(written, roots, loose)
    if difference is None:
        return outputs, None
    run.redo(written)
    return expected_outputs, explain(difference)


def checked_replay(life: Any, c: Any, graph: Any, run_call: Callable[[Any, Any], Any]) -> Any:
    """Verify mode's replay of ``life``'s key (``_key_life.KeyLife``): checked against an
    eager run, made as the key's eager calls are (``run_call``: padded where the key has
    per-bucket state); a mismatch makes the key eager, and the caller gets the eager run's
    outputs and effects."""
    life.checks_left -= 1
    outputs, mismatch = verified_replay(
        lambda: graph.replay(c.tensors, c.padding),
        c,
        life.function.name,
        life.label,
        lambda: life.function.roots(c),
        lambda: run_call(life, c),
    )
    if mismatch is not None:
        life.eager_calls += 1
        c.note(life, "eager_calls")
        life.fall_back(mismatch)
        return outputs
    life.replays += 1
    life.verified += 1
    c.note(life, "replays")
    if not life.checks_left:
        logger.info(
            "%s(%s): its first %d replays after capture matched eager runs",
            life.function.name,
            life.label,
            life.options.replays_to_verify,
        )
    return outputs
