"""Training replays with gradients kept between steps: a gradient kept by a hook on an
AccumulateGrad node or a tensor hook registered after capture is not overwritten; accumulation,
zero_grad in place and clipping equal eager.
"""

import contextlib

import pytest
import torch

import autograph

from conftest import states

pytestmark = pytest.mark.usefixtures("caught")


def _mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).to(
        device
    )


def _kept_by_accumulator_hooks(device, graph, kind):
    """Train 5 steps with every .grad existing (replays once handed out the graph's own views) and
    a hook on each parameter's AccumulateGrad node (as DDP's reducer and DeepSpeed register)
    that keeps the gradient it is given; return those gradients, read after the last step."""
    model = _mlp(device)
    params = list(model.parameters())
    fn = autograph.graphed(model) if graph else model
    kept, nodes, step = {}, [], [0]
    # On CUDA the nodes are made on autograph's capture stream, as DDP is built there: a node
    # kept from the default stream makes a capture wait on it, and the key runs eagerly
    streams = (
        torch.cuda.stream(autograph.capture_stream())
        if device == "cuda"
        else contextlib.nullcontext()
    )
    with streams:
        nodes += [p.view_as(p).grad_fn.next_functions[0][0] for p in params]  # AccumulateGrad
    for i, (p, node) in enumerate(zip(params, nodes)):  # hooks live as long as the node

        def keep(incoming, i=i):
            kept[(step[0], i)] = incoming[0]

        if kind == "prehook":
            node.register_prehook(keep)
        else:
            node.register_hook(lambda grad_inputs, incoming, keep=keep: keep(incoming))
        p.grad = torch.zeros_like(p)
    for s in range(5):
        step[0] = s
        fn(torch.full((2, 4), float(s + 1), device=device)).sum().backward()
    return {k: v.clone() for k, v in kept.items()}, fn


# Once wrong: such a hook was handed a view of the graph's own gradient buffer, which
# the next replay overwrote; gradients are now always fresh copies.
@pytest.mark.parametrize("kind", ["prehook", "posthook"])
def test_a_gradient_kept_by_an_accumulate_grad_node_hook_is_not_overwritten(device, kind):
    got, fn = _kept_by_accumulator_hooks(device, True, kind)
    assert states(fn) == [("graphed", 5, 1, 4)]
    autograph.reset()
    expected, _ = _kept_by_accumulator_hooks(device, False, kind)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], msg=f"step, parameter {key}")


def test_a_tensor_hook_registered_after_capture_keeps_its_own_gradient(device):
    # Guards accumulates_in_place's hook check: a hook added after the capture, on a key
    # already replaying with the graph's own views, gets fresh copies from then on.
    def train(graph):
        model = _mlp(device)
        fn = autograph.graphed(model) if graph else model
        kept = []
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for s in range(6):
            if s == 3:
                model[0].weight.register_hook(lambda g: kept.append(g))
            fn(torch.full((2, 4), float(s + 1), device=device)).sum().backward()
        return [k.clone() for k in kept], [p.grad.clone() for p in model.parameters()], fn

    got, got_grads, fn = train(True)
    assert states(fn) == [("graphed", 6, 1, 5)]
    autograph.reset()
    expected, expected_grads, _ = train(False)
    assert len(got) == len(expected) == 3
    for a, b in zip(got + got_grads, expected + expected_grads):
        torch.testing.assert_close(a, b)


def test_accumulation_over_three_steps_then_zero_grad_in_place_and_clipping(device):
    def train(graph):
        model = _mlp(device)
        fn = autograph.graphed(model) if graph else model
        seen = []
        for s in range(9):
            fn(torch.full((2, 4), float(s % 4 + 1), device=device)).sum().backward()
            if s % 3 == 2:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                seen += [p.grad.clone() for p in model.parameters()]
                model.zero_grad(set_to_none=False)
        return seen, [p.grad for p in model.parameters()], fn

    got, held, fn = train(True)
    assert states(fn) == [("graphed", 9, 1, 8)]
    autograph.reset()
    expected, _, _ = train(False)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in held)
