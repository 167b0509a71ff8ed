"""An argument that is, or is a view of, a module's buffer gives eager's results."""

import pytest
import torch

import autograph

from conftest import states

pytestmark = pytest.mark.usefixtures("caught")


def test_argument_aliasing_a_modules_buffer(device):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(4, device=device))

        def forward(self, x):
            self.acc.add_(x)
            return self.acc * 2 + x

    m = M()
    ref = M()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, device=device)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
        out = g(m.acc)  # the argument is the buffer itself
        want = ref(ref.acc)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(m.acc, ref.acc, rtol=0, atol=0)
        for _ in range(3):
            x = torch.randn(4, device=device)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(m.acc, ref.acc, rtol=0, atol=0)
    assert states(g)[0][0] == "graphed" and states(g)[0][3] >= 5, autograph.stats(g)


def test_argument_is_a_view_of_a_modules_buffer(device):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(8, device=device))

        def forward(self, x):
            self.acc[:4].add_(x)
            return self.acc * 2

    m, ref = M(), M()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, device=device)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
        torch.testing.assert_close(g(m.acc[4:]), ref(ref.acc[4:]), rtol=0, atol=0)
        torch.testing.assert_close(g(m.acc[:4]), ref(ref.acc[:4]), rtol=0, atol=0)
        for _ in range(2):
            x = torch.randn(4, device=device)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(m.acc, ref.acc, rtol=0, atol=0)
    assert states(g)[0][3] >= 3, autograph.stats(g)
