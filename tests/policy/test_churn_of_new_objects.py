"""Churn and new objects: a request-scoped cache, a new object per epoch, scratch objects of
capture(), calls passed through that settle, generate() with a StaticCache, keys captured ahead
that replay once or twice per request keep being graphed.
"""

import pytest
import torch

import autograph

from conftest import (
    autograph_warnings,  # noqa: E402
    states,
)

pytestmark = pytest.mark.usefixtures("caught")


CHURN_ROW = "calls passed through (keys churn)"


class _RequestCache:
    """A per-request KV cache stand-in: keyed by identity, updated in place."""

    def __init__(self, device):
        self.k = torch.zeros(4, device=device)


def _forward(x, cache):
    cache.k.add_(x.sum(0))
    return x * cache.k


def _serve(fn, device, requests, steps=8):
    """Each request: a new cache, one prefill of 8 rows, then ``steps`` decode steps of 1 row;
    return every output and, per request, the states seen before its cache is dropped."""
    outputs, seen = [], []
    for _ in range(requests):
        cache = _RequestCache(device)
        outputs.append(fn(torch.ones(8, 4, device=device), cache))
        for _ in range(steps):
            outputs.append(fn(torch.ones(1, 4, device=device), cache))
        seen.append(states(fn) if fn is not _forward else [])
        del cache
    return outputs, seen


# Was a defect: Churn.new_key (autograph/policy/_churn.py) sums the replays of the cache's live
# entries: the  decode key replays, then dies with its request's cache and is
# dropped (KeyCache.forget_dead)  before the next new key, so its replays leave the sum and never
# reset the streak; the  prefill keys died unused, and after two of them (ORPHANS=2) calls pass
# through with a  warning that no graph replayed (before this session: after 8 requests, at
# WINDOW=16)
def test_a_request_scoped_cache_whose_decode_step_replays_keeps_being_graphed(device, caught):
    fn = autograph.graphed(_forward)
    got, seen = _serve(fn, device, requests=6)
    expected, _ = _serve(_forward, device, requests=6)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    # The last request's decode step warmed up, captured and replayed, as the first one's did.
    assert ("graphed", 8, 1, 7) in seen[0]
    assert ("graphed", 8, 1, 7) in seen[-1], seen[-1]
    assert not [m for m in autograph_warnings(caught) if "no graph replayed" in m]


# Was a defect (fixed in this session): as above, with each object living for a whole epoch and
# its one key replaying 9 times:  the dropped key's replays leave Churn.new_key's sum, so every
# epoch's key counts towards  WINDOW=16 as if nothing had replayed, and from the 16th epoch calls
# pass through; each  look meets a new object's key and passes through again (pre-existing, same
# cause)
def test_a_new_object_per_epoch_whose_key_replays_keeps_being_graphed(device, caught):
    fn = autograph.graphed(_forward)
    for epoch in range(20):
        cache = _RequestCache(device)
        for step in range(10):
            x = torch.ones(1, 4, device=device)
            torch.testing.assert_close(fn(x, cache), x * (step + 1))
        assert states(fn) == [("graphed", 10, 1, 9)], (epoch, states(fn))
    assert not [m for m in autograph_warnings(caught) if "no graph replayed" in m]


# Was a defect: keys captured ahead with a scratch object die unused when it is dropped:
# KeyCache.forget_dead (autograph/engine/_key_cache.py) counts each as key_died_unused, and the
# first call with the object the user keeps passes through at once (ORPHANS=2), warning
# 'an argument is a new object on each call', which is untrue
def test_keys_captured_ahead_with_a_scratch_object_do_not_send_later_calls_through(device, caught):
    fn = autograph.graphed(_forward)
    scratch = _RequestCache(device)
    for rows in (1, 2):
        fn.capture(torch.ones(rows, 4, device=device), scratch)
    del scratch
    cache = _RequestCache(device)
    for i in range(12):
        x = torch.ones(1 + i % 2, 4, device=device)
        expected = x * (cache.k + x.sum(0))
        torch.testing.assert_close(fn(x, cache), expected)
    assert states(fn) == [("graphed", 6, 1, 5), ("graphed", 6, 1, 5)], states(fn)
    assert not [m for m in autograph_warnings(caught) if "no graph replayed" in m]


