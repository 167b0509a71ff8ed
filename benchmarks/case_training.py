"""(t) Training steps: a 16-layer Linear(512)+GELU MLP at batch 32 in float32, and an HF
transformers Llama (4 layers, hidden 256, causal-LM loss) at batch 8 x 128 tokens.

Per model: eager; ``make_graphed_callables`` on the module with an eager optimizer;
autograph on the module (forward and backward graphs) with an eager optimizer, and for the
Llama also on the wrapper that ``make_graphed_callables`` graphs (the ratios compare one module:
the model itself returns its logits too, copied out of its graph a call); autograph on
the whole step (forward, backward, ``Adam(capturable=True).step()``); a hand-written
capture of the whole step; and, with compile, ``torch.compile(mode="reduce-overhead")`` on
the module with an eager optimizer. Figures are us per training step; each row's note gives
the time its first steps took (warmup and capture, or the references' setup). About 2 min
on an H200, most of it the Llama rows and compilation.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import autograph
from autograph.cli._bench import (
    add_row,
    capture_graph,
    compile_for_bench,
    device,
    mlp,
    progress,
    side_by_side,
    sync,
    with_ratio,
)

MLP = "(t) training step, MLP 16x512 fp32, batch 32"
LLAMA = "(t) training step, HF Llama 4x256 fp32, batch 8x128"

Step = Callable[[], Any]


def first_steps(make: Callable[[], Step], steps: int = 2) -> Tuple[Step, float]:
    """Build a variant's step and run its first ``steps`` steps: (step, their seconds, setup
    included). Two steps: autograph's warmup and capture."""
    sync()
    start = time.perf_counter()
    step = make()
    for _ in range(steps):
        step()
    sync()
    return step, time.perf_counter() - start


