"""The shortened replay path (issue 23, item 4) keeps every check: fresh outputs for a lone
tensor, written arguments copied back, aliasing arguments sent to eager, the last key's
shortcut used and left when the arguments change."""

import torch

import autograph

from conftest import states


def test_a_lone_tensor_output_is_a_new_copy_on_every_replay(device):
    @autograph.graphed
    def step(x, w):
        return x * w + 1

    x, w = torch.randn(8, 8, device=device), torch.randn(8, 8, device=device)
    outs = [step(x, w) for _ in range(6)]
    assert states(step) == [("graphed", 6, 1, 5)]  # a warmup, a capture, replays
    expected = x * w + 1
    assert all(torch.equal(o, expected) for o in outs)
    replayed = outs[-3:]
    assert len({o.untyped_storage().data_ptr() for o in replayed}) == 3  # no shared buffer
    replayed[0].zero_()  # the caller owns it: the next replay is not affected
    assert torch.equal(step(x, w), expected)


def test_a_written_argument_is_copied_back_and_an_aliasing_call_runs_eagerly(device):
    @autograph.graphed
    def accumulate(total, x):
        total.add_(x)
        return total.sum()

    total, x = torch.zeros(4, device=device), torch.ones(4, device=device)
    for _ in range(5):
        accumulate(total, x)
    assert states(accumulate) == [("graphed", 5, 1, 4)]
    assert torch.equal(total, torch.full((4,), 5.0, device=device))
    # The same tensor as both arguments: the graph's static copies would not see the write
    # through the other argument, so the aliasing check (still asked) sends it to eager.
    shared = torch.ones(4, device=device)
    result = accumulate(shared, shared)
    assert torch.equal(shared, torch.full((4,), 2.0, device=device))
    assert result.item() == 8.0
    assert states(accumulate) == [("graphed", 6, 2, 4)]


def test_the_last_key_is_left_when_an_argument_changes_shape(device):
    @autograph.graphed
    def step(x):
        return x * 2

    small, large = torch.ones(2, device=device), torch.ones(3, device=device)
    for _ in range(5):
        assert torch.equal(step(small), small * 2)
    for _ in range(5):
        assert torch.equal(step(large), large * 2)
    assert torch.equal(step(small), small * 2)
    assert [s[0] for s in states(step)] == ["graphed", "graphed"]
    assert [s[3] for s in states(step)] == [5, 4]
