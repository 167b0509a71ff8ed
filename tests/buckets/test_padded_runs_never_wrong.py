"""Buckets that are never wrong (issue 22; docs/design.md, "Buckets"): every run of a bucketed key
sees the padded arguments, outputs are sliced back only where evidence shows that their dim
follows the batch, and functions whose real rows change with the padding are caught.

Each test failed on the engine of 70aa60d (issue 22); the wiring of ``_batch_dims``,
``_row_mixing`` and ``_bucket_runs`` makes them pass."""

import dataclasses
import logging
import random
import sys

import pytest
import torch

import autograph

from conftest import python_run_log, states
from helpers.models import tiny_llama


def by_bucket(fn):
    return sorted((r.bucket, r.state, r.calls, r.replays) for r in autograph.stats(fn))


# ---- (a) per-bucket state passed by static_argnames sees the padded arguments ----


def test_every_run_of_a_bucketed_key_sees_the_padded_arguments(device):
    log_run = python_run_log()
    seen = log_run.runs

    @autograph.graphed(buckets=[4, 8], static_argnames=("cache",), bucket_outputs=0)
    def store(x, cache):
        log_run((x.shape[0], cache.shape[0]))
        assert x.shape[0] == cache.shape[0], "per-bucket state of another size"
        cache[: x.shape[0]] = x * 2
        return x + 1

    caches = {4: torch.zeros(4, 5, device=device), 8: torch.zeros(8, 5, device=device)}
    for n in (3, 3, 3, 3, 6, 6, 6):
        bucket = 4 if n <= 4 else 8
        x = torch.randn(n, 5, device=device)
        out = store(x, caches[bucket])
        assert out.shape == (n, 5) and torch.equal(out, x + 1)
        assert torch.equal(caches[bucket][:n], x * 2)
        assert torch.equal(caches[bucket][n:], torch.zeros(bucket - n, 5, device=device))
    assert all(rows == cache for rows, cache in seen)
    assert sorted(set(seen)) == [(4, 4), (8, 8)]
    assert by_bucket(store) == [(4, "graphed", 4, 3), (8, "graphed", 3, 2)]


def test_the_eager_calls_of_a_bucketed_key_see_the_padded_arguments(device, caught):
    log_run = python_run_log()
    seen = log_run.runs

    @autograph.graphed(buckets=[4], static_argnames=("cache",), bucket_outputs=0)
    def store(x, cache):
        log_run(x.shape[0])
        cache[: x.shape[0]] = x
        if x.sum().item() > 1e9:  # a host read: this key runs eagerly
            return x * 0
        return x * 3

    cache = torch.zeros(4, 2, device=device)
    for _ in range(4):
        x = torch.randn(3, 2, device=device)
        assert torch.equal(store(x, cache), x * 3)
        assert torch.equal(cache[:3], x)
    assert seen == [4] * 5  # four calls, and the capture that found .item()
    (row,) = store.stats()
    assert row.state == "eager" and ".item()" in row.fallback_reason


# ---- (b) HF Llama decode with one StaticCache per bucket ----


def test_hf_llama_decodes_with_one_static_cache_per_bucket(device):
    transformers, config, model = tiny_llama(device)
    buckets, prompt_len, decode_steps, max_len = [1, 2, 4, 8], 4, 4, 16

    def new_cache():
        return transformers.StaticCache(config=config, max_cache_len=max_len)

    def run(fn, ids, cache):
        logits = [fn(ids, torch.arange(prompt_len, device=device), cache)]
        for i in range(decode_steps):
            token = logits[-1][:, -1:].argmax(-1)
            logits.append(fn(token, torch.tensor([prompt_len + i], device=device), cache))
        return logits

    def decode(ids, pos, cache):
        return model(
            input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True
        ).logits

    step = autograph.graphed(
        decode, buckets=buckets, bucket_args={"ids": 0}, static_argnames=("cache",)
    )
    caches = {b: new_cache() for b in buckets}
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for batch in (1, 3, 5, 8):
            ids = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=generator).to(
                device
            )
            bucket = next(b for b in buckets if b >= batch)
            caches[bucket].reset()  # in place: graphs read it by address
            got = run(step, ids, caches[bucket])
            expected = run(decode, ids, new_cache())
            for g, e in zip(got, expected):
                assert g.shape == e.shape
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    decode_keys = {r.bucket: r for r in step.stats() if "ids: i64[" in r.key and ", 1]" in r.key}
    assert {b: r.state for b, r in decode_keys.items()} == {
        1: "graphed",
        4: "graphed",
        8: "graphed",
    }
    assert all(r.replays >= decode_steps - 2 for r in decode_keys.values())


