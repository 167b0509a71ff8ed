"""(g) torch.compile and autograph stacked, on the decode step of case (b) (HF Llama 8x512,
StaticCache, batch 1): eager; ``autograph.graphed(torch.compile(step))`` in the default mode and
in ``mode="max-autotune-no-cudagraphs"``; ``autograph.graphed(torch.compile(model))``; and
``torch.compile(step, mode="reduce-overhead")``. For each: the time of its first 3 calls
(compile, capture), us per call, dynamo's counters around the timed calls (no recompiles), and
the largest difference of its logits from eager's at the same cache state, on its first
call and on a replay after the timed calls (allclose at bf16 tolerance, rtol 1.6e-2, atol 1e-2).
About 2-3 min on an H200: ~15 s per compile, max-autotune (last) ~30-60 s more."""

from __future__ import annotations

import copy
import time

import torch
from case_llama import llama_setup, refill, stepper

import autograph
from autograph.cli._bench import (
    add_row,
    compile_for_bench,
    counter_changes,
    device,
    dynamo_counters,
    failure,
    per_call_us,
    progress,
    raise_recompile_limit,
    sync,
)

NAME = "(g) torch.compile on the HF decode step (b)"
RTOL, ATOL = 1.6e-2, 1e-2


def case_compile(rows, with_compile):
    if not with_compile:
        add_row(rows, NAME, "(skipped)", None, note="--no-compile")
        return
    raise_recompile_limit()
    transformers, config, model = llama_setup()
    dev = device()
    ids = torch.randint(0, 1024, (1, 1), device=dev)
    pos = torch.tensor([16], device=dev)

    def make(m, prefill_model=None):
        return stepper(transformers, config, m, prefill_model)

    with torch.inference_mode():
        eager = make(model)
        reference = eager(ids, pos).clone()  # the first call after the prefill
        eager_us = per_call_us(lambda: eager(ids, pos), calls=50, repeats=5, warmup=3)
        add_row(rows, NAME, "eager", eager_us, kind="eager")

    def variant(label, build, reference_us=None):
        """``build()`` gives (call, its stepper, what autograph graphs or None); logits are
        compared with eager's at the same cache state (the first call after a prefill), on
        the first call (compiled code) and on a call after the timed ones (the graph's
        replay)."""
        progress(f"{label}: first calls (compile)")
        try:
            with torch.inference_mode():
                call, inner, target = build()
                sync()
                start = time.perf_counter()
                outs = [call(ids, pos).clone()]
                for _ in range(2):
                    call(ids, pos)
                sync()
                first = time.perf_counter() - start
                counters = dynamo_counters()
                us = per_call_us(lambda: call(ids, pos))
                changes = counter_changes(counters, dynamo_counters())
                refill(inner.cache, inner.prefill_model, 1)
                outs.append(call(ids, pos).clone())
                keys = autograph.stats(target) if target is not None else []
        except Exception as error:
            add_row(rows, NAME, label, None, note=failure(error))
            return None
        error = max((o.float() - reference.float()).abs().max().item() for o in outs)
        close = all(
            torch.allclose(o.float(), reference.float(), rtol=RTOL, atol=ATOL) for o in outs
        )
        note = (
            f"first 3 calls {first:.1f} s; {eager_us / us:.1f}x eager; max |logit error| vs "
            f"eager {error:.3g} (|logits| up to {reference.abs().max().item():.3g}), "
            f"allclose: {close}; dynamo counters while timed: "
            f"{'unchanged' if not changes else changes}"
        )
        if target is not None:
            states = [f"{r.state} ({r.replays} replays)" for r in keys]
            note += f"; autograph keys: {', '.join(states) or 'none'}"
        extra = {}
        if reference_us:
            extra = {"ratio": us / reference_us, "ratio_to": "reduce-overhead"}
            note = f"{us / reference_us:.3f}x reduce-overhead; " + note
        add_row(rows, NAME, label, us, note=note, **extra)
        return us

    def stepped(wrap, mode=None):
        inner = make(copy.deepcopy(model))
        compiled = compile_for_bench(inner) if mode is None else compile_for_bench(inner, mode=mode)
        wrapped = wrap(compiled)
        return wrapped, inner, (wrapped if wrapped is not compiled else None)

    # torch.compile's own graphs first: the reference of the stacked rows.
    reduce_us = variant(
        'torch.compile(step, mode="reduce-overhead")',
        lambda: stepped(lambda f: f, "reduce-overhead"),
    )
    variant("autograph.graphed(torch.compile(step))", lambda: stepped(autograph.graphed), reduce_us)

    def compiled_model():
        original = copy.deepcopy(model)
        # Prefilled by the original module: the compiled one compiles the decode shape only.
        graphed = autograph.graphed(compile_for_bench(original))
        inner = make(graphed, prefill_model=original)
        return inner, inner, graphed

    variant("autograph.graphed(torch.compile(model))", compiled_model, reduce_us)
    variant(
        'autograph.graphed(torch.compile(step, mode="max-autotune-no-cudagraphs"))',
        lambda: stepped(autograph.graphed, "max-autotune-no-cudagraphs"),
        reduce_us,
    )
