"""A faster ``capture()`` (issue 38): no garbage collection between its captures, Python's
collector frozen during it, and later buckets of one family warmed up unwatched."""

import gc

import torch

import autograph
from autograph.engine._key_life import KeyLife

from helpers.watched import watched_warmups


def _noting_the_collector(monkeypatch):
    """Note, at every capture, whether the collector is on and how many objects are frozen (in
    autograph's capture step: a note made by the function would be Python state it changes)."""
    seen = []
    original = KeyLife.agreed_record

    def noted(life, c):
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        return original(life, c)

    monkeypatch.setattr(KeyLife, "agreed_record", noted)
    return seen


def test_capture_freezes_the_collector_and_puts_it_back(emulated, monkeypatch):
    seen = _noting_the_collector(monkeypatch)
    step = autograph.graphed(lambda x: x * 2, buckets=[1, 2, 4, 8])
    gc.unfreeze()  # the suite freezes its objects (conftest): start from a process that did not
    try:
        assert gc.get_freeze_count() == 0 and gc.isenabled()
        rows = step.capture(torch.ones(8, 3))
        assert gc.get_freeze_count() == 0 and gc.isenabled()
    finally:
        gc.freeze()
    assert [r.state for r in rows] == ["graphed"] * 4
    assert len(seen) == 4 and all(not enabled and frozen > 0 for enabled, frozen in seen)


def test_what_the_process_froze_itself_stays_frozen(emulated, monkeypatch):
    seen = _noting_the_collector(monkeypatch)
    step = autograph.graphed(lambda x: x * 2, buckets=[2, 4])
    frozen = gc.get_freeze_count()
    assert frozen > 0  # conftest froze the suite's objects, as a server may after start-up
    assert [r.state for r in step.capture(torch.ones(4, 3))] == ["graphed"] * 2
    assert gc.get_freeze_count() == frozen and gc.isenabled()
    assert len(seen) == 2 and all(not enabled for enabled, _ in seen)


def test_later_buckets_of_a_family_warm_up_unwatched_and_still_probe_right(emulated, monkeypatch):
    watched = watched_warmups(monkeypatch, of=lambda life: life.bucket)

    # per-bucket state written by address: the probe of a first padded replay must save and
    # restore it, from what the capture's own watch saw (the warmup was not watched)
    caches = {b: torch.zeros(b, 3) for b in (2, 4, 8)}

    def step(x, cache):
        cache.add_(x)
        return x * 2 + cache

    fn = autograph.graphed(step, buckets=[2, 4, 8], static_argnames=("cache",))
    rows = fn.capture(torch.ones(8, 3), autograph.per_bucket(caches))
    assert [r.state for r in rows] == ["graphed"] * 3
    assert watched == [8]  # the largest bucket only: the family's first
    assert all(torch.equal(c, torch.zeros_like(c)) for c in caches.values())  # taken back
    x = torch.randn(3, 3)
    out = fn(x, caches[4])
    assert torch.allclose(out, x * 3)  # cache was zero: cache + x, then x * 2 + cache
    assert torch.allclose(caches[4][:3], x) and torch.equal(caches[4][3:], torch.zeros(1, 3))
    (four,) = [r for r in fn.stats() if r.bucket == 4]
    assert (four.state, four.calls, four.replays) == ("graphed", 1, 1)  # its first call replays
