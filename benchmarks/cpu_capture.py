"""The CPU-side cost of ``capture()`` (issue 38): 7 buckets of a tiny HF Llama's decode step, one
StaticCache per bucket given as ``autograph.per_bucket``, on the CPU emulation.

>>> PYTHONPATH=. python benchmarks/cpu_capture.py            # about 30 s; CPU seconds, best of 7
>>> PYTHONPATH=. python benchmarks/cpu_capture.py --profile  # and where one capture() goes

Each round graphs the step anew (a new function, its shapes run before: the one-time work at a
new shape is not counted, as in case (f)'s second row) and times its ``capture()``. What is left
is autograph's own Python (keying, the watched warmups, taking them back, the guarded
captures) plus the emulation's recording of the ops, which stands in for CUDA's capture. The
GPU figure is case (f) of ``benchmarks/run.py``. Not a test: timings vary with the machine.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
import transformers

import autograph
from autograph.testing import emulate_graphs_on_cpu

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ROUNDS = 7
PROMPT = 4


def tiny_llama():
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
    return config, transformers.LlamaForCausalLM(config).eval()


def setup():
    config, model = tiny_llama()

    def step(ids, pos, cache):
        return model(
            input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True
        ).logits

    caches = {}
    for b in BUCKETS:  # prefilled at the bucket's rows: a StaticCache takes its batch from it
        caches[b] = transformers.StaticCache(config=config, max_cache_len=16)
        step(torch.zeros(b, PROMPT, dtype=torch.long), torch.arange(PROMPT), caches[b])
    return step, caches


def capture_seconds(step, caches) -> float:
    fn = autograph.graphed(
        step,
        buckets=list(BUCKETS),
        bucket_args={"ids": 0},
        static_argnames=("cache",),
        max_graphs=64,
    )
    ids, pos = torch.zeros(max(BUCKETS), 1, dtype=torch.long), torch.tensor([PROMPT])
    started = time.thread_time()  # this thread's CPU time: the machine may be shared
    rows = fn.capture(ids, pos, autograph.per_bucket(caches))
    seconds = time.thread_time() - started
    assert sorted(r.bucket for r in rows if r.state == "graphed") == list(BUCKETS), rows
    fn.reset()
    return seconds


def main() -> None:
    torch.set_num_threads(1)  # the ops' work on this thread, where thread_time sees it
    with emulate_graphs_on_cpu(), torch.inference_mode():
        step, caches = setup()
        capture_seconds(step, caches)  # every shape run once: the one-time work paid
        best = min(capture_seconds(step, caches) for _ in range(ROUNDS))
        print(
            f"capture() of {len(BUCKETS)} buckets, tiny Llama decode step, CPU emulation: "
            f"{best:.3f} s (CPU time, best of {ROUNDS}); "
            f"{best / len(BUCKETS) * 1e3:.1f} ms a bucket"
        )
        if "--profile" in sys.argv:
            profile = cProfile.Profile()
            profile.runcall(capture_seconds, step, caches)
            pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