# ---- (c) outputs are sliced only where their dim follows the batch ----


def test_an_output_whose_batch_is_not_in_dim_0_is_sliced_there(device):
    @autograph.graphed(buckets=[4, 8])
    def twice(x):
        return torch.stack([x, x])

    for n in (3, 3, 3, 3):
        x = torch.randn(n, 5, device=device)
        out = twice(x)
        assert out.shape == (2, n, 5) and torch.equal(out, torch.stack([x, x]))
    assert by_bucket(twice) == [(4, "graphed", 4, 3)]  # a warmup, the capture's replay, 2


def test_bucket_args_in_dim_1_slice_the_outputs_that_follow_it(device):
    @autograph.graphed(buckets=[4, 8], bucket_args={"x": 1})
    def column_sums(x):
        acc = x * 2
        return acc.sum(0)

    for _ in range(4):
        x = torch.randn(6, 3, device=device)
        out = column_sums(x)
        assert out.shape == (3,) and torch.allclose(out, (x * 2).sum(0))
    assert by_bucket(column_sums) == [(4, "graphed", 4, 3)]


def test_an_output_that_only_equals_the_bucket_after_a_call_at_the_buckets_size(device):
    @autograph.graphed(buckets=[4, 8])
    def project(x, w):
        return x @ w, w.sum(0)

    w = torch.randn(5, 4, device=device)
    for n in (4, 3, 3, 3, 3):
        x = torch.randn(n, 5, device=device)
        out, total = project(x, w)
        assert out.shape == (n, 4) and torch.allclose(out, x @ w)
        assert total.shape == (4,) and torch.allclose(total, w.sum(0))
    (row,) = project.stats()
    assert row.state == "graphed" and row.replays >= 2


def test_keys_made_by_capture_slice_only_what_follows_the_batch(device):
    @autograph.graphed(buckets=[4, 8])
    def project(x, w):
        return x @ w, w.sum(0)

    w = torch.randn(5, 4, device=device)
    project.capture(torch.randn(8, 5, device=device), w)
    for n in (3, 7, 4, 8):
        x = torch.randn(n, 5, device=device)
        out, total = project(x, w)
        assert out.shape == (n, 4) and torch.allclose(out, x @ w)
        assert total.shape == (4,) and torch.allclose(total, w.sum(0))
    assert by_bucket(project) == [(4, "graphed", 2, 2), (8, "graphed", 2, 2)]


# ---- (d) functions whose real rows change with the padding ----


def _eager_with_the_reason_or_right(fn):
    """Every call was already checked against eager; here: the key ran eagerly with a reason,
    or it replayed its graph (made right)."""
    (row,) = autograph.stats(fn)
    if row.state == "eager":
        assert row.fallback_reason
    else:
        assert row.state == "graphed" and row.replays >= 2


def test_a_mean_over_the_batch_is_eager_with_the_reason_or_right(device, caught):
    @autograph.graphed(buckets=[4])
    def centre(x):
        return x - x.mean(0)

    for _ in range(4):
        x = torch.randn(3, 5, device=device)
        torch.testing.assert_close(centre(x), x - x.mean(0))
    assert states(centre)[0][1] == 4
    _eager_with_the_reason_or_right(centre)


