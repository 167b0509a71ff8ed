"""Padding telemetry of a bucketed function: per bucket its calls, real rows and pad rows in
``stats()`` and ``report()``, and ``suggest_buckets(max_graphs=k)``'s capture sizes (issue 38)."""

import itertools

import pytest
import torch

import autograph
from autograph.buckets._suggest import best_buckets, padding_share


def _served(device, sizes, buckets=(4, 8)):
    step = autograph.graphed(lambda x: x * 2, buckets=list(buckets))
    for n in sizes:
        x = torch.randn(n, 3, device=device)
        assert torch.equal(step(x), x * 2)
    return step


def test_stats_count_each_buckets_real_and_pad_rows(device):
    # by hand: bucket 4 gets 3, 3, 3, 4, 2 -> real 15, pad 1+1+1+0+2 = 5, of 20 rows run;
    # bucket 8 gets 5, 8, 8, 6 -> real 27, pad 3+0+0+2 = 5, of 32 rows run
    step = _served(device, [3, 3, 3, 4, 2, 5, 8, 8, 6])
    rows = {r.bucket: r for r in step.stats()}
    four, eight = rows[4], rows[8]
    assert four.state == eight.state == "graphed" and four.replays >= 3 and eight.replays >= 2
    assert (four.calls, four.real_rows, four.padded_rows) == (5, 15, 5)
    assert (eight.calls, eight.real_rows, eight.padded_rows) == (4, 27, 5)
    assert four.padding_share == pytest.approx(5 / 20)
    assert eight.padding_share == pytest.approx(5 / 32)


def test_report_shows_the_padding_share_and_rows(device, capsys):
    step = _served(device, [3, 3, 3, 4, 2])
    autograph.report(step)
    line = next(line for line in capsys.readouterr().out.splitlines() if "graphed" in line)
    assert "25% 5/20" in line


def test_suggest_buckets_minimises_pad_rows_within_k_graphs(device):
    # sizes seen: 3 x5, 5 x1, 7 x4, 8 x1. Two graphs, by hand: {3, 8}: 5->8 (3) + 7->8 (1 x4)
    # = 7 pad rows; {5, 8}: 3->5 (2 x5) + 7->8 (4) = 14; {7, 8}: 3->7 (4 x5) + 5->7 (2) = 22.
    # The best is {3, 8}: 7 pad rows of 56 real + 7 = 63 rows run.
    step = _served(device, [3] * 5 + [5] + [7] * 4 + [8])
    assert any(r.state == "graphed" and r.replays for r in step.stats())
    suggestion = step.suggest_buckets(max_graphs=2)
    assert suggestion.buckets == [3, 8] and suggestion.calls == 11
    assert suggestion.padding_share == pytest.approx(7 / 63, abs=1e-4)
    # the current buckets [4, 8]: 3->4 (1 x5), 5->8 (3), 7->8 (1 x4) = 12 of 68
    assert suggestion.current == [4, 8]
    assert suggestion.current_padding_share == pytest.approx(12 / 68, abs=1e-4)
    assert step.suggest_buckets(max_graphs=4).padding_share == 0  # one graph per size seen


def test_suggest_buckets_says_what_is_missing(emulated):
    step = autograph.graphed(lambda x: x * 2, buckets=[4, 8])
    with pytest.raises(ValueError, match="no bucketed calls seen yet"):
        step.suggest_buckets(max_graphs=2)
    with pytest.raises(ValueError, match="max_graphs=0"):
        step.suggest_buckets(max_graphs=0)


def _pad_rows(histogram, buckets):
    ordered = sorted(buckets)
    return sum((next(b for b in ordered if b >= s) - s) * n for s, n in histogram.items())


def test_the_programme_is_exact_against_every_choice():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        m = int(torch.randint(1, 9, (1,), generator=generator))
        sizes = torch.randperm(40, generator=generator)[:m].add(1).tolist()
        histogram = {s: int(torch.randint(1, 20, (1,), generator=generator)) for s in sizes}
        k = int(torch.randint(1, 5, (1,), generator=generator))
        got = best_buckets(histogram, k)
        largest = max(histogram)
        best = min(
            _pad_rows(histogram, set(chosen) | {largest})
            for r in range(min(k, m))
            for chosen in itertools.combinations(sizes, r)
        )
        assert len(got) <= k and max(got) == largest and _pad_rows(histogram, got) == best
        ran = sum(s * n for s, n in histogram.items()) + best
        assert padding_share(histogram, got) == pytest.approx(best / ran)
