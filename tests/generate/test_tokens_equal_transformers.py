"""autograph.generate gives model.generate's tokens (greedy, eager kernels) across the decoder
families that build from configs in the installed transformers, through the CPU emulation:
batch 1 and a left-padded batch, rows ending on their own, the length options and the model's
generation_config defaults; and its decode step is captured once and replayed, in later calls
too."""

import pytest
import torch

import autograph

from helpers.generation import assert_graphed, decode_steps, left_padded, replays
from helpers.models import DECODERS, tiny_decoder

NEW = 20


@pytest.mark.parametrize("kind", DECODERS)
def test_greedy_tokens_equal_transformers_batch_1_and_left_padded(kind, emulated):
    _, _, model = tiny_decoder(kind)
    ids, mask = left_padded()
    options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for _ in range(2):  # the second call replays the graphs of the first
        expected = model.generate(ids[:1], **options)
        assert torch.equal(autograph.generate(model, ids[:1], **options), expected)
        expected = model.generate(ids, attention_mask=mask, **options)
        assert torch.equal(autograph.generate(model, ids, attention_mask=mask, **options), expected)
    rows = decode_steps()
    assert len(rows) == 2  # one key per batch size: its graph served both calls
    assert_graphed(rows)
    for row in rows:  # 1 warmup; then the capture call and every later step replay
        steps = 2 * (expected.shape[1] - ids.shape[1] - 1)
        assert row.calls == steps and row.replays == steps - 1, row


def _ends(model, ids, mask, *positions):
    """Eos ids that end the rows at the given (row, new-token index) places, taken from the
    tokens the model makes without an eos."""
    free = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[:, ids.shape[1] :]
    return sorted({int(free[row, index]) for row, index in positions})


@pytest.mark.parametrize("kind", ["llama", "gemma3", "gpt2"])
def test_rows_end_on_their_own_and_are_padded_after_as_transformers_does(kind, emulated):
    _, _, model = tiny_decoder(kind)
    ids, mask = left_padded()
    eos = _ends(model, ids, mask, (0, 3), (2, 9))  # two eos ids: rows end apart
    options = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=1)
    expected = model.generate(ids, attention_mask=mask, **options)
    got = autograph.generate(model, ids, attention_mask=mask, **options)
    assert torch.equal(got, expected)
    assert (got[0, ids.shape[1] + 4 :] == 1).all()  # row 0 padded after its end
    one = dict(options, eos_token_id=eos[0])  # one eos id, as an int
    assert torch.equal(
        autograph.generate(model, ids, attention_mask=mask, **one),
        model.generate(ids, attention_mask=mask, **one),
    )


def test_generation_stops_when_every_row_has_ended_and_the_extra_steps_never_show(emulated):
    _, _, model = tiny_decoder("llama")
    ids, mask = left_padded()
    eos = _ends(model, ids, mask, (0, 2), (1, 2), (2, 2))  # every row ends by its 3rd token
    options = dict(max_new_tokens=60, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = model.generate(ids, attention_mask=mask, **options)
    assert expected.shape[1] <= ids.shape[1] + 3
    for check_every in (1, 4, 8):
        before = replays()
        got = autograph.generate(
            model, ids, attention_mask=mask, check_every=check_every, **options
        )
        assert torch.equal(got, expected)
        # Steps queued after the end: at most two checks' worth, never the 59 steps left.
        assert replays() - before <= 2 * check_every + 2
    assert_graphed()


@pytest.mark.parametrize(
    "options",
    [
        dict(min_new_tokens=6),
        dict(min_length=12),
        dict(min_new_tokens=4, min_length=14),
        dict(max_length=15),
        dict(max_new_tokens=1),
        dict(max_new_tokens=2),
    ],
    ids=["min_new_tokens", "min_length", "both minima", "max_length", "one token", "two tokens"],
)
def test_length_options_give_transformers_tokens(options, emulated):
    _, _, model = tiny_decoder("qwen2")
    ids, mask = left_padded()
    eos = _ends(model, ids, mask, (0, 0), (1, 1), (2, 1))  # eos comes first: blocked
    options = dict(
        dict(max_new_tokens=NEW), **options, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    expected = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(autograph.generate(model, ids, attention_mask=mask, **options), expected)


def test_the_models_generation_config_defaults_are_used(emulated):
    _, _, model = tiny_decoder("mistral")
    ids, mask = left_padded()
    config = model.generation_config
    config.max_new_tokens, config.do_sample, config.pad_token_id = 9, False, 0
    config.eos_token_id = _ends(model, ids, mask, (1, 4))
    expected = model.generate(ids, attention_mask=mask)
    assert torch.equal(autograph.generate(model, ids, attention_mask=mask), expected)
    assert expected.shape[1] == ids.shape[1] + 9


def test_an_attention_mask_is_inferred_from_pad_ids_as_transformers_does(emulated):
    _, _, model = tiny_decoder("llama")
    ids, _ = left_padded()
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(autograph.generate(model, ids, **options), model.generate(ids, **options))


def test_prompts_of_other_lengths_reuse_the_cache_and_the_graph(emulated):
    _, _, model = tiny_decoder("llama")
    options = dict(max_new_tokens=10, do_sample=False, eos_token_id=None)
    for length in (5, 9, 3, 30):  # 30 + 10 fits the cache of 64 made for the first
        ids = left_padded(rows=2, length=length, seed=length)[0][:, :]
        assert torch.equal(
            autograph.generate(model, ids, **options), model.generate(ids, **options)
        )
    (row,) = decode_steps()
    assert row.calls == 4 * 9 and row.replays == 4 * 9 - 1  # one capture, for all four
    ids = left_padded(rows=2, length=60)[0]  # 70 positions: a new, longer cache
    assert torch.equal(autograph.generate(model, ids, **options), model.generate(ids, **options))
    (row,) = decode_steps()
    assert row.calls == 9 and row.state == "graphed"


def test_inference_mode_calls_and_plain_calls_each_get_their_decoder(emulated):
    _, _, model = tiny_decoder("llama")
    ids, mask = left_padded()
    options = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = model.generate(ids, attention_mask=mask, **options)
    with torch.inference_mode():
        assert torch.equal(autograph.generate(model, ids, attention_mask=mask, **options), expected)
    got = autograph.generate(model, ids, attention_mask=mask, **options)
    assert torch.equal(got, expected) and not got.is_inference()
    assert len(decode_steps()) == 2


def test_inside_a_region_the_decode_step_is_graphed_and_the_tokens_are_the_same(emulated):
    _, _, model = tiny_decoder("llama")
    ids, mask = left_padded()
    options = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = model.generate(ids, attention_mask=mask, **options)
    for _ in range(2):
        with autograph.region(buckets=[4, 8]):  # not applied to the decode step's state
            got = autograph.generate(model, ids, attention_mask=mask, **options)
        assert torch.equal(got, expected)
    (row,) = decode_steps()
    assert row.function.endswith("3 rows]") and row.replays == 2 * 11 - 1
