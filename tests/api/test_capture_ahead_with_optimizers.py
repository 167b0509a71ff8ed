"""capture() ahead of a training step with an optimizer (SGD with momentum, Adam) leaves the
optimizer state as before.
"""

import copy

import pytest
import torch

import autograph

pytestmark = pytest.mark.usefixtures("caught")


def test_capture_with_sgd_momentum(device):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2).to(device)
    ref = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def step(model, o, x):
        o.zero_grad(set_to_none=False) if o.state else o.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        o.step()
        return loss.detach()

    g = autograph.graphed(lambda x: step(m, opt, x))
    x0 = torch.randn(3, 4, device=device)
    with pytest.warns(autograph.AutographWarning):
        g.capture(x0)
    assert not opt.state or all(len(s) == 0 for s in opt.state.values()), opt.state
    torch.testing.assert_close(m.weight, ref.weight, rtol=0, atol=0)
    for _ in range(6):
        x = torch.randn(3, 4, device=device)
        torch.testing.assert_close(g(x), step(ref, ref_opt, x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m.weight, ref.weight, rtol=1e-6, atol=1e-6)


def test_capture_with_adam(device):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2).to(device)
    ref = copy.deepcopy(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)

    def step(model, o, x):
        o.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        o.step()
        return loss.detach()

    g = autograph.graphed(lambda x: step(m, opt, x))
    g.capture(torch.randn(3, 4, device=device))
    torch.testing.assert_close(m.weight, ref.weight, rtol=0, atol=0)
    for _ in range(5):
        x = torch.randn(3, 4, device=device)
        torch.testing.assert_close(g(x), step(ref, ref_opt, x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.weight, ref.weight, rtol=1e-5, atol=1e-5)
