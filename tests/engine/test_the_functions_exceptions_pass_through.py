"""A function's own exception comes out of autograph as itself, from every phase, with a note only
where it helps: frozen, attribute-refusing and slotted exceptions, KeyboardInterrupt and
SystemExit, padded runs and captures.
"""

import dataclasses

import pytest
import torch

import autograph
from autograph import _scope
from autograph.backends._cpu_graphs import emulate_graphs_on_cpu, is_emulating

from helpers.modes import modes_on_the_stack
from helpers.raising import capturing, raising_backward_at_capture
from helpers.raising import capturing as _capturing

needs_notes = pytest.mark.skipif(
    not hasattr(Exception, "add_note"), reason="exception notes: Python >= 3.11"
)


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
    fn = autograph.graphed(
        _cache_step(shared), buckets=[4], static_argnames=("cache",), bucket_outputs=0
    )
    cache = torch.zeros(4, 5, device=device)
    for _ in range(3):
        with pytest.raises(ValueError) as raised:
            fn(torch.randn(3, 5, device=device), cache)
        assert raised.value is shared
    assert len(shared.__notes__) == 1


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
    (row,) = train.stats()
    assert (
        row.state == "eager" and "_FrozenError: in the backward's capture" in row.fallback_reason
    ), row.fallback_reason


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


@dataclasses.dataclass(frozen=True)
class _Frozen(Exception):
    what: str


class _RefusesAttributes(Exception):
    def __setattr__(self, name, value):
        raise AttributeError(f"_RefusesAttributes takes no {name}")


class _Slotted(Exception):
    __slots__ = ()


EXCEPTIONS = {
    "frozen dataclass": lambda: _Frozen("x"),
    "__setattr__ raises": lambda: _RefusesAttributes("y"),
    "__slots__": lambda: _Slotted("z"),
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": lambda: SystemExit(3),
    "GeneratorExit": GeneratorExit,
}


def _switch():
    """A flag the test sets between calls: a function's attributes are never a call's state."""

    def switch():
        return None

    switch.on = False
    return switch


def _assert_clean():
    assert modes_on_the_stack() == 0 and _scope.thread.regions == [] and _scope.thread.depth == 0


class _Block(torch.nn.Module):
    def __init__(self, error, switch):
        super().__init__()
        self.lin, self.error, self.switch = torch.nn.Linear(4, 4), error, switch

    def forward(self, x):
        if self.switch.on and _capturing():
            raise self.error
        return self.lin(x)


@torch.compiler.disable
def _raise_in_capture(error, switch):
    if switch.on and _capturing():
        raise error


def _phases(device, error):
    """name -> (a call that raises ``error``, a later call that must work)."""
    x = torch.ones(2, 4, device=device)

    def raising_at_every_call(rows, **options):
        @autograph.graphed(**options)
        def f(x):
            if switch.on:
                raise error
            return x * 2

        switch = _switch()
        switch.on = True
        return lambda: f(rows), lambda: (setattr(switch, "on", False), f(rows))

    def warmup():
        return raising_at_every_call(x)

    def capture():
        @autograph.graphed
        def f(x):
            if switch.on and _capturing():
                raise error
            return x * 2

        switch = _switch()
        f(x)
        switch.on = True
        return lambda: f(x), lambda: (setattr(switch, "on", False), f(x))

    def verify():
        @autograph.graphed(verify=3)
        def f(x):
            if switch.on and not _capturing():
                raise error
            return x * 2

        switch = _switch()
        f(x), f(x)
        switch.on = True
        return lambda: f(x), lambda: (setattr(switch, "on", False), f(x))

    def eager_key():
        @autograph.graphed
        def f(x):
            if switch.on:
                raise error
            return x * float(x.sum().item())  # a host read: the key runs eagerly

        switch = _switch()
        f(x), f(x)
        switch.on = True
        return lambda: f(x), lambda: (setattr(switch, "on", False), f(x))

    def island_capture():
        switch = _switch()
        block = _Block(error, switch).to(device)

        @autograph.graphed
        def f(x):
            y = block(x)
            return y * float(y.sum().item())

        f(x), f(x)
        switch.on = True
        return lambda: [f(x) for _ in range(3)], lambda: (setattr(switch, "on", False), f(x))

    def region_capture():
        switch = _switch()
        block = _Block(error, switch).to(device)
        with torch.no_grad(), autograph.region():
            block(x), block(x)  # a plain call and the watched warmup: the next one captures
        switch.on = True

        def call():
            with torch.no_grad(), autograph.region():
                block(x)

        return call, lambda: (setattr(switch, "on", False), call())

    def padded_warmup():
        return raising_at_every_call(torch.ones(3, 2, device=device), buckets=[4])

    def ahead_per_bucket():
        @autograph.graphed(buckets=[2, 4], static_argnames=("cache",), bucket_outputs=0)
        def f(x, cache):
            if switch.on and cache.shape[0] == 2:
                raise error
            return x * 2

        switch = _switch()
        switch.on = True
        return (
            lambda: f.capture(
                torch.ones(3, 2, device=device),
                autograph.per_bucket(lambda n: torch.zeros(n, device=device)),
            ),
            lambda: (
                setattr(switch, "on", False),
                f(torch.ones(3, 2, device=device), torch.zeros(4, device=device)),
            ),
        )

    def training_forward_capture():
        w = torch.ones(4, device=device, requires_grad=True)

        @autograph.graphed
        def f(x, w):
            if switch.on and _capturing():
                raise error
            return (x * w).sum()

        switch = _switch()
        f(x, w).backward()
        switch.on = True
        return lambda: f(x, w), lambda: (setattr(switch, "on", False), f(x, w).backward())

    def compiled_capture():
        switch = _switch()
        compiled = torch.compile(
            lambda x: (_raise_in_capture(error, switch), x * 2)[1], backend="eager"
        )

        @autograph.graphed
        def f(x):
            return compiled(x)

        f(x)
        switch.on = True
        return lambda: f(x), lambda: (setattr(switch, "on", False), f(x))

    return {
        name: phase
        for name, phase in locals().items()
        if callable(phase) and name not in ("x", "error", "device")
    }


