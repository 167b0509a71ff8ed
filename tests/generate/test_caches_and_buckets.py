"""The caches autograph.generate decodes over: a StaticCache of the caller's (its tokens, and
the cache left as model.generate leaves it), batch sizes through buckets, and compile=True
stacked under the graph."""

import gc
import weakref

import pytest
import torch

import autograph

from conftest import autograph_warnings
from helpers.generation import assert_graphed, decode_steps, left_padded, prefills
from helpers.models import tiny_decoder

OPTIONS = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
# transformers >= 5.18 names the argument cache; past_key_values works in 5.17 and later.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def test_a_callers_static_cache_gives_transformers_tokens_and_is_left_as_it_leaves_it(emulated):
    transformers, config, model = tiny_decoder("llama")
    ids, mask = left_padded()
    eos = [
        int(t)
        for t in model.generate(ids, attention_mask=mask, eos_token_id=None, **OPTIONS)[:, 6 + 4]
    ]  # rows end at their 5th
    options = dict(OPTIONS, eos_token_id=eos)
    ours, theirs = (transformers.StaticCache(config=config, max_cache_len=40) for _ in range(2))
    for _ in range(2):  # the caller resets the cache between calls; the graph is kept
        ours.reset()
        theirs.reset()
        got = autograph.generate(model, ids, attention_mask=mask, past_key_values=ours, **options)
        expected = model.generate(ids, attention_mask=mask, past_key_values=theirs, **options)
        assert torch.equal(got, expected)
        for mine, its in zip(ours.layers, theirs.layers):
            assert int(mine.cumulative_length) == int(its.cumulative_length)
            assert torch.equal(mine.keys, its.keys) and torch.equal(mine.values, its.values)
    (row,) = decode_steps()
    assert row.state == "graphed" and row.replays > 0


def test_a_prompt_length_that_repeats_prefills_from_a_graph(emulated):
    # The prefill was eager at every call: an 8-layer Llama's eager forward is about 10% of
    # a 64-token call on the H200. A length's first call prefills eagerly, its second warms
    # the prefill's key up, its third captures it (and replays it once), later ones replay.
    _, _, model = tiny_decoder("llama")
    ids, mask = left_padded()
    for call in range(5):
        got = autograph.generate(model, ids, attention_mask=mask, **OPTIONS)
        assert torch.equal(got, model.generate(ids, attention_mask=mask, **OPTIONS)), call
    (row,) = prefills()
    assert (row.state, row.calls, row.eager_calls, row.replays) == ("graphed", 4, 1, 3)
    other, other_mask = left_padded(length=9, seed=2)  # a length seen once: eager, no key
    got = autograph.generate(model, other, attention_mask=other_mask, **OPTIONS)
    assert torch.equal(got, model.generate(other, attention_mask=other_mask, **OPTIONS))
    assert len(prefills()) == 1
    assert_graphed()


def test_the_prompt_lengths_chosen_for_graphs_stay_graphed(emulated, caught):
    # Found by a hostile review: once a ninth length repeated, no length's prefill replayed
    # (their graphs held, unused); and one length under 20 sampling options made 20 prefill
    # keys, warning of max_graphs, an option autograph.generate does not take.
    _, _, model = tiny_decoder("llama")
    options = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    for length in range(3, 13):  # ten lengths, each twice: the first eight are chosen
        ids = torch.randint(3, 200, (1, length))
        for _ in range(2):
            autograph.generate(model, ids, **options)
    before = {row.function + row.key: row.replays for row in prefills()}
    for length in range(3, 11):
        autograph.generate(model, torch.randint(3, 200, (1, length)), **options)
    after = {row.function + row.key: row.replays for row in prefills()}
    assert len(after) == 8 and all(after[k] == before[k] + 1 for k in before)
    ids = torch.randint(3, 200, (1, 6))
    for temperature in (0.5, 0.7, 0.9, 1.1, 1.3, 1.5):
        torch.manual_seed(0)
        got = autograph.generate(
            model,
            ids,
            do_sample=True,
            temperature=temperature,
            **{k: v for k, v in options.items() if k != "do_sample"},
        )
        torch.manual_seed(0)
        expected = model.generate(
            ids,
            do_sample=True,
            temperature=temperature,
            **{k: v for k, v in options.items() if k != "do_sample"},
        )
        assert torch.equal(got, expected), temperature
    assert len(prefills()) == 8  # one key for length 6, whatever the options
    assert not [w for w in autograph_warnings(caught) if "max_graphs" in w]


def test_a_callers_cache_too_short_for_the_call_runs_model_generate(emulated):
    transformers, config, model = tiny_decoder("llama")
    ids, mask = left_padded()
    cache = transformers.StaticCache(config=config, max_cache_len=10)
    with pytest.warns(autograph.AutographWarning, match="StaticCache of 10 positions"):
        with pytest.raises(Exception):  # what model.generate itself does with it
            autograph.generate(model, ids, attention_mask=mask, past_key_values=cache, **OPTIONS)


def test_buckets_serve_batch_sizes_from_a_few_graphs(emulated):
    _, _, model = tiny_decoder("llama")
    for rows in (1, 2, 3, 4, 3, 5):
        ids, mask = left_padded(rows=rows, seed=rows)
        got = autograph.generate(model, ids, attention_mask=mask, buckets=[1, 4], **OPTIONS)
        expected = model.generate(ids, attention_mask=mask, **OPTIONS)
        assert torch.equal(got, expected), rows
    sizes = sorted(row.function for row in decode_steps())
    assert sizes == [f"generate_decode_step[LlamaForCausalLM, {n} rows]" for n in (1, 4, 5)]
    assert_graphed()


def test_compile_stacks_torch_compile_under_the_graph(emulated):
    # On the CPU the emulation records ATen ops, so the compiled step uses a Dynamo backend
    # whose ops go through the dispatcher (Inductor's CPU kernels would not be recorded).
    torch._dynamo.reset()
    _, _, model = tiny_decoder("llama")
    ids, mask = left_padded()
    expected = model.generate(ids, attention_mask=mask, **OPTIONS)
    for _ in range(2):
        got = autograph.generate(
            model, ids, attention_mask=mask, compile={"backend": "aot_eager"}, **OPTIONS
        )
        assert torch.equal(got, expected)
    assert_graphed()
    torch._dynamo.reset()


def test_the_decoders_kept_do_not_keep_the_model_or_a_callers_cache_alive(emulated):
    transformers, config, model = tiny_decoder("llama")
    ids, mask = left_padded()
    cache = transformers.StaticCache(config=config, max_cache_len=40)
    autograph.generate(model, ids, attention_mask=mask, **OPTIONS)
    autograph.generate(model, ids, attention_mask=mask, past_key_values=cache, **OPTIONS)
    assert len(decode_steps()) == 2
    gone = [weakref.ref(model), weakref.ref(cache)]
    del model, cache
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
    assert decode_steps() == []
