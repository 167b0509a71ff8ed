"""A training graph's activations live from its forward's replay to its backward's: no other
graph may use their memory as scratch in between (docs/design.md, "Pools"). Graphs of one
function, or of one region, share a pool, where a graph captured later takes the blocks an
earlier one used as scratch; so a key that trains gets a pool of its own.

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
