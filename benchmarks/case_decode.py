"""(f) HF Llama decode with buckets: the model of case (b) (8 layers, hidden 512, bf16) decoding
with ``buckets=[1, 2, 4, 8, 16, 32, 64]``, against eager and against exact-size graphs (one
graph per batch size), at batch 1, 3, 24 and 64: tokens per second, and the ratio of the
bucket's step time to the exact-size graph's (issue 22's target: <= 1.05x). Then P50/P99 step
latency at batch 1 for eager, autograph and a hand-written capture.

The KV cache, as a vLLM-style server holds it: one StaticCache per bucket, passed to the step
by ``static_argnames=("cache",)``. transformers' StaticCache takes its batch size from its first
update, so each bucket's cache is prefilled at the bucket's rows, and every run of a bucketed
key (warmup, capture, replay) must run at the padded size for that cache to fit: the engine
does so since issue 22 (before it, the warmup of a 3-row call met the 4-row cache and failed
in ``index_copy_``). The exact-size graphs get one cache per timed batch size. Caches are
updated in place and ``refill`` resets them in place between measurements (its write
position advances on every call, see case_llama.new_cache), so the graphs' addresses hold.

The buckets are captured ahead of time by one ``step.capture(tokens, pos,
autograph.per_bucket(caches))``: the example resized to every bucket, largest first, each with
its own bucket's cache, the warmups' writes to the caches taken back (issue 22's target: the 7
buckets in under 1 s). Two rows put that figure in context: the same capture() by a second
function over the same shapes (autograph's own cost), and an eager step's first call at a size
not run before against its next (the one-time work at a new shape that the first capture()
pays at each bucket, as an eager server would). A padded batch size is also timed in the
exact-size graph of its bucket's rows: the GPU work of the rows the bucket runs.
About 60-90 s on an H200: eager timing ~25 s, the rest seconds."""

from __future__ import annotations

import time

import torch
from case_llama import llama_setup, new_cache, refill

import autograph
from autograph.cli._bench import (
    add_row,
    device,
    hand_written,
    latencies_us,
    percentile,
    progress,
    side_by_side,
    sync,
)

NAME = "(f) HF Llama decode 8x512, batch 1..64, buckets"
LATENCY = "(f) HF Llama decode, batch 1 step latency"
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SIZES = (1, 3, 24, 64)
MAX_CACHE = 2048  # >= 16 prompt + each cache's calls between refills (~800 at most)


