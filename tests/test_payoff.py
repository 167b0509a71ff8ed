"""The payoff measurer (autograph/_payoff.py) on its own, with plain numbers for the GPU
clock (on the emulation timings mean nothing), and its CUDA clock on a GPU."""
import pytest
import torch

from autograph._payoff import EAGER, EAGER_RUN, GRAPH, REPLAY, CudaClock, Payoff, PendingTimings
from conftest import requires_cuda


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
def test_the_cuda_clock_times_gpu_work_without_synchronising():
    clock = CudaClock()
    x = torch.randn(2048, 2048, device="cuda")
    timing = clock.start()
    for _ in range(10):
        x = x @ x.T / 2048
    clock.stop(timing)
    torch.cuda.synchronize()
    assert clock.ready(timing) and clock.seconds(timing) > 0
