"""Buckets never wrong about state and never in the way (issue 35 section 4): a running mean that
counts the pad rows, Python numbers made from the size after ``capture()``, a refused key left
marked graphed, capture()'s keys counted as churn, capture() keeping objects alive, a 0-row batch.

Each test failed on the engine before the fix of its case (a9c0... on branch wrong-buckets)."""

import gc
import weakref

import pytest
import torch

import autograph

from conftest import autograph_warnings


def rows_of(fn):
    return sorted((r.bucket or 0, r.state, r.calls, r.replays) for r in autograph.stats(fn))


class Cache:
    """State each bucket holds its own of, keyed by identity (as HF's StaticCache is)."""

    def __init__(self, rows, device):
        self.kv = torch.zeros(rows, 2, device=device)


def test_a_running_mean_that_would_count_the_pad_rows_runs_eagerly_with_the_reason(device, caught):
    # The mean moves by 1% of the batch's per call: a replay padded 3 -> 4 rows moves it by
    # 3/4 of that, well within 1% of the accumulated value, which the state check compared to.
    # It has 4 values, one per hidden unit, as many as the bucket has rows: the pad-row probe
    # leaves state of the bucket's size to this check (a bucket's KV cache holds pad rows).
    stats = torch.nn.Module()
    stats.register_buffer("mean", torch.full((4,), 100.0, device=device))

    @autograph.graphed(buckets=[4])
    def step(x):
        stats.mean.mul_(0.99).add_(0.01 * x.mean(0))
        return x * 2

    expected = stats.mean.clone()
    for _ in range(12):
        x = torch.randn(3, 4, device=device) + 100
        assert torch.equal(step(x), x * 2)
        expected.mul_(0.99).add_(0.01 * x.mean(0))
    torch.testing.assert_close(stats.mean, expected)
    (row,) = autograph.stats(step)
    assert row.state == "eager" and row.replays == 0
    assert "stats.mean" in row.fallback_reason and "what the call changed" in row.fallback_reason


def test_a_running_mean_without_a_row_per_bucket_row_is_found_by_the_pad_row_probe(device, caught):
    stats = torch.nn.Module()
    stats.register_buffer("mean", torch.full((5,), 100.0, device=device))

    @autograph.graphed(buckets=[4])
    def step(x):
        stats.mean.mul_(0.99).add_(0.01 * x.mean(0))
        return x * 2

    expected = stats.mean.clone()
    for _ in range(6):
        x = torch.randn(3, 5, device=device) + 100
        assert torch.equal(step(x), x * 2)
        expected.mul_(0.99).add_(0.01 * x.mean(0))
    torch.testing.assert_close(stats.mean, expected)
    (row,) = autograph.stats(step)
    assert row.state == "eager" and "counts the pad rows" in row.fallback_reason


def test_state_that_the_pad_rows_leave_alone_stays_graphed(device):
    # The state check scales with what the call changed, the probe compares what the pad rows
    # reach: a buffer written from the real rows only keeps its graph.
    stats = torch.nn.Module()
    stats.register_buffer("first", torch.zeros(5, device=device))

    @autograph.graphed(buckets=[4])
    def step(x):
        stats.first.mul_(0.5).add_(x[0])
        return x * 2

    expected = stats.first.clone()
    for _ in range(6):
        x = torch.randn(3, 5, device=device) + 1000
        assert torch.equal(step(x), x * 2)
        expected.mul_(0.5).add_(x[0])
    torch.testing.assert_close(stats.first, expected)
    assert rows_of(step) == [(4, "graphed", 6, 5)]


def _captured_with_per_bucket_state(returned, device):
    @autograph.graphed(buckets=[4, 8], static_argnames=("cache",))
    def store(x, cache):
        cache.kv[: x.shape[0]] = x
        return x * 2, returned(x)

    caches = {4: Cache(4, device), 8: Cache(8, device)}
    store.capture(torch.zeros(8, 2, device=device), autograph.per_bucket(caches))
    return store, caches


