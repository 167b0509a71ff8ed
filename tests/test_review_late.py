"""Review 9: hostile tests of the session's last engine commits: the split op's parts run under a
mode of their own (``OpWatch.parts``), the Python-state survey asking a slot's class once, the
first replay at a row count in one step (``Padding.runs_as_called``), and the note a padded
run's exception gets (``_bucket_runs._say_it_ran_padded``).

The three defects found (a note that replaced the exception, notes piling up, a fresh NaN
in a tuple) failed before their fixes; the rest guard what held."""
import dataclasses
import math

import pytest
import torch
import wrapt

import autograph
from autograph.watch._guard import UnsafeOpDetector
from autograph.watch._modes import BOTH, PARTS, WHOLE
from autograph.watch._python_state import PythonState
from autograph.watch._reads import CallWatch
from autograph.watch._size_reads import NumbersOf
from autograph.watch._undo import UndoWrites
from conftest import states
from test_modes import Names, modes_on_the_stack

needs_notes = pytest.mark.skipif(not hasattr(Exception, "add_note"),
                                 reason="exception notes: Python >= 3.11")


# --- OpWatch.parts: a split op's parts under a mode of the observers that see parts ---------

def test_nested_composites_under_inference_mode_each_observer_sees_each_op_once():
    # instance_norm -> batch_norm -> _batch_norm_impl_index -> native_batch_norm: composites
    # whose parts are composites, taken apart by the guard among all three kinds of observers.
    x, external = torch.randn(2, 3, 5), torch.randn(5)
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    whole, parts, both, numbers = Names(WHOLE), Names(PARTS), Names(BOTH), {}
    with torch.inference_mode():
        with UndoWrites() as undo, whole, CallWatch() as watch, NumbersOf(numbers, 2), \
                parts, both, UnsafeOpDetector("cpu", raise_on_unsafe=False) as guard:
            assert modes_on_the_stack() == 1
            y = torch.nn.functional.instance_norm(x, running_mean, running_var,
                                                  use_input_stats=True, momentum=0.5)
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


# A composite op of Python's: its kernel runs between the parts, where an observer can join.
_LIBRARY = torch.library.Library("autograph_review9", "DEF")
_LIBRARY.define("twice(Tensor x) -> Tensor")
_INNER_SAW = []


def _twice(x):
    with Names(WHOLE) as inner:
        y = x * 2
    _INNER_SAW.append(inner.names)
    return y


_LIBRARY.impl("twice", _twice, "CompositeImplicitAutograd")


def test_an_observer_that_joins_and_leaves_inside_a_split_op_leaves_the_stack_clean():
    _INNER_SAW.clear()
    x = torch.ones(3)
    whole, parts = Names(WHOLE), Names(PARTS)
    with torch.inference_mode():
        with whole, parts, UnsafeOpDetector("cpu", raise_on_unsafe=False) as guard:
            y = torch.ops.autograph_review9.twice(x)
            assert modes_on_the_stack() == 1
            y + 1
    assert modes_on_the_stack() == 0 and guard.finding is None
    assert whole.names == ["twice", "add"] and parts.names == ["mul", "add"]
    assert _INNER_SAW == [["mul"]]  # joined the parts' watch for the part it ran
    assert torch.equal(y, torch.full((3,), 2.0))


# --- The Python-state survey: the class asked once ----------------------------------------

class _Holder:
    pass


class _CountsItsReads:
    """An object whose attribute reads have a side effect (they are counted elsewhere)."""
    reads = [0]

    def __getattribute__(self, name):
        type(self).reads[0] += 1
        return object.__getattribute__(self, name)


def test_the_survey_sees_through_proxies_and_odd_objects_as_before():
    # At 4099a33 (before the class was asked once) the same changes were found.
    inner, obj, odd = [1, 2], _Holder(), _CountsItsReads()
    obj.x, odd.x = 1, 1
    module = torch.nn.Linear(2, 2)
    module.count = 0
    holder = _Holder()
    holder.proxied_list, holder.inner = wrapt.ObjectProxy(inner), inner
    holder.proxied_obj, holder.odd = wrapt.ObjectProxy(obj), odd
    holder.module = wrapt.ObjectProxy(module)
    holder.atoms = (1, 2.0, "a", (3, None))
    holder.frozen = frozenset({1, 2})
    holder.same_int = wrapt.ObjectProxy(3)
    holder.ignored = (wrapt.ObjectProxy(math), wrapt.ObjectProxy(len))
    state = PythonState.of([("h", holder)])
    inner.append(3)
    obj.x, odd.x, module.count = 2, 2, 1
    holder.atoms, holder.frozen = (1, 2.0, "a", (3, 4)), frozenset({1, 3})
    holder.same_int = wrapt.ObjectProxy(3)
    assert state.changes() == [
        "h.proxied_list: length 2 -> 3", "h.inner: length 2 -> 3", "h.proxied_obj.x: 1 -> 2",
        "h.odd.x: 1 -> 2", "h.module.count: 0 -> 1",
        "h.atoms: (1, 2.0, 'a', (3, None)) -> (1, 2.0, 'a', (3, 4))",
        "h.frozen: frozenset({1, 2}) -> frozenset({1, 3})"]


