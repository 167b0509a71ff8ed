"""(e) HF BERT serving: BertModel (4 layers, hidden 256, 4 heads, intermediate 1024, vocab 1024,
random weights, bf16), sequence 64, batch sizes cycling 1, 3, 5, 8, 12, 17, 24, 32 under
torch.inference_mode(). Figures are ms per cycle (the 8 calls): eager; exact-size graphs
(``autograph.graphed(model)``, one graph per batch size); buckets
(``autograph.graphed(model, buckets=[1, 2, 4, 8, 16, 32])``, captured ahead of time by
``model.forward.capture(ids, attention_mask=mask)``); hand-written buckets (pad by hand, one
graph per bucket, shared pool, largest first); torch.compile(mode="reduce-overhead",
dynamic=False). Then memory and capture time of the bucket graphs, and the padding waste.
About 2-3 min on an H200: torch.compile's 8 sizes take most of it (~1.5-2 min); the rest
~30 s."""

from __future__ import annotations

import contextlib
import copy
import time

import torch

import autograph
from autograph.cli._bench import (
    add_row,
    capture_graph,
    compile_for_bench,
    counter_changes,
    device,
    dynamo_counters,
    new_pool,
    per_call_us,
    progress,
    raise_recompile_limit,
    reserved_bytes,
    side_by_side,
    sync,
)

NAME = "(e) HF BERT 4x256 serving, seq 64, batch 1..32"
CYCLE = (1, 3, 5, 8, 12, 17, 24, 32)
BUCKETS = (1, 2, 4, 8, 16, 32)
SEQ = 64
MIB = 2**20


def bert_setup():
    import transformers

    dev = device()
    if dev != "cuda":
        # transformers checks on the host whether the padding mask can be skipped, except
        # while a CUDA stream is capturing; the CPU emulation of graphs is no CUDA capture, so
        # its guard would (rightly) refuse the capture. A smoke run always builds the mask.
        import transformers.masking_utils as masking

        masking._ignore_bidirectional_mask_sdpa = lambda *args, **kwargs: False
    config = transformers.BertConfig(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=4 if dev == "cuda" else 1,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).to(dev).eval().requires_grad_(False)
    if dev == "cuda":
        model = model.to(torch.bfloat16)
    return model


def make_inputs():
    """Per batch size: (input_ids, attention_mask), rows of different real lengths."""
    dev = device()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (max(CYCLE), SEQ), generator=generator)
    mask = torch.ones(max(CYCLE), SEQ, dtype=torch.long)
    for row in range(max(CYCLE)):
        mask[row, SEQ - (row * 7) % 48 :] = 0
    return {b: (ids[:b].to(dev), mask[:b].to(dev)) for b in CYCLE}


def bucket_of(b):
    return next(size for size in BUCKETS if size >= b)


def hand_buckets(model, example):
    """Pad by hand: one graph per bucket (largest first, one shared pool), then per call one
    _foreach_copy_ of the real rows and zero padding, replay, and clones of the real rows.
    Returns the call and the reserved-memory growth of the captures (warmups excluded)."""
    dev = device()
    pool = new_pool()
    stream = torch.cuda.Stream() if dev == "cuda" else None
    ids, mask = example
    statics = {
        b: (ids[:1].repeat(b, 1).clone(), torch.ones(b, SEQ, dtype=torch.long, device=dev))
        for b in sorted(BUCKETS, reverse=True)
    }
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for sid, smask in statics.values():
            for _ in range(2):
                model(input_ids=sid, attention_mask=smask)
    sync()
    if dev == "cuda":
        torch.cuda.empty_cache()  # torch.cuda.graph() empties the cache: start from empty
    before = reserved_bytes()
    graphs = {}
    for b, (sid, smask) in statics.items():
        graph, out = capture_graph(
            lambda sid=sid, smask=smask: model(input_ids=sid, attention_mask=smask),
            warmup=0,
            pool=pool,
            stream=stream,
        )
        graphs[b] = (sid, smask, graph, out.last_hidden_state, out.pooler_output)
    sync()
    captured_bytes = reserved_bytes() - before
    zeros = torch.zeros(max(BUCKETS), SEQ, dtype=torch.long, device=dev)
    plans = {}

    def plan(rows):
        sid, smask, graph, last, pooled = graphs[bucket_of(rows)]
        b = sid.shape[0]
        dst, pads = [sid[:rows], smask[:rows]], []
        if rows < b:
            dst += [sid[rows:], smask[rows:]]
            pads = [zeros[: b - rows], zeros[: b - rows]]
        plans[rows] = (dst, pads, graph, last[:rows], pooled[:rows])
        return plans[rows]

    def call(input_ids, attention_mask):
        dst, pads, graph, last, pooled = plans.get(input_ids.shape[0]) or plan(input_ids.shape[0])
        torch._foreach_copy_(dst, [input_ids, attention_mask, *pads])
        graph.replay()
        return last.clone(), pooled.clone()

    return call, captured_bytes


