"""(h) HF text generation end to end: the Llama of case (b) (8 layers, hidden 512, bf16),
8-token prompts, 64 new tokens, greedy, at batch 1 and 8, six ways side by side in one process:

- ``model.generate`` eagerly (its default DynamicCache);
- ``model.generate`` in ``autograph.region()`` with the caller's StaticCache (reset in place
  per call; ``disable_compile=True``): each model call graphed, the loop's host read per token
  left;
- transformers' compiled path (``cache_implementation="static"``: transformers compiles the
  decode forward on CUDA);
- ``autograph.generate``: each decode step one graph replay, the host checking the end every 8
  tokens;
- ``autograph.generate(compile=True)``: the graphed step is ``torch.compile(step)``;
- on CUDA, the reference: a hand-written loop replaying one ``torch.cuda.graph`` of the decode
  step per token (``_HandWritten``: autograph.generate's forward and mask, then an argmax).

Tokens per second (median of interleaved rounds), each variant's first call in the process
(its capture, or its compile, included), whether its tokens equal eager's and the region's
(whose StaticCache has autograph.generate's length, 128: the same attention shapes), and for
``autograph.generate`` the memory its first call took (cache, state and graphs) and its graphs'
``graph_bytes``. Issue 36's targets at batch 1: autograph.generate >= 2.0x the region and >= 2.0x
the compiled path, first call <= 0.5 s, tokens equal; compile=True >= 1.6x autograph.generate;
at batch 8 >= 1.8x the region. About 60-90 s on an H200 (two compiles of ~15 s each).
"""

from __future__ import annotations

import copy
import inspect
import statistics
import time

import torch
from case_llama import llama_setup

import autograph
from autograph.cli._bench import SMOKE, add_row, device, progress, sync

NAME = "(h) HF generate end to end, 8x512 Llama bf16, 8-token prompt, 64 new tokens"
NEW_TOKENS = 8 if SMOKE else 64
PROMPT = 8
ROUNDS = 1 if SMOKE else 5
CACHE_LENGTH = max(64, 1 << (PROMPT + NEW_TOKENS - 1).bit_length())
# On the CPU the emulation records ATen ops, which Inductor's kernels bypass: a Dynamo backend
# that keeps them stands in for it in a smoke run.
COMPILE = {"backend": "aot_eager"} if SMOKE or device() != "cuda" else True


REGION = "generate() in autograph.region(), StaticCache"


def _seconds(call, *args):
    sync()
    start = time.perf_counter()
    out = call(*args)
    sync()
    return time.perf_counter() - start, out


HAND_WRITTEN = "hand-written loop, one CUDA graph per token"


class _HandWritten:
    """The reference a serving engine writes by hand: a StaticCache of autograph.generate's
    length, the decode step (the same forward over the same full-cache mask as
    autograph.generate's step, then an argmax) captured once with ``torch.cuda.graph`` and
    replayed for every token, nothing read on the host until the end. Greedy only, no end of
    sequence: what its graph saves, with nothing of autograph in the loop."""

    def __init__(self, transformers, config, model, rows, cache_name):
        self.model, self.cache_name = model, cache_name
        self.cache = transformers.StaticCache(config=config, max_cache_len=CACHE_LENGTH)

        def longs(*shape):
            return torch.zeros(shape, dtype=torch.long, device=device())

        self.token, self.position, self.index = longs(rows, 1), longs(rows, 1), longs(1)
        self.generated = longs(rows, NEW_TOKENS)
        self.mask = torch.ones(rows, CACHE_LENGTH, dtype=torch.long, device=device())
        self.graph = None

    def _forward(self, ids, **kwargs):
        cache = {self.cache_name: self.cache}
        return self.model(input_ids=ids, use_cache=True, **cache, **kwargs).logits[:, -1:]

    def _keep(self, logits):
        self.token.copy_(logits.argmax(-1))
        self.generated.index_copy_(1, self.index, self.token)
        self.index.add_(1)

    def _step(self):
        self.position.add_(1)
        self._keep(self._forward(self.token, attention_mask=self.mask, position_ids=self.position))

    def __call__(self, ids):
        self.cache.reset()
        self.index.zero_()
        self._keep(self._forward(ids))  # the prefill, eagerly
        self.position.fill_(ids.shape[1] - 1)
        steps = NEW_TOKENS - 1
        if self.graph is None:  # torch's recipe: a warmup on a side stream, then the capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step()  # the first decode step, run eagerly
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()  # recorded, not run
            steps -= 1
        for _ in range(steps):
            self.graph.replay()
        return torch.cat([ids, self.generated], dim=1)


