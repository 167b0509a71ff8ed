"""The payoff measurer (autograph/policy/_payoff.py) on its own, with plain numbers for the GPU
clock (on the emulation timings mean nothing), and its CUDA clock on a GPU."""

import io

import pytest
import torch

import autograph
from autograph.backends._cpu_graphs import CPU
from autograph.backends._cuda_graphs import CudaClock
from autograph.policy._payoff import EAGER, EAGER_RUN, GRAPH, REPLAY, Payoff, PendingTimings

from conftest import autograph_warnings, python_run_log, requires_cuda, states


def feed(payoff, replay, eager, rounds):
    """``rounds`` pairs of timed calls, in the turns the payoff asks for."""
    for i in range(2 * rounds):
        run = payoff.next_run()
        payoff.add(run, (replay if run == REPLAY else eager)(i // 2))
    return payoff.verdict


def test_calls_take_turns_between_the_graph_and_eager():
    payoff = Payoff()
    assert [payoff.next_run() for _ in range(4)] == [REPLAY, EAGER_RUN, REPLAY, EAGER_RUN]


def test_a_replay_clearly_faster_keeps_the_graph_after_the_least_samples():
    payoff = Payoff(least=4)
    assert feed(payoff, lambda i: 10e-6, lambda i: 30e-6, rounds=3) is None
    assert feed(payoff, lambda i: 10e-6, lambda i: 30e-6, rounds=1) == GRAPH
    assert payoff.gain() == pytest.approx(3.0)


def test_a_replay_clearly_slower_goes_eager_with_the_figures():
    # A GPU-bound MLP: the graph's output copy costs more than the launches it saves.
    payoff = Payoff(least=4)
    assert feed(payoff, lambda i: 928e-6, lambda i: 880e-6, rounds=4) == EAGER
    assert payoff.figures() == "replay 928 us, eager 880 us (medians of 4 calls each, GPU clock)"
    assert "check_payoff=False" in payoff.reason() and "928 us" in payoff.reason()


def test_within_the_margin_more_samples_are_taken_then_the_medians_decide():
    payoff = Payoff(least=4, most=8, margin=0.03)
    noisy = [1.00, 1.02, 0.99, 1.01, 1.00, 1.02, 0.98, 1.01]
    assert feed(payoff, lambda i: noisy[i] * 1e-3, lambda i: 1.01e-3, rounds=7) is None
    assert feed(payoff, lambda i: noisy[7] * 1e-3, lambda i: 1.01e-3, rounds=1) == GRAPH


def test_one_outlier_does_not_decide():
    payoff = Payoff(least=4)
    eager = [1e-3, 1e-3, 5e-3, 1e-3]  # a context switch in one eager run
    assert feed(payoff, lambda i: 1.2e-3, lambda i: eager[i], rounds=4) == EAGER


def test_the_verdict_is_given_once():
    payoff = Payoff(least=1)
    assert feed(payoff, lambda i: 1e-6, lambda i: 2e-6, rounds=1) == GRAPH
    assert feed(payoff, lambda i: 9e-6, lambda i: 2e-6, rounds=20) == GRAPH


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="least"):
        Payoff(least=5, most=4)


class StepClock:
    """A clock whose timings finish when the test says so."""

    def __init__(self):
        self.done = set()

    def ready(self, timing):
        return timing[0] in self.done

    def seconds(self, timing):
        return timing[1]


def test_pending_timings_reach_the_payoff_in_order_once_finished_without_waiting():
    clock, payoff = StepClock(), Payoff(least=1)
    pending = PendingTimings(clock)
    pending.add(REPLAY, (1, 1e-6))
    pending.add(EAGER_RUN, (2, 3e-6))
    clock.done.add(2)  # the later one finished first: nothing is read out of order
    assert pending.collect(payoff) is None and payoff.replays == []
    clock.done.add(1)
    assert pending.collect(payoff) == GRAPH and pending.pending == []


@pytest.mark.cuda
@requires_cuda
def test_the_cuda_clock_times_gpu_work_from_an_idle_stream():
    clock = CudaClock()
    x = torch.randn(2048, 2048, device="cuda")
    timing = clock.start()
    for _ in range(10):
        x = x @ x.T / 2048
    clock.stop(timing)
    torch.cuda.synchronize()
    assert clock.ready(timing) and clock.seconds(timing) > 0


# ---- through the engine, on the emulation, with a clock the test controls ----


class PythonRunsClock:
    """Times a call as ``eager`` seconds if the function's Python ran during it (an eager
    run), else as ``replay`` seconds (a replay runs no Python): the engine's payoff logic,
    driven by timings a test chooses, told apart by what really ran."""

    def __init__(self, python_runs, replay, eager):
        self.python_runs, self.replay, self.eager = python_runs, replay, eager

    def start(self, stream=None):
        return [len(self.python_runs.runs), None]

    def stop(self, timing, stream=None):
        timing[1] = len(self.python_runs.runs)
        return timing

    @staticmethod
    def ready(timing):
        return timing[1] is not None

    def seconds(self, timing):
        return self.eager if timing[1] != timing[0] else self.replay


def graphed_counting(python_runs, **options):
    @autograph.graphed(**options)
    def f(x):
        python_runs()  # counted out of the call's reach (conftest)
        return x * 2 + 1

    return f


@pytest.fixture
def payoff_clock(emulated, monkeypatch):
    """Sets the emulation's payoff clock: returns a function making one with given timings."""

    def use(replay, eager):
        python_runs = python_run_log()
        monkeypatch.setattr(CPU, "clock", PythonRunsClock(python_runs, replay, eager))
        return python_runs

    return use


def test_a_key_whose_replay_is_slower_than_eager_goes_eager_said_once_with_figures(
    payoff_clock, caught
):
    python_runs = payoff_clock(replay=2e-3, eager=1e-3)
    f, g = graphed_counting(python_runs), None
    x = torch.arange(4.0)
    outputs = [f(x) for _ in range(20)]
    assert all(torch.equal(o, x * 2 + 1) for o in outputs)
    ((state, calls, eager_calls, replays),) = states(f)
    # warmup, capture (a replay), then 4 replays and 4 eager runs take turns; the 11th call
    # reads the verdict and every later call runs eagerly.
    assert (state, calls, replays, eager_calls) == ("eager", 20, 1 + 4, 1 + 4 + 10)
    (row,) = f.stats()
    assert row.gain == pytest.approx(0.5)
    assert "replay 2 ms, eager 1 ms (medians of 4 calls each" in row.fallback_reason
    assert "check_payoff=False" in row.fallback_reason
    messages = autograph_warnings(caught)
    assert len(messages) == 1 and "does not beat its eager run" in messages[0]
    # A second key of the same function that does not pay either is not said again.
    g = [f(torch.arange(8.0)) for _ in range(12)]
    assert [r.state for r in f.stats()] == ["eager", "eager"]
    assert len(autograph_warnings(caught)) == 1 and torch.equal(g[-1], torch.arange(8.0) * 2 + 1)


def test_a_key_whose_replay_beats_eager_keeps_its_graph_and_shows_its_gain(payoff_clock):
    python_runs = payoff_clock(replay=1e-3, eager=3e-3)
    f = graphed_counting(python_runs)
    x = torch.arange(4.0)
    assert all(torch.equal(f(x), x * 2 + 1) for _ in range(30))
    assert states(f) == [("graphed", 30, 1 + 4, 1 + 4 + 20)]
    assert f.stats()[0].gain == pytest.approx(3.0)
    text = io.StringIO()
    autograph.report(f, file=text)
    assert "gain" in text.getvalue() and "3.00x" in text.getvalue()


def test_within_the_margin_more_samples_are_taken_and_a_tie_goes_eager(payoff_clock, caught):
    python_runs = payoff_clock(replay=1e-3, eager=1e-3)
    f = graphed_counting(python_runs)
    for _ in range(40):
        f(torch.ones(2))
    assert states(f) == [("eager", 40, 1 + 16 + 40 - 34, 1 + 16)]


def test_check_payoff_false_keeps_every_graph_unmeasured(payoff_clock):
    python_runs = payoff_clock(replay=2e-3, eager=1e-3)
    f = graphed_counting(python_runs, check_payoff=False)
    for _ in range(10):
        f(torch.ones(2))
    assert states(f) == [("graphed", 10, 1, 9)] and f.stats()[0].gain is None


def test_verify_checks_come_before_the_payoff_is_measured(payoff_clock):
    python_runs = payoff_clock(replay=1e-3, eager=3e-3)
    f = graphed_counting(python_runs, verify=3)
    for _ in range(20):
        f(torch.ones(2))
    (row,) = f.stats()
    assert (row.state, row.verified, row.gain) == ("graphed", 3, pytest.approx(3.0))
    assert row.eager_calls == 1 + 4


def test_the_emulation_never_judges_keys_by_its_timings(emulated):
    python_runs = python_run_log()
    f = graphed_counting(python_runs)
    for _ in range(10):
        f(torch.ones(2))
    assert states(f) == [("graphed", 10, 1, 9)] and f.stats()[0].gain is None
    assert len(python_runs.runs) == 2  # the warmup and the capture's run of the Python


def test_check_payoff_must_be_a_bool():
    with pytest.raises(ValueError, match="check_payoff='no'"):
        autograph.graphed(check_payoff="no")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.payoff
def test_on_cuda_a_gpu_bound_key_is_measured_and_gets_a_verdict():
    # Big matmuls: the GPU's work dwarfs the launches a graph saves, so either verdict may
    # come; what must hold is that one comes, from real CUDA timings, and results stay right.
    w = torch.randn(4096, 4096, device="cuda")

    @autograph.graphed
    def f(x):
        return (x @ w).relu() @ w

    x = torch.randn(4096, 4096, device="cuda")
    expected = (x @ w).relu() @ w
    for i in range(80):
        out = f(x)
        if i % 8 == 7:  # let the GPU catch up: timings are read once their events passed
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    assert torch.allclose(out, expected, rtol=1e-3, atol=1e-3)
    (row,) = f.stats()
    assert row.gain is not None and row.state in ("graphed", "eager")
    assert (row.state == "eager") == (row.gain <= 1), row


def _launch_bound(x):
    for _ in range(50):
        x = x * 1.0001 + 0.0001
    return x


@requires_cuda
@pytest.mark.cuda
@pytest.mark.payoff
@pytest.mark.parametrize("queued_ms", [0, 2], ids=["host waits", "host runs ahead"])
def test_on_cuda_a_launch_bound_key_keeps_its_graph(queued_ms):
    # "host runs ahead": a loop that never waits for the GPU, 2 ms of GPU work queued before
    # each call. Timed from where the host left the stream, an eager run's 50 kernels were
    # all queued before the GPU reached them and ran back to back, as fast as the graph's:
    # the graph, which saves the host 50 launches per call, looked useless.
    f = autograph.graphed(_launch_bound)
    x = torch.ones(16, device="cuda")
    cycles = int(queued_ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    for _ in range(60):
        if cycles:
            torch.cuda._sleep(cycles)
        out = f(x)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _launch_bound(x))
    (row,) = f.stats()
    assert row.state == "graphed" and row.gain > 2, row


def test_a_key_whose_graph_does_not_pay_gets_no_island(payoff_clock, caught):
    # Its module calls' graphs would save less than its own graph did (benchmark (n): a
    # GPU-bound MLP whose island graphed its layers ran 1.37x slower than eager)
    python_runs = payoff_clock(replay=2e-3, eager=1e-3)
    layer = torch.nn.Linear(4, 4).requires_grad_(False)

    @autograph.graphed
    def f(x):
        python_runs()
        return layer(x) * 2

    x = torch.ones(3, 4)
    for _ in range(20):
        torch.testing.assert_close(f(x), layer(x) * 2)
    rows = f.stats()
    assert [r.state for r in rows] == ["eager"] and rows[0].gain == pytest.approx(0.5)
    assert not any(" > " in r.function for r in rows)  # no island's rows
