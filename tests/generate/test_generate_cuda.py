"""autograph.generate on the GPU, with real CUDA graphs: Llama, Mistral (sliding window) and
Gemma 3, greedy and seeded sampling against model.generate, in float32 and bfloat16."""

import pytest
import torch

import autograph

from conftest import requires_cuda
from helpers.generation import assert_graphed, decode_steps, left_padded
from helpers.models import tiny_decoder

pytestmark = [
    pytest.mark.cuda,
    requires_cuda,
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]


def on_cuda(kind, dtype):
    transformers, config, model = tiny_decoder(kind)
    return transformers, config, model.to("cuda", dtype)


def same_shapes(transformers, config, model, ids, mask, **options):
    """model.generate over a StaticCache of the length autograph.generate makes for these
    calls (64), uncompiled: the same attention shapes, so the same kernels. Its default
    DynamicCache attends over the tokens so far, on the GPU often with another attention
    kernel, which in bf16 can round a near-tie the other way."""
    cache = transformers.StaticCache(config=config, max_cache_len=64)
    return model.generate(
        ids, attention_mask=mask, past_key_values=cache, disable_compile=True, **options
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_greedy_tokens_equal_transformers_on_cuda(kind, dtype):
    transformers, config, model = on_cuda(kind, dtype)
    ids, mask = (t.cuda() for t in left_padded())
    options = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    for _ in range(2):
        for rows in (1, 3):
            got = autograph.generate(model, ids[:rows], attention_mask=mask[:rows], **options)
            expected = same_shapes(transformers, config, model, ids[:rows], mask[:rows], **options)
            assert torch.equal(got, expected), (rows, got, expected)
            if dtype == torch.float32:  # and the default path's tokens too
                assert torch.equal(
                    got, model.generate(ids[:rows], attention_mask=mask[:rows], **options)
                )
    assert len(decode_steps()) == 2
    assert_graphed()


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_seeded_sampling_draws_transformers_tokens_on_cuda(kind):
    # The graph's draws come from the default CUDA generator at the offsets eager's would use:
    # a replay advances the generator by what the captured kernels consumed.
    transformers, config, model = on_cuda(kind, torch.float32)
    ids, mask = (t.cuda() for t in left_padded())
    options = dict(
        max_new_tokens=16,
        do_sample=True,
        top_k=20,
        top_p=0.9,
        temperature=0.8,
        repetition_penalty=1.2,
        pad_token_id=0,
    )
    for seed in range(3):
        torch.manual_seed(seed)
        expected = same_shapes(transformers, config, model, ids, mask, **options)
        torch.manual_seed(seed)
        got = autograph.generate(model, ids, attention_mask=mask, **options)
        assert torch.equal(got, expected), (seed, got, expected)


@pytest.mark.parametrize("kind", ["llama"])
def test_the_sampled_decode_step_is_graphed_on_cuda(kind):
    transformers, config, model = on_cuda(kind, torch.float32)
    ids, mask = (t.cuda() for t in left_padded())
    options = dict(
        max_new_tokens=16,
        do_sample=True,
        top_k=20,
        top_p=0.9,
        temperature=0.8,
        repetition_penalty=1.2,
        pad_token_id=0,
    )
    for seed in range(3):
        torch.manual_seed(seed)
        autograph.generate(model, ids, attention_mask=mask, **options)
    assert_graphed()


def test_the_decode_step_is_graphed_on_the_models_own_gpu():
    _, _, model = on_cuda("llama", torch.float32)
    ids = left_padded(rows=1)[0].cuda()
    autograph.generate(model, ids, max_new_tokens=8, do_sample=False)
    autograph.generate(model, ids, max_new_tokens=8, do_sample=False)
    (row,) = decode_steps()
    assert "cuda" in row.key and row.graph_bytes >= 0
    assert_graphed()
