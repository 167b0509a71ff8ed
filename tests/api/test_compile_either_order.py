"""torch.compile and autograph stack in either order with eager's results."""

import pytest
import torch

import autograph

pytestmark = pytest.mark.usefixtures("caught")


def _fn(x, w):
    return torch.tanh(x @ w) + 1


def test_compile_of_graphed(device):
    w = torch.randn(5, 5, device=device)
    c = torch.compile(autograph.graphed(_fn), backend="eager")
    for _ in range(4):
        x = torch.randn(3, 5, device=device)
        torch.testing.assert_close(c(x, w), _fn(x, w), rtol=1e-6, atol=1e-6)


def test_graphed_of_compile(device):
    w = torch.randn(5, 5, device=device)
    g = autograph.graphed(torch.compile(_fn, backend="eager"))
    for _ in range(4):
        x = torch.randn(3, 5, device=device)
        torch.testing.assert_close(g(x, w), _fn(x, w), rtol=1e-6, atol=1e-6)
    rows = autograph.stats(g)
    assert rows and (
        rows[0].state == "graphed" and rows[0].replays >= 2 or rows[0].fallback_reason
    ), rows
