"""Serving shapes (docs/design.md, "Buckets"): buckets, arguments used by address, and capture ahead
of time."""

import pytest
import torch

import autograph

from conftest import device_label, python_run_log


def by_bucket(fn):
    return sorted((r.bucket, r.state, r.calls, r.replays, r.sizes) for r in autograph.stats(fn))


def test_calls_replay_the_graph_of_their_bucket_with_outputs_sliced_back(device):
    log_run = python_run_log()

    @autograph.graphed(buckets=[1, 2, 4, 8])
    def scores(x, w):
        log_run(x.shape[0])
        return torch.relu(x @ w), (x @ w).sum(1)

    w = torch.randn(5, 3, device=device)
    for n in (3, 4, 3, 3, 1, 1, 1, 4):
        x = torch.randn(n, 5, device=device)
        out, total = scores(x, w)
        assert out.shape == (n, 3) and torch.allclose(out, torch.relu(x @ w))
        assert total.shape == (n,) and torch.allclose(total, (x @ w).sum(1))
    # warmups run the real size, captures the bucket; the first replay with pad rows (3 rows
    # in the graph of 4) is checked once against an eager run of its own 3 rows
    assert log_run.runs == [3, 4, 3, 1, 1]
    (four,) = [row for row in autograph.stats(scores) if row.bucket == 4]
    assert four.state == "graphed" and four.replays == 4
    assert by_bucket(scores) == [(1, "graphed", 3, 2, {1: 3}), (4, "graphed", 5, 4, {3: 3, 4: 2})]
    row = [r for r in scores.stats() if r.bucket == 4][0]
    assert row.key.startswith(f"x: f32[4, 5] {device_label(device)}")
    assert row.padding_waste == pytest.approx(4 * 5 / 17 - 1)


def test_a_sum_over_the_padded_batch_runs_eagerly_with_the_reason(device, caught):
    @autograph.graphed(buckets=[4])
    def total(x, w):
        return (x @ w).sum()  # zero pad rows add nothing, but the probe cannot know

    w = torch.randn(5, 3, device=device)
    for _ in range(3):
        x = torch.randn(3, 5, device=device)
        assert torch.allclose(total(x, w), (x @ w).sum())
    (row,) = total.stats()
    assert row.state == "eager" and "mixes rows" in row.fallback_reason


def test_calls_above_the_largest_bucket_run_eagerly_and_say_so_once(device, caught):
    @autograph.graphed(buckets=[1, 2])
    def double(x):
        return x * 2

    for n in (5, 5, 6):
        x = torch.randn(n, device=device)
        assert torch.equal(double(x), x * 2)
    messages = [
        str(w.message) for w in caught if issubclass(w.category, autograph.AutographWarning)
    ]
    assert len(messages) == 1 and "above the largest of buckets=[1, 2]" in messages[0]
    assert {r.state for r in double.stats()} == {"eager"}


def test_in_place_writes_reach_only_the_callers_real_rows(device):
    @autograph.graphed(buckets=[4])
    def bump(counts, x):
        counts.add_(x)
        return counts * 2

    for _ in range(3):
        counts = torch.zeros(3, device=device)
        doubled = bump(counts, torch.ones(3, device=device))
        assert torch.equal(counts, torch.ones(3, device=device))
        assert torch.equal(doubled, torch.full((3,), 2.0, device=device))
    assert by_bucket(bump) == [(4, "graphed", 3, 2, {3: 3})]


def test_explicit_bucket_args_pad_with_their_values(device):
    @autograph.graphed(
        buckets=[8],
        bucket_args={"ids": 0, "mask": (0, -1)},
        static_argnames=("seen",),
        bucket_outputs=[0, None],
    )
    def masked(ids, mask, scale, seen):
        seen.copy_(mask)  # per-bucket state: every run sees the padded arguments
        return ids * (mask > 0), scale * 2

    scale = torch.ones(5, device=device)  # dim 0 of 5, but not named: not padded
    seen = torch.zeros(8, dtype=torch.long, device=device)
    for _ in range(3):
        ids = torch.arange(5, device=device)
        mask = torch.ones(5, dtype=torch.long, device=device)
        seen.zero_()
        out, doubled = masked(ids, mask, scale, seen)
        assert torch.equal(out, ids) and doubled.shape == (5,)
        assert seen.tolist() == [1] * 5 + [-1] * 3  # the three pad rows hold -1
    assert by_bucket(masked)[0][:4] == (8, "graphed", 3, 2)


def test_buckets_in_a_region_and_for_a_module(device):
    model = torch.nn.Linear(4, 2).to(device)
    with torch.no_grad(), autograph.region(buckets=[2, 4]):
        # per bucket: a plain call and a watched warmup (the region's warmup=2), a capture
        for n in (1, 1, 2, 3, 3, 4, 3):
            x = torch.randn(n, 4, device=device)
            assert torch.allclose(model(x), torch.nn.functional.linear(x, model.weight, model.bias))
    assert by_bucket(model) == [
        (2, "graphed", 3, 1, {1: 2, 2: 1}),
        (4, "graphed", 4, 2, {3: 3, 4: 1}),
    ]


