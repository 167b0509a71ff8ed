"""(i) Islands (issue 24): ``autograph.graphed(model.generate)`` beside ``generate()`` in
``autograph.region()``, and eager, side by side in one process.

generate() cannot be one graph (its stopping criteria read values on the host), so the graphed
generate()'s key runs eagerly and its model calls are graphed as islands, as a region graphs
them. The Llama of case (b) (8 layers, hidden 512, bf16, batch 1), 64 new tokens, greedy, the
user's own StaticCache (one per model, reset in place before each call). Rounds interleave the
three, one generate() call each; tokens are checked against the same round's eager call. About
30-60 s on an H200. ``disable_compile=True``: with a StaticCache on CUDA, transformers (5.17)
compiles the decode step itself with CUDA graphs (torch.compile's CUDAGraph Trees), and
autograph.graphed(model.generate) around that path fails ("tensors in the cudagraph pool not
tracked as outputs", seen on the H200): a limit, in docs/guide/limits.md."""

from __future__ import annotations

import copy
import statistics

import torch
from case_llama import llama_setup
from case_never_slower import _seconds

import autograph
from autograph.cli._bench import SMOKE, add_row, device, progress

NAME = "(i) islands: generate() of the 8x512 Llama, batch 1, the user's StaticCache"
NEW_TOKENS = 8 if SMOKE else 64
ROUNDS = 1 if SMOKE else 5
FIRST_CALLS = 2 if SMOKE else 4


def case_islands(rows, with_compile):
    transformers, config, model = llama_setup()
    ids = torch.randint(0, 1024, (1, 16), device=device())
    region_model, island_model = copy.deepcopy(model), copy.deepcopy(model)
    caches = {
        id(m): transformers.StaticCache(config=config, max_cache_len=ids.shape[1] + NEW_TOKENS)
        for m in (model, region_model, island_model)
    }
    graphed_generate = autograph.graphed(island_model.generate)

    def run(m, generate):
        cache = caches[id(m)]
        cache.reset()  # in place: the addresses the graphs read hold
        return generate(
            ids,
            past_key_values=cache,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            disable_compile=True,
        )

    def in_region():
        with autograph.region():
            return run(region_model, region_model.generate)

    calls = {
        "eager": lambda: run(model, model.generate),
        "region": in_region,
        "islands": lambda: run(island_model, graphed_generate),
    }
    times = {name: [] for name in calls}
    with torch.inference_mode():
        progress("generate(): eager, in a region, graphed (islands)")
        first = {name: _seconds(calls[name])[0] for name in ("region", "islands")}
        for _ in range(FIRST_CALLS - 1):
            for call in calls.values():
                call()
        for _ in range(ROUNDS):
            outs = {}
            for name, call in calls.items():
                seconds, outs[name] = _seconds(call)
                times[name].append(seconds)
            for name in ("region", "islands"):
                if not torch.equal(outs[name], outs["eager"]):
                    raise AssertionError(f"{name}: tokens differ from the same round's eager")
    rates = {name: NEW_TOKENS * ids.shape[0] / statistics.median(t) for name, t in times.items()}
    rows_of_generate = autograph.stats(graphed_generate)
    islands = [r for r in rows_of_generate if " > " in r.function]
    add_row(rows, NAME, "eager generate()", rates["eager"], unit="tok/s", kind="eager")
    add_row(
        rows,
        NAME,
        "generate() in autograph.region()",
        rates["region"],
        unit="tok/s",
        kind="autograph",
        note=f"first call {first['region']:.2f} s; "
        f"{rates['region'] / rates['eager']:.3f}x eager's tokens/s",
    )
    add_row(
        rows,
        NAME,
        "autograph.graphed(model.generate)",
        rates["islands"],
        unit="tok/s",
        kind="autograph",
        note=(
            f"first call {first['islands']:.2f} s; its key "
            f"{rows_of_generate[0].state if rows_of_generate else 'none'}; "
            f"{sum(r.replays for r in islands)} island replays in {len(islands)} "
            f"island keys; {rates['islands'] / rates['eager']:.3f}x eager's, "
            f"{rates['islands'] / rates['region']:.3f}x the region's tokens/s"
        ),
    )
    return rows