def eager_step(
    model: torch.nn.Module,
    loss_of: Callable,
    batch: tuple,
    capturable: bool = False,
    set_to_none: bool = True,
) -> Step:
    """zero_grad, forward, backward and an Adam step, as a training loop writes them."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=capturable)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = loss_of(model, *batch)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def hand_written_step(model: torch.nn.Module, loss_of: Callable, batch: tuple) -> Step:
    """The whole step captured by hand (the PyTorch CUDA-graphs docs' recipe): static inputs,
    warmup on a side stream, one capture; each step copies the batch in and replays."""
    statics = tuple(t.clone() for t in batch)
    whole = eager_step(model, loss_of, statics, capturable=device() == "cuda")
    graph, loss = capture_graph(whole, warmup=3)

    def step() -> torch.Tensor:
        for static, t in zip(statics, batch):
            static.copy_(t)
        graph.replay()
        return loss.clone()

    return step


def variants(
    model: torch.nn.Module,
    loss_of: Callable,
    batch: tuple,
    graphable: Optional[Callable[[torch.nn.Module], torch.nn.Module]],
    with_compile: bool,
) -> Dict[str, Tuple[Callable[[], Step], int, str]]:
    """variant name -> (build its step, steps its first-steps time covers, what they are)."""
    dev = device()
    fresh = lambda: copy.deepcopy(model)  # noqa: E731 - every variant trains its own copy

    def make_graphed(set_to_none: bool = True) -> Step:
        module = graphable(fresh())
        graphed = torch.cuda.make_graphed_callables(module, batch[:1])  # its input alone
        return eager_step(
            module, lambda m, *b: loss_of(graphed, *b), batch, set_to_none=set_to_none
        )

    def compiled() -> Step:
        module = fresh()
        forward = compile_for_bench(module, mode="reduce-overhead")
        return eager_step(module, lambda m, *b: loss_of(forward, *b), batch)

    def whole_step() -> Step:
        return autograph.graphed(eager_step(fresh(), loss_of, batch, capturable=dev == "cuda"))

    found = {
        "eager": (lambda: eager_step(fresh(), loss_of, batch), 1, "first step"),
        "hand-written whole step": (
            lambda: hand_written_step(fresh(), loss_of, batch),
            1,
            "3 warmup steps, capture and 1 replay",
        ),
        "autograph.graphed(module) + eager optimizer": (
            lambda: eager_step(autograph.graphed(fresh()), loss_of, batch),
            2,
            "first 2 steps: warmup and capture",
        ),
        "autograph.graphed(whole step)": (whole_step, 2, "first 2 steps: warmup and capture"),
    }
    # .grad kept between steps (zero_grad(set_to_none=False)): gradients accumulate in place
    found[KEPT] = (
        lambda: eager_step(autograph.graphed(fresh()), loss_of, batch, set_to_none=False),
        2,
        "first 2 steps: warmup and capture",
    )
    if graphable is not None and type(graphable(model)) is not type(model):
        # The module make_graphed_callables graphs (a wrapper returning the loss alone), graphed
        # by autograph too, so that a ratio compares one module: the model itself also returns
        # its logits (a copy a call) in a ModelOutput (built a call).
        for name, set_to_none in ((SAME, True), (SAME_KEPT, False)):
            found[name] = (
                lambda set_to_none=set_to_none: eager_step(
                    autograph.graphed(graphable(fresh())), loss_of, batch, set_to_none=set_to_none
                ),
                2,
                "first 2 steps: warmup and capture",
            )
    if dev == "cuda" and graphable is not None:
        found[REFERENCE] = (
            make_graphed,
            1,
            "3 warmup steps, capture and 1 step",
        )
        found[KEPT_REFERENCE] = (
            lambda: make_graphed(set_to_none=False),
            1,
            "3 warmup steps, capture and 1 step",
        )
    if with_compile:
        found['torch.compile("reduce-overhead") + eager optimizer'] = (
            compiled,
            3,
            "first 3 steps, compilation included",
        )
    return found


KEPT = "autograph.graphed(module) + eager optimizer, zero_grad(set_to_none=False)"
KEPT_REFERENCE = "make_graphed_callables(module) + eager optimizer, zero_grad(set_to_none=False)"
REFERENCE = "make_graphed_callables(module) + eager optimizer"
SAME = "autograph.graphed(the module make_graphed_callables graphs) + eager optimizer"
SAME_KEPT = f"{SAME}, zero_grad(set_to_none=False)"
# Each autograph variant against the reference that graphs the same thing; where the
# reference graphs a wrapper of the model (SAME), the model's own rows get no ratio.
RATIOS = {
    "autograph.graphed(module) + eager optimizer": REFERENCE,
    KEPT: KEPT_REFERENCE,
    SAME: REFERENCE,
    SAME_KEPT: KEPT_REFERENCE,
    "autograph.graphed(whole step)": "hand-written whole step",
}


def run_model(
    rows: List[Dict[str, Any]],
    name: str,
    model: torch.nn.Module,
    loss_of: Callable,
    batch: tuple,
    graphable: Optional[Callable[[torch.nn.Module], torch.nn.Module]],
    with_compile: bool,
    counts: Tuple[int, int, int] = (200, 7, 20),
) -> None:
    """Build every variant (its first steps timed), then time them all in interleaved rounds
    (``counts``: steps a round, rounds, warmup steps): a training step is host-bound, and on
    a host that drifts by 15% within a minute variants timed one after the other gave ratios
    from 0.875x to 1.161x for the same code."""
    built: Dict[str, Tuple[Step, str]] = {}
    for variant, (make, steps, what) in variants(
        model, loss_of, batch, graphable, with_compile
    ).items():
        progress(f"{name}: {variant}")
        try:
            step, seconds = first_steps(make, steps)
        except Exception as error:  # a reference that does not support the model
            add_row(
                rows,
                name,
                variant,
                None,
                note=f"{type(error).__name__}: {str(error).splitlines()[0][:100]}",
            )
            continue
        built[variant] = (step, f"us per step; {what} {seconds:.2f} s")
    progress(f"{name}: {len(built)} variants, interleaved")
    medians = side_by_side({v: step for v, (step, _) in built.items()}, *counts)
    measured: Dict[str, Tuple[float, Dict[str, Any]]] = {}
    for variant, (_, note) in built.items():
        add_row(rows, name, variant, medians[variant], note=note)
        measured[variant] = (medians[variant], rows[-1])
    ratios = dict(RATIOS)
    if SAME in measured:
        del ratios["autograph.graphed(module) + eager optimizer"], ratios[KEPT]
    for variant, reference in ratios.items():
        if variant in measured and reference in measured:
            with_ratio(
                rows,
                measured[variant][0],
                measured[reference][0],
                reference,
                row=measured[variant][1],
            )


def mlp_loss(model: Callable, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), target)


def case_mlp_training(rows: List[Dict[str, Any]], with_compile: bool) -> None:
    dev = device()
    model = mlp(layers=16, width=512, dtype=torch.float32, device=dev).train()
    model.requires_grad_(True)
    torch.manual_seed(1)
    x = torch.randn(32, 512, device=dev)
    batch = (x, x.tanh())
    run_model(rows, MLP, model, mlp_loss, batch, lambda m: m, with_compile)


class CausalLMLoss(torch.nn.Module):
    """A Llama and its loss as one module of tensors: ``make_graphed_callables`` takes
    tensor arguments only, no keywords."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def llama_loss(model: Callable, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, CausalLMLoss) or not isinstance(model, torch.nn.Module):
        return model(ids)  # make_graphed_callables' graphed CausalLMLoss
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def case_llama_training(rows: List[Dict[str, Any]], with_compile: bool) -> None:
    try:
        import transformers
    except ImportError:
        add_row(rows, LLAMA, "(all variants)", None, note="transformers is not installed")
        return
    dev = device()
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4 if dev == "cuda" else 1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dev).train()
    torch.manual_seed(1)
    ids = torch.randint(0, 1024, (8, 128) if dev == "cuda" else (2, 16), device=dev)
    run_model(
        rows,
        LLAMA,
        model,
        llama_loss,
        (ids,),
        CausalLMLoss,
        with_compile,
        counts=(50, 5, 5),
    )


def case_training(rows: List[Dict[str, Any]], with_compile: bool) -> None:
    case_mlp_training(rows, with_compile)
    case_llama_training(rows, with_compile)
