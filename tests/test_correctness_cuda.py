"""Never a wrong result, on a real GPU: HF's default DynamicCache, capture-aware HF code, and
static outputs across keys and after their graph is gone (issues 8 and 15)."""

import copy

import pytest
import torch

import autograph

from conftest import autograph_warnings, requires_cuda
from helpers.models import llama

pytestmark = [pytest.mark.cuda, requires_cuda]


def greedy_decode(model, prompt, steps, cache=None):
    """A hand-written greedy loop: prefill, then one token per step, HF's cache object."""
    tokens, logits = [], []
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    cache = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
    return torch.cat(tokens, 1), logits


def test_hf_dynamic_cache_in_a_region_gives_eagers_tokens_and_names_the_tensor(caught):
    transformers, config, model = llama(layers=2, hidden=256)
    region_model = copy.deepcopy(model)
    prompt = torch.randint(0, 1024, (1, 8), device="cuda")
    with torch.inference_mode():
        expected_tokens, expected_logits = greedy_decode(model, prompt, 12)
        with autograph.region() as region:
            tokens, logits = greedy_decode(region_model, prompt, 12)
    assert torch.equal(tokens, expected_tokens)
    assert all(torch.equal(a, b) for a, b in zip(expected_logits, logits))
    decode_rows = [r for r in region.stats().keys if "input_ids: i64[1, 1]" in r.key]
    assert decode_rows and all(r.state == "eager" for r in decode_rows)
    assert "past_key_values.layers[0].keys" in decode_rows[0].fallback_reason
    assert "StaticCache" in decode_rows[0].fallback_reason
    assert len([m for m in autograph_warnings(caught) if "replaces" in m]) == 1


def test_hf_generate_with_the_default_cache_in_a_region_is_right(caught):
    transformers, config, model = llama(layers=2, hidden=256)
    prompt = torch.randint(0, 1024, (1, 8), device="cuda")
    with torch.inference_mode():
        expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
        # Each call makes new keys (a new DynamicCache, keyed by identity; where the mask is
        # passed, a longer one each step): after 16, calls pass through.
        for _ in range(10):
            with autograph.region():
                got = model.generate(prompt, max_new_tokens=24, do_sample=False)
            assert torch.equal(got, expected)
    churn = [m for m in autograph_warnings(caught) if "no graph replayed" in m]
    assert len(churn) == 1 and "became" in churn[0]
    (passed,) = [r for r in autograph.stats(model) if r.key == "calls passed through (keys churn)"]
    assert passed.calls > 0


def test_capture_aware_hf_bert_under_no_grad_is_graphed(caught):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=1024,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).cuda().eval()
    graphed = autograph.graphed(copy.deepcopy(model))
    ids = torch.randint(0, 1024, (4, 32), device="cuda")
    mask = torch.ones(4, 32, dtype=torch.long, device="cuda")
    mask[1, 20:] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).last_hidden_state
        for _ in range(4):
            got = graphed(ids, attention_mask=mask).last_hidden_state
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    (row,) = autograph.stats(graphed)
    assert (row.state, row.replays) == ("graphed", 3), row.fallback_reason
    assert autograph_warnings(caught) == []


def test_a_static_output_held_from_one_key_is_not_overwritten_by_another():
    @autograph.graphed(outputs="static")
    def f(x):
        return (x * 3).relu() + 1

    for _ in range(3):
        kept = f(torch.ones(1024, device="cuda"))
    for _ in range(3):
        f(torch.ones(2048, device="cuda"))  # another key, same pool
    with pytest.raises(RuntimeError, match="was overwritten by a later call"):
        kept.sum()
    assert sorted(r.state for r in f.stats()) == ["graphed", "graphed"]


def test_a_static_output_after_reset_says_its_graph_was_released():
    @autograph.graphed(outputs="static")
    def f(x):
        return x + 1

    for _ in range(3):
        kept = f(torch.zeros(4, device="cuda"))
    assert f.stats()[0].replays == 2
    f.reset()
    with pytest.raises(RuntimeError, match="belonged to a graph that was released"):
        kept.sum()
