"""The one dispatch mode of a watched run (``_modes.OpWatch``): observers entered inside one
another share it, each sees every op once, and composite ops taken apart by the guard are seen
whole or in parts as each observer asks."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from autograph.watch._guard import GuardError, LibraryUse, UnsafeOpDetector
from autograph.watch._modes import BOTH, PARTS, WHOLE, OpWatch
from autograph.watch._reads import CallWatch
from autograph.watch._size_reads import NumbersOf
from autograph.watch._undo import UndoWrites
from autograph.watch._unsafe_ops import CPU_OPERATION

from helpers.modes import Names, modes_on_the_stack


class Foreign(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_observers_entered_inside_one_another_share_one_mode():
    w, x = torch.ones(3), torch.ones(3)
    numbers = {}
    with UndoWrites() as undo, LibraryUse(), CallWatch() as watch, NumbersOf(numbers, 3):
        assert modes_on_the_stack() == 1
        assert isinstance(_get_current_dispatch_mode(), OpWatch)
        w.add_(x * 2.5)
    assert modes_on_the_stack() == 0
    # Each saw the ops: the read of w by address, the number, the write saved for undoing.
    assert w.untyped_storage().data_ptr() in watch.external
    assert ("other", 2.5) in [(name, n) for _, name, n in numbers[3]]
    undo.restore()
    assert torch.equal(w, torch.ones(3))


def test_a_mode_of_another_kind_between_observers_keeps_its_place():
    x = torch.ones(3)
    with Names() as outer:
        with Foreign() as foreign:
            with Names() as inner:
                assert modes_on_the_stack() == 3
                torch.mul(x, 2)
    assert outer.names == foreign.names == inner.names == ["mul"]
    assert modes_on_the_stack() == 0


def test_each_observer_sees_a_composite_op_whole_or_in_parts_as_it_asks():
    x = torch.ones(2, 3)
    whole, parts, both = Names(WHOLE), Names(PARTS), Names(BOTH)
    with torch.inference_mode():
        with whole, parts, both, UnsafeOpDetector("cpu", raise_on_unsafe=False) as guard:
            torch.nn.functional.layer_norm(x, (3,))
    assert guard.finding is None
    assert "layer_norm" in whole.names and "layer_norm" not in parts.names
    assert "layer_norm" in both.names and set(parts.names) < set(both.names)
    assert "native_layer_norm" in parts.names
    # Without the guard nothing takes it apart: every observer sees it whole.
    alone = Names(PARTS)
    with torch.inference_mode(), alone:
        torch.nn.functional.layer_norm(x, (3,))
    assert alone.names == ["layer_norm"]


def test_the_guard_judges_the_common_composites_whole_unless_a_cpu_tensor_is_in_them():
    x, w = torch.ones(2, 3), torch.ones(4, 3)
    parts = Names(PARTS)
    with torch.inference_mode():
        with parts, UnsafeOpDetector("cpu", raise_on_unsafe=False) as guard:
            torch.nn.functional.linear(x, w).reshape(8).to(torch.float64)
    assert parts.names == ["linear", "reshape", "to"]  # not taken apart
    assert guard.finding is None
    # Graphing CUDA, a CPU tensor in them is CPU work their parts may hide (a reshape copies).
    parts = Names(PARTS)
    with torch.inference_mode():
        with parts, UnsafeOpDetector("cuda", raise_on_unsafe=False) as guard:
            torch.nn.functional.linear(x, w)
    assert "linear" not in parts.names
    assert guard.finding is not None and guard.finding.operation == CPU_OPERATION


def test_the_guard_finds_a_host_read_inside_a_composite_among_other_observers():
    x = torch.ones(3)
    with torch.inference_mode(), CallWatch(), UnsafeOpDetector("cpu", raise_on_unsafe=True):
        with pytest.raises(GuardError, match=r"bool\(tensor\)"):
            bool(x.any())
    assert modes_on_the_stack() == 0
    assert torch.mul(x, 2).sum().item() == 6.0  # nothing left watching


def test_the_watch_leaves_when_its_last_observer_does():
    first, second = Names(), Names()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # out of order: the mode stays for the other
    assert modes_on_the_stack() == 1
    torch.ones(1) + 1
    second.__exit__(None, None, None)
    assert modes_on_the_stack() == 0
    assert first.names == [] and second.names == ["ones", "add"]


def test_an_observer_left_twice_pops_nothing_more():
    outer, inner = Names(), Names()
    with outer:
        inner.__enter__()
        inner.__exit__(None, None, None)
        inner.__exit__(None, None, None)
        assert modes_on_the_stack() == 1
        torch.ones(1)
    assert outer.names == ["ones"] and modes_on_the_stack() == 0