def test_batch_norm_in_train_mode_is_eager_with_the_reason_or_right(device, caught):
    norm = torch.nn.BatchNorm1d(5).to(device).train()
    reference = torch.nn.BatchNorm1d(5).to(device).train()
    graphed = autograph.graphed(norm, buckets=[4])
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 5, device=device)
            torch.testing.assert_close(graphed(x), reference(x))
            torch.testing.assert_close(norm.running_mean, reference.running_mean)
            torch.testing.assert_close(norm.running_var, reference.running_var)
    assert norm.num_batches_tracked.item() == reference.num_batches_tracked.item() == 4
    _eager_with_the_reason_or_right(graphed)


def test_a_returned_batch_size_is_eager_with_the_reason_or_right(device, caught):
    @autograph.graphed(buckets=[4])
    def with_size(x):
        return x * 2, x.shape[0]

    for _ in range(4):
        x = torch.randn(3, 5, device=device)
        out, size = with_size(x)
        assert size == 3 and torch.equal(out, x * 2)
    _eager_with_the_reason_or_right(with_size)


# ---- (e) verify checks the capture call's own (padded) result ----


def test_verify_checks_the_result_of_the_capture_call_of_a_bucketed_key(device, caught):
    results = []

    @autograph.graphed(buckets=[4], verify=3)
    def centre(x):
        return x - x.mean(0)

    for _ in range(4):
        x = torch.randn(3, 5, device=device)
        results.append((centre(x), x - x.mean(0)))
    for got, expected in results:
        torch.testing.assert_close(got, expected)
    (row,) = centre.stats()
    assert row.state == "eager" and row.fallback_reason


# ---- decision 3: per-bucket state whose output dims one padded run cannot tell ----


class RowCache:
    """Per-bucket state as serving code writes it: rows of its bucket's size and a position."""

    def __init__(self, rows, device):
        self.kv = torch.zeros(rows, 4, 6, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)


def test_per_bucket_state_decides_its_output_dims_at_the_first_call(device):
    # Raised "its outputs cannot be sliced back to 3 rows" at the first call of 3 rows: one
    # padded run shows one size. A run on fake tensors with the batch dim symbolic shows it.
    weight = torch.randn(6, 6, device=device)

    def step(x, cache):
        cache.kv.index_copy_(1, cache.pos.view(1), (x @ weight).unsqueeze(1))
        cache.pos.add_(1)
        return cache.kv.sum(1) + x, cache.pos.clone(), weight.sum(0)

    graphed = autograph.graphed(step, buckets=[2, 4, 8], static_argnames=("cache",))
    caches = {b: RowCache(b, device) for b in (2, 4, 8)}
    expected = {b: RowCache(b, device) for b in (2, 4, 8)}
    for rows in (3, 3, 3, 3, 7, 7, 7, 2):
        bucket = next(b for b in (2, 4, 8) if b >= rows)
        x = torch.randn(rows, 6, device=device)
        out, pos, total = graphed(x, caches[bucket])
        padded = torch.cat([x, x.new_zeros(bucket - rows, 6)])
        want, want_pos, want_total = step(padded, expected[bucket])
        assert out.shape == (rows, 6) and total.shape == (6,)
        torch.testing.assert_close(out, want[:rows])
        assert torch.equal(pos, want_pos) and torch.equal(total, want_total)
    for bucket in (2, 4, 8):
        assert torch.equal(caches[bucket].kv, expected[bucket].kv)
    assert by_bucket(graphed) == [(2, "warmup", 1, 0), (4, "graphed", 4, 3), (8, "graphed", 3, 2)]


def test_a_dim_of_the_buckets_size_by_chance_is_not_sliced(device):
    # A hidden size of 4 in a bucket of 4: the fake run tells the weight's dim from the batch.
    weight = torch.randn(4, 4, device=device)

    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def step(x, cache):
        cache[: x.shape[0]] = x @ weight
        return x @ weight, weight.sum(1), cache[: x.shape[0]] * 2

    cache = torch.zeros(4, 4, device=device)
    for _ in range(4):
        x = torch.randn(3, 4, device=device)
        out, per_row_of_weight, doubled = step(x, cache)
        assert out.shape == doubled.shape == (3, 4) and per_row_of_weight.shape == (4,)
        torch.testing.assert_close(out, x @ weight)
        torch.testing.assert_close(doubled, x @ weight * 2)
    assert states(step) == [("graphed", 4, 1, 3)]


