"""Observers of a split composite op: under inference mode each observer sees each op once, and one
that joins and leaves inside a split op leaves the mode stack clean.
"""

import torch

from autograph.watch._guard import UnsafeOpDetector
from autograph.watch._modes import BOTH, PARTS, WHOLE
from autograph.watch._reads import CallWatch
from autograph.watch._size_reads import NumbersOf
from autograph.watch._undo import UndoWrites

from helpers.modes import Names, modes_on_the_stack

# A composite op of Python's: its kernel runs between the parts, where an observer can join.
_LIBRARY = torch.library.Library("autograph_tests", "DEF")
_LIBRARY.define("twice(Tensor x) -> Tensor")
_INNER_SAW = []


def _twice(x):
    with Names(WHOLE) as inner:
        y = x * 2
    _INNER_SAW.append(inner.names)
    return y


_LIBRARY.impl("twice", _twice, "CompositeImplicitAutograd")


def test_nested_composites_under_inference_mode_each_observer_sees_each_op_once():
    # instance_norm -> batch_norm -> _batch_norm_impl_index -> native_batch_norm: composites
    # whose parts are composites, taken apart by the guard among all three kinds of observers.
    x, external = torch.randn(2, 3, 5), torch.randn(5)
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    whole, parts, both, numbers = Names(WHOLE), Names(PARTS), Names(BOTH), {}
    with torch.inference_mode():
        with (
            UndoWrites() as undo,
            whole,
            CallWatch() as watch,
            NumbersOf(numbers, 2),
            parts,
            both,
            UnsafeOpDetector("cpu", raise_on_unsafe=False) as guard,
        ):
            assert modes_on_the_stack() == 1
            y = torch.nn.functional.instance_norm(
                x, running_mean, running_var, use_input_stats=True, momentum=0.5
            )
            y = y * external
    assert modes_on_the_stack() == 0 and guard.finding is None
    assert whole.names == ["instance_norm", "mul"]
    for inner in ("batch_norm", "_batch_norm_impl_index"):  # composites inside: BOTH only
        assert inner not in whole.names and inner not in parts.names
        assert both.names.count(inner) == 1
    assert parts.names.count("native_batch_norm") == both.names.count("native_batch_norm") == 1
    assert [n for n in both.names if n in parts.names] == parts.names
    assert "instance_norm" not in parts.names
    # The external tensor's read and the running stats' write are seen by the WHOLE watch.
    assert external.untyped_storage().data_ptr() in watch.external
    assert running_mean.untyped_storage().data_ptr() in watch.written
    assert not torch.equal(running_mean, torch.zeros(3))
    undo.restore()  # every write taken back (the running stats, written by parts only)
    assert torch.equal(running_mean, torch.zeros(3)) and torch.equal(running_var, torch.ones(3))


def test_an_observer_that_joins_and_leaves_inside_a_split_op_leaves_the_stack_clean():
    _INNER_SAW.clear()
    x = torch.ones(3)
    whole, parts = Names(WHOLE), Names(PARTS)
    with torch.inference_mode():
        with whole, parts, UnsafeOpDetector("cpu", raise_on_unsafe=False) as guard:
            y = torch.ops.autograph_tests.twice(x)
            assert modes_on_the_stack() == 1
            y + 1
    assert modes_on_the_stack() == 0 and guard.finding is None
    assert whole.names == ["twice", "add"] and parts.names == ["mul", "add"]
    assert _INNER_SAW == [["mul"]]  # joined the parts' watch for the part it ran
    assert torch.equal(y, torch.full((3,), 2.0))
