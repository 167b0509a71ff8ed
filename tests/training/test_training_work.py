"""A training replay's own work per step (docs/design.md, "Training graphs", "A replay's
gradients"): the ops it runs beyond its graphs, counted on the CPU emulation, and the cases
where gradients are handed to autograd while .grad exists, which must never leak the graph's
buffers."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autograph
from autograph.backends import _cpu_graphs

from conftest import states
from helpers.torch_versions import detaches_per_adopted_gradient
from helpers.training import batches, grads_of, mlp, same


class _OpsOutsideReplays(TorchDispatchMode):
    """Counts the ATen ops that run outside the emulated graphs' replays."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops = collections.Counter()
        self.replaying = 0
        replay = _cpu_graphs.CpuGraph.replay

        def counted_replay(graph):
            self.replaying += 1
            try:
                replay(graph)
            finally:
                self.replaying -= 1

        monkeypatch.setattr(_cpu_graphs.CpuGraph, "replay", counted_replay)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.replaying:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _one_replayed_step(model, x, set_to_none, monkeypatch):
    """Warm up and capture, then count the ops of one replayed forward and backward."""
    for _ in range(3):
        model.zero_grad(set_to_none=set_to_none)
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=set_to_none)
    counted = _OpsOutsideReplays(monkeypatch)
    replays = states(model)[0][3]
    with counted:
        out = model(x)
        out.backward(torch.ones_like(out))
    assert states(model)[0][3] == replays + 1  # the counted step was a replay
    return counted.ops


def test_gradients_added_into_existing_grads_are_fresh_copies(emulated, monkeypatch):
    model = autograph.graphed(mlp("cpu"))
    ops = _one_replayed_step(model, batches("cpu", 1)[0], False, monkeypatch)
    # Two clones: the output, and the packed gradients (a hook on a parameter's AccumulateGrad
    # node is handed the gradient itself and may keep it: never the graph's own buffer); one
    # add each into the existing .grad
    assert ops["clone"] == 2
    assert ops["add_"] == len(list(model.parameters()))


def test_fresh_gradients_cost_one_clone_and_one_cut_per_shape(emulated, monkeypatch):
    torch.manual_seed(0)
    model = autograph.graphed(
        torch.nn.Sequential(
            *[layer for _ in range(4) for layer in (torch.nn.Linear(32, 32), torch.nn.SiLU())]
        )
    )
    ops = _one_replayed_step(model, torch.randn(16, 32), True, monkeypatch)
    # The output's clone and the packed gradients' clone; the gradients are cut from it by
    # shape (narrow, view, unbind), not one by one (a narrow and a view each: 16 ops here),
    # and AccumulateGrad adopts each (its detaches, as eagerly: two each before torch 2.10).
    assert ops["clone"] == 2
    assert ops["slice"] + ops["view"] + ops["unbind"] == 3 * 2  # two shapes
    assert ops["detach"] == detaches_per_adopted_gradient() * len(list(model.parameters()))
    assert ops["add_"] == 0


def _kept_across_steps(device, wrap, take, prepare=lambda model: None):
    """Steps with .grad kept (zero_grad(set_to_none=False)); what each ``take`` hands out."""
    model = mlp(device)
    prepare(model)
    model = wrap(model)
    kept = []
    for x in batches(device, 5):
        if kept:
            model.zero_grad(set_to_none=False)
        kept.append(take(model, model(x).square().mean()))
    return model, kept


def test_autograd_grad_gets_fresh_gradients_while_grads_exist(device):
    def take(model, loss):
        if all(p.grad is not None for p in model.parameters()):
            return list(torch.autograd.grad(loss, list(model.parameters())))
        loss.backward()
        return None

    _, eager = _kept_across_steps(device, lambda m: m, take)
    model, graphed = _kept_across_steps(device, autograph.graphed, take)
    # Each step's gradients must stay as they were when a later step replays the graph.
    assert all(e is None and g is None or same(e, g) for e, g in zip(eager, graphed))
    assert eager[-1] is not None and states(model)[0][3] >= 3


def test_a_tensor_hook_keeping_its_gradient_gets_a_fresh_one_while_grads_exist(device):
    def run(wrap):
        seen = []
        model, _ = _kept_across_steps(
            device,
            wrap,
            lambda m, loss: loss.backward(),
            prepare=lambda m: m[0].weight.register_hook(seen.append),
        )
        return model, seen

    eager_model, eager = run(lambda m: m)
    model, graphed = run(autograph.graphed)
    assert len(eager) == len(graphed) == 5
    assert all(torch.equal(e, g) for e, g in zip(eager, graphed))
    assert same(grads_of(eager_model), grads_of(model))
    assert states(model)[0][3] >= 3


@pytest.mark.parametrize("subset", [False, True])
def test_existing_grads_accumulate_as_eagerly_with_backward_inputs(device, subset):
    def run(wrap):
        model = wrap(mlp(device))
        params = list(model.parameters())
        record = []
        for step, x in enumerate(batches(device, 6)):
            if step == 4:
                params[1].grad = None  # one .grad cleared: the others still accumulate
            loss = model(x).square().mean()
            loss.backward(inputs=params[::2] if subset else None)
            record.append(grads_of(model))
        return model, record

    _, eager = run(lambda m: m)
    model, graphed = run(autograph.graphed)
    assert all(same(e, g) for e, g in zip(eager, graphed))
    assert states(model)[0][3] >= 4


def test_an_optimizer_in_backward_that_clears_each_grad_steps_as_eagerly(device):
    def run(wrap):
        model = wrap(mlp(device))
        optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

        def step_and_clear(p):
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=False)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_and_clear)
        for x in batches(device, 6):
            model(x).square().mean().backward()
        return model, [p.detach().clone() for p in model.parameters()]

    _, eager = run(lambda m: m)
    model, graphed = run(autograph.graphed)
    assert same(eager, graphed)
    assert states(model)[0][3] >= 4