def test_the_fake_run_leaves_the_python_state_as_it_was(device):
    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def step(x, cache):
        cache.calls += 1  # Python state a replay would skip: this key runs eagerly
        cache.kv[: x.shape[0], 0] = x
        return x * 2

    cache = RowCache(4, device)
    cache.calls = 0
    for calls in range(1, 5):
        x = torch.randn(3, 6, device=device)
        torch.testing.assert_close(step(x, cache), x * 2)
        assert cache.calls == calls
        assert isinstance(cache.kv, torch.Tensor) and torch.equal(cache.kv[:3, 0], x)
    assert states(step)[0][0] == "eager"


class WeightHolder:
    """A plain object holding a weight (functional style): the same in every bucket."""

    def __init__(self, device):
        self.w = torch.randn(4, 6, device=device)  # 4 features: the bucket's size by chance


class HeadsCache:
    def __init__(self, rows, device):
        self.kv = torch.zeros(rows, 4, 6, device=device)  # 4 heads in every bucket


def served_or_refused(graphed, calls):
    """Each call's output shapes as eager's on the call's rows, or a ValueError naming the
    fixes; never other shapes."""
    for args, expected_shapes in calls:
        try:
            got = graphed(*args)
        except ValueError as error:
            assert "bucket_outputs=" in str(error)
            continue
        assert [tuple(t.shape) for t in got] == expected_shapes


@pytest.mark.parametrize("holder", ["weight_in_an_object", "heads_of_the_buckets_size"])
def test_a_size_of_held_state_left_free_is_no_evidence(device, holder):
    # The fake run took the free sizes of whatever the arguments held to grow with the
    # bucket: a weight's 4 features came back as 3, a cache's 4 heads as 3 (silently).
    if holder == "weight_in_an_object":

        def step(x, params, cache):
            cache[: x.shape[0]] = x
            return (x @ params.w.T,)

        held = (WeightHolder(device), torch.zeros(4, 6, device=device))
        expected = [(3, 4)]
    else:

        def step(x, cache):
            cache.kv[:, 0] = x
            return cache.kv.sum(-1), cache.kv[0].sum(-1)

        held = (HeadsCache(4, device),)
        expected = [(3, 4), (4,)]
    graphed = autograph.graphed(step, buckets=[4], static_argnames=("cache",))
    calls = [((torch.randn(3, 6, device=device), *held), expected) for _ in range(4)]
    served_or_refused(graphed, calls)


@dataclasses.dataclass
class Weights:
    w: torch.Tensor


def test_a_dataclass_argument_does_not_shift_which_tensor_is_padded(device):
    # The fake run found the padded tensor by its index among torch pytree's tensors, which
    # do not descend into dataclasses as keys do: the unpadded `scale` was taken for the batch.
    @autograph.graphed(buckets=[4], static_argnames=("cache",), bucket_args={"x": 0})
    def step(cache, weights, x, scale):
        cache[: x.shape[0]] = x @ weights.w
        return x * 2 + scale.sum()

    cache, weights = torch.zeros(4, 6, device=device), Weights(torch.randn(6, 6, device=device))
    scale = torch.randn(5, 6, device=device)
    for _ in range(4):
        x = torch.randn(3, 6, device=device)
        torch.testing.assert_close(step(cache, weights, x, scale), x * 2 + scale.sum())
    assert states(step) == [("graphed", 4, 1, 3)]


SERVED_TOKENS = {"count": 0, "last": None}


def account(x):
    SERVED_TOKENS["count"] += x.shape[0]
    SERVED_TOKENS["last"] = x


def test_the_fake_run_leaves_no_fake_value_in_a_helpers_globals(device):
    from torch._subclasses.fake_tensor import FakeTensor

    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def step(x, cache):
        account(x)
        cache.kv[: x.shape[0], 0] = x
        return x * 2

    python_random = random.getstate()
    step(torch.randn(3, 6, device=device), RowCache(4, device))
    assert type(SERVED_TOKENS["count"]) is int
    assert not isinstance(SERVED_TOKENS["last"], (FakeTensor, torch.SymInt))
    assert random.getstate() == python_random


