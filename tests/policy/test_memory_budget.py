"""``max_graph_memory=``: a function's graphs held within a memory budget, the least recently
replayed dropped first (issue 38)."""

import pytest
import torch

import autograph
from autograph.policy._memory_budget import MAX_EVICTIONS


def _held(fn):
    return sum(r.graph_bytes for r in fn.stats() if r.state == "graphed")


@pytest.mark.filterwarnings("ignore::autograph.AutographWarning")  # keys that thrash go eager
def test_a_long_run_of_40_shapes_stays_within_the_budget_with_no_wrong_result(device):
    features, rows_per_step = (64, 1) if device == "cpu" else (1024, 64)
    w = torch.randn(features, features, device=device)

    def f(x):
        return torch.relu(x @ w) + 1

    def x_of(i):
        return torch.randn(rows_per_step * (i + 1), features, device=device)

    # the memory of the largest shape's graph, measured by the same figure the budget uses
    probe = autograph.graphed(f)
    for _ in range(2):
        probe(x_of(39))
    largest = probe.stats()[0].graph_bytes
    assert largest > 0
    budget = 4 * largest
    fn = autograph.graphed(f, max_graphs=64, max_graph_memory=budget, check_payoff=False)
    wrong, peak = 0, 0
    for _ in range(3):  # the third round: keys dropped twice already go eager
        for i in range(40):
            for _ in range(3):  # warmup, capture, replay
                x = x_of(i)
                wrong += not torch.allclose(fn(x), torch.relu(x @ w) + 1, atol=1e-4)
                peak = max(peak, _held(fn))
    rows = fn.stats()
    assert wrong == 0 and peak <= budget
    assert sum(r.replays for r in rows) > 40  # graphs were captured and replayed throughout
    assert sum(r.evictions for r in rows) > 0
    # A key dropped past MAX_EVICTIONS runs eagerly, saying why. Whether any key gets there
    # depends on the figure: on CUDA a capture that reuses its pool's freed blocks adds
    # little reserved memory, so fewer graphs are dropped than on the emulation.
    thrashed = [r for r in rows if r.evictions > MAX_EVICTIONS]
    assert all(r.state == "eager" and "max_graph_memory" in r.fallback_reason for r in thrashed)
    if device == "cpu":
        assert thrashed


def _by_rows(fn):
    return {int(r.key.split("[")[1].split(",")[0]): r for r in fn.stats()}


def test_the_least_recently_replayed_graph_goes_first(emulated):
    w = torch.randn(8, 8)
    unbounded = autograph.graphed(lambda x: x @ w)
    for n in (1, 2, 3):
        for _ in range(2):
            unbounded(torch.randn(n, 8))
    bytes_of = {n: r.graph_bytes for n, r in _by_rows(unbounded).items()}
    assert 0 < bytes_of[1] < bytes_of[2] < bytes_of[3]
    budget = bytes_of[1] + bytes_of[3]  # holds 1 and 2, or 1 and 3: not all three
    fn = autograph.graphed(lambda x: x @ w, max_graph_memory=budget)
    for n in (1, 2):
        for _ in range(3):
            fn(torch.randn(n, 8))
    fn(torch.randn(1, 8))  # 1 replayed last: 2 is the least recently replayed
    for _ in range(2):
        fn(torch.randn(3, 8))
    rows = _by_rows(fn)
    assert (rows[1].state, rows[1].evictions) == ("graphed", 0)
    assert (rows[2].state, rows[2].evictions) == ("warmup", 1)  # back to warmup, not eager
    assert rows[3].state == "graphed" and _held(fn) <= budget


def test_a_graph_over_the_whole_budget_runs_eagerly_with_both_figures(emulated):
    fn = autograph.graphed(lambda x: x * 2, max_graph_memory=1)
    x = torch.randn(16, 16)
    for _ in range(3):
        assert torch.equal(fn(x), x * 2)
    (row,) = fn.stats()
    assert row.state == "eager" and "more than max_graph_memory=" in row.fallback_reason


@pytest.mark.parametrize("value", ["512MiB", "1.5GB", 4096, "12kib"])
def test_the_budget_takes_bytes_or_a_string_with_a_unit(value):
    autograph.graphed(lambda x: x, max_graph_memory=value)


@pytest.mark.parametrize("value", ["lots", -1, "12 parsecs", True])
def test_a_budget_that_is_no_size_is_refused_when_the_function_is_graphed(value):
    with pytest.raises(ValueError, match="max_graph_memory="):
        autograph.graphed(lambda x: x, max_graph_memory=value)