def test_a_tuple_holding_a_fresh_nan_is_no_change():
    holder = _Holder()
    holder.last, holder.alone = (float("nan"), 1), float("nan")
    state = PythonState.of([("h", holder)])
    holder.last, holder.alone = (float("nan"), 1), float("nan")
    assert state.changes() == []


# --- Padding.runs_as_called and _first_replay_at_rows ------------------------------------

def test_counts_add_up_with_verify_buckets_and_capture_ahead(device):
    w = torch.randn(5, 5, device=device)

    def step(x):
        return torch.tanh(x @ w) + 1

    fn = autograph.graphed(step, buckets=[4, 8], verify=2)
    fn.capture(torch.randn(8, 5, device=device))
    rows = [3, 3, 4, 2, 3, 7, 8, 5, 5, 1, 6, 8]
    for r in rows:
        x = torch.randn(r, 5, device=device)
        torch.testing.assert_close(fn(x), step(x))
    stats = {s.bucket: s for s in fn.stats()}
    assert sorted(stats) == [4, 8]
    for bucket, s in stats.items():
        assert s.state == "graphed" and s.eager_calls == 0
        assert s.calls == s.replays == sum(1 for r in rows if r <= bucket and
                                           (bucket == 4 or r > 4))
        assert s.verified >= 2  # verify=2 checked its first two, the padded checks aside
    assert [st for st, *_ in states(fn)] == ["graphed", "graphed"]


# --- _say_it_ran_padded: the note on a padded run's exception ----------------------------

@dataclasses.dataclass(frozen=True)
class _FrozenError(Exception):
    """A frozen dataclass exception, as some libraries define theirs: no attribute can be set
    on it, ``__notes__`` included."""
    what: str


def _cache_step(error):
    """A step with per-bucket state (the cache, by address) that raises ``error``: a
    callable that makes the exception, or one exception object raised again at each call."""
    def step(x, cache):
        cache[: x.shape[0]] += x
        raise error if isinstance(error, BaseException) else error()
    return step


@needs_notes
def test_a_padded_run_raises_the_functions_own_exception_even_if_it_takes_no_note(device):
    step = _cache_step(lambda: _FrozenError("the cache is full"))
    with pytest.raises(_FrozenError):  # eager
        step(torch.randn(3, 5, device=device), torch.zeros(4, 5, device=device))
    fn = autograph.graphed(step, buckets=[4], static_argnames=("cache",), bucket_outputs=0)
    with pytest.raises(_FrozenError):
        fn(torch.randn(3, 5, device=device), torch.zeros(4, 5, device=device))


@needs_notes
def test_an_exception_raised_again_at_each_call_carries_the_note_once(device):
    shared = ValueError("the cache is full")
    fn = autograph.graphed(_cache_step(shared), buckets=[4], static_argnames=("cache",),
                           bucket_outputs=0)
    cache = torch.zeros(4, 5, device=device)
    for _ in range(3):
        with pytest.raises(ValueError) as raised:
            fn(torch.randn(3, 5, device=device), cache)
        assert raised.value is shared
    assert len(shared.__notes__) == 1


def capturing():
    try:
        return torch.cuda.is_current_stream_capturing()  # the emulation says True too
    except RuntimeError:  # a CPU-only build of torch, outside a recording
        return False


def raising_backward_at_capture(make_error):
    """An autograd Function doubling its input whose backward raises ``make_error()`` while
    a capture runs it (and only then)."""
    class RaisingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            if capturing():
                raise make_error()
            return grad * 2
    return RaisingBackward


def test_an_exception_that_takes_no_traceback_comes_out_of_a_capture_as_it_is(device):
    """Forward and backward captures: the context managers around the function's run let its
    exception through untouched (a generator one set its __traceback__, FrozenInstanceError)."""
    @autograph.graphed
    def step(x):
        if capturing():
            raise _FrozenError("in the capture")
        return x * 2

    x = torch.ones(3, device=device)
    assert torch.equal(step(x), x * 2)  # the warmup
    for _ in range(2):  # the capture raises the function's exception; the next call retries
        with pytest.raises(_FrozenError):
            step(x)
    assert [s.state for s in step.stats()] == ["warmup"]

    raising = raising_backward_at_capture(lambda: _FrozenError("in the backward's capture"))

    @autograph.graphed
    def train(x, w):
        return raising.apply(x * w).sum()

    w = torch.ones(3, device=device, requires_grad=True)
    with pytest.warns(autograph.AutographWarning, match="its backward .* could not be captured"):
        for _ in range(3):
            train(x, w).backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 6.0, device=device))
    row, = train.stats()
    assert row.state == "eager" and "_FrozenError: in the backward's capture" in \
        row.fallback_reason, row.fallback_reason


@needs_notes
def test_a_keyboard_interrupt_in_a_padded_run_gets_no_note_and_passes_through(device):
    def step(x, cache):
        cache[: x.shape[0]] += x
        raise KeyboardInterrupt

    fn = autograph.graphed(step, buckets=[4], static_argnames=("cache",), bucket_outputs=0)
    with pytest.raises(KeyboardInterrupt) as raised:
        fn(torch.randn(3, 5, device=device), torch.zeros(4, 5, device=device))
    assert not hasattr(raised.value, "__notes__")
    assert modes_on_the_stack() == 0
