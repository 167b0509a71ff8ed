"""Sampling: from the same seed, autograph.generate draws the tokens model.generate draws
(temperature, top-k, top-p, min-p, the repetition penalty, rows ending on their own), through
the emulation's graphs; with buckets the draws are made for the bucket's rows, so the tokens
differ and the distribution is the same (checked statistically)."""

import pytest
import torch

import autograph

from helpers.generation import assert_graphed, left_padded
from helpers.models import tiny_decoder

SAMPLING = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "all": dict(temperature=1.3, top_k=50, top_p=0.9),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "penalty, greedy": dict(repetition_penalty=1.5, do_sample=False),
}


def seeded(call, seed):
    torch.manual_seed(seed)
    return call()


@pytest.mark.parametrize("name", SAMPLING)
def test_seeded_sampling_draws_transformers_tokens(name, emulated):
    _, _, model = tiny_decoder("llama")
    ids, mask = left_padded()
    options = dict(
        dict(do_sample=True, top_k=0),
        **SAMPLING[name],
        max_new_tokens=16,
        eos_token_id=[5, 7, 11],
        pad_token_id=0,
    )
    for seed in range(3):  # the first call warms up and captures; the next ones replay
        expected = seeded(lambda: model.generate(ids, attention_mask=mask, **options), seed)
        got = seeded(lambda: autograph.generate(model, ids, attention_mask=mask, **options), seed)
        assert torch.equal(got, expected), (seed, got, expected)
    assert_graphed()


def test_without_an_end_the_generator_is_left_where_transformers_leaves_it(emulated):
    # Steps queued after every row has ended draw too (documented); without an end none run.
    _, _, model = tiny_decoder("llama")
    ids, mask = left_padded()
    options = dict(do_sample=True, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    seeded(lambda: model.generate(ids, attention_mask=mask, **options), 0)
    expected = torch.rand(4)
    for _ in range(2):
        seeded(lambda: autograph.generate(model, ids, attention_mask=mask, **options), 0)
        assert torch.equal(torch.rand(4), expected)
    assert_graphed()


def _homogeneity_p_value(a, b):
    """The chi-square test's p-value that two count vectors come from one distribution."""
    seen = (a + b) > 0
    table = torch.stack([a[seen], b[seen]]).double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    freedom = int(seen.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2.0), statistic / 2))


def test_with_buckets_the_tokens_follow_the_same_distribution(emulated):
    # 120 rows of one prompt are 120 independent samples; in the bucket of 128 the draws are
    # made for 128 rows, so the generator's later draws differ from transformers'. Compared by
    # a chi-square test per position against transformers' own samples of the same size.
    _, _, model = tiny_decoder("llama")
    prompt = left_padded(rows=1, length=4)[0].expand(120, 4)
    options = dict(do_sample=True, temperature=3.0, top_k=8, max_new_tokens=5, eos_token_id=None)
    expected = seeded(lambda: model.generate(prompt, **options), 0)[:, 4:]
    got = seeded(lambda: autograph.generate(model, prompt, buckets=[128], **options), 0)[:, 4:]
    assert got.shape == expected.shape and not torch.equal(got, expected)
    assert_graphed()
    for position in range(1, 5):  # the first token is drawn at the prefill, the rest replayed
        a, b = (torch.bincount(t[:, position], minlength=256) for t in (got, expected))
        assert _homogeneity_p_value(a, b) > 1e-3, (position, a, b)
    # The test can tell distributions apart: greedy tokens against these samples.
    greedy = autograph.generate(
        model, prompt, buckets=[128], max_new_tokens=5, do_sample=False, eos_token_id=None
    )[:, 4:]
    assert (
        _homogeneity_p_value(
            torch.bincount(greedy[:, 2], minlength=256),
            torch.bincount(expected[:, 2], minlength=256),
        )
        < 1e-6
    )
