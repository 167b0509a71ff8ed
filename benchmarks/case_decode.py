"""(f) HF Llama decode with buckets: the model of case (b) (8 layers, hidden 512, bf16) decoding
at batch sizes 1..64 with ``buckets=[1, 2, 4, 8, 16, 32, 64]``, against eager and against
exact-size graphs (one graph per batch size), at batch 1, 3, 8, 24 and 64: tokens per second.
Then P50/P99 step latency at batch 1 for eager, autograph and a hand-written capture.

The KV cache. transformers' StaticCache takes its batch size from its first update, so one
cache serves one batch size: there is one cache per batch size (those timed and the buckets).
The key of a call holds the cache's identity (a StaticCache is not a pytree node, so it is
keyed by identity whether or not it is named in ``static_argnames``), and the graph of bucket
4 must write into a 4-row cache while the eager warmup of a 3-row call needs a 3-row one. So
the cache is not an argument here: the step closes over the caches and takes the one of the
batch it sees (the padded batch, in a graph). The graph reads the cache by address (SPEC 2.8);
it is updated in place, and ``refill`` resets it in place between measurements (its write
position advances on every call, see case_llama.new_cache). ``step.capture(ids, pos)`` then
captures every bucket ahead of time (largest first, one pool), each with its own cache.
About 60-90 s on an H200: eager timing ~25 s, the rest seconds."""
from __future__ import annotations

import time

import torch

import autograph
from autograph._bench import (add_row, device, hand_written, latencies_us, percentile, progress,
                              side_by_side, sync)
from case_llama import llama_setup, new_cache, refill

NAME = "(f) HF Llama decode 8x512, batch 1..64, buckets"
LATENCY = "(f) HF Llama decode, batch 1 step latency"
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SIZES = (1, 3, 8, 24, 64)
MAX_CACHE = 2048  # >= 16 prompt + each cache's calls between refills (~800 at most)


def case_decode(rows, with_compile):
    transformers, config, model = llama_setup()
    dev = device()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1024, (max(BUCKETS), 16), generator=generator)
    tokens = torch.randint(0, 1024, (max(BUCKETS), 1), generator=generator).to(dev)
    pos = torch.tensor([16], device=dev)
    progress("one StaticCache per batch size, prefilled")
    caches = {b: new_cache(transformers, config, model, b, MAX_CACHE, prompt)
              for b in sorted(set(SIZES) | set(BUCKETS))}

    def refill_all():
        for b, cache in caches.items():
            refill(cache, model, b, prompt)

    def step(ids, pos):
        return model(input_ids=ids, past_key_values=caches[ids.shape[0]], cache_position=pos,
                     use_cache=True).logits

    exact = autograph.graphed(step, max_graphs=64)
    bucketed = autograph.graphed(step, buckets=list(BUCKETS), bucket_args={"ids": 0},
                                 max_graphs=64)
    with torch.inference_mode():
        sync()
        start = time.perf_counter()
        captured = bucketed.capture(tokens, pos)
        sync()
        seconds = time.perf_counter() - start
        assert [r.state for r in captured] == ["graphed"] * len(BUCKETS), captured
        graph_mib = sum(r.graph_bytes for r in captured) / 2**20
        add_row(rows, NAME, "step.capture(ids, pos) of the 7 buckets", seconds, unit="s",
                kind="autograph",
                note=f"graph memory {graph_mib:.1f} MiB (graph_bytes summed); one StaticCache "
                     f"per batch size (HF fixes a cache's batch at its first update), closed "
                     f"over by the step and picked by the batch it sees")
        for b in SIZES:
            progress(f"batch {b}")
            ids = tokens[:b]
            for _ in range(2):  # warmup and capture: the exact-size graph exists
                exact(ids, pos)
            # Logits compared at the same cache state: the first call after a refill.
            refill_all()
            reference = step(ids, pos)
            refill_all()
            got_exact = exact(ids, pos)
            refill_all()
            got_bucket = bucketed(ids, pos)
            error = max((got.float() - reference.float()).abs().max().item()
                        for got in (got_exact, got_bucket))
            refill_all()
            us = side_by_side({"eager": lambda: step(ids, pos), "exact": lambda: exact(ids, pos),
                               "buckets": lambda: bucketed(ids, pos)},
                              calls=50, rounds=5, warmup=5)
            tps = {k: b / v * 1e6 for k, v in us.items()}
            add_row(rows, NAME, f"batch {b}: eager", tps["eager"], unit="tok/s", kind="eager",
                    series="eager", x=b, note=f"{us['eager']:.0f} us/step")
            add_row(rows, NAME, f"batch {b}: autograph, exact-size graph", tps["exact"],
                    unit="tok/s", kind="autograph", series="exact-size graphs", x=b,
                    note=f"{us['exact']:.0f} us/step")
            bucket = next(s for s in BUCKETS if s >= b)
            add_row(rows, NAME, f"batch {b}: autograph, buckets (graph of {bucket})",
                    tps["buckets"], unit="tok/s", kind="autograph", series="buckets", x=b,
                    ratio=us["buckets"] / us["exact"], ratio_to="exact-size graph",
                    note=f"{us['buckets']:.0f} us/step; {tps['buckets'] / tps['eager']:.2f}x "
                         f"eager's tokens/s, {tps['buckets'] / tps['exact']:.3f}x the exact-size "
                         f"graph's; max |logit error| vs eager {error:.3g}")
        exact_keys = [r for r in exact.stats() if r.state == "graphed"]
        assert len(exact_keys) == len(SIZES), exact.stats()
        assert not [r for r in bucketed.stats() if r.state != "graphed"], bucketed.stats()

        progress("batch 1 latency")
        refill_all()
        ids = tokens[:1]
        hand = hand_written(step, [ids, pos])
        samples = {
            "eager": latencies_us(lambda: step(ids, pos), n=300),
            "autograph.graphed(step, buckets=...)": latencies_us(lambda: bucketed(ids, pos),
                                                                  n=300),
            "hand-written capture/replay": latencies_us(lambda: hand(ids, pos), n=300),
        }
        for variant, values in samples.items():
            p50, p99 = percentile(values, 50), percentile(values, 99)
            add_row(rows, LATENCY, f"{variant}: P50", p50, unit="us", note=f"P99 {p99:.0f} us",
                    p99=p99)
