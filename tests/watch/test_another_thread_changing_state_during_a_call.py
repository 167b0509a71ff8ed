"""Known limits, each a strict xfail until fixed (docs/guide/limits.md, "Thread safety"):
another thread changing what a call reads while it replays or captures, and autograph's own
bookkeeping changing another thread's state. Found by helper-5's thread audit; each race made
deterministic by pausing one thread inside its window (``threading.Event``), on the CPU
emulation."""

import threading

import pytest
import torch
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

import autograph
from autograph.testing import emulate_graphs_on_cpu

_armed, _entered, _go_on = threading.Event(), threading.Event(), threading.Event()


def _gate():
    # A function: never walked as a call's state. Pauses the armed call once.
    if _armed.is_set():
        _armed.clear()
        _entered.set()
        _go_on.wait(10)


def _reset_gates():
    for e in (_armed, _entered, _go_on):
        e.clear()


@pytest.mark.xfail(
    strict=True,
    reason="known: registration hooks run before the parameter is stored",
)
def test_a_weight_replaced_while_another_thread_replays_is_seen():
    with emulate_graphs_on_cpu():
        torch.manual_seed(0)
        m = autograph.graphed(torch.nn.Linear(8, 8), warmup=1)
        x = torch.randn(4, 8)
        with torch.no_grad():
            m(x), m(x), m(x)  # graphed; its slot watch installs the registration hooks
        assert autograph.stats(m)[0].state == "graphed"
        old = m.weight  # an optimizer holds it
        new = torch.nn.Parameter(torch.randn(8, 8))
        entered, go_on = threading.Event(), threading.Event()

        def user_hook(module, name, param):
            if threading.current_thread() is swapper:
                entered.set()
                go_on.wait(10)

        handle = _module.register_module_parameter_registration_hook(user_hook)

        def swap():
            m.weight = new

        swapper = threading.Thread(target=swap)
        try:
            swapper.start()
            assert entered.wait(10)
            with torch.no_grad():
                m(x)  # a request meanwhile: checks the slots (the old weight is still there)
            go_on.set()
            swapper.join(10)
        finally:
            handle.remove()
        assert m.weight is new
        with torch.no_grad():
            got = m(x)  # a later request
        autograph.reset()
        del old
        torch.testing.assert_close(got, torch.nn.functional.linear(x, new, m.bias))


def _assert_the_hook_doubles(m, x):
    """A later call of ``m`` runs the forward hook (``out * 2``) added to ``m.inner``."""
    with torch.no_grad():
        got = m(x)
    autograph.reset()
    w, b = m.inner.weight, m.inner.bias
    torch.testing.assert_close(got, 2 * torch.nn.functional.linear(x, w, b))


class Wrapper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.inner(x)


@pytest.mark.xfail(
    strict=True,
    reason="known: a hook handle takes its id before the hook is stored",
)
def test_a_hook_added_while_another_thread_replays_runs_at_later_calls():
    # register_forward_hook makes its RemovableHandle (next_id += 1) before it stores the
    # hook: a replay's HookWatch.compare() in between finds the ids unchanged and takes the
    # new next_id as seen. The pause stands in for a thread switch there (a wrapper of
    # RemovableHandle.__init__, test instrumentation only).

    with emulate_graphs_on_cpu():
        torch.manual_seed(0)
        m = autograph.graphed(Wrapper(), warmup=1)
        x = torch.randn(4, 8)
        with torch.no_grad():
            m(x), m(x), m(x)
        entered, go_on = threading.Event(), threading.Event()
        original = RemovableHandle.__init__

        def paused(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if threading.current_thread() is adder:
                entered.set()
                go_on.wait(10)

        adder = threading.Thread(
            target=lambda: m.inner.register_forward_hook(lambda mod, i, out: out * 2)
        )
        RemovableHandle.__init__ = paused
        try:
            adder.start()
            assert entered.wait(10)
            with torch.no_grad():
                m(x)  # a request meanwhile
            go_on.set()
            adder.join(10)
        finally:
            RemovableHandle.__init__ = original
        _assert_the_hook_doubles(m, x)


class Gated(torch.nn.Linear):
    def forward(self, x):
        out = torch.nn.functional.linear(x, self.weight, self.bias)
        _gate()  # the capture has recorded the op reading self.weight
        return out


def _capture_in_a_thread(m, x, change):
    _reset_gates()
    errors = []

    def calls():
        try:
            with torch.no_grad():
                m(x)  # warmup (watched)
                _armed.set()
                m(x)  # the capture: pauses inside
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=calls)
    t.start()
    assert _entered.wait(10)
    change()  # another thread, while the capture is under way
    _go_on.set()
    t.join(10)
    assert errors == []


