"""(b) One decode step of an HF transformers Llama (8 layers, hidden 512, random weights) with
a StaticCache, batch 1: eager, a hand-written capture/replay loop, autograph (the model, the
step function, a region) and torch.compile(mode="reduce-overhead").
About 45 s on an H200: eager timing ~10 s, compile ~15 s, the rest a few seconds each.

Also the Llama helpers of cases (f) and (g)."""

from __future__ import annotations

import copy
import time

import torch
from case_mlp import compiled

import autograph
from autograph.cli._bench import add_row, device, hand_written, progress, sync, timed, with_ratio

NAME = "(b) HF Llama decode step, 8x512, StaticCache 2048"


def llama_setup(layers=8):
    """(transformers, config, model): a random-weight LlamaForCausalLM, 8 layers, hidden 512,
    bf16 on the GPU (a 2-layer float32 one on the CPU in a smoke run)."""
    import transformers

    dev = device()
    if dev != "cuda":
        layers = min(layers, 2)
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1024,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dev)
    if dev == "cuda":
        model = model.to(torch.bfloat16)
    return transformers, config, model.eval()


def new_cache(transformers, config, model, batch, max_cache_len=2048, prompt=None):
    """A StaticCache with a 16-token prompt prefilled at ``batch`` rows.

    transformers 5.x: a StaticCache takes its batch size from its first update, and writes
    every update at its on-device ``cumulative_length``, which each call advances whatever
    ``cache_position`` says (past ``max_cache_len`` the index_copy_ fails on the device);
    Llama's position ids are that length too. So a cache serves one batch size, holds
    ``max_cache_len - 16`` decode calls until ``refill``, and each call decodes the next
    position: two variants' logits compare only at the same number of calls since a refill."""
    cache = transformers.StaticCache(config=config, max_cache_len=max_cache_len)
    refill(cache, model, batch, prompt)
    return cache


def refill(cache, model, batch, prompt=None):
    """Zero the cache in place (same addresses: graphs that read it stay valid) and prefill
    the prompt again: its write position is back at 16."""
    dev = device()
    cache.reset()
    if prompt is None:
        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, 1024, (batch, 16), generator=generator)
    with torch.inference_mode():
        model(
            input_ids=prompt[:batch].to(dev),
            past_key_values=cache,
            cache_position=torch.arange(16, device=dev),
            use_cache=True,
        )


def stepper(transformers, config, m, prefill_model=None, max_cache_len=2048):
    """A decode step of ``m`` at batch 1 over its own StaticCache, prefilled by
    ``prefill_model`` (default ``m``; a compiled model is prefilled by its original)."""
    cache = new_cache(transformers, config, prefill_model or m, 1, max_cache_len)

    def step(ids, pos):
        return m(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits

    step.cache, step.prefill_model = cache, prefill_model or m  # for refill(...)
    return step


def case_llama(rows, with_compile):
    transformers, config, model = llama_setup()
    dev = device()
    ids = torch.randint(0, 1024, (1, 1), device=dev)
    pos = torch.tensor([16], device=dev)

    def make(m):
        return stepper(transformers, config, m)

    with torch.inference_mode():
        eager = make(model)
        timed(rows, NAME, "eager", lambda: eager(ids, pos), kind="eager")
        hand = hand_written(make(model), [ids, pos])
        hand_us = timed(
            rows, NAME, "hand-written capture/replay", lambda: hand(ids, pos), kind="hand"
        )
    add_row(
        rows,
        NAME,
        "make_graphed_callables",
        None,
        kind="hand",
        note="takes tensors only; the StaticCache argument is not a tensor",
    )
    graphed_model = autograph.graphed(copy.deepcopy(model))
    with torch.inference_mode():
        step = make(graphed_model)
        sync()
        start = time.perf_counter()
        step(ids, pos)
        step(ids, pos)
        sync()
        first = time.perf_counter() - start
        us = timed(
            rows,
            NAME,
            "autograph.graphed(model)",
            lambda: step(ids, pos),
            note=f"first call (warmup+capture) {first:.2f} s;",
            kind="autograph",
        )
        with_ratio(rows, us, hand_us)
        decorated = autograph.graphed(make(copy.deepcopy(model)))
        decorated_us = timed(
            rows,
            NAME,
            "autograph.graphed(step function)",
            lambda: decorated(ids, pos),
            kind="autograph",
        )
        with_ratio(rows, decorated_us, hand_us)
        in_region = make(copy.deepcopy(model))
        with autograph.region():
            us = timed(
                rows,
                NAME,
                "HF decode in autograph.region()",
                lambda: in_region(ids, pos),
                kind="autograph",
            )
        with_ratio(rows, us, hand_us)
        if us and decorated_us:
            rows.note(f"{us / decorated_us:.3f}x the decorated step", sep=", ")
        row = [r for r in graphed_model.forward.stats() if "[1, 1]" in r.key][0]
        assert row.state == "graphed", row
    if with_compile:
        try:
            progress("compiling (reduce-overhead)")
            with torch.inference_mode():
                fn, seconds = compiled(make(copy.deepcopy(model)), (ids, pos))
                timed(
                    rows,
                    NAME,
                    'torch.compile("reduce-overhead")',
                    lambda: fn(ids, pos),
                    note=f"first 3 calls {seconds:.1f} s",
                    kind="compile",
                )
        except Exception as error:
            add_row(
                rows,
                NAME,
                'torch.compile("reduce-overhead")',
                None,
                kind="compile",
                note=f"{type(error).__name__}",
            )
