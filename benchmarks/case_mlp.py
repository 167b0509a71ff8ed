"""(a) A 32-layer Linear(512)+GELU MLP at batch 1 in bf16: eager, a hand-written
capture/replay loop, make_graphed_callables, autograph (module and function), timed in
interleaved rounds; then torch.compile(mode="reduce-overhead") and autograph around
torch.compile (the compiled module, and a compiled step function). Then two more modules,
eager, hand-written and autograph (module and function) timed in interleaved rounds: an
8-layer Linear(4096)+GELU MLP at batch 64 in bf16, and torchvision's ResNet-18 at batch 1 in
float32 (where torchvision is installed). About 45 s on an H200 (compile 15 s of it)."""

from __future__ import annotations

import copy
import time

import torch

import autograph
from autograph.cli._bench import (
    add_row,
    compile_for_bench,
    device,
    hand_written,
    mlp,
    progress,
    side_by_side,
    sync,
    timed,
    with_ratio,
)

NAME = "(a) MLP 32x512 bf16, batch 1"
WIDE = "(a) MLP 8x4096 bf16, batch 64"
RESNET = "(a) torchvision ResNet-18 fp32, batch 1"


def first_calls(fn, example, calls=3):
    """The seconds ``fn``'s first ``calls`` calls take (compilation, warmup and capture)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn(*example)
    sync()
    return time.perf_counter() - start


def compiled(fn, example, calls=3):
    """torch.compile(mode="reduce-overhead") and the time of its first ``calls`` calls."""
    compiled_fn = compile_for_bench(fn, mode="reduce-overhead")
    return compiled_fn, first_calls(compiled_fn, example, calls)


def module_rows(rows, name, model, x, references=None):
    """Eager, hand-written (and ``references``: name -> callable of ``x``),
    ``graphed(module)`` and ``graphed(function)`` of one module, timed in interleaved rounds
    (their ratios are a few percent: a drift of the host between variants timed one after the
    other would be as large), outputs checked equal."""
    references = references or {}
    with torch.no_grad():
        hand = hand_written(model, [x])
        graphed_module = autograph.graphed(copy.deepcopy(model))
        inner = copy.deepcopy(model)
        step = autograph.graphed(lambda x: inner(x))
        variants = {
            "eager": lambda: model(x),
            "hand-written capture/replay": lambda: hand(x),
            **{variant: (lambda f=f: f(x)) for variant, f in references.items()},
            "autograph.graphed(module)": lambda: graphed_module(x),
            "autograph.graphed(function)": lambda: step(x),
        }
        medians = side_by_side(variants)
        expected = model(x)
        for out in (hand(x), *(f(x) for f in references.values()), graphed_module(x), step(x)):
            torch.testing.assert_close(out, expected)
    kinds = {
        "eager": "eager",
        "hand-written capture/replay": "hand",
        **dict.fromkeys(references, "hand"),
    }
    states = ", ".join(r.state for r in autograph.stats(graphed_module))
    for variant, us in medians.items():
        add_row(rows, name, variant, us, kind=kinds.get(variant, "autograph"))
        if variant.startswith("autograph"):
            rows[-1]["note"] = f"keys: {states}" if "module" in variant else ""
            with_ratio(rows, us, medians["hand-written capture/replay"])


def case_mlp(rows, with_compile):
    _small_mlp_rows(rows, with_compile)
    dev = device()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    width = 4096 if dev == "cuda" else 256  # a smoke run on the CPU: small
    wide = mlp(layers=8 if dev == "cuda" else 2, width=width, device=dev, dtype=dtype)
    progress(WIDE)
    module_rows(rows, WIDE, wide, torch.randn(64, width, device=dev, dtype=dtype))
    try:
        import torchvision
    except ImportError:
        add_row(rows, RESNET, "(all variants)", None, note="torchvision is not installed")
        return
    progress(RESNET)
    resnet = torchvision.models.resnet18().to(dev).eval().requires_grad_(False)
    module_rows(rows, RESNET, resnet, torch.randn(1, 3, 224, 224, device=dev))


def _small_mlp_rows(rows, with_compile):
    dev = device()
    model = mlp(device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    x = torch.randn(1, 512, device=dev, dtype=next(model.parameters()).dtype)
    references = {}
    if dev == "cuda":
        with torch.no_grad():
            mgc = torch.cuda.make_graphed_callables(copy.deepcopy(model), (x.clone(),))
        references["make_graphed_callables"] = mgc
    progress(NAME)
    module_rows(rows, NAME, model, x, references)
    with torch.no_grad():
        if with_compile:
            progress("compiling (reduce-overhead)")
            fn, seconds = compiled(copy.deepcopy(model), (x,))
            compile_us = timed(
                rows,
                NAME,
                'torch.compile("reduce-overhead")',
                lambda: fn(x),
                note=f"first 3 calls {seconds:.1f} s",
                kind="compile",
            )
            progress("compiling for autograph (default mode)")
            inner = copy.deepcopy(model)
            variants = {
                "autograph.graphed(torch.compile(model))": autograph.graphed(
                    compile_for_bench(copy.deepcopy(model))
                ),
                "autograph.graphed(torch.compile(step))": autograph.graphed(
                    compile_for_bench(lambda x: inner(x))
                ),
            }
            for variant, graphed in variants.items():
                seconds = first_calls(graphed, (x,))
                error = (graphed(x).float() - model(x).float()).abs().max().item()
                us = timed(
                    rows,
                    NAME,
                    variant,
                    lambda: graphed(x),
                    kind="autograph",
                    note=f"first 3 calls {seconds:.1f} s; max |error| vs eager "
                    f"{error:.3g}; keys: " + ", ".join(r.state for r in autograph.stats(graphed)),
                )
                with_ratio(rows, us, compile_us, "reduce-overhead")
