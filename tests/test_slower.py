"""Never slower than eager (issue 23; docs/design.md, "Never slower") for HF generate() in a region,
through the emulation: tokens equal eager's, and what the engine did, call by call. These fail until
the churn policy (autograph/_churn.py) is wired in and generate()'s own StaticCache is reused."""
import pytest
import torch

import autograph
from autograph.testing import emulate_graphs_on_cpu

transformers = pytest.importorskip("transformers")


def tiny_llama():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def generate_in_a_region(model, ids, **options):
    with emulate_graphs_on_cpu(), autograph.region() as region:
        tokens = model.generate(ids, max_new_tokens=16, do_sample=False, **options)
    return tokens, region.stats()


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padded mask"])
def test_generate_with_the_default_cache_passes_through_once_its_keys_churn(padded):
    model = tiny_llama()
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
    assert len(first.keys) >= 2  # it was keyed, and watched, before it passed through
    assert len(last.keys) <= 1 and last.captures == 0  # at most one look in the last call
    row, = [r for r in autograph.stats(model) if r.key == "calls passed through (keys churn)"]
    assert row.state == "eager" and row.calls > 0
    assert "never graphed" in row.fallback_reason


@pytest.mark.xfail(strict=True, reason=(
    "issue 23.2: transformers 5.x generate() builds a new StaticCache on every call "
    "(GenerationMixin._prepare_static_cache), and the model call's key holds the cache by "
    "identity, so every generate() call makes a new prefill key and a new decode key, and "
    "warms up and captures the decode step again"))
def test_generate_with_a_static_cache_captures_once_and_replays_in_later_calls():
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 8))
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=16, do_sample=False,
                                  cache_implementation="static")
        runs = [generate_in_a_region(model, ids, cache_implementation="static")
                for _ in range(3)]
    assert all(torch.equal(tokens, expected) for tokens, _ in runs)
    assert runs[0][1].captures == 1
    for _, later in runs[1:]:
        assert later.captures == 0 and later.replays >= 14, later
