"""Never slower than eager (docs/design.md, "Never slower") for HF generate() in a region,
through the emulation: tokens equal eager's, and what the engine did, call by call: the churn
policy (autograph/policy/_churn.py) and generate()'s own StaticCache reused."""

import pytest
import torch

import autograph
from autograph.testing import emulate_graphs_on_cpu

from conftest import autograph_warnings, requires_cuda
from helpers.models import generate_in_a_region, generating_llama, static_generate_runs
from helpers.watched import watched_warmups

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padded mask"])
def test_generate_with_the_default_cache_passes_through_once_its_keys_churn(padded):
    model = generating_llama()
    ids = torch.randint(0, 256, (1, 8))
    options = {}
    if padded:  # a mask with padding is passed to the model, one position longer each step
        options["attention_mask"] = torch.ones_like(ids)
        options["attention_mask"][0, 0] = 0
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=16, do_sample=False, **options)
        # 16 new keys before calls pass through: 2 per generate() without a mask (a prefill
        # and a decode key per new DynamicCache), 1 per step with a growing padded mask.
        runs = [generate_in_a_region(model, ids, **options) for _ in range(10)]
    assert all(torch.equal(tokens, expected) for tokens, _ in runs)
    first, last = runs[0][1], runs[-1][1]
    assert len(first.keys) >= 2  # it was keyed before it passed through
    assert len(last.keys) <= 1 and last.captures == 0  # at most one look in the last call
    (row,) = [r for r in autograph.stats(model) if r.key == "calls passed through (keys churn)"]
    assert row.state == "eager" and row.calls > 0
    assert "never graphed" in row.fallback_reason


def test_a_first_generate_in_a_region_watches_no_call(monkeypatch):
    # A region's keys run their first call as a plain call and are watched op by op only at
    # their second (its warmup=2), and no key of a first generate() with a DynamicCache comes
    # back: the prefill is called once, and each decode step's attention mask is one position
    # longer, its input_ids [1, 1] the same. So no call is watched, and after the prefill and
    # three decode steps calls pass through; the look after 16 calls meets a key that grew
    # while calls passed through, which passes through again at once, for 32 calls.
    watched = watched_warmups(monkeypatch)
    model = generating_llama()
    ids = torch.randint(0, 256, (1, 8))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with torch.inference_mode():
        expected = model.generate(
            ids, attention_mask=mask, max_new_tokens=48, min_new_tokens=48, do_sample=False
        )
        with emulate_graphs_on_cpu(), autograph.region() as region:
            tokens = model.generate(
                ids, attention_mask=mask, max_new_tokens=48, min_new_tokens=48, do_sample=False
            )
    assert torch.equal(tokens, expected)
    stats = region.stats()
    # The prefill, 3 decode steps, then one key per look: one look (after 16 calls) in 48.
    assert len(stats.keys) == 5 and stats.captures == 0, stats
    # 48 calls: 4 keyed, 16 passed through, 1 look, the 27 left of 32 passed through.
    assert stats.passed_through == 43 and stats.eager_calls == 48, stats
    assert watched == [], watched


@pytest.mark.xfail(
    strict=True,
    reason=(
        "issue 23.2: transformers 5.x generate() builds a new StaticCache on every call "
        "(GenerationMixin._prepare_static_cache), and the model call's key holds the cache by "
        "identity, so every generate() call makes a new prefill key and a new decode key, and "
        "warms up and captures the decode step again"
    ),
)
def test_generate_with_a_static_cache_captures_once_and_replays_in_later_calls():
    expected, runs = static_generate_runs(3)
    assert all(torch.equal(tokens, expected) for tokens, _ in runs)
    assert runs[0][1].captures == 1
    for _, later in runs[1:]:
        assert later.captures == 0 and later.replays >= 14, later


def test_a_new_cache_object_per_call_passes_through_after_three_calls(caught):
    # What a region sees of generate(cache_implementation="static") on CUDA, where transformers
    # compiles the decode step itself: one prefill call per generate(), with a StaticCache
    # built anew. Each call's key dies with its cache, so waiting for 16 new keys, each
    # watched op by op, would cost about ten eager calls per call.
    model = generating_llama()
    ids = torch.randint(0, 256, (1, 8))

    def prefill():
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits

    with torch.inference_mode():
        expected = prefill()
        regions = []
        for _ in range(6):
            with emulate_graphs_on_cpu(), autograph.region() as region:
                torch.testing.assert_close(prefill(), expected)
            regions.append(region.stats())
    assert [r.passed_through for r in regions] == [0, 0, 0, 1, 1, 1]
    assert [len(r.keys) for r in regions[:3]] == [1, 1, 1]  # keyed, then not
    (row,) = [r for r in autograph.stats(model) if r.key == "calls passed through (keys churn)"]
    assert "died before they were called again" in row.fallback_reason
    messages = [m for m in autograph_warnings(caught) if "no graph replayed" in m]
    assert len(messages) == 1 and "a new object on each call" in messages[0]
    assert "Pass the same object on every call" in messages[0]


@pytest.mark.cuda
@requires_cuda
def test_generate_with_cache_implementation_static_on_cuda_passes_through(caught):
    # transformers compiles the decode step (its own CUDA graphs) from the second call on; the
    # region must add no more than a few watched prefills, and never change a token.
    model = generating_llama().cuda()
    ids = torch.randint(0, 256, (1, 8), device="cuda")
    with torch.inference_mode():
        runs = []
        for _ in range(5):
            expected = model.generate(
                ids, max_new_tokens=16, do_sample=False, cache_implementation="static"
            )
            with autograph.region() as region:
                got = model.generate(
                    ids, max_new_tokens=16, do_sample=False, cache_implementation="static"
                )
            assert torch.equal(got, expected)
            runs.append(region.stats())
    assert all(r.captures == 0 for r in runs[3:]), runs
    assert runs[-1].passed_through >= 1 and runs[-1].keys == [], runs[-1]