class Served:
    """A class-level counter, as a metrics registry keeps one."""

    rows = 0


class Holder:
    pass


# A plain object of this module's globals, and one inside a dict that only a helper names.
REGISTRY = Holder()
BOXES = {"rows": Holder()}


def note_rows(n):
    BOXES["rows"].value = n


def test_the_fake_run_leaves_no_fake_value_in_a_class_or_an_object_a_call_gets(device):
    # Found by a hostile review: Served.rows += x.shape[0] became 's26 + 4' after the run on
    # fake tensors (a class attribute is no module global), and range(Served.rows) then
    # yielded 8 items.
    def remember(holder, x):
        holder.last_rows = x.shape[0]

    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def update(x, cache):
        cache.kv[: x.shape[0], 0] = x
        Served.rows += x.shape[0]
        remember(REGISTRY, x)
        return x * 2

    Served.rows = 0
    out = update(torch.randn(3, 6, device=device), RowCache(4, device))
    assert out.shape == (3, 6)
    assert type(Served.rows) is int and type(REGISTRY.last_rows) is int
    assert list(range(Served.rows)) == list(range(Served.rows))  # no symbolic size


def test_a_fake_value_the_run_cannot_put_back_is_said_loudly(device):
    # An object in a dict that only a helper names: nothing copied it before the run, which
    # finds the fake value after it and says so, instead of leaving it there silently.
    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def update(x, cache):
        cache.kv[: x.shape[0], 0] = x
        note_rows(x.shape[0])
        return x * 2

    # (the suite freezes the objects made at its start, which hides the holder's name)
    first, other = RowCache(4, device), RowCache(4, device)
    with pytest.raises(RuntimeError, match=r"fake values in .*bucket_outputs="):
        update(torch.randn(3, 6, device=device), first)
    for cache in (first, other, other):  # another key of its family (other's cache) too
        x = torch.randn(3, 6, device=device)
        torch.testing.assert_close(update(x, cache), x * 2)
        assert BOXES["rows"].value == 3  # eager from now on, as called
        assert torch.equal(cache.kv[:3, 0], x)
    rows = autograph.stats(update)
    assert len(rows) == 2 and all(r.replays == 0 and r.eager_calls == r.calls for r in rows)
    assert all("left fake values" in r.fallback_reason for r in rows)


def test_what_a_kept_log_record_holds_of_the_fake_run_is_no_ones_state(device, caplog):
    # Found by a hostile review: pytest keeps each log record, and a record's arguments (or
    # an exception's traceback, logged with exc_info) held the run's symbolic size; that was
    # taken for state the run left, and a call that works eagerly raised in CI.
    log = logging.getLogger("a_server")

    def fused(x):
        raise NotImplementedError("no fused kernel here")

    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def step(x, cache):
        cache.kv[: x.shape[0], 0] = x
        log.warning("a batch of %s rows", x.shape[0])
        try:
            return fused(x)
        except NotImplementedError:
            log.warning("the slow path", exc_info=True)
            return x * 2

    cache = RowCache(4, device)
    with caplog.at_level(logging.WARNING, logger="a_server"):
        for _ in range(3):
            x = torch.randn(3, 6, device=device)
            torch.testing.assert_close(step(x, cache), x * 2)
    assert states(step) == [("graphed", 3, 1, 2)]


def after_the_call():
    return None


def test_the_fake_run_leaves_a_profiler_on(device):
    # It once chained the profile function it found (cProfile's before Python 3.12, which
    # cannot be called), broke its own run and put that profiler back as a plain function:
    # profiling stopped. (From 3.12 cProfile uses sys.monitoring, and sys.getprofile() is None.)
    import cProfile
    import pstats

    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def step(x, cache):
        cache.kv[: x.shape[0], 0] = x
        return x * 2

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        before = sys.getprofile()
        x = torch.randn(3, 6, device=device)
        torch.testing.assert_close(step(x, RowCache(4, device)), x * 2)
        after = sys.getprofile()
        after_the_call()
    finally:
        profiler.disable()
    assert after is before
    names = {name for _, _, name in pstats.Stats(profiler).stats}
    assert "after_the_call" in names


