"""copy.deepcopy of a graphed module or function in the middle of its life gives an independent one
that graphs again.
"""

import copy

import pytest
import torch

import autograph

from conftest import states
from helpers.models import gelu_mlp

pytestmark = pytest.mark.usefixtures("caught")


def test_deepcopy_of_a_graphed_module_mid_life(device):
    m = autograph.graphed(gelu_mlp(device))
    xs = [torch.randn(4, 8, device=device) for _ in range(6)]
    with torch.no_grad():
        for x in xs[:3]:
            m(x)
        twin = copy.deepcopy(m)
        with torch.no_grad():
            twin[0].weight.add_(1.0)
        plain_twin = gelu_mlp(device)
        plain_twin.load_state_dict(twin.state_dict())
        plain = gelu_mlp(device)
        for x in xs:
            torch.testing.assert_close(m(x), plain(x), rtol=0, atol=0)
            torch.testing.assert_close(twin(x), plain_twin(x), rtol=0, atol=0)
    assert states(m)[0][0] == "graphed" and states(m)[0][3] >= 7, states(m)
    assert twin[0].weight.data_ptr() != m[0].weight.data_ptr()


def test_deepcopy_of_a_graphed_function_mid_life(device):
    w = torch.randn(5, 5, device=device)

    @autograph.graphed
    def f(x):
        return x @ w + 1

    for _ in range(3):
        f(torch.randn(2, 5, device=device))
    twin = copy.deepcopy(f)
    for _ in range(3):
        x = torch.randn(2, 5, device=device)
        torch.testing.assert_close(f(x), x @ w + 1, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(twin(x), x @ w + 1, rtol=1e-6, atol=1e-6)
    assert states(f)[0][3] >= 4, autograph.stats(f)
