"""``autograph.per_bucket``: ``capture()`` of a bucketed function whose buckets each hold their own
state (one StaticCache per bucket, passed with static_argnames), so that every bucket is
captured ahead of time and its first real call replays (issue 22; docs/design.md, "Capture
ahead")."""

import pytest
import torch

import autograph

from conftest import python_run_log
from helpers.models import cache_contents, tiny_llama_decoding


def test_capture_with_a_static_cache_per_bucket_makes_each_first_call_a_replay(device):
    buckets, prompt_len, decode_steps = [1, 2, 4, 8], 4, 3
    llama = tiny_llama_decoding(device, prompt_len)
    config, tokens, decode = llama.config, llama.tokens, llama.decode
    prefill, new_cache = llama.prefill, llama.new_cache

    step = autograph.graphed(
        decode, buckets=buckets, bucket_args={"ids": 0}, static_argnames=("cache",)
    )
    with torch.inference_mode():
        caches = {b: prefill(new_cache(), tokens(b, prompt_len)) for b in buckets}
        before = {b: cache_contents(c) for b, c in caches.items()}
        example = tokens(8, 1)
        rows = step.capture(
            example, torch.tensor([prompt_len], device=device), autograph.per_bucket(caches)
        )
        assert sorted((r.bucket, r.state) for r in rows) == [(b, "graphed") for b in buckets]
        for b, cache in caches.items():  # the warmups' writes were taken back
            for now, then in zip(cache_contents(cache), before[b]):
                assert torch.equal(now, then)

        for batch in (1, 3, 5, 8):
            bucket = next(b for b in buckets if b >= batch)
            prompt = tokens(batch, prompt_len)
            padded = torch.cat([prompt, prompt.new_zeros(bucket - batch, prompt_len)])
            cache, reference = prefill(caches[bucket], padded), prefill(new_cache(), prompt)
            for i in range(decode_steps):
                ids, pos = tokens(batch, 1), torch.tensor([prompt_len + i], device=device)
                got, expected = step(ids, pos, cache), decode(ids, pos, reference)
                assert got.shape == expected.shape == (batch, 1, config.vocab_size)
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    used = {1: 1, 4: 1, 8: 2}  # real calls at 1, 3, 5, 8 rows: the buckets they replay
    by_bucket = {r.bucket: r for r in step.stats()}
    assert set(by_bucket) == set(buckets)
    for b, row in by_bucket.items():
        assert row.state == "graphed" and row.eager_calls == 0, row
        assert row.calls == used.get(b, 0) * decode_steps, row
        assert row.replays == row.calls, row  # each first call too


def test_capture_gives_each_bucket_its_own_value_keyword_or_callable(device):
    log_run = python_run_log()

    @autograph.graphed(buckets=[2, 4], static_argnames=("cache",))
    def store(x, cache):
        log_run((x.shape[0], cache.shape[0]))
        cache[: x.shape[0]] = x
        return x * 2

    caches = {2: torch.zeros(2, 3, device=device), 4: torch.zeros(4, 3, device=device)}
    store.capture(torch.ones(4, 3, device=device), cache=autograph.per_bucket(caches.get))
    assert sorted(set(log_run.runs)) == [(2, 2), (4, 4)]  # every run met its own bucket's
    assert all(not cache.any() for cache in caches.values())
    runs = len(log_run.runs)
    x = torch.randn(3, 3, device=device)
    assert torch.equal(store(x, cache=caches[4]), x * 2)
    assert torch.equal(caches[4][:3], x)
    assert len(log_run.runs) == runs  # a replay: the function's Python did not run
    assert sorted((r.bucket, r.state, r.replays) for r in store.stats()) == [
        (2, "graphed", 0),
        (4, "graphed", 1),
    ]


