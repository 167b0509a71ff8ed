"""The first replay of a bucket at each row count is probed once and stays right: per-bucket
StaticCaches, per-bucket counters, stats counted once, random ops and in-place arguments,
capture() then calls at several row counts, a dim 0 equal to the rows by chance.
"""

import pytest
import torch

import autograph

from conftest import (
    python_run_log,  # noqa: E402
    states,
)

pytestmark = pytest.mark.usefixtures("caught")


def _static_cache_decode_at_rows(device, rows_per_sequence, ahead):
    """Decode sequences of 3 steps at these row counts, all in the bucket of 4 with its one
    StaticCache (re-prefilled, padded, per sequence); compare each step's logits and the cache's
    real rows with eager decoding on a cache of the sequence's real size; return the rows of
    stats() while the caches live (keys die with them)."""
    from helpers.models import cache_contents, tiny_llama_decoding

    prompt_len = 4
    llama = tiny_llama_decoding(device, prompt_len)
    tokens, decode, prefill, new_cache = llama.tokens, llama.decode, llama.prefill, llama.new_cache

    step = autograph.graphed(
        decode, buckets=[4], bucket_args={"ids": 0}, static_argnames=("cache",), bucket_outputs=0
    )
    with torch.inference_mode():
        cache = prefill(new_cache(), tokens(4, prompt_len))
        if ahead:
            step.capture(
                tokens(4, 1),
                torch.tensor([prompt_len], device=device),
                autograph.per_bucket({4: cache}),
            )
        for batch in rows_per_sequence:
            prompt = tokens(batch, prompt_len)
            prefill(cache, torch.cat([prompt, prompt.new_zeros(4 - batch, prompt_len)]))
            reference = prefill(new_cache(), prompt)
            for i in range(3):
                ids, pos = tokens(batch, 1), torch.tensor([prompt_len + i], device=device)
                torch.testing.assert_close(
                    step(ids, pos, cache),
                    decode(ids, pos, reference),
                    rtol=1e-4,
                    atol=1e-4,
                    msg=f"{batch} rows, step {i}",
                )
                for got, expected in zip(cache_contents(cache), cache_contents(reference)):
                    real = got[:batch] if got.dim() and got.shape[0] == 4 else got
                    torch.testing.assert_close(real, expected, msg=f"cache, {batch} rows")
        return states(step)


@pytest.mark.parametrize("ahead", [False, True], ids=["warmed", "captured_ahead"])
def test_a_static_cache_per_bucket_probed_at_each_row_count_stays_right(device, ahead):
    # Guards 46d74b8 on per-bucket state: the probe's extra replay at rows 3, 2 and 1 writes the
    # bucket's cache in place; its writes must be taken back (logits and cache as eager's).
    rows = _static_cache_decode_at_rows(device, (3, 2, 1, 3), ahead)
    assert rows == ([("graphed", 12, 0, 12)] if ahead else [("graphed", 12, 1, 11)])


def test_a_counter_written_in_place_per_bucket_counts_once_per_call_at_every_row_count(device):
    # Guards the probes of a key with per-bucket state: each probe replays twice; the counter
    # and the accumulator it writes must move once per call, whatever the row count.
    @autograph.graphed(buckets=[4], static_argnames=("state",), bucket_outputs=0)
    def step(x, state):
        state["count"].add_(1)
        state["acc"][: x.shape[0]] += x
        return x * state["count"]

    state = {"count": torch.zeros((), device=device), "acc": torch.zeros(4, 2, device=device)}
    acc = torch.zeros(4, 2, device=device)
    sizes = (4, 4, 3, 2, 1, 3, 2, 1, 4)
    for calls, n in enumerate(sizes, 1):
        x = torch.full((n, 2), float(n), device=device)
        acc[:n] += x
        torch.testing.assert_close(step(x, state), x * calls, msg=f"{n} rows")
        assert state["count"].item() == calls, n
        torch.testing.assert_close(state["acc"], acc, msg=f"{n} rows")
    assert states(step) == [("graphed", 9, 1, 8)]


