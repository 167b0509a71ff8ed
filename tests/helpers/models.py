"""Tiny models built from configs and the decode loops the tests run them in (transformers is
imported lazily: tests that need it skip without it).
"""

from types import SimpleNamespace

import pytest
import torch

import autograph
from autograph.testing import emulate_graphs_on_cpu


def llama(layers=8, hidden=512):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1024,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    return transformers, config, model


def static_decode(model, transformers, config, prompt, tokens):
    """A prefill of ``prompt``, then one step per token of ``tokens``, with a fresh
    StaticCache, under inference_mode; the logits of every step (``.cache``: the cache)."""
    cache = static_cache(transformers, config)
    logits = Decoded()
    logits.cache = cache
    with torch.inference_mode():
        model(
            input_ids=prompt,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(prompt.shape[1], device="cuda"),
        )
        for step, token in enumerate(tokens):
            out = model(
                input_ids=token,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.tensor([prompt.shape[1] + step], device="cuda"),
            )
            logits.append(out.logits)
    return logits


def tiny_llama(device):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers, config, transformers.LlamaForCausalLM(config).to(device).eval()


def cache_contents(cache):
    """Every tensor a StaticCache holds, copied: its keys, values and write position."""
    return [
        t.clone()
        for layer in cache.layers
        for t in (layer.keys, layer.values, layer.cumulative_length)
    ]


def tiny_llama_decoding(device, prompt_len=4, max_len=16):
    """A tiny HF Llama's decode step over StaticCaches: ``tokens(rows, length)``, ``decode(ids,
    pos, cache)``, ``prefill(cache, prompt)`` (in place: graphs read the cache by address) and
    ``new_cache()``, plain closures, as a serving loop writes them."""
    transformers, config, model = tiny_llama(device)
    generator = torch.Generator().manual_seed(1)

    def tokens(rows, length):
        return torch.randint(0, config.vocab_size, (rows, length), generator=generator).to(device)

    def decode(ids, pos, cache):
        return model(
            input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True
        ).logits

    def prefill(cache, prompt):
        # transformers 5.x: a StaticCache takes its batch size from its first update
        cache.reset()
        decode(prompt, torch.arange(prompt_len, device=device), cache)
        return cache

    def new_cache():
        return transformers.StaticCache(config=config, max_cache_len=max_len)

    return SimpleNamespace(
        config=config, tokens=tokens, decode=decode, prefill=prefill, new_cache=new_cache
    )


def static_generate_runs(calls):
    """(eager's tokens, [(tokens, region stats)] of ``calls`` calls in a region) of a tiny
    Llama's generate(cache_implementation="static"), which builds a StaticCache per call."""
    model = generating_llama()
    ids = torch.randint(0, 256, (1, 8))
    with torch.inference_mode():
        expected = model.generate(
            ids, max_new_tokens=16, do_sample=False, cache_implementation="static"
        )
        runs = [
            generate_in_a_region(model, ids, cache_implementation="static") for _ in range(calls)
        ]
    return expected, runs


def static_cache(transformers, config, length=64):
    return transformers.StaticCache(config=config, max_cache_len=length)


class Decoded(list):
    """The logits of every step, holding the StaticCache they were made with: keys of a
    cache are held weakly and go when it dies, so a test that reads stats keeps it."""


def generate_in_a_region(model, ids, **options):
    with emulate_graphs_on_cpu(), autograph.region() as region:
        tokens = model.generate(ids, max_new_tokens=16, do_sample=False, **options)
    return tokens, region.stats()


def generating_llama():
    """A tiny Llama sized for generate() (a 512-position window), on the CPU."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def gelu_mlp(device, seed=0):
    """Linear(8, 8), GELU, Linear(8, 8), seeded, on ``device``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)).to(
        device
    )


DECODERS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt2",
    "opt",
    "gpt_neox",
    "mixtral",
    "olmoe",
)


def tiny_decoder(kind):
    """(transformers, config, model): a 2-layer, 64-wide decoder of the family ``kind`` (one of
    ``DECODERS``) with a 256-token vocabulary, seeded, in eval mode, on the CPU. Sliding-window
    families have a window of 16; skips if the installed transformers lacks the family."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    experts = dict(num_experts_per_tok=2)
    configs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", common),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", common),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(common, head_dim=16)),
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(common, sliding_window=16)),
        "gemma2": (
            "Gemma2Config",
            "Gemma2ForCausalLM",
            dict(common, head_dim=16, sliding_window=16),
        ),
        "gemma3": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            dict(common, head_dim=16, sliding_window=16),
        ),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(common, pad_token_id=0)),
        "gpt2": (
            "GPT2Config",
            "GPT2LMHeadModel",
            dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256),
        ),
        "opt": (
            "OPTConfig",
            "OPTForCausalLM",
            dict(
                hidden_size=64,
                ffn_dim=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=256,
                max_position_embeddings=256,
                word_embed_proj_dim=64,
            ),
        ),
        "gpt_neox": (
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=256,
                max_position_embeddings=256,
            ),
        ),
        "mixtral": (
            "MixtralConfig",
            "MixtralForCausalLM",
            dict(common, num_local_experts=4, **experts),
        ),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(common, num_experts=4, **experts)),
    }
    config_name, model_name, options = configs[kind]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    config = getattr(transformers, config_name)(**options)
    torch.manual_seed(0)
    return transformers, config, getattr(transformers, model_name)(config).eval()
