"""``autograph.region()`` on a real GPU: an HF decode loop. The region's other tests run on
the GPU too, in test_region.py."""

import copy

import pytest
import torch

import autograph

from conftest import autograph_warnings, is_label_of, requires_cuda, states
from helpers.models import llama, static_decode

pytestmark = [pytest.mark.cuda, requires_cuda]


def test_hf_llama_decode_loop_in_a_region_matches_eager(caught):
    transformers, config, model = llama()
    region_model = copy.deepcopy(model)
    prompt = torch.randint(0, 1024, (1, 8), device="cuda")
    tokens = torch.randint(0, 1024, (20, 1, 1), device="cuda")

    expected = static_decode(model, transformers, config, prompt, tokens)
    with autograph.region() as region:
        got = static_decode(region_model, transformers, config, prompt, tokens)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"decode step {step} differs"
    stats = region.stats()
    assert (stats.captures, stats.replays) == (1, 18)
    # the prefill (a key of its own, one plain call) and the decode's first two steps: a
    # plain call and the watched warmup (the region's warmup=2)
    assert stats.eager_calls == 3
    # the prefill stays in warmup (one call), the decode step is graphed: nothing else, no
    # key for the model's submodules
    assert states(region) == [("warmup", 1, 1, 0), ("graphed", 20, 2, 18)]
    assert autograph.stats(region_model) == stats.keys
    assert all(is_label_of(r.function, type(region_model)) for r in stats.keys)
    assert autograph.stats(model) == []  # the eager reference was not graphed
    assert autograph_warnings(caught) == []
