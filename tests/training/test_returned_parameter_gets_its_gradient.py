"""A parameter the function returns as it is gets its gradient."""

import copy

import pytest
import torch

import autograph

from conftest import states

pytestmark = pytest.mark.usefixtures("caught")


def test_returned_parameter_grad(device):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.lin(x) * self.scale, self.scale

    torch.manual_seed(0)
    m = M().to(device)
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    for _ in range(4):
        x = torch.randn(2, 4, device=device)
        out, s = g(x)
        rout, rs = ref(x)
        assert s is m.scale
        (out.sum() + (s * s).sum()).backward()
        (rout.sum() + (rs * rs).sum()).backward()
        torch.testing.assert_close(m.scale.grad, ref.scale.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad, rtol=1e-6, atol=1e-6)
    assert states(g)[0][0] == "graphed" and states(g)[0][3] >= 2, autograph.stats(g)