def test_the_fake_run_takes_the_captures_path_through_capture_aware_code(device):
    # transformers 5.17 reads the prompt's offset on the host unless a stream captures; the
    # fake run read it too, found nothing, and the first call of 3 rows raised.
    def capturing():  # as transformers asks (a CPU-only torch raises)
        try:
            return torch.cuda.is_current_stream_capturing()
        except Exception:
            return False

    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def step(x, cache):
        if not capturing() and cache.pos.item() == 0:
            pass  # a host read the capture skips, which no fake tensor can answer
        cache.kv[: x.shape[0], 0] = x
        return x * 2

    cache = RowCache(4, device)
    for _ in range(3):
        x = torch.randn(3, 6, device=device)
        torch.testing.assert_close(step(x, cache), x * 2)
    assert states(step) == [("graphed", 3, 1, 2)]


class LazyCache:
    """Per-bucket state whose write position its first call makes anew, as transformers 5.17's
    StaticCache moves its own to the GPU (``cumulative_length.to(device)``) at its first
    update: made inside the run that watched what the function writes."""

    def __init__(self, rows, device):
        self.kv = torch.zeros(rows, 8, 6, device=device)
        self.pos = torch.zeros((), dtype=torch.long)
        self.device = device

    def update(self, x):
        if self.pos.device != self.kv.device or not hasattr(self, "ready"):
            self.pos, self.ready = self.pos.to(self.device).clone(), True
        self.kv.index_copy_(1, self.pos.view(1), x.unsqueeze(1))
        self.pos.add_(1)
        return self.kv.sum(1) * self.pos


def test_state_made_by_the_first_run_is_restored_when_pad_rows_are_probed(device):
    # The probe of pad rows replays twice from the same state: the position made in the first
    # (watched) run was not put back, the second replay wrote one place on, and the key went
    # eager with "it mixes rows of the batch" (seen on the H200 with HF Llama). The output
    # dims are named: before torch 2.13 the fake run cannot tie index_copy_'s sizes.
    @autograph.graphed(buckets=[4], static_argnames=("cache",), bucket_outputs=0)
    def step(x, cache):
        return cache.update(x)

    cache, expected = LazyCache(4, device), LazyCache(4, device)
    for rows in (3, 3, 3, 3, 2, 2):  # a new row count probes its pad rows again
        cache.kv.zero_(), expected.kv.zero_()
        if hasattr(cache, "ready"):
            cache.pos.zero_(), expected.pos.zero_()
        x = torch.randn(rows, 6, device=device)
        want = expected.update(torch.cat([x, x.new_zeros(4 - rows, 6)]))[:rows]
        torch.testing.assert_close(step(x, cache), want)
    # Two watched warmups: the first frees the position it read (rebound to a new tensor), so
    # the next call is watched too before a capture (a key that does so on every call is eager)
    assert states(step) == [("graphed", 6, 2, 4)]


class SlotsCache:
    __slots__ = ("kv", "pos")

    def __init__(self, rows, device):
        self.kv = torch.zeros(rows, 8, 6, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)


class TupleCache:
    def __init__(self, rows, device):
        self.parts = (torch.zeros(rows, 8, 6, device=device), torch.zeros((), device=device))


def _slots_step(x, cache):
    cache.kv[:, 1] += x  # (index_copy_ ties no sizes in the fake run before torch 2.13)
    cache.pos.add_(1)
    return cache.kv.sum(1) * cache.pos


def _tuple_step(x, cache):
    kv, count = cache.parts
    kv[:, 0] += x
    count.add_(1)
    return kv.sum(1) * count