@pytest.mark.parametrize(
    "returned, value",
    [
        (lambda x: 1.0 / x.shape[0], lambda n: 1.0 / n),
        (lambda x: x.shape[0], lambda n: n),
        # Once silently the bucket's ('rows=4' for 3 rows): only ints and floats were compared.
        (lambda x: f"rows={x.shape[0]}", lambda n: f"rows={n}"),
        (lambda x: x.shape[0] > 4, lambda n: n > 4),
    ],
    ids=["1/rows", "rows", "str", "bool"],
)
def test_a_number_made_from_the_size_after_capture_is_the_calls_own(
    device, caught, returned, value
):
    store, caches = _captured_with_per_bucket_state(returned, device)
    reason = "output 1 is a Python value that changes with the batch size"
    # Refused at capture: the key of bucket 4 is eager, never marked graphed.
    assert [(r.bucket, r.state) for r in autograph.stats(store)] == [(8, "graphed"), (4, "eager")]
    assert reason in autograph.stats(store)[1].fallback_reason
    for rows, bucket in ((3, 4), (5, 8), (3, 4), (5, 8)):
        x = torch.randn(rows, 2, device=device)
        out, number = store(x, caches[bucket])
        assert torch.equal(out, x * 2) and number == value(rows)
    assert all(r.state == "eager" and reason in r.fallback_reason for r in autograph.stats(store))
    assert any(reason in w for w in autograph_warnings(caught))


@pytest.mark.parametrize(
    "returned, value",
    [(lambda x: 1.0 / x.shape[0], lambda n: 1.0 / n), (lambda x: x.shape[0], lambda n: n)],
    ids=["1/rows", "rows"],
)
def test_a_number_made_from_the_size_after_capture_of_one_bucket_runs_eagerly_and_writes_once(
    device, caught, returned, value
):
    # Once raised ValueError at every call of 3 rows: capture() had run the bucket's size only,
    # and each padded run wrote the cache before its outputs showed a number that changes
    # with the size. The run on fake tensors now shows it first, and the call runs as called,
    # writing the cache once.
    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def accumulate(x, cache):
        cache.kv[: x.shape[0]] += x
        return x * 2, returned(x)

    cache = Cache(4, device)
    accumulate.capture(torch.zeros(4, 2, device=device), cache)
    expected = cache.kv.clone()
    for _ in range(4):
        x = torch.randn(3, 2, device=device)
        out, number = accumulate(x, cache)
        expected[:3] += x
        assert torch.equal(out, x * 2) and number == value(3)
        assert torch.equal(cache.kv, expected)
    reason = "output 1 is a Python value that changes with the batch size"
    (row,) = autograph.stats(accumulate)
    assert row.replays == 0 and reason in row.fallback_reason


@pytest.mark.parametrize(
    "returned, value",
    [
        (lambda x: 1.0 / x.shape[0], lambda n: 1.0 / n),
        (lambda x: x.shape[0], lambda n: n),
        (lambda x: x.shape[0] > 3, lambda n: n > 3),
    ],
    ids=["1/rows", "rows", "bool"],
)
def test_a_number_made_from_the_size_at_a_familys_first_call_is_the_calls_own(
    device, caught, returned, value
):
    # Once raised ValueError at the first call: its padded run had written the cache when its
    # outputs showed a number that changes with the size. That call's outputs now come from
    # its run on fake tensors at the call's rows (the padded run writes the cache once), and
    # the calls after it run eagerly, as called.
    @autograph.graphed(buckets=[4, 8], static_argnames=("cache",))
    def accumulate(x, cache):
        cache.kv[: x.shape[0]] += x
        return x * 2, returned(x)

    cache = Cache(4, device)
    expected = cache.kv.clone()
    for _ in range(4):
        x = torch.randn(3, 2, device=device)
        out, number = accumulate(x, cache)
        expected[:3] += x
        assert out.shape == (3, 2) and torch.equal(out, x * 2)
        assert number == value(3) and type(number) is type(value(3))
        assert torch.equal(cache.kv, expected)
    reason = "output 1 is a Python value that changes with the batch size"
    (row,) = autograph.stats(accumulate)
    assert row.state == "eager" and row.replays == 0 and row.eager_calls == 4
    assert reason in row.fallback_reason
    assert sum(reason in w for w in autograph_warnings(caught)) == 1


