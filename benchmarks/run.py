"""Eager against autograph against the references, in one run on one GPU.

    PYTHONPATH=$PWD python3 benchmarks/run.py            # prints the table, writes RESULTS.md

Cases: (a) a 32-layer Linear(512)+GELU MLP at batch 1 in bf16; (b) one decode step of an HF
transformers Llama (8 layers, hidden 512, random weights) with a StaticCache, batch 1;
(c) a one-kernel function of four small tensors, where the wrapper's own cost shows fully.
References: a hand-written capture/replay loop, torch.cuda.make_graphed_callables and
torch.compile(mode="reduce-overhead"). Figures are us per call (see autograph._bench).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

import torch

import autograph
from autograph._bench import format_rows, hand_written, mlp, per_call_us

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(rows, case, variant, call, reference=None, note=""):
    try:
        us = per_call_us(call)
        rows.append({"case": case, "variant": variant, "us/call": f"{us:.1f}", "note": note})
    except Exception as error:  # a reference that does not support the case
        rows.append({"case": case, "variant": variant, "us/call": "n/a",
                     "note": f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"})
        return None
    return us


def with_ratio(rows, autograph_us, hand_us):
    if autograph_us and hand_us:
        rows[-1]["note"] = (rows[-1]["note"] + " " if rows[-1]["note"] else "") + \
            f"{autograph_us / hand_us:.3f}x hand-written"


def compiled(fn, example, calls=3):
    compiled_fn = torch.compile(fn, mode="reduce-overhead")
    start = time.perf_counter()
    for _ in range(calls):
        compiled_fn(*example)
    torch.cuda.synchronize()
    return compiled_fn, time.perf_counter() - start


def case_mlp(rows, with_compile):
    name = "(a) MLP 32x512 bf16, batch 1"
    model = mlp()
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        timed(rows, name, "eager", lambda: model(x))
        hand = hand_written(model, [x])
        hand_us = timed(rows, name, "hand-written capture/replay", lambda: hand(x))
        mgc = torch.cuda.make_graphed_callables(copy.deepcopy(model), (x.clone(),))
        timed(rows, name, "make_graphed_callables", lambda: mgc(x))
        graphed_module = autograph.graphed(copy.deepcopy(model))
        us = timed(rows, name, "autograph.graphed(module)", lambda: graphed_module(x))
        with_ratio(rows, us, hand_us)
        inner = copy.deepcopy(model)
        step = autograph.graphed(lambda x: inner(x))
        us = timed(rows, name, "autograph.graphed(function)", lambda: step(x))
        with_ratio(rows, us, hand_us)
        assert torch.equal(graphed_module(x), model(x)) and torch.equal(step(x), model(x))
        if with_compile:
            fn, seconds = compiled(copy.deepcopy(model), (x,))
            timed(rows, name, 'torch.compile("reduce-overhead")', lambda: fn(x),
                  note=f"first 3 calls {seconds:.1f} s")


def llama_setup():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=1024, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    return transformers, config, model


def case_llama(rows, with_compile):
    name = "(b) HF Llama decode step, 8x512, StaticCache 2048"
    transformers, config, model = llama_setup()
    ids = torch.randint(0, 1024, (1, 1), device="cuda")
    pos = torch.tensor([16], device="cuda")

    def stepper(m):
        # The cache writes at an on-device length that every call advances: room for
        # all the timed calls of one variant.
        cache = transformers.StaticCache(config=config, max_cache_len=2048)
        with torch.inference_mode():
            m(input_ids=torch.randint(0, 1024, (1, 16), device="cuda"), past_key_values=cache,
              cache_position=torch.arange(16, device="cuda"), use_cache=True)

        def step(ids, pos):
            return m(input_ids=ids, past_key_values=cache, cache_position=pos,
                     use_cache=True).logits
        return step

    with torch.inference_mode():
        eager = stepper(model)
        timed(rows, name, "eager", lambda: eager(ids, pos))
        hand = hand_written(stepper(model), [ids, pos])
        hand_us = timed(rows, name, "hand-written capture/replay", lambda: hand(ids, pos))
    rows.append({"case": name, "variant": "make_graphed_callables", "us/call": "n/a",
                 "note": "takes tensors only; the StaticCache argument is not a tensor"})
    graphed_model = autograph.graphed(copy.deepcopy(model))
    with torch.inference_mode():
        step = stepper(graphed_model)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(ids, pos)
        step(ids, pos)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        us = timed(rows, name, "autograph.graphed(model)", lambda: step(ids, pos),
                   note=f"first call (warmup+capture) {first:.2f} s;")
        with_ratio(rows, us, hand_us)
        decorated = autograph.graphed(stepper(copy.deepcopy(model)))
        decorated_us = timed(rows, name, "autograph.graphed(step function)",
                             lambda: decorated(ids, pos))
        with_ratio(rows, decorated_us, hand_us)
        in_region = stepper(copy.deepcopy(model))
        with autograph.region():
            us = timed(rows, name, "HF decode in autograph.region()", lambda: in_region(ids, pos))
        with_ratio(rows, us, hand_us)
        if us and decorated_us:
            rows[-1]["note"] += f", {us / decorated_us:.3f}x the decorated step"
        row = [r for r in graphed_model.forward.stats() if "[1, 1]" in r.key][0]
        assert row.state == "graphed", row
    if with_compile:
        try:
            with torch.inference_mode():
                fn, seconds = compiled(stepper(copy.deepcopy(model)), (ids, pos))
                timed(rows, name, 'torch.compile("reduce-overhead")', lambda: fn(ids, pos),
                      note=f"first 3 calls {seconds:.1f} s")
        except Exception as error:
            rows.append({"case": name, "variant": 'torch.compile("reduce-overhead")',
                         "us/call": "n/a", "note": f"{type(error).__name__}"})


def case_small(rows, with_compile):
    name = "(c) one kernel, four small tensors"
    tensors = [torch.randn(64, device="cuda") for _ in range(4)]

    def cat4(a, b, c, d):
        return torch.cat((a, b, c, d))

    with torch.no_grad():
        timed(rows, name, "eager", lambda: cat4(*tensors))
        hand = hand_written(cat4, tensors)
        hand_us = timed(rows, name, "hand-written capture/replay", lambda: hand(*tensors))
        mgc = torch.cuda.make_graphed_callables(cat4, tuple(t.clone() for t in tensors))
        timed(rows, name, "make_graphed_callables", lambda: mgc(*tensors))
        step = autograph.graphed(cat4)
        us = timed(rows, name, "autograph.graphed", lambda: step(*tensors))
        with_ratio(rows, us, hand_us)
        assert torch.equal(step(*tensors), cat4(*tensors))
        if with_compile:
            fn, seconds = compiled(cat4, tensors)
            timed(rows, name, 'torch.compile("reduce-overhead")', lambda: fn(*tensors),
                  note=f"first 3 calls {seconds:.1f} s")


CASES = {"a": case_mlp, "b": case_llama, "c": case_small}


def run_case(letter, with_compile):
    """One case in this process: its rows as JSON on the last line of stdout."""
    rows = []
    try:
        CASES[letter](rows, with_compile)
    except Exception:
        traceback.print_exc()
        rows.append({"case": letter, "variant": "(case failed)", "us/call": "n/a"})
    print(json.dumps(rows))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile rows")
    parser.add_argument("--cases", default="abc")
    parser.add_argument("--write", default=os.path.join(HERE, "RESULTS.md"))
    parser.add_argument("--one-case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_case:
        return run_case(args.one_case, not args.no_compile)
    rows = []
    for letter in args.cases:
        # Each case in a fresh process, so that one case's compiled code and heap do not
        # slow another's Python; within a case, torch.compile runs last for the same reason.
        command = [sys.executable, __file__, "--one-case", letter]
        if args.no_compile:
            command.append("--no-compile")
        path = os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": path})
        sys.stderr.write(done.stderr)
        try:
            rows.extend(json.loads(done.stdout.strip().splitlines()[-1]))
        except (IndexError, ValueError):
            rows.append({"case": letter, "variant": "(case failed)", "us/call": "n/a",
                         "note": f"exit code {done.returncode}"})
    table = format_rows(rows, ["case", "variant", "us/call", "note"])
    header = (f"{datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(header + "\n\n" + table)
    if args.write:
        with open(args.write, "w") as fh:
            fh.write("# Benchmark results\n\nWritten by `benchmarks/run.py` in one run; "
                     "figures are microseconds per call (median of 7 runs of 200 calls, "
                     "GPU synchronised around each run). Each case runs in a fresh process, "
                     "torch.compile last within it.\n\n" + header + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
