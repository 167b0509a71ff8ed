"""Hostile review of this session's changes (private generators, per_bucket, size reads under
buckets, the replay path, training replays that hand autograd the graph's own gradients): each
test compares with eager and asserts the graph state. Strict xfails are open defects."""
import contextlib

import pytest
import torch

import autograph
from conftest import states

pytestmark = pytest.mark.usefixtures("caught")


def _mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1)).to(device)


# ---- training: the graph's own gradient buffers handed to autograd ----

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
    streams = torch.cuda.stream(autograph.capture_stream()) if device == "cuda" else \
        contextlib.nullcontext()
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


# Found by review: such a hook was handed a view of the graph's own gradient buffer, which
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


# ---- private generators ----

class _Noisy(torch.nn.Module):
    def __init__(self, generator):
        super().__init__()
        self.generator = generator

    def forward(self, x):
        return x + torch.rand(3, generator=self.generator, device=x.device)


def _draws_after_a_swap(device, graph):
    first = torch.Generator(device=device).manual_seed(1)
    second = torch.Generator(device=device).manual_seed(2)   # both stay alive
    module = _Noisy(first)
    fn = autograph.graphed(module) if graph else module
    outputs = []
    with torch.no_grad():
        for i in range(8):
            module.generator = first if i < 4 else second
            outputs.append(fn(torch.zeros(3, device=device)))
    return outputs, fn, (first.get_state(), second.get_state())


# Found by review: the graph kept drawing from the old generator. A generator reached as an
# attribute is now checked on every replay (_slots.GeneratorSlots), and a swap captures again.
def test_a_generator_attribute_swapped_for_another_live_one_is_drawn_from(device):
    got, fn, got_states = _draws_after_a_swap(device, True)
    assert states(fn)[0][3] >= 1  # replayed
    autograph.reset()
    expected, _, expected_states = _draws_after_a_swap(device, False)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(got_states, expected_states))


def test_a_generator_passed_as_an_argument_keys_the_call(device):
    gens = [torch.Generator(device=device).manual_seed(s) for s in (1, 2)]
    refs = [torch.Generator(device=device).manual_seed(s) for s in (1, 2)]
    fn = autograph.graphed(lambda x, g: x + torch.rand(3, generator=g, device=device))
    for i in range(8):
        got = fn(torch.zeros(3, device=device), gens[i % 2])
        assert torch.equal(got, torch.rand(3, generator=refs[i % 2], device=device))
    assert states(fn) == [("graphed", 4, 1, 3), ("graphed", 4, 1, 3)]


def test_a_generators_set_state_between_replays_is_followed(device):
    generator = torch.Generator(device=device).manual_seed(1)
    start = generator.get_state()
    fn = autograph.graphed(lambda x: x + torch.rand(3, generator=generator, device=device))
    reference = torch.Generator(device=device).manual_seed(1)
    for i in range(8):
        if i % 3 == 2:
            generator.set_state(start)
            reference.set_state(start)
        got = fn(torch.zeros(3, device=device))
        assert torch.equal(got, torch.rand(3, generator=reference, device=device))
    assert states(fn) == [("graphed", 8, 1, 7)]


# ---- a number read from the batch size, under buckets ----

SIZE_AS_VALUES = {
    "torch.linspace(0, 1, n)": lambda x: x * torch.linspace(0, 1, x.shape[0],
                                                            device=x.device).unsqueeze(1),
    "torch.ones(n).sum()": lambda x: x * torch.ones(x.shape[0], device=x.device).sum(),
    "x.new_ones(n).cumsum(0)[-1]": lambda x: x * x.new_ones(x.shape[0]).cumsum(0)[-1],
}


# Found by review: the graph of 4 gave 4's values for 3 rows. A stateless key's first replay
# with pad rows is now checked against an eager run of its own rows.
@pytest.mark.parametrize("name", sorted(SIZE_AS_VALUES))
def test_a_value_made_from_the_batch_size_through_a_shape_is_not_replayed_wrong(device, name):
    reference = SIZE_AS_VALUES[name]
    fn = autograph.graphed(reference, buckets=[4, 8])
    for n in (3, 3, 3, 3):
        x = torch.randn(n, 5, device=device)
        torch.testing.assert_close(fn(x), reference(x))
    assert states(fn)[0][0] == "eager"
    assert "padded from 3 rows to its bucket of 4" in autograph.stats(fn)[0].fallback_reason


# Found by review: on the emulation the graph of 4 replayed 4 for 3 rows; the check of the
# first replay with pad rows against an eager run now makes the key eager.
def test_a_tensor_made_from_the_batch_size_on_the_emulation(emulated):
    def reference(x):
        return x * torch.tensor(x.shape[0])

    fn = autograph.graphed(reference, buckets=[4, 8])
    for n in (3, 3, 3, 3):
        x = torch.randn(n, 5)
        torch.testing.assert_close(fn(x), reference(x))
    assert states(fn)[0][0] == "eager"


@pytest.mark.parametrize("name", ["float(n)", "n ** 2", "x.new_full", "branch", "len(x)"])
def test_more_numbers_read_from_the_batch_size_run_eagerly(device, name):
    reference = {
        "float(n)": lambda x: x * float(x.shape[0]),
        "n ** 2": lambda x: x * x.size(0) ** 2,
        "x.new_full": lambda x: x + x.new_full((1, 5), x.shape[0]),
        "branch": lambda x: x * 2 if x.shape[0] > 3 else x * 3,
        "len(x)": lambda x: x * len(x),
    }[name]
    fn = autograph.graphed(reference, buckets=[4, 8])
    for n in (3, 3, 3, 3, 6, 6):
        x = torch.randn(n, 5, device=device)
        torch.testing.assert_close(fn(x), reference(x), rtol=0, atol=0)
    assert [row[0] for row in states(fn)] == ["eager", "eager"]
