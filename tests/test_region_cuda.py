"""``autograph.region()`` on a real GPU: an HF decode loop. The region's other tests run on
the GPU too, in test_region.py."""
import copy

import pytest
import torch

import autograph
from conftest import autograph_warnings, is_label_of, requires_cuda, states
from test_cuda import llama, static_cache

pytestmark = [pytest.mark.cuda, requires_cuda]


def test_hf_llama_decode_loop_in_a_region_matches_eager(caught):
    transformers, config, model = llama()
    region_model = copy.deepcopy(model)
    prompt = torch.randint(0, 1024, (1, 8), device="cuda")
    tokens = torch.randint(0, 1024, (20, 1, 1), device="cuda")

    def decode(m):
        cache = static_cache(transformers, config)
        logits = []
        m(input_ids=prompt, past_key_values=cache, use_cache=True,
          cache_position=torch.arange(8, device="cuda"))
        for step in range(20):
            out = m(input_ids=tokens[step], past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([8 + step], device="cuda"))
            logits.append(out.logits)
        return logits

    with torch.inference_mode():
        expected = decode(model)
        with autograph.region() as region:
            got = decode(region_model)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"decode step {step} differs"
    stats = region.stats()
    assert (stats.captures, stats.replays) == (1, 19)
    assert stats.eager_calls == 2   # the prefill (a key of its own) and the decode's warmup
    # the prefill stays in warmup (one call), the decode step is graphed: nothing else, no
    # key for the model's submodules
    assert states(region) == [("warmup", 1, 1, 0), ("graphed", 20, 1, 19)]
    assert autograph.stats(region_model) == stats.keys
    assert all(is_label_of(r.function, type(region_model)) for r in stats.keys)
    assert autograph.stats(model) == []              # the eager reference was not graphed
    assert autograph_warnings(caught) == []