def test_a_marker_inside_a_container_is_swapped_too(device):
    @autograph.graphed(buckets=[2, 4], static_argnames=("state",))
    def store(x, state):
        state["cache"][: x.shape[0]] = x
        return x * state["scale"]

    caches = {2: torch.zeros(2, 3, device=device), 4: torch.zeros(4, 3, device=device)}
    store.capture(
        torch.ones(4, 3, device=device), {"cache": autograph.per_bucket(caches), "scale": 2.0}
    )
    x = torch.randn(1, 3, device=device)
    assert torch.equal(store(x, {"cache": caches[2], "scale": 2.0}), x * 2)
    assert torch.equal(caches[2][:1], x) and not caches[4].any()
    assert sorted((r.bucket, r.state, r.eager_calls, r.replays) for r in store.stats()) == [
        (2, "graphed", 0, 1),
        (4, "graphed", 0, 0),
    ]


def test_a_mapping_without_some_bucket_names_the_sizes_and_the_fix(device):
    @autograph.graphed(buckets=[1, 2, 4], static_argnames=("cache",))
    def store(x, cache):
        cache[: x.shape[0]] = x
        return x + 1

    caches = {4: torch.zeros(4, 2, device=device)}
    with pytest.raises(ValueError, match=r"store.capture\(\).*cache.*\[1, 2\].*every bucket"):
        store.capture(torch.ones(4, 2, device=device), autograph.per_bucket(caches))
    assert store.stats() == []


def test_a_marker_for_a_function_without_buckets_is_refused(device):
    @autograph.graphed
    def scale(x, factor):
        return x * factor

    with pytest.raises(ValueError, match=r"scale.capture\(\).*factor.*no buckets="):
        scale.capture(torch.ones(2, device=device), autograph.per_bucket({1: 2.0}))
    assert scale.stats() == []


def test_a_marker_given_to_a_real_call_is_refused(device):
    log_run = python_run_log()

    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def store(x, cache):
        log_run()
        return x + 1

    marker = autograph.per_bucket({4: torch.zeros(4, 2, device=device)})
    with pytest.raises(ValueError, match=r"per_bucket\(\{4: \.\.\.\}\).*only fn.capture"):
        store(torch.ones(3, 2, device=device), marker)
    with pytest.raises(ValueError, match="only fn.capture"):
        store(torch.ones(3, 2, device=device), cache=(marker,))
    assert log_run.runs == []


def test_per_bucket_takes_a_mapping_or_a_callable():
    with pytest.raises(TypeError, match=r"per_bucket\(values\).*list.*mapping.*callable"):
        autograph.per_bucket([None, None])


@pytest.mark.skipif(not hasattr(Exception, "add_note"), reason="exception notes: Python >= 3.11")
def test_a_padded_run_that_raises_says_it_ran_padded_and_names_bucket_args(device):
    # A key with per-bucket state runs padded every time; a weight whose dim 0 equals the rows
    # by chance is padded too by the default rule, and torch's error alone did not say so.
    def step(x, w, cache):
        y = x @ w
        cache[: y.shape[0]] += y
        return y

    x, w = torch.randn(3, 3, device=device), torch.randn(3, 5, device=device)
    guessed = autograph.graphed(step, buckets=[4], static_argnames=("cache",))
    with pytest.raises(RuntimeError) as raised:
        guessed(x, w, torch.zeros(4, 5, device=device))
    assert "padded from 3 to 4 rows" in raised.value.__notes__[0]
    assert "bucket_args=" in raised.value.__notes__[0]
    # Named, it graphs and gives eager's result.
    named = autograph.graphed(
        step, buckets=[4], static_argnames=("cache",), bucket_args={"x": 0}, bucket_outputs=0
    )
    cache, eager_cache = torch.zeros(4, 5, device=device), torch.zeros(4, 5, device=device)
    for _ in range(4):
        torch.testing.assert_close(named(x, w, cache), step(x, w, eager_cache))
    torch.testing.assert_close(cache[:3], eager_cache[:3])
    assert [(s.state, s.replays > 0) for s in named.stats()] == [("graphed", True)]
