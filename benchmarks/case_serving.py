"""(s) Serving at scale: the BERT of case (e) (4 layers, hidden 256, bf16, sequence 64) served
over batch sizes 1..32 drawn from a skewed distribution (most requests small, a long tail:
sizes 1 + floor(31 * u**2.5) for uniform u, seeded), 2,000 requests.

- padding share: the share of the GPU's rows spent on pad rows with the powers of two
  (1, 2, 4, 8, 16, 32) against ``fn.suggest_buckets(max_graphs=6)`` for the sizes seen, both
  from the calls' real sizes (``stats()`` ``sizes``), and the same traffic replayed through the
  suggested buckets to check the prediction;
- memory under a budget: exact-size graphs (one per batch size, 32 sizes, 40 shapes counting
  8 sizes seen twice with another sequence length) with ``max_graph_memory`` set to 1.5 times
  the largest graph (at 4 times it did not bind on the H200: the 40 graphs held 58 MiB, the
  largest 28 MiB, as graphs share their pool): the largest graph memory held at any time,
  evictions, and wrong results (0 expected);
- ``capture()`` wall time of the 6 power-of-two buckets in a process that has run the model.

About 30-60 s on an H200."""

from __future__ import annotations

import copy
import time

import torch
from case_bert import bert_setup

import autograph
from autograph.cli._bench import add_row, device, progress, sync

NAME = "(s) serving BERT 4x256, seq 64, sizes 1..32 (skewed)"
POWERS = [1, 2, 4, 8, 16, 32]
REQUESTS = 2000
MIB = 2**20


def traffic(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=generator)
    return [1 + int(31 * float(v) ** 2.5) for v in u]


def inputs_of(size, seq=64):
    generator = torch.Generator().manual_seed(size * 1000 + seq)
    ids = torch.randint(0, 1024, (size, seq), generator=generator).to(device())
    return ids, torch.ones(size, seq, dtype=torch.long, device=device())


def serve(model, sizes, seq=64):
    for size in sizes:
        ids, mask = inputs_of(size, seq)
        model(ids, attention_mask=mask)


def case_serving(rows, with_compile):
    model = bert_setup()
    sizes = traffic(REQUESTS if device() == "cuda" else 60)
    with torch.inference_mode():
        serve(model, sorted(set(sizes)))  # the eager kernels of every size loaded once
        sync()

        progress("capture() of the 6 power-of-two buckets")
        powers = autograph.graphed(copy.deepcopy(model), buckets=POWERS, check_payoff=False)
        largest = inputs_of(max(POWERS))
        start = time.perf_counter()
        captured = powers.forward.capture(largest[0], attention_mask=largest[1])
        sync()
        seconds = time.perf_counter() - start
        add_row(
            rows,
            NAME,
            "capture() of 6 buckets, wall time",
            seconds,
            unit="s",
            kind="autograph",
            note=f"{sum(r.state == 'graphed' for r in captured)} graphs, "
            f"{sum(r.graph_bytes for r in captured) / MIB:.1f} MiB",
        )

        progress(f"{len(sizes)} requests through the powers of two")
        serve(powers, sizes)
        suggestion = powers.forward.suggest_buckets(max_graphs=len(POWERS))
        add_row(
            rows,
            NAME,
            "padding share, powers of two [1..32]",
            suggestion.current_padding_share * 100,
            unit="%",
            kind="other",
            note=f"pad rows over all rows run, {suggestion.calls} calls",
        )
        progress(f"suggested buckets {suggestion.buckets}")
        suggested = autograph.graphed(
            copy.deepcopy(model), buckets=suggestion.buckets, check_payoff=False
        )
        serve(suggested, sizes)
        measured = suggested.forward.suggest_buckets(max_graphs=len(POWERS))
        add_row(
            rows,
            NAME,
            f"padding share, suggest_buckets(max_graphs=6) = {suggestion.buckets}",
            measured.current_padding_share * 100,
            unit="%",
            kind="autograph",
            note=f"predicted {suggestion.padding_share:.1%}, measured by replaying the same "
            f"traffic through those buckets; "
            f"{suggestion.current_padding_share / max(measured.current_padding_share, 1e-9):.1f}x "
            f"less padding than the powers of two",
        )
        memory_under_a_budget(rows, model)


def own_rows(graphed):
    """The model's own keys, without the islands of its eager calls (``model > Layer``)."""
    return [r for r in graphed.forward.stats() if " > " not in r.function]


def memory_under_a_budget(rows, model):
    shapes = [(size, 64) for size in range(1, 33)] + [(size, 48) for size in range(1, 33, 4)]
    probe = autograph.graphed(copy.deepcopy(model), check_payoff=False)
    ids, mask = inputs_of(32)
    for _ in range(3):
        probe(ids, attention_mask=mask)
    one_graph = max(r.graph_bytes for r in probe.forward.stats())
    budget = one_graph * 3 // 2
    progress(f"40 shapes under max_graph_memory={budget / MIB:.1f} MiB (1.5 of the largest graph)")
    limited = autograph.graphed(
        copy.deepcopy(model), max_graph_memory=budget, max_graphs=64, check_payoff=False
    )
    held = wrong = 0
    for _ in range(2):
        for size, seq in shapes:
            ids, mask = inputs_of(size, seq)
            for _ in range(3):
                got = limited(ids, attention_mask=mask).last_hidden_state
            want = model(ids, attention_mask=mask).last_hidden_state
            wrong += not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
            held = max(held, sum(r.graph_bytes for r in own_rows(limited)))
    stats = own_rows(limited)
    add_row(
        rows,
        NAME,
        "memory under max_graph_memory (40 shapes, twice)",
        held / MIB,
        unit="MiB",
        kind="autograph",
        note=f"most graph memory held at once; budget {budget / MIB:.1f} MiB "
        f"({'within' if held <= budget else 'OVER'}); "
        f"{sum(r.evictions for r in stats)} evictions, "
        f"{sum(r.state == 'graphed' for r in stats)} graphs at the end, {wrong} wrong results",
    )