PHASES = [
    "warmup",
    "capture",
    "verify",
    "eager_key",
    "island_capture",
    "region_capture",
    "padded_warmup",
    "ahead_per_bucket",
    "training_forward_capture",
    "compiled_capture",
]


# As a Ctrl-C arriving during the backward's capture.
_InterruptedBackward = raising_backward_at_capture(KeyboardInterrupt)


# The eager-key and island phases make their keys eager on purpose (a host read).
@pytest.mark.filterwarnings("ignore::autograph.AutographWarning")
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kind", list(EXCEPTIONS))
def test_the_functions_exception_comes_out_as_itself_from_every_phase(device, phase, kind):
    error = EXCEPTIONS[kind]()
    raising, later = _phases(device, error)[phase]()
    with pytest.raises(BaseException) as raised:
        raising()
    assert raised.value is error, repr(raised.value)
    _assert_clean()
    later()  # later calls work
    _assert_clean()


def test_the_emulation_class_reused_as_a_decorator_and_a_block_under_exceptions():
    emulation = emulate_graphs_on_cpu()

    @emulation
    def depth(n, error=None):
        if n == 0 and error is not None:
            raise error
        return [is_emulating()] + (depth(n - 1, error) if n else [])

    assert depth(2) == [True] * 3 and not is_emulating()
    error = _Frozen("deep")
    with pytest.raises(_Frozen) as raised:
        depth(3, error)
    assert raised.value is error and not is_emulating()
    with emulation:  # the same object as a block, the decorated function inside it
        assert depth(1) == [True, True] and is_emulating()
    assert not is_emulating() and emulation._before == []


def test_a_keyboard_interrupt_during_a_padded_capture_comes_out(device):
    @autograph.graphed(buckets=[4])
    def f(x):
        if _capturing():
            raise KeyboardInterrupt  # as a Ctrl-C arriving during the capture's run
        return x * 2

    rows = torch.ones(3, 2, device=device)
    f(rows)  # the warmup
    try:
        with pytest.raises(KeyboardInterrupt):
            f(rows)
    finally:
        _assert_clean()
    assert [s.state for s in f.stats()] != ["eager"], f.stats()


def test_a_keyboard_interrupt_during_a_backward_capture_comes_out(device):
    @autograph.graphed
    def train(x, w):
        return _InterruptedBackward.apply(x * w).sum()

    x, w = torch.ones(3, device=device), torch.ones(3, device=device, requires_grad=True)
    train(x, w).backward()  # the warmup
    try:
        with pytest.raises(KeyboardInterrupt):
            train(x, w).backward()
    finally:
        _assert_clean()