@pytest.mark.parametrize("step, cache_type", [(_slots_step, SlotsCache), (_tuple_step, TupleCache)])
def test_state_held_in_slots_or_tuples_decides_its_output_dims_at_the_first_call(
    device, step, cache_type
):
    # The fake run swapped fakes into __dict__ entries, lists and dicts only: a cache held in
    # __slots__ or a tuple stayed real, its rows the bucket's, and the first call of 3 rows
    # raised "its outputs cannot be sliced back to 3 rows".
    graphed = autograph.graphed(step, buckets=[4], static_argnames=("cache",))
    cache, expected = cache_type(4, device), cache_type(4, device)
    held = [getattr(cache, n) for n in ("kv", "pos", "parts") if hasattr(cache, n)]
    for _ in range(4):
        x = torch.randn(3, 6, device=device)
        want = step(torch.cat([x, x.new_zeros(1, 6)]), expected)[:3]
        torch.testing.assert_close(graphed(x, cache), want)
    after = [getattr(cache, n) for n in ("kv", "pos", "parts") if hasattr(cache, n)]
    assert all(a is b for a, b in zip(after, held))  # the fake run put back what it swapped
    assert states(graphed) == [("graphed", 4, 1, 3)]


def test_per_bucket_state_whose_dims_no_run_can_tell_raises_naming_the_fixes(device):
    # A real tensor's size (4, the bucket's) meets the batch in Python: the fake run's batch
    # is specialised to 4, which shows nothing about other sizes.
    table = torch.zeros(4, 5, device=device)

    @autograph.graphed(buckets=[4], static_argnames=("cache",))
    def store(x, cache):
        cache[: x.shape[0]] = x
        return x + torch.ones(table.shape[0], 5, device=x.device)

    cache = torch.zeros(4, 5, device=device)
    with pytest.raises(ValueError, match="bucket_outputs=.*capture"):
        store(torch.randn(3, 5, device=device), cache)
    assert states(store) == [("warmup", 1, 1, 0)]


def test_hf_llama_with_a_static_cache_per_bucket_serves_its_first_call_of_3_rows(device):
    transformers, config, model = tiny_llama(device)
    buckets, prompt_len = [1, 2, 4, 8], 4

    def decode(ids, pos, cache):
        return model(input_ids=ids, past_key_values=cache, cache_position=pos).logits

    step = autograph.graphed(decode, buckets=buckets, static_argnames=("cache",))
    caches = {b: transformers.StaticCache(config=config, max_cache_len=16) for b in buckets}
    generator = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for batch in (3, 3, 3, 6):
            ids = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=generator)
            ids = ids.to(device)
            bucket = next(b for b in buckets if b >= batch)
            caches[bucket].reset()
            reference = transformers.StaticCache(config=config, max_cache_len=16)
            got = step(ids, torch.arange(prompt_len, device=device), caches[bucket])
            want = decode(ids, torch.arange(prompt_len, device=device), reference)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            token = got[:, -1:].argmax(-1)
            position = torch.tensor([prompt_len], device=device)
            torch.testing.assert_close(
                step(token, position, caches[bucket]),
                decode(token, position, reference),
                rtol=1e-4,
                atol=1e-4,
            )
    prompt = [r for r in step.stats() if r.bucket == 4 and f", {prompt_len}]" in r.key]
    # On CUDA the StaticCache moves its write position to the GPU at its first update, letting
    # the CPU one go: the key is watched once more before its capture
    # (docs/design.md, "A key's life").
    expected = ("graphed", 3, 2, 1) if device == "cuda" else ("graphed", 3, 1, 2)
    assert [(r.state, r.calls, r.eager_calls, r.replays) for r in prompt] == [expected]


def test_random_outputs_are_not_taken_for_rows_that_mix(device):
    @autograph.graphed(buckets=[4])
    def noisy(x):
        return x * 2 + torch.rand_like(x)

    for _ in range(4):
        x = torch.randn(3, 5, device=device)
        out = noisy(x)
        assert out.shape == (3, 5) and ((out - x * 2) >= 0).all() and ((out - x * 2) < 1).all()
    assert states(noisy) == [("graphed", 4, 1, 3)]