@pytest.mark.xfail(
    strict=True, reason="known: the slot watch starts at the end of the capture, not its start"
)
def test_a_parameter_replaced_during_anothers_capture_is_used_by_later_calls():
    with emulate_graphs_on_cpu():
        torch.manual_seed(0)
        m = autograph.graphed(Gated(8, 8), warmup=1)
        x = torch.randn(4, 8)
        old = m.weight  # held elsewhere (an optimizer, an EMA): it stays alive
        new = torch.nn.Parameter(torch.randn(8, 8))

        def swap():
            m.weight = new

        _capture_in_a_thread(m, x, swap)
        with torch.no_grad():
            got = m(x)
        autograph.reset()
        torch.testing.assert_close(got, torch.nn.functional.linear(x, new, m.bias))
        del old


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)

    def forward(self, x):
        out = self.inner(x)
        _gate()  # the capture has run the submodule's call, hooks and all
        return out


@pytest.mark.xfail(
    strict=True, reason="known: the hook watch starts at the end of the capture, not its start"
)
def test_a_forward_hook_added_during_anothers_capture_runs_at_later_calls():
    with emulate_graphs_on_cpu():
        torch.manual_seed(0)
        m = autograph.graphed(Outer(), warmup=1)
        x = torch.randn(4, 8)

        def hook():
            m.inner.register_forward_hook(lambda mod, inp, out: out * 2)

        _capture_in_a_thread(m, x, hook)
        _assert_the_hook_doubles(m, x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        _gate()
        return self.lin(x)


@pytest.mark.xfail(
    strict=True,
    reason="known: capture(plan=) sets the plan's training flags on the module while it captures",
)
def test_a_warm_restart_leaves_other_threads_calls_in_their_mode(tmp_path):
    _reset_gates()
    with emulate_graphs_on_cpu():
        m = autograph.graphed(Net(), warmup=1)
        x = torch.randn(4, 8)
        m.train()  # a plan whose key was captured in train mode (e.g. a step's forward)
        with torch.no_grad():
            for _ in range(3):
                m(x)
        path = tmp_path / "plan.json"
        assert m.forward.save_plan(path) == 1
        autograph.reset(m)
        m.eval()  # this process serves in eval mode
        errors = []

        def warm_restart():
            try:
                _armed.set()
                m.forward.capture(plan=path)  # pauses in its warmup
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=warm_restart)
        t.start()
        assert _entered.wait(10)
        ones = torch.ones(1000)
        served = m.drop(ones)  # a request thread uses the eval model meanwhile
        flags = [mod.training for mod in m.modules()]
        _go_on.set()
        t.join(10)
        autograph.reset()
        assert errors == []
        assert torch.equal(served, ones), f"{int((served == 0).sum())} of 1000 dropped"
        assert flags == [False, False, False], flags


def step(x):
    y = x * 2 + 1
    _gate()
    return y


@pytest.mark.xfail(
    strict=True, reason="known: a verified call puts the default generators back as it found them"
)
def test_another_threads_draws_are_not_taken_back_by_a_verified_call():
    _reset_gates()
    with emulate_graphs_on_cpu():
        f = autograph.graphed(step, warmup=1, verify=1, check_payoff=False)
        x = torch.randn(4)
        f(x), f(x)  # warmup, capture: verify checks the next replay
        errors = []

        def checked():
            try:
                _armed.set()
                f(x)  # verify's eager run pauses inside
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=checked)
        t.start()
        assert _entered.wait(10)
        first = torch.rand(4)  # a request thread samples meanwhile
        _go_on.set()
        t.join(10)
        second = torch.rand(4)  # its next sample
        autograph.reset()
        assert errors == []
        assert not torch.equal(first, second), "the generator was rewound: the same numbers again"