def _variants(transformers, config, model, copies, with_compile):
    """{name: call}, each on its own copy of the model (graphs and compiled code are kept per
    model), the same copies at every batch size."""
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    # The length autograph.generate gives its own cache (a power of two >= the 72 needed): the
    # region's tokens come from the same attention shapes, so they are the exact reference.
    cache = transformers.StaticCache(config=config, max_cache_len=CACHE_LENGTH)
    # transformers >= 5.18 names it cache (past_key_values still works, with a warning)
    cache_name = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )

    def in_region(ids):
        cache.reset()  # in place: the addresses the region's graphs read hold
        with autograph.region():
            return copies["region"].generate(
                ids, disable_compile=True, **{cache_name: cache}, **greedy
            )

    variants = {
        "generate() eager": lambda ids: model.generate(ids, **greedy),
        REGION: in_region,
        "autograph.generate": lambda ids: autograph.generate(copies["autograph"], ids, **greedy),
    }
    if device() == "cuda":
        rows = {}  # one hand-written loop per batch size, made at its first call

        def hand_written(ids):
            if ids.shape[0] not in rows:
                rows[ids.shape[0]] = _HandWritten(
                    transformers, config, copies["hand-written"], ids.shape[0], cache_name
                )
            return rows[ids.shape[0]](ids)

        variants[HAND_WRITTEN] = hand_written
    if with_compile:
        variants['transformers compiled (cache_implementation="static")'] = lambda ids: copies[
            "compiled"
        ].generate(ids, cache_implementation="static", **greedy)
        variants["autograph.generate(compile=True)"] = lambda ids: autograph.generate(
            copies["autograph compile"], ids, compile=COMPILE, **greedy
        )
    return variants


def _first_calls(variants, ids):
    """Each variant's first call in the process; autograph.generate's also with the memory it
    took (allocated after minus before: its cache, its state and its graphs' pool)."""
    firsts, memory = {}, {}
    for name, call in variants.items():
        progress(f"batch {ids.shape[0]}: {name}, first call")
        before = torch.cuda.memory_allocated() if device() == "cuda" else 0
        firsts[name], _ = _seconds(call, ids)
        if device() == "cuda":
            memory[name] = (torch.cuda.memory_allocated() - before) / 2**20
    return firsts, memory


def _graph_mib(rows):
    steps = [
        r
        for r in autograph.stats()
        if r.function.startswith("generate_decode_step[") and r.function.endswith(f" {rows} rows]")
    ]
    return sum(r.graph_bytes for r in steps) / 2**20


def _batch(rows_out, transformers, config, model, copies, rows, with_compile):
    generator = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, config.vocab_size, (rows, PROMPT), generator=generator).to(device())
    variants = _variants(transformers, config, model, copies, with_compile)
    firsts, memory = _first_calls(variants, ids)
    times = {name: [] for name in variants}
    equal = {name: {"eager": True, "region": True} for name in variants}
    for _ in range(ROUNDS):  # interleaved: a drift of the machine hits every variant alike
        outs = {}
        for name, call in variants.items():
            seconds, outs[name] = _seconds(call, ids)
            times[name].append(seconds)
        for name, out in outs.items():
            for reference, label in ((outs["generate() eager"], "eager"), (outs[REGION], "region")):
                equal[name][label] &= out.shape == reference.shape and torch.equal(out, reference)
    rates = {name: rows * NEW_TOKENS / statistics.median(t) for name, t in times.items()}
    region = rates[REGION]
    compiled = rates.get('transformers compiled (cache_implementation="static")')
    for name, rate in rates.items():
        note = (
            f"first call {firsts[name]:.2f} s; {rate / rates['generate() eager']:.2f}x "
            f"eager, {rate / region:.2f}x the region"
        )
        if compiled:
            note += f", {rate / compiled:.2f}x transformers compiled"
        note += "; tokens " + ", ".join(
            f"{'equal' if same else 'DIFFER from'} {label}'s" for label, same in equal[name].items()
        )
        if name.startswith("autograph.generate") and name in memory:
            note += (
                f"; its first call allocated {memory[name]:.1f} MiB (cache, state, "
                f"graphs), graph_bytes {_graph_mib(rows):.1f} MiB"
            )
        if name == "autograph.generate" and HAND_WRITTEN in rates:
            note += f"; {rate / rates[HAND_WRITTEN]:.2f}x the hand-written loop"
        if name == "autograph.generate(compile=True)":
            note += f"; {rate / rates['autograph.generate']:.2f}x autograph.generate"
        add_row(
            rows_out,
            NAME,
            f"batch {rows}: {name}",
            rate,
            unit="tok/s",
            x=rows,
            series=name,
            first_call_s=firsts[name],
            tokens_equal_eager=equal[name]["eager"],
            tokens_equal_region=equal[name]["region"],
            note=note,
        )


def case_generate(rows, with_compile):
    transformers, config, model = llama_setup()
    model.generation_config.eos_token_id = None  # every call makes its 64 tokens
    with torch.no_grad():
        model.generate(
            torch.zeros(1, PROMPT, dtype=torch.long, device=device()),
            max_new_tokens=2,
            do_sample=False,
        )  # CUDA and cuBLAS set up first
    copies = {
        name: copy.deepcopy(model)
        for name in ("region", "compiled", "autograph", "autograph compile", "hand-written")
    }
    for batch in (1, 8):
        _batch(rows, transformers, config, model, copies, batch, with_compile)