def test_static_arguments_are_used_by_address(device):
    @autograph.graphed(static_argnames=["cache"])
    def append(x, cache, position):
        cache.index_copy_(0, position, x)
        return cache.sum()

    cache = torch.zeros(8, device=device)
    for i in range(5):
        total = append(torch.ones(1, device=device), cache, torch.tensor([i], device=device))
        assert total.item() == i + 1
    assert torch.equal(cache, torch.tensor([1.0] * 5 + [0.0] * 3, device=device))
    other = torch.zeros(8, device=device)  # a new address is a new key
    append(torch.ones(1, device=device), other, torch.tensor([0], device=device))
    assert sorted((r.state, r.calls, r.replays) for r in append.stats()) == [
        ("graphed", 5, 4),
        ("warmup", 1, 0),
    ]


def test_capture_ahead_of_time_captures_every_bucket_and_leaves_no_effect(device):
    log_run = python_run_log()

    @autograph.graphed(buckets=[1, 2, 4], static_argnames=["cache"])
    def step(x, cache):
        log_run(x.shape[0])
        cache.add_(x.sum())
        return x * 2 + torch.rand_like(x)

    cache = torch.zeros(3, device=device)
    torch.manual_seed(0)
    expected_noise = torch.rand(3, 2, device=device)
    torch.manual_seed(0)
    rows = step.capture(torch.ones(3, 2, device=device), cache)
    assert [(r.bucket, r.state) for r in rows] == [(4, "graphed"), (2, "graphed"), (1, "graphed")]
    assert log_run.runs == [4, 4, 2, 2, 1, 1]  # one warmup and one capture each
    assert torch.equal(cache, torch.zeros(3, device=device))  # the warmups were taken back
    out = step(torch.ones(3, 2, device=device), cache)  # a replay, first call
    assert log_run.runs == [4, 4, 2, 2, 1, 1]
    assert torch.equal(cache, torch.full((3,), 6.0, device=device))
    assert out.shape == (3, 2)
    if device == "cpu":  # the emulation draws as eager would; on CUDA, philox offsets
        assert torch.equal(out, 2 + expected_noise)


def test_an_output_whose_size_only_equals_the_bucket_is_not_sliced(device):
    @autograph.graphed(buckets=[4, 8])
    def transposed(x):
        return x.t() * 2, x * 2  # hidden size 4 equals a bucket; the batch is dim 0 of x

    for _ in range(4):
        x = torch.randn(3, 4, device=device)
        flipped, doubled = transposed(x)
        assert flipped.shape == (4, 3) and torch.equal(flipped, x.t() * 2)
        assert torch.equal(doubled, x * 2)
    assert by_bucket(transposed)[0][:4] == (4, "graphed", 4, 3)


def test_a_sum_over_the_batch_of_the_buckets_size_runs_eagerly_with_the_reason(device, caught):
    @autograph.graphed(buckets=[4, 8])
    def pooled(x):
        return x.sum(0), x * 2  # (4,): the hidden size, and a sum over the batch

    for _ in range(4):
        x = torch.randn(3, 4, device=device)
        total, doubled = pooled(x)
        assert total.shape == (4,) and torch.allclose(total, x.sum(0))
        assert torch.equal(doubled, x * 2)
    (row,) = pooled.stats()
    assert row.state == "eager" and "mixes rows" in row.fallback_reason


def test_an_expanded_argument_that_is_not_padded(device):
    @autograph.graphed(buckets=[4])
    def add(x, bias):
        return x + bias

    bias = torch.randn(1, 4, device=device).expand(3, 4)  # stride 0, dim 0 equals the batch
    for _ in range(3):
        x = torch.randn(3, 4, device=device)
        assert torch.equal(add(x, bias), x + bias)
    assert {r.state for r in add.stats()} == {"graphed"}


def test_a_view_of_a_padded_argument_runs_eagerly_with_the_reason(device, caught):
    @autograph.graphed(buckets=[4])
    def tail(x):
        x.mul_(2)
        return x[1:]

    for _ in range(3):
        x = torch.arange(12.0, device=device).view(3, 4)
        out = tail(x)
        assert out.shape == (2, 4) and torch.equal(
            out, torch.arange(4.0, 12.0, device=device).view(2, 4) * 2
        )
    (row,) = tail.stats()
    assert row.state == "eager" and "view of an argument padded to a bucket" in row.fallback_reason


def test_capture_ahead_of_time_pads_what_real_calls_pad(device):
    @autograph.graphed(buckets=[2, 4, 8])
    def project(x, w):
        return x @ w

    w = torch.randn(4, 4, device=device)  # dim 0 is 4: equal to a bucket, never padded
    project.capture(torch.randn(8, 4, device=device), w)
    for _ in range(2):
        x = torch.randn(3, 4, device=device)
        assert torch.allclose(project(x, w), x @ w)
    rows = {r.bucket: (r.state, r.calls, r.replays) for r in project.stats()}
    assert rows == {8: ("graphed", 0, 0), 4: ("graphed", 2, 2), 2: ("graphed", 0, 0)}


def test_capture_ahead_of_time_takes_back_writes_made_through_a_view(device):
    linear = torch.nn.Linear(4, 4).to(device)
    before = linear.weight.detach().clone()

    @autograph.graphed
    def step(x):
        out = linear(x)
        with torch.no_grad():
            linear.weight.t().mul_(0.5)  # a write through a view of the weight
        return out

    with torch.no_grad():
        step.capture(torch.randn(2, 4, device=device))
    assert torch.equal(linear.weight, before)
    assert [r.state for r in step.stats()] == ["graphed"]
