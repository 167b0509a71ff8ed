"""What autograph.generate does not serve runs model.generate as it is, with one
AutographWarning naming the option: never a silent difference."""

import sys

import pytest
import torch

import autograph

from conftest import autograph_warnings
from helpers.generation import decode_steps, left_padded
from helpers.models import tiny_decoder

transformers = pytest.importorskip("transformers")


class Collecting(transformers.generation.BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value)

    def end(self):
        pass


def _unserved(model):
    config = model.config
    sliding = transformers.StaticCache(config=tiny_decoder("mistral")[1], max_cache_len=64)
    used = transformers.StaticCache(config=config, max_cache_len=64)
    model(input_ids=torch.tensor([[4, 5]]), past_key_values=used, use_cache=True)
    return {
        "num_beams": (dict(num_beams=2), "num_beams=2"),
        "num_return_sequences": (
            dict(do_sample=True, num_return_sequences=2),
            "num_return_sequences=2",
        ),
        "return_dict_in_generate": (
            dict(return_dict_in_generate=True, output_scores=True),
            "return_dict_in_generate",
        ),
        "streamer": (dict(streamer=Collecting()), "streamer"),
        "logits_processor": (
            dict(
                logits_processor=transformers.LogitsProcessorList(
                    [transformers.NoRepeatNGramLogitsProcessor(2)]
                )
            ),
            "logits_processor",
        ),
        "stopping_criteria": (
            dict(
                stopping_criteria=transformers.StoppingCriteriaList(
                    [transformers.MaxTimeCriteria(60.0)]
                )
            ),
            "stopping_criteria",
        ),
        "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), "NoRepeatNGramLogitsProcessor"),
        "max_time": (dict(max_time=60.0), "MaxTimeCriteria"),
        "a DynamicCache": (
            dict(past_key_values=transformers.DynamicCache(config=config)),
            "DynamicCache",
        ),
        "a cache with sliding layers": (dict(past_key_values=sliding), "StaticSlidingWindowLayer"),
        "a cache holding tokens": (dict(past_key_values=used), "holds tokens already"),
        "use_cache=False": (dict(use_cache=False), "use_cache=False"),
        "prefill_chunk_size": (dict(prefill_chunk_size=2), "prefill_chunk_size=2"),
        "a model argument": (dict(position_ids=torch.arange(6).expand(3, 6)), "position_ids"),
    }


CASES = [
    "num_beams",
    "num_return_sequences",
    "return_dict_in_generate",
    "streamer",
    "logits_processor",
    "stopping_criteria",
    "no_repeat_ngram_size",
    "max_time",
    "a DynamicCache",
    "a cache with sliding layers",
    "a cache holding tokens",
    "use_cache=False",
    "prefill_chunk_size",
    "a model argument",
]


@pytest.mark.parametrize("case", CASES)
def test_an_unserved_option_runs_model_generate_with_one_warning_naming_it(case, emulated, caught):
    _, _, model = tiny_decoder("llama")
    ids, mask = left_padded()
    options, named = _unserved(model)[case]
    common = dict(max_new_tokens=6, pad_token_id=0)
    if case == "a cache holding tokens":
        ids, mask = ids[:1], None
    torch.manual_seed(0)
    got = autograph.generate(model, ids, attention_mask=mask, **common, **options)
    messages = autograph_warnings(caught)
    assert len(messages) == 1 and named in messages[0], messages
    assert "runs model.generate as it is" in messages[0]
    if case in ("a cache holding tokens", "streamer"):
        return  # the cache (the streamer) is not in the state a second call would need
    torch.manual_seed(0)
    expected = model.generate(ids, attention_mask=mask, **common, **options)
    if case == "return_dict_in_generate":
        got, expected = got.sequences, expected.sequences
    assert torch.equal(got, expected)
    assert decode_steps() == []


def test_an_encoder_decoder_model_runs_model_generate_with_one_warning(emulated, caught):
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(1, 64, (2, 5))
    got = autograph.generate(model, ids, max_new_tokens=4)
    messages = autograph_warnings(caught)
    assert len(messages) == 1 and "encoder-decoder" in messages[0]
    assert torch.equal(got, model.generate(ids, max_new_tokens=4))


def test_without_transformers_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        autograph.generate(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long))


def test_bad_arguments_of_its_own_are_refused_by_name():
    _, _, model = tiny_decoder("llama")
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="buckets="):
        autograph.generate(model, ids, buckets=[0, 2])
    with pytest.raises(ValueError, match="check_every="):
        autograph.generate(model, ids, check_every=0)
    with pytest.raises(TypeError, match="compile="):
        autograph.generate(model, ids, compile="yes")