def max_error(outputs, reference):
    return max((o.float() - r.float()).abs().max().item() for o, r in zip(outputs, reference))


def case_bert(rows, with_compile):
    model = bert_setup()
    inputs = make_inputs()
    largest = inputs[max(CYCLE)]

    def cycle(m):
        for b in CYCLE:
            m(inputs[b][0], attention_mask=inputs[b][1])

    with torch.inference_mode():
        reference = {
            b: model(inputs[b][0], attention_mask=inputs[b][1]).last_hidden_state for b in CYCLE
        }
        for _ in range(2):  # libraries and the allocator's cache warmed before memory figures
            cycle(model)
        sync()

        progress("memory: the largest bucket's graph alone, then the 6 bucket graphs")
        # Graphs against graphs (buckets, exact sizes, hand-written): no payoff check, which
        # may send a GPU-bound key to eager; case (n) measures that.
        alone = autograph.graphed(copy.deepcopy(model), buckets=[max(BUCKETS)], check_payoff=False)
        sync()
        before = reserved_bytes()
        alone.forward.capture(largest[0], attention_mask=largest[1])
        sync()
        alone_bytes = reserved_bytes() - before
        bucketed = autograph.graphed(
            copy.deepcopy(model), buckets=list(BUCKETS), check_payoff=False
        )
        sync()
        before = reserved_bytes()
        start = time.perf_counter()
        captured = bucketed.forward.capture(largest[0], attention_mask=largest[1])
        sync()
        capture_seconds = time.perf_counter() - start
        six_bytes = reserved_bytes() - before
        graph_bytes = sum(r.graph_bytes for r in captured)
        states = sorted({r.state for r in captured})
        assert len(captured) == len(BUCKETS) and states == ["graphed"], captured
        add_row(
            rows,
            NAME,
            "memory: largest bucket (32) graph alone",
            alone_bytes / MIB,
            unit="MiB",
            kind="autograph",
            note="reserved-memory growth of its capture(), measured before the others",
        )
        ratio = six_bytes / alone_bytes if alone_bytes else float("nan")
        add_row(
            rows,
            NAME,
            "memory: 6 bucket graphs, one capture() call",
            six_bytes / MIB,
            unit="MiB",
            kind="autograph",
            note=f"{ratio:.2f}x the largest alone (target <= 1.25x: "
            f"{'met' if ratio <= 1.25 else 'NOT met'}); graph_bytes in stats sum to "
            f"{graph_bytes / MIB:.1f} MiB",
        )
        add_row(
            rows,
            NAME,
            "capture() of the 6 buckets, wall time",
            capture_seconds,
            unit="s",
            kind="autograph",
            note=f"target < 1 s: {'met' if capture_seconds < 1 else 'NOT met'}",
        )
        del alone

        progress("hand-written buckets")
        hand, hand_bytes = hand_buckets(copy.deepcopy(model), largest)
        exact = autograph.graphed(copy.deepcopy(model), max_graphs=32, check_payoff=False)

        progress("checking results against eager")
        errors = {}
        for label, m in (("exact", exact), ("buckets", bucketed)):
            for _ in range(3):  # warmup, capture, replay
                outs = {
                    b: m(inputs[b][0], attention_mask=inputs[b][1]).last_hidden_state for b in CYCLE
                }
            errors[label] = max_error([outs[b] for b in CYCLE], [reference[b] for b in CYCLE])
        outs = {b: hand(*inputs[b])[0] for b in CYCLE}
        errors["hand"] = max_error([outs[b] for b in CYCLE], [reference[b] for b in CYCLE])
        assert all(r.state == "graphed" for r in exact.forward.stats()), exact.forward.stats()

        progress("timing eager, exact-size graphs, buckets, hand-written buckets")
        us = side_by_side(
            {
                "eager": lambda: cycle(model),
                "exact": lambda: cycle(exact),
                "buckets": lambda: cycle(bucketed),
                "hand": lambda: cycle(hand),
            },
            calls=20,
            rounds=7,
            warmup=3,
        )
        ms = {k: v / 1e3 for k, v in us.items()}
        add_row(rows, NAME, "eager", ms["eager"], unit="ms/cycle", kind="eager")
        add_row(
            rows,
            NAME,
            "autograph.graphed(model), exact-size graphs",
            ms["exact"],
            unit="ms/cycle",
            kind="autograph",
            note=f"{len(CYCLE)} graphs; {ms['eager'] / ms['exact']:.2f}x eager's speed;"
            f" max |error| vs eager {errors['exact']:.3g}",
        )
        add_row(
            rows,
            NAME,
            "hand-written buckets (shared pool)",
            ms["hand"],
            unit="ms/cycle",
            kind="hand",
            note=f"capture memory {hand_bytes / MIB:.1f} MiB (6 graphs, "
            f"warmups excluded); max |error| vs eager "
            f"{errors['hand']:.3g}",
        )
        ratio = ms["buckets"] / ms["exact"]
        add_row(
            rows,
            NAME,
            "autograph.graphed(model, buckets=[1..32])",
            ms["buckets"],
            unit="ms/cycle",
            kind="autograph",
            ratio=ratio,
            ratio_to="exact-size graphs",
            note=f"{ratio:.3f}x exact-size graphs (target <= 1.05x: "
            f"{'met' if ratio <= 1.05 else 'NOT met'}), "
            f"{ms['buckets'] / ms['hand']:.3f}x hand-written buckets; "
            f"max |error| vs eager {errors['buckets']:.3g}",
        )

        stats = [r for r in autograph.stats(bucketed) if r.bucket]
        for r in stats:
            waste = r.padding_waste
            progress(
                f"bucket {r.bucket}: calls by real size {r.sizes}, padding waste "
                f"{'n/a' if waste is None else f'{waste:.0%}'}"
            )
        real = sum(size * n for r in stats for size, n in (r.sizes or {}).items())
        padded = sum(r.bucket * sum((r.sizes or {}).values()) for r in stats)
        per_bucket = ", ".join(
            f"{r.bucket}: {r.padding_waste:.0%}" for r in stats if r.padding_waste is not None
        )
        add_row(
            rows,
            NAME,
            "padding waste, autograph.stats(model)",
            (padded / real - 1) * 100 if real else None,
            unit="%",
            kind="other",
            note=f"padded rows over real rows, all calls; per bucket {per_bucket}",
        )

        if with_compile:
            progress("torch.compile(mode='reduce-overhead', dynamic=False): 8 sizes to compile")
            raise_recompile_limit()
            compiled = compile_for_bench(
                copy.deepcopy(model), mode="reduce-overhead", dynamic=False
            )
            start = time.perf_counter()
            cycle(compiled)
            sync()
            first = time.perf_counter() - start
            progress(f"first cycle {first:.1f} s")
            start = time.perf_counter()
            cycle(compiled)
            sync()
            second = time.perf_counter() - start
            counters = dynamo_counters()
            value = per_call_us(lambda: cycle(compiled), calls=20, repeats=7, warmup=3) / 1e3
            changes = counter_changes(counters, dynamo_counters())
            add_row(
                rows,
                NAME,
                'torch.compile("reduce-overhead", dynamic=False)',
                value,
                unit="ms/cycle",
                kind="compile",
                note=f"first cycle {first:.1f} s (compiles 8 sizes), second {second:.1f} s;"
                f" {value / ms['buckets']:.2f}x autograph buckets; recompiles while "
                f"timed: {changes or 'none'}",
            )