def case_decode(rows, with_compile):
    transformers, config, model = llama_setup()
    dev = device()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1024, (max(BUCKETS), 16), generator=generator)
    tokens = torch.randint(0, 1024, (max(BUCKETS), 1), generator=generator).to(dev)
    pos = torch.tensor([16], device=dev)
    progress("one StaticCache per bucket and per exact size, prefilled")
    bucket_caches = {
        b: new_cache(transformers, config, model, b, MAX_CACHE, prompt) for b in BUCKETS
    }
    # Exact-size caches at each batch size and at the bucket a padded size runs in: the
    # exact-size graph of the bucket's rows shows what the pad rows cost the GPU.
    exact_sizes = sorted(set(SIZES) | {next(s for s in BUCKETS if s >= b) for b in SIZES})
    per_size = {
        b: new_cache(transformers, config, model, b, MAX_CACHE, prompt) for b in exact_sizes
    }

    def refill_all():
        for caches in (bucket_caches, per_size):
            for b, cache in caches.items():
                refill(cache, model, b, prompt)

    def step(ids, pos, cache):
        return model(
            input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True
        ).logits

    # Graphs against graphs (buckets, exact sizes, hand-written): no payoff check, which
    # may send a GPU-bound key to eager; case (n) measures that.
    exact = autograph.graphed(step, static_argnames=("cache",), max_graphs=64, check_payoff=False)
    bucketed = autograph.graphed(
        step,
        buckets=list(BUCKETS),
        bucket_args={"ids": 0},
        check_payoff=False,
        static_argnames=("cache",),
        max_graphs=64,
    )

    def bucket_of(b):
        return next(s for s in BUCKETS if s >= b)

    with torch.inference_mode():
        sync()
        start = time.perf_counter()
        captured = bucketed.capture(tokens, pos, autograph.per_bucket(bucket_caches))
        sync()
        seconds = time.perf_counter() - start
        assert sorted(r.bucket for r in captured if r.state == "graphed") == list(BUCKETS), captured
        graph_mib = sum(r.graph_bytes for r in captured) / 2**20
        add_row(
            rows,
            NAME,
            f"capture() of the {len(BUCKETS)} buckets (per_bucket caches)",
            seconds,
            unit="s",
            kind="autograph",
            note=f"target < 1 s; graph memory {graph_mib:.1f} MiB (graph_bytes summed); one "
            f"StaticCache per bucket passed by static_argnames, given to capture() as "
            f"autograph.per_bucket(caches)",
        )
        # The same capture by a new function, every shape run once already: autograph's own
        # cost, without the one-time work at a new shape (kernels loaded, cuBLAS's choices)
        # that the first capture() pays and an eager first call at each size pays too.
        again = autograph.graphed(
            step,
            buckets=list(BUCKETS),
            bucket_args={"ids": 0},
            check_payoff=False,
            static_argnames=("cache",),
            max_graphs=64,
        )
        sync()
        start = time.perf_counter()
        again.capture(tokens, pos, autograph.per_bucket(bucket_caches))
        sync()
        add_row(
            rows,
            NAME,
            f"capture() of the {len(BUCKETS)} buckets again, a new function",
            time.perf_counter() - start,
            unit="s",
            kind="autograph",
            note="the shapes run before: without the one-time work at each new shape that "
            "the first capture() pays (an eager first call pays it too)",
        )
        again.reset()
        del again
        # One-time work at a new shape (kernels loaded, cuBLAS's choices), which the first
        # capture() paid at each of its buckets and an eager server pays at each new size too:
        # an eager decode step at a size not run before in this process, then again.
        new_size = next(b for b in SIZES if b not in BUCKETS)
        seconds = []
        for _ in range(2):
            sync()
            start = time.perf_counter()
            step(tokens[:new_size], pos, per_size[new_size])
            sync()
            seconds.append(time.perf_counter() - start)
        add_row(
            rows,
            NAME,
            f"eager step at a new size ({new_size} rows), its first call",
            seconds[0] * 1e3,
            unit="ms",
            kind="eager",
            note=f"the next call {seconds[1] * 1e3:.1f} ms: the difference is one-time work "
            f"at a new shape, which the first capture() pays at each bucket too",
        )
        refill_all()
        for b in SIZES:
            progress(f"batch {b}")
            ids, bucket_cache, exact_cache = tokens[:b], bucket_caches[bucket_of(b)], per_size[b]
            for _ in range(2):  # warmup and capture: the exact-size graph exists
                exact(ids, pos, exact_cache)
            # Logits compared at the same cache state: the first call after a refill.
            refill_all()
            reference = step(ids, pos, exact_cache)
            refill_all()
            got_exact = exact(ids, pos, exact_cache)
            refill_all()
            got_bucket = bucketed(ids, pos, bucket_cache)
            assert got_bucket.shape == reference.shape, (got_bucket.shape, reference.shape)
            error = max(
                (got.float() - reference.float()).abs().max().item()
                for got in (got_exact, got_bucket)
            )
            refill_all()
            variants = {
                "eager": lambda: step(ids, pos, exact_cache),
                "exact": lambda: exact(ids, pos, exact_cache),
                "buckets": lambda: bucketed(ids, pos, bucket_cache),
            }
            padded_to = bucket_of(b)
            if padded_to != b:
                variants["exact at the bucket"] = lambda: exact(
                    tokens[:padded_to], pos, per_size[padded_to]
                )
            us = side_by_side(variants, calls=50, rounds=5, warmup=5)
            tps = {k: b / v * 1e6 for k, v in us.items()}
            add_row(
                rows,
                NAME,
                f"batch {b}: eager",
                tps["eager"],
                unit="tok/s",
                kind="eager",
                series="eager",
                x=b,
                note=f"{us['eager']:.0f} us/step",
            )
            add_row(
                rows,
                NAME,
                f"batch {b}: autograph, exact-size graph",
                tps["exact"],
                unit="tok/s",
                kind="autograph",
                series="exact-size graphs",
                x=b,
                note=f"{us['exact']:.0f} us/step",
            )
            add_row(
                rows,
                NAME,
                f"batch {b}: autograph, buckets (graph of {bucket_of(b)})",
                tps["buckets"],
                unit="tok/s",
                kind="autograph",
                series="buckets",
                x=b,
                ratio=us["buckets"] / us["exact"],
                ratio_to="exact-size graph",
                note=f"{us['buckets']:.0f} us/step; {tps['buckets'] / tps['eager']:.2f}x "
                f"eager's tokens/s, {tps['buckets'] / tps['exact']:.3f}x the exact-size "
                f"graph's; max |logit error| vs eager {error:.3g}",
            )
            if padded_to != b:
                add_row(
                    rows,
                    NAME,
                    f"batch {b}: autograph, exact-size graph of {padded_to} rows",
                    us["exact at the bucket"],
                    unit="us/step",
                    kind="autograph",
                    note=f"the bucket's own work, unpadded: the buckets row at {b} rows "
                    f"takes {us['buckets'] / us['exact at the bucket']:.3f}x its time "
                    f"(what it takes beyond {b} rows' exact-size graph is the "
                    f"{padded_to - b} pad rows' work, unless this is well above 1)",
                )
        exact_keys = [r for r in exact.stats() if r.state == "graphed"]
        assert len(exact_keys) == len(exact_sizes), exact.stats()
        assert not [r for r in bucketed.stats() if r.state != "graphed"], bucketed.stats()

        progress("batch 1 latency")
        refill_all()
        ids, bucket_cache, exact_cache = tokens[:1], bucket_caches[1], per_size[1]
        hand = hand_written(lambda i, p: step(i, p, exact_cache), [ids, pos])
        samples = {
            "eager": latencies_us(lambda: step(ids, pos, exact_cache), n=300),
            "autograph.graphed(step, buckets=...)": latencies_us(
                lambda: bucketed(ids, pos, bucket_cache), n=300
            ),
            "hand-written capture/replay": latencies_us(lambda: hand(ids, pos), n=300),
        }
        for variant, values in samples.items():
            p50, p99 = percentile(values, 50), percentile(values, 99)
            add_row(
                rows, LATENCY, f"{variant}: P50", p50, unit="us", note=f"P99 {p99:.0f} us", p99=p99
            )