def test_calls_passed_through_for_new_objects_are_graphed_again_once_one_object_is_reused(
    device, caught
):
    # Guards the looks: after a pass-through caused by a new object per call, reusing one
    # object must let its keys warm up, capture and replay again.
    fn = autograph.graphed(_forward)
    for _ in range(3):
        cache = _RequestCache(device)
        for rows in (8, 1):
            fn(torch.ones(rows, 4, device=device), cache)
    assert [r for r in autograph.stats(fn) if r.key == CHURN_ROW]  # it passed through
    messages = [m for m in autograph_warnings(caught) if "no graph replayed" in m]
    assert len(messages) == 1 and "a new object on each call" in messages[0]
    cache = _RequestCache(device)
    for _ in range(40):
        cache.k.zero_()
        fn(torch.ones(8, 4, device=device), cache)
        for _ in range(8):
            got = fn(torch.ones(1, 4, device=device), cache)
    torch.testing.assert_close(got, torch.full((1, 4), 16.0, device=device))
    rows = states(fn)
    # Its first call started a pass-through, so it ran unwatched: its second was its warmup.
    assert ("graphed", rows[0][1], 2, rows[0][1] - 2) == rows[0] and rows[0][3] > 200, rows
    assert rows[1][0] == "graphed" and rows[1][3] > 20, rows


# Was a defect (fixed in this session): without torch.compile (the CPU, or a CUDA run where
# transformers does not compile the  decode step) generate(cache_implementation='static') graphs
# its decode step and replays  it 14 times per call; the new StaticCache per call makes the
# prefill key die unused, the  decode key's replays leave Churn.new_key's sum when it dies, and
# from the third  generate() every call passes through (0 replays; before this session: from the
# eighth)
def test_generate_with_a_static_cache_keeps_replaying_its_decode_step_on_the_emulation():
    pytest.importorskip("transformers")
    from helpers.models import static_generate_runs

    expected, runs = static_generate_runs(6)
    assert all(torch.equal(tokens, expected) for tokens, _ in runs)
    # 15 decode steps per call: a plain call and a watched warmup (the region's warmup=2),
    # then a capture and replays
    assert runs[0][1].replays >= 13
    assert [r.passed_through for _, r in runs] == [0] * 6
    assert all(r.replays >= 13 for _, r in runs), [r for _, r in runs]


# Defect: Churn.key_died (autograph/policy/_churn.py:103) counts a dead key as paid only when
# replays > recaptures + 1, taking one replay as its capture call's own; a key captured ahead
# by capture() has no such replay, so its one real replay is not counted. Each request's
# prefill key dies unused; after two requests (ORPHANS) calls pass through, the graph captured
# ahead is never replayed again, and the warning says no graph replayed, which is untrue.
# Was a defect (fixed in this session): _churn.Churn.key_died takes a capture()-ahead key's one
# real replay for its capture call's own
def test_a_key_captured_ahead_that_replays_once_per_request_keeps_replaying(device, caught):
    fn = autograph.graphed(_forward)
    seen = []
    for _ in range(5):
        cache, reference = _RequestCache(device), _RequestCache(device)
        fn.capture(torch.ones(1, 4, device=device), cache)
        for rows in (8, 1):  # a prefill, then one decode step (the key captured ahead)
            x = torch.ones(rows, 4, device=device)
            torch.testing.assert_close(fn(x, cache), _forward(x, reference))
        seen.append(states(fn))
        del cache
    assert not [m for m in autograph_warnings(caught) if "no graph replayed" in m]
    assert seen[-1][0] == ("graphed", 1, 0, 1), seen


def test_a_key_captured_ahead_that_replays_twice_per_request_keeps_replaying(device, caught):
    # Guards the other side of the defect above: two replays count as paid.
    fn = autograph.graphed(_forward)
    for _ in range(5):
        cache, reference = _RequestCache(device), _RequestCache(device)
        fn.capture(torch.ones(1, 4, device=device), cache)
        for rows in (8, 1, 1):
            x = torch.ones(rows, 4, device=device)
            torch.testing.assert_close(fn(x, cache), _forward(x, reference))
        assert states(fn) == [("graphed", 2, 0, 2), ("warmup", 1, 1, 0)]
        del cache
    assert not [m for m in autograph_warnings(caught) if "no graph replayed" in m]
