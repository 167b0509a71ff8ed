"""Review 10: hostile tests of this session's commits: a function's own exception comes out of
autograph as itself (9978e94, 3ea1b83), and the guard's naming of ``x[index] = number`` /
``x[mask] = number`` (6577bcc, a684f7a).

The defects it found are fixed in the same session, their tests kept: a Ctrl-C during a padded
capture or a backward's capture was swallowed (made a capture failure, the key eager for
good); ``_number_assigned`` crashed on keyword arguments, named an accumulating index_put_ an
assignment, and named ``masked_fill_(mask, number)`` for a mask over rows, which fills columns.
The rest guard what held: exceptions that refuse attributes, and BaseExceptions, raised in
every phase."""
import dataclasses

import pytest
import torch

import autograph
from autograph import _scope
from autograph.watch._unsafe_ops import unsafe_op
from autograph.backends._cpu_graphs import emulate_graphs_on_cpu, is_emulating
from test_modes import modes_on_the_stack
from test_review_late import capturing as _capturing, raising_backward_at_capture

_aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class _Frozen(Exception):
    what: str


class _RefusesAttributes(Exception):
    def __setattr__(self, name, value):
        raise AttributeError(f"_RefusesAttributes takes no {name}")


class _Slotted(Exception):
    __slots__ = ()


EXCEPTIONS = {"frozen dataclass": lambda: _Frozen("x"),
              "__setattr__ raises": lambda: _RefusesAttributes("y"),
              "__slots__": lambda: _Slotted("z"), "KeyboardInterrupt": KeyboardInterrupt,
              "SystemExit": lambda: SystemExit(3), "GeneratorExit": GeneratorExit}


def _switch():
    """A flag the test sets between calls: a function's attributes are never a call's state."""
    def switch():
        return None
    switch.on = False
    return switch


def _assert_clean():
    assert modes_on_the_stack() == 0 and _scope.thread.regions == [] and \
        _scope.thread.depth == 0


# --- what held: the exception itself, from every phase -------------------------------------

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
            block(x)
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
        return (lambda: f.capture(torch.ones(3, 2, device=device),
                                  autograph.per_bucket(lambda n: torch.zeros(n, device=device))),
                lambda: (setattr(switch, "on", False),
                         f(torch.ones(3, 2, device=device), torch.zeros(4, device=device))))

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
        compiled = torch.compile(lambda x: (_raise_in_capture(error, switch), x * 2)[1],
                                 backend="eager")

        @autograph.graphed
        def f(x):
            return compiled(x)
        f(x)
        switch.on = True
        return lambda: f(x), lambda: (setattr(switch, "on", False), f(x))

    return {name: phase for name, phase in locals().items() if callable(phase)
            and name not in ("x", "error", "device")}


PHASES = ["warmup", "capture", "verify", "eager_key", "island_capture", "region_capture",
          "padded_warmup", "ahead_per_bucket", "training_forward_capture", "compiled_capture"]


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


# --- defects -------------------------------------------------------------------------------

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


# As a Ctrl-C arriving during the backward's capture.
_InterruptedBackward = raising_backward_at_capture(KeyboardInterrupt)


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


def test_number_assigned_takes_keyword_arguments():
    finding = unsafe_op(_aten.index_put_.default, (torch.zeros(4),),
                        {"indices": [torch.tensor([0])], "values": torch.tensor(7.0)}, "cuda")
    assert finding is not None and finding[0] == "computing with a CPU tensor"


def test_the_fix_named_for_a_row_mask_does_what_the_assignment_does():
    """Review 10 found masked_fill_(mask, number) named for any mask: masked_fill_ broadcasts
    the mask from the last dim, so for a mask over rows it filled columns. The fix now says
    how to shape the mask, and the shaped mask does what the assignment does."""
    x = torch.arange(16.0).view(4, 4)
    mask = torch.tensor([True, False, False, False])
    assigned = x.clone()
    assigned[mask] = 0.0
    assert torch.equal(x.clone().masked_fill_(mask[..., None], 0.0), assigned)
    target = torch.empty(4, 4, device="meta")
    for given in (mask, mask.to(torch.uint8)):
        _, consequence = unsafe_op(_aten.index_put_.default,
                                   (target, [given.to("meta")], torch.tensor(0.0)), {}, "cuda")
        assert "bool mask of x's shape" in consequence and "mask[..., None]" in consequence


def test_an_accumulating_index_put_of_a_number_is_not_named_an_assignment():
    target, index = torch.empty(4, device="meta"), torch.tensor([0, 2], device="meta")
    operation, _ = unsafe_op(_aten.index_put_.default,
                             (target, [index], torch.tensor(1.0), True), {}, "cuda")
    assert operation == "computing with a CPU tensor"
