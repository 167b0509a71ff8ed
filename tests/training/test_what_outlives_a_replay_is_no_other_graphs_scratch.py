"""What a graph leaves in its memory for later, a training graph's activations (read by its
backward) or the `.grad` a whole step's backward set, must be no other graph's scratch
(docs/design.md, "Pools"). Graphs of one function, or of one region, share a pool, where a
graph captured later takes the blocks an earlier one used as scratch; so a key whose call
runs a backward or leaves one to run gets a pool of its own, a new one at each capture.

Only a GPU shows the harm (the CPU emulation gives every graph memory of its own); the pool
each key was given is checked on both."""

import copy

import pytest
import torch

import autograph
from autograph.api._region import engine_of

from conftest import requires_cuda, states


def wide_mlp(device, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 64),
    ).to(device)


def gradients_agree(model, reference):
    return all(
        torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), reference.parameters())
    )


def pools_of(engine):
    return [life.graph.pool for cache in engine.caches() for life in cache.entries.values()]


def two_modules_then_two_backwards(device, steps):
    """Two modules called through one region, then the first one's backward before the
    second's: the order in which the second's activations met the first's scratch."""
    first, second = wide_mlp(device, 0), wide_mlp(device, 1)
    references = copy.deepcopy(first), copy.deepcopy(second)
    region = autograph.region(check_payoff=False, warmup=1)
    wrong = []
    for step in range(steps):
        x, y = torch.randn(32, 64, device=device), torch.randn(32, 64, device=device)
        for m in (first, second, *references):
            m.zero_grad(set_to_none=True)
        with region:
            a, b = first(x), second(y)
        a.square().sum().backward()
        b.square().sum().backward()
        references[0](x).square().sum().backward()
        references[1](y).square().sum().backward()
        if not (gradients_agree(first, references[0]) and gradients_agree(second, references[1])):
            wrong.append(step)
    return first, second, region, wrong


def test_two_modules_of_one_region_train_in_pools_of_their_own(device):
    first, second, region, wrong = two_modules_then_two_backwards(device, 3)
    assert wrong == []
    assert states(first) == states(second) == [("graphed", 3, 1, 2)]
    [first_pool], [second_pool] = pools_of(engine_of(first)), pools_of(engine_of(second))
    region_pool = region.pools.get(first_pool.backend, first_pool.device)
    assert len({id(first_pool), id(second_pool), id(region_pool)}) == 3


@pytest.mark.cuda
@requires_cuda
def test_a_module_backward_before_another_ones_keeps_its_activations():
    # Before each key trained in its own pool, steps 1 to 5 of 6 gave wrong gradients on an
    # H100: the second module's activations sat in the first one's backward scratch.
    first, second, region, wrong = two_modules_then_two_backwards("cuda", 6)
    assert wrong == []
    assert region.stats().captures == 2 and region.stats().replays == 2 * 5


@pytest.mark.cuda
@requires_cuda
def test_two_keys_of_one_model_called_in_either_order_before_one_backward():
    # Gradient accumulation over micro-batches of two sizes, summed into one backward: the
    # order of the two forwards alternates. Before each key trained in its own pool, every
    # step that called them in the order other than their capture's gave wrong gradients.
    model = wide_mlp("cuda", 2)
    reference = copy.deepcopy(model)
    graphed = autograph.graphed(model, check_payoff=False, warmup=1)
    wrong = []
    for step in range(8):
        xs = [torch.randn(64, 64, device="cuda"), torch.randn(32, 64, device="cuda")]
        if step % 2:
            xs.reverse()
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        sum(graphed(x).square().sum() for x in xs).backward()
        sum(reference(x).square().sum() for x in xs).backward()
        if not gradients_agree(model, reference):
            wrong.append(step)
    assert wrong == []
    assert [row.state for row in autograph.stats(graphed)] == ["graphed", "graphed"]
    assert sum(row.replays for row in autograph.stats(graphed)) >= 12
    first_pool, second_pool = pools_of(graphed.forward._self_engine)
    assert first_pool is not second_pool


def test_a_whole_step_gets_a_pool_of_its_own_for_the_grads_it_leaves(device):
    # Its backward runs inside, its loss comes out detached (it does not "train"), and the
    # .grad it set is the graph's memory until the optimizer reads it after the call.
    model = wide_mlp(device, 3)
    weights = torch.randn(64, 64, device=device)

    @autograph.graphed
    def probe(x):  # another graph of the region, captured first
        return torch.tanh(x @ weights).sum(0)

    @autograph.graphed
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach()

    region = autograph.region(warmup=1, check_payoff=False)
    for _ in range(3):
        with region:
            probe(torch.randn(8, 64, device=device))
        model.zero_grad(set_to_none=True)
        with region:
            step(torch.randn(8, 64, device=device))
    assert states(probe) == states(step) == [("graphed", 3, 1, 2)]
    [probe_pool], [step_pool] = pools_of(probe._self_engine), pools_of(step._self_engine)
    assert probe_pool is region.pools.get(probe_pool.backend, probe_pool.device)
    assert step_pool is not probe_pool


def test_a_training_key_captured_again_while_its_old_backward_waits_gets_a_new_pool(device):
    model = wide_mlp(device, 4)
    graphed = autograph.graphed(model, warmup=1, check_payoff=False)
    for _ in range(3):
        graphed(torch.randn(8, 64, device=device)).sum().backward()
    [old] = [life.graph for life in graphed.forward._self_engine.cache.entries.values()]
    first = graphed(torch.randn(8, 64, device=device))  # its backward still to run
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())  # read by address
    second = graphed(torch.randn(8, 64, device=device))  # captured again
    [new] = [life.graph for life in graphed.forward._self_engine.cache.entries.values()]
    assert new is not old and new.pool is not old.pool
    first.sum().backward()  # the old graph's backward: its scratch is not the new activations
    second.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