def test_a_stateless_key_refused_at_its_warmup_is_never_captured(device, caught):
    # Its warmup ran as called and refused it (the bucket of 8 had shown another size), and
    # the end of the warmup made it a key to capture again: its next call captured a graph
    # only to throw it away.
    @autograph.graphed(buckets=[4, 8])
    def rows(x):
        return x * 2, x.shape[0]

    for n in (8, 8, 3, 3, 3):
        x = torch.randn(n, 2, device=device)
        out, number = rows(x)
        assert torch.equal(out, x * 2) and number == n
    by_bucket = {r.bucket: r for r in autograph.stats(rows)}
    assert by_bucket[4].state == "eager" and by_bucket[4].capture_seconds is None
    assert by_bucket[4].eager_calls == 3


def test_the_keys_of_capture_are_not_churn(device, caught):
    sizes = list(range(1, 21))

    @autograph.graphed(buckets=sizes, max_graphs=32)
    def double(x):
        return x * 2

    double.capture(torch.zeros(20, 2, device=device))
    for rows in sizes:
        x = torch.randn(rows, 2, device=device)
        assert torch.equal(double(x), x * 2)
    assert not [w for w in autograph_warnings(caught) if "churn" in w or "new keys" in w]
    rows = autograph.stats(double)
    assert len(rows) == 20 and all(r.state == "graphed" and r.replays == 1 for r in rows)


def test_capture_keeps_no_object_the_function_returns_alive(device):
    @autograph.graphed(buckets=[4, 8], static_argnames=("cache",), bucket_outputs=0)
    def store(x, cache):
        cache.kv[: x.shape[0]] = x
        return x * 2, cache

    caches = {4: Cache(4, device), 8: Cache(8, device)}
    alive = [weakref.ref(c) for c in caches.values()]
    store.capture(torch.zeros(8, 2, device=device), autograph.per_bucket(caches))
    assert [r.state for r in autograph.stats(store)] == ["graphed", "graphed"]
    x = torch.randn(3, 2, device=device)
    out, cache = store(x, caches[4])
    assert torch.equal(out, x * 2) and cache is caches[4]
    assert [r.replays for r in autograph.stats(store)] == [0, 1]
    del caches, cache
    gc.collect()
    assert [r() for r in alive] == [None, None]
    assert autograph.stats(store) == []  # the keys went with their caches


def test_a_batch_of_no_rows_runs_as_called(device, caught):
    @autograph.graphed(buckets=[4, 8])
    def double(x):
        return x * 2

    for _ in range(3):
        out = double(torch.ones(0, 2, device=device))
        assert out.shape == (0, 2)
    for _ in range(3):
        x = torch.randn(3, 2, device=device)
        assert torch.equal(double(x), x * 2)
    by_bucket = {r.bucket: r for r in autograph.stats(double)}
    assert by_bucket[None].state == "eager" and "0 rows" in by_bucket[None].fallback_reason
    assert by_bucket[4].state == "graphed" and by_bucket[4].replays >= 1


def test_a_running_mean_beside_per_bucket_state_is_found_by_the_pad_row_probe(device, caught):
    # A key with per-bucket state runs padded in every phase; its graph's probe replays with
    # other pad rows and finds that a buffer with no row per batch row changed. The padded
    # warmups before it have counted their pad rows (see the report of issue 35).
    stats = torch.nn.Module()
    stats.register_buffer("mean", torch.full((5,), 100.0, device=device))

    @autograph.graphed(buckets=[4, 8], static_argnames=("cache",), bucket_outputs=0)
    def step(x, cache):
        cache.kv[: x.shape[0]] = x[:, :2]
        stats.mean.mul_(0.99).add_(0.01 * x.mean(0))
        return x * 2

    caches = {4: Cache(4, device), 8: Cache(8, device)}
    for _ in range(6):
        x = torch.randn(3, 5, device=device) + 100
        assert torch.equal(step(x, caches[4]), x * 2)
        assert torch.equal(caches[4].kv[:3], x[:, :2])
        before = stats.mean.clone()
    x = torch.randn(3, 5, device=device) + 100
    step(x, caches[4])
    torch.testing.assert_close(stats.mean, before * 0.99 + 0.01 * x.mean(0))
    (row,) = autograph.stats(step)
    assert row.state == "eager" and row.replays == 0
    assert "counts the pad rows" in row.fallback_reason
