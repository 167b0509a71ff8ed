"""What a run on fake tensors (``_symbolic_batch``) shows of a bucketed key's outputs at sizes
it has not run at (docs/design.md, "Buckets"): evidence of the dims that follow the batch, a
refusal made before any per-bucket state is written, and a refused call's outputs at its own rows.

>>> run = run_on_fake(life, c, args, kwargs, padded)   # once per family; None if it cannot run
>>> noted_fake_evidence(padding, run.shapes_at)      # the outputs at a second size, noted
>>> refused_by(padding, run.shapes_at)               # why the fake outputs refuse the key, if so

The fake run's outputs count only where its outputs at the bucket's size are the real run's:
otherwise it ran another program than the function does, and shows nothing.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..capture._outputs import real_rows
from ..watch._python_state import PythonState
from ..watch._undo import generator_states
from ._batch_dims import BatchShapes, as_evidence
from ._symbolic_batch import FakeRun, symbolic_shapes

Tensor = torch.Tensor


def run_on_fake(
    life: Any, c: Any, args: tuple, kwargs: dict, padded: Dict[int, Tensor]
) -> Optional[FakeRun]:
    """The run of the call ``c``'s function on fake tensors with its padded arguments' batch
    dims symbolic, once per family (None after the first try, or where it could not run), with
    the Python state the call reaches and the random generators put back after it."""
    padding = c.padding
    if padding.shapes.fake_run_tried:
        return None
    padding.shapes.fake_run_tried = True
    try:
        return symbolic_shapes(
            c.call,
            args,
            kwargs,
            [(t, padding.dims[i][0]) for i, t in padded.items()],
            padding.bucket,
            kept=PutBack(life, c),
        )
    except Exception:  # noqa: BLE001 - evidence or none: the run never fails the call
        return None


def at_the_calls_rows(padding: Any, leaves: List[Any], shapes_at: Any) -> Optional[List[Any]]:
    """The outputs of a padded run that its family refuses (``x.shape[0]`` returned) as a run of
    the call's own rows gives them, from its run on fake tensors: a tensor narrowed where that
    run's dim is the bucket's size padded and the call's rows as called, a number made from the
    size its value at the call's rows. None where the fake run shows other outputs than the
    padded run did at the bucket's size, or a dim that changes otherwise. The padded run wrote
    the per-bucket state already, and a run as called would write it again: this is the one
    call of the key that is not run as called (the next ones are)."""
    rows, bucket = padding.rows, padding.bucket
    at_bucket = shapes_at(bucket) if shapes_at is not None else None
    at_rows = shapes_at(rows) if at_bucket is not None else None
    if at_rows is None or padding.shapes.runs.get(bucket) != [as_evidence(o) for o in at_bucket]:
        return None
    outputs = []
    for leaf, fake in zip(leaves, at_rows):
        if not isinstance(leaf, Tensor):
            # A number at the call's rows (the fake run's); any other leaf is the padded run's.
            outputs.append(fake if type(fake) in (int, float, bool) else leaf)
            continue
        if fake.dim() != leaf.dim():
            return None
        changed = tuple(d for d in range(leaf.dim()) if leaf.shape[d] != fake.shape[d])
        if any((leaf.shape[d], fake.shape[d]) != (bucket, rows) for d in changed):
            return None
        outputs.append(real_rows(leaf, changed, rows))
    return outputs


class PutBack:
    """The Python state the call reaches (``PythonState``), torch's generators and Python's and
    numpy's random generators, as they were before the block, after it."""

    def __init__(self, life: Any, c: Any):
        self.state = PythonState.of(life.function.roots(c), life.function.fn, restorable=True)

    def __enter__(self) -> None:
        self.generators = generator_states()
        self.python_random = _python_random_states()

    def __exit__(self, *exc: Any) -> None:
        self.state.restore()
        for generator, before in self.generators:
            generator.set_state(before)
        for set_state, before in self.python_random:
            set_state(before)


def _second_size(padding: Any, shapes_at: Any) -> Optional[Tuple[int, List[Any]]]:
    """A size other than the bucket's, not run yet, and the fake run's outputs there."""
    bucket = padding.bucket
    for size in (2 * bucket + 1, bucket + 1, bucket - 1):
        leaves = shapes_at(size) if size >= 2 and size not in padding.shapes.runs else None
        if leaves is not None:
            return size, leaves
    return None


def refused_by(padding: Any, shapes_at: Any) -> Optional[str]:
    """Why the fake run's outputs at the bucket and a second size refuse the key, if they do.
    Unchecked against a real run (none has run yet), they only ever refuse: a refused key runs
    eagerly, as called, which is right whatever the fake run got wrong."""
    at_bucket = shapes_at(padding.bucket) if shapes_at is not None else None
    second = _second_size(padding, shapes_at) if at_bucket is not None else None
    if second is None:
        return None
    trial = BatchShapes(padding.shapes.named)
    trial.note(padding.bucket, at_bucket)
    trial.note(*second)
    return trial.decide(padding.rows, padding.bucket).refused


def noted_fake_evidence(padding: Any, shapes_at: Any) -> bool:
    """Note the fake run's outputs at a second size in the family's ``BatchShapes``, if its
    outputs at the bucket's size are the real run's; whether it did."""
    if shapes_at is None:
        return False
    at_bucket = shapes_at(padding.bucket)
    if at_bucket is None or padding.shapes.runs[padding.bucket] != [
        as_evidence(o) for o in at_bucket
    ]:
        return False  # not the real run's shapes: no evidence
    second = _second_size(padding, shapes_at)
    if second is None:
        return False
    padding.shapes.note(*second)
    return True


def _python_random_states() -> List[Tuple[Any, Any]]:
    """(setter, state) of Python's and, where imported, numpy's global random generators: the
    run on fake tensors
    draws from them as the function does, and must not."""
    states: List[Tuple[Any, Any]] = [(random.setstate, random.getstate())]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states.append((numpy.random.set_state, numpy.random.get_state()))
    return states