def test_each_row_counts_first_padded_call_counts_once_in_stats(device):
    # Guards the counts: at 4, 4, 3, 2, 1, 3, 2, 1, 3 rows: a warmup, the capture's replay, an
    # eager run at 3 (the only size seen was the bucket's), then replays, each row count's
    # first replay checked against an eager run (not counted as an eager call).
    log_run = python_run_log()

    @autograph.graphed(buckets=[4])
    def affine(x):
        log_run(x.shape[0])
        return x * 2 + 1

    for n in (4, 4, 3, 2, 1, 3, 2, 1, 3):
        x = torch.randn(n, 3, device=device)
        torch.testing.assert_close(affine(x), x * 2 + 1)
    assert states(affine) == [("graphed", 9, 2, 7)]
    # warmup, capture, eager at 3 (not a replay, so 3 is not yet checked), checks at 2, 1, 3
    assert log_run.runs == [4, 4, 3, 2, 1, 3]


def test_random_ops_and_in_place_arguments_probed_at_each_row_count(device):
    # Guards the probe against random ops (a second replay draws other numbers) and arguments
    # written in place (written once, not once per probe replay).
    @autograph.graphed(buckets=[4])
    def bump(x, y):
        x.add_(1)
        y.mul_(2)
        return x.sum(1) + y.sum(1) + 0 * torch.rand_like(x).sum(1)

    for n in (4, 4, 3, 2, 1, 3, 2, 1):
        x = torch.arange(n * 3, dtype=torch.float32, device=device).reshape(n, 3)
        y = torch.ones(n, 3, device=device)
        x0, y0 = x.clone(), y.clone()
        out = bump(x, y)
        torch.testing.assert_close(x, x0 + 1, msg=f"x, {n} rows")
        torch.testing.assert_close(y, y0 * 2, msg=f"y, {n} rows")
        torch.testing.assert_close(out, (x0 + 1).sum(1) + (y0 * 2).sum(1))
    assert states(bump) == [("graphed", 8, 2, 6)]


def test_capture_ahead_then_calls_at_several_row_counts_all_replay(device):
    log_run = python_run_log()

    @autograph.graphed(buckets=[2, 4])
    def f(x):
        log_run(x.shape[0])
        return (x * 2).relu()

    f.capture(torch.randn(4, 3, device=device))
    runs = len(log_run.runs)
    for n in (3, 1, 3, 1, 2, 4):
        x = torch.randn(n, 3, device=device)
        torch.testing.assert_close(f(x), (x * 2).relu())
    assert sorted((r.bucket, r.state, r.calls, r.eager_calls, r.replays) for r in f.stats()) == [
        (2, "graphed", 3, 0, 3),
        (4, "graphed", 3, 0, 3),
    ]
    assert log_run.runs[runs:] == [3, 1]  # each row count's first call checked, once


# Once wrong: by default every tensor argument whose dim 0 equals
# the call's rows is padded (_buckets); a weight of 3 rows, called with x of 3 rows, is padded
# too. The warmup runs as called and passes; the capture runs on the padded arguments and
# raises, and the key stays in its capture phase, so every later call raises.
# Was a defect (fixed in this session): a capture on wrongly padded arguments raises to the
# caller at every call instead of running the key eagerly
def test_an_argument_whose_dim_0_equals_the_rows_by_chance_does_not_break_calls(device):
    f = autograph.graphed(lambda x, w: x @ w, buckets=[4])
    w = torch.randn(3, 3, device=device)
    for _ in range(3):
        x = torch.randn(3, 3, device=device)
        torch.testing.assert_close(f(x, w), x @ w)
    assert states(f)[0][:3] in [("eager", 3, 3), ("graphed", 3, 1)], states(f)
